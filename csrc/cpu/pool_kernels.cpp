// Vectorised CPU pooling kernels. Compiled once per CPU capability: CPU_CAPABILITY is DEFAULT, AVX2 or AVX512
// and names the namespace of this copy (see CMakeLists.txt and kernels_dispatch.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "cpu/attention_kernels.h"
#include "cpu/bf16_pairs.h"
#include "cpu/kernel_common.h"
#include "cpu/normalize_kernels.h"
#include "cpu/rows.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {
namespace {

// Whether x takes over from the kept maximum best (x comes later): greater, or a NaN where best is not.
template <typename acc>
inline bool takes_over(acc x, acc best) {
  return x > best || (std::isnan(x) && !std::isnan(best));
}

// Keeps the larger value and its position, lane by lane: x wins when it is greater, or when it is NaN and the
// kept value is not (so the first NaN stays, as with torch.max); ties keep the earlier position. One unordered
// compare does "greater or NaN", guarded by "kept value is not NaN".
template <typename acc>
inline void keep_max(Vec<acc>& best, Vec<same_size_int<acc>>& where, Vec<acc> x, Vec<same_size_int<acc>> pos) {
  const auto take = ~(x.v <= best.v) & (best.v == best.v);  // greater or unordered, and best is a number
  best = take ? x.v : best.v;
  where = take ? pos.v : where.v;
}

// Sums rows in the accumulation type in runs of kFoldRows rows, each run folded into a float64 total. The error of
// a mean so stays within about one float32 ulp of the result at any L (a plain float32 running sum loses digits as
// it grows: 80,000 ulp at a million rows).
//
// The mean of float32 and float64 rows takes them four at a time, side by side and without software prefetches except
// on Zen 4 (SumReducer::add_rows): a run adds eight group sums (x0 + x1) + (x2 + x3) in turn, as many roundings in a
// row as eight single rows, so a million equal float32 rows stay within 1 ulp, and float64 ones within 2 (a chunk's
// total then takes 16 additions). One row at a time it waited on memory on Zen 3 (AVX2, 2 threads), where four streams
// of the same run read faster. Time over hidden.sum()'s, three rounds in alternating processes, one row at a time ->
// four in runs of 8: float32 1x32768x1024 1.26-1.33x -> 1.06-1.12x, 64x512x1024 1.25-1.33x -> 1.04-1.14x, 32x512x768
// 1.41-1.51x -> 1.27-1.50x; float64 1x16384x1024 1.18-1.24x -> 0.95-1.03x (two rounds); runs of 8 -> 32 (the fold's
// widening pass a quarter as often): float32 1x32768x1024 1.09-1.13x -> 1.02-1.08x, 8x4096x1024 1.07-1.14x ->
// 0.97-1.04x, 32x512x768 1.39-1.47x -> 1.34-1.38x, a packed batch of 120 texts x 768 1.23-1.26x -> 1.17-1.18x. On Zen 4
// (where the kernels prefetch into L2: prefetches_into_l1) the four streams were read late, one thread at 1.5-1.6x
// hidden.sum()'s time; prefetching the next four rows into L2 as the four are added, float32, two rounds in alternating
// processes, 10th percentiles, one thread: 1x32768x1024 1.51-1.55x -> 1.14-1.20x, 8x4096x1024 1.59-1.64x -> 1.12-1.16x,
// the packed 120 texts 1.59-1.66x -> 1.11-1.12x (index_add in float32 1.07-1.16x); two threads: 1.62-1.73x ->
// 1.20-1.22x, 1.63-1.76x -> 1.24-1.32x, 1.48-1.53x -> 1.01-1.05x (index_add 1.21-1.34x). Elsewhere the four streams
// read near the floor without (above; the Intel Xeon's reports 0.86-1.03x), and an L1 prefetch there is unmeasured, so
// they are left as they were.
//
// The maximum goes one row after another, each read whole as one contiguous run: a stream the hardware prefetchers
// follow, helped by a software prefetch (prefetch_rows). Four rows side by side (maxima in registers across the
// rows) were no faster in float32 and slower at 32x512x768 (1.20-1.36x -> 1.56-1.65x). So did 16-bit rows of the
// mean, and grouped (x0 + x1) + (x2 + x3) four of them read side by side were slower on Zen 3 (bfloat16 pair blocks
// 1.13x -> 1.44x hidden.sum()'s time); added one after another as single rows are (the same bits), with only the
// sums kept in registers across four (SumReducer::add_four_rows), they are faster on the 2-core Intel Xeon
// (AVX-512) where the rows are in cache and level from memory: packed 32 texts of 16-128 tokens x 768 bfloat16
// 1.42-1.51x -> 1.33-1.42x, the 120 texts 0.67-0.68x -> 0.60-0.65x, 1x32768x1024 unchanged. A 16-bit run of 32 rows
// is up to 8 float32 ulp off on a constant column, 2^13 times below half a bfloat16 ulp (2^10 for float16), and the
// result is rounded to theirs; runs of 8 -> 32, three rounds: bfloat16 1x32768x1024 0.97-1.00x -> 0.85-0.91x,
// 32x512x768 1.00-1.06x -> 0.82-0.92x; float16 8x4096x1024 0.81-0.84x -> 0.73-0.75x, 32x512x768 1.15-1.21x ->
// 0.92-0.99x. (Earlier, on Zen 5, 2 threads, rows one at a time instead of four side by side with software
// prefetches, time over an index_add's on the same packed batch of 120 texts x 768: the mean 1.03-1.06x ->
// 0.97-1.04x (float32), 1.13-1.30x -> 0.98-1.00x (bfloat16); the maximum 1.19-1.21x -> 1.02-1.06x, 1.26-1.33x ->
// 1.08-1.10x; the float32 maximum at 1x32768x1024 1.34-1.45x -> 1.12-1.19x hidden.sum()'s time.)
// Tried and not kept (Zen 4, 2026-12-03): the four rows read one after another instead of side by side (r0 and r1
// summed through an L1 buffer, then r2 + r3, then the group added: the same additions, the same bits) and without
// software prefetches, so that a packed text is one forward stream as for index_add. One thread, the packed 120 texts
// x 768 float32, third-fastest of 15 calls, three processes in turn: 1.45-1.46x -> 1.27-1.37x hidden.sum()'s time
// (index_add in float32 1.28-1.42x); but two threads, as the report runs, fourth-fastest of 25: time over that
// index_add's 0.89-0.91 -> 0.92-0.95, 32x512x768 1.30-1.41x -> 1.37-1.62x hidden.sum()'s, 1x32768x1024 1.03-1.17x
// -> 1.10-1.64x.
constexpr int kFoldRows = 32;

// The hardware prefetchers alone left the mean and the maximum waiting on memory after each row: on one thread their
// time was about hidden.sum()'s plus that of the same work on rows already in L1 (no overlap). So while a row is added,
// the row prefetch_rows() on (in the selection's order) is prefetched, a line per line read (prefetch_line): three rows
// on into L1, ten into L2 where the kernels prefetch into L2 only (Zen 4, and rows of 32- and 64-bit values on Intel:
// prefetches_into_l1). Zen 5, 2 threads, mean and max time over hidden.sum()'s, six runs in alternating processes:
// 1x32768x1024 float32 1.13-1.46x -> 0.95-1.11x, bfloat16 1.10-1.28x -> 0.99-1.13x; 8x4096x1024 float32 1.11-1.43x ->
// 1.02-1.11x; a packed batch of 120 texts x 768, scatter_reduce's time over the max's 0.91-1.26 -> 0.99-1.11; bfloat16
// 32x512x768, the one shape that lost, 0.81-1.06x -> 0.99-1.10x. Two rows on did about as well, one and four worse,
// prefetcht2 (into L2) worse on one thread. Zen 4, into L2, 2 threads, three rounds in alternating processes, three
// rows on -> six -> ten: the bfloat16 maximum of the packed 120 texts 1.57-1.58x -> 1.28-1.32x -> 1.22-1.26x, of
// 1x32768x1024 1.33-1.35x -> 1.19-1.28x -> 1.23-1.29x; float32 8x4096x1024 1.07-1.12x -> 1.01-1.11x -> 1.03-1.05x; the
// bfloat16 mean (which takes four rows at a time, add_four_rows) unchanged.
template <typename scalar_t>
inline int64_t prefetch_rows() {
  return prefetches_into_l1<scalar_t>() ? 3 : 10;
}

// Calls step(i) for i = *at, *at + kStep, ... while kStep features fit in n (a vector's, a pair block's, a key
// vector's), prefetching each line of `ahead` as prefetch_line() does, and leaves *at past the last. The whole lines
// of a contiguous row go a line per round (one prefetch, then the line's steps, unrolled) rather than a test and a
// branch per step: same operations, same bits. Against a clean build of the code before (8bed6b7), Zen 3 (AVX2), 2
// threads, 1x32768x1024, three rounds in alternating processes, time over hidden.sum()'s: float32 max
// 1.35-1.44x -> 1.25-1.29x, bfloat16 max 1.06-1.16x -> 1.04-1.07x, float32 mean 1.19-1.30x -> 1.27-1.31x (no
// gain), bfloat16 mean 0.93-0.94x -> 1.12x (slower). The mean with its old loops back (everything else as here)
// measured 1.36-1.54x (float32) and 0.94-1.00x (bfloat16) in the same hour: on this machine the same source moves
// by 10-20% with where the code lands, so these figures bound what the change does rather than measure it. (The
// first gains measured for it, float32 mean 1.34-1.54x -> 1.21-1.32x, were against a build instrumented with
// run-time prefetch switches, which had made the old loop slower.)
template <int64_t kStep, typename scalar_t, typename Step>
[[gnu::always_inline]] inline void for_each_step(const scalar_t* ahead, int64_t* at, int64_t n, const Step& step) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(scalar_t));
  int64_t i = *at;
  if constexpr (kLine % kStep == 0) {
    if (i % kLine == 0) {
      for (; i + kLine <= n; i += kLine) {
        prefetch_read(ahead + i);
#pragma GCC unroll 8
        for (int64_t j = 0; j < kLine; j += kStep) {
          step(i + j);
        }
      }
    }
  }
  for (; i + kStep <= n; i += kStep) {
    prefetch_line(ahead, i);
    step(i);
  }
  *at = i;
}

template <typename scalar_t>
struct SumReducer {
  using acc = acc_t<scalar_t>;
  using V = Vec<acc>;
  alignas(64) acc sum[kMaxBlock];
  alignas(64) double total[kMaxBlock];
  double unscale = 1.0;  // total * unscale is the sum (resum_if_overflowed)
  int64_t n = 0;
  int64_t paired = 0;  // leading features of sum and total in pair order (bf16_pairs.h), else 0
  int run = 0;
  bool folded = false;  // whether total holds a run yet (finish)
  bool overflowed = false;  // float sums: whether a run's sum was inf or NaN (finish, resum_if_overflowed)

  // Where feature i is in sum and total. Contiguous bfloat16 rows are read in pair order: one load and two
  // instructions widen a pair block where load_widened() takes a load, a widening and a shift per vector. With
  // AVX2 that bound the mean of bfloat16 by instructions (1x32768x1024, one thread: 1.46x hidden.sum()'s time).
  int64_t slot(int64_t i) const {
    return i < paired ? pair_index(i) : i;
  }

  void init(const scalar_t* row, int64_t stride, int64_t width, int64_t /*l*/) {
    n = width;
    int64_t i = 0;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      paired = reads_pairs<scalar_t>(stride) ? n / kPairBlock * kPairBlock : 0;
      for (; i < paired; i += kPairBlock) {
        const Pairs p = load_pairs(row + i);
        p.even.store(sum + i);
        p.odd.store(sum + i + kPairBlock / 2);
      }
    }
    for (; i < n; ++i) {
      sum[i] = static_cast<acc>(row[i * stride]);
    }
    folded = false;
    overflowed = false;
    run = 1;
  }

  // Rows pool_forward hands over together (add_rows): four of float32 or float64 (see kFoldRows), else one.
  static constexpr int kRowsTogether = sizeof(scalar_t) >= 4 ? 4 : 1;

  // Starts from zero sums, where the rows then come kRowsTogether at a time (init() takes the first row instead).
  void start(int64_t width) {
    n = width;
    std::fill_n(sum, n, acc(0));
    folded = false;
    overflowed = false;
    run = 0;
  }

  // Adds kRowsTogether rows r[0..3] as (r0 + r1) + (r2 + r3), read side by side; where the kernels prefetch into L2
  // only, the next four rows, ahead[0..3], are prefetched a line per line read.
  void add_rows(const scalar_t* const* r, const scalar_t* const* ahead, int64_t stride, int64_t width) {
    static_assert(kRowsTogether == 4 && sizeof(scalar_t) >= 4, "16-bit rows (pair order) go one at a time");
    int64_t i = 0;
    if (stride == 1) {
      for (; i + V::size() <= width; i += V::size()) {
        if (!prefetches_into_l1<scalar_t>()) {  // see kFoldRows
          for (int k = 0; k < 4; ++k) {
            prefetch_line(ahead[k], i);
          }
        }
        const V group = (V::loadu(r[0] + i) + V::loadu(r[1] + i)) + (V::loadu(r[2] + i) + V::loadu(r[3] + i));
        (V::loadu(sum + i) + group).store(sum + i);
      }
    }
    for (; i < width; ++i) {
      sum[i] += (static_cast<acc>(r[0][i * stride]) + static_cast<acc>(r[1][i * stride])) +
                (static_cast<acc>(r[2][i * stride]) + static_cast<acc>(r[3][i * stride]));
    }
    run += kRowsTogether;
    if (run >= kFoldRows) {
      finish();
    }
  }

  void add_row(const scalar_t* row, int64_t /*l*/, int64_t stride, int64_t width, const scalar_t* ahead) {
    int64_t i = 0;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      for_each_step<kPairBlock>(ahead, &i, paired, [&](int64_t j) __attribute__((always_inline)) {
        const Pairs p = load_pairs(row + j);
        (V::loadu(sum + j) + p.even).store(sum + j);
        (V::loadu(sum + j + kPairBlock / 2) + p.odd).store(sum + j + kPairBlock / 2);
      });
    }
    if (stride == 1) {
      for_each_step<V::size()>(ahead, &i, width, [&](int64_t j) __attribute__((always_inline)) {
        (V::loadu(sum + j) + load_widened(row + j)).store(sum + j);
      });
    }
    for (; i < width; ++i) {
      sum[i] += static_cast<acc>(row[i * stride]);
    }
    if (++run >= kFoldRows) {
      finish();
    }
  }

  // Four 16-bit rows, each added as add_row() adds it (the same additions in the same order, so the same bits), with
  // the sums of each stretch of features kept in registers across the four rather than loaded and stored per row.
  // The driver calls it only where the four stay within the run (see kFoldRows). ahead[k]: the rows to prefetch.
  static constexpr bool kAddsFourRows = sizeof(scalar_t) == 2;
  void add_four_rows(const scalar_t* const* r, const scalar_t* const* ahead, int64_t stride, int64_t width) {
    int64_t i = 0;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      for (; i < paired; i += kPairBlock) {
        V even = V::loadu(sum + i), odd = V::loadu(sum + i + kPairBlock / 2);
        for (int k = 0; k < 4; ++k) {
          prefetch_read(ahead[k] + i);
          const Pairs p = load_pairs(r[k] + i);
          even = even + p.even;
          odd = odd + p.odd;
        }
        even.store(sum + i);
        odd.store(sum + i + kPairBlock / 2);
      }
    }
    if (stride == 1) {
      for (; i + V::size() <= width; i += V::size()) {
        V s = V::loadu(sum + i);
        for (int k = 0; k < 4; ++k) {
          prefetch_line(ahead[k], i);
          s = s + load_widened(r[k] + i);
        }
        s.store(sum + i);
      }
    }
    for (; i < width; ++i) {
      acc s = sum[i];
      for (int k = 0; k < 4; ++k) {
        s += static_cast<acc>(r[k][i * stride]);
      }
      sum[i] = s;
    }
    run += 4;
    if (run >= kFoldRows) {
      finish();
    }
  }

  // Folds the current run into the total; the driver calls it with last after the text's last row, when the sums
  // need not be zeroed for another run (init and start set them). The first run is the total: 0.0 + run, the bits a
  // zeroed total would give (-0.0 becomes +0.0) without zeroing it first. (Zeroing it per task was a quarter of the
  // time of a mean over 16384 texts of two tokens: a text's total is twice its row's bytes.) Float runs are checked
  // for inf and NaN here, in float lanes: a float64 total of float runs is finite exactly when they all are.
  void finish(bool last = false) {
    if constexpr (!std::is_same_v<acc, double>) {
      overflowed = overflowed || !all_finite(sum, n);
    }
    for (int64_t i = 0; i < n; ++i) {  // vectorised by the compiler (the test unswitched): widen, add
      total[i] = (folded ? total[i] : 0.0) + static_cast<double>(sum[i]);
    }
    if (!last) {
      std::fill_n(sum, n, acc(0));
    }
    folded = true;
    run = 0;
  }

  // dst[0, n) = the mean of a text of `count` rows that is this one chunk, in natural order, rounded to out_t. Float
  // sums (rows of 16 and 32 bits) are multiplied by 1 / count in float64, rounded to float, un-paired and narrowed a
  // vector at a time; a division per feature (one at a time in pair order) cost a text of 768 features about a
  // microsecond, as much as 60 bfloat16 rows (32 texts of one token: 45 us a call). The product is within 2^-52 of
  // the quotient, so the float it rounds to is the quotient's but where that lies that close to a midpoint between
  // two floats. Float64 sums are divided, correctly rounded, as before (and unscaled: resum_if_overflowed).
  template <typename out_t>
  void write_mean(int64_t count, out_t* dst) const {
    if constexpr (std::is_same_v<acc, double>) {
      for (int64_t i = 0; i < n; ++i) {
        dst[i] = static_cast<out_t>(total[i] / static_cast<double>(count) * unscale);
      }
    } else {
      static_assert(kResumShrink<acc> == 1.0, "float sums are never scaled");
      const double reciprocal = 1.0 / static_cast<double>(count);
      alignas(64) float slotted[kMaxBlock];  // the means in slot order
      for (int64_t i = 0; i < n; ++i) {  // vectorised by the compiler: multiply, narrow
        slotted[i] = static_cast<float>(total[i] * reciprocal);
      }
      alignas(64) float natural[kMaxBlock];
      const float* means = slotted;
      if (paired > 0) {
        from_pair_order(slotted, natural, paired, [](float mean) { return mean; });
        std::copy(slotted + paired, slotted + n, natural + paired);
        means = natural;
      }
      if constexpr (std::is_same_v<out_t, float>) {
        std::copy(means, means + n, dst);
      } else {
        store_narrowed(means, dst, n);
      }
    }
  }

  // After finish(): where a total is not finite, the chunk's rows summed again, straight in float64. A float32 run
  // overflows on values near float32's maximum, which bfloat16 shares, though their mean is finite; in float64 it
  // cannot. Float64 rows near float64's maximum are summed scaled by 2^-10 (exactly, but for subnormal values),
  // which keeps a chunk's kChunkRows rows finite, and unscale carries the factor back: the caller divides by the
  // row count before unscaling. Only such values, or inputs that are inf or NaN (which stay so), take this read.
  void resum_if_overflowed(const scalar_t* block, int64_t stride_l, int64_t stride_d, const ChunkRows& chunk) {
    if (std::is_same_v<acc, double> ? all_finite(total, n) : !overflowed) {
      return;
    }
    constexpr double shrink = kResumShrink<acc>;
    unscale = 1.0 / shrink;
    std::fill_n(total, n, 0.0);
    chunk.each([&](int64_t l) {
      for (int64_t i = 0; i < n; ++i) {
        total[slot(i)] += static_cast<double>(block[l * stride_l + i * stride_d]) * shrink;
      }
    });
  }
};

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// 16-bit floats (bfloat16, float16) compared as 16-bit integers: order_keys maps a value's bits to an int16 whose
// order is the value's, -0 and +0 equal, every NaN one key above +inf (so the first NaN stays, as in torch.max).
// Twice the lanes of a float compare, with no widening, and positions as 16-bit ordinals within the chunk (a chunk
// holds kChunkRows rows). The maximum with its positions was bound by instructions with AVX2: one text of
// 32768 x 1024 took 1.9-2.3x hidden.sum() in bfloat16 and float16 as floats, 1.0-1.1x as keys.
typedef int16_t Keys __attribute__((vector_size(kVectorBytes)));
constexpr int64_t kKeyLanes = kVectorBytes / 2;
static_assert(kChunkRows <= 32768, "ordinals within a chunk are int16");

template <typename scalar_t>
constexpr int16_t kInfBits = std::is_same_v<scalar_t, c10::BFloat16> ? 0x7F80 : 0x7C00;

// The keys of kKeyLanes 16-bit floats at p: the magnitude, negated where the sign bit is set (so -0 is 0), and
// 0x7FFF for every NaN (a magnitude above infinity's).
template <typename scalar_t>
inline Keys order_keys(const scalar_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_loadu_si512(p);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi16(0x7FFF));
  const __m512i signed_magnitude = _mm512_mask_sub_epi16(magnitude, _mm512_movepi16_mask(bits),
                                                         _mm512_setzero_si512(), magnitude);
  const __mmask32 nan = _mm512_cmpgt_epi16_mask(magnitude, _mm512_set1_epi16(kInfBits<scalar_t>));
  return reinterpret_cast<Keys>(_mm512_mask_mov_epi16(signed_magnitude, nan, _mm512_set1_epi16(0x7FFF)));
#else
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi16(0x7FFF));
  const __m256i nan = _mm256_cmpgt_epi16(magnitude, _mm256_set1_epi16(kInfBits<scalar_t>));
  // nan ^ 0x8000: 0x7FFF where NaN, the smallest int16 elsewhere; the maximum with it lifts only the NaNs.
  return reinterpret_cast<Keys>(_mm256_max_epi16(_mm256_sign_epi16(magnitude, bits),
                                                 _mm256_xor_si256(nan, _mm256_set1_epi16(-0x8000))));
#endif
}

// Keeps the larger key and its row's ordinal, lane by lane; ties keep the earlier row.
inline void keep_key(Keys& kept, Keys& at, Keys x, Keys ordinal) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask32 take = _mm512_cmpgt_epi16_mask(reinterpret_cast<__m512i>(x), reinterpret_cast<__m512i>(kept));
  at = reinterpret_cast<Keys>(
      _mm512_mask_mov_epi16(reinterpret_cast<__m512i>(at), take, reinterpret_cast<__m512i>(ordinal)));
  kept = reinterpret_cast<Keys>(_mm512_max_epi16(reinterpret_cast<__m512i>(x), reinterpret_cast<__m512i>(kept)));
#else
  const Keys take = x > kept;
  at = take ? ordinal : at;
  kept = reinterpret_cast<Keys>(_mm256_max_epi16(reinterpret_cast<__m256i>(x), reinterpret_cast<__m256i>(kept)));
#endif
}

template <typename scalar_t>
constexpr bool kKeyed = std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>;
#else
template <typename scalar_t>
constexpr bool kKeyed = false;
#endif

// Keeps the largest value and its first position (see keep_max). Positions live in integer lanes as wide as the
// accumulator lanes (int32 beside float, int64 beside double), so that one mask moves them with the values. The
// leading whole vectors of contiguous 16-bit rows go by order_keys instead (AVX2, AVX-512) until finish(), which
// reads each kept value back from its row (so a -0 kept for a tie with 0 keeps its sign).
template <typename scalar_t>
struct MaxReducer {
  static constexpr int kRowsTogether = 1;  // see kFoldRows
  static constexpr bool kAddsFourRows = false;
  using acc = acc_t<scalar_t>;
  using V = Vec<acc>;
  using index_t = same_size_int<acc>;
  using Where = Vec<index_t>;
  alignas(64) acc best[kMaxBlock];
  alignas(64) index_t where[kMaxBlock];
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  int64_t keyed = 0;  // leading features kept as keys (a multiple of kKeyLanes), else 0
  alignas(64) int16_t key[kKeyed<scalar_t> ? kMaxBlock : 1];
  alignas(64) int16_t ordinal[kKeyed<scalar_t> ? kMaxBlock : 1];  // the kept row's place in the chunk
  const scalar_t* row_at[kKeyed<scalar_t> ? kChunkRows : 1];      // the chunk's rows and positions, by ordinal
  int64_t position_at[kKeyed<scalar_t> ? kChunkRows : 1];
  int64_t rows_seen = 0;
#endif

  void finish(bool /*last*/ = false) {  // (as SumReducer's: the driver's call after a chunk's last row)
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    for (int64_t i = 0; i < keyed; ++i) {
      best[i] = static_cast<acc>(row_at[ordinal[i]][i]);
      where[i] = static_cast<index_t>(position_at[ordinal[i]]);
    }
    keyed = 0;
#endif
  }

  void init(const scalar_t* row, int64_t stride, int64_t n, int64_t l) {
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    if constexpr (kKeyed<scalar_t>) {
      keyed = stride == 1 ? n / kKeyLanes * kKeyLanes : 0;
      for (; i < keyed; i += kKeyLanes) {
        const Keys keys = order_keys(row + i);
        std::memcpy(key + i, &keys, sizeof keys);
      }
      std::fill_n(ordinal, keyed, int16_t{0});
      row_at[0] = row;
      position_at[0] = l;
      rows_seen = 1;
    }
#endif
    for (; i < n; ++i) {
      best[i] = static_cast<acc>(row[i * stride]);
      where[i] = static_cast<index_t>(l);
    }
  }

  void add_row(const scalar_t* row, int64_t l, int64_t stride, int64_t n, const scalar_t* ahead) {
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    if constexpr (kKeyed<scalar_t>) {
      if (keyed > 0) {
        row_at[rows_seen] = row;
        position_at[rows_seen] = l;
        const Keys ordinal_of_row = Keys{} + static_cast<int16_t>(rows_seen++);
        for_each_step<kKeyLanes>(ahead, &i, keyed, [&](int64_t j) __attribute__((always_inline)) {
          Keys kept, at;
          std::memcpy(&kept, key + j, sizeof kept);
          std::memcpy(&at, ordinal + j, sizeof at);
          keep_key(kept, at, order_keys(row + j), ordinal_of_row);
          std::memcpy(key + j, &kept, sizeof kept);
          std::memcpy(ordinal + j, &at, sizeof at);
        });
      }
    }
#endif
    if (stride == 1) {
      const Where position(static_cast<index_t>(l));
      for_each_step<V::size()>(ahead, &i, n, [&](int64_t j) __attribute__((always_inline)) {
        V m = V::loadu(best + j);
        Where w = Where::loadu(where + j);
        keep_max(m, w, load_widened(row + j), position);
        m.store(best + j);
        w.store(where + j);
      });
    }
    for (; i < n; ++i) {
      const acc x = static_cast<acc>(row[i * stride]);
      if (takes_over(x, best[i])) {
        best[i] = x;
        where[i] = static_cast<index_t>(l);
      }
    }
  }
};

// Shared driver of the forward kernels: runs a Reducer over every (text, chunk, feature block) task of the listed
// rows (for_each_chunk), one row after another (init() the first, add_row() the rest, or add_four_rows() four at a
// time within a run where the Reducer has it: see kFoldRows on why not in groups, as attention's reducers take them)
// or, where the Reducer takes kRowsTogether > 1 rows at a time, from start() in groups of that many (add_rows) and
// the rest one by one; it hands the reduced block to chunk_done(b, chunk, d0, n, reducer, rows), rows being the
// text's selected row count; then combine(b, d0, n, rows) finishes the texts of several chunks.
template <typename scalar_t, typename Reducer, typename ChunkDone, typename Combine>
void pool_forward(const Tensor& hidden, const RowList& list, const ChunkPlan& plan, const ChunkDone& chunk_done,
                  const Combine& combine) {
  const int64_t batch = hidden.size(0), dim = hidden.size(2);
  const int64_t sb = hidden.stride(0), sl = hidden.stride(1), sd = hidden.stride(2);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  for_each_chunk(plan, list, dim, 1, [&](int64_t b, int64_t chunk, int64_t d0, int64_t n, const ChunkRows& rows) {
    Reducer reducer;
    const scalar_t* block = h + b * sb + d0 * sd;
    if (rows.begin < rows.end) {
      int64_t j = rows.begin;
      const scalar_t* last_row = block + list.row(b, rows.end - 1) * sl;
      const auto ahead_of = [&](int64_t at) { return row_to_prefetch(list, batch, b, at, block, sb, sl, last_row); };
      // Selected rows j to j + 3 into four, and the four after them into ahead, to prefetch: add_rows() and
      // add_four_rows() take rows four at a time.
      const auto four_rows = [&](int64_t j, const scalar_t** four, const scalar_t** ahead) {
        for (int k = 0; k < 4; ++k) {
          four[k] = block + rows.list->row(b, j + k) * sl;
          ahead[k] = ahead_of(j + 4 + k);
        }
      };
      if constexpr (Reducer::kRowsTogether > 1) {
        static_assert(Reducer::kRowsTogether == 4, "add_rows takes four rows");
        reducer.start(n);
        for (; j + 4 <= rows.end; j += 4) {
          const scalar_t* four[4];
          const scalar_t* ahead[4];
          four_rows(j, four, ahead);
          reducer.add_rows(four, ahead, sd, n);
        }
      } else {
        const int64_t first = rows.list->row(b, j++);
        reducer.init(block + first * sl, sd, n, first);
      }
      // Adds selected row j alone, prefetching the row prefetch_rows() on (ahead_of).
      const int64_t distance = prefetch_rows<scalar_t>();
      const auto add_one = [&](int64_t j) {
        const int64_t l = rows.list->row(b, j);
        reducer.add_row(block + l * sl, l, sd, n, ahead_of(j + distance));
      };
      if constexpr (Reducer::kAddsFourRows) {
        while (j + 4 <= rows.end) {
          if (reducer.run + 4 > kFoldRows) {  // singly up to the run's end, which then starts at 0 (four fit)
            add_one(j++);
            continue;
          }
          const scalar_t* four[4];
          const scalar_t* ahead[4];
          four_rows(j, four, ahead);
          reducer.add_four_rows(four, ahead, sd, n);
          j += 4;
        }
      }
      for (; j < rows.end; ++j) {
        add_one(j);
      }
      reducer.finish(/*last=*/true);
      if constexpr (std::is_same_v<Reducer, SumReducer<scalar_t>>) {
        reducer.resum_if_overflowed(block, sl, sd, rows);
      }
    }
    chunk_done(b, chunk, d0, n, reducer, list.rows(b));
  });
  for_each_text(list, batch, dim, 1, kChunkRows + 1,
                [&](int64_t b, int64_t d0, int64_t n) { combine(b, d0, n, list.rows(b)); });
}

template <typename scalar_t, typename out_t>
void mean_forward_typed(const Tensor& hidden, const RowSelection& rows, Tensor& out) {
  const int64_t batch = hidden.size(0), dim = hidden.size(2);
  const RowListing listing = list_rows(rows, batch, hidden.size(1));
  const RowList& list = listing.view;
  const ChunkPlan plan(list, batch);
  // The chunks' shares of the mean (chunk sum / the text's row count) of texts with several chunks, added in chunk
  // order. Shares rather than sums: each is at most the largest value, and so is every partial sum of them, so
  // float64 rows near float64's maximum give a finite mean wherever it is finite.
  const CallScratch<double, 0> partial(plan.slots() * dim);
  out_t* o = out.mutable_data_ptr<out_t>();
  pool_forward<scalar_t, SumReducer<scalar_t>>(
      hidden, list, plan,
      [&](int64_t b, int64_t chunk, int64_t d0, int64_t n, const SumReducer<scalar_t>& r, int64_t count) {
        if (count == 0) {
          std::fill_n(o + b * dim + d0, n, out_t(0));
          return;
        }
        const auto share = [&](int64_t i) { return r.total[r.slot(i)] / static_cast<double>(count) * r.unscale; };
        if (count <= kChunkRows) {  // the only chunk: finish here
          r.write_mean(count, o + b * dim + d0);
        } else {
          double* dst = partial.data() + plan.slot(b, chunk) * dim + d0;
          for (int64_t i = 0; i < n; ++i) {
            dst[i] = share(i);
          }
        }
      },
      [&](int64_t b, int64_t d0, int64_t n, int64_t count) {
        const double* first = partial.data() + plan.slot(b, 0) * dim + d0;
        std::vector<wide_t<scalar_t>> total(first, first + n);
        for (int64_t c = 1; c * kChunkRows < count; ++c) {
          const double* p = partial.data() + plan.slot(b, c) * dim + d0;
          for (int64_t i = 0; i < n; ++i) {
            total[i] += p[i];
          }
        }
        out_t* dst = o + b * dim + d0;
        for (int64_t i = 0; i < n; ++i) {
          dst[i] = static_cast<out_t>(total[i]);
        }
      });
}

template <typename scalar_t>
void max_forward_typed(const Tensor& hidden, const RowSelection& rows, Tensor& out, Tensor& argmax) {
  using acc = acc_t<scalar_t>;
  using index_t = same_size_int<acc>;
  const int64_t batch = hidden.size(0), dim = hidden.size(2);
  const RowListing listing = list_rows(rows, batch, hidden.size(1));
  const RowList& list = listing.view;
  const ChunkPlan plan(list, batch);
  const CallScratch<acc, 0> partial(plan.slots() * dim);
  const CallScratch<index_t, 1> partial_where(plan.slots() * dim);
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  int32_t* a = argmax.mutable_data_ptr<int32_t>();
  pool_forward<scalar_t, MaxReducer<scalar_t>>(
      hidden, list, plan,
      [&](int64_t b, int64_t chunk, int64_t d0, int64_t n, const MaxReducer<scalar_t>& r, int64_t count) {
        if (count <= kChunkRows) {  // the only chunk: finish here
          scalar_t* dst = o + b * dim + d0;
          int32_t* pos = a + b * dim + d0;
          for (int64_t i = 0; i < n; ++i) {
            // The kept value is one of the inputs, so narrowing it back is exact.
            dst[i] = count == 0 ? scalar_t(0) : static_cast<scalar_t>(r.best[i]);
            pos[i] = count == 0 ? -1 : static_cast<int32_t>(r.where[i]);
          }
        } else {
          std::copy_n(r.best, n, partial.data() + plan.slot(b, chunk) * dim + d0);
          std::copy_n(r.where, n, partial_where.data() + plan.slot(b, chunk) * dim + d0);
        }
      },
      [&](int64_t b, int64_t d0, int64_t n, int64_t count) {
        // Chunks in order, with keep_max's rules: a later chunk wins only with a greater value or a first NaN.
        for (int64_t i = 0; i < n; ++i) {
          acc best = partial.data()[plan.slot(b, 0) * dim + d0 + i];
          index_t where = partial_where.data()[plan.slot(b, 0) * dim + d0 + i];
          for (int64_t c = 1; c * kChunkRows < count; ++c) {
            const acc x = partial.data()[plan.slot(b, c) * dim + d0 + i];
            if (takes_over(x, best)) {
              best = x;
              where = partial_where.data()[plan.slot(b, c) * dim + d0 + i];
            }
          }
          o[b * dim + d0 + i] = static_cast<scalar_t>(best);
          a[b * dim + d0 + i] = static_cast<int32_t>(where);
        }
      });
}

void mean_forward(const Tensor& hidden, const RowSelection& rows, Tensor& out) {
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "mean_pool", [&] {
    if (out.scalar_type() == hidden.scalar_type()) {
      mean_forward_typed<scalar_t, scalar_t>(hidden, rows, out);
    } else {
      mean_forward_typed<scalar_t, acc_t<scalar_t>>(hidden, rows, out);
    }
  });
}

void max_forward(const Tensor& hidden, const RowSelection& rows, Tensor& out, Tensor& argmax) {
  LMK_DISPATCH_FLOATING(
      hidden.scalar_type(), "max_pool", [&] { max_forward_typed<scalar_t>(hidden, rows, out, argmax); });
}

// Backward of max: grad_hidden[b, l, d] = grad[b, d] where argmax[b, d] == l, else 0. Split over (b, l) rows, each
// row written once, whole and in order. Only bits are moved (zero is all-zero bits in every float dtype), so the
// select runs on unsigned words of the element's width, which the compiler vectorises for this capability. With
// offsets (a packed batch), row t is text b's position t - offsets[b] (as mean_backward finds its text).
template <typename word_t>
void max_backward_words(const Tensor& grad, const Tensor& argmax, const Tensor& offsets, Tensor& grad_hidden) {
  const int64_t seq_len = grad_hidden.size(1), dim = grad_hidden.size(2), texts = grad.size(0);
  const auto* g = static_cast<const word_t*>(grad.const_data_ptr());
  const int32_t* a = argmax.const_data_ptr<int32_t>();
  const int64_t* starts = offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr;
  auto* out = static_cast<word_t*>(grad_hidden.mutable_data_ptr());
  const int64_t grain = std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, dim));
  torch::stable::parallel_for(0, grad_hidden.size(0) * seq_len, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = starts == nullptr ? row / seq_len
                                          : std::upper_bound(starts, starts + texts + 1, row) - starts - 1;
      const auto l = static_cast<int32_t>(starts == nullptr ? row % seq_len : row - starts[b]);
      const word_t* gb = g + b * dim;
      const int32_t* ab = a + b * dim;
      word_t* dst = out + row * dim;
      for (int64_t d = 0; d < dim; ++d) {
        dst[d] = ab[d] == l ? gb[d] : word_t(0);
      }
    }
  });
}

void max_backward(const Tensor& grad, const Tensor& argmax, const Tensor& offsets, Tensor& grad_hidden) {
  switch (grad.element_size()) {
    case 2:
      return max_backward_words<uint16_t>(grad, argmax, offsets, grad_hidden);
    case 4:
      return max_backward_words<uint32_t>(grad, argmax, offsets, grad_hidden);
    default:
      return max_backward_words<uint64_t>(grad, argmax, offsets, grad_hidden);
  }
}

}  // namespace

const Kernels& kernels() {
  // The row-copying and bookkeeping kernels (cpu/rows.cpp) gain nothing from wider vectors and are compiled once.
  static const Kernels k{cpu::check_range,    &mean_forward,        &max_forward,       cpu::grad_over_counts,
                         cpu::mean_backward,
                         &max_backward,       cpu::gather_forward, cpu::gather_backward, &attention_forward,
                         &attention_backward, cpu::find_rows,     cpu::shift_rows,
                         cpu::packed_offsets, &normalize_rows};
  return k;
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
