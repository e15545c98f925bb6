#include "ops/pooling.h"

#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include "ops/kernels.h"

namespace lmk_ops::ops {

bool is_empty_pool(const at::Tensor& hidden) {
  return hidden.size(0) == 0 || hidden.size(1) == 0 || hidden.size(2) == 0;
}

std::tuple<at::Tensor, at::Tensor> finish_pooled(const at::Tensor& pooled, at::ScalarType dtype, bool normalize) {
  if (!normalize) {
    return {pooled, at::empty({0}, pooled.options().dtype(at::toOpMathType(dtype)))};
  }
  at::Tensor wide = pooled.to(at::toOpMathType(dtype));
  const at::Tensor norm = at::linalg_vector_norm(wide, 2, {1}, /*keepdim=*/true);
  at::Tensor out = wide.div(norm.clamp_min(1e-12)).to(dtype);
  return {out, wide};
}

std::tuple<at::Tensor, at::Tensor> mean_of_rows(const at::Tensor& hidden, const RowSelection& rows, bool normalize) {
  const int64_t batch = hidden.size(0), dim = hidden.size(2);
  const at::ScalarType out_type = normalize ? at::toOpMathType(hidden.scalar_type()) : hidden.scalar_type();
  at::Tensor out;
  if (is_empty_pool(hidden)) {
    out = at::zeros({batch, dim}, hidden.options().dtype(out_type));
  } else {
    // Normalising needs the unrounded mean, so the kernel then writes it in the accumulation type.
    out = at::empty({batch, dim}, hidden.options().dtype(out_type));
    kernels_for(hidden).mean_forward(hidden, rows, out);
  }
  return finish_pooled(out, hidden.scalar_type(), normalize);
}

at::Tensor mean_of_rows_backward(
    const at::Tensor& grad, const RowSelection& rows, int64_t seq_len, std::optional<at::ScalarType> dtype) {
  const int64_t batch = grad.size(0), dim = grad.size(1);
  const at::ScalarType out_type = dtype.value_or(grad.scalar_type());
  at::Tensor grad_hidden = at::empty({batch, seq_len, dim}, grad.options().dtype(out_type));
  if (grad_hidden.numel() == 0) {
    return grad_hidden;
  }
  // grad / count once per text, in the accumulation type; the kernel multiplies by how often each row is selected.
  at::Tensor counts;
  if (rows.mask.defined()) {
    counts = rows.mask.sum(1, /*keepdim=*/true);
  } else if (rows.positions.defined()) {
    counts = rows.positions.ge(0).sum(1, /*keepdim=*/true);
  } else {
    counts = at::full({batch, 1}, seq_len, grad.options().dtype(at::kLong));
  }
  const at::Tensor scaled = grad.to(at::toOpMathType(out_type)).div(counts.clamp_min(1)).contiguous();
  kernels_for(grad).mean_backward(scaled, rows, grad_hidden);
  return grad_hidden;
}

at::Tensor packed_mean_backward(const at::Tensor& grad, const PackedBatch& packed, const at::Tensor& times,
                                const at::Tensor& count, std::optional<at::ScalarType> dtype) {
  const at::ScalarType out_type = dtype.value_or(grad.scalar_type());
  const at::Tensor scaled = grad.to(at::toOpMathType(out_type)).div(count.clamp_min(1).unsqueeze(1));
  at::Tensor rows = scaled.index_select(0, packed.text_of_rows());
  if (times.defined() && times.scalar_type() != at::kBool) {
    rows.mul_(times.unsqueeze(1));  // a row listed n times: grad * n / count, rounded once, as the padded kernels
  }
  at::Tensor grad_hidden = rows.to(out_type);
  if (times.defined()) {
    grad_hidden.masked_fill_(times.eq(0).unsqueeze(1), 0);
  }
  return grad_hidden;
}

at::Tensor times_listed(const at::Tensor& positions, int64_t tokens) {
  // Entries of -1 count into a spare last row, dropped after.
  const at::Tensor row = at::where(positions.ge(0), positions, tokens).flatten();
  at::Tensor times = at::zeros({tokens + 1}, positions.options());
  times.scatter_add_(0, row, at::ones_like(row));
  return times.narrow(0, 0, tokens);
}

}  // namespace lmk_ops::ops
