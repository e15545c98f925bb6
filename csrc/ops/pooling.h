#pragma once
// Building blocks shared by the op implementations (pool_ops.cpp, landmark_ops.cpp), for every device. Inputs
// are checked.
#include <optional>
#include <tuple>

#include "common/packed.h"
#include "common/tensor_ops.h"

namespace lmk_ops::ops {

bool is_empty_pool(const Tensor& hidden);

// The pooling ops' (out, pooled) pair. With normalize: pooled [B, D] rows L2-normalised as
// torch.nn.functional.normalize does (divide by max(norm, 1e-12)) in the accumulation type, rounded to dtype, and the
// unrounded rows themselves. Without: the rows as they are, and an empty tensor of the accumulation type.
std::tuple<Tensor, Tensor> finish_pooled(const Tensor& pooled, ScalarType dtype, bool normalize);

// The mean of each text's selected rows, [B, D] in hidden's dtype (zeros for a text with none); with normalize,
// normalized as finish_pooled does, and the unrounded means (an empty tensor without).
std::tuple<Tensor, Tensor> mean_of_rows(const Tensor& hidden, const RowSelection& rows, bool normalize);

// The gradient of mean_of_rows: each selected row of text b gets grad[b] * times_selected / count[b], every other
// row zero. [B, seq_len, D] in dtype (grad's dtype when not given), rounded once from the accumulation type.
Tensor mean_of_rows_backward(
    const Tensor& grad, const RowSelection& rows, int64_t seq_len, std::optional<ScalarType> dtype);

// The gradient of a packed batch's mean, [T, D] in dtype: row t of text b gets grad[b] / count[b] times how often
// rows selects it (packed.selection(mask), or a [1, N] list of absolute rows as positions: kernel_types.h), written
// once by the kernels and rounding of mean_of_rows_backward, so that a text gets the same bits packed and padded.
// count[b] is counted by the kernel from `counted`: its mask [T] within the text's run (with counted.offsets), or
// its positions [B, K] (entries >= 0), or where it has neither the text's length.
Tensor packed_mean_backward(const Tensor& grad, const PackedBatch& packed, const RowSelection& rows,
                            const RowSelection& counted, std::optional<ScalarType> dtype);

}  // namespace lmk_ops::ops
