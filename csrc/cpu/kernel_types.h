#pragma once
// The CPU kernel table (common/kernel_types.h says what it holds).
#include <string>

#include "common/kernel_types.h"

namespace lmk_ops::cpu {

// The kernels for the best CPU capability this machine runs (ATEN_CPU_CAPABILITY caps it, as it does ATen's).
const Kernels& kernels();
// Which capability kernels() uses: "DEFAULT", "AVX2" or "AVX512".
const std::string& kernels_capability();
// Whether the kernels' software prefetches fill L1 (prefetcht0) or stop at L2 (prefetcht2): chosen once, before
// any kernel runs, from LMK_OPS_PREFETCH ("l1" or "l2") or else this CPU (kernels_dispatch.cpp says which prefer
// which). Read by every prefetch (kernel_common.h, prefetch_read), so a variable rather than a call.
extern const bool prefetch_into_l1;

}  // namespace lmk_ops::cpu
