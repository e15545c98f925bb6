#pragma once
// The CPU kernel table (common/kernel_types.h says what it holds).
#include <string>

#include "common/kernel_types.h"

namespace lmk_ops::cpu {

// The kernels for the best CPU capability this machine runs (ATEN_CPU_CAPABILITY caps it, as it does ATen's).
const Kernels& kernels();
// Which capability kernels() uses: "DEFAULT", "AVX2" or "AVX512".
const std::string& kernels_capability();
// Whether the kernels' software prefetches fill L1 (prefetcht0) or stop at L2 (prefetcht2), for rows of 16-bit
// values and for rows of 32- and 64-bit ones: chosen once, before any kernel runs, from LMK_OPS_PREFETCH ("l1" or
// "l2", for both) or else this CPU (kernels_dispatch.cpp says which prefer which). Read by every prefetch
// (kernel_common.h, prefetches_into_l1), so a variable rather than a call.
struct PrefetchLevels {
  bool narrow_into_l1, wide_into_l1;  // 16-bit rows; rows of 32- and 64-bit values (into L1: true)
};
extern const PrefetchLevels prefetch_levels;
// Where the prefetches go, as build_info() names it: "L1", "L2", or "L1 for 16-bit rows, L2 for wider".
const char* prefetch_levels_name();

}  // namespace lmk_ops::cpu
