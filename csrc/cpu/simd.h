#pragma once
// The vector type of the CPU kernels, in place of ATen's at::vec (which PyTorch's stable ABI does not offer).
// Included only by files compiled once per CPU capability: everything here lives in that capability's namespace.
//
// One source for every capability: GCC/Clang vector extensions as wide as the capability's registers (32 bytes for
// DEFAULT and AVX2, 64 for AVX512), which the compiler lowers to SSE2, AVX2 or AVX-512 instructions. The code the
// tests run on an AVX2 machine (DEFAULT and AVX2) is so the code an AVX-512 machine runs, only wider. Intrinsics
// only where the generic form would be slower: fused multiply-add and float16 conversion.
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/kernel_types.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace lmk_ops::cpu::CPU_CAPABILITY {

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kVectorBytes = 64;
#else
constexpr int kVectorBytes = 32;
#endif

// The signed integer as wide as T (positions kept beside values, lane for lane).
template <typename T>
using same_size_int = std::conditional_t<sizeof(T) == 8, int64_t, int32_t>;

// The compiler's vector of kVectorBytes / sizeof(T) lanes of T. (Spelled per type: GCC drops vector_size from a
// typedef that depends on a template parameter when it matches declarations.)
template <typename T>
struct NativeVector;
template <>
struct NativeVector<float> {
  typedef float type __attribute__((vector_size(kVectorBytes)));
};
template <>
struct NativeVector<double> {
  typedef double type __attribute__((vector_size(kVectorBytes)));
};
template <>
struct NativeVector<int32_t> {
  typedef int32_t type __attribute__((vector_size(kVectorBytes)));
};
template <>
struct NativeVector<int64_t> {
  typedef int64_t type __attribute__((vector_size(kVectorBytes)));
};

// A vector of kVectorBytes / sizeof(T) lanes of T (float, double, int32_t or int64_t).
template <typename T>
struct Vec {
  using Native = typename NativeVector<T>::type;
  Native v;

  Vec() = default;
  Vec(Native x) : v(x) {}
  Vec(T x) : v(Native{} + x) {}  // every lane x

  static constexpr int64_t size() { return kVectorBytes / sizeof(T); }
  static Vec loadu(const T* p) {
    Native r;
    std::memcpy(&r, p, sizeof r);
    return r;
  }
  void store(T* p) const { std::memcpy(p, &v, sizeof v); }
  // The first count lanes. (A whole vector as one store: the variable-length copy compiles to a loop of 8-byte
  // moves, which perf found taking a fifth of row_scores' time.)
  void store(T* p, int64_t count) const {
    if (count == size()) {
      store(p);
    } else {
      std::memcpy(p, &v, count * sizeof(T));
    }
  }

  friend Vec operator+(Vec a, Vec b) { return a.v + b.v; }
  friend Vec operator-(Vec a, Vec b) { return a.v - b.v; }
  friend Vec operator*(Vec a, Vec b) { return a.v * b.v; }
};

// Whether any lane of a vector comparison's result (each lane all ones or zero) is set.
template <typename Mask>
inline bool any_lane(Mask mask) {
  uint64_t words[sizeof(Mask) / 8];
  std::memcpy(words, &mask, sizeof words);
  uint64_t any = 0;
  for (uint64_t w : words) {
    any |= w;
  }
  return any != 0;
}

// a * b + c, fused where the capability has FMA.
template <typename T>
inline Vec<T> fmadd(Vec<T> a, Vec<T> b, Vec<T> c) {
#if defined(__FMA__) && defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    return Vec<T>(_mm512_fmadd_ps(a.v, b.v, c.v));
  } else {
    return Vec<T>(_mm512_fmadd_pd(a.v, b.v, c.v));
  }
#elif defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    return Vec<T>(_mm256_fmadd_ps(a.v, b.v, c.v));
  } else {
    return Vec<T>(_mm256_fmadd_pd(a.v, b.v, c.v));
  }
#else
  return a * b + c;
#endif
}

// The sum of a's lanes, halving: lanes [0, n/2) + lanes [n/2, n), and so on.
template <typename T>
inline T sum_lanes(Vec<T> a) {
  T lanes[Vec<T>::size()];
  a.store(lanes);
  for (int64_t width = Vec<T>::size() / 2; width >= 1; width /= 2) {
    for (int64_t i = 0; i < width; ++i) {
      lanes[i] += lanes[i + width];
    }
  }
  return lanes[0];
}

// Vec<acc_t>::size() elements of p widened to the accumulation type.
template <typename scalar_t>
inline Vec<acc_t<scalar_t>> load_widened(const scalar_t* p) {
  using V = Vec<float>;
  if constexpr (std::is_same_v<scalar_t, acc_t<scalar_t>>) {
    return Vec<scalar_t>::loadu(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    // A bfloat16 is the high half of a float: zero-extend to 32 bits, shift into place. (Intrinsics: GCC lowers
    // the generic __builtin_convertvector to two half-width extensions and an insert.)
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return V(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return V(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
    typedef uint16_t Narrow __attribute__((vector_size(kVectorBytes / 2)));
    typedef uint32_t Wide __attribute__((vector_size(kVectorBytes)));
    Narrow narrow;
    std::memcpy(&narrow, p, sizeof narrow);
    return V(reinterpret_cast<V::Native>(__builtin_convertvector(narrow, Wide) << 16));
#endif
#if defined(__F16C__) && defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return V(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return V(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
  } else {
    float lanes[V::size()];
    for (int64_t i = 0; i < V::size(); ++i) {
      lanes[i] = static_cast<float>(p[i]);
    }
    return V::loadu(lanes);
  }
}

// Vec<double>::size() floats from p, each widened to double (exact). (Intrinsics: GCC lowers the generic
// __builtin_convertvector to half-width conversions and an insert.)
inline Vec<double> load_floats_widened(const float* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec<double>(_mm512_cvtps_pd(_mm256_loadu_ps(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec<double>(_mm256_cvtps_pd(_mm_loadu_ps(p)));
#else
  typedef float Floats __attribute__((vector_size(kVectorBytes / 2)));
  Floats f;
  std::memcpy(&f, p, sizeof f);
  return Vec<double>(__builtin_convertvector(f, Vec<double>::Native));
#endif
}

// x's lanes rounded to float (to nearest, ties to even, as a static_cast), stored at p.
inline void store_doubles_narrowed(Vec<double> x, float* p) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_ps(p, _mm512_cvtpd_ps(x.v));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm_storeu_ps(p, _mm256_cvtpd_ps(x.v));
#else
  typedef float Floats __attribute__((vector_size(kVectorBytes / 2)));
  const Floats f = __builtin_convertvector(x.v, Floats);
  std::memcpy(p, &f, sizeof f);
#endif
}

// dst[i] = src[i] rounded to scalar_t (to nearest, ties to even, as a static_cast), for n values.
template <typename scalar_t>
inline void store_narrowed(const acc_t<scalar_t>* src, scalar_t* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    // The float's bits rounded at bit 16 (ties to even); a NaN stays a quiet NaN, as c10::BFloat16 does.
    using V = Vec<float>;
    typedef uint32_t Wide __attribute__((vector_size(kVectorBytes)));
    typedef uint16_t Narrow __attribute__((vector_size(kVectorBytes / 2)));
    for (; i + V::size() <= n; i += V::size()) {
      const V x = V::loadu(src + i);
      const Wide bits = reinterpret_cast<Wide>(x.v);
      const Wide rounded = (bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16;
      const Wide narrowed = x.v != x.v ? Wide{} + 0x7fc0u : rounded;
      const Narrow out = __builtin_convertvector(narrowed, Narrow);
      std::memcpy(dst + i, &out, sizeof out);
    }
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    for (; i + 8 <= n; i += 8) {
      const __m128i out = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), out);
    }
#endif
  }
  for (; i < n; ++i) {
    dst[i] = static_cast<scalar_t>(src[i]);
  }
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
