#pragma once
// CPU kernels that write whole rows (the mean backward and landmark gather, forward and backward), and the value
// check. Plain loops over rows with memcpy/memset: compiled once, not per CPU capability. Documented in
// common/kernel_types.h.
#include <string>

#include "cpu/kernel_types.h"
#include "cpu/row_list.h"

namespace lmk_ops::cpu {

void check_range(const Tensor& values, int64_t lo, int64_t hi, const std::string& expected, EntryName naming);
void mean_backward(const Tensor& scaled, const RowSelection& rows, Tensor& grad_hidden);
void gather_forward(const Tensor& hidden, const Tensor& positions, Tensor& out);
void gather_backward(const Tensor& grad, const Tensor& positions, Tensor& grad_hidden);

}  // namespace lmk_ops::cpu
