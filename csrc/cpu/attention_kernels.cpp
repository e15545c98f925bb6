// Vectorised CPU kernels of attention pooling. Compiled once per CPU capability, like pool_kernels.cpp.
//
// Work split (forward and backward): each text's valid rows are cut into chunks (kChunkRows, kernel_common.h), and
// tasks are (text, chunk, block of whole heads), so one long text is spread over every thread; a second pass merges
// the chunks of each text of several in chunk order (a text of one chunk is finished by its chunk's task). Every
// (text, head) result depends only on that text's valid rows, taken in order, so a text pools to the same bits alone
// or in a batch, whatever the padding side or the thread count.
//
// Forward, per chunk: one pass over the chunk's rows with an online softmax, a group of rows at a time. The group's
// rows get their scores for every head of the block (each row read front to back once), per head the running
// maximum moves up if a score passes it (rescaling the running total and the weighted row sum once per group), the
// group's weights exp(score - max) are taken together, then each head's slices of the rows are added with their
// weights (from cache). Nothing can overflow: every exponent is <= 0. Sums run in float32 over kFoldRows rows and
// are folded into float64, and the chunks' (max, total, weighted sum) are merged in float64, so the error does not
// grow with L. Only the softmax statistics are kept for the backward: per text and head the maximum score and the
// sum of exp(score - max).
//
// Backward: with p_l = exp(s_l - max) / sum and a_l = <g, x_l> (+ the gradient of the returned weight), the score
// gradient is p_l (a_l - delta) with delta = sum_l p_l a_l. Written that way it cancels badly in float32 when the
// states share a large common part, so the backward works relative to the forward's output m (the weighted mean of
// the rows, so delta = <g, m> + sum_l p_l gw_l): with e_l = <g, x_l - m> + gw_l and S = sum_l p_l e_l, the score
// gradient is p_l (e_l - S), and the query gradient scale * sum_l p_l (e_l - S) x_l equals
// scale * (sum_l p_l e_l (x_l - m) - S sum_l p_l (x_l - m)), every term small where the rows agree. A first pass
// over the chunks reads each valid row once and keeps p_l, e_l and the chunk's sums; a second merges the chunks per
// text (S, the text's share of the query gradient); a third writes every row of grad_hidden,
// p_l g + scale p_l (e_l - S) q (zeros for the padding), split over rows, without reading hidden again. A chunk
// whose sums overflow (rows near float32's or float64's maximum) is summed again wider (redo_wide).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "cpu/attention_kernels.h"
#include "cpu/bf16_pairs.h"
#include "cpu/exp.h"
#include "cpu/kernel_common.h"
#include "cpu/row_bytes.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {
namespace {

// Prefetches (prefetch_read) the cache lines of p[i, i + kSpan) (nothing where p is null): a dot product over a row
// prefetches a row read soon after, a line for each line it reads, so the requests are spread out. (A burst of a
// whole row's lines ahead of the dot stalled on the full fill buffers.) Into L1 (prefetcht0) rather than the outer
// caches (prefetcht2), which Zen 4 takes instead (prefetches_into_l1, kernels_dispatch.cpp): on Zen 5, 2 threads,
// seven runs in alternating processes, time over hidden.sum()'s, float32 one head 1x32768x1024 1.17-1.47x ->
// 1.11-1.46x (faster in six runs of seven), 32x512x768 1.41-2.22x -> 1.25-1.93x, bfloat16 with 12 or 16 heads no
// worse.
template <int64_t kSpan, typename scalar_t>
[[gnu::always_inline]] inline void prefetch_span(const scalar_t* p, int64_t i) {
  if (p != nullptr) {
    constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t j = 0; j < kSpan; j += kLine) {
      prefetch_read(p + i + j);
    }
  }
}

// What a pass over rows prefetches, ahead(i, r, span): the span elements it prefetches as row r's features
// [i, i + span) are read (every row's pass steps by span). RowAhead: one row, the same features of `row` (null:
// none).
template <typename scalar_t>
struct RowAhead {
  const scalar_t* row;
  const scalar_t* operator()(int64_t i, int, int64_t) const {
    return row != nullptr ? row + i : nullptr;
  }
};

// R rows read together: their R prefetch rows (each `features` long) taken as one stream from element `base` on,
// the pass's stretch at i being the next R spans of it. The stream's element e < R * features is found in row
// e / features by subtraction: a 64-bit division per prefetched span (the divisor is not a constant) cost the
// two-row score pass of 16 heads of 64 in float32 about as much as its multiply-adds. Where the rows lie one after
// another in memory (`flat`, their first; consecutive rows of a contiguous text, the common case), e is simply
// flat + e.
template <int R, typename scalar_t>
struct SequentialAhead {
  const scalar_t* const* rows;
  const scalar_t* flat;
  int64_t features;
  int64_t base;
  const scalar_t* operator()(int64_t i, int r, int64_t span) const {
    int64_t e = base + i * R + r * span;
    if (flat != nullptr) {
      return flat + e;
    }
    int row = 0;
    for (; row + 1 < R && e >= features; ++row) {
      e -= features;
    }
    return rows[row] + e;
  }
};

// <x, y> over n features, or with kCentred <x - m, y> (m and y contiguous), for R contiguous rows x[r] at once:
// the rows share the loads of m and y (the query in L1 otherwise took as many loads as the rows). Each row's four
// independent accumulator chains hide the FMA latency, and its whole vectors' products come back as one vector of
// partial sums, out[r] (the remaining features are the caller's: dots()). A row's partial sums are taken in the same
// order whatever R, so a score has the same bits however many rows were scored with it. ahead: what to prefetch
// (prefetch_span; RowAhead, SequentialAhead).
template <int R, bool kCentred, typename scalar_t, typename Ahead>
[[gnu::always_inline]] inline void partial_dots(const scalar_t* const* x, const acc_t<scalar_t>* m,
                                                const acc_t<scalar_t>* y, int64_t n, const Ahead& ahead,
                                                Vec<acc_t<scalar_t>>* out) {
  using V = Vec<acc_t<scalar_t>>;
  constexpr int64_t W = V::size();
  const auto load = [&](int r, int64_t i) {
    if constexpr (kCentred) {
      return load_widened(x[r] + i) - V::loadu(m + i);
    } else {
      return load_widened(x[r] + i);
    }
  };
  V s[R][4];
  for (int r = 0; r < R; ++r) {
    s[r][0] = s[r][1] = s[r][2] = s[r][3] = V(0);
  }
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    for (int r = 0; r < R; ++r) {
      prefetch_span<4 * W>(ahead(i, r, 4 * W), 0);
    }
    for (int u = 0; u < 4; ++u) {
      const V yu = V::loadu(y + i + u * W);
      for (int r = 0; r < R; ++r) {
        s[r][u] = fmadd(load(r, i + u * W), yu, s[r][u]);
      }
    }
  }
  for (; i + W <= n; i += W) {
    const V yi = V::loadu(y + i);
    for (int r = 0; r < R; ++r) {
      s[r][0] = fmadd(load(r, i), yi, s[r][0]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = (s[r][0] + s[r][1]) + (s[r][2] + s[r][3]);
  }
}

// out[r * out_stride] = <x[r], y>, or with kCentred <x[r] - m, y>, for R contiguous rows at once (partial_dots).
template <int R, bool kCentred, typename scalar_t, typename Ahead>
inline void dots(const scalar_t* const* x, const acc_t<scalar_t>* m, const acc_t<scalar_t>* y, int64_t n,
                 const Ahead& prefetch, acc_t<scalar_t>* out, int64_t out_stride) {
  using acc = acc_t<scalar_t>;
  using V = Vec<acc>;
  const int64_t whole = n / V::size() * V::size();
  V partials[R];
  partial_dots<R, kCentred>(x, m, y, whole, prefetch, partials);
  for (int r = 0; r < R; ++r) {
    acc total = sum_lanes(partials[r]);
    for (int64_t i = whole; i < n; ++i) {
      const auto xi = static_cast<acc>(x[r][i]);
      total += (kCentred ? xi - m[i] : xi) * y[i];
    }
    out[r * out_stride] = total;
  }
}

// <x, y>, or with kCentred <x - m, y>, feature i of x at x[i * stride] (dots for a contiguous row).
template <bool kCentred, typename scalar_t>
inline acc_t<scalar_t> dot(const scalar_t* x, int64_t stride, const acc_t<scalar_t>* m, const acc_t<scalar_t>* y,
                           int64_t n, const scalar_t* prefetch = nullptr) {
  using acc = acc_t<scalar_t>;
  acc total = 0;
  if (stride == 1) {
    dots<1, kCentred>(&x, m, y, n, RowAhead<scalar_t>{prefetch}, &total, 1);
    return total;
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto xi = static_cast<acc>(x[i * stride]);
    total += (kCentred ? xi - m[i] : xi) * y[i];
  }
  return total;
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// The sums of eight 8-float vectors' lanes, as one (lane h: the sum of v[h]'s lanes), in hadd's order: adjacent
// lanes first, then adjacent pairs, then the two 128-bit halves.
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

#if defined(CPU_CAPABILITY_AVX512)
// a + b with a's and b's lanes chosen by two-source shuffles, once each way: even/odd picks (of 128-bit quarters
// with Quarters, of lanes within each quarter otherwise), so that every lane of the result adds two of the same
// vector's lanes.
template <int kEven, int kOdd, bool Quarters>
[[gnu::always_inline]] inline __m512 add_shuffled(__m512 a, __m512 b) {
  if constexpr (Quarters) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, kEven), _mm512_shuffle_f32x4(a, b, kOdd));
  } else {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, kEven), _mm512_shuffle_ps(a, b, kOdd));
  }
}
#endif

// The sums of Vec<float>::size() vectors' lanes, as one vector (lane h: the sum of v[h]'s lanes); an AVX-512
// vector's two halves are added first.
inline Vec<float> sum_lanes_each(const Vec<float>* v) {
#if defined(CPU_CAPABILITY_AVX512)
  // A tree of two-source shuffles and adds, each level halving the vectors (45 instructions where 256-bit halves
  // and hadd took 75, a fifth of a 16-head row's score pass): the halves of two vectors (lanes i and i + 8), then
  // adjacent lanes, adjacent pairs, and the two 128-bit quarters that hold a vector's two quads, the additions of
  // sum_lanes_as_each in its order. The inputs are taken in the order that leaves lane h holding v[h]'s sum.
  constexpr int kOrder[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
  __m512 halves[8], lanes[4], pairs[2];
  for (int j = 0; j < 8; ++j) {
    halves[j] = add_shuffled<0x44, 0xEE, true>(v[kOrder[2 * j]].v, v[kOrder[2 * j + 1]].v);
  }
  for (int j = 0; j < 4; ++j) {
    lanes[j] = add_shuffled<0x88, 0xDD, false>(halves[2 * j], halves[2 * j + 1]);
  }
  for (int j = 0; j < 2; ++j) {
    pairs[j] = add_shuffled<0x88, 0xDD, false>(lanes[2 * j], lanes[2 * j + 1]);
  }
  return Vec<float>(add_shuffled<0x88, 0xDD, true>(pairs[0], pairs[1]));
#else
  __m256 lanes[8];
  for (int j = 0; j < 8; ++j) {
    lanes[j] = v[j].v;
  }
  return Vec<float>(sum_lanes8(lanes));
#endif
}

// One vector's lane of sum_lanes_each(), in the same order (a score gets the same bits whichever way its head is
// reduced, so whatever heads share its block): the AVX-512 halves added, then adjacent lanes, adjacent pairs, and
// the two 128-bit halves.
inline float sum_lanes_as_each(const Vec<float>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v.v), _mm512_extractf32x8_ps(v.v, 1));
#else
  const __m256 h = v.v;
#endif
  const __m256 lanes = _mm256_add_ps(h, _mm256_permute_ps(h, 0xB1));        // h0 + h1 at 0, h4 + h5 at 4, ...
  const __m256 pairs = _mm256_add_ps(lanes, _mm256_permute_ps(lanes, 0x4E));  // (h0 + h1) + (h2 + h3) at 0, ...
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
}
#endif

// partial_dots<R, false> of bfloat16 rows and a query in pair order (n a multiple of kPairBlock). With AVX-512 a
// narrow head of two pair blocks (64 features) is one chain of multiply-adds per row instead of four chains and
// three additions: the four rows scored together (kScoreRows) overlap their chains, and the additions were a fifth
// of such a head's score. (This and sum_lanes_each's tree, on a 2-core Intel Xeon, bfloat16 with 16 heads of 64,
// three rounds in alternating processes: one thread on 512x1024 in L2 147-150 -> 140-145 ns a row, 2 threads on
// 1x32768x1024 from memory 178-180 -> 169-174.) Not with AVX2, whose two rows' chains did not overlap enough: its
// heads of 32 in one chain took 212-215 -> 242-251 ns a row.
constexpr bool kChainNarrowHeads = kVectorBytes == 64;

template <int R, typename Ahead>
[[gnu::always_inline]] inline void partial_dots_pairs(const c10::BFloat16* const* x, const float* q, int64_t n,
                                                      const Ahead& ahead, Vec<float>* out) {
  using V = Vec<float>;
  constexpr int64_t kHalf = kPairBlock / 2;
  if (kChainNarrowHeads && n == 2 * kPairBlock) {  // one chain per row, the rows' chains independent
    for (int r = 0; r < R; ++r) {
      prefetch_span<2 * kPairBlock>(ahead(0, r, 2 * kPairBlock), 0);
    }
    const V q0 = V::loadu(q), q1 = V::loadu(q + kHalf), q2 = V::loadu(q + kPairBlock),
            q3 = V::loadu(q + kPairBlock + kHalf);
    for (int r = 0; r < R; ++r) {
      const Pairs a = load_pairs(x[r]), b = load_pairs(x[r] + kPairBlock);
      out[r] = fmadd(b.odd, q3, fmadd(b.even, q2, fmadd(a.odd, q1, a.even * q0)));
    }
    return;
  }
  V s[R][4];
  for (int r = 0; r < R; ++r) {
    s[r][0] = s[r][1] = s[r][2] = s[r][3] = V(0);
  }
  int64_t i = 0;
  for (; i + 2 * kPairBlock <= n; i += 2 * kPairBlock) {  // two blocks a round: four independent chains
    for (int r = 0; r < R; ++r) {
      prefetch_span<2 * kPairBlock>(ahead(i, r, 2 * kPairBlock), 0);
    }
    const V q0 = V::loadu(q + i), q1 = V::loadu(q + i + kHalf), q2 = V::loadu(q + i + kPairBlock),
            q3 = V::loadu(q + i + kPairBlock + kHalf);
    for (int r = 0; r < R; ++r) {
      const Pairs a = load_pairs(x[r] + i), b = load_pairs(x[r] + i + kPairBlock);
      s[r][0] = fmadd(a.even, q0, s[r][0]);
      s[r][1] = fmadd(a.odd, q1, s[r][1]);
      s[r][2] = fmadd(b.even, q2, s[r][2]);
      s[r][3] = fmadd(b.odd, q3, s[r][3]);
    }
  }
  if (i < n) {
    const V q0 = V::loadu(q + i), q1 = V::loadu(q + i + kHalf);
    for (int r = 0; r < R; ++r) {
      const Pairs a = load_pairs(x[r] + i);
      s[r][0] = fmadd(a.even, q0, s[r][0]);
      s[r][1] = fmadd(a.odd, q1, s[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = (s[r][0] + s[r][1]) + (s[r][2] + s[r][3]);
  }
}

// row_scores' second form: each score out[h] that is not finite again in float64, scaled, then rounded. Out of
// line: it runs only for rows near float32's maximum (or inf or NaN).
template <typename scalar_t>
[[gnu::noinline]] void rescore_in_float64(const scalar_t* x, int64_t stride, const float* q, int64_t heads,
                                          int64_t head_dim, float scale, bool pairs, float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    if (!(std::abs(out[h]) <= std::numeric_limits<float>::max())) {
      double wide = 0;
      for (int64_t i = h * head_dim; i < (h + 1) * head_dim; ++i) {
        wide += static_cast<double>(x[i * stride]) * static_cast<double>(q[pairs ? pair_index(i) : i]);
      }
      out[h] = static_cast<float>(wide * static_cast<double>(scale));
    }
  }
}

// Heads up to this wide are narrow: row_scores reduces them a vector's width at a time, and head_block_unit keeps
// that many in one feature block.
constexpr int64_t kNarrowHeadDim = 256;

// scale * <x_h, q_h> for each of `heads` heads (x_h: row r's slice of head h) of R rows x[r], into
// out[r * heads + h]; with `pairs` (use_pairs()) the query is in pair order. R > 1 only for contiguous rows
// (stride 1): they share the loads of the query (partial_dots). The forward and the backward both compute scores
// with this one function, and a row's score has the same bits whatever R, so a score recomputed in the backward has
// the bits it had in the forward. With AVX2 or AVX-512, narrow heads of whole vectors on a contiguous row reduce
// their partial sums a vector's width of heads at a time (8 or 16): one vector's horizontal sum costs as much as a
// 64-feature head's products otherwise. prefetch[r]: a contiguous row read soon after, or null; R rows prefetch
// their R rows as one stream (ahead_of).
template <int R, typename scalar_t>
inline void rows_scores(const scalar_t* const* x, int64_t stride, const acc_t<scalar_t>* q, int64_t heads,
                        int64_t head_dim, acc_t<scalar_t> scale, bool pairs, acc_t<scalar_t>* out,
                        const scalar_t* const* prefetch) {
  // Row r's slice of head `head`.
  const auto slices = [&](int64_t head, const scalar_t** xh) __attribute__((always_inline)) {
    for (int r = 0; r < R; ++r) {
      xh[r] = x[r] + head * head_dim * stride;
    }
  };
  const scalar_t* flat = nullptr;  // SequentialAhead's: the prefetch rows' first where they are consecutive
  if constexpr (R > 1) {
    flat = prefetch[0];
    for (int r = 1; r < R; ++r) {
      flat = prefetch[r] == prefetch[0] + r * heads * head_dim ? flat : nullptr;
    }
  }
  // What head `head`'s pass prefetches: one row, the same features of its prefetch row; several rows, the next
  // stretch of their prefetch rows taken one after another (rows interleaved, the reads; one stream, the prefetches).
  const auto ahead_of = [&](int64_t head) __attribute__((always_inline)) {
    if constexpr (R == 1) {
      return RowAhead<scalar_t>{prefetch[0] != nullptr ? prefetch[0] + head * head_dim : nullptr};
    } else {
      return SequentialAhead<R, scalar_t>{prefetch, flat, heads * head_dim, head * head_dim * R};
    }
  };
  int64_t h = 0;
  bool overflowed = false;  // a score not finite (see the end); heads [0, checked) are checked already
  int64_t checked = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t<scalar_t>, float>) {
    constexpr int64_t kLanes = Vec<float>::size();
    if (pairs || (stride == 1 && head_dim % kLanes == 0 && head_dim <= kNarrowHeadDim)) {
      // Head `head`'s partial sums of each row into dst[r], `width` its features: head_dim, or the same as a
      // constant (the common 64), so that the loops over its features unroll whole. This lambda and the next are
      // always inlined: when the file grew, GCC left this one a call per head and row, and 12 heads of 64 in
      // bfloat16 took 15-18% longer.
      const auto partial = [&](int64_t head, auto width, Vec<float>* dst) __attribute__((always_inline)) {
        const scalar_t* xh[R];
        slices(head, xh);
        const float* qh = q + head * head_dim;
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (pairs) {
            partial_dots_pairs<R>(xh, qh, width, ahead_of(head), dst);
            return;
          }
        }
        partial_dots<R, false>(xh, nullptr, qh, width, ahead_of(head), dst);
      };
      // A vector's width of heads at a time. The loop over them stays a loop: fully unrolled (the partials in
      // registers) it was as fast on rows in L2, but on rows from memory the row's loads no longer overlapped the
      // arithmetic. One long bfloat16 text with 16 heads of 64 (2 threads, Zen 5, time over hidden.sum()'s):
      // 1.7-3.0x -> 1.6-1.7x; one thread 2.4x -> 1.8-1.9x; float32 unchanged within the noise.
      const auto whole_vectors_of_heads = [&](auto width) __attribute__((always_inline)) {
        const Vec<float>::Native top = Vec<float>(std::numeric_limits<float>::max()).v;
        decltype(top <= top) finite = top <= top;  // all lanes set
        for (; h + kLanes <= heads; h += kLanes) {
          Vec<float> partials[R][kLanes];
#pragma GCC unroll 1
          for (int64_t j = 0; j < kLanes; ++j) {
            Vec<float> head_partials[R];
            partial(h + j, width, head_partials);
            for (int r = 0; r < R; ++r) {
              partials[r][j] = head_partials[r];
            }
          }
          for (int r = 0; r < R; ++r) {
            const Vec<float> scores = sum_lanes_each(partials[r]) * Vec<float>(scale);
            scores.store(out + r * heads + h);
            finite &= (scores.v <= top) & (scores.v >= -top);  // not inf or NaN
          }
        }
        overflowed = any_lane(~finite);
      };
      if (head_dim == 64) {
        whole_vectors_of_heads(std::integral_constant<int64_t, 64>());
      } else {
        whole_vectors_of_heads(head_dim);
      }
      checked = h;
      const int64_t count = heads - h;
      if (count > kLanes / 2) {  // many heads left: the shared transpose, padded with zeros
        Vec<float> partials[R][kLanes];
        for (int64_t j = 0; j < kLanes; ++j) {
          Vec<float> head_partials[R];
          if (j < count) {
            partial(h + j, head_dim, head_partials);
          }
          for (int r = 0; r < R; ++r) {
            partials[r][j] = j < count ? head_partials[r] : Vec<float>(0);
          }
        }
        for (int r = 0; r < R; ++r) {
          (sum_lanes_each(partials[r]) * Vec<float>(scale)).store(out + r * heads + h, count);
        }
        h = heads;
      }
      for (; h < heads; ++h) {  // a few heads: reduced one by one, cheaper than the shared transpose
        Vec<float> head_partials[R];
        partial(h, head_dim, head_partials);
        for (int r = 0; r < R; ++r) {
          out[r * heads + h] = sum_lanes_as_each(head_partials[r]) * scale;
        }
      }
    }
  }
#endif
  for (; h < heads; ++h) {
    const acc_t<scalar_t>* qh = q + h * head_dim;
    const scalar_t* xh[R];
    slices(h, xh);
    if (stride == 1) {
      dots<R, false>(xh, nullptr, qh, head_dim, ahead_of(h), out + h, heads);
    } else {
      for (int r = 0; r < R; ++r) {
        out[r * heads + h] = dot<false>(xh[r], stride, nullptr, qh, head_dim);
      }
    }
    for (int r = 0; r < R; ++r) {
      out[r * heads + h] *= scale;
    }
  }
  if constexpr (std::is_same_v<acc_t<scalar_t>, float>) {
    // Rows near float32's maximum overflow the unscaled dot product though the scaled score may be finite: such a
    // score again in float64 (where it cannot overflow), scaled, then rounded. A finite score never takes this path,
    // so the forward and the backward decide alike.
    for (int r = 0; r < R; ++r) {
      for (int64_t j = checked; j < heads; ++j) {
        overflowed |= !(std::abs(out[r * heads + j]) <= std::numeric_limits<float>::max());
      }
    }
    if (overflowed) {
      for (int r = 0; r < R; ++r) {
        rescore_in_float64(x[r], stride, q, heads, head_dim, scale, pairs, out + r * heads);
      }
    }
  }
}

// rows_scores of one row.
template <typename scalar_t>
inline void row_scores(const scalar_t* x, int64_t stride, const acc_t<scalar_t>* q, int64_t heads, int64_t head_dim,
                       acc_t<scalar_t> scale, bool pairs, acc_t<scalar_t>* out,
                       const scalar_t* prefetch_row = nullptr) {
  rows_scores<1>(&x, stride, q, heads, head_dim, scale, pairs, out, &prefetch_row);
}

// Rows the forward scores at a time (rows_scores) where it shares the query's loads (SoftmaxReducer::
// shares_query_loads): four on AVX-512, whose 32 vector registers hold the four rows' sixteen chains beside the
// query's vectors; two on AVX2, which has 16. Two rows at a time with the AVX2 kernels were 10-20% slower than one
// in bfloat16 on Zen 5 (which runs the AVX-512 kernels unless told otherwise), but faster on Zen 3, an AVX2-only
// machine: 2 threads, two rounds in alternating processes, time over hidden.sum()'s at 1x32768x1024 with 16 heads
// of 64, float32 1.61-1.76x -> 1.49-1.56x, bfloat16 1.76-1.77x -> 1.58-1.60x; one head and 32x512x768 unchanged
// within the noise. Four rows there were no faster on the long text and slower at 32x512x768 in bfloat16 (16
// heads 2.02-2.11x -> 2.18-2.24x).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kScoreRows = 4;
constexpr bool kFloatRowsShareQueryLoads = false;  // see shares_query_loads
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kScoreRows = 2;
constexpr bool kFloatRowsShareQueryLoads = true;
#else
constexpr int kScoreRows = 1;
constexpr bool kFloatRowsShareQueryLoads = false;
#endif

// total[i] += chunk[i], then chunk[i] = 0, for n values: a chunk's sums folded into the running totals.
template <typename total_t, typename acc>
inline void fold_chunk(total_t* total, acc* chunk, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    total[i] += chunk[i];
    chunk[i] = acc(0);
  }
}

// Sums over rows run in chunks of kFoldRows rows in the accumulation type, each chunk's sum folded into a float64
// total: the float32 error then stays that of kFoldRows additions, whatever L.
constexpr int64_t kFoldRows = 32;

// The online softmax of one text's block of heads, as a reducer for reduce_rows. Call fold() after the last row.
template <typename scalar_t>
struct SoftmaxReducer {
  using acc = acc_t<scalar_t>;
  using V = Vec<acc>;
  const acc* query;  // the block's heads, [heads, head_dim]
  acc scale;
  int64_t heads, head_dim;
  bool pairs;               // use_pairs(): query, weighted and weighted_total are in pair order
  acc* weighted;            // [n]: the current chunk's sum over rows of exp(score - running_max) * row
  double* weighted_total;   // [n]: the same over the folded chunks
  acc* running_max;         // [heads]
  acc* total;               // [heads]: the current chunk's sum over rows of exp(score - running_max)
  double* total_sum;        // [heads]: the same over the folded chunks
  acc* scores;              // [heads, seq_len]: each row's raw score, kept when the weights are returned; else nullptr
  int64_t seq_len;
  acc* group_scores;        // [kRowGroup * heads]: scratch
  int64_t chunk_rows = 0;
  double unscale = 1.0;     // weighted_total * unscale is the weighted sum (resum_if_overflowed)

  void init(const scalar_t* row, int64_t stride, int64_t n, int64_t l) {
    std::fill_n(weighted, n, acc(0));
    std::fill_n(weighted_total, n, 0.0);
    std::fill_n(running_max, heads, -std::numeric_limits<acc>::infinity());
    std::fill_n(total, heads, acc(0));
    std::fill_n(total_sum, heads, 0.0);
    step(RowGroup<scalar_t>{{row}, {row}, {l}, 1}, stride, n);
  }

  void fold() {
    fold_chunk(weighted_total, weighted, heads * head_dim);
    fold_chunk(total_sum, total, heads);
    chunk_rows = 0;
  }

  void step(const RowGroup<scalar_t>& g, int64_t stride, int64_t /*n*/) {
    const int k = g.k;
    // Where the rows of the group after next (g.ahead) are prefetched: for a whole group of contiguous rows of wide
    // heads scored one at a time, the first kScoredAhead of them while the group is scored and the others while it
    // is summed (add_rows), so that the requests are spread over the group's work rather than bunched in its first
    // pass. Zen 3 (AVX2), 2 threads, 1x32768x1024, four rounds in alternating processes, time over
    // hidden.sum()'s: one head of bfloat16 1.54-1.57x -> 1.35-1.41x, of float32 1.43-1.56x -> 1.41-1.47x; at
    // 32x512x768 unchanged within the noise. Narrow heads keep every prefetch in the score pass: split, 12 heads of
    // 64 at 32x512x768 took about a tenth longer (bfloat16 1.36-1.43 -> 1.53-1.58 ms), 16 at 1x32768x1024 no less.
    // All of them in the sums was slower for every case.
    const bool split_ahead =
        stride == 1 && k == kRowGroup && head_dim > kNarrowHeadDim && !shares_query_loads(stride);
    // The group's scores (each row read once, front to back; kScoreRows rows at a time where shares_query_loads):
    // s[r * heads + h].
    int r = 0;
    if (shares_query_loads(stride)) {
      for (; r + kScoreRows <= k; r += kScoreRows) {
        rows_scores<kScoreRows>(g.rows + r, stride, query, heads, head_dim, scale, pairs, group_scores + r * heads,
                                g.ahead + r);
      }
    }
    for (; r < k; ++r) {
      row_scores(g.rows[r], stride, query, heads, head_dim, scale, pairs, group_scores + r * heads,
                 stride == 1 && (!split_ahead || r < kScoredAhead) ? g.ahead[r] : nullptr);
    }
    if (scores != nullptr) {
      for (r = 0; r < k; ++r) {
        for (int64_t h = 0; h < heads; ++h) {
          scores[h * seq_len + g.ls[r]] = group_scores[r * heads + h];
        }
      }
    }
    // Per head, the running maximum moves up to the group's if a score passes it (a NaN score is passed over here
    // and poisons the total below), rescaling what was added so far: a vector of heads at a time, the rare move
    // head by head.
    int64_t h = 0;
    for (; h + V::size() <= heads; h += V::size()) {
      const typename V::Native before = V::loadu(running_max + h).v;
      typename V::Native top = before;
      for (int r = 0; r < k; ++r) {
        const typename V::Native s = V::loadu(group_scores + r * heads + h).v;
        top = s > top ? s : top;
      }
      if (any_lane(top > before)) {
        for (int64_t j = 0; j < V::size(); ++j) {
          raise_max(h + j, top[j]);
        }
      }
    }
    for (; h < heads; ++h) {
      acc top = running_max[h];
      for (int r = 0; r < k; ++r) {
        top = group_scores[r * heads + h] > top ? group_scores[r * heads + h] : top;
      }
      raise_max(h, top);
    }
    // The weights exp(score - max), all of the group's at once (exp.h), and their totals per head (row by row, a
    // vector of heads at a time: the compiler does not vectorise these loops itself, the arrays might overlap).
    for (int r = 0; r < k; ++r) {
      acc* s = group_scores + r * heads;
      for (h = 0; h + V::size() <= heads; h += V::size()) {
        (V::loadu(s + h) - V::loadu(running_max + h)).store(s + h);
      }
      for (; h < heads; ++h) {
        s[h] -= running_max[h];
      }
    }
    exp_in_place(group_scores, k * heads);
    for (h = 0; h + V::size() <= heads; h += V::size()) {
      V t = V::loadu(total + h);
      for (int r = 0; r < k; ++r) {
        t = t + V::loadu(group_scores + r * heads + h);
      }
      t.store(total + h);
    }
    for (; h < heads; ++h) {
      for (int r = 0; r < k; ++r) {
        total[h] += group_scores[r * heads + h];
      }
    }
    // Each head's slices of the group's rows added with their weights; one loop over the heads for each way of
    // prefetching, so that the common one (narrow heads) carries nothing of the other.
    const auto add_heads = [&](auto with_ahead) __attribute__((always_inline)) {
      constexpr bool kAhead = decltype(with_ahead)::value;
      for (int64_t head = 0; head < heads; ++head) {
        acc p[kRowGroup];
        const scalar_t* x[kRowGroup];
        const scalar_t* ahead[kRowGroup] = {};
        for (int r = 0; r < k; ++r) {
          p[r] = group_scores[r * heads + head];
          x[r] = g.rows[r] + head * head_dim * stride;
          if constexpr (kAhead) {
            ahead[r] = r >= kScoredAhead ? g.ahead[r] + head * head_dim : nullptr;
          }
        }
        add_rows<kAhead>(weighted + head * head_dim, p, x, k, stride, ahead);
      }
    };
    if (split_ahead) {
      add_heads(std::true_type());
    } else {
      add_heads(std::false_type());
    }
    chunk_rows += k;
    if (chunk_rows >= kFoldRows) {
      fold();
    }
  }

  // The rows of the group after next whose prefetches go with the score pass (step()).
  static constexpr int kScoredAhead = 2;

  // prefetch_line() of each row r that has one, ahead[r].
  [[gnu::always_inline]] static void prefetch_ahead(const scalar_t* const* ahead, int64_t i) {
    for (int r = 0; r < kRowGroup; ++r) {
      if (ahead[r] != nullptr) {
        prefetch_line(ahead[r], i);
      }
    }
  }

  // Whether step() scores the rows of a group kScoreRows at a time, sharing the query's loads: contiguous
  // bfloat16 rows, and contiguous float32 rows with the AVX2 kernels (see kScoreRows). With AVX-512 the query
  // (float32) takes as many bytes as bfloat16 rows, so the score pass was bound by loads, and a head of few
  // features also pays its reduction per row. Measured on Zen 5, 2 threads, three rounds in alternating
  // processes, time over hidden.sum()'s: 32x512x768 with 12 heads 3.04-3.16x -> 2.58-2.82x, with one head
  // 1.91-2.16x -> 1.66-1.88x, 1x32768x1024 with 16 heads 1.99-2.09x -> 1.69-1.99x, with one head 1.41-1.48x ->
  // 1.38-1.45x. The prefetches must stay one stream (SequentialAhead): with each row prefetching its own row
  // ahead, the long text lost (one head 1.42-1.66x -> 1.64-1.73x). Float32 rows lost with it there (twice the
  // lines per row; one long text with 16 heads 1.4-2.0x -> 1.6-2.5x) and stay one row at a time with AVX-512.
  bool shares_query_loads(int64_t stride) const {
    return kScoreRows > 1 && stride == 1 &&
           (std::is_same_v<scalar_t, c10::BFloat16> ||
            (kFloatRowsShareQueryLoads && std::is_same_v<scalar_t, float>));
  }

  // Head h's running maximum up to top where top passes it, rescaling what was added so far.
  void raise_max(int64_t h, acc top) {
    if (!(top > running_max[h])) {
      return;
    }
    if (running_max[h] != -std::numeric_limits<acc>::infinity()) {  // else nothing was added yet
      const acc factor = exp_acc(running_max[h] - top);
      scale_in_place(weighted_total + h * head_dim, factor);
      scale_in_place(weighted + h * head_dim, factor);
      total_sum[h] *= factor;
      total[h] *= factor;
    }
    running_max[h] = top;
  }

  // After fold(): where a weighted sum or total is not finite, the chunk again, its weights exp(score - max)
  // taken against the chunk's final maximum and its sums straight in float64. Float32 runs of rows near float32's
  // maximum, which bfloat16 shares, overflow though their weighted mean is finite; in float64 they cannot. Float64
  // rows near float64's maximum are added scaled by 2^-10 (exactly, but for subnormal values), which keeps a
  // chunk's kChunkRows rows finite, and unscale carries the factor back (applied after the division by the total).
  // Only such rows, or inputs that are inf or NaN (which stay so), take this second read.
  void resum_if_overflowed(const scalar_t* block, int64_t stride_l, int64_t stride_d, const ChunkRows& chunk) {
    const int64_t n = heads * head_dim;
    if (all_finite(weighted_total, n) && all_finite(total_sum, heads)) {
      return;
    }
    constexpr double shrink = kResumShrink<acc>;
    unscale = 1.0 / shrink;
    std::fill_n(weighted_total, n, 0.0);
    std::fill_n(total_sum, heads, 0.0);
    std::vector<acc> row_score(heads);
    chunk.each([&](int64_t l) {
      const scalar_t* row = block + l * stride_l;
      row_scores(row, stride_d, query, heads, head_dim, scale, pairs, row_score.data());
      for (int64_t h = 0; h < heads; ++h) {
        const double p = exp_acc(row_score[h] - running_max[h]);
        total_sum[h] += p;
        for (int64_t j = h * head_dim; j < (h + 1) * head_dim; ++j) {
          weighted_total[pairs ? pair_index(j) : j] += p * (static_cast<double>(row[j * stride_d]) * shrink);
        }
      }
    });
  }

  template <typename T>
  void scale_in_place(T* w, acc factor) const {
    int64_t i = 0;
    if constexpr (std::is_same_v<T, acc>) {
      for (; i + V::size() <= head_dim; i += V::size()) {
        (V::loadu(w + i) * V(factor)).store(w + i);
      }
    }
    for (; i < head_dim; ++i) {
      w[i] *= factor;
    }
  }

  // w += sum_r p[r] * x[r]. A whole group's products are added pairwise, (p0 x0 + p1 x1) + (p2 x2 + p3 x3), and then
  // to w, as the mean adds its rows: a run of kFoldRows rows so costs kFoldRows / 4 roundings in a row, where one
  // fused multiply-add per row into w cost kFoldRows (8 ulp against a float64 oracle on a constant column, 2 now).
  // Always inlined into step()'s loop over heads: as a call per head, its set-up and the reloads of the row pointers
  // cost a 64-feature head about a tenth of its time (Zen 5, one thread, 4096 x 1024 in L3, 16 heads of bfloat16:
  // AVX2 110 -> 97-101 ns a row, AVX-512 86-91 -> 81-83). With kAhead, a whole group of contiguous rows also
  // prefetches the rows `ahead` (null: none) at the head's features as it reads its own.
  template <bool kAhead>
  [[gnu::always_inline]] void add_rows(acc* w, const acc* p, const scalar_t* const* x, int k, int64_t stride,
                                       const scalar_t* const* ahead) const {
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (pairs) {
        add_rows_pairs<kAhead>(w, p, x, k, ahead);
        return;
      }
    }
    int64_t i = 0;
    if (stride == 1 && k == kRowGroup) {  // the common case, unrolled: the four weights stay in registers
      static_assert(kRowGroup == 4);
      const V p0(p[0]), p1(p[1]), p2(p[2]), p3(p[3]);
      for (; i + V::size() <= head_dim; i += V::size()) {
        if constexpr (kAhead) {
          prefetch_ahead(ahead, i);
        }
        const V a = fmadd(p1, load_widened(x[1] + i), p0 * load_widened(x[0] + i));
        const V b = fmadd(p3, load_widened(x[3] + i), p2 * load_widened(x[2] + i));
        (V::loadu(w + i) + (a + b)).store(w + i);
      }
    } else if (stride == 1) {
      for (; i + V::size() <= head_dim; i += V::size()) {
        V a = V::loadu(w + i);
        for (int r = 0; r < k; ++r) {
          a = fmadd(V(p[r]), load_widened(x[r] + i), a);
        }
        a.store(w + i);
      }
    }
    for (; i < head_dim; ++i) {
      const auto term = [&](int r) { return p[r] * static_cast<acc>(x[r][i * stride]); };
      if (k == kRowGroup) {
        w[i] += (term(0) + term(1)) + (term(2) + term(3));
      } else {
        for (int r = 0; r < k; ++r) {
          w[i] += term(r);
        }
      }
    }
  }

  // add_rows for bfloat16 rows with w in pair order. Tried and not kept (2-core Intel Xeon, family 6 model 167,
  // 2026-12-07): the score pass storing each full group's rows as it widens them (an L1 scratch of four rows, pair
  // order) and the sums reading those floats instead of widening the rows again; the same bits, but slower: 2 threads,
  // 1x32768x1024, three rounds in alternating processes, 16 heads of 64 3.09-3.21 -> 3.85-3.99 ms, one head
  // 2.56-2.77 -> 3.05-3.18 ms; one thread 8.6-8.7 -> 9.8-9.9 ms with 16 heads.
  template <bool kAhead>
  [[gnu::always_inline]] void add_rows_pairs(float* w, const float* p, const c10::BFloat16* const* x, int k,
                                             const c10::BFloat16* const* ahead) const {
    constexpr int64_t kHalf = kPairBlock / 2;
    if (k == kRowGroup) {  // the common case, unrolled as in add_rows (the same operations in the same order)
      static_assert(kRowGroup == 4);
      const V p0(p[0]), p1(p[1]), p2(p[2]), p3(p[3]);
      for (int64_t i = 0; i < head_dim; i += kPairBlock) {
        if constexpr (kAhead) {
          prefetch_ahead(ahead, i);
        }
        const Pairs v0 = load_pairs(x[0] + i), v1 = load_pairs(x[1] + i), v2 = load_pairs(x[2] + i),
                    v3 = load_pairs(x[3] + i);
        const V even = fmadd(p1, v1.even, p0 * v0.even) + fmadd(p3, v3.even, p2 * v2.even);
        const V odd = fmadd(p1, v1.odd, p0 * v0.odd) + fmadd(p3, v3.odd, p2 * v2.odd);
        (V::loadu(w + i) + even).store(w + i);
        (V::loadu(w + i + kHalf) + odd).store(w + i + kHalf);
      }
      return;
    }
    for (int64_t i = 0; i < head_dim; i += kPairBlock) {
      V even = V::loadu(w + i), odd = V::loadu(w + i + kHalf);
      for (int r = 0; r < k; ++r) {  // k is kRowGroup but for a chunk's first and last groups
        const Pairs v = load_pairs(x[r] + i);
        even = fmadd(V(p[r]), v.even, even);
        odd = fmadd(V(p[r]), v.odd, odd);
      }
      even.store(w + i);
      odd.store(w + i + kHalf);
    }
  }
};

// The query [dim] as row_scores() takes it for rows of this type, feature stride and head width: q itself, or a
// copy in pair order where use_pairs() holds. The forward and the backward both build it here, so a score
// recomputed in the backward meets the query in the forward's order and keeps its bits.
template <typename scalar_t>
struct ScoreQuery {
  using acc = acc_t<scalar_t>;
  bool pairs;
  std::vector<acc> storage;
  const acc* data;

  ScoreQuery(const acc* q, int64_t dim, int64_t stride, int64_t head_dim)
      : pairs(use_pairs<scalar_t>(stride, head_dim)), storage(pairs ? dim : 0), data(q) {
    if (pairs) {
      to_pair_order(q, storage.data(), dim);
      data = storage.data();
    }
  }
};

// A score's probability from its text and head's statistics {max, sum}: exp(score - max) / sum, as a softmax
// computes it. Kept as that pair rather than one log-sum-exp number max + log(sum), the statistics lose nothing at
// any score magnitude: rounded to one number, the log-sum-exp carries an error of |max| ulps into every recomputed
// probability (and loses log(sum) entirely once |max| is large).
template <typename acc>
inline acc probability(acc score, const double* stats) {
  return exp_acc(score - static_cast<acc>(stats[0])) / static_cast<acc>(stats[1]);
}

// The unit of attention's feature blocks (for_each_chunk): whole heads, and narrow heads as many at a time as
// row_scores reduces together (a vector's width), divided only as far as it takes to give every thread work when
// the batch has fewer chunks than threads (`chunks`: the batch's chunk count or a bound above it). A block of a few
// narrow heads pays row_scores' whole reduction for each: one 512-token text's 16 heads in 4 blocks of 4 took 1.7
// times as long on one thread as in one block. (Which heads share a block never changes a score's bits: each head's
// partial sums are reduced alone.)
inline int64_t head_block_unit(int64_t heads, int64_t head_dim, int64_t chunks) {
  constexpr int64_t kLanes = Vec<float>::size();
  if (head_dim > kNarrowHeadDim) {
    return head_dim;
  }
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  const int64_t blocks_per_chunk = std::clamp<int64_t>(threads / std::max<int64_t>(chunks, 1), 1, kLanes);
  return head_dim * ((std::min(heads, kLanes) + blocks_per_chunk - 1) / blocks_per_chunk);
}

template <typename scalar_t>
void attention_forward_typed(const Tensor& hidden, const AttentionRows& rows, const Tensor& query,
                             double scale, Tensor& out, Tensor& stats, Tensor& weights) {
  using acc = acc_t<scalar_t>;
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const int64_t sb = hidden.stride(0), sl = hidden.stride(1), sd = hidden.stride(2);
  const int64_t heads = query.size(0), head_dim = query.size(1);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  const acc* q = query.const_data_ptr<acc>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  double* all_stats = stats.mutable_data_ptr<double>();
  acc* w = weights.defined() ? weights.mutable_data_ptr<acc>() : nullptr;
  const RowListing listing = list_rows(rows.listed, batch, seq_len);
  const RowList& list = listing.view;
  const ChunkPlan plan(list, batch);
  // Where text b's weights start: [B, H, L], or one [H, T] for a packed batch (rows of texts never overlap).
  const int64_t weights_batch = rows.packed() ? 0 : heads * seq_len;
  const ScoreQuery<scalar_t> query_in_order(q, dim, sd, head_dim);
  const bool pairs = query_in_order.pairs;
  // Text b's results for head hh from its softmax state over all its rows (max score, total, weighted mean of its
  // slice): the output, the statistics and, when asked, the probabilities of its rows.
  // mean: head hh's weighted mean, in float64 or (merged from several chunks) in wide_t.
  const auto finish_head = [&](int64_t b, int64_t hh, acc best, double total, const auto* mean) {
    for (int64_t i = 0; i < head_dim; ++i) {
      o[b * dim + hh * head_dim + i] = static_cast<scalar_t>(mean[i]);
    }
    double* text_stats = all_stats + (b * heads + hh) * 2;
    text_stats[0] = best;
    text_stats[1] = total;
    if (w != nullptr) {
      acc* scores = w + b * weights_batch + hh * seq_len;
      for (int64_t j = 0; j < list.rows(b); ++j) {
        const int64_t l = list.row(b, j);
        scores[l] = probability(scores[l], text_stats);
      }
    }
  };
  // The softmax state of each chunk of the texts with several (running max, total, weighted mean), merged per text
  // below in chunk order. A text of one chunk is finished by its chunk's task. Means rather than weighted sums: each
  // is at most the largest value, and so is every partial sum of them weighted by shares of the text's total, so
  // float64 rows near float64's maximum merge to a finite result wherever it is finite.
  const CallScratch<acc, 0> part_max(plan.slots() * heads);
  const CallScratch<double, 1> part_sum(plan.slots() * heads);
  const CallScratch<double, 2> part_out(plan.slots() * dim);
  // A chunk's weighted mean per head of its block, in natural order, into dst [n]. Float sums (rows of 16 and 32
  // bits) are multiplied by the reciprocal of the head's total (as SumReducer::write_mean does, and why: a division
  // per feature, one at a time in pair order, took most of a short text's time, 1.8 us a text of 768 bfloat16
  // features), then taken out of pair order a pair block at a time; float64 sums are divided.
  const auto chunk_mean = [&](const SoftmaxReducer<scalar_t>& reducer, double* dst) {
    for (int64_t k = 0; k < reducer.heads; ++k) {
      const int64_t begin = k * head_dim, end = begin + head_dim;
      const double* weighted = reducer.weighted_total;
      if constexpr (std::is_same_v<acc, double>) {
        const double total = reducer.total_sum[k];
        for (int64_t j = begin; j < end; ++j) {
          dst[j] = weighted[j] / total * reducer.unscale;
        }
      } else {
        const double factor = 1.0 / reducer.total_sum[k] * reducer.unscale;
        if (pairs) {
          from_pair_order(weighted + begin, dst + begin, head_dim, [factor](double sum) { return sum * factor; });
        } else {
          for (int64_t j = begin; j < end; ++j) {
            dst[j] = weighted[j] * factor;
          }
        }
      }
    }
  };
  const int64_t unit = head_block_unit(heads, head_dim, plan.chunks());
  for_each_chunk(plan, list, dim, unit, [&](int64_t b, int64_t chunk, int64_t d0, int64_t n,
                                            const ChunkRows& chunk_rows) {
    const int64_t h0 = d0 / head_dim, block_heads = n / head_dim;
    acc* state = thread_scratch<acc, 0>(n + (2 + kRowGroup) * block_heads);  // init() sets what is read
    double* totals = thread_scratch<double, 1>(n + block_heads);
    acc* scores = w != nullptr ? w + b * weights_batch + h0 * seq_len : nullptr;
    SoftmaxReducer<scalar_t> reducer{query_in_order.data + d0,
                                     static_cast<acc>(scale),
                                     block_heads,
                                     head_dim,
                                     pairs,
                                     state,
                                     totals,
                                     state + n,
                                     state + n + block_heads,
                                     totals + n,
                                     scores,
                                     seq_len,
                                     state + n + 2 * block_heads};
    const scalar_t* block = h + b * sb + d0 * sd;
    const int64_t count = reduce_rows(block, batch, sb, sl, sd, n, chunk_rows, reducer);
    if (count > 0) {
      reducer.fold();
      reducer.resum_if_overflowed(block, sl, sd, chunk_rows);
    }
    if (list.rows(b) <= kChunkRows) {  // the text's only chunk: finish it here
      if (count == 0) {                // a text with no valid row: zeros, and -inf statistics
        std::fill_n(o + b * dim + d0, n, scalar_t(0));
        std::fill_n(all_stats + (b * heads + h0) * 2, 2 * block_heads, -std::numeric_limits<double>::infinity());
        return;
      }
      double* mean = thread_scratch<double, 2>(n);
      chunk_mean(reducer, mean);
      for (int64_t k = 0; k < block_heads; ++k) {
        finish_head(b, h0 + k, reducer.running_max[k], reducer.total_sum[k], mean + k * head_dim);
      }
    } else if (count > 0) {
      const int64_t part = plan.slot(b, chunk);
      std::copy_n(reducer.running_max, block_heads, part_max.data() + part * heads + h0);
      std::copy_n(reducer.total_sum, block_heads, part_sum.data() + part * heads + h0);
      chunk_mean(reducer, part_out.data() + part * dim + d0);
    }
  });
  // Per text of several chunks and block of heads: the chunks merged in order (in wide_t), then finished.
  for_each_text(list, batch, dim, head_dim, kChunkRows + 1, [&](int64_t b, int64_t d0, int64_t n) {
    const int64_t h0 = d0 / head_dim, used = (list.rows(b) + kChunkRows - 1) / kChunkRows;
    std::vector<wide_t<scalar_t>> weighted(head_dim);
    std::vector<double> rescaled_sum(used);
    for (int64_t hh = h0; hh < h0 + n / head_dim; ++hh) {
      acc best = -std::numeric_limits<acc>::infinity();
      for (int64_t c = 0; c < used; ++c) {
        best = std::max(best, part_max.data()[plan.slot(b, c) * heads + hh]);
      }
      // The text's total first (each chunk's sum rescaled to the text's maximum), then each chunk's mean weighted by
      // its share of it.
      wide_t<scalar_t> total = 0;
      for (int64_t c = 0; c < used; ++c) {
        const int64_t part = plan.slot(b, c);
        const acc m = part_max.data()[part * heads + hh];
        rescaled_sum[c] =
            part_sum.data()[part * heads + hh] * (m == best ? 1.0 : static_cast<double>(exp_acc(m - best)));
        total += rescaled_sum[c];
      }
      std::fill(weighted.begin(), weighted.end(), 0.0);
      for (int64_t c = 0; c < used; ++c) {
        const wide_t<scalar_t> share = rescaled_sum[c] / total;
        for (int64_t i = 0; i < head_dim; ++i) {
          weighted[i] += part_out.data()[plan.slot(b, c) * dim + hh * head_dim + i] * share;
        }
      }
      finish_head(b, hh, best, static_cast<double>(total), weighted.data());
    }
  });
}

// pe += c_pe * (x - m) and pr += c_pr * (x - m) over n features.
template <typename scalar_t>
inline void add_centred_twice(acc_t<scalar_t>* pe, acc_t<scalar_t>* pr, acc_t<scalar_t> c_pe, acc_t<scalar_t> c_pr,
                              const scalar_t* x, int64_t stride, const acc_t<scalar_t>* m, int64_t n) {
  using V = Vec<acc_t<scalar_t>>;
  int64_t i = 0;
  if (stride == 1) {
    const V ve(c_pe), vr(c_pr);
    for (; i + V::size() <= n; i += V::size()) {
      const V y = load_widened(x + i) - V::loadu(m + i);
      fmadd(ve, y, V::loadu(pe + i)).store(pe + i);
      fmadd(vr, y, V::loadu(pr + i)).store(pr + i);
    }
  }
  for (; i < n; ++i) {
    const auto y = static_cast<acc_t<scalar_t>>(x[i * stride]) - m[i];
    pe[i] += c_pe * y;
    pr[i] += c_pr * y;
  }
}

// dst = p * g + c * q over n features.
template <typename acc>
inline void combine(acc* dst, acc p, const acc* g, acc c, const acc* q, int64_t n) {
  using V = Vec<acc>;
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    fmadd(V(p), V::loadu(g + i), V(c) * V::loadu(q + i)).store(dst + i);
  }
  for (; i < n; ++i) {
    dst[i] = p * g[i] + c * q[i];
  }
}

template <typename scalar_t>
void attention_backward_typed(const Tensor& grad, const Tensor& grad_weights, const Tensor& hidden,
                              const AttentionRows& rows, const Tensor& query, const Tensor& out,
                              const Tensor& stats, double scale, Tensor& grad_hidden,
                              Tensor& grad_query) {
  using acc = acc_t<scalar_t>;
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const int64_t sb = hidden.stride(0), sl = hidden.stride(1), sd = hidden.stride(2);
  const int64_t heads = query.size(0), head_dim = query.size(1);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  const acc* g = grad.const_data_ptr<acc>();
  const acc* gw = grad_weights.defined() ? grad_weights.const_data_ptr<acc>() : nullptr;
  const acc* q = query.const_data_ptr<acc>();
  const acc* mean = out.const_data_ptr<acc>();
  const double* all_stats = stats.const_data_ptr<double>();
  scalar_t* gh = grad_hidden.mutable_data_ptr<scalar_t>();
  const auto sc = static_cast<acc>(scale);
  const RowListing listing = list_rows(rows.listed, batch, seq_len);
  const RowList& list = listing.view;
  const ChunkPlan plan(list, batch);
  // Per-row values live at [(b * row_batch + h) * seq_len + l]: [B, H, L], or one [H, T] for a packed batch.
  const int64_t row_batch = rows.packed() ? 0 : heads, row_texts = rows.packed() ? 1 : batch;
  // The scores as the forward computed them (row_scores, the same query order).
  const ScoreQuery<scalar_t> query_in_order(q, dim, sd, head_dim);
  // p and e of every valid row, per head; per chunk the sums of p e (x - m) and p (x - m) per feature and of p e
  // per head, in `wide`: float64, and for float64 rows the x87 extended type (long double: 64-bit mantissa, 15-bit
  // exponent). e is kept wide: near the rows' type's maximum the wide pass below gives e past that type's range, and
  // the row gradient needs e - S, which may be small.
  using wide = wide_t<scalar_t>;
  // Not zeroed: the chunks write every valid row's values, and only those are read. (Zero-filled anew on every
  // call, the pages of [B, H, L] values were faulted in each time, as CallScratch says.)
  const CallScratch<acc, 3> prob_scratch(row_texts * heads * seq_len);
  const CallScratch<wide, 4> err_scratch(row_texts * heads * seq_len);
  acc* prob = prob_scratch.data();
  wide* err = err_scratch.data();
  // The feature sums of a text of several chunks are kept in its slots until the query pass combines them; a text
  // of one chunk sums in the thread's scratch and leaves only its query-gradient share, in the accumulation type.
  // (When every chunk kept its sums, 4096 texts of 8 rows, bfloat16, D = 384, wrote and read back 25 MB of float64
  // sums, and the backward took 1.2-1.3x as long.) Every chunk's sums per head are kept (plan.index numbers them).
  const CallScratch<wide, 0> part_pex(plan.slots() * dim);
  const CallScratch<wide, 1> part_px(plan.slots() * dim);
  const CallScratch<wide, 2> part_pe(plan.chunks() * heads);
  const CallScratch<acc, 5> shares(batch * dim);
  const auto one_chunk_text = [&](int64_t b) { return list.rows(b) <= kChunkRows; };
  // A text's share of feature i of the query gradient from its sums over all its rows (S: its head's): one formula
  // for texts of one chunk and of several, so that a text's bits do not depend on its length class.
  const auto query_share = [sc](wide pex, wide px, wide s) { return static_cast<acc>(sc * (pex - s * px)); };
  const int64_t unit = head_block_unit(heads, head_dim, plan.chunks());
  for_each_chunk(plan, list, dim, unit, [&](int64_t b, int64_t chunk, int64_t d0, int64_t n,
                                            const ChunkRows& chunk_rows) {
    const int64_t h0 = d0 / head_dim, block_heads = n / head_dim;
    const bool one_chunk = one_chunk_text(b);
    wide* own_sums = one_chunk ? thread_scratch<wide, 2>(2 * n) : nullptr;
    wide* pex = one_chunk ? own_sums : part_pex.data() + plan.slot(b, chunk) * dim + d0;
    wide* px = one_chunk ? own_sums + n : part_px.data() + plan.slot(b, chunk) * dim + d0;
    wide* pe = part_pe.data() + plan.index(b, chunk) * heads + h0;
    // Rows add into the current run's sums (accumulation type), folded into the float64 partials every kFoldRows.
    acc* run = thread_scratch<acc, 0>(2 * n + block_heads);
    std::fill_n(run, 2 * n + block_heads, acc(0));
    acc* scores = thread_scratch<acc, 1>(block_heads);
    std::fill_n(pex, n, wide(0));
    std::fill_n(px, n, wide(0));
    std::fill_n(pe, block_heads, wide(0));
    const auto fold = [&] {
      fold_chunk(pex, run, n);
      fold_chunk(px, run + n, n);
      fold_chunk(pe, run + 2 * n, block_heads);
    };
    const scalar_t* text = h + b * sb + d0 * sd;
    const acc* gb = g + b * dim + d0;
    const acc* mb = mean + b * dim + d0;
    const double* text_stats = all_stats + (b * heads + h0) * 2;
    // The chunk again in `wide`, from the probabilities already kept: where its sums are not finite. Rows near
    // float32's maximum (which bfloat16 shares) make x - m overflow in float32 though every gradient of hidden is
    // finite; in float64 it cannot, and for float64 rows near float64's maximum neither in the extended type. Only
    // such rows, or inputs that are inf or NaN (which stay so), take this second read.
    const auto redo_wide = [&] {
      std::fill_n(pex, n, wide(0));
      std::fill_n(px, n, wide(0));
      std::fill_n(pe, block_heads, wide(0));
      chunk_rows.each([&](int64_t l) {
        const scalar_t* row = text + l * sl;
        for (int64_t hh = 0; hh < block_heads; ++hh) {
          const int64_t at = (b * row_batch + h0 + hh) * seq_len + l;
          wide e = gw != nullptr ? static_cast<wide>(gw[at]) : wide(0);
          for (int64_t i = hh * head_dim; i < (hh + 1) * head_dim; ++i) {
            e += (static_cast<wide>(row[i * sd]) - mb[i]) * gb[i];
          }
          const wide p = prob[at];
          err[at] = e;
          pe[hh] += p * e;
          for (int64_t i = hh * head_dim; i < (hh + 1) * head_dim; ++i) {
            const wide y = static_cast<wide>(row[i * sd]) - mb[i];
            pex[i] += p * e * y;
            px[i] += p * y;
          }
        }
      });
    };
    int64_t in_run = 0;
    chunk_rows.each([&](int64_t l) {
      const scalar_t* row = text + l * sl;
      row_scores(row, sd, query_in_order.data + d0, block_heads, head_dim, sc, query_in_order.pairs, scores);
      // The row's probabilities, as probability() computes them, with the heads' exponentials taken together.
      for (int64_t hh = 0; hh < block_heads; ++hh) {
        scores[hh] -= static_cast<acc>(text_stats[2 * hh]);
      }
      exp_in_place(scores, block_heads);
      for (int64_t hh = 0; hh < block_heads; ++hh) {
        const int64_t offset = hh * head_dim, at = (b * row_batch + h0 + hh) * seq_len + l;
        const scalar_t* x = row + offset * sd;
        const acc p = scores[hh] / static_cast<acc>(text_stats[2 * hh + 1]);
        const acc e = dot<true>(x, sd, mb + offset, gb + offset, head_dim) + (gw != nullptr ? gw[at] : acc(0));
        prob[at] = p;
        err[at] = e;
        run[2 * n + hh] += p * e;
        add_centred_twice(run + offset, run + n + offset, p * e, p, x, sd, mb + offset, head_dim);
      }
      if (++in_run == kFoldRows) {
        fold();
        in_run = 0;
      }
    });
    fold();
    const auto finite = [](wide t) { return std::isfinite(t); };
    if (!std::all_of(pex, pex + n, finite) || !std::all_of(px, px + n, finite) ||
        !std::all_of(pe, pe + block_heads, finite)) {
      redo_wide();
    }
    if (one_chunk) {  // S is the chunk's own sum: the text's share, as the query pass computes a longer text's
      acc* share = shares.data() + b * dim + d0;
      for (int64_t hh = 0; hh < block_heads; ++hh) {
        for (int64_t i = hh * head_dim; i < (hh + 1) * head_dim; ++i) {
          share[i] = query_share(pex[i], px[i], pe[hh]);
        }
      }
    }
  });
  // Per (text, head): S = sum of p e over its chunks in order.
  std::vector<wide> text_sums(batch * heads);
  torch::stable::parallel_for(0, batch, 1 + kMinParallelWork / (heads + 1), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t used = (list.rows(b) + kChunkRows - 1) / kChunkRows;
      for (int64_t hh = 0; hh < heads; ++hh) {
        wide s = 0;
        for (int64_t c = 0; c < used; ++c) {
          s += part_pe.data()[plan.index(b, c) * heads + hh];
        }
        text_sums[b * heads + hh] = s;
      }
    }
  });
  // The query gradient, split over features: feature i gets each text's share,
  // scale * (sum p e (x - m) - S sum p (x - m)) (the sums over the text's chunks in order; a text of one chunk left
  // its share), added in text order: no atomics, the same bits whatever the thread count. (Summed feature by feature
  // down the columns of a [B, D] table of shares on one thread, it was a fifth of the backward's time for 4000
  // one-row texts.)
  acc* gq = grad_query.mutable_data_ptr<acc>();
  const int64_t feature_grain = std::max<int64_t>(64, kMinParallelWork / (2 * plan.chunks() + 1));
  torch::stable::parallel_for(0, dim, feature_grain, [&](int64_t begin, int64_t end) {
    const int64_t n = end - begin;
    std::vector<wide> pex(n), px(n);
    std::fill_n(gq + begin, n, acc(0));
    for (int64_t b = 0; b < batch; ++b) {
      if (one_chunk_text(b)) {
        const acc* share = shares.data() + b * dim + begin;
        for (int64_t i = 0; i < n; ++i) {
          gq[begin + i] += share[i];
        }
        continue;
      }
      const int64_t used = (list.rows(b) + kChunkRows - 1) / kChunkRows;
      std::fill(pex.begin(), pex.end(), wide(0));
      std::fill(px.begin(), px.end(), wide(0));
      for (int64_t c = 0; c < used; ++c) {
        const wide* chunk_pex = part_pex.data() + plan.slot(b, c) * dim + begin;
        const wide* chunk_px = part_px.data() + plan.slot(b, c) * dim + begin;
        for (int64_t i = 0; i < n; ++i) {
          pex[i] += chunk_pex[i];
          px[i] += chunk_px[i];
        }
      }
      // Head by head, S read once a head: an integer division per feature was ~3 ms of the backward of 4096 texts
      // of 8 rows (bfloat16, D = 384).
      for (int64_t i = 0; i < n;) {
        const int64_t head = (begin + i) / head_dim, head_end = std::min(n, (head + 1) * head_dim - begin);
        const wide s = text_sums[b * heads + head];
        for (; i < head_end; ++i) {
          gq[begin + i] += query_share(pex[i], px[i], s);
        }
      }
    }
  });
  // Every row of grad_hidden once, split over rows: p g + scale p (e - S) q for a valid row, zeros elsewhere,
  // without reading hidden again.
  // (A packed batch's rows are [T, D], text by text as offsets bound them: a range's first row finds its text by a
  // binary search, the others by passing the texts' ends in turn.)
  const bool* is_valid = rows.valid.defined() ? rows.valid.const_data_ptr<bool>() : nullptr;
  const int64_t* offsets = rows.packed() ? rows.listed.offsets.const_data_ptr<int64_t>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, kMinParallelWork / dim);
  torch::stable::parallel_for(0, rows.packed() ? seq_len : batch * seq_len, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc> wide(std::is_same_v<scalar_t, acc> ? 0 : dim);
    int64_t text = offsets != nullptr ? std::upper_bound(offsets, offsets + batch + 1, begin) - offsets - 1 : 0;
    for (int64_t r = begin; r < end; ++r) {
      while (offsets != nullptr && r >= offsets[text + 1]) {
        ++text;
      }
      const int64_t b = offsets != nullptr ? text : r / seq_len;
      const int64_t l = offsets != nullptr ? r : r % seq_len;
      scalar_t* dst = gh + r * dim;
      if (is_valid != nullptr && !is_valid[r]) {
        zero_row_bytes(dst, dim * sizeof(scalar_t));
        continue;
      }
      acc* row = wide.empty() ? reinterpret_cast<acc*>(dst) : wide.data();
      for (int64_t hh = 0; hh < heads; ++hh) {
        const int64_t offset = hh * head_dim, at = (b * row_batch + hh) * seq_len + l;
        const auto coef = static_cast<acc>(scale * prob[at] * (err[at] - text_sums[b * heads + hh]));
        combine(row + offset, prob[at], g + b * dim + offset, coef, q + offset, head_dim);
      }
      if (!wide.empty()) {
        store_narrowed(wide.data(), dst, dim);
      }
    }
  });
}

}  // namespace

void attention_forward(const Tensor& hidden, const AttentionRows& rows, const Tensor& query, double scale,
                       Tensor& out, Tensor& stats, Tensor& weights) {
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool", [&] {
    attention_forward_typed<scalar_t>(hidden, rows, query, scale, out, stats, weights);
  });
}

void attention_backward(const Tensor& grad, const Tensor& grad_weights, const Tensor& hidden,
                        const AttentionRows& rows, const Tensor& query, const Tensor& out,
                        const Tensor& stats, double scale, Tensor& grad_hidden, Tensor& grad_query) {
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool_backward", [&] {
    attention_backward_typed<scalar_t>(grad, grad_weights, hidden, rows, query, out, stats, scale, grad_hidden,
                                       grad_query);
  });
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
