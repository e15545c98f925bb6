#pragma once
// Building blocks of the vectorised CPU kernels (pool_kernels.cpp, attention_kernels.cpp). Included only by files
// compiled once per CPU capability: everything here lives in that capability's namespace.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

#include "common/row_selection.h"
#include "cpu/row_list.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {

using at::vec::Vectorized;

template <typename scalar_t>
using acc_t = at::opmath_type<scalar_t>;  // float for half/bfloat16/float, double for double

// Work split for the forward kernels: tasks are (text b, block of features [d0, d0 + n)). Each task walks its
// text's selected rows (increasing l, or the listed order) and reduces the block into an accumulator of its own,
// so every element's result depends only on that text's data, in a fixed order: a text pools to the same bits
// alone or in a batch, whatever the thread count. Blocks are whole rows when there are enough texts to occupy
// every thread, and are split (down to kMinBlock, which keeps each row read a long contiguous run for the
// prefetcher) when B is small.
constexpr int64_t kMaxBlock = 1024;
constexpr int64_t kMinBlock = 256;
constexpr int64_t kTasksPerThread = 4;
// Below this many elements of work per chunk, at::parallel_for keeps the work on one thread.
constexpr int64_t kMinParallelWork = int64_t{1} << 15;

// The block width: a multiple of unit (attention heads must not be split; unit 1 rounds to 64 features, a whole
// number of vectors), at most kMaxBlock unless one unit is wider, and at most dim.
inline int64_t feature_block(int64_t batch, int64_t dim, int64_t unit) {
  const int64_t threads = at::get_num_threads();
  const int64_t blocks_per_text = std::max<int64_t>(1, (kTasksPerThread * threads + batch - 1) / batch);
  const int64_t align = unit == 1 ? 64 : unit;
  const int64_t block = std::clamp((dim + blocks_per_text - 1) / blocks_per_text, kMinBlock, kMaxBlock);
  return std::min((block + align - 1) / align * align, dim);
}

// Calls body(b, d0, n) for every (text, feature block) task, in parallel.
template <typename Body>
void for_each_text_block(int64_t batch, int64_t rows_per_text, int64_t dim, int64_t unit, const Body& body) {
  const int64_t block = feature_block(batch, dim, unit);
  const int64_t blocks = (dim + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, rows_per_text * block));
  at::parallel_for(0, batch * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / blocks;
      const int64_t d0 = (task % blocks) * block;
      body(b, d0, std::min(block, dim - d0));
    }
  });
}

// Rows a chunk holds: the unit of parallel work of the pooling kernels. A text's selected rows are cut into chunks
// of kChunkRows consecutive selected rows; each chunk is reduced on its own (a task of its own), and the chunks of a
// longer text are combined in chunk order afterwards, so one long text is spread over every thread. The chunks
// depend only on the text's own selected rows, never on padding, the batch or the threads. (Large enough that a
// task's fixed costs stay small beside its rows; a 32k-token text still makes 64 tasks.)
constexpr int64_t kChunkRows = 512;

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

// Calls body(b, chunk, d0, n, rows) for every (text, chunk of its selected rows, block of features) task, in
// parallel; a text with no selected row still gets its chunk 0 (with no rows), to write its zeros.
template <typename Body>
void for_each_chunk(const RowList& list, int64_t batch, int64_t dim, const Body& body) {
  const int64_t chunks = std::max<int64_t>(1, (list.upper() + kChunkRows - 1) / kChunkRows);
  const int64_t block = feature_block(batch * chunks, dim, 1);
  const int64_t blocks = (dim + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, kMinParallelWork / (std::min(kChunkRows, list.upper()) * block + 1));
  at::parallel_for(0, batch * chunks * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (chunks * blocks), chunk = task / blocks % chunks;
      const int64_t d0 = task % blocks * block, first = chunk * kChunkRows, count = list.rows(b);
      if (first < count || chunk == 0) {
        body(b, chunk, d0, std::min(block, dim - d0), ChunkRows{&list, b, first, std::min(first + kChunkRows, count)});
      }
    }
  });
}

// Calls body(b, d0, n) for every (text with more than one chunk, block of features) task, in parallel: the
// combining pass after for_each_chunk.
template <typename Body>
void for_each_long_text(const RowList& list, int64_t batch, int64_t dim, const Body& body) {
  if (list.upper() <= kChunkRows) {
    return;
  }
  const int64_t block = feature_block(batch, dim, 1);
  const int64_t blocks = (dim + block - 1) / block;
  at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / blocks, d0 = task % blocks * block;
      if (list.rows(b) > kChunkRows) {
        body(b, d0, std::min(block, dim - d0));
      }
    }
  });
}

// Loads Vectorized<acc_t>::size() elements widened to the accumulation type.
template <typename scalar_t>
inline Vectorized<acc_t<scalar_t>> load_widened(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, acc_t<scalar_t>>) {
    return Vectorized<scalar_t>::loadu(p);
  } else {
    Vectorized<float> v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

// The row selections of RowSelection, one text at a time: each(f) calls f(l) for the text's selected rows in order.
struct AllRows {
  int64_t seq_len;
  template <typename F>
  void each(const F& f) const {
    for (int64_t l = 0; l < seq_len; ++l) {
      f(l);
    }
  }
};

struct MaskedRows {
  const bool* valid;
  int64_t seq_len;
  template <typename F>
  void each(const F& f) const {
    for (int64_t l = 0; l < seq_len; ++l) {
      if (valid[l]) {
        f(l);
      }
    }
  }
};

struct ListedRows {
  const int64_t* positions;
  int64_t count;
  template <typename F>
  void each(const F& f) const {
    for (int64_t k = 0; k < count; ++k) {
      if (positions[k] >= 0) {
        f(positions[k]);
      }
    }
  }
};

// Calls run(rows_per_text, rows_of), where rows_of(b) is text b's selector (ListedRows, MaskedRows or AllRows).
template <typename Run>
void with_row_selectors(const RowSelection& selection, int64_t seq_len, const Run& run) {
  if (selection.positions.defined()) {
    const int64_t listed = selection.positions.size(1);
    const int64_t* p = selection.positions.const_data_ptr<int64_t>();
    run(listed, [=](int64_t b) { return ListedRows{p + b * listed, listed}; });
  } else if (selection.mask.defined()) {
    const bool* v = selection.mask.const_data_ptr<bool>();
    run(seq_len, [=](int64_t b) { return MaskedRows{v + b * seq_len, seq_len}; });
  } else {
    run(seq_len, [=](int64_t) { return AllRows{seq_len}; });
  }
}

// A reducer folds groups of up to kRowGroup selected rows (in the selection's order) into its accumulator of n
// features; feature i of a row is at row[i * stride]. init() takes the first row alone. Folding a group per pass
// keeps the accumulator in registers across the group's rows; the order of operations per element is still row
// by row, and the groups depend only on the selected rows, never on padding or the batch.
constexpr int kRowGroup = 4;

// Folds the selected rows of one text's feature block into the reducer, in the selection's order, without
// reading the other rows. Returns how many rows were folded.
template <typename scalar_t, typename Rows, typename Reducer>
int64_t reduce_rows(const scalar_t* block, int64_t stride_l, int64_t stride_d, int64_t n, const Rows& selected,
                    Reducer& reducer) {
  int64_t count = 0;
  const scalar_t* rows[kRowGroup];
  int64_t ls[kRowGroup];
  int k = 0;
  selected.each([&](int64_t l) {
    if (count++ == 0) {
      reducer.init(block + l * stride_l, stride_d, n, l);
      return;
    }
    rows[k] = block + l * stride_l;
    ls[k] = l;
    if (++k == kRowGroup) {
      reducer.step(rows, ls, k, stride_d, n);
      k = 0;
    }
  });
  if (k > 0) {
    reducer.step(rows, ls, k, stride_d, n);
  }
  return count;
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
