#pragma once
// bfloat16 rows read a pair block (two float vectors' worth: 16 features on AVX2, 32 on AVX-512) at a time as two
// float vectors ("pair order"), for the kernels of attention pooling. Included only by files compiled once per CPU
// capability.
//
// load_widened() widens one vector's worth of bfloat16 values with a half-width load, a zero-extension and a
// shift. Here one full-width load holds two vectors' worth, two per 32-bit lane, and each lane's even feature is
// the lane shifted left by 16 and its odd feature the lane with its low half cleared: half the instructions per
// feature. Attention pooling over bfloat16 is bound by instructions on AVX2 and AVX-512 (a 64-feature head costs
// as much per row as in float32), so the float operands that meet such rows (the query and the weighted sums) are
// kept in the same order: per pair block, the even features, then the odd ones. Sums taken in pair order add the
// same products in another order; the forward and the backward use the same order, so a recomputed score keeps
// its bits. (The maximum compares 16-bit floats as integers instead: pool_kernels.cpp.) GCC folds load_pairs' load
// into both the shift and the mask (two loads of the block); one load kept in a register (an empty asm forcing it)
// was no faster: Zen 4, 16 heads of 64 on 1x32768x1024, time over hidden.sum()'s in alternating processes, 2 threads
// 1.55-1.57x -> 1.60-1.74x, one thread 2.19-2.20x -> 2.34-2.38x (2026-12-04).
#include <torch/headeronly/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/simd.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {

constexpr int64_t kPairBlock = 2 * Vec<float>::size();

// DEFAULT (SSE2 pairs of registers) keeps the plain order: the tests then cover both orders on one machine.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kHavePairs = true;
#else
constexpr bool kHavePairs = false;
#endif

struct Pairs {
  Vec<float> even, odd;
};

// Features [0, kPairBlock) of p as (even, odd) floats.
inline Pairs load_pairs(const c10::BFloat16* p) {
  typedef uint32_t Lanes __attribute__((vector_size(kVectorBytes)));
  using Native = Vec<float>::Native;
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return {Vec<float>(reinterpret_cast<Native>(v << 16)), Vec<float>(reinterpret_cast<Native>(v & 0xFFFF0000u))};
}

// Whether rows of this type and feature stride can be read in pair order.
template <typename scalar_t>
inline bool reads_pairs(int64_t stride) {
  return kHavePairs && std::is_same_v<scalar_t, c10::BFloat16> && stride == 1;
}

// Whether attention reads rows of this type, feature stride and head width in pair order.
template <typename scalar_t>
inline bool use_pairs(int64_t stride, int64_t head_dim) {
  return reads_pairs<scalar_t>(stride) && head_dim % kPairBlock == 0;
}

// Index in pair order of feature i (n, the length, a multiple of kPairBlock).
inline int64_t pair_index(int64_t i) {
  const int64_t j = i % kPairBlock;
  return i - j + (j % 2) * (kPairBlock / 2) + j / 2;
}

// dst (pair order) = src (natural order), n values.
template <typename T>
inline void to_pair_order(const T* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[pair_index(i)] = src[i];
  }
}

// dst (natural order) = value(src (pair order)), n values (a multiple of kPairBlock): the inverse of to_pair_order,
// a pair block at a time (interleaving its even and odd halves), which the compiler vectorises.
template <typename T, typename U, typename Value>
inline void from_pair_order(const T* src, U* dst, int64_t n, const Value& value) {
  for (int64_t j = 0; j < n; j += kPairBlock) {
    for (int64_t k = 0; k < kPairBlock / 2; ++k) {
      dst[j + 2 * k] = value(src[j + k]);
      dst[j + 2 * k + 1] = value(src[j + kPairBlock / 2 + k]);
    }
  }
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
