#pragma once
// Building blocks of the vectorised CPU kernels (pool_kernels.cpp, attention_kernels.cpp). Included only by files
// compiled once per CPU capability: everything here lives in that capability's namespace.
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/kernel_types.h"
#include "cpu/row_list.h"
#include "cpu/simd.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {

// Work split for the forward kernels: tasks are (text b, chunk of its selected rows, block of features
// [d0, d0 + n)) (for_each_chunk below). Each task walks its chunk's rows in order and reduces the block into an
// accumulator of its own, so every element's result depends only on that text's data, in a fixed order: a text
// pools to the same bits alone or in a batch, whatever the thread count. Blocks are whole rows when there are
// enough tasks to occupy every thread, and are split (down to kMinBlock, which keeps each row read a long
// contiguous run for the prefetcher) when there are not.
constexpr int64_t kMaxBlock = 1024;
constexpr int64_t kMinBlock = 256;
constexpr int64_t kTasksPerThread = 4;
// The least work, in elements, worth a thread: the parallel loops give each thread at least this much (a small
// call stays on one thread).
constexpr int64_t kMinParallelWork = int64_t{1} << 15;

// The block width: a multiple of unit (attention heads must not be split; unit 1 rounds to 64 features, a whole
// number of vectors), at most kMaxBlock unless one unit is wider, and at most dim.
inline int64_t feature_block(int64_t batch, int64_t dim, int64_t unit) {
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  const int64_t blocks_per_text = std::max<int64_t>(1, (kTasksPerThread * threads + batch - 1) / batch);
  const int64_t align = unit == 1 ? 64 : unit;
  const int64_t block = std::clamp((dim + blocks_per_text - 1) / blocks_per_text, kMinBlock, kMaxBlock);
  return std::min((block + align - 1) / align * align, dim);
}

// Rows a chunk holds: the unit of parallel work of the pooling kernels. A text's selected rows are cut into chunks
// of kChunkRows consecutive selected rows; each chunk is reduced on its own (a task of its own), and the chunks of a
// longer text are combined in chunk order afterwards, so one long text is spread over every thread. The chunks
// depend only on the text's own selected rows, never on padding, the batch or the threads. (Large enough that a
// task's fixed costs stay small beside its rows; a 32k-token text still makes 64 tasks.)
constexpr int64_t kChunkRows = 512;

// What a chunk's second pass (a reducer's resum_if_overflowed, where its sums overflowed) scales the rows by:
// float64 rows near float64's maximum by 2^-10, a power of two, so exactly but for subnormal values, which keeps
// kChunkRows of them finite; narrower rows are summed in float64, wider than theirs, unscaled.
template <typename acc>
constexpr double kResumShrink = std::is_same_v<acc, double> ? 0x1p-10 : 1.0;
static_assert(kChunkRows <= 1024, "a shrunk chunk's sums must stay finite");

// The type a text's per-chunk results are added up in: float64, and for float64 rows the x87 extended type (long
// double: 64-bit mantissa, 15-bit exponent). A float64 sum of a long float64 text's chunks drifted with their
// number: a mean of a million equal rows was 139 ulp off (torch.mean: 6); added up so, 1 (the chunks' own rounding).
template <typename scalar_t>
using wide_t = std::conditional_t<std::is_same_v<scalar_t, double>, long double, double>;

// Whether every value (float or double) is finite, in one vectorised pass: t - t is 0 for a finite t and NaN for
// inf or NaN. (A std::all_of over isfinite compiled to a scalar loop that took ~3% of a small batch's mean.) The
// reducers' check for chunk sums that overflowed, before their float64 re-sum.
template <typename T>
inline bool all_finite(const T* values, int64_t n) {
  using V = Vec<T>;
  int64_t i = 0;
  typename Vec<same_size_int<T>>::Native bad{};
  for (; i + V::size() <= n; i += V::size()) {
    const V t = V::loadu(values + i);
    bad |= (t.v - t.v) != T(0);
  }
  for (; i < n; ++i) {
    if (!std::isfinite(values[i])) {
      return false;
    }
  }
  return !any_lane(bad);
}

// A chunk's rows, in order, as reduce_rows walks them: rows [begin, end) of text b's list.
struct ChunkRows {
  const RowList* list;
  int64_t b, begin, end;
  template <typename F>
  void each(const F& f) const {
    for (int64_t j = begin; j < end; ++j) {
      f(list->row(b, j));
    }
  }
};

// At least n values of T for the calling thread, kept for its later tasks, not zeroed: the task of a short text
// spent more on allocating its few small buffers than on its rows. A task's buffers take distinct slots, also
// across types (acc_t may be double).
template <typename T, int kSlot>
T* thread_scratch(int64_t n) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) {
    buffer.resize(n);
  }
  return buffer.data();
}

// The number of chunks a text of up to `upper` selected rows can have.
inline int64_t chunks_for(int64_t upper) {
  return std::max<int64_t>(1, (upper + kChunkRows - 1) / kChunkRows);
}

// A call's chunks, text by text: for_each_chunk's tasks, and the slots where the texts of several chunks keep
// their chunks' partial results until they are combined. Slots exist only for the chunks there are: laid out as
// [B, the most chunks any text has] instead, a packed batch of 4000 one-token texts and one of 65536 tokens (D 768)
// took 3 GB and 10 s to pool (6 GB and 17 s for attention's backward).
struct ChunkPlan {
  std::vector<int64_t> first;   // [B + 1]: the chunks of the texts before b
  std::vector<int64_t> stored;  // [B + 1]: the slots of the texts before b (a text of one chunk has none)
  std::vector<int64_t> rows;    // [B + 1]: the selected rows of the texts before b

  ChunkPlan(const RowList& list, int64_t batch) : first(batch + 1, 0), stored(batch + 1, 0), rows(batch + 1, 0) {
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t chunks = chunks_for(list.rows(b));
      first[b + 1] = first[b] + chunks;
      stored[b + 1] = stored[b] + (chunks > 1 ? chunks : 0);
      rows[b + 1] = rows[b] + list.rows(b);
    }
  }
  int64_t chunks() const {
    return first.back();
  }
  // The work of the chunks before chunk `chunk` of text b, in rows, a chunk counting one row more than it holds
  // (its fixed costs; a text with no row still has a task): for_each_chunk splits the tasks over the threads by it.
  int64_t work_before(int64_t b, int64_t chunk) const {
    return rows[b] + std::min(chunk * kChunkRows, rows[b + 1] - rows[b]) + first[b] + chunk;
  }
  int64_t work() const {
    return rows.back() + chunks();
  }
  int64_t slots() const {
    return stored.back();
  }
  // Chunk `chunk` of text b among all the call's chunks, and among the stored ones (texts of several chunks).
  int64_t index(int64_t b, int64_t chunk) const {
    return first[b] + chunk;
  }
  int64_t slot(int64_t b, int64_t chunk) const {
    return stored[b] + chunk;
  }
};

// Up to this size a call's scratch (CallScratch) is the calling thread's, kept for its later calls.
constexpr size_t kKeptScratchBytes = size_t{16} << 20;

// Room for n values of T for one kernel call, not zeroed. At most kKeptScratchBytes, it is the calling thread's
// buffer for (T, kSlot), kept for its later calls (a call's buffers take distinct slots, also across types: acc_t
// may be double); larger, a buffer of its own, freed with this object. Fresh memory costs a page fault per 4 KiB
// page on first touch: max_pool spent 15-20% of its time on a packed batch of 120 texts of 16-2048 tokens (D 768)
// faulting in its 2.9 MB of chunk partials anew on every call.
template <typename T, int kSlot>
class CallScratch {
 public:
  explicit CallScratch(int64_t n) {
    if (static_cast<size_t>(n) * sizeof(T) > kKeptScratchBytes) {
      own_.reset(new T[n]);
      data_ = own_.get();
      return;
    }
    thread_local std::vector<T> kept;
    if (static_cast<int64_t>(kept.size()) < n) {
      kept.resize(n);
    }
    data_ = kept.data();
  }
  T* data() const {
    return data_;
  }

 private:
  std::unique_ptr<T[]> own_;
  T* data_;
};

// Calls body(b, chunk, d0, n, rows) for every (text, chunk of its selected rows, block of features) task, in
// parallel; a text with no selected row still gets its chunk 0 (with no rows), to write its zeros. Blocks are whole
// units (attention heads). Only the chunks texts have are tasks, in text order, and each thread takes a run of them
// holding an even share of the rows (ChunkPlan::work_before): an even split of the tasks was uneven in rows where
// the texts' lengths differ and few texts are long enough to be cut into chunks (a packed batch of 32 texts of
// 16-128 tokens: one of 2 threads had 1207 rows, the other 928). Which thread runs a task never changes its result.
template <typename Body>
void for_each_chunk(const ChunkPlan& plan, const RowList& list, int64_t dim, int64_t unit, const Body& body) {
  const std::vector<int64_t>& first_chunk = plan.first;
  const int64_t chunks = plan.chunks();
  if (chunks == 0) {
    return;
  }
  const int64_t block = feature_block(chunks, dim, unit);
  const int64_t blocks = (dim + block - 1) / block;
  // Work is counted in units of 1 / blocks of a row: task (chunk, block k) starts k shares of its chunk's work
  // after the chunk's work_before.
  const int64_t total = plan.work() * blocks;
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  const int64_t parts = std::clamp<int64_t>(plan.work() * dim / kMinParallelWork, 1, threads);
  torch::stable::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    // The tasks starting in [from, to). Their first text by binary search (the last text whose work starts at or
    // before `from`; every text has a chunk, so the starts increase), then the next by stepping on (a search per
    // task cost about 20 ns of a 25 ns task in a batch of 100,000 one-row texts).
    const int64_t from = total * part_begin / parts, to = total * part_end / parts;
    int64_t b = 0;
    for (int64_t hi = static_cast<int64_t>(first_chunk.size()) - 2; b < hi;) {
      const int64_t mid = (b + hi + 1) / 2;
      if (plan.work_before(mid, 0) * blocks <= from) {
        b = mid;
      } else {
        hi = mid - 1;
      }
    }
    for (int64_t index = first_chunk[b]; index < chunks; ++index) {
      while (first_chunk[b + 1] <= index) {
        ++b;
      }
      const int64_t chunk = index - first_chunk[b], first = chunk * kChunkRows;
      const int64_t before = plan.work_before(b, chunk), share = plan.work_before(b, chunk + 1) - before;
      if (before * blocks >= to) {
        return;
      }
      for (int64_t k = 0; k < blocks; ++k) {
        const int64_t at = before * blocks + k * share;
        if (at >= from && at < to) {
          body(b, chunk, k * block, std::min(block, dim - k * block),
               ChunkRows{&list, b, first, std::min(first + kChunkRows, list.rows(b))});
        }
      }
    }
  });
}

// Calls body(b, d0, n) for every (text, block of features) task with min_rows selected rows or more, in parallel:
// the combining pass after for_each_chunk (min_rows = kChunkRows + 1: the texts of several chunks).
template <typename Body>
void for_each_text(const RowList& list, int64_t batch, int64_t dim, int64_t unit, int64_t min_rows,
                   const Body& body) {
  if (list.upper() < min_rows) {
    return;
  }
  const int64_t block = feature_block(batch, dim, unit);
  const int64_t blocks = (dim + block - 1) / block;
  torch::stable::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / blocks, d0 = task % blocks * block;
      if (list.rows(b) >= min_rows) {
        body(b, d0, std::min(block, dim - d0));
      }
    }
  });
}

// A reducer folds groups of up to kRowGroup selected rows (in the selection's order) into its accumulator of n
// features; feature i of a row is at row[i * stride]. init() takes the first row alone. Attention's reducers fold
// a group per pass, keeping their accumulators in registers across the group's rows (the mean and the maximum take
// rows their own way: pool_kernels.cpp, kFoldRows). The groups depend only on the selected rows, never on padding
// or the batch.
constexpr int kRowGroup = 4;

// Whether the prefetches of rows of scalar_t go into L1 rather than only into L2, as this CPU prefers for rows of
// that width (kernel_types.h; the branch is the same every time).
template <typename scalar_t>
[[gnu::always_inline]] inline bool prefetches_into_l1() {
  return sizeof(scalar_t) >= 4 ? prefetch_levels.wide_into_l1 : prefetch_levels.narrow_into_l1;
}

// Prefetches for reading the cache line that holds p (a row of scalar_t), into L1 or only into L2
// (prefetches_into_l1). Always inlined: as a call, GCC can find it free of side effects and delete it.
template <typename scalar_t>
[[gnu::always_inline]] inline void prefetch_read(const scalar_t* p) {
  if (prefetches_into_l1<scalar_t>()) {
    __builtin_prefetch(p, 0, 3);
  } else {
    __builtin_prefetch(p, 0, 1);
  }
}

// prefetch_read() of the cache line at ahead + i where feature i starts one (contiguous rows: the mean's and the
// maximum's rows ahead, attention's).
template <typename scalar_t>
[[gnu::always_inline]] inline void prefetch_line(const scalar_t* ahead, int64_t i) {
  if ((i & (64 / static_cast<int64_t>(sizeof(scalar_t)) - 1)) == 0) {
    prefetch_read(ahead + i);
  }
}

// A group of selected rows as a reducer's step() takes it: the k row pointers, their positions, and the rows of
// the group after the next (`ahead`: row_to_prefetch), which step() prefetches line by line as it reads its own
// (attention's SoftmaxReducer::step). (Two groups on rather than one: attention over bfloat16 with 16 heads
// 1.77-1.85x -> 1.69-1.73x hidden.sum() at 1x32768x1024.)
template <typename scalar_t>
struct RowGroup {
  const scalar_t* rows[kRowGroup];
  const scalar_t* ahead[kRowGroup];
  int64_t ls[kRowGroup];
  int k;
};

// How many texts on a prefetch may reach past a short text's end (row_to_prefetch; a bound on the walk over empty
// texts).
constexpr int kPrefetchTexts = 4;

// What to prefetch for the row `at` selected rows on from text b's first, given b's feature block `block` (texts
// stride_b apart): past the text's last row, a row of the texts after it, up to kPrefetchTexts on, which this
// thread most likely takes next (for_each_chunk walks chunks in text order, and a batch of many texts has one
// feature block); else `fallback`. (With only its own rows prefetched, a text of ten rows or fewer had none, and
// each text's first row waited on memory: 4096 texts of 4-8 rows x 384 bfloat16 features, 2 threads, mean 4.2-5.3x
// hidden.sum()'s time -> 2.9-3.5x.)
template <typename scalar_t>
const scalar_t* row_to_prefetch(const RowList& list, int64_t batch, int64_t b, int64_t at, const scalar_t* block,
                                int64_t stride_b, int64_t stride_l, const scalar_t* fallback) {
  int64_t text = b;
  for (int hop = 0; at >= list.rows(text); ++hop) {
    at -= list.rows(text);
    if (++text == batch || hop == kPrefetchTexts) {
      return fallback;
    }
  }
  return block + (text - b) * stride_b + list.row(text, at) * stride_l;
}

// Folds a chunk's selected rows of one text's feature block into the reducer, in the selection's order, without
// reading the other rows; prefetches the rows two groups on (row_to_prefetch: past the text's end, the next
// texts'). Returns how many rows were folded.
template <typename scalar_t, typename Reducer>
int64_t reduce_rows(const scalar_t* block, int64_t batch, int64_t stride_b, int64_t stride_l, int64_t stride_d,
                    int64_t n, const ChunkRows& chunk, Reducer& reducer) {
  if (chunk.begin == chunk.end) {
    return 0;
  }
  const auto row = [&](int64_t j) { return chunk.list->row(chunk.b, j); };
  reducer.init(block + row(chunk.begin) * stride_l, stride_d, n, row(chunk.begin));
  RowGroup<scalar_t> group;
  for (int64_t j = chunk.begin + 1; j < chunk.end; j += kRowGroup) {
    group.k = static_cast<int>(std::min<int64_t>(kRowGroup, chunk.end - j));
    for (int r = 0; r < group.k; ++r) {
      group.ls[r] = row(j + r);
      group.rows[r] = block + group.ls[r] * stride_l;
      group.ahead[r] = row_to_prefetch(*chunk.list, batch, chunk.b, j + 2 * kRowGroup + r, block, stride_b, stride_l,
                                       group.rows[r]);
    }
    reducer.step(group, stride_d, n);
  }
  return chunk.end - chunk.begin;
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
