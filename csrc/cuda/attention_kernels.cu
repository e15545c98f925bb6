// CUDA kernels of attention pooling, forward and backward (the maths is the CPU kernels'; see
// cpu/attention_kernels.cpp).
//
// Layout: a block takes one chunk of kChunkRows valid rows of one text (common.cuh) for a tile of whole heads.
// Each head is a segment of `seg` lanes holding one pack of VEC features each (kWidePacks packs for a head of
// more than kThreads packs): a power of two up to 32 lanes (several heads per warp, blocks one warp wide) or whole
// warps (a wide head), summed by a butterfly within the warp and then, for a wide head, across its warps in order
// through shared memory. Every lane of a head so holds the same bits of each score, and the backward, which uses the
// same layout and the same head_sums, recomputes the forward's scores bit for bit. Y row lanes take rows y, y + Y,
// ... of the chunk (their indices staged in shared memory first: stage_chunk_rows), kRowsInFlight / packs at a time,
// with an online softmax each; they are merged in order, and the chunks of a long text are merged in order by a
// second kernel. Every block has at most kThreads threads and the chunk kernels are bounded to it, so a launch never
// asks for more registers than an SM has.
//
// Backward: a first kernel reads every valid row once and keeps p_l and e_l = <g, x_l - m> + gw_l per (text, head,
// row), and per chunk the sums of p e, p e (x - m) and p (x - m); a second one sums those per (text, feature) in
// chunk order (S = sum p e, and the text's share of the query gradient), and a deterministic reduction adds the
// shares over the texts; a last one writes every row of grad_hidden, p g + scale p (e - S) q or zeros, without
// reading hidden again.

#include <algorithm>
#include <limits>
#include <utility>

#include "common/dispatch.h"
#include "common/error.h"
#include "cuda/attention_kernels.h"
#include "cuda/common.cuh"

namespace lmk_ops::cuda {
namespace {

constexpr int kMaxSums = 2 * kRowsInFlight;  // values one head_sums call reduces (scores and, backward, errors)
// Values each row lane >= 1 hands to row lane 0 at the end of a chunk: forward, the maximum, the total and its
// carry, the weighted sums and their carries; backward, the sum of p e and the sums of p e (x - m) and p (x - m).
template <int P, int VEC>
constexpr int kForwardSlot = 2 * P * VEC + 3;
template <int P, int VEC>
constexpr int kBackwardSlot = 2 * P * VEC + 1;
// A lane holds one pack of a head's features, or kWidePacks packs when the head has more than kThreads packs: a
// head then spans up to kThreads lanes holding kWidePacks packs each (4096 float32, 8192 bfloat16 or 2048 float64
// features when rows are contiguous and aligned).
constexpr int kWidePacks = 4;
constexpr int64_t kMaxHeadPacks = int64_t{kWidePacks} * kThreads;

struct HeadLayout {
  int vec;            // features per pack
  int packs;          // packs per lane: 1 or kWidePacks
  int seg;            // lanes per head
  int lanes;          // x threads of a block
  int row_lanes;      // y threads of a block
  int64_t head_packs;  // packs per head
  int64_t per_block;  // heads per block
  int64_t tiles;      // blocks across the heads of a text
};

// Heads of at most 32 packs share a warp (a power-of-two segment each) and blocks are one warp wide, so that several
// heads make several tiles (more blocks for a medium batch); a wider head takes whole warps of one block.
HeadLayout head_layout(int vec, int64_t heads, int64_t head_dim) {
  HeadLayout layout{};
  layout.vec = vec;
  layout.head_packs = head_dim / vec;
  if (layout.head_packs <= 32) {
    layout.packs = 1;
    layout.seg = 1;
    while (layout.seg < layout.head_packs) {
      layout.seg *= 2;
    }
    layout.lanes = 32;
    layout.per_block = 32 / layout.seg;
  } else {
    layout.packs = layout.head_packs <= kThreads ? 1 : kWidePacks;
    layout.seg = static_cast<int>(ceil_div(ceil_div(layout.head_packs, layout.packs), 32) * 32);
    layout.lanes = layout.seg;
    layout.per_block = 1;
  }
  layout.row_lanes = kThreads / layout.lanes;
  layout.tiles = ceil_div(heads, layout.per_block);
  return layout;
}

// The lane's place: its head, and the packs of that head it holds (pack p of the lane is the head's pack
// lane + p * seg); inactive packs pad segments and tiles.
template <int P>
struct HeadLane {
  int64_t head;
  int64_t first_pack;  // the row's pack index of this lane's pack 0
  bool active[P];
  bool leader;  // lane 0 of its head: writes the head's scalars

  __device__ int64_t pack(int p, int seg) const {
    return first_pack + int64_t{p} * seg;
  }
};

template <int P>
__device__ HeadLane<P> head_lane(const HeadLayout& layout, int64_t tile, int64_t heads) {
  HeadLane<P> me{};
  me.head = tile * layout.per_block + threadIdx.x / layout.seg;
  const int lane = threadIdx.x % layout.seg;
  me.first_pack = me.head * layout.head_packs + lane;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    me.active[p] = me.head < heads && lane + int64_t{p} * layout.seg < layout.head_packs;
  }
  me.leader = me.active[0] && lane == 0;
  return me;
}

// The lane's share of a score: its packs' features times the query's, in one fixed order (the forward and the
// backward both call it, so a recomputed score has the forward's bits).
// shrink: 1, or kDotShrink for the second form of overflowed_scores.
template <int P, int VEC, typename acc>
__device__ __forceinline__ acc lane_dot(const acc (&x)[P][VEC], const acc (&q)[P][VEC], acc shrink = acc(1)) {
  acc s = acc(0);
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      s += (x[p][i] * shrink) * q[p][i];
    }
  }
  return s;
}

// Loads the lane's packs of one row (zeros for inactive packs).
template <int P, int VEC, typename scalar_t, typename acc>
__device__ __forceinline__ void load_lane(const scalar_t* row, const HeadLane<P>& me, int seg, int64_t sd,
                                          acc (&x)[P][VEC]) {
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (me.active[p]) {
      load_features<VEC>(row, me.pack(p, seg), sd, x[p]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        x[p][i] = acc(0);
      }
    }
  }
}

// Loads the lane's packs of a [D] vector in the accumulation type (zeros for inactive packs).
template <int P, int VEC, typename acc>
__device__ __forceinline__ void load_lane_wide(const acc* vector, const HeadLane<P>& me, int seg,
                                               acc (&x)[P][VEC]) {
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      x[p][i] = me.active[p] ? vector[me.pack(p, seg) * VEC + i] : acc(0);
    }
  }
}

// Sums each of values[0, N) over the lanes of its head; every lane of the head gets the same bits. Every thread
// of the block must call it (wide heads go through shared memory).
template <int N, typename acc>
__device__ void head_sums(acc (&values)[N], int seg) {
  __shared__ acc warp_sums[kMaxSums * 32];
  static_assert(N <= kMaxSums);
#pragma unroll
  for (int r = 0; r < N; ++r) {
    values[r] = segment_sum(values[r], std::min(seg, 32));
  }
  if (seg <= 32) {
    return;
  }
  const int warps = seg / 32, warp = threadIdx.x / 32;
  const int base = threadIdx.y * N * warps;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int r = 0; r < N; ++r) {
      warp_sums[base + r * warps + warp] = values[r];
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < N; ++r) {
    acc total = warp_sums[base + r * warps];
    for (int w = 1; w < warps; ++w) {
      total += warp_sums[base + r * warps + w];
    }
    values[r] = total;
  }
  __syncthreads();
}

// Rows near float32's maximum overflow the dot product <x, q> though scale * <x, q> may be finite. Such scores
// are summed again from the products of the rows scaled by kDotShrink (a power of two, so with the same roundings)
// and scaled back after the scale.
constexpr float kDotShrink = 0x1p-64f;

// The scores scale * <x, q> of the rows in flight, from their head sums (`sums`, after head_sums) and, where
// a sum is not finite in float32, from `shrunk`: each row's lane_dot with kDotShrink, summed here. Every thread of
// the block must call it (head_sums); which scores take the second form depends only on their own sums, so the
// backward recomputes the forward's bits.
template <int N, typename acc>
__device__ __forceinline__ void scale_scores(acc (&sums)[N], acc (&shrunk)[N], int seg, acc scale) {
  bool overflowed = false;
#pragma unroll
  for (int r = 0; r < N; ++r) {
    overflowed |= !isfinite(sums[r]);
  }
  if constexpr (std::is_same_v<acc, float>) {
    if (__syncthreads_or(overflowed)) {  // the whole block takes the same branch
      head_sums(shrunk, seg);
#pragma unroll
      for (int r = 0; r < N; ++r) {
        sums[r] = isfinite(sums[r]) ? sums[r] * scale : shrunk[r] * scale / kDotShrink;
      }
      return;
    }
  }
#pragma unroll
  for (int r = 0; r < N; ++r) {
    sums[r] *= scale;
  }
}

// Where row lane y >= 1 of a block hands its values (slot values each) to row lane 0, which keeps its own in
// registers. The launches size the shared memory for row_lanes - 1 lanes: all of them would pass the 48 KB a launch
// may take without opting in, for a bfloat16 head of 2k-4k features (packs of 8, 4 per lane, 2 row lanes).
__device__ __forceinline__ int64_t row_lane_slot(int y, int lanes, int slot) {
  return (int64_t{y - 1} * lanes + threadIdx.x) * slot;
}

// Bytes of shared memory for the row lanes' hand-over of `slot` values of type acc each.
template <typename acc>
size_t row_lane_bytes(const HeadLayout& layout, int slot) {
  return size_t(layout.row_lanes - 1) * size_t(layout.lanes) * size_t(slot) * sizeof(acc);
}

// The factor exp(from - to) that moves a sum of weights exp(. - from) to exp(. - to), to >= from: 0 where there was
// nothing yet (from = -inf).
template <typename acc>
__device__ __forceinline__ acc rescale_factor(acc from, acc to) {
  return from == to ? acc(1) : (from == -std::numeric_limits<acc>::infinity() ? acc(0) : device_exp(from - to));
}

// sum += a * b, compensated, with the product's own rounding error, which an fma gives exactly.
template <typename acc>
__device__ __forceinline__ void add_product(acc& sum, acc& carry, acc a, acc b) {
  const acc product = mul_rn(a, b);
  add_compensated(sum, carry, product, fma(a, b, -product));
}

// Scales total and weighted (P x VEC values) from exp(. - from) to exp(. - to), to >= from; a lane with nothing
// yet (from = -inf) contributes nothing.
template <int P, int VEC, typename acc>
__device__ __forceinline__ void rescale(acc from, acc to, acc& total, acc (&weighted)[P][VEC]) {
  if (from == to) {
    return;
  }
  const acc factor = rescale_factor(from, to);
  total *= factor;
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      weighted[p][i] *= factor;
    }
  }
}

// rescale() for compensated sums: each sum and its compensation carry (what its roundings lost) scale alike.
template <int P, int VEC, typename acc>
__device__ __forceinline__ void rescale(acc from, acc to, acc& total, acc& total_carry, acc (&weighted)[P][VEC],
                                        acc (&carry)[P][VEC]) {
  rescale(from, to, total_carry, carry);
  rescale(from, to, total, weighted);
}

template <typename scalar_t, int VEC, int P>
__global__ void __launch_bounds__(kThreads)
    attention_chunks(const scalar_t* hidden, int64_t sb, int64_t sl, int64_t sd, SelectedRows rows,
                     const acc_t<scalar_t>* query, acc_t<scalar_t> scale, int64_t heads, HeadLayout layout,
                     ChunkView chunks, scalar_t* out, double* stats, acc_t<scalar_t>* scores, int64_t row_values_batch,
                     acc_t<scalar_t>* part_max, acc_t<scalar_t>* part_sum, double* part_out) {
  using acc = acc_t<scalar_t>;
  constexpr acc kNegInf = -std::numeric_limits<acc>::infinity();
  // Rows near acc's maximum (float32's range, which bfloat16 shares) overflow a weighted sum whose mean is finite:
  // such a chunk is summed again with the weights scaled by kOverflowShrink (common.cuh), scaled back where its sums
  // are divided by the total or stored in float64. Inputs that are inf or NaN take the second pass too, and stay so.
  static_assert(kChunkRows <= 128 && kThreads / 32 <= 256,
                "a shrunk chunk's sums, and the merge of up to kThreads / 32 row lanes' sums, must stay finite");
  constexpr int R = kRowsInFlight / P;  // a lane with more packs keeps fewer rows in flight (same registers)
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int64_t tile = blockIdx.x % layout.tiles, part = blockIdx.x / layout.tiles;
  if (part >= chunks.count()) {
    return;  // past the texts' chunks (the grid is sized by a bound)
  }
  const int64_t b = chunks.text_of(part), chunk = part - chunks.first[b];
  const int64_t n = rows.rows(b), begin = chunk * kChunkRows;
  const int64_t end = std::min(begin + kChunkRows, n), dim = heads * layout.head_packs * VEC;
  __shared__ int64_t chunk_row[kChunkRows];
  stage_chunk_rows(rows, b, begin, end, chunk_row);
  const HeadLane<P> me = head_lane<P>(layout, tile, heads);
  acc q[P][VEC];
  load_lane_wide(query, me, layout.seg, q);
  const scalar_t* text = hidden + b * sb;
  const int64_t step = int64_t{layout.row_lanes} * R;
  // A lane's total and weighted sums are compensated (add_compensated, add_product): carry holds what their
  // roundings lost, the products' included, and the row lanes' sums are merged and divided in float64 with their
  // carries; so a chunk's weighted mean is within about an ulp of float64's of the exact one, where 128 plain
  // float32 additions of a constant lose up to 30 ulp of float32 (simulated on the CPU). Where a text's rows agree
  // in a feature, its mean is then that value exactly: the backward works relative to the mean and so gets exact
  // zeros there, where an H100 left 3e25 in such a query gradient over rows near float32's maximum when the
  // products were rounded uncompensated and the row lanes merged in float32. An overflow makes the sums NaN, which
  // sends the chunk to the scaled second pass below.
  acc best, total, total_carry, weighted[P][VEC], carry[P][VEC];
  // One pass over the chunk's rows (this lane's share) with an online softmax, the weights scaled by shrink.
  const auto sum_chunk = [&](acc shrink) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        weighted[p][i] = acc(0);
        carry[p][i] = acc(0);
      }
    }
    best = kNegInf;
    total = total_carry = 0;
    for (int64_t base = begin; base < end; base += step) {
      acc x[R][P][VEC], s[R], shrunk[R];
      int64_t at[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t j = base + int64_t{r} * layout.row_lanes + threadIdx.y;
        at[r] = j < end ? chunk_row[j - begin] : -1;
        s[r] = shrunk[r] = acc(0);
        if (at[r] >= 0) {
          load_lane(text + at[r] * sl, me, layout.seg, sd, x[r]);
          s[r] = lane_dot(x[r], q);
          shrunk[r] = lane_dot(x[r], q, acc(kDotShrink));
        }
      }
      head_sums(s, layout.seg);
      scale_scores(s, shrunk, layout.seg, scale);
      acc top = best;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (at[r] >= 0) {
          top = s[r] > top ? s[r] : top;
          if (scores != nullptr && me.leader) {
            scores[b * row_values_batch + me.head * rows.seq_len + at[r]] = s[r];
          }
        }
      }
      rescale(best, top, total, total_carry, weighted, carry);
      best = top;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (at[r] >= 0) {
          const acc p = device_exp(s[r] - best);
          add_compensated(total, total_carry, p);
          const acc shrunk = p * shrink;  // exact: a power of two
#pragma unroll
          for (int k = 0; k < P; ++k) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              add_product(weighted[k][i], carry[k][i], shrunk, x[r][k][i]);
            }
          }
        }
      }
    }
  };
  acc shrink = acc(1);
  sum_chunk(shrink);
  bool overflowed = false;
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      overflowed |= near_overflow(weighted[p][i]);
    }
  }
  if (__syncthreads_or(overflowed)) {  // the whole block takes the same branch
    shrink = kOverflowShrink<acc>;
    sum_chunk(shrink);
  }

  // In float64: each lane's sums less their carries, row lanes 1.. handing theirs (through shared memory) to row
  // lane 0, which merges them in order.
  double sum_total = static_cast<double>(total) - static_cast<double>(total_carry), sums[P][VEC];
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      sums[p][i] = static_cast<double>(weighted[p][i]) - static_cast<double>(carry[p][i]);
    }
  }
  if (layout.row_lanes > 1) {
    acc* shared = reinterpret_cast<acc*>(shared_bytes);
    constexpr int kSlot = kForwardSlot<P, VEC>;
    if (threadIdx.y > 0) {
      const int64_t mine = row_lane_slot(threadIdx.y, layout.lanes, kSlot);
      shared[mine] = best;
      shared[mine + 1] = total;
      shared[mine + 2] = total_carry;
#pragma unroll
      for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          shared[mine + 3 + p * VEC + i] = weighted[p][i];
          shared[mine + 3 + (P + p) * VEC + i] = carry[p][i];
        }
      }
    }
    __syncthreads();
    if (threadIdx.y != 0) {
      return;
    }
    for (int y = 1; y < layout.row_lanes; ++y) {
      const acc* other = shared + row_lane_slot(y, layout.lanes, kSlot);
      const acc top = other[0] > best ? other[0] : best;
      const double mine_factor = rescale_factor(best, top), other_factor = rescale_factor(other[0], top);
      sum_total = sum_total * mine_factor +
                  (static_cast<double>(other[1]) - static_cast<double>(other[2])) * other_factor;
#pragma unroll
      for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const double theirs =
              static_cast<double>(other[3 + p * VEC + i]) - static_cast<double>(other[3 + (P + p) * VEC + i]);
          sums[p][i] = sums[p][i] * mine_factor + theirs * other_factor;
        }
      }
      best = top;
    }
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (!me.active[p]) {
      continue;
    }
    const int64_t feature = me.pack(p, layout.seg) * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      // The chunk's weighted mean: the text's result where it is the only chunk, else see attention_combine.
      const double mean = sums[p][i] / sum_total / static_cast<double>(shrink);
      if (n <= kChunkRows) {
        out[b * dim + feature + i] = n == 0 ? scalar_t(0) : static_cast<scalar_t>(mean);
      } else {
        part_out[part * dim + feature + i] = mean;
      }
    }
  }
  if (me.leader) {
    if (n <= kChunkRows) {  // the text's only chunk; a text with no valid row gets -inf statistics
      stats[(b * heads + me.head) * 2] = n == 0 ? -std::numeric_limits<double>::infinity() : best;
      stats[(b * heads + me.head) * 2 + 1] = n == 0 ? -std::numeric_limits<double>::infinity() : sum_total;
    } else {
      part_max[part * heads + me.head] = best;
      part_sum[part * heads + me.head] = static_cast<acc>(sum_total);
    }
  }
}

// Finishes the texts with more than one chunk: the chunks' (max, total, weighted mean), merged warp by warp in chunk
// order and then in warp order (common.cuh: kCombineLanes), each mean weighted by its chunk's share of the text's
// total. Means rather than weighted sums: each is at most the largest value, and so is every partial sum of them,
// so float64 rows near float64's maximum merge to a finite result wherever it is finite.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    attention_combine(const acc_t<scalar_t>* part_max, const acc_t<scalar_t>* part_sum, const double* part_out,
                      SelectedRows rows, int64_t batch, int64_t heads, int64_t head_dim, ChunkView chunks,
                      scalar_t* out, double* stats) {
  using acc = acc_t<scalar_t>;
  constexpr acc kNegInf = -std::numeric_limits<acc>::infinity();
  __shared__ acc top_of[kWarpsPerBlock][kCombineLanes];
  __shared__ double sum_of[kWarpsPerBlock][kCombineLanes];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t dim = heads * head_dim;
  // The warps' compensated sums (ChunkSum: float64, so the error does not grow with the number of chunks), taken in
  // warp order, in every warp.
  const auto merged = [&](const ChunkSum& mine) {
    share_lanes(mine.value(), sum_of);
    ChunkSum all;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      all.add(sum_of[w][lane]);
    }
    return all.value();
  };
  for_each_combine_item(batch, dim, [&](int64_t b, int64_t d) {
    const int64_t n = rows.rows(b);
    if (n <= kChunkRows) {
      return;  // the text's only chunk finished it
    }
    const bool active = d < dim;
    const int64_t h = active ? d / head_dim : 0, first = chunks.first[b], used = ceil_div(n, kChunkRows);
    // The text's maximum score for the lane's head, over every warp's chunks (a maximum: in any order).
    acc best = kNegInf;
#pragma unroll 4  // loads in flight
    for (int64_t c = warp; active && c < used; c += kWarpsPerBlock) {
      const acc m = part_max[(first + c) * heads + h];
      best = m > best ? m : best;
    }
    share_lanes(best, top_of);
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      best = top_of[w][lane] > best ? top_of[w][lane] : best;
    }
    // Each chunk's total rescaled to that maximum.
    const auto rescaled_sum = [&](int64_t part) {
      const acc m = part_max[part * heads + h];
      const acc factor = m == best ? acc(1) : (m == kNegInf ? acc(0) : device_exp(m - best));
      return static_cast<double>(part_sum[part * heads + h] * factor);
    };
    ChunkSum warp_total, warp_weighted;
#pragma unroll 4
    for (int64_t c = warp; active && c < used; c += kWarpsPerBlock) {
      warp_total.add(rescaled_sum(first + c));
    }
    const double total = merged(warp_total);
#pragma unroll 4
    for (int64_t c = warp; active && c < used; c += kWarpsPerBlock) {
      warp_weighted.add(part_out[(first + c) * dim + d] * (rescaled_sum(first + c) / total));
    }
    const double weighted = merged(warp_weighted);
    if (warp == 0 && active) {
      out[b * dim + d] = static_cast<scalar_t>(weighted);
      if (d % head_dim == 0) {
        stats[(b * heads + h) * 2] = best;
        stats[(b * heads + h) * 2 + 1] = total;
      }
    }
  });
}

// weights[b, h, l] (packed: [h, l]) = exp(score - max) / sum for the valid rows (scores were left there by
// attention_chunks). A thread per (chunk, head, row of the chunk): the grid is sized by the chunks' bound.
template <typename acc>
__global__ void scores_to_weights(acc* weights, int64_t row_values_batch, const double* stats, SelectedRows rows,
                                  ChunkView chunks, int64_t heads) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t part = i / (heads * kChunkRows), h = i / kChunkRows % heads;
  if (part >= chunks.count()) {
    return;
  }
  const int64_t b = chunks.text_of(part), j = (part - chunks.first[b]) * kChunkRows + i % kChunkRows;
  if (j >= rows.rows(b)) {
    return;
  }
  const int64_t bh = b * heads + h;
  acc& w = weights[b * row_values_batch + h * rows.seq_len + rows.row(b, j)];
  w = device_exp(w - static_cast<acc>(stats[bh * 2])) / static_cast<acc>(stats[bh * 2 + 1]);
}

template <typename scalar_t, int VEC, int P>
__global__ void __launch_bounds__(kThreads)
    attention_backward_chunks(const scalar_t* hidden, int64_t sb, int64_t sl, int64_t sd, SelectedRows rows,
                              const acc_t<scalar_t>* query, acc_t<scalar_t> scale, int64_t heads, HeadLayout layout,
                              ChunkView chunks, const acc_t<scalar_t>* grad, const acc_t<scalar_t>* grad_weights,
                              const acc_t<scalar_t>* out, const double* stats, acc_t<scalar_t>* prob, double* err,
                              int64_t row_values_batch, double* part_pe, double* part_pex, double* part_px) {
  using acc = acc_t<scalar_t>;
  // Rows near acc's maximum (float32's range, which bfloat16 shares) make x - m overflow though every gradient is
  // finite. Such a chunk is summed again with x - m taken as x * shrink - m * shrink, shrink = kOverflowShrink
  // (common.cuh): e and the sums of p e and p (x - m) carry one factor shrink, that of p e (x - m) two, taken out
  // where they are stored in float64. Inputs that are inf or NaN take the second pass too, and stay so; so does a
  // p e (x - m) past float32's range even shrunk, whose query gradient is past it too.
  constexpr int R = kRowsInFlight / P;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int64_t tile = blockIdx.x % layout.tiles, part = blockIdx.x / layout.tiles;
  if (part >= chunks.count()) {
    return;  // past the texts' chunks (the grid is sized by a bound)
  }
  const int64_t b = chunks.text_of(part), chunk = part - chunks.first[b];
  const int64_t n = rows.rows(b), begin = chunk * kChunkRows;
  if (begin >= n) {
    return;  // a text with no valid row: its one chunk has no rows
  }
  const int64_t end = std::min(begin + kChunkRows, n), dim = heads * layout.head_packs * VEC;
  __shared__ int64_t chunk_row[kChunkRows];
  stage_chunk_rows(rows, b, begin, end, chunk_row);
  const HeadLane<P> me = head_lane<P>(layout, tile, heads);
  const int64_t head = std::min(me.head, heads - 1), bh = b * heads + head;
  const acc best = static_cast<acc>(stats[bh * 2]), total = static_cast<acc>(stats[bh * 2 + 1]);
  acc q[P][VEC], g[P][VEC], m[P][VEC], pex[P][VEC], px[P][VEC], pe;
  load_lane_wide(query, me, layout.seg, q);
  load_lane_wide(grad + b * dim, me, layout.seg, g);
  load_lane_wide(out + b * dim, me, layout.seg, m);
  const scalar_t* text = hidden + b * sb;
  const int64_t step = int64_t{layout.row_lanes} * R;
  // One pass over the chunk's rows (this lane's share), x - m taken as x * shrink - m * shrink.
  const auto sum_chunk = [&](acc shrink) {
    pe = acc(0);
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        pex[p][i] = px[p][i] = acc(0);
      }
    }
    for (int64_t base = begin; base < end; base += step) {
      acc x[R][P][VEC], sums[2 * R], shrunk[R];  // sums: scores, then <g, x - m>
      int64_t at[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t j = base + int64_t{r} * layout.row_lanes + threadIdx.y;
        at[r] = j < end ? chunk_row[j - begin] : -1;
        sums[r] = sums[R + r] = shrunk[r] = acc(0);
        if (at[r] >= 0) {
          load_lane(text + at[r] * sl, me, layout.seg, sd, x[r]);
          sums[r] = lane_dot(x[r], q);  // as in attention_chunks, so the score has the forward's bits
          shrunk[r] = lane_dot(x[r], q, acc(kDotShrink));
#pragma unroll
          for (int k = 0; k < P; ++k) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              x[r][k][i] = x[r][k][i] * shrink - m[k][i] * shrink;
              sums[R + r] += g[k][i] * x[r][k][i];
            }
          }
        }
      }
      head_sums(sums, layout.seg);
      acc scores[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        scores[r] = sums[r];
      }
      scale_scores(scores, shrunk, layout.seg, scale);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (at[r] >= 0) {
          const acc p = device_exp(scores[r] - best) / total;
          const int64_t row = b * row_values_batch + head * rows.seq_len + at[r];
          const acc e = sums[R + r] + (grad_weights != nullptr ? grad_weights[row] * shrink : acc(0));
          if (me.leader) {
            prob[row] = p;
            err[row] = static_cast<double>(e) / static_cast<double>(shrink);
          }
          pe += p * e;
#pragma unroll
          for (int k = 0; k < P; ++k) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              pex[k][i] += p * e * x[r][k][i];
              px[k][i] += p * x[r][k][i];
            }
          }
        }
      }
    }
  };
  acc shrink = acc(1);
  sum_chunk(shrink);
  bool overflowed = near_overflow(pe);
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      overflowed |= near_overflow(pex[p][i]) || near_overflow(px[p][i]);
    }
  }
  if (__syncthreads_or(overflowed)) {  // the whole block takes the same branch
    shrink = kOverflowShrink<acc>;
    sum_chunk(shrink);
  }

  if (layout.row_lanes > 1) {
    acc* shared = reinterpret_cast<acc*>(shared_bytes);
    constexpr int kSlot = kBackwardSlot<P, VEC>;
    if (threadIdx.y > 0) {
      const int64_t mine = row_lane_slot(threadIdx.y, layout.lanes, kSlot);
      shared[mine] = pe;
#pragma unroll
      for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          shared[mine + 1 + p * VEC + i] = pex[p][i];
          shared[mine + 1 + (P + p) * VEC + i] = px[p][i];
        }
      }
    }
    __syncthreads();
    if (threadIdx.y != 0) {
      return;
    }
    for (int y = 1; y < layout.row_lanes; ++y) {
      const acc* other = shared + row_lane_slot(y, layout.lanes, kSlot);
      pe += other[0];
#pragma unroll
      for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          pex[p][i] += other[1 + p * VEC + i];
          px[p][i] += other[1 + (P + p) * VEC + i];
        }
      }
    }
  }
  const double unshrink = 1.0 / static_cast<double>(shrink);
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (me.active[p]) {
      const int64_t feature = me.pack(p, layout.seg) * VEC;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        part_pex[part * dim + feature + i] = static_cast<double>(pex[p][i]) * unshrink * unshrink;
        part_px[part * dim + feature + i] = static_cast<double>(px[p][i]) * unshrink;
      }
    }
  }
  if (me.leader) {
    part_pe[part * heads + me.head] = static_cast<double>(pe) * unshrink;
  }
}

// Per (text, feature): S = the sum of p e over the text's chunks (kept per (text, head) for the rows) and the text's
// share of the query gradient, scale * (sum p e (x - m) - S sum p (x - m)), each summed in float64, warp by warp
// in chunk order and then in warp order (common.cuh: kCombineLanes). The shares are then summed over the texts by a
// deterministic ATen reduction.
template <typename acc>
__global__ void __launch_bounds__(kThreads)
    attention_text_sums(const double* part_pe, const double* part_pex, const double* part_px, SelectedRows rows,
                        int64_t batch, int64_t heads, int64_t head_dim, ChunkView chunks, acc scale,
                        double* text_sums, acc* query_shares) {
  __shared__ double s_of[kWarpsPerBlock][kCombineLanes], pex_of[kWarpsPerBlock][kCombineLanes],
      px_of[kWarpsPerBlock][kCombineLanes];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t dim = heads * head_dim;
  for_each_combine_item(batch, dim, [&](int64_t b, int64_t d) {
    const bool active = d < dim;
    const int64_t h = active ? d / head_dim : 0, first = chunks.first[b];
    const int64_t used = ceil_div(rows.rows(b), kChunkRows);
    double s = 0, pex = 0, px = 0;  // float64, so the error does not grow with the number of chunks
    if (used > 1) {
#pragma unroll 4  // loads in flight
      for (int64_t c = warp; active && c < used; c += kWarpsPerBlock) {
        s += part_pe[(first + c) * heads + h];
        pex += part_pex[(first + c) * dim + d];
        px += part_px[(first + c) * dim + d];
      }
      share_lanes(s, s_of);  // the same branch for the whole block: one text
      share_lanes(pex, pex_of);
      share_lanes(px, px_of);
      s = pex = px = 0;
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        s += s_of[w][lane];
        pex += pex_of[w][lane];
        px += px_of[w][lane];
      }
    } else if (used == 1 && active) {  // a text of one chunk (the usual short text): its values
      s = part_pe[first * heads + h];
      pex = part_pex[first * dim + d];
      px = part_px[first * dim + d];
    }
    if (warp == 0 && active) {
      query_shares[b * dim + d] = static_cast<acc>(scale * (pex - s * px));
      if (d % head_dim == 0) {
        text_sums[b * heads + h] = s;
      }
    }
  });
}

// Every row of grad_hidden, a warp per row: p g + scale p (e - S) q for a valid row, zeros elsewhere. Packs never
// straddle heads, so each pack reads its head's p, e and S once and grad and query as packs. Rows: batch * seq_len
// of a padded batch, or the seq_len rows of a packed one (offsets, its [B + 1], bound each text's rows).
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    attention_grad_rows(const bool* valid, const int64_t* offsets, int64_t texts, const acc_t<scalar_t>* prob,
                        const double* err, int64_t row_values_batch, const double* text_sums,
                        const acc_t<scalar_t>* grad, const acc_t<scalar_t>* query, acc_t<scalar_t> scale,
                        int64_t rows, int64_t seq_len, int64_t heads, int64_t head_dim, scalar_t* grad_hidden) {
  using acc = acc_t<scalar_t>;
  const int lane = threadIdx.x % 32;
  const int64_t dim = heads * head_dim, packs = dim / VEC, head_packs = head_dim / VEC;
  for_each_warp_row(rows, [&](int64_t row) {
    const int64_t b = offsets != nullptr ? text_of_row(offsets, texts, row) : row / seq_len;
    const int64_t l = offsets != nullptr ? row : row % seq_len;
    const bool is_valid = valid == nullptr || valid[row];
    for (int64_t v = lane; v < packs; v += 32) {
      acc x[VEC];
      if (is_valid) {
        const int64_t h = static_cast<int32_t>(v) / static_cast<int32_t>(head_packs);  // D < 2^31
        const int64_t at = b * row_values_batch + h * seq_len + l, bh = b * heads + h;
        const acc p = prob[at];
        const auto c = static_cast<acc>(scale * p * (err[at] - text_sums[bh]));  // e, S: past float32's range
        acc g[VEC], q[VEC];
        load_pack<VEC>(grad + b * dim + v * VEC, g);
        load_pack<VEC>(query + v * VEC, q);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          x[i] = p * g[i] + c * q[i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          x[i] = acc(0);
        }
      }
      store_features<VEC>(grad_hidden + row * dim, v, x);
    }
  });
}

int64_t checked_blocks(int64_t blocks) {
  LMK_CHECK(
      blocks <= std::numeric_limits<int32_t>::max(), "lmk_ops.attention_pool: needs ", blocks,
      " CUDA blocks, more than one launch takes; split the batch");
  return blocks;
}

// Runs body.template operator()<VEC, P>() for the layout's pack width and packs per lane.
template <typename scalar_t, typename Body>
void with_head_layout(const HeadLayout& layout, const Body& body) {
  with_vector_width<scalar_t>(layout.vec, [&]<int VEC>() {
    if (layout.packs == kWidePacks) {
      body.template operator()<VEC, kWidePacks>();
    } else {
      body.template operator()<VEC, 1>();
    }
  });
}

// What the forward and the backward share: sizes, the hidden states the kernels read, the valid rows listed, the
// chunking and the head layout (the backward must use the forward's layout to recompute its scores bit for bit).
struct Plan {
  int64_t batch, seq_len, dim, heads, head_dim;
  Tensor hidden;
  RowList list;
  ChunkPlan chunks;
  HeadLayout layout;
  ScalarType wide;            // the accumulation type
  int64_t row_values_batch;  // elements between two texts' per-row values (weights, p, e): H * L, packed 0
};

// hidden's rows in an aligned contiguous copy. A packed batch (batch stride 0: every text views the same T rows)
// copies its T rows once and views them as the batch again.
Tensor contiguous_rows(const Tensor& hidden) {
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  if (hidden.stride(0) != 0) {
    Tensor copy = empty_on(hidden, hidden.sizes(), hidden.scalar_type());
    torch::stable::copy_(copy, hidden);
    return copy;
  }
  Tensor rows = empty_on(hidden, {seq_len, dim}, hidden.scalar_type());
  torch::stable::copy_(rows, as_strided(hidden, {seq_len, dim}, {hidden.stride(1), hidden.stride(2)}));
  return as_strided(rows, {batch, seq_len, dim}, {0, dim, 1});
}

// A head wider than kMaxHeadPacks features on the strided path (rows not contiguous or not 16-byte aligned) is read
// from an aligned contiguous copy, which holds it in packs; the widest head is then kMaxHeadPacks packs.
template <typename scalar_t>
Plan make_plan(const Tensor& hidden, const AttentionRows& rows, const Tensor& query) {
  constexpr int kWidest = 16 / sizeof(scalar_t);
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), heads = query.size(0), head_dim = query.size(1);
  Tensor source = hidden;
  int vec = vector_width<scalar_t>(hidden, head_dim);
  if (vec == 1 && head_dim > kMaxHeadPacks && head_dim % kWidest == 0) {
    source = contiguous_rows(hidden);
    vec = vector_width<scalar_t>(source, head_dim);
  }
  LMK_CHECK(
      head_dim / vec <= kMaxHeadPacks, "lmk_ops.attention_pool: on CUDA a head is at most ",
      kMaxHeadPacks * kWidest, " features wide in ", torch::headeronly::toString(hidden.scalar_type()), " (",
      kMaxHeadPacks, " when its width is not a multiple of ", kWidest, "), got ", head_dim);
  RowList list = select_rows(rows.listed, batch, seq_len);
  ChunkPlan chunks = plan_chunks(list, batch, hidden);
  return {batch, seq_len, hidden.size(2), heads, head_dim, source, std::move(list), std::move(chunks),
          head_layout(vec, heads, head_dim), acc_dtype(hidden.scalar_type()), rows.packed() ? 0 : heads * seq_len};
}

template <typename scalar_t>
void forward_typed(const Tensor& hidden_in, const AttentionRows& rows, const Tensor& query, double scale,
                   Tensor& out, Tensor& stats, Tensor& weights) {
  using acc = acc_t<scalar_t>;
  const Plan plan = make_plan<scalar_t>(hidden_in, rows, query);
  const auto& [batch, seq_len, dim, heads, head_dim, hidden, list, chunks, layout, wide, row_values_batch] = plan;
  Tensor part_max, part_sum, part_out;
  if (chunks.several()) {
    part_max = empty_on(hidden, {chunks.bound, heads}, wide);
    part_sum = empty_on(hidden, {chunks.bound, heads}, wide);
    part_out = empty_on(hidden, {chunks.bound, dim}, ScalarType::Double);  // near acc's maximum: see attention_combine
  }
  const auto data = [](Tensor& t) { return t.defined() ? t.mutable_data_ptr<acc>() : nullptr; };
  double* chunk_out = part_out.defined() ? part_out.mutable_data_ptr<double>() : nullptr;
  with_head_layout<scalar_t>(layout, [&]<int VEC, int P>() {
    const size_t shared = row_lane_bytes<acc>(layout, kForwardSlot<P, VEC>);
    attention_chunks<scalar_t, VEC, P>
        <<<checked_blocks(chunks.bound * layout.tiles), dim3(layout.lanes, layout.row_lanes), shared, stream()>>>(
            hidden.const_data_ptr<scalar_t>(), hidden.stride(0), hidden.stride(1), hidden.stride(2), list.view(),
            query.const_data_ptr<acc>(), static_cast<acc>(scale), heads, layout, chunks.view(),
            out.mutable_data_ptr<scalar_t>(),
            stats.mutable_data_ptr<double>(), data(weights), row_values_batch, data(part_max), data(part_sum),
            chunk_out);
    check_launch();
  });
  if (chunks.several()) {
    attention_combine<scalar_t><<<grid_for(combine_items(batch, dim), 1), kThreads, 0, stream()>>>(
        data(part_max), data(part_sum), chunk_out, list.view(), batch, heads, head_dim, chunks.view(),
        out.mutable_data_ptr<scalar_t>(), stats.mutable_data_ptr<double>());
    check_launch();
  }
  if (weights.defined()) {
    scores_to_weights<acc><<<ceil_div(chunks.bound * heads * kChunkRows, kThreads), kThreads, 0, stream()>>>(
        weights.mutable_data_ptr<acc>(), row_values_batch, stats.const_data_ptr<double>(), list.view(), chunks.view(),
        heads);
    check_launch();
  }
}

template <typename scalar_t>
void backward_typed(const Tensor& grad, const Tensor& grad_weights, const Tensor& hidden_in,
                    const AttentionRows& rows, const Tensor& query, const Tensor& out, const Tensor& stats,
                    double scale, Tensor& grad_hidden, Tensor& grad_query) {
  using acc = acc_t<scalar_t>;
  const Plan plan = make_plan<scalar_t>(hidden_in, rows, query);
  const auto& [batch, seq_len, dim, heads, head_dim, hidden, list, chunks, layout, wide, row_values_batch] = plan;
  // p and e per (text, head, row): [B, H, L], or [H, T] for a packed batch (its texts' rows never overlap).
  const int64_t row_texts = rows.packed() ? 1 : batch;
  Tensor prob = empty_on(hidden, {row_texts, heads, seq_len}, wide);
  // e, S and the chunk sums in float64: near float32's maximum they pass its range though the gradients do not.
  Tensor err = empty_on(hidden, {row_texts, heads, seq_len}, ScalarType::Double);
  Tensor part_pe = empty_on(hidden, {chunks.bound, heads}, ScalarType::Double);
  Tensor part_pex = empty_on(hidden, {chunks.bound, dim}, ScalarType::Double);
  Tensor part_px = empty_on(hidden, {chunks.bound, dim}, ScalarType::Double);
  Tensor text_sums = empty_on(hidden, {batch, heads}, ScalarType::Double);
  Tensor query_shares = empty_on(hidden, {batch, dim}, wide);
  const acc wide_scale = static_cast<acc>(scale);
  with_head_layout<scalar_t>(layout, [&]<int VEC, int P>() {
    const size_t shared = row_lane_bytes<acc>(layout, kBackwardSlot<P, VEC>);
    attention_backward_chunks<scalar_t, VEC, P>
        <<<checked_blocks(chunks.bound * layout.tiles), dim3(layout.lanes, layout.row_lanes), shared, stream()>>>(
            hidden.const_data_ptr<scalar_t>(), hidden.stride(0), hidden.stride(1), hidden.stride(2), list.view(),
            query.const_data_ptr<acc>(), wide_scale, heads, layout, chunks.view(), grad.const_data_ptr<acc>(),
            grad_weights.defined() ? grad_weights.const_data_ptr<acc>() : nullptr, out.const_data_ptr<acc>(),
            stats.const_data_ptr<double>(), prob.mutable_data_ptr<acc>(), err.mutable_data_ptr<double>(),
            row_values_batch, part_pe.mutable_data_ptr<double>(), part_pex.mutable_data_ptr<double>(),
            part_px.mutable_data_ptr<double>());
    check_launch();
  });
  attention_text_sums<acc><<<grid_for(combine_items(batch, dim), 1), kThreads, 0, stream()>>>(
      part_pe.const_data_ptr<double>(), part_pex.const_data_ptr<double>(), part_px.const_data_ptr<double>(),
      list.view(), batch, heads, head_dim, chunks.view(), wide_scale, text_sums.mutable_data_ptr<double>(),
      query_shares.mutable_data_ptr<acc>());
  check_launch();
  Tensor flat_grad_query = torch::stable::view(grad_query, {dim});
  torch::stable::sum_out(flat_grad_query, query_shares, torch::headeronly::IntHeaderOnlyArrayRef({int64_t{0}}));
  int vec = vector_width<scalar_t>(grad_hidden, head_dim);
  vec = packs_fit(grad, vec) && packs_fit(query, vec) ? vec : 1;
  const int64_t grad_rows = rows.packed() ? seq_len : batch * seq_len;
  with_vector_width<scalar_t>(vec, [&]<int VEC>() {
    attention_grad_rows<scalar_t, VEC><<<grid_for(grad_rows, kWarpsPerBlock), kThreads, 0, stream()>>>(
        rows.valid.defined() ? rows.valid.const_data_ptr<bool>() : nullptr,
        rows.packed() ? rows.listed.offsets.const_data_ptr<int64_t>() : nullptr, batch, prob.const_data_ptr<acc>(),
        err.const_data_ptr<double>(), row_values_batch, text_sums.const_data_ptr<double>(), grad.const_data_ptr<acc>(),
        query.const_data_ptr<acc>(), wide_scale, grad_rows, seq_len, heads, head_dim,
        grad_hidden.mutable_data_ptr<scalar_t>());
    check_launch();
  });
}

}  // namespace

void attention_forward(const Tensor& hidden, const AttentionRows& rows, const Tensor& query, double scale,
                       Tensor& out, Tensor& stats, Tensor& weights) {
  const auto guard = on_device_of(hidden);
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool", [&] {
    forward_typed<scalar_t>(hidden, rows, query, scale, out, stats, weights);
  });
}

void attention_backward(const Tensor& grad, const Tensor& grad_weights, const Tensor& hidden,
                        const AttentionRows& rows, const Tensor& query, const Tensor& out,
                        const Tensor& stats, double scale, Tensor& grad_hidden, Tensor& grad_query) {
  const auto guard = on_device_of(hidden);
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool_backward", [&] {
    backward_typed<scalar_t>(grad, grad_weights, hidden, rows, query, out, stats, scale, grad_hidden, grad_query);
  });
}

}  // namespace lmk_ops::cuda
