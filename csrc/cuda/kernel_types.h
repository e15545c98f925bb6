#pragma once
// What the CUDA kernels take: the stable-ABI instances of common/kernel_types.h, which inside lmk_ops::cuda stand
// for them rather than for the op layer's ATen instances (ops/kernels.h).
#include "common/kernel_types.h"

namespace lmk_ops::cuda {

using stable_abi::AttentionRows;
using stable_abi::Kernels;
using stable_abi::RowSelection;
using stable_abi::Tensor;

const Kernels& kernels();

}  // namespace lmk_ops::cuda
