#pragma once
// What the CPU kernels take: the stable-ABI instances of common/kernel_types.h, which inside lmk_ops::cpu stand
// for them rather than for the op layer's ATen instances (ops/kernels.h).
#include <string>

#include "common/kernel_types.h"

namespace lmk_ops::cpu {

using stable_abi::AttentionRows;
using stable_abi::Kernels;
using stable_abi::RowSelection;
using stable_abi::Tensor;

// The kernels for the best CPU capability this machine runs (ATEN_CPU_CAPABILITY caps it, as it does ATen's).
const Kernels& kernels();
// Which capability kernels() uses: "DEFAULT", "AVX2" or "AVX512".
const std::string& kernels_capability();

}  // namespace lmk_ops::cpu
