#pragma once
// Input checks shared by every op. Each message starts with "lmk_ops.<op>:" and says what was expected and
// what came, so a user can fix the call without reading this code.
#include <ATen/core/Tensor.h>

#include <optional>

namespace lmk_ops {

// hidden: a [B, L, D] tensor of float16, bfloat16, float32 or float64 (any strides).
void check_hidden(const char* op, const at::Tensor& hidden);

// grad: a [B, D] floating tensor (the gradient of a pooled output).
void check_pooled_grad(const char* op, const at::Tensor& grad);

// Validates an attention mask against [batch, seq_len] and like's device. Accepts bool or integer tensors whose
// values are 0 or 1 (a Hugging Face attention_mask). Returns it as a contiguous bool tensor, or an undefined tensor
// when no mask was given (every token valid).
at::Tensor prepare_mask(
    const char* op,
    const std::optional<at::Tensor>& mask,
    int64_t batch,
    int64_t seq_len,
    const at::Tensor& like);

// "[2, 3, 4]" — for messages.
std::string shape_str(at::IntArrayRef sizes);

}  // namespace lmk_ops
