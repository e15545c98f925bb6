// Row listing (select_rows), value checks on the device, and the CUDA kernels that write whole rows: the mean and
// max backward, landmark gather and its backward. A warp owns a row: it learns what the row needs (how often it is
// selected, which gradient rows list it), then writes it once with 16-byte stores where the row is aligned. And the
// row bookkeeping of first/last-token pooling and packed batches (find_rows, shift_rows).

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <limits>

#include "common/dispatch.h"
#include "common/error.h"
#include "common/packed.h"
#include "cuda/common.cuh"
#include "cuda/rows.h"

namespace lmk_ops::cuda {
namespace {

// Row listing: each thread takes kListItems consecutive entries of a text (16 mask bytes: one 16-byte load where
// aligned), so a block lists a segment of kListSegment entries. A long text is split over several blocks, which
// matters when the batch is small (one text of 32k tokens: 8 blocks instead of one block walking 32k entries).
constexpr int kListItems = 16;
constexpr int64_t kListSegment = int64_t{kThreads} * kListItems;

// Exclusive prefix sum of value over the block (of at most 1024 threads), and the block's total. Every thread must
// call it.
__device__ int block_exclusive_scan(int value, int& total) {
  __shared__ int warp_totals[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int inclusive = value;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    inclusive += lane >= offset ? up : 0;
  }
  if (lane == 31) {
    warp_totals[warp] = inclusive;
  }
  __syncthreads();
  if (warp == 0) {
    int total_up_to = lane < warps ? warp_totals[lane] : 0;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, total_up_to, offset);
      total_up_to += lane >= offset ? up : 0;
    }
    if (lane < warps) {
      warp_totals[lane] = total_up_to;
    }
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_totals[warp - 1] : 0) + inclusive - value;
  total = warp_totals[warps - 1];
  __syncthreads();  // warp_totals is reused by the next call
  return before;
}

// The entries of a bool mask [B, n]: entry i is selected when true, and lists as row i.
struct MaskEntries {
  const bool* mask;
  int64_t n;

  // Bit j: entry first + j is selected (entries past n are not).
  __device__ unsigned flags(int64_t b, int64_t first) const {
    const bool* p = mask + b * n + first;
    unsigned bits = 0;
    if (first + kListItems <= n && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
      const uint4 word = *reinterpret_cast<const uint4*>(p);
      const unsigned parts[4] = {word.x, word.y, word.z, word.w};
#pragma unroll
      for (int j = 0; j < kListItems; ++j) {
        bits |= ((parts[j / 4] >> (8 * (j % 4))) & 0xffu ? 1u : 0u) << j;
      }
    } else {
      for (int j = 0; j < kListItems && first + j < n; ++j) {
        bits |= (p[j] ? 1u : 0u) << j;
      }
    }
    return bits;
  }
  __device__ int64_t value(int64_t, int64_t i) const {
    return i;
  }
};

// The entries of positions [B, n]: entry k is selected unless it is -1, and lists as row positions[b, k].
struct PositionEntries {
  const int64_t* positions;
  int64_t n;

  __device__ unsigned flags(int64_t b, int64_t first) const {
    unsigned bits = 0;
    for (int j = 0; j < kListItems && first + j < n; ++j) {
      bits |= (positions[b * n + first + j] >= 0 ? 1u : 0u) << j;
    }
    return bits;
  }
  __device__ int64_t value(int64_t b, int64_t k) const {
    return positions[b * n + k];
  }
};

// Block (b, s) counts the selected entries of segment s of text b (only when a text spans several segments).
template <typename Entries>
__global__ void __launch_bounds__(kThreads) count_segments(Entries entries, int64_t segments, int32_t* counts) {
  const int64_t b = blockIdx.x / segments, s = blockIdx.x % segments;
  int total;
  block_exclusive_scan(__popc(entries.flags(b, s * kListSegment + int64_t{threadIdx.x} * kListItems)), total);
  if (threadIdx.x == 0) {
    counts[blockIdx.x] = total;
  }
}

// Block (b, s) lists the selected entries of segment s of text b in order, after those of the segments before it
// (counts, from count_segments, when there are several); the last segment writes the text's count.
template <typename Entries>
__global__ void __launch_bounds__(kThreads) list_segments(Entries entries, int64_t segments, const int32_t* counts,
                                                          int64_t* order, int64_t* count) {
  __shared__ int64_t offset;
  const int64_t b = blockIdx.x / segments, s = blockIdx.x % segments;
  if (threadIdx.x == 0) {
    int64_t before = 0;
    for (int64_t t = 0; t < s; ++t) {
      before += counts[b * segments + t];
    }
    offset = before;
  }
  const int64_t first = s * kListSegment + int64_t{threadIdx.x} * kListItems;
  unsigned bits = entries.flags(b, first);
  int total;
  const int before = block_exclusive_scan(__popc(bits), total);  // its barrier also publishes offset
  int64_t* out = order + b * entries.n + offset + before;
  for (int rank = 0; bits != 0; ++rank, bits &= bits - 1) {
    out[rank] = entries.value(b, first + __ffs(bits) - 1);
  }
  if (threadIdx.x == 0 && s == segments - 1) {
    count[b] = offset + total;
  }
}

// A packed batch's texts in the list of its mask's true rows (order, in row order, *listed of them): where text b's
// rows start in it and how many there are, the listed rows below each of its bounds found by binary search.
__global__ void runs_in_list(const int64_t* order, const int64_t* listed, const int64_t* offsets, int64_t batch,
                             int64_t* start, int64_t* count) {
  const int64_t n = *listed;
  const auto below = [&](int64_t row) {  // how many listed rows are less than row
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (order[mid] < row) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo;
  };
  for (int64_t b = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; b < batch; b += int64_t{gridDim.x} * blockDim.x) {
    const int64_t first = below(offsets[b]);
    start[b] = first;
    count[b] = below(offsets[b + 1]) - first;
  }
}

// first[b] = the chunks of the texts before b, first[batch] = all of them, a text's chunks being its rows /
// kChunkRows, rounded up, and at least 1. One block: thread t takes a run of consecutive texts, counts their chunks,
// the runs' counts are scanned over the block, and each thread writes its run's in order. One launch where the
// numbering took four (a fill, a count, ATen's cumsum and a copy: several µs of host time each); a batch of 100k
// texts is some 400 texts a thread. The caller keeps the total within int (plan_chunks: bound).
__global__ void __launch_bounds__(kThreads) number_chunks(SelectedRows rows, int64_t batch, int64_t* first) {
  const int64_t per = ceil_div(batch, kThreads);
  const int64_t begin = std::min(batch, int64_t{threadIdx.x} * per), end = std::min(batch, begin + per);
  const auto chunks_of = [&](int64_t b) { return std::max<int64_t>(1, ceil_div(rows.rows(b), kChunkRows)); };
  int64_t run = 0;
  for (int64_t b = begin; b < end; ++b) {
    run += chunks_of(b);
  }
  int total;
  int64_t before = block_exclusive_scan(static_cast<int>(run), total);
  for (int64_t b = begin; b < end; ++b) {
    first[b] = before;
    before += chunks_of(b);
  }
  if (threadIdx.x == blockDim.x - 1) {  // the last run ends at the batch's end: before is every chunk
    first[batch] = before;
  }
}

template <typename Entries>
void list_entries(const Entries& entries, int64_t batch, Tensor& order, Tensor& count) {
  const int64_t segments = ceil_div(entries.n, kListSegment);
  Tensor counts;
  if (segments > 1) {
    counts = empty_on(order, {batch, segments}, ScalarType::Int);
    count_segments<<<batch * segments, kThreads, 0, stream()>>>(entries, segments, counts.mutable_data_ptr<int32_t>());
    check_launch();
  }
  list_segments<<<batch * segments, kThreads, 0, stream()>>>(
      entries, segments, counts.defined() ? counts.const_data_ptr<int32_t>() : nullptr,
      order.mutable_data_ptr<int64_t>(), count.mutable_data_ptr<int64_t>());
  check_launch();
}

// What check_range allows: values in [lo, hi] and, where limits is not null, below their row's limit (values
// [rows, cols]).
struct ValueRange {
  int64_t lo, hi;
  const int64_t* limits;
  int64_t cols;

  // Whether value, entry i of values, is outside.
  __device__ __forceinline__ bool outside(int64_t value, int64_t i) const {
    return value < lo || value > hi || (limits != nullptr && value >= limits[i / cols]);
  }
};

// The first entry of values (int64 [rows, cols], flattened) outside range, by an integer atomicMin (the result
// does not depend on the order of the threads); `first` starts at numel.
__global__ void find_out_of_range(const int64_t* values, int64_t numel, ValueRange range, unsigned long long* first) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < numel; i += int64_t{gridDim.x} * blockDim.x) {
    if (range.outside(values[i], i)) {
      atomicMin(first, static_cast<unsigned long long>(i));
    }
  }
}

// Reports entry i (< numel) with the op's message, then stops the stream with a device-side assertion (which the
// host sees at its next synchronisation as "device-side assert triggered").
__device__ void report_entry(const int64_t* values, int64_t i, int64_t cols, const RangeMessage& message) {
  if (message.naming == EntryName::kNone) {
    printf("%s, got %lld\n", message.expected, static_cast<long long>(values[i]));
  } else if (message.naming == EntryName::kRow) {
    printf("%s, got %lld in row %lld\n", message.expected, static_cast<long long>(values[i]),
           static_cast<long long>(i));
  } else if (message.naming == EntryName::kLandmarks) {
    printf("%s, got %lld in row %lld (landmarks[%lld, %lld])\n", message.expected,
           static_cast<long long>(values[i]), static_cast<long long>(i / cols), static_cast<long long>(i / cols),
           static_cast<long long>(i % cols));
  } else if (message.flat) {
    printf("%s, got %lld at [%lld]\n", message.expected, static_cast<long long>(values[i]),
           static_cast<long long>(i));
  } else {
    printf("%s, got %lld at [%lld, %lld]\n", message.expected, static_cast<long long>(values[i]),
           static_cast<long long>(i / cols), static_cast<long long>(i % cols));
  }
  __assert_fail("lmk_ops input check (see the message above)", __FILE__, __LINE__, __func__);
}

// Reports the entry find_out_of_range found, if any.
__global__ void report_out_of_range(const int64_t* values, int64_t numel, int64_t cols,
                                    const unsigned long long* first, RangeMessage message) {
  const auto i = static_cast<int64_t>(*first);
  if (i < numel) {
    report_entry(values, i, cols, message);
  }
}

// Loads a thread of check_in_one_block has in flight at once.
constexpr int kCheckLoads = 16;

// Values up to this many are searched and reported by one block, in one launch, where find_out_of_range and
// report_out_of_range take three (with the fill of `first`): an integer attention mask is checked on every call.
// Four rounds of kCheckLoads loads a thread: each round waits once for memory. (It was 65536 values, 256 a thread
// each waited for in turn: some 100 us of one SM for the 8 x 8192 int64 mask of the CUDA report's cases.)
constexpr int64_t kOneBlockCheck = int64_t{4} * kCheckLoads * kThreads;

// find_out_of_range and report_out_of_range in one block: the first entry outside range by a shared atomicMin.
__global__ void __launch_bounds__(kThreads) check_in_one_block(const int64_t* values, int64_t numel, ValueRange range,
                                                               RangeMessage message) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) {
    first = static_cast<unsigned long long>(numel);
  }
  __syncthreads();
  bool found = false;
  for (int64_t base = threadIdx.x; !found && base < numel; base += int64_t{kCheckLoads} * blockDim.x) {
    int64_t value[kCheckLoads];
#pragma unroll
    for (int u = 0; u < kCheckLoads; ++u) {
      const int64_t i = base + int64_t{u} * blockDim.x;
      value[u] = i < numel ? values[i] : 0;
    }
#pragma unroll
    for (int u = 0; u < kCheckLoads; ++u) {
      const int64_t i = base + int64_t{u} * blockDim.x;
      if (!found && i < numel && range.outside(value[u], i)) {
        atomicMin(&first, static_cast<unsigned long long>(i));
        found = true;  // this thread's later entries come after i
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && first < static_cast<unsigned long long>(numel)) {
    report_entry(values, static_cast<int64_t>(first), range.cols, message);
  }
}

// The inverse of positions [B, K]: how many entries list each row (b, l) and the first of them, built once for a
// backward (a warp per row then finds its entries without scanning the K listed positions). Integer atomics: the
// counts and minima do not depend on the order the threads run in. Entries outside [0, L) are skipped (the forward
// checked them; a backward op never reads or writes outside its tensors).
__global__ void index_positions(const int64_t* positions, int64_t batch, int64_t listed, int64_t seq_len,
                                int32_t* times, int32_t* first) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < batch * listed;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t l = positions[i];
    if (l >= 0 && l < seq_len) {
      const int64_t row = (i / listed) * seq_len + l;
      atomicAdd(times + row, 1);
      if (first != nullptr) {
        atomicMin(first + row, static_cast<int32_t>(i % listed));
      }
    }
  }
}

// How often row (b, l) is selected: 1 for every row (both null), the mask's 0/1, or the times positions list it.
struct SelectionView {
  const bool* mask;
  const int32_t* times;

  __device__ int of(int64_t row) const {
    return mask != nullptr ? (mask[row] ? 1 : 0) : (times != nullptr ? times[row] : 1);
  }
};

// The sum of value over the block (every thread must call it; the result is the block's total in every thread).
__device__ int64_t block_sum(int64_t value) {
  __shared__ int64_t warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  if (lane == 0) {
    warp_sums[warp] = value;
  }
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < warps; ++w) {
    total += warp_sums[w];
  }
  __syncthreads();  // warp_sums may be written again by a later call
  return total;
}

// A block per text: its count of selected rows (given, or summed from its mask row or its positions), then its
// gradient row divided by it (grad_over_counts).
template <typename scalar_t, typename acc>
__global__ void __launch_bounds__(kThreads)
    grad_over_counts_kernel(const scalar_t* grad, int64_t stride_b, int64_t stride_d, const int64_t* counts,
                            const bool* mask, const int64_t* offsets, const int64_t* positions, int64_t listed,
                            int64_t seq_len, int64_t dim, acc* scaled) {
  const int64_t b = blockIdx.x;
  int64_t count = seq_len;
  if (counts != nullptr) {
    count = counts[b];
  } else if (mask != nullptr || positions != nullptr) {
    int64_t mine = 0;
    if (mask != nullptr) {  // text b's entries: its row of [B, L], or its run of a packed batch's [T]
      const int64_t begin = offsets != nullptr ? offsets[b] : b * seq_len;
      const int64_t end = offsets != nullptr ? offsets[b + 1] : begin + seq_len;
      for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        mine += mask[i];
      }
    } else {
      for (int64_t i = threadIdx.x; i < listed; i += blockDim.x) {
        mine += positions[b * listed + i] >= 0;
      }
    }
    count = block_sum(mine);
  }
  const acc divisor = static_cast<acc>(count > 1 ? count : int64_t{1});
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    scaled[b * dim + d] = static_cast<acc>(grad[b * stride_b + d * stride_d]) / divisor;
  }
}

// grad_hidden[b, l] = scaled[b] * times(b, l), rounded once; zeros for an unselected row. With offsets (a packed
// batch: batch 1, seq_len T), row t takes its own text's scaled row.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) mean_backward_kernel(const acc_t<scalar_t>* scaled,
                                                                 SelectionView selection, const int64_t* offsets,
                                                                 int64_t texts, int64_t batch, int64_t seq_len,
                                                                 int64_t dim, scalar_t* grad_hidden) {
  using acc = acc_t<scalar_t>;
  const int lane = threadIdx.x % 32;
  const int64_t packs = dim / VEC;
  for_each_warp_row(batch * seq_len, [&](int64_t row) {
    const acc times = static_cast<acc>(selection.of(row));
    const acc* source = scaled + (offsets != nullptr ? text_of_row(offsets, texts, row) : row / seq_len) * dim;
    for (int64_t v = lane; v < packs; v += 32) {
      acc x[VEC];
      if (times == acc(0)) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          x[i] = acc(0);
        }
      } else {
        load_pack<VEC>(source + v * VEC, x);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          x[i] *= times;
        }
      }
      store_features<VEC>(grad_hidden + row * dim, v, x);
    }
  });
}

// grad_hidden[b, l, d] = grad[b, d] where argmax[b, d] == l, else 0. With offsets (a packed batch: batch 1, seq_len
// T), row t is its own text's position t - offsets[b].
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) max_backward_kernel(const scalar_t* grad, const int32_t* argmax,
                                                                const int64_t* offsets, int64_t texts,
                                                                int64_t batch, int64_t seq_len, int64_t dim,
                                                                scalar_t* grad_hidden) {
  const int lane = threadIdx.x % 32;
  const int64_t packs = dim / VEC;
  for_each_warp_row(batch * seq_len, [&](int64_t row) {
    const int64_t b = offsets != nullptr ? text_of_row(offsets, texts, row) : row / seq_len;
    const auto l = static_cast<int32_t>(offsets != nullptr ? row - offsets[b] : row % seq_len);
    for (int64_t v = lane; v < packs; v += 32) {
      int32_t where[VEC];
      load_pack<VEC>(argmax + b * dim + v * VEC, where);
      Pack<scalar_t, VEC> p;
      bool any = false;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        any = any || where[i] == l;
      }
      if (any) {
        scalar_t g[VEC];
        load_pack<VEC>(grad + b * dim + v * VEC, g);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          p.v[i] = where[i] == l ? g[i] : scalar_t(0);
        }
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          p.v[i] = scalar_t(0);
        }
      }
      *reinterpret_cast<Pack<scalar_t, VEC>*>(grad_hidden + row * dim + v * VEC) = p;
    }
  });
}

// out[b, k] = hidden[b, positions[b, k]] (packed: hidden[starts[b] + positions[b, k]]), zeros for -1.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) gather_kernel(const scalar_t* hidden, int64_t sb, int64_t sl, int64_t sd,
                                                          const int64_t* positions, OffsetsView starts,
                                                          int64_t batch, int64_t listed, int64_t dim, scalar_t* out) {
  const int lane = threadIdx.x % 32;
  const int64_t packs = dim / VEC;
  for_each_warp_row(batch * listed, [&](int64_t row) {
    const int64_t l = positions[row], b = row / listed;
    const scalar_t* src = hidden + b * sb + (starts ? starts[b] + l : l) * sl;
    for (int64_t v = lane; v < packs; v += 32) {
      Pack<scalar_t, VEC> p;
      if (l < 0) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          p.v[i] = scalar_t(0);
        }
      } else if constexpr (VEC == 1) {
        p.v[0] = src[v * sd];
      } else {
        p = *reinterpret_cast<const Pack<scalar_t, VEC>*>(src + v * VEC);
      }
      *reinterpret_cast<Pack<scalar_t, VEC>*>(out + row * dim + v * VEC) = p;
    }
  });
}

// grad_hidden[b, l] = the sum over k with positions[b, k] == l of grad[b, k]: a copy when one entry lists the row,
// zeros when none does, else a sum in k order (from the first listing on) in the accumulation type, rounded once.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) scatter_kernel(const scalar_t* grad, const int64_t* positions,
                                                           const int32_t* times, const int32_t* first,
                                                           int64_t batch, int64_t listed, int64_t seq_len,
                                                           int64_t dim, scalar_t* grad_hidden) {
  using acc = acc_t<scalar_t>;
  const int lane = threadIdx.x % 32;
  const int64_t packs = dim / VEC;
  for_each_warp_row(batch * seq_len, [&](int64_t row) {
    const int64_t b = row / seq_len, l = row % seq_len;
    const int count = times[row];
    const int64_t* listing = positions + b * listed;
    for (int64_t v = lane; v < packs; v += 32) {
      acc x[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        x[i] = acc(0);
      }
      int found = 0;
      for (int64_t k = count > 0 ? first[row] : listed; found < count && k < listed; ++k) {
        if (listing[k] == l) {
          acc g[VEC];
          load_features<VEC>(grad + (b * listed + k) * dim, v, 1, g);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            x[i] += g[i];
          }
          ++found;
        }
      }
      store_features<VEC>(grad_hidden + row * dim, v, x);
    }
  });
}

// The inverse of positions (index_positions): times [B, L] and, with first, the first entry listing each row.
std::pair<Tensor, Tensor> invert_positions(const Tensor& positions, int64_t seq_len, bool with_first) {
  const int64_t batch = positions.size(0), listed = positions.size(1);
  LMK_CHECK(listed <= std::numeric_limits<int32_t>::max(), "lmk_ops: at most 2^31 - 1 landmark positions per "
              "text, got ", listed);
  Tensor times = zeros_on(positions, {batch, seq_len}, ScalarType::Int);
  Tensor first = with_first ? full_on(positions, {batch, seq_len}, listed, ScalarType::Int)
                                : Tensor();
  if (batch * listed > 0) {
    index_positions<<<grid_for(batch * listed, kThreads), kThreads, 0, stream()>>>(
        positions.const_data_ptr<int64_t>(), batch, listed, seq_len, times.mutable_data_ptr<int32_t>(),
        with_first ? first.mutable_data_ptr<int32_t>() : nullptr);
    check_launch();
  }
  return {times, first};
}

// A warp per text: 32 of its rows at a time, from its start (its end for last); a valid row's rank among the text's
// is the valid rows before it (the ballot's lower lanes and the earlier rounds). Stops after the width-th valid row
// unless counts are asked for.
__global__ void __launch_bounds__(kThreads)
    find_rows_kernel(const bool* valid, OffsetsView offsets, int64_t batch, int64_t seq_len, bool last,
                     int64_t width, int64_t* positions, int64_t* counts) {
  const int lane = threadIdx.x % 32;
  for_each_warp_row(batch, [&](int64_t b) {
    const int64_t start = offsets ? offsets[b] : b * seq_len;
    const int64_t length = offsets ? offsets[b + 1] - start : seq_len;
    int64_t seen = 0;
    for (int64_t base = 0; base < length && (counts != nullptr || seen < width); base += 32) {
      const int64_t i = base + lane, at = last ? length - 1 - i : i;
      const bool hit = i < length && (valid == nullptr || valid[start + at]);
      const unsigned hits = __ballot_sync(0xffffffffu, hit);
      const int64_t rank = seen + __popc(hits & ((1u << lane) - 1u));
      if (hit && rank < width) {
        positions[b * width + rank] = at;
      }
      seen += __popc(hits);
    }
    for (int64_t k = std::min(seen, width) + lane; k < width; k += 32) {
      positions[b * width + k] = -1;
    }
    if (lane == 0 && counts != nullptr) {
      counts[b] = seen;
    }
  });
}

template <typename index_t>
__global__ void shift_rows_kernel(const index_t* values, const int64_t* starts, int64_t count, int64_t width,
                                  int64_t sign, index_t* out) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = static_cast<index_t>(values[i] >= 0 ? values[i] + sign * starts[i / width] : -1);
  }
}

constexpr unsigned long long kNoFailure = ~0ull;

// A check's text into a kernel argument's buffer (zeroed); one too long for it, which the CPU twin build's suite
// would have refused, ends in "..." rather than being cut without a sign.
void copy_message(const std::string& text, char (&into)[kDeviceMessageBytes]) {
  if (text.size() < kDeviceMessageBytes) {
    text.copy(into, text.size());
    return;
  }
  const std::size_t kept = kDeviceMessageBytes - 4;
  text.copy(into, kept);
  std::copy_n("...", 3, into + kept);
}

// The messages of packed_offsets' checks (OffsetChecks::message), in OffsetCheck's order: a kernel argument, so the
// texts travel by value.
struct OffsetMessages {
  char text[kOffsetChecks][kDeviceMessageBytes];
};

// What packed_offsets checks: the last offset, the longest text; nothing where check is false.
struct OffsetBounds {
  int64_t tokens;
  int64_t longest;
  bool check;
};

// A failed check as one number, check * (B + 1) + b: the lowest is the one reported (OffsetCheck's order, then b).
__device__ __forceinline__ unsigned long long failure_key(OffsetCheck check, int64_t b, int64_t batch) {
  return static_cast<unsigned long long>(static_cast<int64_t>(check) * (batch + 1) + b);
}

// Prints the failure `key` names with its message, then stops the stream with a device-side assertion.
template <typename index_t>
__device__ void report_offsets(const index_t* cu, int64_t stride, int64_t batch, unsigned long long key,
                               const OffsetMessages& messages) {
  const auto check = static_cast<int64_t>(key / static_cast<unsigned long long>(batch + 1));
  const auto b = static_cast<int64_t>(key % static_cast<unsigned long long>(batch + 1));
  const auto at = static_cast<long long>(cu[b * stride]);
  if (check <= static_cast<int64_t>(OffsetCheck::kLast)) {
    printf("%s, got %lld\n", messages.text[check], at);
  } else {
    printf("%s, got %lld at [%lld]\n", messages.text[check], static_cast<long long>(cu[(b + 1) * stride]) - at,
           static_cast<long long>(b));
  }
  __assert_fail("lmk_ops input check (see the message above)", __FILE__, __LINE__, __func__);
}

// packed_offsets: offsets and lengths (each unless null) from cu (grid-stride) and, where bounds.check, the lowest
// failure key, found per block by a shared atomicMin; a lone block (failure null) reports it itself, blocks of a
// larger grid leave it in *failure for report_offsets_failure.
template <typename index_t>
__global__ void __launch_bounds__(kThreads)
    convert_offsets(const index_t* cu, int64_t stride, int64_t batch, OffsetBounds bounds, int64_t* offsets,
                    int64_t* lengths, unsigned long long* failure, OffsetMessages messages) {
  __shared__ unsigned long long lowest;
  if (threadIdx.x == 0) {
    lowest = kNoFailure;
  }
  __syncthreads();
  unsigned long long mine = kNoFailure;
  for (int64_t b = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; b <= batch; b += int64_t{gridDim.x} * blockDim.x) {
    const auto at = static_cast<int64_t>(cu[b * stride]);
    if (offsets != nullptr) {
      offsets[b] = at;
    }
    if (b < batch) {
      const int64_t length = static_cast<int64_t>(cu[(b + 1) * stride]) - at;
      if (lengths != nullptr) {
        lengths[b] = length;
      }
      if (length < 0) {
        mine = min(mine, failure_key(OffsetCheck::kOrder, b, batch));
      } else if (length > bounds.longest) {
        mine = min(mine, failure_key(OffsetCheck::kLongest, b, batch));
      }
    }
    if (b == 0 && at != 0) {
      mine = min(mine, failure_key(OffsetCheck::kFirst, b, batch));
    }
    if (b == batch && at != bounds.tokens) {
      mine = min(mine, failure_key(OffsetCheck::kLast, b, batch));
    }
  }
  if (!bounds.check) {  // the same for every thread
    return;
  }
  if (mine != kNoFailure) {
    atomicMin(&lowest, mine);
  }
  __syncthreads();
  if (threadIdx.x == 0 && lowest != kNoFailure) {
    if (failure == nullptr) {
      report_offsets(cu, stride, batch, lowest, messages);
    } else {
      atomicMin(failure, lowest);
    }
  }
}

template <typename index_t>
__global__ void report_offsets_failure(const index_t* cu, int64_t stride, int64_t batch,
                                       const unsigned long long* failure, OffsetMessages messages) {
  if (*failure != kNoFailure) {
    report_offsets(cu, stride, batch, *failure, messages);
  }
}

}  // namespace

RowList select_rows(const RowSelection& selection, int64_t batch, int64_t seq_len) {
  if (selection.offsets.defined()) {  // a packed batch's texts: runs of the [B, T, D] view's T rows
    if (!selection.mask.defined()) {
      return {Tensor(), selection.lengths, selection.offsets, 0, seq_len, seq_len, seq_len};
    }
    // The true rows of the [T] mask in order, listed as one text's, are the texts' lists one after another (texts
    // are consecutive runs); each text's start and count in it follow from its bounds. Two or three launches, where
    // ATen's cumsum, index_select and diff with a fill and copies took some eight.
    const Tensor& mask = selection.mask;
    Tensor order = empty_on(mask, {1, seq_len}, ScalarType::Long);
    Tensor listed = empty_on(mask, {1}, ScalarType::Long);
    Tensor start = empty_on(mask, {batch}, ScalarType::Long), count = empty_on(mask, {batch}, ScalarType::Long);
    if (seq_len > 0) {
      list_entries(MaskEntries{mask.const_data_ptr<bool>(), seq_len}, 1, order, listed);
    } else {
      listed = zeros_on(mask, {1}, ScalarType::Long);
    }
    if (batch > 0) {
      runs_in_list<<<grid_for(batch, kThreads), kThreads, 0, stream()>>>(
          order.const_data_ptr<int64_t>(), listed.const_data_ptr<int64_t>(),
          selection.offsets.const_data_ptr<int64_t>(), batch, start.mutable_data_ptr<int64_t>(),
          count.mutable_data_ptr<int64_t>());
      check_launch();
    }
    return {order, count, start, 0, seq_len, seq_len, seq_len};
  }
  if (selection.mask.defined()) {
    const Tensor& mask = selection.mask;
    Tensor order = empty_on(mask, {batch, seq_len}, ScalarType::Long);
    Tensor count;
    if (batch > 0 && seq_len > 0) {
      count = empty_on(mask, {batch}, ScalarType::Long);  // written by list_entries
      list_entries(MaskEntries{mask.const_data_ptr<bool>(), seq_len}, batch, order, count);
    } else {
      count = zeros_on(mask, {batch}, ScalarType::Long);
    }
    return {order, count, Tensor(), seq_len, seq_len, seq_len, batch * seq_len};
  }
  if (selection.positions.defined()) {
    const Tensor& positions = selection.positions;
    const int64_t listed = positions.size(1);
    Tensor order = empty_on(positions, {batch, listed}, positions.scalar_type());
    Tensor count;
    if (batch > 0 && listed > 0) {
      count = empty_on(positions, {batch}, positions.scalar_type());  // written by list_entries
      list_entries(PositionEntries{positions.const_data_ptr<int64_t>(), listed}, batch, order, count);
    } else {
      count = zeros_on(positions, {batch}, positions.scalar_type());
    }
    return {order, count, Tensor(), listed, seq_len, listed, batch * listed};
  }
  return {Tensor(), Tensor(), Tensor(), 0, seq_len, seq_len, batch * seq_len};
}

ChunkPlan plan_chunks(const RowList& list, int64_t batch, const Tensor& like) {
  // Chunks per text (rows / kChunkRows, rounded up, at least 1) are at most upper's and sum to at most one per text
  // plus one per kChunkRows of the total.
  const int64_t bound = std::min(batch * std::max<int64_t>(1, ceil_div(list.upper, kChunkRows)),
                                 batch + list.total / kChunkRows);
  LMK_CHECK(bound <= std::numeric_limits<int32_t>::max(), "lmk_ops: pooling may need ", bound, " chunks of ",
            kChunkRows, " rows, more than one launch takes; split the batch");
  Tensor first = empty_on(like, {batch + 1}, ScalarType::Long);
  number_chunks<<<1, kThreads, 0, stream()>>>(list.view(), batch, first.mutable_data_ptr<int64_t>());
  check_launch();
  return {first, batch, bound};
}

void check_range(const Tensor& values, int64_t lo, int64_t hi, const Tensor& row_limits,
                 const std::string& expected, EntryName naming) {
  const auto guard = on_device_of(values);
  const int64_t numel = values.numel();
  if (numel == 0) {
    return;
  }
  RangeMessage message{};
  copy_message(expected, message.expected);
  message.naming = naming;
  message.flat = values.dim() == 1;
  const ValueRange range{lo, hi, row_limits.defined() ? row_limits.const_data_ptr<int64_t>() : nullptr,
                         values.size(-1)};
  if (numel <= kOneBlockCheck) {
    check_in_one_block<<<1, kThreads, 0, stream()>>>(values.const_data_ptr<int64_t>(), numel, range, message);
    check_launch();
    return;
  }
  Tensor first = full_on(values, {1}, numel, ScalarType::Long);
  auto* first_data = reinterpret_cast<unsigned long long*>(first.mutable_data_ptr<int64_t>());
  find_out_of_range<<<grid_for(numel, kThreads), kThreads, 0, stream()>>>(values.const_data_ptr<int64_t>(), numel,
                                                                          range, first_data);
  check_launch();
  report_out_of_range<<<1, 1, 0, stream()>>>(values.const_data_ptr<int64_t>(), numel, values.size(-1), first_data,
                                             message);
  check_launch();
}

void grad_over_counts(const Tensor& grad, const Tensor& counts, const Tensor& mask, const Tensor& offsets,
                      const Tensor& positions, int64_t seq_len, Tensor& scaled) {
  const auto guard = on_device_of(scaled);
  const int64_t batch = grad.size(0), dim = grad.size(1);
  if (batch == 0) {
    return;
  }
  LMK_DISPATCH_FLOATING(grad.scalar_type(), "mean_pool_backward", [&] {
    const auto launch = [&](auto* out) {
      using acc = std::remove_pointer_t<decltype(out)>;
      grad_over_counts_kernel<scalar_t, acc><<<batch, kThreads, 0, stream()>>>(
          grad.const_data_ptr<scalar_t>(), grad.stride(0), grad.stride(1),
          counts.defined() ? counts.const_data_ptr<int64_t>() : nullptr,
          mask.defined() ? mask.const_data_ptr<bool>() : nullptr,
          offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr,
          positions.defined() ? positions.const_data_ptr<int64_t>() : nullptr,
          positions.defined() ? positions.size(1) : 0, seq_len, dim, out);
      check_launch();
    };
    if (scaled.scalar_type() == ScalarType::Double) {
      launch(scaled.mutable_data_ptr<double>());
    } else {
      launch(scaled.mutable_data_ptr<float>());
    }
  });
}

void mean_backward(const Tensor& scaled, const RowSelection& rows, Tensor& grad_hidden) {
  const auto guard = on_device_of(grad_hidden);
  const int64_t batch = grad_hidden.size(0), seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  Tensor times;
  if (rows.positions.defined()) {
    times = invert_positions(rows.positions, seq_len, /*with_first=*/false).first;
  }
  const SelectionView selection{rows.mask.defined() ? rows.mask.const_data_ptr<bool>() : nullptr,
                                times.defined() ? times.const_data_ptr<int32_t>() : nullptr};
  LMK_DISPATCH_FLOATING(grad_hidden.scalar_type(), "mean_backward", [&] {
    int vec = vector_width<scalar_t>(grad_hidden);
    vec = packs_fit(scaled, vec) ? vec : 1;
    with_vector_width<scalar_t>(vec, [&]<int VEC>() {
      mean_backward_kernel<scalar_t, VEC><<<grid_for(batch * seq_len, kWarpsPerBlock), kThreads, 0, stream()>>>(
          scaled.const_data_ptr<acc_t<scalar_t>>(), selection,
          rows.offsets.defined() ? rows.offsets.const_data_ptr<int64_t>() : nullptr, scaled.size(0), batch, seq_len,
          dim, grad_hidden.mutable_data_ptr<scalar_t>());
      check_launch();
    });
  });
}

void max_backward(const Tensor& grad, const Tensor& argmax, const Tensor& offsets, Tensor& grad_hidden) {
  const auto guard = on_device_of(grad_hidden);
  const int64_t batch = grad_hidden.size(0), seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  LMK_DISPATCH_FLOATING(grad_hidden.scalar_type(), "max_pool_backward", [&] {
    int vec = vector_width<scalar_t>(grad_hidden);
    vec = packs_fit(grad, vec) && packs_fit(argmax, vec) ? vec : 1;
    with_vector_width<scalar_t>(vec, [&]<int VEC>() {
      max_backward_kernel<scalar_t, VEC><<<grid_for(batch * seq_len, kWarpsPerBlock), kThreads, 0, stream()>>>(
          grad.const_data_ptr<scalar_t>(), argmax.const_data_ptr<int32_t>(),
          offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr, grad.size(0), batch, seq_len, dim,
          grad_hidden.mutable_data_ptr<scalar_t>());
      check_launch();
    });
  });
}

void gather_forward(const Tensor& hidden, const Tensor& positions, const Tensor& starts, Tensor& out) {
  const auto guard = on_device_of(hidden);
  const int64_t batch = out.size(0), listed = out.size(1), dim = out.size(2);
  if (out.numel() == 0) {
    return;
  }
  const bool packed = starts.defined();  // hidden [T, D] (Kernels::gather_forward)
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "landmark_gather", [&] {
    with_vector_width<scalar_t>(vector_width<scalar_t>(hidden), [&]<int VEC>() {
      gather_kernel<scalar_t, VEC><<<grid_for(batch * listed, kWarpsPerBlock), kThreads, 0, stream()>>>(
          hidden.const_data_ptr<scalar_t>(), packed ? 0 : hidden.stride(0), hidden.stride(packed ? 0 : 1),
          hidden.stride(packed ? 1 : 2), positions.const_data_ptr<int64_t>(),
          OffsetsView(starts), batch, listed, dim, out.mutable_data_ptr<scalar_t>());
      check_launch();
    });
  });
}

void gather_backward(const Tensor& grad, const Tensor& positions, Tensor& grad_hidden) {
  const auto guard = on_device_of(grad_hidden);
  const int64_t batch = grad_hidden.size(0), seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  const auto [times, first] = invert_positions(positions, seq_len, /*with_first=*/true);
  LMK_DISPATCH_FLOATING(grad_hidden.scalar_type(), "landmark_gather_backward", [&] {
    const int vec = std::min(vector_width<scalar_t>(grad_hidden), vector_width<scalar_t>(grad));
    with_vector_width<scalar_t>(vec, [&]<int VEC>() {
      scatter_kernel<scalar_t, VEC><<<grid_for(batch * seq_len, kWarpsPerBlock), kThreads, 0, stream()>>>(
          grad.const_data_ptr<scalar_t>(), positions.const_data_ptr<int64_t>(), times.const_data_ptr<int32_t>(),
          first.const_data_ptr<int32_t>(), batch, positions.size(1), seq_len, dim,
          grad_hidden.mutable_data_ptr<scalar_t>());
      check_launch();
    });
  });
}

void find_rows(const Tensor& valid, const Tensor& offsets, int64_t batch, int64_t seq_len, bool last,
               Tensor& positions, Tensor& counts) {
  const auto guard = on_device_of(positions);
  if (batch == 0) {
    return;
  }
  find_rows_kernel<<<grid_for(batch, kWarpsPerBlock), kThreads, 0, stream()>>>(
      valid.defined() ? valid.const_data_ptr<bool>() : nullptr, OffsetsView(offsets), batch, seq_len, last,
      positions.size(1), positions.mutable_data_ptr<int64_t>(),
      counts.defined() ? counts.mutable_data_ptr<int64_t>() : nullptr);
  check_launch();
}

void shift_rows(const Tensor& values, const Tensor& starts, int64_t sign, Tensor& out) {
  const auto guard = on_device_of(values);
  const int64_t count = values.numel();
  if (count == 0) {
    return;
  }
  LMK_DISPATCH_INDEX(values.scalar_type(), "shift_rows", [&] {
    shift_rows_kernel<index_t><<<grid_for(count, kThreads), kThreads, 0, stream()>>>(
        values.const_data_ptr<index_t>(), starts.const_data_ptr<int64_t>(), count, values.size(1), sign,
        out.mutable_data_ptr<index_t>());
    check_launch();
  });
}

void packed_offsets(const Tensor& cu_seqlens, const OffsetChecks* checks, Tensor& offsets, Tensor& lengths) {
  const auto guard = on_device_of(cu_seqlens);
  const int64_t batch = cu_seqlens.size(0) - 1;
  OffsetBounds bounds{0, std::numeric_limits<int64_t>::max(), checks != nullptr};
  OffsetMessages messages{};
  if (checks != nullptr) {
    bounds.tokens = checks->tokens;
    bounds.longest = checks->longest;
    for (int check = 0; check < kOffsetChecks; ++check) {
      copy_message(checks->message(static_cast<OffsetCheck>(check)), messages.text[check]);
    }
  }
  // One block (one launch) for the usual batch, up to 4 offsets a thread (each a load the thread waits for); a
  // larger one is spread over a grid, whose blocks leave their lowest failure in `failure` (starting at kNoFailure:
  // all bits set) for a second, one-thread launch to report.
  const bool one_block = batch + 1 <= 4 * kThreads;
  Tensor failure;
  if (!one_block && checks != nullptr) {
    failure = full_on(cu_seqlens, {1}, -1, ScalarType::Long);
  }
  auto* failure_data =
      failure.defined() ? reinterpret_cast<unsigned long long*>(failure.mutable_data_ptr<int64_t>()) : nullptr;
  const int64_t stride = cu_seqlens.stride(0);
  LMK_DISPATCH_INDEX(cu_seqlens.scalar_type(), "packed_offsets", [&] {
    const index_t* cu = cu_seqlens.const_data_ptr<index_t>();
    convert_offsets<index_t><<<one_block ? 1 : grid_for(batch + 1, kThreads), kThreads, 0, stream()>>>(
        cu, stride, batch, bounds, offsets.defined() ? offsets.mutable_data_ptr<int64_t>() : nullptr,
        lengths.defined() ? lengths.mutable_data_ptr<int64_t>() : nullptr, failure_data, messages);
    check_launch();
    if (failure_data != nullptr) {
      report_offsets_failure<index_t><<<1, 1, 0, stream()>>>(cu, stride, batch, failure_data, messages);
      check_launch();
    }
  });
}

}  // namespace lmk_ops::cuda
