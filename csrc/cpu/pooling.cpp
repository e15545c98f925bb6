#include "cpu/pooling.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/zeros.h>

#include <cstring>

#include "common/dispatch.h"
#include "cpu/pool_kernels.h"

namespace lmk_ops::cpu {

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
    pool_kernels().mean_forward(hidden, rows, out);
  }
  return finish_pooled(out, hidden.scalar_type(), normalize);
}

namespace {

// How many times each (b, l) row is selected, and how many selections each text has.
struct RowWeights {
  at::Tensor times;   // [B, L]: bool for a mask (0/1), int32 for listed positions; undefined: every row once
  at::Tensor counts;  // [B, 1] int64
};

RowWeights row_weights(const RowSelection& rows, int64_t batch, int64_t seq_len, const at::TensorOptions& opts) {
  if (rows.mask.defined()) {
    return {rows.mask, rows.mask.sum(1, /*keepdim=*/true)};
  }
  if (!rows.positions.defined()) {
    return {at::Tensor(), at::full({batch, 1}, seq_len, opts.dtype(at::kLong))};
  }
  at::Tensor times = at::zeros({batch, seq_len}, opts.dtype(at::kInt));
  at::Tensor counts = at::zeros({batch, 1}, opts.dtype(at::kLong));
  const int64_t listed = rows.positions.size(1);
  const int64_t* p = rows.positions.const_data_ptr<int64_t>();
  int32_t* t = times.data_ptr<int32_t>();
  int64_t* c = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t k = 0; k < listed; ++k) {
      const int64_t l = p[b * listed + k];
      if (l >= 0) {
        ++t[b * seq_len + l];
        ++c[b];
      }
    }
  }
  return {times, counts};
}

// Writes every row of grad_hidden once, split over (b, l) rows: a row selected once is a memcpy of its text's
// scaled gradient, an unselected row a memset, a row listed several times the scaled gradient times that count.
template <typename scalar_t, typename times_t>
void write_weighted_rows(const at::Tensor& scaled_wide, const times_t* times, at::Tensor& grad_hidden) {
  using acc = at::opmath_type<scalar_t>;
  const int64_t seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  const at::Tensor scaled = scaled_wide.to(grad_hidden.scalar_type()).contiguous();
  const scalar_t* src = scaled.const_data_ptr<scalar_t>();
  const acc* src_wide = scaled_wide.const_data_ptr<acc>();
  scalar_t* dst = grad_hidden.data_ptr<scalar_t>();
  const size_t row_bytes = static_cast<size_t>(dim) * sizeof(scalar_t);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / dim);
  at::parallel_for(0, grad_hidden.size(0) * seq_len, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / seq_len;
      const int64_t n = times == nullptr ? 1 : static_cast<int64_t>(times[row]);
      scalar_t* out_row = dst + row * dim;
      if (n == 1) {
        std::memcpy(out_row, src + b * dim, row_bytes);
      } else if (n == 0) {
        std::memset(out_row, 0, row_bytes);
      } else {
        for (int64_t d = 0; d < dim; ++d) {
          out_row[d] = static_cast<scalar_t>(src_wide[b * dim + d] * static_cast<acc>(n));
        }
      }
    }
  });
}

}  // namespace

at::Tensor mean_of_rows_backward(
    const at::Tensor& grad, const RowSelection& rows, int64_t seq_len, std::optional<at::ScalarType> dtype) {
  const int64_t batch = grad.size(0), dim = grad.size(1);
  const at::ScalarType out_type = dtype.value_or(grad.scalar_type());
  at::Tensor grad_hidden = at::empty({batch, seq_len, dim}, grad.options().dtype(out_type));
  if (grad_hidden.numel() == 0) {
    return grad_hidden;
  }
  const RowWeights weights = row_weights(rows, batch, seq_len, grad.options());
  // grad / count once per text, in the accumulation type.
  const at::Tensor scaled = grad.to(at::toOpMathType(out_type)).div(weights.counts.clamp_min(1)).contiguous();
  LMK_DISPATCH_FLOATING(out_type, "mean_of_rows_backward", [&] {
    if (!weights.times.defined()) {
      write_weighted_rows<scalar_t, bool>(scaled, nullptr, grad_hidden);
    } else if (weights.times.scalar_type() == at::kBool) {
      write_weighted_rows<scalar_t>(scaled, weights.times.const_data_ptr<bool>(), grad_hidden);
    } else {
      write_weighted_rows<scalar_t>(scaled, weights.times.const_data_ptr<int32_t>(), grad_hidden);
    }
  });
  return grad_hidden;
}

}  // namespace lmk_ops::cpu
