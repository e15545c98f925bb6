#pragma once
// The CUDA kernels that write whole rows (rows.cu); documented in ops/kernels.h.
#include <ATen/core/Tensor.h>

#include "common/row_selection.h"

namespace lmk_ops::cuda {

void mean_backward(const at::Tensor& scaled, const RowSelection& rows, at::Tensor& grad_hidden);
void max_backward(const at::Tensor& grad, const at::Tensor& argmax, at::Tensor& grad_hidden);
void gather_forward(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out);
void gather_backward(const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden);

}  // namespace lmk_ops::cuda
