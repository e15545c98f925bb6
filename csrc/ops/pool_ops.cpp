// mean_pool and max_pool, for every device: check inputs, allocate outputs, hand off to the device's kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <tuple>

#include "common/checks.h"
#include "common/device_name.h"
#include "common/error.h"
#include "common/packed.h"
#include "ops/kernels.h"
#include "ops/pooling.h"

namespace lmk_ops::ops {
namespace {

std::tuple<at::Tensor, at::Tensor> mean_pool(const at::Tensor& hidden, const std::optional<at::Tensor>& mask,
                                             bool normalize, const std::optional<at::Tensor>& cu_seqlens,
                                             std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "mean_pool";
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    const at::Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    return mean_of_rows(packed.batch_view(hidden), packed.selection(valid), normalize);
  }
  check_hidden(op, hidden);
  const RowSelection rows{prepare_mask(op, mask, hidden.size(0), hidden.size(1), hidden), at::Tensor()};
  return mean_of_rows(hidden, rows, normalize);
}

at::Tensor mean_pool_backward(
    const at::Tensor& grad, const std::optional<at::Tensor>& mask, int64_t seq_len,
    std::optional<at::ScalarType> dtype, const std::optional<at::Tensor>& cu_seqlens) {
  constexpr const char* op = "mean_pool_backward";
  check_pooled_grad(op, grad);
  check_grad_dtype(op, dtype);
  LMK_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_grad(op, grad, seq_len, *cu_seqlens);
    const at::Tensor valid = prepare_packed_mask(op, mask, packed, grad, Values::kTrusted);
    return packed_mean_backward(grad, packed, valid, valid.defined() ? packed.count(valid) : packed.lengths, dtype);
  }
  const RowSelection rows{prepare_mask(op, mask, grad.size(0), seq_len, grad, Values::kTrusted), at::Tensor()};
  return mean_of_rows_backward(grad, rows, seq_len, dtype);
}

// The int32 limit of the saved argmax, checked for a text's (padded) or the packed batch's row count.
void check_argmax_rows(const char* op, const char* name, int64_t rows) {
  LMK_CHECK(
      rows <= std::numeric_limits<int32_t>::max(), "lmk_ops.", op,
      ": expected at most 2^31 - 1 tokens per text (positions are saved as int32), got ", name, " = ", rows);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> max_of_rows(const at::Tensor& hidden, const RowSelection& rows,
                                                           bool normalize) {
  const int64_t batch = hidden.size(0), dim = hidden.size(2);
  at::Tensor out, argmax;
  if (is_empty_pool(hidden)) {
    out = at::zeros({batch, dim}, hidden.options());
    argmax = at::full({batch, dim}, -1, hidden.options().dtype(at::kInt));
  } else {
    out = at::empty({batch, dim}, hidden.options());
    argmax = at::empty({batch, dim}, hidden.options().dtype(at::kInt));
    kernels_for(hidden).max_forward(hidden, rows, out, argmax);
  }
  // The maxima are input values, exact in hidden's dtype: normalising them afterwards loses nothing.
  auto [finished, pooled] = finish_pooled(out, hidden.scalar_type(), normalize);
  return {finished, argmax, pooled};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> max_pool(const at::Tensor& hidden, const std::optional<at::Tensor>& mask,
                                                        bool normalize, const std::optional<at::Tensor>& cu_seqlens,
                                                        std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "max_pool";
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    check_argmax_rows(op, "T", packed.tokens);
    const at::Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    auto [out, rows, pooled] =
        max_of_rows(packed.batch_view(hidden), packed.selection(valid), normalize);
    // The kernels found absolute rows of hidden; the op returns positions from each text's start.
    return {out, packed.relative(rows), pooled};
  }
  check_hidden(op, hidden);
  check_argmax_rows(op, "L", hidden.size(1));
  return max_of_rows(hidden, {prepare_mask(op, mask, hidden.size(0), hidden.size(1), hidden), at::Tensor()},
                     normalize);
}

at::Tensor max_pool_backward(const at::Tensor& grad, const at::Tensor& argmax, int64_t seq_len,
                             const std::optional<at::Tensor>& cu_seqlens) {
  constexpr const char* op = "max_pool_backward";
  check_pooled_grad(op, grad);
  LMK_CHECK(
      argmax.device() == grad.device(), "lmk_ops.", op, ": expected argmax on the same device as grad_out (",
      device_name(grad), "), got ", device_name(argmax));
  LMK_CHECK(
      argmax.scalar_type() == at::kInt && argmax.sizes() == grad.sizes(), "lmk_ops.", op,
      ": expected argmax of dtype int32 and shape ", shape_str(grad.sizes()), " (as max_pool returns), got ",
      argmax.scalar_type(), " of shape ", shape_str(argmax.sizes()));
  LMK_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  // argmax is what max_pool produced, so its values are trusted (the kernels only compare them with row indices).
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_grad(op, grad, seq_len, *cu_seqlens);
    // Each text's maxima go to rows of its own, so no two texts write one element; a text with none writes into a
    // spare last row, dropped after.
    const at::Tensor rows = packed.absolute(argmax.to(at::kLong));
    at::Tensor grad_hidden = at::zeros({seq_len + 1, grad.size(1)}, grad.options());
    grad_hidden.scatter_(0, at::where(rows.ge(0), rows, seq_len), grad);
    return grad_hidden.narrow(0, 0, seq_len);
  }
  at::Tensor grad_hidden = at::empty({grad.size(0), seq_len, grad.size(1)}, grad.options());
  if (grad_hidden.numel() == 0) {
    return grad_hidden;
  }
  kernels_for(grad).max_backward(grad.contiguous(), argmax.contiguous(), grad_hidden);
  return grad_hidden;
}

at::Tensor valid_mask(const at::Tensor& mask, c10::string_view op_name) {
  const std::string op(op_name);
  LMK_CHECK(mask.dim() == 2, "lmk_ops.", op, ": expected mask of shape [B, L], got ", shape_str(mask.sizes()));
  const at::Tensor valid = prepare_mask(op.c_str(), mask, mask.size(0), mask.size(1), mask);
  // A fresh tensor, never the input itself (an op's output must not alias its input).
  return valid.is_same(mask) || valid.data_ptr() == mask.data_ptr() ? valid.clone() : valid;
}

at::Tensor packed_offsets(const at::Tensor& cu_seqlens, int64_t tokens, std::optional<int64_t> max_seqlen,
                          c10::string_view op_name) {
  const std::string op(op_name);
  LMK_CHECK(tokens >= 0, "lmk_ops.", op, ": expected T >= 0 rows, got ", tokens);
  const PackedBatch packed = prepare_packed(op.c_str(), tokens, cu_seqlens, cu_seqlens, max_seqlen);
  return packed.offsets.is_same(cu_seqlens) ? packed.offsets.clone() : packed.offsets;
}

void register_pool_ops(torch::Library& m) {
  m.impl("valid_mask", &valid_mask);
  m.impl("packed_offsets", &packed_offsets);
  m.impl("mean_pool", &mean_pool);
  m.impl("mean_pool_backward", &mean_pool_backward);
  m.impl("max_pool", &max_pool);
  m.impl("max_pool_backward", &max_pool_backward);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_pool_ops)

}  // namespace lmk_ops::ops
