#pragma once
// CPU kernels that write whole rows (the mean backward and landmark gather, forward and backward), and the value
// check. Plain loops over rows with memcpy/memset: compiled once, not per CPU capability. Documented in
// ops/kernels.h.
#include <ATen/core/Tensor.h>

#include <string>

#include "common/row_selection.h"
#include "cpu/row_list.h"

namespace lmk_ops::cpu {

void check_range(const at::Tensor& values, int64_t lo, int64_t hi, const std::string& expected, bool landmarks);
void mean_backward(const at::Tensor& scaled, const RowSelection& rows, at::Tensor& grad_hidden);
void gather_forward(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out);
void gather_backward(const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden);

}  // namespace lmk_ops::cpu
