#pragma once
// The CUDA mean and max forward kernels (pool_kernels.cu); documented in common/kernel_types.h.
#include "cuda/kernel_types.h"

namespace lmk_ops::cuda {

void mean_forward(const Tensor& hidden, const RowSelection& rows, Tensor& out);
void max_forward(const Tensor& hidden, const RowSelection& rows, Tensor& out, Tensor& argmax);

}  // namespace lmk_ops::cuda
