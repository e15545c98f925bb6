#include "common/checks.h"

#include <ATen/ops/any.h>
#include <ATen/ops/nonzero.h>

#include <sstream>

namespace lmk_ops {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s << (i ? ", " : "") << sizes[i];
  }
  s << "]";
  return s.str();
}

static bool is_supported_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

void check_hidden(const char* op, const at::Tensor& hidden) {
  TORCH_CHECK(hidden.defined(), "lmk_ops.", op, ": expected hidden to be a tensor, got None");
  TORCH_CHECK(
      hidden.dim() == 3, "lmk_ops.", op, ": expected hidden of shape [B, L, D] (3-D), got a ", hidden.dim(),
      "-D tensor of shape ", shape_str(hidden.sizes()));
  TORCH_CHECK(
      is_supported_float(hidden.scalar_type()), "lmk_ops.", op,
      ": expected hidden of dtype float16, bfloat16, float32 or float64, got ", hidden.scalar_type());
}

void check_pooled_grad(const char* op, const at::Tensor& grad) {
  TORCH_CHECK(
      grad.dim() == 2, "lmk_ops.", op, ": expected grad_out of shape [B, D] (2-D), got shape ",
      shape_str(grad.sizes()));
  TORCH_CHECK(
      is_supported_float(grad.scalar_type()), "lmk_ops.", op,
      ": expected grad_out of dtype float16, bfloat16, float32 or float64, got ", grad.scalar_type());
}

at::Tensor prepare_mask(
    const char* op,
    const std::optional<at::Tensor>& mask,
    int64_t batch,
    int64_t seq_len,
    const at::Tensor& like) {
  if (!mask.has_value() || !mask->defined()) {
    return at::Tensor();
  }
  const at::Tensor& m = *mask;
  TORCH_CHECK(
      m.device() == like.device(), "lmk_ops.", op, ": expected mask on the same device as hidden (", like.device(),
      "), got ", m.device());
  TORCH_CHECK(
      m.dim() == 2 && m.size(0) == batch && m.size(1) == seq_len, "lmk_ops.", op, ": expected mask of shape [B, L] = [",
      batch, ", ", seq_len, "], got ", shape_str(m.sizes()));
  const auto t = m.scalar_type();
  TORCH_CHECK(
      t == at::kBool || at::isIntegralType(t, /*includeBool=*/false), "lmk_ops.", op,
      ": expected mask of dtype bool or an integer dtype holding 0/1, got ", t);
  if (t == at::kBool) {
    return m.contiguous();
  }
  // An integer mask is a Hugging Face attention_mask: anything but 0/1 is almost surely a mistake (weights, or
  // token ids passed by accident), so say so instead of treating it as "nonzero = valid".
  const at::Tensor bad = m.lt(0).logical_or_(m.gt(1));
  if (bad.any().item<bool>()) {
    const at::Tensor where = bad.nonzero()[0];
    const int64_t b = where[0].item<int64_t>(), l = where[1].item<int64_t>();
    TORCH_CHECK(
        false, "lmk_ops.", op, ": expected mask values 0 or 1, got ", m[b][l].item<int64_t>(), " at [", b, ", ", l,
        "]");
  }
  return m.to(at::kBool).contiguous();
}

}  // namespace lmk_ops
