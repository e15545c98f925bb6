#pragma once
// The one place that lists the dtypes the kernels are instantiated for, as switches of our own over the dtype
// (header-only: ATen's AT_DISPATCH macros are not part of PyTorch's stable ABI). The ops check dtypes before any
// kernel runs, so another dtype here is an internal error.
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <stdexcept>
#include <string>

#define LMK_DISPATCH_CASE(ENUM, TYPE, ALIAS, ...) \
  case c10::ScalarType::ENUM: {                   \
    using ALIAS [[maybe_unused]] = TYPE;          \
    return __VA_ARGS__();                         \
  }

#define LMK_DISPATCH_UNEXPECTED(NAME) \
  default:                            \
    throw std::logic_error(std::string("lmk_ops.") + NAME + ": internal error: a dtype no kernel is built for");

// Calls the lambda (its last argument) with scalar_t the C++ type of TYPE: half, bfloat16, float or double.
#define LMK_DISPATCH_FLOATING(TYPE, NAME, ...)                          \
  [&] {                                                                 \
    switch (TYPE) {                                                     \
      LMK_DISPATCH_CASE(Half, c10::Half, scalar_t, __VA_ARGS__)         \
      LMK_DISPATCH_CASE(BFloat16, c10::BFloat16, scalar_t, __VA_ARGS__) \
      LMK_DISPATCH_CASE(Float, float, scalar_t, __VA_ARGS__)            \
      LMK_DISPATCH_CASE(Double, double, scalar_t, __VA_ARGS__)          \
      LMK_DISPATCH_UNEXPECTED(NAME)                                     \
    }                                                                   \
  }()

// Calls the lambda (its last argument) with index_t the C++ type of TYPE: int32 or int64.
#define LMK_DISPATCH_INDEX(TYPE, NAME, ...)                  \
  [&] {                                                      \
    switch (TYPE) {                                          \
      LMK_DISPATCH_CASE(Int, int32_t, index_t, __VA_ARGS__)  \
      LMK_DISPATCH_CASE(Long, int64_t, index_t, __VA_ARGS__) \
      LMK_DISPATCH_UNEXPECTED(NAME)                          \
    }                                                        \
  }()
