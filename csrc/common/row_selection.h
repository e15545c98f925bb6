#pragma once
// Which rows of each text an op reduces; produced by the input checks, consumed by the kernels.
#include <ATen/core/Tensor.h>

namespace lmk_ops {

// Every row (all undefined), the rows where a contiguous bool [B, L] mask is true, the rows listed in contiguous
// int64 [B, K] positions (-1 entries skipped; the others checked to lie in [0, L); a repeated position counts as
// often as it is listed), or runs: text b's rows are [starts[b], starts[b] + lengths[b]) (contiguous int64 [B]; a
// packed batch's texts, every row selected; on CPU only, where listing them would cost more than the reduction's
// share of a pass, so PackedBatch::selection gives this form on CPU alone).
struct RowSelection {
  at::Tensor mask;
  at::Tensor positions;
  at::Tensor starts, lengths;
};

}  // namespace lmk_ops
