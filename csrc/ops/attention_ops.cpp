// attention_pool and its backward, for every device: check inputs, allocate outputs, hand off to the device's
// kernels.
#include <limits>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/packed.h"
#include "common/tensor_ops.h"
#include "ops/kernels.h"
#include "ops/op_entry.h"

namespace lmk_ops::ops {
namespace {

// The query as the kernels take it: [H, D / H], contiguous, in the accumulation type of hidden's dtype.
Tensor wide_query(const Tensor& query, const Heads& heads, ScalarType acc) {
  return as_contiguous(to_dtype(torch::stable::reshape(query, {heads.count, heads.dim}), acc));
}

// The rows the attention kernels take: a padded batch's valid mask, or a packed batch's lists.
AttentionRows padded_rows(const Tensor& valid) {
  return {{valid, Tensor()}, valid};
}

AttentionRows packed_rows(const PackedBatch& packed, const Tensor& valid) {
  return {packed.selection(valid), valid};
}

std::tuple<Tensor, Tensor, Tensor> attention_forward(const Tensor& hidden, const AttentionRows& rows,
                                                     const Tensor& query, const Heads& heads, double scale,
                                                     bool return_weights) {
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const ScalarType acc = acc_dtype(hidden.scalar_type());
  const std::vector<int64_t> stats_shape{batch, heads.count, 2};
  const std::vector<int64_t> weights_shape =
      rows.packed() ? std::vector<int64_t>{heads.count, seq_len} : std::vector<int64_t>{batch, heads.count, seq_len};
  Tensor weights = return_weights ? zeros_on(hidden, weights_shape, acc) : empty_on(hidden, {0}, acc);
  if (batch == 0 || seq_len == 0) {  // no text has a valid row
    return {zeros_on(hidden, {batch, dim}, hidden.scalar_type()),
            full_on(hidden, stats_shape, -std::numeric_limits<double>::infinity(), ScalarType::Double), weights};
  }
  // The kernels write every text's statistics, -inf for a text with no valid row.
  Tensor stats = empty_on(hidden, stats_shape, ScalarType::Double);
  Tensor out = empty_on(hidden, {batch, dim}, hidden.scalar_type());
  Tensor kernel_weights = return_weights ? weights : Tensor();
  kernels_for(hidden).attention_forward(hidden, rows, wide_query(query, heads, acc), scale, out, stats,
                                        kernel_weights);
  return {out, stats, weights};
}

// hidden with contiguous features: the score dot products add in a different order on the vectorised (contiguous)
// and the strided path, so reading strided features from a copy keeps a text's bits independent of the strides.
// (Before the checks: anything they would refuse passes through as it came.)
Tensor unit_feature_stride(const Tensor& hidden) {
  return hidden.defined() && hidden.dim() > 0 && hidden.stride(hidden.dim() - 1) != 1 ? as_contiguous(hidden) : hidden;
}

std::tuple<Tensor, Tensor, Tensor> attention_pool(const Tensor& hidden_in, const std::optional<Tensor>& mask,
                                                  const Tensor& query, std::optional<double> scale, bool return_weights,
                                                  const std::optional<Tensor>& cu_seqlens,
                                                  std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "attention_pool";
  const Tensor hidden = unit_feature_stride(hidden_in);
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    const Heads heads = check_query(op, query, hidden);
    const double s = resolve_scale(op, scale, heads.dim);
    const Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    const Tensor view = packed.batch_view(hidden);
    return attention_forward(view, packed_rows(packed, valid), query, heads, s, return_weights);
  }
  check_hidden(op, hidden, max_seqlen);
  const Heads heads = check_query(op, query, hidden);
  const double s = resolve_scale(op, scale, heads.dim);
  const Tensor valid = prepare_mask(op, mask, hidden.size(0), hidden.size(1), hidden);
  return attention_forward(hidden, padded_rows(valid), query, heads, s, return_weights);
}

// The backward of a batch as the kernels take it; grad_hidden [B, L, D], or [T, D] for packed rows.
std::tuple<Tensor, Tensor> attention_backward(const Tensor& grad, const Tensor& grad_weights, const Tensor& hidden,
                                              const AttentionRows& rows, const Tensor& query, const Heads& heads,
                                              const Tensor& out, const Tensor& stats, double scale) {
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const ScalarType acc = acc_dtype(hidden.scalar_type());
  Tensor grad_hidden = rows.packed() ? empty_on(hidden, {seq_len, dim}, hidden.scalar_type())
                                     : empty_on(hidden, {batch, seq_len, dim}, hidden.scalar_type());
  Tensor grad_query = zeros_on(hidden, {heads.count, heads.dim}, acc);
  if (grad_hidden.numel() > 0) {
    const auto wide = [&](const Tensor& t, ScalarType dtype) { return as_contiguous(to_dtype(t, dtype)); };
    const Tensor wide_grad_weights = grad_weights.defined() ? wide(grad_weights, acc) : Tensor();
    kernels_for(hidden).attention_backward(wide(grad, acc), wide_grad_weights, hidden, rows,
                                           wide_query(query, heads, acc), wide(out, acc),
                                           wide(stats, ScalarType::Double), scale, grad_hidden, grad_query);
  }
  return {grad_hidden, to_dtype(torch::stable::reshape(grad_query, query.sizes()), query.scalar_type())};
}

// The saved tensors and gradients the backward takes, for a batch of `batch` texts of `dim` features whose
// weights have weights_shape ([B, H, L], packed [H, T]).
void check_backward_inputs(const char* op, const Tensor& grad, const Tensor& grad_weights, const Tensor& out,
                           const Tensor& stats, int64_t batch, int64_t dim, const Heads& heads, Sizes weights_shape,
                           const Tensor& hidden) {
  check_float_tensor(op, "grad_out", grad, {batch, dim}, hidden);
  check_float_tensor(op, "out", out, {batch, dim}, hidden);
  check_float_tensor(op, "stats", stats, {batch, heads.count, 2}, hidden);
  if (grad_weights.defined()) {
    check_float_tensor(op, "grad_weights", grad_weights, weights_shape, hidden);
  }
}

std::tuple<Tensor, Tensor> attention_pool_backward(
    const Tensor& grad, const std::optional<Tensor>& grad_weights_in, const Tensor& hidden_in,
    const std::optional<Tensor>& mask, const Tensor& query, const Tensor& out, const Tensor& stats,
    std::optional<double> scale, const std::optional<Tensor>& cu_seqlens, std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "attention_pool_backward";
  const Tensor hidden = unit_feature_stride(hidden_in);
  const Tensor gw = grad_weights_in.has_value() ? *grad_weights_in : Tensor();
  if (cu_seqlens.has_value()) {
    // The offsets checked as the forward checks them: CUDA's backward kernels take each text's rows from them.
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    const Tensor view = packed.batch_view(hidden);
    const Heads heads = check_query(op, query, hidden);
    const double s = resolve_scale(op, scale, heads.dim);
    const int64_t batch = packed.batch, dim = hidden.size(1);
    check_backward_inputs(op, grad, gw, out, stats, batch, dim, heads, {heads.count, packed.tokens}, hidden);
    const Tensor valid = prepare_packed_mask(op, mask, packed, hidden, Values::kTrusted);
    return attention_backward(grad, gw, view, packed_rows(packed, valid), query, heads, out, stats, s);
  }
  check_hidden(op, hidden, max_seqlen);
  const Heads heads = check_query(op, query, hidden);
  const double s = resolve_scale(op, scale, heads.dim);
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  check_backward_inputs(op, grad, gw, out, stats, batch, dim, heads, {batch, heads.count, seq_len}, hidden);
  const Tensor valid = prepare_mask(op, mask, batch, seq_len, hidden, Values::kTrusted);
  return attention_backward(grad, gw, hidden, padded_rows(valid), query, heads, out, stats, s);
}

void register_attention_ops(torch::stable::detail::StableLibrary& m) {
  LMK_OPS_IMPL(m, "attention_pool", attention_pool);
  LMK_OPS_IMPL(m, "attention_pool_backward", attention_pool_backward);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_attention_ops)

}  // namespace lmk_ops::ops
