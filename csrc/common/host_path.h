#pragma once
// Where the op layer has two ways to do a small piece of work: plain loops over host memory (CPU tensors only, for
// speed: a few operator calls cost more than the work), or the device-generic composition of tensor operations that
// CUDA runs. A build configured with LMK_OPS_CPU_TWIN=ON sends CPU tensors down the device-generic paths too, so
// that the suite checks, on a machine without a GPU, the op-layer code a CUDA build runs (the kernels stay CPU's).
#include <torch/csrc/stable/tensor.h>

#include <string>

#include "common/error.h"
#include "common/kernel_types.h"

namespace lmk_ops {

#ifdef LMK_OPS_CPU_TWIN
constexpr bool kCpuTwin = true;
#else
constexpr bool kCpuTwin = false;
#endif

// Whether t's work may take the host-loop path.
inline bool takes_host_path(const torch::stable::Tensor& t) {
  return !kCpuTwin && t.is_cpu();
}

// A value check's text, which the CUDA kernels print from a buffer of kDeviceMessageBytes: a CPU twin build refuses
// one that would not fit, so that the suite finds it without a GPU.
inline void twin_checks_message_fits(const std::string& expected) {
  LMK_CHECK(!kCpuTwin || expected.size() < kDeviceMessageBytes, "lmk_ops internal error: a check's message of ",
            expected.size(), " bytes would not fit the ", kDeviceMessageBytes - 1,
            " that the CUDA kernels print: ", expected);
}

}  // namespace lmk_ops
