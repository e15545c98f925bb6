// The L2 normalisation of pooled rows, out = row / max(|row|, eps) as F.normalize, one pass per row and threads
// over rows. Compiled once per CPU capability (CMakeLists.txt): the squares and the quotients run in vectors, and a
// row's norm is summed in the same order on every capability (sixteen running sums, feature d in sum d % 16, added
// pairwise), so the results do not depend on the capability. Sixteen chains of additions rather than four: the
// latency of one chain of D / 4 dependent additions was most of the time. (As a scalar loop in the op layer, built
// for the x86-64 baseline, the normalisation cost a 1024x16x384 bfloat16 mean two thirds again.)
#include "cpu/normalize_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "cpu/kernel_common.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {
namespace {

// A row's squares are summed in kSums running sums, feature d in sum d % kSums, as kSums / Vec<double>::size()
// vectors of them (lane k of vector j: sum j * Vec<double>::size() + k), so each sum takes the same features in the
// same order whatever the vector width.
constexpr int64_t kSums = 16;

// The rows of float pooled values (float, bfloat16 and float16 outputs): the squares, their sum and the quotients
// in float64, which holds every square of a float and their sum (no row needs scaling to keep its norm finite and
// nonzero); each quotient is rounded to float, then to the output type (as static_cast<scalar_t>(double) does).
template <typename scalar_t>
void normalize_float_rows(const float* wide, scalar_t* out, int64_t batch, int64_t dim) {
  using VD = Vec<double>;
  torch::stable::parallel_for(0, batch, std::max<int64_t>(1, kMinParallelWork / dim), [&](int64_t first,
                                                                                           int64_t last) {
    std::vector<float> narrowing(std::is_same_v<scalar_t, float> ? 0 : dim);  // the quotients before narrowing
    for (int64_t b = first; b < last; ++b) {
      const float* row = wide + b * dim;
      VD vectors[kSums / VD::size()];
      for (VD& v : vectors) {
        v = VD(0.0);
      }
      int64_t d = 0;
      for (; d + kSums <= dim; d += kSums) {
        for (int64_t j = 0; j < kSums / VD::size(); ++j) {
          const VD x = load_floats_widened(row + d + j * VD::size());
          vectors[j] = vectors[j] + x * x;  // no contraction (-ffp-contract=off): a product and a sum, as below
        }
      }
      double sums[kSums];
      std::memcpy(sums, vectors, sizeof sums);
      for (int64_t i = 0; d + i < dim; ++i) {
        const double x = row[d + i];
        sums[i] += x * x;
      }
      for (int64_t width = kSums / 2; width >= 1; width /= 2) {  // pairwise: sum i + sum i + width
        for (int64_t i = 0; i < width; ++i) {
          sums[i] += sums[i + width];
        }
      }
      const double norm = std::sqrt(sums[0]);
      float* quotients = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(out + b * dim) : narrowing.data();
      // Above eps (or NaN, which makes every feature NaN, as in F.normalize) the product by the norm's reciprocal
      // in float64 (two roundings far below float's); at or below it the division by eps, as F.normalize divides.
      if (!(norm <= kNormalizeEps)) {
        const double inverse = 1.0 / norm;
        for (d = 0; d + VD::size() <= dim; d += VD::size()) {
          store_doubles_narrowed(load_floats_widened(row + d) * VD(inverse), quotients + d);
        }
        for (; d < dim; ++d) {
          quotients[d] = static_cast<float>(static_cast<double>(row[d]) * inverse);
        }
      } else {
        for (d = 0; d < dim; ++d) {
          quotients[d] = static_cast<float>(static_cast<double>(row[d]) / kNormalizeEps);
        }
      }
      if constexpr (!std::is_same_v<scalar_t, float>) {
        store_narrowed(quotients, out + b * dim, dim);
      }
    }
  });
}

// float64 rows: the squares, their sum and the quotients in the kernels' wide_t, the x87 extended type (a float64
// sum of 768 float64 squares drifted, its unit vectors up to 5.7 ulp off the exact ones, F.normalize's 1.2), which
// holds every square of a float64 and their sum. Scalar: x87 has no vectors.
void normalize_double_rows(const double* wide, double* out, int64_t batch, int64_t dim) {
  using wide_sum = wide_t<double>;
  using wide_limits = std::numeric_limits<wide_sum>;
  using limits = std::numeric_limits<double>;
  static_assert(wide_limits::max_exponent >= 2 * limits::max_exponent + 64 &&
                    wide_limits::min_exponent <= 2 * (limits::min_exponent - limits::digits),
                "normalize needs a type whose range holds the squares of float64 values (x87 long double)");
  torch::stable::parallel_for(0, batch, std::max<int64_t>(1, kMinParallelWork / dim), [&](int64_t first,
                                                                                           int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const double* row = wide + b * dim;
      wide_sum sums[4] = {0, 0, 0, 0};
      for (int64_t d = 0; d < dim; ++d) {
        const wide_sum x = row[d];
        sums[d % 4] += x * x;
      }
      const wide_sum norm = std::sqrt((sums[0] + sums[1]) + (sums[2] + sums[3]));
      double* out_row = out + b * dim;
      if (!(norm <= wide_sum(kNormalizeEps))) {
        const wide_sum inverse = wide_sum(1) / norm;
        for (int64_t d = 0; d < dim; ++d) {
          out_row[d] = static_cast<double>(static_cast<wide_sum>(row[d]) * inverse);
        }
      } else {
        for (int64_t d = 0; d < dim; ++d) {
          out_row[d] = row[d] / kNormalizeEps;
        }
      }
    }
  });
}

}  // namespace

void normalize_rows(const Tensor& wide, Tensor& out) {
  const int64_t batch = wide.size(0), dim = wide.size(1);
  LMK_DISPATCH_FLOATING(out.scalar_type(), "normalize", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      normalize_double_rows(wide.const_data_ptr<double>(), out.mutable_data_ptr<double>(), batch, dim);
    } else {
      normalize_float_rows(wide.const_data_ptr<float>(), out.mutable_data_ptr<scalar_t>(), batch, dim);
    }
  });
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
