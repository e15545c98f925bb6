#pragma once
// The one place that lists the dtypes the kernels are instantiated for, with torch's header-only dispatch macros
// (torch/headeronly/core/Dispatch.h: ATen's AT_DISPATCH macros are not part of the stable ABI). The ops check dtypes
// before any kernel runs, so another dtype here is an internal error (STD_TORCH_CHECK: "NAME" not implemented for it).
#include <torch/headeronly/core/Dispatch.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>

// Calls the lambda (its last argument) with scalar_t the C++ type of TYPE: half, bfloat16, float or double.
#define LMK_DISPATCH_FLOATING(TYPE, NAME, ...)                                  \
  THO_DISPATCH_SWITCH(TYPE, NAME,                                               \
                      THO_DISPATCH_CASE(c10::ScalarType::Half, __VA_ARGS__)     \
                      THO_DISPATCH_CASE(c10::ScalarType::BFloat16, __VA_ARGS__) \
                      THO_DISPATCH_CASE(c10::ScalarType::Float, __VA_ARGS__)    \
                      THO_DISPATCH_CASE(c10::ScalarType::Double, __VA_ARGS__))

// Calls the lambda (its last argument) with index_t the C++ type of TYPE: int32 or int64.
#define LMK_DISPATCH_INDEX(TYPE, NAME, ...)                                                        \
  THO_DISPATCH_SWITCH(TYPE, NAME,                                                                  \
                      THO_PRIVATE_CASE_TYPE_USING_HINT(c10::ScalarType::Int, index_t, __VA_ARGS__) \
                      THO_PRIVATE_CASE_TYPE_USING_HINT(c10::ScalarType::Long, index_t, __VA_ARGS__))
