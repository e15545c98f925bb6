#pragma once
// Each text's selected rows in order, as the CPU forward kernels take them: the rows they cut into chunks of
// kChunkRows (kernel_common.h). The CPU twin of the CUDA row listing (cuda/common.cuh).
#include <ATen/core/Tensor.h>

#include "common/row_selection.h"

namespace lmk_ops::cpu {

// A view: text b has rows(b) selected rows, the j-th being row(b, j). (An explicit flag for "every row": an empty
// list of positions has no data pointer either.)
struct RowList {
  const int64_t* order = nullptr;  // [B, width]
  const int64_t* count = nullptr;  // [B]
  int64_t width = 0;
  int64_t seq_len = 0;
  bool every_row = true;

  int64_t rows(int64_t b) const {
    return every_row ? seq_len : count[b];
  }
  int64_t row(int64_t b, int64_t j) const {
    return every_row ? j : order[b * width + j];
  }
  // The most rows a text can have.
  int64_t upper() const {
    return every_row ? seq_len : width;
  }
};

// A RowList and the storage it views.
struct RowListing {
  at::Tensor order, count;
  RowList view;
};

// The true rows of a mask, or the entries of positions that are not -1, in order (nothing listed for every row).
RowListing list_rows(const RowSelection& selection, int64_t batch, int64_t seq_len);

}  // namespace lmk_ops::cpu
