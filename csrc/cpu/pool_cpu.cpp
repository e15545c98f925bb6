// CPU implementations of the pooling ops: check inputs, allocate outputs, hand off to the vectorised kernels.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <tuple>

#include "common/checks.h"
#include "cpu/pool_kernels.h"

namespace lmk_ops::cpu {
namespace {

bool is_empty_pool(const at::Tensor& hidden) {
  return hidden.size(0) == 0 || hidden.size(1) == 0 || hidden.size(2) == 0;
}

at::Tensor mean_pool(const at::Tensor& hidden, const std::optional<at::Tensor>& mask) {
  constexpr const char* op = "mean_pool";
  check_hidden(op, hidden);
  const at::Tensor valid = prepare_mask(op, mask, hidden.size(0), hidden.size(1), hidden);
  if (is_empty_pool(hidden)) {
    return at::zeros({hidden.size(0), hidden.size(2)}, hidden.options());
  }
  at::Tensor out = at::empty({hidden.size(0), hidden.size(2)}, hidden.options());
  pool_kernels().mean_forward(hidden, valid, out);
  return out;
}

// Backward of mean: every valid row of text b gets grad[b] / count[b], every other row zero. The scaled [B, D]
// rows are computed once in the accumulation type; the [B, L, D] gradient is then written once, row by row,
// with memcpy / memset (split over (b, l) rows).
at::Tensor mean_pool_backward(const at::Tensor& grad, const std::optional<at::Tensor>& mask, int64_t seq_len) {
  constexpr const char* op = "mean_pool_backward";
  check_pooled_grad(op, grad);
  TORCH_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  const int64_t batch = grad.size(0), dim = grad.size(1);
  const at::Tensor valid = prepare_mask(op, mask, batch, seq_len, grad);
  at::Tensor grad_hidden = at::empty({batch, seq_len, dim}, grad.options());
  if (grad_hidden.numel() == 0) {
    return grad_hidden;
  }
  const at::Tensor counts = valid.defined() ? valid.sum(1, /*keepdim=*/true)
                                            : at::full({batch, 1}, seq_len, grad.options().dtype(at::kLong));
  const at::Tensor rows =
      grad.to(at::toOpMathType(grad.scalar_type())).div(counts.clamp_min(1)).to(grad.scalar_type()).contiguous();

  const size_t row_bytes = static_cast<size_t>(dim) * grad.element_size();
  const auto* src = static_cast<const char*>(rows.const_data_ptr());
  const bool* v = valid.defined() ? valid.const_data_ptr<bool>() : nullptr;
  auto* dst = static_cast<char*>(grad_hidden.data_ptr());
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / dim);
  at::parallel_for(0, batch * seq_len, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      char* out_row = dst + row * row_bytes;
      if (v == nullptr || v[row]) {
        std::memcpy(out_row, src + (row / seq_len) * row_bytes, row_bytes);
      } else {
        std::memset(out_row, 0, row_bytes);
      }
    }
  });
  return grad_hidden;
}

std::tuple<at::Tensor, at::Tensor> max_pool(const at::Tensor& hidden, const std::optional<at::Tensor>& mask) {
  constexpr const char* op = "max_pool";
  check_hidden(op, hidden);
  TORCH_CHECK(
      hidden.size(1) <= std::numeric_limits<int32_t>::max(), "lmk_ops.", op,
      ": expected at most 2^31 - 1 tokens per text (positions are saved as int32), got L = ", hidden.size(1));
  const at::Tensor valid = prepare_mask(op, mask, hidden.size(0), hidden.size(1), hidden);
  const int64_t batch = hidden.size(0), dim = hidden.size(2);
  if (is_empty_pool(hidden)) {
    return {at::zeros({batch, dim}, hidden.options()), at::full({batch, dim}, -1, hidden.options().dtype(at::kInt))};
  }
  at::Tensor out = at::empty({batch, dim}, hidden.options());
  at::Tensor argmax = at::empty({batch, dim}, hidden.options().dtype(at::kInt));
  pool_kernels().max_forward(hidden, valid, out, argmax);
  return {out, argmax};
}

at::Tensor max_pool_backward(const at::Tensor& grad, const at::Tensor& argmax, int64_t seq_len) {
  constexpr const char* op = "max_pool_backward";
  check_pooled_grad(op, grad);
  TORCH_CHECK(
      argmax.device() == grad.device(), "lmk_ops.", op, ": expected argmax on the same device as grad_out (",
      grad.device(), "), got ", argmax.device());
  TORCH_CHECK(
      argmax.scalar_type() == at::kInt && argmax.sizes() == grad.sizes(), "lmk_ops.", op,
      ": expected argmax of dtype int32 and shape ", shape_str(grad.sizes()), " (as max_pool returns), got ",
      argmax.scalar_type(), " of shape ", shape_str(argmax.sizes()));
  TORCH_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  TORCH_CHECK(
      argmax.numel() == 0 || (argmax.min().item<int64_t>() >= -1 && argmax.max().item<int64_t>() < seq_len),
      "lmk_ops.", op, ": expected argmax values in [-1, seq_len) = [-1, ", seq_len, "), got values in [",
      argmax.min().item<int64_t>(), ", ", argmax.max().item<int64_t>(), "]");
  at::Tensor grad_hidden = at::empty({grad.size(0), seq_len, grad.size(1)}, grad.options());
  if (grad_hidden.numel() == 0) {
    return grad_hidden;
  }
  pool_kernels().max_backward(grad.contiguous(), argmax.contiguous(), grad_hidden);
  return grad_hidden;
}

}  // namespace

TORCH_LIBRARY_IMPL(lmk_ops, CPU, m) {
  m.impl("mean_pool", &mean_pool);
  m.impl("mean_pool_backward", &mean_pool_backward);
  m.impl("max_pool", &max_pool);
  m.impl("max_pool_backward", &max_pool_backward);
}

}  // namespace lmk_ops::cpu
