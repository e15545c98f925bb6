#pragma once
// What the op layer (and the CUDA kernels' host code) does with tensors, on PyTorch's stable ABI only: allocation
// and views through the AOTI C shims (no dispatcher round trip, they are on every op's path), and the few ATen
// operators the device-generic paths still compose, called by name through the dispatcher (torch_call_dispatcher).
// torch 2.10's dispatcher call cannot pass an ATen Scalar, so scalars travel as 0-d tensors on the operand's device,
// and each operator here is the overload that takes tensors.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/kernel_types.h"

namespace lmk_ops {

using ScalarType = torch::headeronly::ScalarType;
using Sizes = torch::headeronly::IntHeaderOnlyArrayRef;

// Whether two shapes are equal (HeaderOnlyArrayRef has no operator== in torch 2.10's headers).
inline bool same_sizes(Sizes a, Sizes b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

// The accumulation dtype of a floating dtype: acc_t's (float64 for float64, else float32).
inline ScalarType acc_dtype(ScalarType t) {
  return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

inline bool is_integral(ScalarType t) {
  return t == ScalarType::Byte || t == ScalarType::Char || t == ScalarType::Short || t == ScalarType::Int ||
         t == ScalarType::Long || t == ScalarType::UInt16 || t == ScalarType::UInt32 || t == ScalarType::UInt64;
}

// An ATen operator by name and overload, called through the dispatcher: its (first) output. The arguments are the
// schema's, every one given, as types the stable ABI converts (Tensor, int64_t, double, bool, ScalarType,
// std::string, std::optional and std::vector of them).
template <typename... Args>
Tensor aten(const char* name, const char* overload, const Args&... args) {
  std::array<StableIValue, sizeof...(Args)> stack{torch::stable::detail::from(args)...};
  LMK_SHIM_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION), "calling ", name);
  return torch::stable::detail::to<Tensor>(stack[0]);
}

// A new contiguous tensor on like's device: uninitialised, zeros, or every element `value`.
Tensor empty_on(const Tensor& like, Sizes sizes, ScalarType dtype);
Tensor zeros_on(const Tensor& like, Sizes sizes, ScalarType dtype);
Tensor full_on(const Tensor& like, Sizes sizes, double value, ScalarType dtype);  // exact integers below 2^53

// A view of t's storage with these sizes and strides, from t's own storage offset.
Tensor as_strided(const Tensor& t, Sizes sizes, Sizes strides);
// Elements [start, start + length) of dimension dim of t, as a view.
Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t length);
// t itself when it already is contiguous (or of dtype), else a contiguous copy (a copy in dtype).
Tensor as_contiguous(const Tensor& t);
Tensor to_dtype(const Tensor& t, ScalarType dtype);

// Element-wise, broadcasting as ATen does; a scalar operand becomes a 0-d tensor of a's dtype on a's device.
Tensor mul(const Tensor& a, const Tensor& b), mul(const Tensor& a, int64_t b);
Tensor div(const Tensor& a, const Tensor& b), div(const Tensor& a, int64_t b);
Tensor ge(const Tensor& a, const Tensor& b), ge(const Tensor& a, int64_t b);
Tensor clamp_min(const Tensor& a, double b);
// cond ? a : b.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

}  // namespace lmk_ops
