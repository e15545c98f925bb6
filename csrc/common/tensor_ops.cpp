#include "common/tensor_ops.h"

#include <torch/csrc/stable/device.h>

#include <algorithm>

#include "common/checks.h"
#include "common/error.h"

namespace lmk_ops {
namespace {

int32_t shim_dtype(ScalarType dtype) {
  return torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
}

// A 0-d tensor holding value in like's dtype, on like's device.
Tensor scalar_like(const Tensor& like, double value) {
  return full_on(like, {}, value, like.scalar_type());
}

}  // namespace

Tensor empty_on(const Tensor& like, Sizes sizes, ScalarType dtype) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(sizes[i], 1);
  }
  const torch::stable::Device device = like.device();
  const auto device_type = torch::stable::detail::to<int32_t>(torch::stable::detail::from(device.type()));
  AtenTensorHandle out = nullptr;
  LMK_SHIM_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                                          shim_dtype(dtype), device_type, like.get_device_index(), &out),
                 "allocating a tensor of shape ", shape_str(sizes));
  return Tensor(out);
}

Tensor zeros_on(const Tensor& like, Sizes sizes, ScalarType dtype) {
  Tensor t = empty_on(like, sizes, dtype);
  torch::stable::zero_(t);
  return t;
}

Tensor full_on(const Tensor& like, Sizes sizes, double value, ScalarType dtype) {
  return torch::stable::fill_(empty_on(like, sizes, dtype), value);
}

Tensor as_strided(const Tensor& t, Sizes sizes, Sizes strides) {
  // The shim's offset is an increment on t's own storage offset (it was passed t's offset, which doubled it: a
  // packed hidden that was a later slice of a bigger tensor read rows further on, or past the storage's end).
  AtenTensorHandle out = nullptr;
  LMK_SHIM_CHECK(aoti_torch__reinterpret_tensor(t.get(), static_cast<int64_t>(sizes.size()), sizes.data(),
                                                strides.data(), /*offset_increment=*/0, &out),
                 "viewing a tensor as shape ", shape_str(sizes));
  return Tensor(out);
}

Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  Tensor view = t;  // stable narrow takes a mutable reference; it returns a new view all the same
  return torch::stable::narrow(view, dim, start, length);
}

Tensor as_contiguous(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

Tensor to_dtype(const Tensor& t, ScalarType dtype) {
  return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}

// An ATen binary operator's Tensor overload, and its form with an integer operand (a 0-d tensor of a's dtype).
#define LMK_OPS_BINARY(fn, name)                                 \
  Tensor fn(const Tensor& a, const Tensor& b) {                  \
    return aten(name, "Tensor", a, b);                           \
  }                                                              \
  Tensor fn(const Tensor& a, int64_t b) {                        \
    return fn(a, scalar_like(a, static_cast<double>(b)));        \
  }
LMK_OPS_BINARY(mul, "aten::mul")
LMK_OPS_BINARY(div, "aten::div")
LMK_OPS_BINARY(ge, "aten::ge")
#undef LMK_OPS_BINARY

Tensor clamp_min(const Tensor& a, double b) {
  return aten("aten::clamp_min", "Tensor", a, scalar_like(a, b));
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  return aten("aten::where", "self", cond, a, b);
}

}  // namespace lmk_ops
