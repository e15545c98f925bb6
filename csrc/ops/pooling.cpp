#include "ops/pooling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "common/dispatch.h"
#include "common/host_path.h"
#include "ops/kernels.h"

namespace lmk_ops::ops {

bool is_empty_pool(const Tensor& hidden) {
  return hidden.size(0) == 0 || hidden.size(1) == 0 || hidden.size(2) == 0;
}

// The divisor's floor in normalize, as torch.nn.functional.normalize's eps.
constexpr double kNormEps = 1e-12;

std::tuple<Tensor, Tensor> finish_pooled(const Tensor& pooled, ScalarType dtype, bool normalize) {
  if (!normalize) {
    return {pooled, empty_on(pooled, {0}, acc_dtype(dtype))};
  }
  const Tensor wide = as_contiguous(to_dtype(pooled, acc_dtype(dtype)));
  if (takes_host_path(wide)) {  // one pass per row, where the generic form below costs six operator calls
    const int64_t batch = wide.size(0), dim = wide.size(1);
    Tensor out = empty_on(wide, {batch, dim}, dtype);
    LMK_DISPATCH_FLOATING(dtype, "normalize", [&] {
      using acc = acc_t<scalar_t>;
      const acc* w = wide.const_data_ptr<acc>();
      scalar_t* o = out.mutable_data_ptr<scalar_t>();
      for (int64_t b = 0; b < batch; ++b) {
        const acc* row = w + b * dim;
        // The norm in float64, of the row scaled by a power of two near its largest magnitude (clamped to keep
        // the factor a finite double): no square overflows or underflows whatever the dtype, and the scaling is
        // exact, so it changes no bit otherwise.
        double largest = 0;
        for (int64_t d = 0; d < dim; ++d) {
          largest = std::max(largest, std::abs(static_cast<double>(row[d])));
        }
        int exponent = 0;
        if (largest > 0 && std::isfinite(largest)) {
          std::frexp(largest, &exponent);
          exponent = std::clamp(exponent, -1021, 1021);
        }
        const double scale = std::ldexp(1.0, -exponent);
        double squares = 0;  // no float32 rounding error piles up over D
        for (int64_t d = 0; d < dim; ++d) {
          const double x = static_cast<double>(row[d]) * scale;
          squares += x * x;
        }
        const double scaled_norm = std::sqrt(squares);
        // out = row / max(norm, eps), as F.normalize, with the quotient in float64 (the norm may pass the dtype's
        // range: the mean of values near float32's maximum over 8 features).
        const bool above_eps = std::ldexp(scaled_norm, exponent) > kNormEps;
        for (int64_t d = 0; d < dim; ++d) {
          const double x = static_cast<double>(row[d]);
          o[b * dim + d] = static_cast<scalar_t>(above_eps ? x * scale / scaled_norm : x / kNormEps);
        }
      }
    });
    return {out, wide};
  }
  // The L2 norm of each row (ATen's vector norm takes its order as a Scalar, which the stable ABI cannot pass), in
  // float64 so that no square of a float32 value overflows or underflows, nor the norm.
  const Tensor wide64 = to_dtype(wide, ScalarType::Double);
  if (dtype != ScalarType::Double) {
    const Tensor squares = torch::stable::sum(mul(wide64, wide64), std::vector<int64_t>{1}, /*keepdim=*/true);
    const Tensor norm = aten("aten::sqrt", "", squares);
    return {to_dtype(div(wide64, clamp_min(norm, kNormEps)), dtype), wide};
  }
  // float64 rows: scaled first by a power of two near each row's largest magnitude, as the host path does, so that
  // the squares neither overflow nor underflow (exact: the scaling changes no bit otherwise).
  const Tensor largest = aten("aten::amax", "", aten("aten::abs", "", wide64), std::vector<int64_t>{1}, true);
  const Tensor log2 = aten("aten::log2", "", clamp_min(largest, std::numeric_limits<double>::min()));
  const Tensor scale = aten("aten::exp2", "", aten("aten::floor", "", log2));
  const Tensor scaled = div(wide64, scale);
  const Tensor scaled_norm = aten("aten::sqrt", "", torch::stable::sum(mul(scaled, scaled), std::vector<int64_t>{1},
                                                                       /*keepdim=*/true));
  // row / max(norm, eps): scaled / scaled_norm above eps, where the norm itself may pass float64's range (it is
  // only compared, as inf if so), and row / eps below it.
  const Tensor norm = mul(scaled_norm, scale);
  const Tensor eps = full_on(norm, {}, kNormEps, ScalarType::Double);
  return {where(ge(norm, eps), div(scaled, scaled_norm), div(wide64, eps)), wide};
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
