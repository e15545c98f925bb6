#pragma once
// CPU kernels that write whole rows (the mean backward and landmark gather, forward and backward). Plain loops
// over rows with memcpy/memset: compiled once, not per CPU capability. Documented in ops/kernels.h.
#include <ATen/core/Tensor.h>

#include "common/row_selection.h"

namespace lmk_ops::cpu {

void mean_backward(const at::Tensor& scaled, const RowSelection& rows, at::Tensor& grad_hidden);
void gather_forward(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out);
void gather_backward(const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden);

}  // namespace lmk_ops::cpu
