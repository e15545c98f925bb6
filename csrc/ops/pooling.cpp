#include "ops/pooling.h"

#include <cmath>
#include <limits>

#include "common/host_path.h"
#include "ops/kernels.h"

namespace lmk_ops::ops {

bool is_empty_pool(const Tensor& hidden) {
  return hidden.size(0) == 0 || hidden.size(1) == 0 || hidden.size(2) == 0;
}

std::tuple<Tensor, Tensor> finish_pooled(const Tensor& pooled, ScalarType dtype, bool normalize) {
  if (!normalize) {
    return {pooled, empty_on(pooled, {0}, acc_dtype(dtype))};
  }
  const Tensor wide = as_contiguous(to_dtype(pooled, acc_dtype(dtype)));
  if (wide.numel() == 0) {  // no texts or no features: nothing to divide (D = 0 divided the host pass's work split
    return {empty_on(wide, {wide.size(0), wide.size(1)}, dtype), wide};  // by zero, SIGFPE; ATen's amax refuses it)
  }
  if (takes_host_path(wide)) {  // one pass per row, where the generic form below costs six operator calls
    Tensor out = empty_on(wide, {wide.size(0), wide.size(1)}, dtype);
    kernels_for(wide).normalize_rows(wide, out);
    return {out, wide};
  }
  // The L2 norm of each row (ATen's vector norm takes its order as a Scalar, which the stable ABI cannot pass), in
  // float64 so that no square of a float32 value overflows or underflows, nor the norm.
  const Tensor wide64 = to_dtype(wide, ScalarType::Double);
  if (dtype != ScalarType::Double) {
    const Tensor squares = torch::stable::sum(mul(wide64, wide64), std::vector<int64_t>{1}, /*keepdim=*/true);
    const Tensor norm = aten("aten::sqrt", "", squares);
    return {to_dtype(div(wide64, clamp_min(norm, kNormalizeEps)), dtype), wide};
  }
  // float64 rows: scaled first by a power of two near each row's largest magnitude, so that the squares neither
  // overflow nor underflow (exact: the scaling changes no bit otherwise; the host path sums in a wider type instead).
  const Tensor largest = aten("aten::amax", "", aten("aten::abs", "", wide64), std::vector<int64_t>{1}, true);
  const Tensor log2 = aten("aten::log2", "", clamp_min(largest, std::numeric_limits<double>::min()));
  const Tensor scale = aten("aten::exp2", "", aten("aten::floor", "", log2));
  const Tensor scaled = div(wide64, scale);
  const Tensor scaled_norm = aten("aten::sqrt", "", torch::stable::sum(mul(scaled, scaled), std::vector<int64_t>{1},
                                                                       /*keepdim=*/true));
  // row / max(norm, eps): row / eps at or below eps, else scaled / scaled_norm (a NaN norm too, which makes the
  // whole row NaN, as in F.normalize), where the norm itself may pass float64's range (only compared, as inf if so).
  const Tensor norm = mul(scaled_norm, scale);
  const Tensor eps = full_on(norm, {}, kNormalizeEps, ScalarType::Double);
  return {where(ge(eps, norm), div(wide64, eps), div(scaled, scaled_norm)), wide};
}

std::tuple<Tensor, Tensor> mean_of_rows(const Tensor& hidden, const RowSelection& rows, bool normalize) {
  const int64_t batch = hidden.size(0), dim = hidden.size(2);
  const ScalarType out_type = normalize ? acc_dtype(hidden.scalar_type()) : hidden.scalar_type();
  Tensor out;
  if (is_empty_pool(hidden)) {
    out = zeros_on(hidden, {batch, dim}, out_type);
  } else {
    // Normalising needs the unrounded mean, so the kernel then writes it in the accumulation type.
    out = empty_on(hidden, {batch, dim}, out_type);
    kernels_for(hidden).mean_forward(hidden, rows, out);
  }
  return finish_pooled(out, hidden.scalar_type(), normalize);
}

namespace {

// grad [B, D] / (the number of rows each text selects, at least 1), as a contiguous tensor of type acc (float32 or
// float64): the operand of the mean's backward kernel. counts: each text's count where known (a packed batch's
// lengths), else undefined (counted from the rows: counted's mask, with its offsets for a packed batch, or its
// positions). One kernel on every device.
Tensor grad_over_counts(const Tensor& grad, const Tensor& counts, const RowSelection& counted, int64_t seq_len,
                        ScalarType acc) {
  Tensor scaled = empty_on(grad, {grad.size(0), grad.size(1)}, acc);
  kernels_for(grad).grad_over_counts(grad, counts, counted.mask, counted.offsets, counted.positions, seq_len, scaled);
  return scaled;
}

}  // namespace

Tensor mean_of_rows_backward(const Tensor& grad, const RowSelection& rows, int64_t seq_len,
                             std::optional<ScalarType> dtype) {
  const int64_t batch = grad.size(0), dim = grad.size(1);
  const ScalarType out_type = dtype.value_or(grad.scalar_type());
  Tensor grad_hidden = empty_on(grad, {batch, seq_len, dim}, out_type);
  if (grad_hidden.numel() == 0) {
    return grad_hidden;
  }
  // grad / count once per text, in the accumulation type; the kernel multiplies by how often each row is selected.
  const Tensor scaled = grad_over_counts(grad, Tensor(), rows, seq_len, acc_dtype(out_type));
  kernels_for(grad).mean_backward(scaled, rows, grad_hidden);
  return grad_hidden;
}

Tensor packed_mean_backward(const Tensor& grad, const PackedBatch& packed, const RowSelection& rows,
                            const RowSelection& counted, std::optional<ScalarType> dtype) {
  const ScalarType out_type = dtype.value_or(grad.scalar_type());
  Tensor grad_hidden = empty_on(grad, {1, packed.tokens, grad.size(1)}, out_type);
  if (grad_hidden.numel() > 0) {
    const bool every_row = !counted.mask.defined() && !counted.positions.defined();
    const Tensor scaled =
        grad_over_counts(grad, every_row ? packed.lengths : Tensor(), counted, 0, acc_dtype(out_type));
    kernels_for(grad).mean_backward(scaled, rows, grad_hidden);
  }
  return torch::stable::view(grad_hidden, {packed.tokens, grad.size(1)});
}

}  // namespace lmk_ops::ops
