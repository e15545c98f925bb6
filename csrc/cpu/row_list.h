#pragma once
// Each text's selected rows in order, as the CPU forward kernels take them: the rows they cut into chunks of
// kChunkRows (kernel_common.h). The CPU twin of the CUDA row listing (cuda/common.cuh).
#include <cstdint>
#include <vector>

#include "cpu/kernel_types.h"

namespace lmk_ops::cpu {

// A view: text b has rows(b) selected rows, the j-th being row(b, j): listed in order, or else a run of rows
// from start[b] (from 0 when start is null). (An explicit flag for "listed": an empty list of positions has no data
// pointer either.)
struct RowList {
  const int64_t* order = nullptr;  // the listed rows: [B, width], or the texts' lists one after another
  const int64_t* count = nullptr;  // [B]: rows per text; seq_len each when null
  const int64_t* start = nullptr;  // [B]: where each text's run starts, unless listed; where its list starts in
                                   // order when listed one after another (null: at b * width)
  int64_t width = 0;               // the most rows a text has
  int64_t seq_len = 0;
  bool listed = false;

  int64_t rows(int64_t b) const {
    return count != nullptr ? count[b] : seq_len;
  }
  int64_t row(int64_t b, int64_t j) const {
    return listed ? order[(start != nullptr ? start[b] : b * width) + j] : (start != nullptr ? start[b] : 0) + j;
  }
  int64_t upper() const {
    return width;
  }
};

// A RowList and the storage it views (moving keeps the view valid; list_rows returns it in place).
struct RowListing {
  std::vector<int64_t> order, count, start;
  RowList view;
};

// The true rows of a mask, or the entries of positions that are not -1, in order, or the rows of each run where a
// [T] mask is true, the texts' lists one after another (nothing listed for every row, or for runs alone).
RowListing list_rows(const RowSelection& selection, int64_t batch, int64_t seq_len);

}  // namespace lmk_ops::cpu
