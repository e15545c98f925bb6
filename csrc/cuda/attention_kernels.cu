// CUDA kernels of attention pooling, forward and backward (the maths is the CPU kernels'; see
// cpu/attention_kernels.cpp).
//
// Layout: a block takes one chunk of kChunkRows valid rows of one text (common.cuh) for a tile of whole heads.
// Each head is a segment of `seg` lanes holding one pack of VEC features each: a power of two up to 32 lanes
// (several heads per warp) or whole warps (a wide head), summed by a butterfly within the warp and then, for a
// wide head, across its warps in order through shared memory. Every lane of a head so holds the same bits of each
// score, and the backward, which uses the same layout and the same head_sums, recomputes the forward's scores bit
// for bit. Y row lanes take rows y, y + Y, ... of the chunk, kRowsInFlight at a time, with an online softmax each;
// they are merged in order, and the chunks of a long text are merged in order by a second kernel.
//
// Backward: a first kernel reads every valid row once and keeps p_l and e_l = <g, x_l - m> + gw_l per (text, head,
// row), and per chunk the sums of p e, p e (x - m) and p (x - m); a second one sums those per text in order (S =
// sum p e, the query gradient); a third writes every row of grad_hidden, p g + scale p (e - S) q or zeros, without
// reading hidden again.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "common/dispatch.h"
#include "cuda/attention_kernels.h"
#include "cuda/common.cuh"

namespace lmk_ops::cuda {
namespace {

constexpr int kMaxSums = 2 * kRowsInFlight;  // values one head_sums call reduces (scores and, backward, errors)

struct HeadLayout {
  int vec;          // features per lane
  int seg;          // lanes per head
  int lanes;        // x threads of a block
  int row_lanes;    // y threads of a block
  int64_t per_block;  // heads per block
  int64_t tiles;    // blocks across the heads of a text
};

template <typename scalar_t>
HeadLayout head_layout(const at::Tensor& hidden, int64_t heads, int64_t head_dim) {
  HeadLayout layout{};
  layout.vec = vector_width<scalar_t>(hidden, head_dim);
  const int64_t head_lanes = head_dim / layout.vec;
  TORCH_CHECK(
      head_lanes <= 1024, "lmk_ops.attention_pool: on CUDA a head is at most ", 1024 * layout.vec,
      " features wide for this input (", 16 / sizeof(scalar_t) * 1024,
      " when rows are contiguous and 16-byte aligned), got ", head_dim);
  if (head_lanes <= 32) {
    layout.seg = 1;
    while (layout.seg < head_lanes) {
      layout.seg *= 2;
    }
    layout.lanes = static_cast<int>(std::min<int64_t>(kThreads, ceil_div(heads * layout.seg, 32) * 32));
    layout.per_block = layout.lanes / layout.seg;
  } else {
    layout.seg = static_cast<int>(ceil_div(head_lanes, 32) * 32);
    layout.lanes = layout.seg;
    layout.per_block = 1;
  }
  layout.row_lanes = std::max(1, kThreads / layout.lanes);
  layout.tiles = ceil_div(heads, layout.per_block);
  return layout;
}

// The lane's place: its head h and its pack of that head's features; inactive lanes pad segments and tiles.
struct HeadLane {
  int64_t head;
  int64_t pack;  // pack index within the row (features pack * VEC ...)
  bool active;
  bool leader;  // lane 0 of its head: writes the head's scalars
};

template <int VEC>
__device__ HeadLane head_lane(const HeadLayout& layout, int64_t tile, int64_t heads, int64_t head_dim) {
  const int64_t head = tile * layout.per_block + threadIdx.x / layout.seg;
  const int lane = threadIdx.x % layout.seg;
  const bool active = head < heads && lane < head_dim / VEC;
  return {head, head * (head_dim / VEC) + lane, active, active && lane == 0};
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

// Scales total and weighted (VEC values) from exp(. - from) to exp(. - to), to >= from; a lane with nothing yet
// (from = -inf) contributes nothing.
template <int VEC, typename acc>
__device__ __forceinline__ void rescale(acc from, acc to, acc& total, acc (&weighted)[VEC]) {
  if (from == to) {
    return;
  }
  const acc factor = from == -std::numeric_limits<acc>::infinity() ? acc(0) : device_exp(from - to);
  total *= factor;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    weighted[i] *= factor;
  }
}

template <typename scalar_t, int VEC>
__global__ void attention_chunks(const scalar_t* hidden, int64_t sb, int64_t sl, int64_t sd, SelectedRows rows,
                                 const acc_t<scalar_t>* query, acc_t<scalar_t> scale, int64_t heads,
                                 int64_t head_dim, HeadLayout layout, int64_t chunks, scalar_t* out, double* stats,
                                 acc_t<scalar_t>* scores, acc_t<scalar_t>* part_max, acc_t<scalar_t>* part_sum,
                                 acc_t<scalar_t>* part_out) {
  using acc = acc_t<scalar_t>;
  constexpr acc kNegInf = -std::numeric_limits<acc>::infinity();
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int64_t tile = blockIdx.x % layout.tiles, chunk = (blockIdx.x / layout.tiles) % chunks;
  const int64_t b = blockIdx.x / (layout.tiles * chunks), n = rows.rows(b), begin = chunk * kChunkRows;
  if (begin >= n && chunk > 0) {
    return;
  }
  const int64_t end = std::min(begin + kChunkRows, n), dim = heads * head_dim;
  const HeadLane me = head_lane<VEC>(layout, tile, heads, head_dim);
  acc q[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    q[i] = me.active ? query[me.pack * VEC + i] : acc(0);
  }
  acc best = kNegInf, total = 0, weighted[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    weighted[i] = acc(0);
  }
  const scalar_t* text = hidden + b * sb;
  const int64_t step = int64_t{layout.row_lanes} * kRowsInFlight;
  for (int64_t base = begin; base < end; base += step) {
    acc x[kRowsInFlight][VEC], s[kRowsInFlight];
    int64_t at[kRowsInFlight];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t j = base + int64_t{r} * layout.row_lanes + threadIdx.y;
      at[r] = j < end ? rows.row(b, j) : -1;
      s[r] = acc(0);
      if (me.active && at[r] >= 0) {
        load_features<VEC>(text + at[r] * sl, me.pack, sd, x[r]);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          s[r] += x[r][i] * q[i];
        }
      }
    }
    head_sums(s, layout.seg);
    acc top = best;
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      s[r] *= scale;
      if (at[r] >= 0) {
        top = s[r] > top ? s[r] : top;
        if (scores != nullptr && me.leader) {
          scores[(b * heads + me.head) * rows.seq_len + at[r]] = s[r];
        }
      }
    }
    rescale(best, top, total, weighted);
    best = top;
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      if (me.active && at[r] >= 0) {
        const acc p = device_exp(s[r] - best);
        total += p;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          weighted[i] += p * x[r][i];
        }
      }
    }
  }

  // Row lanes 1.. hand (max, total, weighted) to row lane 0, which merges them in order.
  if (layout.row_lanes > 1) {
    acc* shared = reinterpret_cast<acc*>(shared_bytes);
    constexpr int kSlot = VEC + 2;
    const int64_t mine = (int64_t{threadIdx.y} * layout.lanes + threadIdx.x) * kSlot;
    shared[mine] = best;
    shared[mine + 1] = total;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      shared[mine + 2 + i] = weighted[i];
    }
    __syncthreads();
    if (threadIdx.y != 0) {
      return;
    }
    for (int y = 1; y < layout.row_lanes; ++y) {
      const acc* other = shared + (int64_t{y} * layout.lanes + threadIdx.x) * kSlot;
      const acc top = other[0] > best ? other[0] : best;
      rescale(best, top, total, weighted);
      acc other_total = other[1], other_weighted[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        other_weighted[i] = other[2 + i];
      }
      rescale(other[0], top, other_total, other_weighted);
      best = top;
      total += other_total;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        weighted[i] += other_weighted[i];
      }
    }
  }
  if (!me.active) {
    return;
  }
  if (n <= kChunkRows) {  // the only chunk: finish here
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      out[b * dim + me.pack * VEC + i] = n == 0 ? scalar_t(0) : static_cast<scalar_t>(weighted[i] / total);
    }
    if (me.leader && n > 0) {
      stats[(b * heads + me.head) * 2] = best;
      stats[(b * heads + me.head) * 2 + 1] = total;
    }
    return;
  }
  const int64_t part = b * chunks + chunk;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    part_out[part * dim + me.pack * VEC + i] = weighted[i];
  }
  if (me.leader) {
    part_max[part * heads + me.head] = best;
    part_sum[part * heads + me.head] = total;
  }
}

// Finishes the texts with more than one chunk: the chunks' (max, total, weighted sum), merged in chunk order.
template <typename scalar_t>
__global__ void attention_combine(const acc_t<scalar_t>* part_max, const acc_t<scalar_t>* part_sum,
                                  const acc_t<scalar_t>* part_out, SelectedRows rows, int64_t batch, int64_t heads,
                                  int64_t head_dim, int64_t chunks, scalar_t* out, double* stats) {
  using acc = acc_t<scalar_t>;
  const int64_t dim = heads * head_dim, i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= batch * dim) {
    return;
  }
  const int64_t b = i / dim, d = i % dim, h = d / head_dim, n = rows.rows(b);
  if (n <= kChunkRows) {
    return;
  }
  const int64_t used = ceil_div(n, kChunkRows);
  acc best = -std::numeric_limits<acc>::infinity();
  for (int64_t c = 0; c < used; ++c) {
    const acc m = part_max[(b * chunks + c) * heads + h];
    best = m > best ? m : best;
  }
  acc total = 0, weighted = 0;
  for (int64_t c = 0; c < used; ++c) {
    const int64_t part = b * chunks + c;
    const acc m = part_max[part * heads + h];
    const acc factor = m == best ? acc(1) : (m == -std::numeric_limits<acc>::infinity() ? acc(0) : device_exp(m - best));
    total += part_sum[part * heads + h] * factor;
    weighted += part_out[part * dim + d] * factor;
  }
  out[i] = static_cast<scalar_t>(weighted / total);
  if (d % head_dim == 0) {
    stats[(b * heads + h) * 2] = best;
    stats[(b * heads + h) * 2 + 1] = total;
  }
}

// weights[b, h, l] = exp(score - max) / sum for the valid rows (scores were left there by attention_chunks).
template <typename acc>
__global__ void scores_to_weights(acc* weights, const double* stats, SelectedRows rows, int64_t batch,
                                  int64_t heads, int64_t upper) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= batch * heads * upper) {
    return;
  }
  const int64_t bh = i / upper, j = i % upper, b = bh / heads;
  if (j >= rows.rows(b)) {
    return;
  }
  acc& w = weights[bh * rows.seq_len + rows.row(b, j)];
  w = device_exp(w - static_cast<acc>(stats[bh * 2])) / static_cast<acc>(stats[bh * 2 + 1]);
}

template <typename scalar_t, int VEC>
__global__ void attention_backward_chunks(const scalar_t* hidden, int64_t sb, int64_t sl, int64_t sd,
                                          SelectedRows rows, const acc_t<scalar_t>* query, acc_t<scalar_t> scale,
                                          int64_t heads, int64_t head_dim, HeadLayout layout, int64_t chunks,
                                          const acc_t<scalar_t>* grad, const acc_t<scalar_t>* grad_weights,
                                          const acc_t<scalar_t>* out, const double* stats, acc_t<scalar_t>* prob,
                                          acc_t<scalar_t>* err, acc_t<scalar_t>* part_pe, acc_t<scalar_t>* part_pex,
                                          acc_t<scalar_t>* part_px) {
  using acc = acc_t<scalar_t>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int64_t tile = blockIdx.x % layout.tiles, chunk = (blockIdx.x / layout.tiles) % chunks;
  const int64_t b = blockIdx.x / (layout.tiles * chunks), n = rows.rows(b), begin = chunk * kChunkRows;
  if (begin >= n) {
    return;  // nothing of this text here (a text with no valid row has no chunk)
  }
  const int64_t end = std::min(begin + kChunkRows, n), dim = heads * head_dim;
  const HeadLane me = head_lane<VEC>(layout, tile, heads, head_dim);
  const int64_t bh = b * heads + std::min(me.head, heads - 1);
  const acc best = static_cast<acc>(stats[bh * 2]), total = static_cast<acc>(stats[bh * 2 + 1]);
  acc q[VEC], g[VEC], m[VEC], pex[VEC], px[VEC], pe = 0;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const int64_t f = me.pack * VEC + i;
    q[i] = me.active ? query[f] : acc(0);
    g[i] = me.active ? grad[b * dim + f] : acc(0);
    m[i] = me.active ? out[b * dim + f] : acc(0);
    pex[i] = px[i] = acc(0);
  }
  const scalar_t* text = hidden + b * sb;
  const int64_t step = int64_t{layout.row_lanes} * kRowsInFlight;
  for (int64_t base = begin; base < end; base += step) {
    acc x[kRowsInFlight][VEC], sums[2 * kRowsInFlight];  // scores, then <g, x - m>
    int64_t at[kRowsInFlight];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t j = base + int64_t{r} * layout.row_lanes + threadIdx.y;
      at[r] = j < end ? rows.row(b, j) : -1;
      sums[r] = sums[kRowsInFlight + r] = acc(0);
      if (me.active && at[r] >= 0) {
        load_features<VEC>(text + at[r] * sl, me.pack, sd, x[r]);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          sums[r] += x[r][i] * q[i];  // as in attention_chunks, so the score has the forward's bits
          x[r][i] -= m[i];
          sums[kRowsInFlight + r] += g[i] * x[r][i];
        }
      }
    }
    head_sums(sums, layout.seg);
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      if (me.active && at[r] >= 0) {
        const acc p = device_exp(sums[r] * scale - best) / total;
        const int64_t row = bh * rows.seq_len + at[r];
        const acc e = sums[kRowsInFlight + r] + (grad_weights != nullptr ? grad_weights[row] : acc(0));
        if (me.leader) {
          prob[row] = p;
          err[row] = e;
        }
        pe += p * e;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          pex[i] += p * e * x[r][i];
          px[i] += p * x[r][i];
        }
      }
    }
  }

  if (layout.row_lanes > 1) {
    acc* shared = reinterpret_cast<acc*>(shared_bytes);
    constexpr int kSlot = 2 * VEC + 1;
    const int64_t mine = (int64_t{threadIdx.y} * layout.lanes + threadIdx.x) * kSlot;
    shared[mine] = pe;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      shared[mine + 1 + i] = pex[i];
      shared[mine + 1 + VEC + i] = px[i];
    }
    __syncthreads();
    if (threadIdx.y != 0) {
      return;
    }
    for (int y = 1; y < layout.row_lanes; ++y) {
      const acc* other = shared + (int64_t{y} * layout.lanes + threadIdx.x) * kSlot;
      pe += other[0];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        pex[i] += other[1 + i];
        px[i] += other[1 + VEC + i];
      }
    }
  }
  if (!me.active) {
    return;
  }
  const int64_t part = b * chunks + chunk;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    part_pex[part * dim + me.pack * VEC + i] = pex[i];
    part_px[part * dim + me.pack * VEC + i] = px[i];
  }
  if (me.leader) {
    part_pe[part * heads + me.head] = pe;
  }
}

// Per (head, feature): S = sum of p e per text (kept for the rows), and the query gradient, scale * (sum p e (x - m)
// - S sum p (x - m)) per text, summed over the texts in order.
template <typename acc>
__global__ void attention_query_grad(const acc* part_pe, const acc* part_pex, const acc* part_px, SelectedRows rows,
                                     int64_t batch, int64_t heads, int64_t head_dim, int64_t chunks, acc scale,
                                     acc* text_sums, acc* grad_query) {
  const int64_t dim = heads * head_dim, d = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (d >= dim) {
    return;
  }
  const int64_t h = d / head_dim;
  acc gq = 0;
  for (int64_t b = 0; b < batch; ++b) {
    acc s = 0, pex = 0, px = 0;
    for (int64_t c = 0; c < ceil_div(rows.rows(b), kChunkRows); ++c) {
      const int64_t part = b * chunks + c;
      s += part_pe[part * heads + h];
      pex += part_pex[part * dim + d];
      px += part_px[part * dim + d];
    }
    gq += scale * (pex - s * px);
    if (d % head_dim == 0) {
      text_sums[b * heads + h] = s;
    }
  }
  grad_query[d] = gq;
}

// Every row of grad_hidden: p g + scale p (e - S) q for a valid row, zeros elsewhere.
template <typename scalar_t, int VEC>
__global__ void attention_grad_rows(const bool* valid, const acc_t<scalar_t>* prob, const acc_t<scalar_t>* err,
                                    const acc_t<scalar_t>* text_sums, const acc_t<scalar_t>* grad,
                                    const acc_t<scalar_t>* query, acc_t<scalar_t> scale, int64_t batch,
                                    int64_t seq_len, int64_t heads, int64_t head_dim, scalar_t* grad_hidden) {
  using acc = acc_t<scalar_t>;
  const int64_t dim = heads * head_dim, packs = dim / VEC;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < batch * seq_len * packs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / packs, v = i % packs, b = row / seq_len, l = row % seq_len;
    acc x[VEC];
    const bool is_valid = valid == nullptr || valid[row];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int64_t d = v * VEC + k, bh = b * heads + d / head_dim;
      if (is_valid) {
        const acc p = prob[bh * seq_len + l];
        x[k] = p * grad[b * dim + d] + scale * p * (err[bh * seq_len + l] - text_sums[bh]) * query[d];
      } else {
        x[k] = acc(0);
      }
    }
    store_features<VEC>(grad_hidden + row * dim, v, x);
  }
}

int64_t checked_blocks(int64_t blocks) {
  TORCH_CHECK(
      blocks <= std::numeric_limits<int32_t>::max(), "lmk_ops.attention_pool: needs ", blocks,
      " CUDA blocks, more than one launch takes; split the batch");
  return blocks;
}

// What the forward and the backward share: sizes, the valid rows listed, the chunking and the head layout (the
// backward must use the forward's layout to recompute its scores bit for bit).
struct Plan {
  int64_t batch, seq_len, dim, heads, head_dim;
  RowList list;
  int64_t chunks;
  HeadLayout layout;
  at::TensorOptions wide;  // the accumulation type, on hidden's device
};

template <typename scalar_t>
Plan make_plan(const at::Tensor& hidden, const at::Tensor& valid, const at::Tensor& query) {
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), heads = query.size(0), head_dim = query.size(1);
  RowList list = select_valid(valid, batch, seq_len);
  const int64_t chunks = std::max<int64_t>(1, ceil_div(list.upper, kChunkRows));
  return {batch, seq_len, hidden.size(2), heads, head_dim, std::move(list), chunks,
          head_layout<scalar_t>(hidden, heads, head_dim),
          hidden.options().dtype(at::toOpMathType(hidden.scalar_type()))};
}

template <typename scalar_t>
void forward_typed(const at::Tensor& hidden, const at::Tensor& valid, const at::Tensor& query, double scale,
                   at::Tensor& out, at::Tensor& stats, at::Tensor& weights) {
  using acc = acc_t<scalar_t>;
  const Plan plan = make_plan<scalar_t>(hidden, valid, query);
  const auto& [batch, seq_len, dim, heads, head_dim, list, chunks, layout, wide] = plan;
  at::Tensor part_max, part_sum, part_out;
  if (chunks > 1) {
    part_max = at::empty({batch, chunks, heads}, wide);
    part_sum = at::empty({batch, chunks, heads}, wide);
    part_out = at::empty({batch, chunks, dim}, wide);
  }
  const auto data = [](at::Tensor& t) { return t.defined() ? t.data_ptr<acc>() : nullptr; };
  with_vector_width<scalar_t>(layout.vec, [&]<int VEC>() {
    const size_t shared = layout.row_lanes > 1 ? size_t{kThreads} * (VEC + 2) * sizeof(acc) : 0;
    attention_chunks<scalar_t, VEC>
        <<<checked_blocks(batch * chunks * layout.tiles), dim3(layout.lanes, layout.row_lanes), shared, stream()>>>(
            hidden.const_data_ptr<scalar_t>(), hidden.stride(0), hidden.stride(1), hidden.stride(2), list.view(),
            query.const_data_ptr<acc>(), static_cast<acc>(scale), heads, head_dim, layout, chunks,
            out.data_ptr<scalar_t>(), stats.data_ptr<double>(), data(weights), data(part_max), data(part_sum),
            data(part_out));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (chunks > 1) {
    attention_combine<scalar_t><<<ceil_div(batch * dim, kThreads), kThreads, 0, stream()>>>(
        data(part_max), data(part_sum), data(part_out), list.view(), batch, heads, head_dim, chunks,
        out.data_ptr<scalar_t>(), stats.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (weights.defined()) {
    scores_to_weights<acc><<<ceil_div(batch * heads * list.upper, kThreads), kThreads, 0, stream()>>>(
        weights.data_ptr<acc>(), stats.const_data_ptr<double>(), list.view(), batch, heads, list.upper);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename scalar_t>
void backward_typed(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                    const at::Tensor& valid, const at::Tensor& query, const at::Tensor& out, const at::Tensor& stats,
                    double scale, at::Tensor& grad_hidden, at::Tensor& grad_query) {
  using acc = acc_t<scalar_t>;
  const Plan plan = make_plan<scalar_t>(hidden, valid, query);
  const auto& [batch, seq_len, dim, heads, head_dim, list, chunks, layout, wide] = plan;
  at::Tensor prob = at::empty({batch, heads, seq_len}, wide), err = at::empty({batch, heads, seq_len}, wide);
  at::Tensor part_pe = at::empty({batch, chunks, heads}, wide);
  at::Tensor part_pex = at::empty({batch, chunks, dim}, wide), part_px = at::empty({batch, chunks, dim}, wide);
  at::Tensor text_sums = at::empty({batch, heads}, wide);
  const acc wide_scale = static_cast<acc>(scale);
  with_vector_width<scalar_t>(layout.vec, [&]<int VEC>() {
    const size_t shared = layout.row_lanes > 1 ? size_t{kThreads} * (2 * VEC + 1) * sizeof(acc) : 0;
    attention_backward_chunks<scalar_t, VEC>
        <<<checked_blocks(batch * chunks * layout.tiles), dim3(layout.lanes, layout.row_lanes), shared, stream()>>>(
            hidden.const_data_ptr<scalar_t>(), hidden.stride(0), hidden.stride(1), hidden.stride(2), list.view(),
            query.const_data_ptr<acc>(), wide_scale, heads, head_dim, layout, chunks, grad.const_data_ptr<acc>(),
            grad_weights.defined() ? grad_weights.const_data_ptr<acc>() : nullptr, out.const_data_ptr<acc>(),
            stats.const_data_ptr<double>(), prob.data_ptr<acc>(), err.data_ptr<acc>(), part_pe.data_ptr<acc>(),
            part_pex.data_ptr<acc>(), part_px.data_ptr<acc>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  attention_query_grad<acc><<<ceil_div(dim, kThreads), kThreads, 0, stream()>>>(
      part_pe.const_data_ptr<acc>(), part_pex.const_data_ptr<acc>(), part_px.const_data_ptr<acc>(), list.view(),
      batch, heads, head_dim, chunks, wide_scale, text_sums.data_ptr<acc>(), grad_query.data_ptr<acc>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  with_vector_width<scalar_t>(vector_width<scalar_t>(grad_hidden, 1), [&]<int VEC>() {
    const int64_t packs = batch * seq_len * (dim / VEC);
    const int64_t resident = int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount} * 8;
    attention_grad_rows<scalar_t, VEC><<<std::max<int64_t>(1, std::min(ceil_div(packs, kThreads), resident * 4)),
                                         kThreads, 0, stream()>>>(
        valid.defined() ? valid.const_data_ptr<bool>() : nullptr, prob.const_data_ptr<acc>(),
        err.const_data_ptr<acc>(), text_sums.const_data_ptr<acc>(), grad.const_data_ptr<acc>(),
        query.const_data_ptr<acc>(), wide_scale, batch, seq_len, heads, head_dim, grad_hidden.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

void attention_forward(const at::Tensor& hidden, const at::Tensor& valid, const at::Tensor& query, double scale,
                       at::Tensor& out, at::Tensor& stats, at::Tensor& weights) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool", [&] {
    forward_typed<scalar_t>(hidden, valid, query, scale, out, stats, weights);
  });
}

void attention_backward(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                        const at::Tensor& valid, const at::Tensor& query, const at::Tensor& out,
                        const at::Tensor& stats, double scale, at::Tensor& grad_hidden, at::Tensor& grad_query) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool_backward", [&] {
    backward_typed<scalar_t>(grad, grad_weights, hidden, valid, query, out, stats, scale, grad_hidden, grad_query);
  });
}

}  // namespace lmk_ops::cuda
