#pragma once
// Building blocks shared by the op implementations (pool_ops.cpp, landmark_ops.cpp), for every device. Inputs
// are checked.
#include <ATen/core/Tensor.h>

#include <tuple>

#include "common/row_selection.h"

namespace lmk_ops::ops {

bool is_empty_pool(const at::Tensor& hidden);

// The pooling ops' (out, pooled) pair. With normalize: pooled [B, D] rows L2-normalised as
// torch.nn.functional.normalize does (divide by max(norm, 1e-12)) in the accumulation type, rounded to dtype, and the
// unrounded rows themselves. Without: the rows as they are, and an empty tensor of the accumulation type.
std::tuple<at::Tensor, at::Tensor> finish_pooled(const at::Tensor& pooled, at::ScalarType dtype, bool normalize);

// The mean of each text's selected rows, [B, D] in hidden's dtype (zeros for a text with none); with normalize,
// normalized as finish_pooled does, and the unrounded means (an empty tensor without).
std::tuple<at::Tensor, at::Tensor> mean_of_rows(const at::Tensor& hidden, const RowSelection& rows, bool normalize);

// The gradient of mean_of_rows: each selected row of text b gets grad[b] * times_selected / count[b], every other
// row zero. [B, seq_len, D] in dtype (grad's dtype when not given), rounded once from the accumulation type.
at::Tensor mean_of_rows_backward(
    const at::Tensor& grad, const RowSelection& rows, int64_t seq_len, std::optional<at::ScalarType> dtype);

}  // namespace lmk_ops::ops
