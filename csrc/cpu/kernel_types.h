#pragma once
// The CPU kernel table (common/kernel_types.h says what it holds).
#include <string>

#include "common/kernel_types.h"

namespace lmk_ops::cpu {

// The kernels for the best CPU capability this machine runs (ATEN_CPU_CAPABILITY caps it, as it does ATen's).
const Kernels& kernels();
// Which capability kernels() uses: "DEFAULT", "AVX2" or "AVX512".
const std::string& kernels_capability();

}  // namespace lmk_ops::cpu
