#pragma once
// The vectorised CPU pooling kernels. pool_kernels.cpp is compiled once per CPU capability (DEFAULT, AVX2, AVX512),
// each copy in its own namespace; pool_kernels_dispatch.cpp picks the best one the running CPU supports.
// The kernels trust their inputs: the op implementations in pool_cpu.cpp check them first.
#include <ATen/core/Tensor.h>

#include <string>

#include "common/row_selection.h"

namespace lmk_ops::cpu {

struct PoolKernels {
  // hidden [B, L, D] with any strides; out [B, D] contiguous, in hidden's dtype or in its accumulation type
  // (float32, float64 for float64), which keeps the mean unrounded for a normalisation that follows. B, L, D > 0.
  void (*mean_forward)(const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out);
  // As mean_forward with out in hidden's dtype, plus argmax [B, D] contiguous int32 (-1 for a text with no row).
  void (*max_forward)(const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out, at::Tensor& argmax);
  // grad [B, D] contiguous, argmax [B, D] contiguous int32; grad_hidden [B, L, D] contiguous, fully written.
  void (*max_backward)(const at::Tensor& grad, const at::Tensor& argmax, at::Tensor& grad_hidden);
  // Attention pooling (attention_kernels.cpp). hidden [B, L, D] with any strides, B, L, D > 0; valid: bool [B, L]
  // contiguous, or undefined for every row; query [H, D / H] contiguous in the accumulation type. Writes every
  // element of out [B, D] (hidden's dtype), the softmax statistics stats [B, H, 2] (float64 {max score, sum of
  // exp(score - max)}) of every text with a valid row (the caller fills them with -inf first) and, when
  // weights [B, H, L] (accumulation type, zero-filled) is defined, the probabilities of the valid rows.
  void (*attention_forward)(const at::Tensor& hidden, const at::Tensor& valid, const at::Tensor& query, double scale,
                            at::Tensor& out, at::Tensor& stats, at::Tensor& weights);
  // grad [B, D], grad_weights [B, H, L] (or undefined) and out [B, D] (the forward's output) contiguous in the
  // accumulation type; stats as the forward wrote them. Writes every element of grad_hidden [B, L, D] (hidden's dtype,
  // contiguous) and of grad_query [H, D / H] (accumulation type).
  void (*attention_backward)(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                             const at::Tensor& valid, const at::Tensor& query, const at::Tensor& out,
                             const at::Tensor& stats, double scale, at::Tensor& grad_hidden, at::Tensor& grad_query);
};

// The kernels for the CPU capability that at::get_cpu_capability() selects (ATEN_CPU_CAPABILITY overrides it).
const PoolKernels& pool_kernels();
// Which capability pool_kernels() uses: "DEFAULT", "AVX2" or "AVX512".
const std::string& pool_kernels_capability();

}  // namespace lmk_ops::cpu
