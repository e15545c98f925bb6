#pragma once
// The attention pooling kernels of one CPU capability (attention_kernels.cpp); pool_kernels.cpp puts them in that
// capability's Kernels table (common/kernel_types.h), which documents them. Included only by files compiled per
// capability.
#include "cpu/kernel_types.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {

void attention_forward(const Tensor& hidden, const AttentionRows& rows, const Tensor& query, double scale,
                       Tensor& out, Tensor& stats, Tensor& weights);

void attention_backward(const Tensor& grad, const Tensor& grad_weights, const Tensor& hidden,
                        const AttentionRows& rows, const Tensor& query, const Tensor& out,
                        const Tensor& stats, double scale, Tensor& grad_hidden, Tensor& grad_query);

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
