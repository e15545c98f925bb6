#pragma once
// LMK_OPS_IMPL(m, "name", fn) registers fn as the op lmk_ops::name, behind an entry that names the op in the error
// of a failed torch call, or of a host allocation that failed (std::bad_alloc, which Python would show as a bare
// MemoryError). The stable ABI's own calls (torch::stable::sum, view, fill_, ...) throw "<shim call> API call failed
// at <header>, line <n>" without torch's reason (a build that serves torch before 2.13 cannot get it at compile
// time), nor the op: on CUDA that is where an earlier kernel's device-side assertion often surfaces.
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cstddef>
#include <new>
#include <stdexcept>
#include <utility>

#include "common/error.h"

namespace lmk_ops {

// A string literal as a template argument.
template <std::size_t N>
struct OpName {
  constexpr OpName(const char (&name)[N]) { std::copy_n(name, N, text); }  // NOLINT: implicit from a literal
  char text[N];
};

template <OpName op, auto fn>
struct OpEntry;

template <OpName op, typename Result, typename... Args, Result (*fn)(Args...)>
struct OpEntry<op, fn> {
  static Result call(Args... args) {
    try {
      return fn(std::forward<Args>(args)...);
    } catch (const std::runtime_error& failure) {
      rethrow_naming_op(op.text, failure);
    } catch (const std::bad_alloc&) {  // host memory for the kernels' own buffers (partial sums, row lists)
      fail("lmk_ops::", op.text, ": out of host memory for its working buffers (std::bad_alloc)");
    }
  }
};

}  // namespace lmk_ops

#define LMK_OPS_IMPL(m, name, fn)                \
  do {                                           \
    using Entry = ::lmk_ops::OpEntry<name, &fn>; \
    (m).impl(name, TORCH_BOX(&Entry::call));     \
  } while (false)
