#pragma once
// What the CPU kernels take: the stable-ABI instances of common/kernel_types.h. Inside lmk_ops::cpu these names
// stand for them rather than for the op layer's ATen instances (ops/kernels.h); kernels_dispatch.cpp adapts one
// table to the other until the op layer moves to the stable ABI as well.
#include <torch/csrc/stable/tensor.h>

#include "common/kernel_types.h"

namespace lmk_ops::cpu {

using Tensor = torch::stable::Tensor;
using RowSelection = RowSelectionOf<Tensor>;
using AttentionRows = AttentionRowsOf<Tensor>;
using Kernels = KernelsOf<Tensor>;

}  // namespace lmk_ops::cpu
