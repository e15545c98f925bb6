#pragma once
// The CUDA attention pooling kernels (attention_kernels.cu); documented in common/kernel_types.h.
#include "cuda/kernel_types.h"

namespace lmk_ops::cuda {

void attention_forward(const Tensor& hidden, const AttentionRows& rows, const Tensor& query, double scale,
                       Tensor& out, Tensor& stats, Tensor& weights);

void attention_backward(const Tensor& grad, const Tensor& grad_weights, const Tensor& hidden,
                        const AttentionRows& rows, const Tensor& query, const Tensor& out,
                        const Tensor& stats, double scale, Tensor& grad_hidden, Tensor& grad_query);

}  // namespace lmk_ops::cuda
