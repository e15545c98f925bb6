#pragma once
// The L2 normalisation of pooled rows for one CPU capability (normalize_kernels.cpp); pool_kernels.cpp puts it in
// that capability's Kernels table (common/kernel_types.h documents it). Included only by files compiled per
// capability.
#include "cpu/kernel_types.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {

void normalize_rows(const Tensor& wide, Tensor& out);

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
