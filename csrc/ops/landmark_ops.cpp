// The landmark ops, for every device: landmark_mean (LMK pooling) and landmark_gather (one vector per
// landmark), with their backward ops, and landmark_positions (a landmark mask as positions).
#include <exception>
#include <string>
#include <tuple>

#include "common/checks.h"
#include "common/error.h"
#include "common/packed.h"
#include "common/tensor_ops.h"
#include "ops/kernels.h"
#include "ops/op_entry.h"
#include "ops/pooling.h"

namespace lmk_ops::ops {
namespace {

// The mean over the landmark rows only: the kernel reads those rows and nothing else, so the cost grows with the
// number of landmarks, not with L.
std::tuple<Tensor, Tensor> landmark_mean(const Tensor& hidden, const Tensor& landmarks, bool normalize,
                                         const std::optional<Tensor>& cu_seqlens,
                                         std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "landmark_mean";
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    return mean_of_rows(packed.batch_view(hidden), prepare_packed_landmarks(op, landmarks, packed, hidden), normalize);
  }
  check_hidden(op, hidden, max_seqlen);
  const RowSelection rows = prepare_landmarks(op, landmarks, hidden.size(0), hidden.size(1), hidden);
  return mean_of_rows(hidden, rows, normalize);
}

Tensor landmark_mean_backward(const Tensor& grad, const Tensor& landmarks, int64_t seq_len,
                              std::optional<ScalarType> dtype, const std::optional<Tensor>& cu_seqlens) {
  constexpr const char* op = "landmark_mean_backward";
  check_pooled_grad(op, grad);
  check_grad_dtype(op, dtype);
  LMK_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_grad(op, grad, seq_len, *cu_seqlens);
    if (landmarks.scalar_type() == ScalarType::Bool) {
      const Tensor selected = prepare_packed_landmark_mask(op, landmarks, packed, grad);
      const RowSelection rows = packed.selection(selected);
      return packed_mean_backward(grad, packed, rows, rows, dtype);
    }
    // The texts' listed rows as one list of absolute rows: each row is one text's, so the counts are per row.
    const Tensor rows = prepare_packed_positions(op, landmarks, packed, grad, Values::kTrusted);
    RowSelection listed = packed.selection(Tensor());
    listed.positions = torch::stable::view(rows, {1, rows.numel()});
    RowSelection counted;
    counted.positions = as_contiguous(landmarks);  // each text's entries >= 0
    return packed_mean_backward(grad, packed, listed, counted, dtype);
  }
  const RowSelection rows = prepare_landmarks(op, landmarks, grad.size(0), seq_len, grad, Values::kTrusted);
  return mean_of_rows_backward(grad, rows, seq_len, dtype);
}

Tensor landmark_gather(const Tensor& hidden, const Tensor& positions,
                       const std::optional<Tensor>& cu_seqlens) {
  constexpr const char* op = "landmark_gather";
  Tensor p, starts;  // starts: a packed batch's offsets, which the gather adds to the positions
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, std::nullopt);
    p = check_packed_positions(op, positions, packed, hidden);
    starts = packed.offsets;
  } else {
    check_hidden(op, hidden);
    p = prepare_positions(op, positions, hidden.size(0), hidden.size(1), hidden);
  }
  Tensor out = empty_on(hidden, {p.size(0), p.size(1), hidden.size(hidden.dim() - 1)}, hidden.scalar_type());
  if (out.numel() > 0) {
    kernels_for(hidden).gather_forward(hidden, p, starts, out);
  }
  return out;
}

Tensor landmark_gather_backward(const Tensor& grad, const Tensor& positions, int64_t seq_len,
                                const std::optional<Tensor>& cu_seqlens) {
  constexpr const char* op = "landmark_gather_backward";
  check_grad(op, grad, 3, "[B, K, D]");
  LMK_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  std::optional<PackedBatch> packed;
  if (cu_seqlens.has_value()) {
    packed = prepare_packed_grad(op, grad, seq_len, *cu_seqlens);
  }
  Tensor p = packed.has_value() ? prepare_packed_positions(op, positions, *packed, grad, Values::kTrusted)
                                    : prepare_positions(op, positions, grad.size(0), seq_len, grad, Values::kTrusted);
  LMK_CHECK(
      p.size(1) == grad.size(1), "lmk_ops.", op, ": expected grad_out of shape [B, K, D] with K = ", p.size(1),
      " (as positions), got ", shape_str(grad.sizes()));
  Tensor g = as_contiguous(grad);
  if (packed.has_value()) {
    // Every text's rows are its own, so the batch is one text listing all B * K absolute rows: each row still sums
    // its own text's gradient rows in k order, as the padded kernels do.
    g = torch::stable::view(g, {1, g.size(0) * g.size(1), g.size(2)});
    p = torch::stable::view(p, {1, p.numel()});
  }
  Tensor grad_hidden = empty_on(grad, {g.size(0), seq_len, grad.size(2)}, grad.scalar_type());
  if (grad_hidden.numel() > 0) {
    kernels_for(grad).gather_backward(g, p, grad_hidden);
  }
  return packed.has_value() ? torch::stable::view(grad_hidden, {seq_len, grad.size(2)}) : grad_hidden;
}

// The positions of each text's true entries of a bool landmark mask ([B, L], or [T] with cu_seqlens), in order,
// int64 [B, K] padded with -1, and each text's count of them [B]; a text with more than K is refused (on CUDA by a
// device-side assertion, without synchronising). Without K, only the counts (positions [B, 0]). One pass of
// find_rows on every device.
std::tuple<Tensor, Tensor> landmark_positions(const Tensor& mask, std::optional<int64_t> width,
                                              const std::optional<Tensor>& cu_seqlens, std::string op) {
  const char* name = op.c_str();
  const int64_t mask_dims = cu_seqlens.has_value() ? 1 : 2;
  LMK_CHECK(
      mask.scalar_type() == ScalarType::Bool && mask.dim() == mask_dims, "lmk_ops.", name,
      ": expected a bool landmark mask of shape ", mask_dims == 1 ? "[T]" : "[B, L]", ", got ", mask.scalar_type(),
      " of shape ", shape_str(mask.sizes()));
  const int64_t num_landmarks = width.value_or(0);
  LMK_CHECK(num_landmarks >= 0, "lmk_ops.", name, ": expected num_landmarks as an int in [0, 2**63) (or None), got ",
            num_landmarks);
  Tensor offsets;
  int64_t batch = 0, seq_len = 0;
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed(name, mask.size(0), mask, *cu_seqlens, std::nullopt, Values::kCheck,
                                              "the landmark mask's entries", PackedReads::kGivenOffsets);
    offsets = packed.offsets;
    batch = packed.batch;
  } else {
    batch = mask.size(0);
    seq_len = mask.size(1);
  }
  int64_t entries = 0;
  Tensor positions;
  try {
    LMK_CHECK(!__builtin_mul_overflow(batch, num_landmarks, &entries), batch, " x ", num_landmarks,
              " entries: more than an int64 counts");
    positions = empty_on(mask, {batch, num_landmarks}, ScalarType::Long);
  } catch (const std::exception& error) {  // a K far beyond any text's length: say so, not only the allocator
    const std::string why = failure_reason(error);
    fail("lmk_ops.", name, ": expected num_landmarks whose int64 positions [", batch,
         ", K] fit in memory, got num_landmarks = ", num_landmarks, " (", why.substr(0, why.find('\n')), ")");
  }
  Tensor counts = empty_on(mask, {batch}, ScalarType::Long);
  kernels_for(mask).find_rows(as_contiguous(mask), offsets, batch, seq_len, /*last=*/false, positions, counts);
  if (width.has_value() && batch > 0) {
    kernels_for(mask).check_range(counts, 0, num_landmarks, Tensor(),
                                  "lmk_ops." + op + ": expected at most num_landmarks = " +
                                      std::to_string(num_landmarks) + " landmarks per row",
                                  EntryName::kRow);
  }
  return {positions, counts};
}

void register_landmark_ops(torch::stable::detail::StableLibrary& m) {
  LMK_OPS_IMPL(m, "landmark_positions", landmark_positions);
  LMK_OPS_IMPL(m, "landmark_mean", landmark_mean);
  LMK_OPS_IMPL(m, "landmark_mean_backward", landmark_mean_backward);
  LMK_OPS_IMPL(m, "landmark_gather", landmark_gather);
  LMK_OPS_IMPL(m, "landmark_gather_backward", landmark_gather_backward);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_landmark_ops)

}  // namespace lmk_ops::ops
