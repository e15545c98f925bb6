// mean_pool and max_pool, for every device: check inputs, allocate outputs, hand off to the device's kernels.
#include <limits>
#include <string>
#include <tuple>

#include "common/checks.h"
#include "common/device_name.h"
#include "common/error.h"
#include "common/packed.h"
#include "common/tensor_ops.h"
#include "ops/kernels.h"
#include "ops/op_entry.h"
#include "ops/pooling.h"

namespace lmk_ops::ops {
namespace {

std::tuple<Tensor, Tensor> mean_pool(const Tensor& hidden, const std::optional<Tensor>& mask,
                                     bool normalize, const std::optional<Tensor>& cu_seqlens,
                                     std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "mean_pool";
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    const Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    return mean_of_rows(packed.batch_view(hidden), packed.selection(valid), normalize);
  }
  check_hidden(op, hidden, max_seqlen);
  const RowSelection rows{prepare_mask(op, mask, hidden.size(0), hidden.size(1), hidden), Tensor()};
  return mean_of_rows(hidden, rows, normalize);
}

Tensor mean_pool_backward(
    const Tensor& grad, const std::optional<Tensor>& mask, int64_t seq_len,
    std::optional<ScalarType> dtype, const std::optional<Tensor>& cu_seqlens) {
  constexpr const char* op = "mean_pool_backward";
  check_pooled_grad(op, grad);
  check_grad_dtype(op, dtype);
  LMK_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_grad(op, grad, seq_len, *cu_seqlens);
    const Tensor valid = prepare_packed_mask(op, mask, packed, grad, Values::kTrusted);
    const RowSelection rows = packed.selection(valid);
    return packed_mean_backward(grad, packed, rows, rows, dtype);
  }
  const RowSelection rows{prepare_mask(op, mask, grad.size(0), seq_len, grad, Values::kTrusted), Tensor()};
  return mean_of_rows_backward(grad, rows, seq_len, dtype);
}

// result, or a copy of it where it shares input's memory: an op's output must not alias its input.
Tensor fresh(const Tensor& result, const Tensor& input) {
  return result.data_ptr() == input.data_ptr() ? torch::stable::clone(result) : result;
}

// The int32 limit of the saved argmax, checked for a text's (padded) or the packed batch's row count.
void check_argmax_rows(const char* op, const char* name, int64_t rows) {
  LMK_CHECK(
      rows <= std::numeric_limits<int32_t>::max(), "lmk_ops.", op,
      ": expected at most 2^31 - 1 tokens per text (positions are saved as int32), got ", name, " = ", rows);
}

std::tuple<Tensor, Tensor, Tensor> max_of_rows(const Tensor& hidden, const RowSelection& rows,
                                               bool normalize) {
  const int64_t batch = hidden.size(0), dim = hidden.size(2);
  Tensor out, argmax;
  if (is_empty_pool(hidden)) {
    out = zeros_on(hidden, {batch, dim}, hidden.scalar_type());
    argmax = full_on(hidden, {batch, dim}, -1, ScalarType::Int);
  } else {
    out = empty_on(hidden, {batch, dim}, hidden.scalar_type());
    argmax = empty_on(hidden, {batch, dim}, ScalarType::Int);
    kernels_for(hidden).max_forward(hidden, rows, out, argmax);
  }
  // The maxima are input values, exact in hidden's dtype: normalising them afterwards loses nothing.
  auto [finished, pooled] = finish_pooled(out, hidden.scalar_type(), normalize);
  return {finished, argmax, pooled};
}

std::tuple<Tensor, Tensor, Tensor> max_pool(const Tensor& hidden, const std::optional<Tensor>& mask,
                                            bool normalize, const std::optional<Tensor>& cu_seqlens,
                                            std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "max_pool";
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    check_argmax_rows(op, "T", packed.tokens);
    const Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    auto [out, rows, pooled] =
        max_of_rows(packed.batch_view(hidden), packed.selection(valid), normalize);
    // The kernels found absolute rows of hidden; the op returns positions from each text's start.
    return {out, packed.relative(rows), pooled};
  }
  check_hidden(op, hidden, max_seqlen);
  check_argmax_rows(op, "L", hidden.size(1));
  return max_of_rows(hidden, {prepare_mask(op, mask, hidden.size(0), hidden.size(1), hidden), Tensor()},
                     normalize);
}

Tensor max_pool_backward(const Tensor& grad, const Tensor& argmax, int64_t seq_len,
                         const std::optional<Tensor>& cu_seqlens) {
  constexpr const char* op = "max_pool_backward";
  check_pooled_grad(op, grad);
  LMK_CHECK(
      argmax.device() == grad.device(), "lmk_ops.", op, ": expected argmax on the same device as grad_out (",
      device_name(grad), "), got ", device_name(argmax));
  LMK_CHECK(
      argmax.scalar_type() == ScalarType::Int && same_sizes(argmax.sizes(), grad.sizes()), "lmk_ops.", op,
      ": expected argmax of dtype int32 and shape ", shape_str(grad.sizes()), " (as max_pool returns), got ",
      argmax.scalar_type(), " of shape ", shape_str(argmax.sizes()));
  LMK_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  // argmax is what max_pool produced, so its values are trusted (the kernels only compare them with row indices).
  // A packed batch's rows are written by the padded batch's kernel as runs: [1, T, D], each row its own text's.
  Tensor offsets;
  if (cu_seqlens.has_value()) {
    offsets = prepare_packed_grad(op, grad, seq_len, *cu_seqlens).offsets;
  }
  const int64_t batch = offsets.defined() ? 1 : grad.size(0);
  Tensor grad_hidden = empty_on(grad, {batch, seq_len, grad.size(1)}, grad.scalar_type());
  if (grad_hidden.numel() > 0) {
    kernels_for(grad).max_backward(as_contiguous(grad), as_contiguous(argmax), offsets, grad_hidden);
  }
  return offsets.defined() ? torch::stable::view(grad_hidden, {seq_len, grad.size(1)}) : grad_hidden;
}

Tensor valid_mask(const Tensor& mask, std::string op) {
  LMK_CHECK(
      mask.dim() == 1 || mask.dim() == 2, "lmk_ops.", op, ": expected mask of shape [B, L] (or [T], packed), got ",
      shape_str(mask.sizes()));
  return fresh(mask_as_bool(op.c_str(), mask, Values::kCheck), mask);
}

Tensor packed_offsets(const Tensor& cu_seqlens, int64_t tokens, std::optional<int64_t> max_seqlen, std::string op) {
  LMK_CHECK(tokens >= 0, "lmk_ops.", op, ": expected T >= 0 rows, got ", tokens);
  return prepare_packed(op.c_str(), tokens, cu_seqlens, cu_seqlens, max_seqlen, Values::kCheck, "hidden's rows",
                        PackedReads::kOffsets)
      .offsets;  // a new tensor
}

void register_pool_ops(torch::stable::detail::StableLibrary& m) {
  LMK_OPS_IMPL(m, "valid_mask", valid_mask);
  LMK_OPS_IMPL(m, "packed_offsets", packed_offsets);
  LMK_OPS_IMPL(m, "mean_pool", mean_pool);
  LMK_OPS_IMPL(m, "mean_pool_backward", mean_pool_backward);
  LMK_OPS_IMPL(m, "max_pool", max_pool);
  LMK_OPS_IMPL(m, "max_pool_backward", max_pool_backward);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_pool_ops)

}  // namespace lmk_ops::ops
