#pragma once
// The CUDA kernel table (common/kernel_types.h says what it holds).
#include "common/kernel_types.h"

namespace lmk_ops::cuda {

const Kernels& kernels();

}  // namespace lmk_ops::cuda
