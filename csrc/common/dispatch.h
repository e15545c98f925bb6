#pragma once
// The one place that lists the floating dtypes the kernels are instantiated for.
#include <ATen/Dispatch.h>

#define LMK_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, "lmk_ops." NAME, __VA_ARGS__)
