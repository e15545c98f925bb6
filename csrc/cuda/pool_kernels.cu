// CUDA forward kernels of mean and max pooling over a selection of rows (mean_pool, max_pool, landmark_mean).
//
// One block reduces one chunk of kChunkRows selected rows of one text, for one tile of features (common.cuh says
// why). Its threads are kFeatureLanes feature lanes (a 16-byte pack of features each where rows are aligned: a
// warp reads 512 contiguous bytes of a row) by kThreads / kFeatureLanes row lanes: row lane y takes the chunk's
// rows y, y + Y, ... in order (their indices staged in shared memory first: stage_chunk_rows), kRowsInFlight loads
// at a time; the Y lanes are then combined in order through shared memory. Tiles one warp wide give a medium batch
// enough blocks to fill the GPU (32 x 512 x 768 in bfloat16: 384 blocks), and the order of every addition still
// depends only on D and on the text's own rows. A text with one chunk is finished by that block; longer texts leave
// per-chunk partial results that a second kernel combines in chunk order.

#include <algorithm>
#include <limits>
#include <type_traits>

#include "common/dispatch.h"
#include "common/error.h"
#include "cuda/common.cuh"
#include "cuda/pool_kernels.h"

namespace lmk_ops::cuda {
namespace {

constexpr int kFeatureLanes = 32;

// What a chunk reduces into: the accumulation type for max (whose results are input values), and for mean float64
// beside float32 rows (so a mean is within about one float32 ulp at any L: a float32 running sum loses digits as
// it grows) and bfloat16 rows (float32's range: a float32 sum of values near its maximum overflows though their
// mean is finite), and float32 beside float16 rows (whose 16-row runs per row lane it holds exactly or nearly, and
// far from overflow). The chunks' partial sums are combined in float64 in chunk order, compensated (ChunkSum).
template <bool kMax, typename scalar_t>
using value_t = std::conditional_t<kMax || std::is_same_v<scalar_t, c10::Half> || std::is_same_v<scalar_t, double>,
                                   acc_t<scalar_t>, double>;
template <bool kMax, typename scalar_t>
using partial_t = std::conditional_t<kMax, acc_t<scalar_t>, double>;

// Max with torch.max's rules: a greater value wins, a NaN wins over a number (the first NaN is kept), and of equal
// values the earlier row is kept. where < 0 marks "nothing kept yet".
template <typename acc>
__device__ __forceinline__ bool takes_over(acc x, int64_t at, acc best, int64_t where) {
  if (where < 0) {
    return true;
  }
  const bool x_nan = x != x, best_nan = best != best;
  if (x_nan || best_nan) {
    return x_nan && (!best_nan || at < where);
  }
  return x > best || (x == best && at < where);
}

template <bool kMax, typename scalar_t, typename out_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    pool_chunks(const scalar_t* hidden, int64_t sb, int64_t sl, int64_t sd, SelectedRows rows, int64_t dim,
                ChunkView chunks, int64_t tiles, out_t* out, int32_t* argmax, partial_t<kMax, scalar_t>* partial,
                int32_t* partial_where) {
  using acc = acc_t<scalar_t>;
  using value_acc = value_t<kMax, scalar_t>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int64_t tile = blockIdx.x % tiles, part = blockIdx.x / tiles;
  if (part >= chunks.count()) {
    return;  // past the texts' chunks (the grid is sized by a bound)
  }
  const int64_t b = chunks.text_of(part), chunk = part - chunks.first[b];
  const int64_t n = rows.rows(b), begin = chunk * kChunkRows;
  const int64_t end = std::min(begin + kChunkRows, n);
  __shared__ int64_t chunk_row[kChunkRows];
  stage_chunk_rows(rows, b, begin, end, chunk_row);
  const int lanes = blockDim.x, row_lanes = blockDim.y;
  const int64_t packs = dim / VEC, v = tile * lanes + threadIdx.x;
  const bool active = v < packs;

  value_acc value[VEC];
  int64_t where[VEC];
  const scalar_t* text = hidden + b * sb;
  // One pass over this lane's rows of the chunk; a mean's values are added multiplied by shrink.
  const auto reduce_chunk = [&](value_acc shrink) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      value[i] = value_acc(0);
      where[i] = -1;
    }
    for (int64_t first = begin + threadIdx.y; first < end; first += int64_t{row_lanes} * kRowsInFlight) {
      acc x[kRowsInFlight][VEC];
      int64_t at[kRowsInFlight];
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r) {
        const int64_t j = first + int64_t{r} * row_lanes;
        at[r] = j < end ? chunk_row[j - begin] : -1;
        if (active && at[r] >= 0) {
          load_features<VEC>(text + at[r] * sl, v, sd, x[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r) {
        if (active && at[r] >= 0) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            if constexpr (kMax) {
              if (takes_over(x[r][i], at[r], value[i], where[i])) {
                value[i] = x[r][i];
                where[i] = at[r];
              }
            } else {
              value[i] += x[r][i] * shrink;
            }
          }
        }
      }
    }
  };
  value_acc shrink = value_acc(1);
  reduce_chunk(shrink);
  if constexpr (!kMax && std::is_same_v<value_acc, double> && std::is_same_v<scalar_t, double>) {
    // Float64 rows near float64's maximum overflow a sum whose mean is finite (other rows are summed in a wider
    // type than theirs): such a chunk is summed again scaled by kOverflowShrink (common.cuh), and the factor comes
    // back after the division by the row count.
    static_assert(kChunkRows <= 128, "a shrunk chunk's sums must stay finite");
    bool overflowed = false;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      overflowed |= near_overflow(value[i]);
    }
    if (__syncthreads_or(overflowed)) {  // the whole block takes the same branch
      shrink = kOverflowShrink<double>;
      reduce_chunk(shrink);
    }
  }

  // Row lanes 1.. hand their results to row lane 0, which takes them in order.
  value_acc* shared_value = reinterpret_cast<value_acc*>(shared_bytes);
  int64_t* shared_where = reinterpret_cast<int64_t*>(shared_value + row_lanes * lanes * VEC);
  const int64_t slot = (int64_t{threadIdx.y} * lanes + threadIdx.x) * VEC;
  if (row_lanes > 1) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      shared_value[slot + i] = value[i];
      if constexpr (kMax) {
        shared_where[slot + i] = where[i];
      }
    }
    __syncthreads();
    if (threadIdx.y != 0) {
      return;
    }
    for (int y = 1; y < row_lanes; ++y) {
      const int64_t other = (int64_t{y} * lanes + threadIdx.x) * VEC;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if constexpr (kMax) {
          if (shared_where[other + i] >= 0 &&
              takes_over(shared_value[other + i], shared_where[other + i], value[i], where[i])) {
            value[i] = shared_value[other + i];
            where[i] = shared_where[other + i];
          }
        } else {
          value[i] += shared_value[other + i];
        }
      }
    }
  }
  if (!active) {
    return;
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const int64_t d = v * VEC + i;
    if (n <= kChunkRows) {  // the only chunk: finish here
      if constexpr (kMax) {
        out[b * dim + d] = n == 0 ? out_t(0) : static_cast<out_t>(value[i]);
        argmax[b * dim + d] = n == 0 ? -1 : static_cast<int32_t>(where[i]);
      } else {
        out[b * dim + d] = n == 0 ? out_t(0) : static_cast<out_t>(value[i] / static_cast<value_acc>(n) / shrink);
      }
    } else if constexpr (kMax) {
      partial[part * dim + d] = value[i];
      partial_where[part * dim + d] = static_cast<int32_t>(where[i]);
    } else {  // the chunk's share of the text's mean (see combine_chunks)
      partial[part * dim + d] =
          static_cast<double>(value[i]) / static_cast<double>(n) / static_cast<double>(shrink);
    }
  }
}

// Finishes the texts with more than one chunk: their partial results, warp by warp in chunk order and then in warp
// order (common.cuh: kCombineLanes). A mean's partials are the chunks' shares of it (chunk sum / the text's row
// count): each is at most the largest value, and so is every partial sum of them, so float64 rows near float64's
// maximum give a finite mean wherever it is finite. A maximum is the same whatever the order (takes_over breaks
// ties by row).
template <bool kMax, typename scalar_t, typename out_t>
__global__ void __launch_bounds__(kThreads)
    combine_chunks(const partial_t<kMax, scalar_t>* partial, const int32_t* partial_where, SelectedRows rows,
                   int64_t batch, int64_t dim, ChunkView chunks, out_t* out, int32_t* argmax) {
  using acc = partial_t<kMax, scalar_t>;
  struct Best {
    acc value;
    int64_t where;  // -1: none (a warp without chunks)
  };
  __shared__ Best best_of[kWarpsPerBlock][kCombineLanes];
  __shared__ double sum_of[kWarpsPerBlock][kCombineLanes];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for_each_combine_item(batch, dim, [&](int64_t b, int64_t d) {
    const int64_t n = rows.rows(b);
    if (n <= kChunkRows) {
      return;  // the text's only chunk finished it
    }
    const bool active = d < dim;
    const int64_t first = chunks.first[b], used = ceil_div(n, kChunkRows);
    const acc* p = partial + first * dim + d;
    if constexpr (kMax) {
      Best best{acc(0), -1};
#pragma unroll 4  // loads in flight
      for (int64_t c = warp; active && c < used; c += kWarpsPerBlock) {
        const int32_t at = partial_where[(first + c) * dim + d];
        if (takes_over(p[c * dim], at, best.value, best.where)) {
          best = {p[c * dim], at};
        }
      }
      share_lanes(best, best_of);
      if (warp == 0 && active) {
        for (int w = 1; w < kWarpsPerBlock; ++w) {
          const Best other = best_of[w][lane];
          if (other.where >= 0 && takes_over(other.value, other.where, best.value, best.where)) {
            best = other;
          }
        }
        out[b * dim + d] = static_cast<out_t>(best.value);
        argmax[b * dim + d] = static_cast<int32_t>(best.where);
      }
    } else {
      ChunkSum mine;
#pragma unroll 4  // loads in flight
      for (int64_t c = warp; active && c < used; c += kWarpsPerBlock) {
        mine.add(p[c * dim]);
      }
      share_lanes(mine.value(), sum_of);
      if (warp == 0 && active) {
        ChunkSum total;
        for (int w = 0; w < kWarpsPerBlock; ++w) {
          total.add(sum_of[w][lane]);
        }
        out[b * dim + d] = static_cast<out_t>(total.value());
      }
    }
  });
}

template <bool kMax, typename scalar_t, typename out_t>
void pool_forward(const Tensor& hidden, const RowSelection& selection, Tensor& out, Tensor* argmax) {
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const RowList list = select_rows(selection, batch, seq_len);
  const ChunkPlan chunks = plan_chunks(list, batch, hidden);
  Tensor partial, partial_where;
  if (chunks.several()) {
    partial = empty_on(hidden, {chunks.bound, dim}, kMax ? acc_dtype(hidden.scalar_type()) : ScalarType::Double);
    if (kMax) {
      partial_where = empty_on(hidden, {chunks.bound, dim}, ScalarType::Int);
    }
  }
  auto* argmax_data = kMax ? argmax->mutable_data_ptr<int32_t>() : nullptr;
  auto* partial_data = partial.defined() ? partial.mutable_data_ptr<partial_t<kMax, scalar_t>>() : nullptr;
  auto* partial_where_data = partial_where.defined() ? partial_where.mutable_data_ptr<int32_t>() : nullptr;
  with_vector_width<scalar_t>(vector_width<scalar_t>(hidden), [&]<int VEC>() {
    const int64_t packs = dim / VEC;
    const int lanes = kFeatureLanes, row_lanes = kThreads / kFeatureLanes;
    const int64_t tiles = ceil_div(packs, lanes);
    const int64_t blocks = chunks.bound * tiles;
    LMK_CHECK(
        blocks <= std::numeric_limits<int32_t>::max(), "lmk_ops: pooling needs ", blocks,
        " CUDA blocks, more than one launch takes; split the batch");
    const size_t shared =
        row_lanes > 1 ? size_t{kThreads} * VEC * (sizeof(value_t<kMax, scalar_t>) + (kMax ? sizeof(int64_t) : 0)) : 0;
    pool_chunks<kMax, scalar_t, out_t, VEC><<<blocks, dim3(lanes, row_lanes), shared, stream()>>>(
        hidden.const_data_ptr<scalar_t>(), hidden.stride(0), hidden.stride(1), hidden.stride(2), list.view(), dim,
        chunks.view(), tiles, out.mutable_data_ptr<out_t>(), argmax_data, partial_data, partial_where_data);
    check_launch();
  });
  if (chunks.several()) {
    combine_chunks<kMax, scalar_t, out_t><<<grid_for(combine_items(batch, dim), 1), kThreads, 0, stream()>>>(
        partial_data, partial_where_data, list.view(), batch, dim, chunks.view(), out.mutable_data_ptr<out_t>(),
        argmax_data);
    check_launch();
  }
}

}  // namespace

void mean_forward(const Tensor& hidden, const RowSelection& rows, Tensor& out) {
  const auto guard = on_device_of(hidden);
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "mean_pool", [&] {
    if (out.scalar_type() == hidden.scalar_type()) {
      pool_forward<false, scalar_t, scalar_t>(hidden, rows, out, nullptr);
    } else {
      pool_forward<false, scalar_t, acc_t<scalar_t>>(hidden, rows, out, nullptr);
    }
  });
}

void max_forward(const Tensor& hidden, const RowSelection& rows, Tensor& out, Tensor& argmax) {
  const auto guard = on_device_of(hidden);
  LMK_DISPATCH_FLOATING(
      hidden.scalar_type(), "max_pool", [&] { pool_forward<true, scalar_t, scalar_t>(hidden, rows, out, &argmax); });
}

}  // namespace lmk_ops::cuda
