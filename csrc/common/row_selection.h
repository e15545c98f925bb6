#pragma once
// Which rows of each text an op reduces; produced by the input checks, consumed by the kernels.
#include <ATen/core/Tensor.h>

namespace lmk_ops {

// Every row (both undefined), the rows where a contiguous bool [B, L] mask is true, or the rows listed in
// contiguous int64 [B, K] positions (-1 entries skipped; the others checked to lie in [0, L); a repeated position
// counts as often as it is listed).
struct RowSelection {
  at::Tensor mask;
  at::Tensor positions;
};

}  // namespace lmk_ops
