#pragma once
// The exponential of attention pooling's softmax weights, vectorised. Included only by files compiled once per CPU
// capability (attention_kernels.cpp).
//
// A float's exp is computed in double and rounded once to float: 2^k * P(r) with x = k ln2 + r, |r| <= ln2 / 2, P
// the degree-10 Taylor polynomial (relative error below 2^-42), so the float result is the correctly rounded exp
// except when exp(x) lies within about 2^-42 of a rounding boundary. Checked over every float in [-110, 90]
// against the double exp rounded to float: 36 of 2.2e9 differ (glibc's expf: 170,648). Half an ulp matters here:
// Sleef's 1-ulp exp flipped float16 outputs' rounding against the reference in the parity test. The scalar form
// performs the same operations in the same order, with fused multiply-adds, so a value gets the same bits
// whichever form computes it (checked over the same range).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/simd.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {

namespace exp_detail {
constexpr double kLog2e = 0x1.71547652b82fep0;
constexpr double kLn2Hi = 0x1.62e42fefa39efp-1;  // ln 2 = kLn2Hi + kLn2Lo
constexpr double kLn2Lo = 0x1.abc9e3b39803fp-56;
constexpr double kShifter = 0x1.8p52;  // x + kShifter rounds x to an integer, held in the low mantissa bits
// Beyond +-110 a float's exp is 0 or inf whatever the input; the clamp keeps 2^k a normal double.
constexpr double kClamp = 110.0;
// 1 / n! for n = 10 down to 0, for Horner's rule.
constexpr double kTaylor[11] = {0x1.27e4fb7789f5cp-22, 0x1.71de3a556c734p-19, 0x1.a01a01a01a01ap-16,
                                0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10, 0x1.1111111111111p-7,
                                0x1.5555555555555p-5,  0x1.5555555555555p-3,  0x1.0p-1,
                                0x1.0p0,               0x1.0p0};
}  // namespace exp_detail

#if defined(__FMA__)
inline float exp_acc(float x) {
  using namespace exp_detail;
  double v = static_cast<double>(x);
  v = -kClamp > v ? -kClamp : v;  // as _mm256_max_pd(-kClamp, v): a NaN passes through
  v = v > kClamp ? kClamp : v;
  const double shifted = std::fma(v, kLog2e, kShifter);
  const double k = shifted - kShifter;
  double r = std::fma(-k, kLn2Hi, v);
  r = std::fma(-k, kLn2Lo, r);
  double p = kTaylor[0];
  for (int i = 1; i < 11; ++i) {
    p = std::fma(p, r, kTaylor[i]);
  }
  int64_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits + 1023) << 52;  // 2^k: the low bits of `shifted` are k
  double two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return static_cast<float>(p * two_k);
}
#else
inline float exp_acc(float x) {
  return std::exp(x);
}
#endif

inline double exp_acc(double x) {
  return std::exp(x);
}

#if defined(__FMA__)
// exp_acc of kCount * Vec<double>::size() floats at v (4 a vector with AVX2, 8 with AVX-512), in place: exp_acc's
// operations lane by lane, so each value gets the bits the scalar form gives it. The kCount vectors go through each
// step together: the degree-10 Horner chain is some 40 cycles of latency a vector, and one vector at a time left
// the weights of 16 heads at about a sixth of attention's time per row (Zen 3, AVX2, rows in cache: 32 of 218 ns
// in bfloat16). Four at a time, one thread, 16 heads of bfloat16 in cache: 214-248 -> 199-209 ns a row; 1x32768x1024
// at 2 threads, time over hidden.sum()'s: 1.79-1.98x -> 1.72-1.80x (three rounds in alternating processes); float32
// unchanged within the noise.
template <int kCount>
[[gnu::always_inline]] inline void exp_acc_vectors(float* v) {
  using namespace exp_detail;
  using D = Vec<double>;
  typedef float Narrow __attribute__((vector_size(kVectorBytes / 2)));
  D shifted[kCount], r[kCount], p[kCount];
  for (int j = 0; j < kCount; ++j) {
    Narrow narrow;
    std::memcpy(&narrow, v + j * D::size(), sizeof narrow);
#if defined(CPU_CAPABILITY_AVX512)
    // The clamp as the scalar form's comparisons: max(c, x) and min(c, x) return x where x is a NaN. (GCC lowers the
    // generic widening and ternaries to a store, two half conversions and compare-and-blends: twice the
    // instructions.)
    __m512d x = _mm512_cvtps_pd(reinterpret_cast<__m256>(narrow));
    x = _mm512_min_pd(_mm512_set1_pd(kClamp), _mm512_max_pd(_mm512_set1_pd(-kClamp), x));
#elif defined(CPU_CAPABILITY_AVX2)
    __m256d x = _mm256_cvtps_pd(reinterpret_cast<__m128>(narrow));
    x = _mm256_min_pd(_mm256_set1_pd(kClamp), _mm256_max_pd(_mm256_set1_pd(-kClamp), x));
#else
    D::Native x = __builtin_convertvector(narrow, D::Native);
    x = D(-kClamp).v > x ? D(-kClamp).v : x;  // as the scalar form: a NaN passes through
    x = x > D(kClamp).v ? D(kClamp).v : x;
#endif
    shifted[j] = fmadd(D(x), D(kLog2e), D(kShifter));
    const D k = shifted[j] - D(kShifter);
    r[j] = fmadd(k, D(-kLn2Hi), D(x));  // -k * kLn2Hi is k * -kLn2Hi exactly
    r[j] = fmadd(k, D(-kLn2Lo), r[j]);
    p[j] = D(kTaylor[0]);
  }
  for (int i = 1; i < 11; ++i) {
    for (int j = 0; j < kCount; ++j) {
      p[j] = fmadd(p[j], r[j], D(kTaylor[i]));
    }
  }
  using Bits = Vec<int64_t>::Native;
  for (int j = 0; j < kCount; ++j) {
    const Bits bits = (reinterpret_cast<Bits>(shifted[j].v) + 1023) << 52;  // 2^k: the low bits of `shifted` are k
    Narrow narrow;
#if defined(CPU_CAPABILITY_AVX512)
    narrow = reinterpret_cast<Narrow>(_mm512_cvtpd_ps((p[j] * D(reinterpret_cast<D::Native>(bits))).v));
#elif defined(CPU_CAPABILITY_AVX2)
    narrow = reinterpret_cast<Narrow>(_mm256_cvtpd_ps((p[j] * D(reinterpret_cast<D::Native>(bits))).v));
#else
    narrow = __builtin_convertvector((p[j] * D(reinterpret_cast<D::Native>(bits))).v, Narrow);
#endif
    std::memcpy(v + j * D::size(), &narrow, sizeof narrow);
  }
}
#endif

// v[i] = exp_acc(v[i]) for n values.
template <typename acc>
inline void exp_in_place(acc* v, int64_t n) {
  int64_t i = 0;
#if defined(__FMA__)
  if constexpr (std::is_same_v<acc, float>) {
    constexpr int64_t W = Vec<double>::size();
    for (; i + 4 * W <= n; i += 4 * W) {
      exp_acc_vectors<4>(v + i);
    }
    for (; i + W <= n; i += W) {
      exp_acc_vectors<1>(v + i);
    }
    if (i < n) {  // the rest, padded to a vector: one vector exp costs less than a few scalar ones
      float rest[W] = {};
      std::memcpy(rest, v + i, (n - i) * sizeof(float));
      exp_acc_vectors<1>(rest);
      std::memcpy(v + i, rest, (n - i) * sizeof(float));
      return;
    }
  }
#endif
  for (; i < n; ++i) {
    v[i] = exp_acc(v[i]);
  }
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
