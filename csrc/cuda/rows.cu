// Row listing (select_rows) and the CUDA kernels that write whole rows: the mean and max backward, landmark gather
// and its backward. A warp owns a row: it finds what the row needs (how often it is selected, which gradient rows
// list it), then writes it once with 16-byte stores where the row is aligned.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "common/dispatch.h"
#include "cuda/common.cuh"
#include "cuda/rows.h"

namespace lmk_ops::cuda {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kWarpsPerBlock = kThreads / 32;

// Exclusive prefix sum of flag over the block, and the block's total. Every thread must call it.
__device__ int block_exclusive_scan(int flag, int& total) {
  __shared__ int warp_totals[kScanThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int inclusive = flag;
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
  const int before = (warp > 0 ? warp_totals[warp - 1] : 0) + inclusive - flag;
  total = warp_totals[warps - 1];
  __syncthreads();  // warp_totals is reused by the next call
  return before;
}

// One block per text. keep(i) says whether entry i of the text is selected and value(i) what to list for it.
// Lists the selected entries in order, then (with partition) the others in order; writes the count.
template <bool kPartition, typename Keep, typename Value>
__device__ void list_rows(int64_t n, int64_t* order, int64_t* count, const Keep& keep, const Value& value) {
  int64_t selected = 0;
  if (kPartition) {
    for (int64_t base = 0; base < n; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      int tile_total;
      block_exclusive_scan(i < n && keep(i), tile_total);
      selected += tile_total;
    }
  }
  int64_t kept_before = 0;
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const bool in_range = i < n, kept = in_range && keep(i);
    int tile_total;
    const int before = block_exclusive_scan(kept, tile_total);
    if (kept) {
      order[kept_before + before] = value(i);
    } else if (kPartition && in_range) {
      order[selected + (i - kept_before - before)] = value(i);
    }
    kept_before += tile_total;
  }
  if (threadIdx.x == 0) {
    *count = kept_before;
  }
}

__global__ void list_mask_rows(const bool* mask, int64_t seq_len, int64_t* order, int64_t* count) {
  const int64_t b = blockIdx.x;
  const bool* row = mask + b * seq_len;
  list_rows<true>(
      seq_len, order + b * seq_len, count + b, [&](int64_t l) { return row[l]; }, [](int64_t l) { return l; });
}

__global__ void list_positions(const int64_t* positions, int64_t listed, int64_t* order, int64_t* count) {
  const int64_t b = blockIdx.x;
  const int64_t* row = positions + b * listed;
  list_rows<false>(
      listed, order + b * listed, count + b, [&](int64_t k) { return row[k] >= 0; },
      [&](int64_t k) { return row[k]; });
}

// Calls body(row) for each row of [0, rows) this thread's warp owns: a warp per row, striding over the grid. All
// lanes of a warp get the same rows, so a body may vote across the warp (find_listing).
template <typename Body>
__device__ __forceinline__ void for_each_warp_row(int64_t rows, const Body& body) {
  for (int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += int64_t{gridDim.x} * kWarpsPerBlock) {
    body(row);
  }
}

// Which entries of positions[0, listed) equal l: how many, and the first. Called by a whole warp.
struct Listing {
  int64_t first;
  int count;
};

__device__ Listing find_listing(const int64_t* positions, int64_t listed, int64_t l) {
  const int lane = threadIdx.x % 32;
  Listing found{-1, 0};
  for (int64_t base = 0; base < listed; base += 32) {
    const unsigned hits = __ballot_sync(0xffffffffu, base + lane < listed && positions[base + lane] == l);
    if (hits != 0 && found.count == 0) {
      found.first = base + __ffs(hits) - 1;
    }
    found.count += __popc(hits);
  }
  return found;
}

// How often row l of a text is selected: 1 for every row, the mask's 0/1, or the times positions list it.
struct SelectionView {
  enum Kind { kEveryRow, kMask, kPositions } kind;
  const bool* mask;
  const int64_t* positions;  // may be null when listed == 0
  int64_t listed;

  __device__ int times(int64_t b, int64_t seq_len, int64_t l) const {
    switch (kind) {
      case kMask:
        return mask[b * seq_len + l] ? 1 : 0;
      case kPositions:
        return find_listing(positions + b * listed, listed, l).count;
      default:
        return 1;
    }
  }
};

// grad_hidden[b, l] = scaled[b] * times(b, l), rounded once; zeros for an unselected row.
template <typename scalar_t, int VEC>
__global__ void mean_backward_kernel(const acc_t<scalar_t>* scaled, SelectionView selection, int64_t batch,
                                     int64_t seq_len, int64_t dim, scalar_t* grad_hidden) {
  using acc = acc_t<scalar_t>;
  const int lane = threadIdx.x % 32;
  const int64_t packs = dim / VEC;
  for_each_warp_row(batch * seq_len, [&](int64_t row) {
    const int64_t b = row / seq_len;
    const acc times = static_cast<acc>(selection.times(b, seq_len, row % seq_len));
    for (int64_t v = lane; v < packs; v += 32) {
      acc x[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        x[i] = times == acc(0) ? acc(0) : scaled[b * dim + v * VEC + i] * times;
      }
      store_features<VEC>(grad_hidden + row * dim, v, x);
    }
  });
}

// grad_hidden[b, l, d] = grad[b, d] where argmax[b, d] == l, else 0.
template <typename scalar_t, int VEC>
__global__ void max_backward_kernel(const scalar_t* grad, const int32_t* argmax, int64_t batch, int64_t seq_len,
                                    int64_t dim, scalar_t* grad_hidden) {
  const int lane = threadIdx.x % 32;
  const int64_t packs = dim / VEC;
  for_each_warp_row(batch * seq_len, [&](int64_t row) {
    const int64_t b = row / seq_len;
    const auto l = static_cast<int32_t>(row % seq_len);
    for (int64_t v = lane; v < packs; v += 32) {
      Pack<scalar_t, VEC> p;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int64_t d = v * VEC + i;
        p.v[i] = argmax[b * dim + d] == l ? grad[b * dim + d] : scalar_t(0);
      }
      *reinterpret_cast<Pack<scalar_t, VEC>*>(grad_hidden + row * dim + v * VEC) = p;
    }
  });
}

// out[b, k] = hidden[b, positions[b, k]], zeros for -1.
template <typename scalar_t, int VEC>
__global__ void gather_kernel(const scalar_t* hidden, int64_t sb, int64_t sl, int64_t sd, const int64_t* positions,
                              int64_t batch, int64_t listed, int64_t dim, scalar_t* out) {
  const int lane = threadIdx.x % 32;
  const int64_t packs = dim / VEC;
  for_each_warp_row(batch * listed, [&](int64_t row) {
    const int64_t l = positions[row];
    const scalar_t* src = hidden + (row / listed) * sb + l * sl;
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
// zeros when none does, else a sum in k order in the accumulation type, rounded once.
template <typename scalar_t, int VEC>
__global__ void scatter_kernel(const scalar_t* grad, const int64_t* positions, int64_t batch, int64_t listed,
                               int64_t seq_len, int64_t dim, scalar_t* grad_hidden) {
  using acc = acc_t<scalar_t>;
  const int lane = threadIdx.x % 32;
  const int64_t packs = dim / VEC;
  for_each_warp_row(batch * seq_len, [&](int64_t row) {
    const int64_t b = row / seq_len, l = row % seq_len;
    const int64_t* listing = positions + b * listed;
    const Listing found = find_listing(listing, listed, l);
    for (int64_t v = lane; v < packs; v += 32) {
      acc x[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        x[i] = acc(0);
      }
      if (found.count > 0) {
        for (int64_t k = found.first; k < listed; ++k) {
          if (listing[k] == l) {
            acc g[VEC];
            load_features<VEC>(grad + (b * listed + k) * dim, v, 1, g);
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              x[i] += g[i];
            }
          }
          if (found.count == 1) {
            break;  // the only listing was the first
          }
        }
      }
      store_features<VEC>(grad_hidden + row * dim, v, x);
    }
  });
}

// Enough warps to cover the rows, at most a few waves of blocks (the kernels loop over the rest).
int64_t row_blocks(int64_t rows) {
  const int64_t resident = int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount} * 8;
  return std::max<int64_t>(1, std::min(ceil_div(rows, kWarpsPerBlock), resident * 4));
}

}  // namespace

RowList select_rows(const RowSelection& selection, int64_t batch, int64_t seq_len) {
  if (selection.mask.defined()) {
    const at::Tensor& mask = selection.mask;
    at::Tensor order = at::empty({batch, seq_len}, mask.options().dtype(at::kLong));
    at::Tensor count = at::empty({batch}, mask.options().dtype(at::kLong));
    if (batch > 0 && seq_len > 0) {
      list_mask_rows<<<batch, kScanThreads, 0, stream()>>>(
          mask.const_data_ptr<bool>(), seq_len, order.data_ptr<int64_t>(), count.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      count.zero_();
    }
    return {order, count, seq_len, seq_len};
  }
  if (selection.positions.defined()) {
    const at::Tensor& positions = selection.positions;
    const int64_t listed = positions.size(1);
    at::Tensor order = at::empty({batch, listed}, positions.options());
    at::Tensor count = at::zeros({batch}, positions.options());
    if (batch > 0 && listed > 0) {
      list_positions<<<batch, kScanThreads, 0, stream()>>>(
          positions.const_data_ptr<int64_t>(), listed, order.data_ptr<int64_t>(), count.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return {order, count, listed, seq_len};
  }
  return {at::Tensor(), at::Tensor(), seq_len, seq_len};
}

void mean_backward(const at::Tensor& scaled, const RowSelection& rows, at::Tensor& grad_hidden) {
  const c10::cuda::CUDAGuard guard(grad_hidden.device());
  const int64_t batch = grad_hidden.size(0), seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  const SelectionView selection{
      rows.mask.defined() ? SelectionView::kMask
                          : (rows.positions.defined() ? SelectionView::kPositions : SelectionView::kEveryRow),
      rows.mask.defined() ? rows.mask.const_data_ptr<bool>() : nullptr,
      rows.positions.defined() ? rows.positions.const_data_ptr<int64_t>() : nullptr,
      rows.positions.defined() ? rows.positions.size(1) : 0};
  LMK_DISPATCH_FLOATING(grad_hidden.scalar_type(), "mean_backward", [&] {
    with_vector_width<scalar_t>(vector_width<scalar_t>(grad_hidden, 1), [&]<int VEC>() {
      mean_backward_kernel<scalar_t, VEC><<<row_blocks(batch * seq_len), kThreads, 0, stream()>>>(
          scaled.const_data_ptr<acc_t<scalar_t>>(), selection, batch, seq_len, dim, grad_hidden.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void max_backward(const at::Tensor& grad, const at::Tensor& argmax, at::Tensor& grad_hidden) {
  const c10::cuda::CUDAGuard guard(grad_hidden.device());
  const int64_t batch = grad_hidden.size(0), seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  LMK_DISPATCH_FLOATING(grad_hidden.scalar_type(), "max_pool_backward", [&] {
    with_vector_width<scalar_t>(vector_width<scalar_t>(grad_hidden, 1), [&]<int VEC>() {
      max_backward_kernel<scalar_t, VEC><<<row_blocks(batch * seq_len), kThreads, 0, stream()>>>(
          grad.const_data_ptr<scalar_t>(), argmax.const_data_ptr<int32_t>(), batch, seq_len, dim,
          grad_hidden.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void gather_forward(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t batch = out.size(0), listed = out.size(1), dim = out.size(2);
  if (out.numel() == 0) {
    return;
  }
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "landmark_gather", [&] {
    with_vector_width<scalar_t>(vector_width<scalar_t>(hidden, 1), [&]<int VEC>() {
      gather_kernel<scalar_t, VEC><<<row_blocks(batch * listed), kThreads, 0, stream()>>>(
          hidden.const_data_ptr<scalar_t>(), hidden.stride(0), hidden.stride(1), hidden.stride(2),
          positions.const_data_ptr<int64_t>(), batch, listed, dim, out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void gather_backward(const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden) {
  const c10::cuda::CUDAGuard guard(grad_hidden.device());
  const int64_t batch = grad_hidden.size(0), seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  LMK_DISPATCH_FLOATING(grad_hidden.scalar_type(), "landmark_gather_backward", [&] {
    const int vec = std::min(vector_width<scalar_t>(grad_hidden, 1), vector_width<scalar_t>(grad, 1));
    with_vector_width<scalar_t>(vec, [&]<int VEC>() {
      scatter_kernel<scalar_t, VEC><<<row_blocks(batch * seq_len), kThreads, 0, stream()>>>(
          grad.const_data_ptr<scalar_t>(), positions.const_data_ptr<int64_t>(), batch, positions.size(1), seq_len,
          dim, grad_hidden.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace lmk_ops::cuda
