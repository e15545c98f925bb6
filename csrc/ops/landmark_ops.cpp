// The landmark ops, for every device: landmark_mean (LMK pooling) and landmark_gather (one vector per
// landmark), with their backward ops.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "common/checks.h"
#include "ops/kernels.h"
#include "ops/pooling.h"

namespace lmk_ops::ops {
namespace {

// The mean over the landmark rows only: the kernel reads those rows and nothing else, so the cost grows with the
// number of landmarks, not with L.
std::tuple<at::Tensor, at::Tensor> landmark_mean(const at::Tensor& hidden, const at::Tensor& landmarks, bool normalize) {
  constexpr const char* op = "landmark_mean";
  check_hidden(op, hidden);
  const RowSelection rows = prepare_landmarks(op, landmarks, hidden.size(0), hidden.size(1), hidden);
  return mean_of_rows(hidden, rows, normalize);
}

at::Tensor landmark_mean_backward(
    const at::Tensor& grad, const at::Tensor& landmarks, int64_t seq_len, std::optional<at::ScalarType> dtype) {
  constexpr const char* op = "landmark_mean_backward";
  check_pooled_grad(op, grad);
  check_grad_dtype(op, dtype);
  TORCH_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  const RowSelection rows = prepare_landmarks(op, landmarks, grad.size(0), seq_len, grad, Values::kTrusted);
  return mean_of_rows_backward(grad, rows, seq_len, dtype);
}

at::Tensor landmark_gather(const at::Tensor& hidden, const at::Tensor& positions) {
  constexpr const char* op = "landmark_gather";
  check_hidden(op, hidden);
  const at::Tensor p = prepare_positions(op, positions, hidden.size(0), hidden.size(1), hidden);
  at::Tensor out = at::empty({hidden.size(0), p.size(1), hidden.size(2)}, hidden.options());
  if (out.numel() > 0) {
    kernels_for(hidden).gather_forward(hidden, p, out);
  }
  return out;
}

at::Tensor landmark_gather_backward(const at::Tensor& grad, const at::Tensor& positions, int64_t seq_len) {
  constexpr const char* op = "landmark_gather_backward";
  check_grad(op, grad, 3, "[B, K, D]");
  TORCH_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  const at::Tensor p = prepare_positions(op, positions, grad.size(0), seq_len, grad, Values::kTrusted);
  TORCH_CHECK(
      p.size(1) == grad.size(1), "lmk_ops.", op, ": expected grad_out of shape [B, K, D] with K = ", p.size(1),
      " (as positions), got ", shape_str(grad.sizes()));
  at::Tensor grad_hidden = at::empty({grad.size(0), seq_len, grad.size(2)}, grad.options());
  if (grad_hidden.numel() > 0) {
    kernels_for(grad).gather_backward(grad.contiguous(), p, grad_hidden);
  }
  return grad_hidden;
}

void register_landmark_ops(torch::Library& m) {
  m.impl("landmark_mean", &landmark_mean);
  m.impl("landmark_mean_backward", &landmark_mean_backward);
  m.impl("landmark_gather", &landmark_gather);
  m.impl("landmark_gather_backward", &landmark_gather_backward);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_landmark_ops)

}  // namespace lmk_ops::ops
