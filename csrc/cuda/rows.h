#pragma once
// Row listing, device-side value checks and the CUDA kernels that write whole rows (rows.cu); documented in
// ops/kernels.h.
#include <ATen/core/Tensor.h>

#include <string>

#include "common/row_selection.h"

namespace lmk_ops::cuda {

// What report_out_of_range prints before ", got V ...": a kernel argument, so the text travels by value.
struct RangeMessage {
  char expected[240];
  bool landmarks;  // "in row r (landmarks[r, c])" rather than "at [r, c]"
};

void check_range(const at::Tensor& values, int64_t lo, int64_t hi, const std::string& expected, bool landmarks);
void mean_backward(const at::Tensor& scaled, const RowSelection& rows, at::Tensor& grad_hidden);
void max_backward(const at::Tensor& grad, const at::Tensor& argmax, at::Tensor& grad_hidden);
void gather_forward(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out);
void gather_backward(const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden);

}  // namespace lmk_ops::cuda
