#pragma once
// The kernel table: what each device provides under the op implementations in ops/ (common/kernel_types.h
// documents it). The op implementations check inputs, allocate outputs and finish results once, for every device;
// kernels_for(tensor) hands the work to the CPU table (cpu/, vectorised once per CPU capability) or the CUDA table
// (cuda/).
#include <torch/csrc/stable/library.h>

#include "common/kernel_types.h"
#include "cpu/kernel_types.h"
#ifdef LMK_OPS_WITH_CUDA
#include "cuda/kernel_types.h"
#endif

namespace lmk_ops {

// The table for t's device (the ops register only for devices that have one).
const Kernels& kernels_for(const Tensor& t);

}  // namespace lmk_ops

// Registers the op implementations that register(StableLibrary&) adds, for every device with a kernel table, through
// the stable ABI (the schemas are defined in Python: python/lmk_ops/_schemas.py).
#ifdef LMK_OPS_WITH_CUDA
#define LMK_OPS_REGISTER_CUDA(register)       \
  STABLE_TORCH_LIBRARY_IMPL(lmk_ops, CUDA, m) { \
    register(m);                               \
  }
#else
#define LMK_OPS_REGISTER_CUDA(register)
#endif
#define LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register) \
  STABLE_TORCH_LIBRARY_IMPL(lmk_ops, CPU, m) {      \
    register(m);                                    \
  }                                                 \
  LMK_OPS_REGISTER_CUDA(register)
