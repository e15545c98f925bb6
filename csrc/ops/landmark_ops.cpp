// The landmark ops, for every device: landmark_mean (LMK pooling) and landmark_gather (one vector per
// landmark), with their backward ops.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "common/checks.h"
#include "common/error.h"
#include "common/packed.h"
#include "ops/kernels.h"
#include "ops/pooling.h"

namespace lmk_ops::ops {
namespace {

// The mean over the landmark rows only: the kernel reads those rows and nothing else, so the cost grows with the
// number of landmarks, not with L.
std::tuple<at::Tensor, at::Tensor> landmark_mean(const at::Tensor& hidden, const at::Tensor& landmarks, bool normalize,
                                                 const std::optional<at::Tensor>& cu_seqlens,
                                                 std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "landmark_mean";
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    return mean_of_rows(packed.batch_view(hidden), prepare_packed_landmarks(op, landmarks, packed, hidden), normalize);
  }
  check_hidden(op, hidden);
  const RowSelection rows = prepare_landmarks(op, landmarks, hidden.size(0), hidden.size(1), hidden);
  return mean_of_rows(hidden, rows, normalize);
}

at::Tensor landmark_mean_backward(const at::Tensor& grad, const at::Tensor& landmarks, int64_t seq_len,
                                  std::optional<at::ScalarType> dtype, const std::optional<at::Tensor>& cu_seqlens) {
  constexpr const char* op = "landmark_mean_backward";
  check_pooled_grad(op, grad);
  check_grad_dtype(op, dtype);
  LMK_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_grad(op, grad, seq_len, *cu_seqlens);
    if (landmarks.scalar_type() == at::kBool) {
      const at::Tensor selected = prepare_packed_landmark_mask(op, landmarks, packed, grad);
      return packed_mean_backward(grad, packed, selected, packed.count(selected), dtype);
    }
    const at::Tensor rows = prepare_packed_positions(op, landmarks, packed, grad, Values::kTrusted);
    return packed_mean_backward(grad, packed, times_listed(rows, seq_len), landmarks.ge(0).sum(1), dtype);
  }
  const RowSelection rows = prepare_landmarks(op, landmarks, grad.size(0), seq_len, grad, Values::kTrusted);
  return mean_of_rows_backward(grad, rows, seq_len, dtype);
}

at::Tensor landmark_gather(const at::Tensor& hidden, const at::Tensor& positions,
                           const std::optional<at::Tensor>& cu_seqlens) {
  constexpr const char* op = "landmark_gather";
  at::Tensor view, p;
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, std::nullopt);
    p = prepare_packed_positions(op, positions, packed, hidden);
    view = packed.batch_view(hidden);
  } else {
    check_hidden(op, hidden);
    p = prepare_positions(op, positions, hidden.size(0), hidden.size(1), hidden);
    view = hidden;
  }
  at::Tensor out = at::empty({view.size(0), p.size(1), view.size(2)}, hidden.options());
  if (out.numel() > 0) {
    kernels_for(hidden).gather_forward(view, p, out);
  }
  return out;
}

at::Tensor landmark_gather_backward(const at::Tensor& grad, const at::Tensor& positions, int64_t seq_len,
                                    const std::optional<at::Tensor>& cu_seqlens) {
  constexpr const char* op = "landmark_gather_backward";
  check_grad(op, grad, 3, "[B, K, D]");
  LMK_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  std::optional<PackedBatch> packed;
  if (cu_seqlens.has_value()) {
    packed = prepare_packed_grad(op, grad, seq_len, *cu_seqlens);
  }
  at::Tensor p = packed.has_value() ? prepare_packed_positions(op, positions, *packed, grad, Values::kTrusted)
                                    : prepare_positions(op, positions, grad.size(0), seq_len, grad, Values::kTrusted);
  LMK_CHECK(
      p.size(1) == grad.size(1), "lmk_ops.", op, ": expected grad_out of shape [B, K, D] with K = ", p.size(1),
      " (as positions), got ", shape_str(grad.sizes()));
  at::Tensor g = grad.contiguous();
  if (packed.has_value()) {
    // Every text's rows are its own, so the batch is one text listing all B * K absolute rows: each row still sums
    // its own text's gradient rows in k order, as the padded kernels do.
    g = g.view({1, g.size(0) * g.size(1), g.size(2)});
    p = p.view({1, p.numel()});
  }
  at::Tensor grad_hidden = at::empty({g.size(0), seq_len, grad.size(2)}, grad.options());
  if (grad_hidden.numel() > 0) {
    kernels_for(grad).gather_backward(g, p, grad_hidden);
  }
  return packed.has_value() ? grad_hidden.view({seq_len, grad.size(2)}) : grad_hidden;
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
