// attention_pool and its backward, for every device: check inputs, allocate outputs, hand off to the device's
// kernels.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/packed.h"
#include "ops/kernels.h"

namespace lmk_ops::ops {
namespace {

// The query as the kernels take it: [H, D / H], contiguous, in the accumulation type of hidden's dtype.
at::Tensor wide_query(const at::Tensor& query, const Heads& heads, at::ScalarType acc) {
  return query.reshape({heads.count, heads.dim}).to(acc).contiguous();
}

// A packed batch copied into padded form [B, W, D] (W the longest text), for the devices whose attention kernels
// take padded batches only (CUDA, for now): row t of the packed batch is row slot[t] of the padded one flattened to
// [B * W, D]. The padded kernels then give each text the same bits as a padded batch would.
struct PaddedCopy {
  at::Tensor hidden, valid, slot;
};

PaddedCopy pad_packed(const at::Tensor& hidden, const PackedBatch& packed, const at::Tensor& valid) {
  const int64_t width = packed.width(), rows = packed.batch * width;
  const at::Tensor text = packed.text_of_rows();
  const at::Tensor slot = text * width + at::arange(packed.tokens, text.options()) - packed.starts.index_select(0, text);
  at::Tensor padded = at::zeros({rows, hidden.size(1)}, hidden.options()).index_copy_(0, slot, hidden);
  at::Tensor padded_valid = at::zeros({rows}, hidden.options().dtype(at::kBool))
                                .index_copy_(0, slot, valid.defined() ? valid : at::ones({packed.tokens}, slot.options())
                                                                                    .to(at::kBool));
  return {padded.view({packed.batch, width, hidden.size(1)}), padded_valid.view({packed.batch, width}), slot};
}

// The rows the attention kernels take: a padded batch's valid mask, or a packed batch's lists.
AttentionRows padded_rows(const at::Tensor& valid) {
  return {{valid, at::Tensor()}, valid, at::Tensor()};
}

AttentionRows packed_rows(const PackedBatch& packed, const at::Tensor& valid) {
  return {packed.selection(valid), valid, packed.text_of_rows()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(const at::Tensor& hidden, const AttentionRows& rows,
                                                                 const at::Tensor& query, const Heads& heads,
                                                                 double scale, bool return_weights) {
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const at::ScalarType acc = at::toOpMathType(hidden.scalar_type());
  at::Tensor stats = at::full(
      {batch, heads.count, 2}, -std::numeric_limits<double>::infinity(), hidden.options().dtype(at::kDouble));
  const std::vector<int64_t> weights_shape =
      rows.packed() ? std::vector<int64_t>{heads.count, seq_len} : std::vector<int64_t>{batch, heads.count, seq_len};
  at::Tensor weights = return_weights ? at::zeros(weights_shape, hidden.options().dtype(acc))
                                      : at::empty({0}, hidden.options().dtype(acc));
  if (batch == 0 || seq_len == 0) {
    return {at::zeros({batch, dim}, hidden.options()), stats, weights};
  }
  at::Tensor out = at::empty({batch, dim}, hidden.options());
  at::Tensor kernel_weights = return_weights ? weights : at::Tensor();
  kernels_for(hidden).attention_forward(hidden, rows, wide_query(query, heads, acc), scale, out, stats,
                                        kernel_weights);
  return {out, stats, weights};
}

// hidden with contiguous features: the score dot products add in a different order on the vectorised (contiguous)
// and the strided path, so reading strided features from a copy keeps a text's bits independent of the strides.
// (Before the checks: anything they would refuse passes through as it came.)
at::Tensor unit_feature_stride(const at::Tensor& hidden) {
  return hidden.defined() && hidden.dim() > 0 && hidden.stride(-1) != 1 ? hidden.contiguous() : hidden;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_pool(
    const at::Tensor& hidden_in, const std::optional<at::Tensor>& mask, const at::Tensor& query,
    std::optional<double> scale, bool return_weights, const std::optional<at::Tensor>& cu_seqlens,
    std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "attention_pool";
  const at::Tensor hidden = unit_feature_stride(hidden_in);
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    const at::Tensor view = packed.batch_view(hidden);
    const Heads heads = check_query(op, query, view);
    const double s = resolve_scale(op, scale, heads.dim);
    const at::Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    if (hidden.is_cpu()) {
      return attention_forward(view, packed_rows(packed, valid), query, heads, s, return_weights);
    }
    const PaddedCopy copy = pad_packed(hidden, packed, valid);
    auto [out, stats, weights] = attention_forward(copy.hidden, padded_rows(copy.valid), query, heads, s,
                                                   return_weights);
    if (return_weights) {  // [B, H, W] to [H, T]
      weights = weights.transpose(0, 1).reshape({heads.count, -1}).index_select(1, copy.slot);
    }
    return {out, stats, weights};
  }
  check_hidden(op, hidden);
  const Heads heads = check_query(op, query, hidden);
  const double s = resolve_scale(op, scale, heads.dim);
  const at::Tensor valid = prepare_mask(op, mask, hidden.size(0), hidden.size(1), hidden);
  return attention_forward(hidden, padded_rows(valid), query, heads, s, return_weights);
}

// The backward of a batch as the kernels take it; grad_hidden [B, L, D], or [T, D] for packed rows.
std::tuple<at::Tensor, at::Tensor> attention_backward(const at::Tensor& grad, const at::Tensor& grad_weights,
                                                      const at::Tensor& hidden, const AttentionRows& rows,
                                                      const at::Tensor& query, const Heads& heads, const at::Tensor& out,
                                                      const at::Tensor& stats, double scale) {
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const at::ScalarType acc = at::toOpMathType(hidden.scalar_type());
  at::Tensor grad_hidden = rows.packed() ? at::empty({seq_len, dim}, hidden.options())
                                         : at::empty({batch, seq_len, dim}, hidden.options());
  at::Tensor grad_query = at::zeros({heads.count, heads.dim}, hidden.options().dtype(acc));
  if (grad_hidden.numel() > 0) {
    const at::Tensor wide_grad_weights = grad_weights.defined() ? grad_weights.to(acc).contiguous() : at::Tensor();
    kernels_for(hidden).attention_backward(
        grad.to(acc).contiguous(), wide_grad_weights, hidden, rows, wide_query(query, heads, acc),
        out.to(acc).contiguous(), stats.to(at::kDouble).contiguous(), scale, grad_hidden, grad_query);
  }
  return {grad_hidden, grad_query.reshape(query.sizes()).to(query.scalar_type())};
}

// The saved tensors and gradients the backward takes, for a batch of `batch` texts of `dim` features whose
// weights have weights_shape ([B, H, L], packed [H, T]).
void check_backward_inputs(const char* op, const at::Tensor& grad, const at::Tensor& grad_weights,
                           const at::Tensor& out, const at::Tensor& stats, int64_t batch, int64_t dim,
                           const Heads& heads, at::IntArrayRef weights_shape, const at::Tensor& hidden) {
  check_float_tensor(op, "grad_out", grad, {batch, dim}, hidden);
  check_float_tensor(op, "out", out, {batch, dim}, hidden);
  check_float_tensor(op, "stats", stats, {batch, heads.count, 2}, hidden);
  if (grad_weights.defined()) {
    check_float_tensor(op, "grad_weights", grad_weights, weights_shape, hidden);
  }
}

std::tuple<at::Tensor, at::Tensor> attention_pool_backward(
    const at::Tensor& grad, const std::optional<at::Tensor>& grad_weights_in, const at::Tensor& hidden_in,
    const std::optional<at::Tensor>& mask, const at::Tensor& query, const at::Tensor& out,
    const at::Tensor& stats, std::optional<double> scale, const std::optional<at::Tensor>& cu_seqlens,
    std::optional<int64_t> max_seqlen) {
  constexpr const char* op = "attention_pool_backward";
  const at::Tensor hidden = unit_feature_stride(hidden_in);
  const at::Tensor gw = grad_weights_in.has_value() ? *grad_weights_in : at::Tensor();
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen, Values::kTrusted);
    const at::Tensor view = packed.batch_view(hidden);
    const Heads heads = check_query(op, query, view);
    const double s = resolve_scale(op, scale, heads.dim);
    const int64_t batch = packed.batch, dim = hidden.size(1);
    check_backward_inputs(op, grad, gw, out, stats, batch, dim, heads, {heads.count, packed.tokens}, hidden);
    const at::Tensor valid = prepare_packed_mask(op, mask, packed, hidden, Values::kTrusted);
    if (hidden.is_cpu()) {
      return attention_backward(grad, gw, view, packed_rows(packed, valid), query, heads, out, stats, s);
    }
    const PaddedCopy copy = pad_packed(hidden, packed, valid);
    const int64_t width = copy.hidden.size(1);
    at::Tensor padded_gw;
    if (gw.defined()) {  // [H, T] to [B, H, W]
      padded_gw = at::zeros({heads.count, batch * width}, gw.options()).index_copy_(1, copy.slot, gw)
                      .view({heads.count, batch, width}).transpose(0, 1);
    }
    auto [grad_hidden, grad_query] =
        attention_backward(grad, padded_gw, copy.hidden, padded_rows(copy.valid), query, heads, out, stats, s);
    return {grad_hidden.view({batch * width, dim}).index_select(0, copy.slot), grad_query};
  }
  check_hidden(op, hidden);
  const Heads heads = check_query(op, query, hidden);
  const double s = resolve_scale(op, scale, heads.dim);
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  check_backward_inputs(op, grad, gw, out, stats, batch, dim, heads, {batch, heads.count, seq_len}, hidden);
  const at::Tensor valid = prepare_mask(op, mask, batch, seq_len, hidden, Values::kTrusted);
  return attention_backward(grad, gw, hidden, padded_rows(valid), query, heads, out, stats, s);
}

void register_attention_ops(torch::Library& m) {
  m.impl("attention_pool", &attention_pool);
  m.impl("attention_pool_backward", &attention_pool_backward);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_attention_ops)

}  // namespace lmk_ops::ops
