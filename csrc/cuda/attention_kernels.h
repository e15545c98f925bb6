#pragma once
// The CUDA attention pooling kernels (attention_kernels.cu); documented in ops/kernels.h.
#include <ATen/core/Tensor.h>

#include "ops/kernels.h"

namespace lmk_ops::cuda {

void attention_forward(const at::Tensor& hidden, const AttentionRows& rows, const at::Tensor& query, double scale,
                       at::Tensor& out, at::Tensor& stats, at::Tensor& weights);

void attention_backward(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                        const AttentionRows& rows, const at::Tensor& query, const at::Tensor& out,
                        const at::Tensor& stats, double scale, at::Tensor& grad_hidden, at::Tensor& grad_query);

}  // namespace lmk_ops::cuda
