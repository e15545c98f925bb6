#pragma once
// The CUDA mean and max forward kernels (pool_kernels.cu); documented in ops/kernels.h.
#include <ATen/core/Tensor.h>

#include "common/row_selection.h"

namespace lmk_ops::cuda {

void mean_forward(const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out);
void max_forward(const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out, at::Tensor& argmax);

}  // namespace lmk_ops::cuda
