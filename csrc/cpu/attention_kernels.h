#pragma once
// The attention pooling kernels of one CPU capability (attention_kernels.cpp); pool_kernels.cpp puts them in that
// capability's Kernels table (ops/kernels.h), which documents them. Included only by files compiled per capability.
#include <ATen/core/Tensor.h>

#include "ops/kernels.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {

void attention_forward(const at::Tensor& hidden, const AttentionRows& rows, const at::Tensor& query, double scale,
                       at::Tensor& out, at::Tensor& stats, at::Tensor& weights);

void attention_backward(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                        const AttentionRows& rows, const at::Tensor& query, const at::Tensor& out,
                        const at::Tensor& stats, double scale, at::Tensor& grad_hidden, at::Tensor& grad_query);

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
