// attention_pool and its backward, for every device: check inputs, allocate outputs, hand off to the device's
// kernels.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "common/checks.h"
#include "ops/kernels.h"

namespace lmk_ops::ops {
namespace {

// The query as the kernels take it: [H, D / H], contiguous, in the accumulation type of hidden's dtype.
at::Tensor wide_query(const at::Tensor& query, const Heads& heads, at::ScalarType acc) {
  return query.reshape({heads.count, heads.dim}).to(acc).contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_pool(
    const at::Tensor& hidden, const std::optional<at::Tensor>& mask, const at::Tensor& query,
    std::optional<double> scale, bool return_weights) {
  constexpr const char* op = "attention_pool";
  check_hidden(op, hidden);
  const Heads heads = check_query(op, query, hidden);
  const double s = resolve_scale(op, scale, heads.dim);
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const at::Tensor valid = prepare_mask(op, mask, batch, seq_len, hidden);
  const at::ScalarType acc = at::toOpMathType(hidden.scalar_type());
  at::Tensor stats = at::full(
      {batch, heads.count, 2}, -std::numeric_limits<double>::infinity(), hidden.options().dtype(at::kDouble));
  at::Tensor weights = return_weights ? at::zeros({batch, heads.count, seq_len}, hidden.options().dtype(acc))
                                      : at::empty({0}, hidden.options().dtype(acc));
  if (batch == 0 || seq_len == 0) {
    return {at::zeros({batch, dim}, hidden.options()), stats, weights};
  }
  at::Tensor out = at::empty({batch, dim}, hidden.options());
  at::Tensor kernel_weights = return_weights ? weights : at::Tensor();
  kernels_for(hidden).attention_forward(hidden, valid, wide_query(query, heads, acc), s, out, stats, kernel_weights);
  return {out, stats, weights};
}

std::tuple<at::Tensor, at::Tensor> attention_pool_backward(
    const at::Tensor& grad, const std::optional<at::Tensor>& grad_weights, const at::Tensor& hidden,
    const std::optional<at::Tensor>& mask, const at::Tensor& query, const at::Tensor& out,
    const at::Tensor& stats, std::optional<double> scale) {
  constexpr const char* op = "attention_pool_backward";
  check_hidden(op, hidden);
  const Heads heads = check_query(op, query, hidden);
  const double s = resolve_scale(op, scale, heads.dim);
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  check_float_tensor(op, "grad_out", grad, {batch, dim}, hidden);
  check_float_tensor(op, "out", out, {batch, dim}, hidden);
  check_float_tensor(op, "stats", stats, {batch, heads.count, 2}, hidden);
  const bool has_grad_weights = grad_weights.has_value() && grad_weights->defined();
  if (has_grad_weights) {
    check_float_tensor(op, "grad_weights", *grad_weights, {batch, heads.count, seq_len}, hidden);
  }
  const at::Tensor valid = prepare_mask(op, mask, batch, seq_len, hidden, Values::kTrusted);
  const at::ScalarType acc = at::toOpMathType(hidden.scalar_type());
  at::Tensor grad_hidden = at::empty({batch, seq_len, dim}, hidden.options());
  at::Tensor grad_query = at::zeros({heads.count, heads.dim}, hidden.options().dtype(acc));
  if (grad_hidden.numel() > 0) {
    const at::Tensor wide_grad_weights = has_grad_weights ? grad_weights->to(acc).contiguous() : at::Tensor();
    kernels_for(hidden).attention_backward(
        grad.to(acc).contiguous(), wide_grad_weights, hidden, valid, wide_query(query, heads, acc),
        out.to(acc).contiguous(), stats.to(at::kDouble).contiguous(), s, grad_hidden, grad_query);
  }
  return {grad_hidden, grad_query.reshape(query.sizes()).to(query.scalar_type())};
}

void register_attention_ops(torch::Library& m) {
  m.impl("attention_pool", &attention_pool);
  m.impl("attention_pool_backward", &attention_pool_backward);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_attention_ops)

}  // namespace lmk_ops::ops
