#pragma once
// Which rows of each text an op reduces (common/kernel_types.h), as the op layer and the CUDA kernels hold it: ATen
// tensors, until they move to the stable ABI.
#include <ATen/core/Tensor.h>

#include "common/kernel_types.h"

namespace lmk_ops {

using RowSelection = RowSelectionOf<at::Tensor>;

}  // namespace lmk_ops
