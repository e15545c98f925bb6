#pragma once
// Building blocks of the CUDA kernels (pool_kernels.cu, rows.cu, attention_kernels.cu).
//
// How a reduction over rows is split, for every forward op: a text's selected rows are listed in order (select_rows
// below: the valid rows of a mask, the listed landmark positions, or simply 0..L-1) and cut into chunks of
// kChunkRows consecutive selected rows. One block reduces one chunk of one text (and one tile of features or
// heads); when a text has more than one chunk, a second kernel combines the chunks' partial results in chunk
// order. Short batches of long texts still fill the GPU (8 x 8192 rows make 512 chunks), nothing is added with
// atomics, and the order of every addition depends only on the text's own selected rows and on D: the same input
// gives the same bits, and a text gives the same bits alone or in a batch, padded on either side.
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>  // its CUDA part (the current stream) needs USE_CUDA: CMakeLists
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/error.h"
#include "common/tensor_ops.h"
#include "cuda/kernel_types.h"

namespace lmk_ops::cuda {

// Makes t's device current for the guard's lifetime.
inline torch::stable::accelerator::DeviceGuard on_device_of(const Tensor& t) {
  return torch::stable::accelerator::DeviceGuard(t.get_device_index());
}

// Raises the error of the last kernel launch, if any (as C10_CUDA_KERNEL_LAUNCH_CHECK does).
inline void check_launch() {
  const cudaError_t error = cudaGetLastError();
  LMK_CHECK(error == cudaSuccess, "lmk_ops: a CUDA kernel failed to launch: ", cudaGetErrorString(error));
}

// Threads of every block. Kernels that take whole blocks of it say so with __launch_bounds__(kThreads), so that
// ptxas keeps them within the registers a block of this size may use (a launch never fails for resources).
constexpr int kThreads = 256;
constexpr int64_t kChunkRows = 128;
// Rows each thread loads before using any of them: independent 16-byte loads in flight hide memory latency.
constexpr int kRowsInFlight = 4;

// A chunk's second pass where its sums near overflow (values near the accumulation type's maximum, or inf or NaN):
// a lane's sum past max / 256, or not finite (near_overflow), sends the whole block to sum the chunk again with its
// values scaled by kOverflowShrink, a power of two, so exactly but for subnormal values. kChunkRows rows of such
// values, and the merge of a block's row lanes' sums, then stay finite; the kernels scale the factor back out.
template <typename acc>
constexpr acc kOverflowShrink = acc(1) / acc(256);

template <typename acc>
__device__ __forceinline__ bool near_overflow(acc v) {
  constexpr acc kBound = std::numeric_limits<acc>::max() / acc(256);
  return !(v >= -kBound && v <= kBound);  // a NaN too
}

// Additions and a product rounded as written: nvcc would otherwise fuse a product into the addition after it, and a
// compensated sum must know each rounding it makes.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// sum += value + lost, compensated (Kahan): carry holds minus what the roundings lost (and lost, what value's own
// rounding lost), so that sum - carry is the exact sum but for the roundings of carry itself.
template <typename acc>
__device__ __forceinline__ void add_compensated(acc& sum, acc& carry, acc value, acc lost = acc(0)) {
  const acc term = add_rn(value, -carry);
  const acc next = add_rn(sum, term);
  carry = add_rn(add_rn(add_rn(next, -sum), -term), -lost);
  sum = next;
}

// A float64 sum of a text's chunk results, taken in chunk order: compensated, so that it does not drift with the
// number of chunks (float64 rows: a plain float64 sum of 10^6 rows' 7,813 chunk shares drifts by hundreds of ulp),
// with a plain sum beside it for inputs that are inf or NaN, which the compensation would turn into NaN.
struct ChunkSum {
  double sum = 0, carry = 0, plain = 0;
  __device__ __forceinline__ void add(double value) {
    add_compensated(sum, carry, value);
    plain += value;
  }
  __device__ __forceinline__ double value() const {
    return isfinite(plain) ? sum - carry : plain;
  }
};

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// VEC elements of scalar_t moved as one aligned load or store (16 bytes for the widest VEC).
template <typename scalar_t, int VEC>
struct alignas(sizeof(scalar_t) * VEC) Pack {
  scalar_t v[VEC];
};

// Features [v * VEC, (v + 1) * VEC) of a row, widened to acc. VEC > 1 only where the row is contiguous and aligned
// (vector_width); the scalar path (VEC = 1) follows the feature stride.
template <int VEC, typename scalar_t, typename acc>
__device__ __forceinline__ void load_features(const scalar_t* row, int64_t v, int64_t stride, acc (&x)[VEC]) {
  if constexpr (VEC == 1) {
    x[0] = static_cast<acc>(row[v * stride]);
  } else {
    const Pack<scalar_t, VEC> p = *reinterpret_cast<const Pack<scalar_t, VEC>*>(row + v * VEC);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      x[i] = static_cast<acc>(p.v[i]);
    }
  }
}

// VEC values of T from p, widened to acc: one or several 16-byte loads (p aligned to min(16, VEC * sizeof(T))
// bytes when VEC > 1; packs_fit says when a tensor's rows allow it). Serves the [B, D] side inputs of the row
// writers (gradients, queries, argmax), whose element type may be wider than the rows written.
template <int VEC, typename T, typename acc>
__device__ __forceinline__ void load_pack(const T* p, acc (&x)[VEC]) {
  constexpr int kPer = VEC * sizeof(T) <= 16 ? VEC : 16 / static_cast<int>(sizeof(T));
#pragma unroll
  for (int c = 0; c < VEC / kPer; ++c) {
    const Pack<T, kPer> piece = *reinterpret_cast<const Pack<T, kPer>*>(p + c * kPer);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      x[c * kPer + i] = static_cast<acc>(piece.v[i]);
    }
  }
}

// Rounds VEC values to scalar_t and stores them at row + v * VEC (row contiguous and aligned when VEC > 1).
template <int VEC, typename scalar_t, typename acc>
__device__ __forceinline__ void store_features(scalar_t* row, int64_t v, const acc (&x)[VEC]) {
  Pack<scalar_t, VEC> p;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    p.v[i] = static_cast<scalar_t>(x[i]);
  }
  *reinterpret_cast<Pack<scalar_t, VEC>*>(row + v * VEC) = p;
}

// 16 / sizeof(scalar_t) (one 16-byte pack) when every row of t starts 16-byte aligned and holds whole packs of
// contiguous features, and every group of unit features (an attention head) is whole packs; else 1. Two widths,
// not four: each kernel is instantiated twice per dtype.
template <typename scalar_t>
int vector_width(const Tensor& t, int64_t unit) {
  constexpr int kWidest = 16 / sizeof(scalar_t);
  const int64_t rank = t.dim();
  bool ok = t.stride(rank - 1) == 1 && t.size(rank - 1) % kWidest == 0 && unit % kWidest == 0 &&
            reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int64_t i = 0; i + 1 < rank; ++i) {
    ok = ok && (t.size(i) == 1 || t.stride(i) % kWidest == 0);
  }
  return ok ? kWidest : 1;
}

// vector_width for kernels that read whole rows, with no groups of features inside a row. (They passed a unit of
// 1, which no pack divides: every mean, max, gather and row-writing kernel took the scalar path; on an H100 a
// float32 mean of 64x512x1024 took 119 us, the read floor 52.)
template <typename scalar_t>
int vector_width(const Tensor& t) {
  return vector_width<scalar_t>(t, t.size(t.dim() - 1));
}

// Whether t (contiguous) can be read as packs of vec elements by load_pack: 16-byte aligned, whole packs per row.
inline bool packs_fit(const Tensor& t, int vec) {
  return vec == 1 || (t.is_contiguous() && t.size(-1) % vec == 0 &&
                      reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0);
}

// Runs body.template operator()<VEC>() with VEC the compile-time constant for the runtime width (1 or the widest).
template <typename scalar_t, typename Body>
void with_vector_width(int vec, const Body& body) {
  constexpr int kWidest = 16 / sizeof(scalar_t);
  if (vec == kWidest) {
    body.template operator()<kWidest>();
  } else {
    LMK_CHECK(vec == 1, "lmk_ops: unexpected vector width ", vec);
    body.template operator()<1>();
  }
}

// A text's selected rows in order, as select_rows gives them: listed, in a [B, width] table or (start given) the
// texts' lists one after another from start[b]; or runs, text b's rows start[b] .. start[b] + count[b] - 1 (a
// packed batch's texts); or every row, 0 .. seq_len - 1. (An explicit flag for "listed": an empty list has no data
// pointer either.)
struct SelectedRows {
  const int64_t* order;  // the listed rows
  const int64_t* count;  // [B]: rows per text; seq_len each when null
  const int64_t* start;  // [B]: where each text's list (listed) or run (not) starts; null: at b * width, or 0
  int64_t width;
  int64_t seq_len;
  bool listed;

  __device__ __forceinline__ int64_t rows(int64_t b) const {
    return count != nullptr ? count[b] : seq_len;
  }
  __device__ __forceinline__ int64_t row(int64_t b, int64_t j) const {
    return listed ? order[(start != nullptr ? start[b] : b * width) + j] : (start != nullptr ? start[b] : 0) + j;
  }
};

// The rows of one chunk of text b, its selected rows [begin, end) (at most kChunkRows), read by the whole block
// into row_of (shared memory) before any lane reads a row: row_of[j - begin] = rows.row(b, j). A listed selection
// (a mask's valid rows, landmark positions) is an index table in global memory, and a lane that read each row's index
// just before the row waited on memory twice for every kRowsInFlight rows (Nsight Compute on an H200: the float32
// mean's chunk kernel at 45% of the DRAM bandwidth, hidden.sum() at 77%); staged, a block waits on its indices once.
// Every thread of the block must call it.
__device__ __forceinline__ void stage_chunk_rows(const SelectedRows& rows, int64_t b, int64_t begin, int64_t end,
                                                 int64_t (&row_of)[kChunkRows]) {
  const int64_t threads = int64_t{blockDim.x} * blockDim.y;
  for (int64_t j = int64_t{threadIdx.y} * blockDim.x + threadIdx.x; begin + j < end; j += threads) {
    row_of[j] = rows.row(b, begin + j);
  }
  __syncthreads();
}

// The selected rows of each text, on the device, as SelectedRows says (undefined tensors for null pointers): for a
// mask its true rows, for positions the entries that are not -1 (nothing past count[b] is written), for a packed
// batch's runs every row or, with a [T] mask, the true rows listed one text after another. `upper` is the most rows
// a text can have and `total` the most rows all texts together can have, known without a synchronisation: they size
// the grids (ChunkPlan), whose blocks past the texts' rows return at once.
struct RowList {
  Tensor order;
  Tensor count;
  Tensor start;
  int64_t width;
  int64_t seq_len;
  int64_t upper;
  int64_t total;

  SelectedRows view() const {
    return {order.defined() ? order.const_data_ptr<int64_t>() : nullptr,
            count.defined() ? count.const_data_ptr<int64_t>() : nullptr,
            start.defined() ? start.const_data_ptr<int64_t>() : nullptr, width, seq_len, order.defined()};
  }
};

RowList select_rows(const RowSelection& selection, int64_t batch, int64_t seq_len);

// The chunks of a call's texts, numbered text by text: text b's are first[b] .. first[b + 1] - 1, at least one (a
// text with no row still writes its zeros). One block (per tile) reduces one chunk, and chunk g's partial results
// are at g: room only for the chunks there are. (Laid out [B, the longest text's chunks], 4000 one-token texts beside
// one of 65536 tokens made 2 million blocks and 4 GB of partial results at D 256.)
struct ChunkView {
  const int64_t* first;  // [B + 1]
  int64_t batch;

  __device__ __forceinline__ int64_t count() const {
    return first[batch];
  }
  // The text of chunk g < count(): the last b with first[b] <= g.
  __device__ __forceinline__ int64_t text_of(int64_t g) const {
    int64_t lo = 0, hi = batch - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (first[mid] <= g) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }
};

// A call's chunks (ChunkView) and `bound`, at least their number, from the list's upper and total without a
// synchronisation: grids and partial results are sized by it.
struct ChunkPlan {
  Tensor first;
  int64_t batch;
  int64_t bound;

  ChunkView view() const {
    return {first.const_data_ptr<int64_t>(), batch};
  }
  // Whether a text may have several chunks (and partial results be needed).
  bool several() const {
    return bound > batch;
  }
};

// (like: a tensor on the device.)
ChunkPlan plan_chunks(const RowList& list, int64_t batch, const Tensor& like);

// The sum of x over a segment of `seg` adjacent lanes of a warp (seg a power of two up to 32), in every lane of the
// segment. The butterfly gives every lane the same bits.
template <typename acc>
__device__ __forceinline__ acc segment_sum(acc x, int seg) {
  for (int offset = seg / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

template <typename acc>
__device__ __forceinline__ acc device_exp(acc x) {
  if constexpr (sizeof(acc) == 8) {
    return ::exp(x);
  } else {
    return ::expf(x);
  }
}

constexpr int kWarpsPerBlock = kThreads / 32;

// Calls body(row) for each row of [0, rows) this thread's warp owns: a warp per row, striding over the grid. All
// lanes of a warp get the same rows, so a body may vote or shuffle across the warp.
template <typename Body>
__device__ __forceinline__ void for_each_warp_row(int64_t rows, const Body& body) {
  for (int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += int64_t{gridDim.x} * kWarpsPerBlock) {
    body(row);
  }
}

// The text of a packed batch's row: the b with offsets[b] <= row < offsets[b + 1] (row in [0, offsets[texts])).
__device__ __forceinline__ int64_t text_of_row(const int64_t* offsets, int64_t texts, int64_t row) {
  int64_t lo = 0, hi = texts;  // offsets[lo] <= row < offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The kernels that combine a text's chunk results (pool_kernels.cu, attention_kernels.cu) take a block per (text,
// tile of 32 features): warp w takes the text's chunks w, w + kWarpsPerBlock, ... in order, a lane per feature,
// and the warps' results are then taken in warp order (share_lanes), so that the order of every operation depends
// only on the text's chunk count. (A thread per (text, feature) walking all of its text's chunks gave one text of 1024
// features 4 blocks: on an H100 the combine of one bfloat16 text of 32768 x 1024 outlasted its chunks' kernel.)
constexpr int kCombineLanes = 32;

// A combining kernel's work: batch * combine_items(dim) items (text, tile of kCombineLanes features), a block each
// in turn (a grid-stride loop: a few waves of blocks whatever the batch, so that a large batch of short texts, whose
// items end at once, does not pay a block launch each).
inline int64_t combine_items(int64_t batch, int64_t dim) {
  return batch * ceil_div(dim, kCombineLanes);
}

// Calls body(b, d) for each of the block's items: text b, and d this thread's feature (d >= dim past the last
// tile: an idle lane, which must still take part in share_lanes). body's return ends the item, for the whole block.
template <typename Body>
__device__ __forceinline__ void for_each_combine_item(int64_t batch, int64_t dim, const Body& body) {
  const int64_t tiles = ceil_div(dim, kCombineLanes);
  for (int64_t item = blockIdx.x; item < batch * tiles; item += gridDim.x) {
    body(item / tiles, (item % tiles) * kCombineLanes + threadIdx.x % 32);
  }
}

// Shares every warp's per-lane value: afterwards slots[w][lane] holds warp w's value of that lane, for any thread to
// read until the next call. Every thread of the block must call it (it synchronises the block, before and after).
template <typename T>
__device__ __forceinline__ void share_lanes(T value, T (&slots)[kWarpsPerBlock][kCombineLanes]) {
  __syncthreads();  // an earlier use of slots is over
  slots[threadIdx.x / 32][threadIdx.x % 32] = value;
  __syncthreads();
}

// The current device's multiprocessor count, asked once per device.
inline int multiprocessors() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices] = {};
  int device = 0;
  LMK_CHECK(cudaGetDevice(&device) == cudaSuccess, "lmk_ops: no current CUDA device");
  int count = device < kDevices ? known[device].load(std::memory_order_relaxed) : 0;
  if (count == 0) {
    LMK_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess,
              "lmk_ops: cannot read CUDA device ", device, "'s multiprocessor count");
    if (device < kDevices) {
      known[device].store(count, std::memory_order_relaxed);
    }
  }
  return count;
}

// Blocks for `items` units of work at per_block a block (warps or threads), at most a few waves: grid-stride
// kernels loop over the rest.
inline int64_t grid_for(int64_t items, int64_t per_block) {
  const int64_t resident = int64_t{multiprocessors()} * 8;
  return std::max<int64_t>(1, std::min(ceil_div(items, per_block), resident * 4));
}

// The current device's stream, as torch's CUDA ops use it (through the C shim: its index and handle are stable).
inline cudaStream_t stream() {
  void* handle = nullptr;
  LMK_CHECK(aoti_torch_get_current_cuda_stream(torch::stable::accelerator::getCurrentDeviceIndex(), &handle) ==
                AOTI_TORCH_SUCCESS,
            "lmk_ops: torch gave no current CUDA stream");
  return static_cast<cudaStream_t>(handle);
}

}  // namespace lmk_ops::cuda
