#pragma once
// The vectorised CPU pooling kernels. pool_kernels.cpp is compiled once per CPU capability (DEFAULT, AVX2, AVX512),
// each copy in its own namespace; pool_kernels_dispatch.cpp picks the best one the running CPU supports.
// The kernels trust their inputs: the op implementations in pool_cpu.cpp check them first.
#include <ATen/core/Tensor.h>

#include <string>

namespace lmk_ops::cpu {

struct PoolKernels {
  // hidden [B, L, D] with stride(2) == 1 (other strides free); valid: contiguous bool [B, L] or undefined (all
  // valid); out [B, D] contiguous in hidden's dtype. B, L, D > 0.
  void (*mean_forward)(const at::Tensor& hidden, const at::Tensor& valid, at::Tensor& out);
  // As mean_forward, plus argmax [B, D] contiguous int32 (-1 for a row with no valid token).
  void (*max_forward)(const at::Tensor& hidden, const at::Tensor& valid, at::Tensor& out, at::Tensor& argmax);
  // grad [B, D] contiguous, argmax [B, D] contiguous int32; grad_hidden [B, L, D] contiguous, fully written.
  void (*max_backward)(const at::Tensor& grad, const at::Tensor& argmax, at::Tensor& grad_hidden);
};

// The kernels for the CPU capability that at::get_cpu_capability() selects (ATEN_CPU_CAPABILITY overrides it).
const PoolKernels& pool_kernels();
// Which capability pool_kernels() uses: "DEFAULT", "AVX2" or "AVX512".
const std::string& pool_kernels_capability();

}  // namespace lmk_ops::cpu
