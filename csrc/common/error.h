#pragma once
// The ops' errors: LMK_CHECK(condition, parts...) throws std::runtime_error with the parts streamed together, which
// the dispatcher hands to Python as a RuntimeError. Our own rather than c10's TORCH_CHECK, which PyTorch's stable
// ABI does not offer (common/device_name.h names devices for the same reason).
#include <sstream>
#include <stdexcept>
#include <string>

namespace lmk_ops {

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

// Throws for a failed C-shim call with torch's own message (an allocator's "can't allocate memory: you tried to
// allocate ..."), which the stable ABI's STABLE_TORCH_ERROR_CODE_CHECK drops for builds that serve torch before
// 2.13, and what lmk_ops was doing.
[[noreturn]] void throw_shim_error(const std::string& doing);

// Rethrows failure, the exception being handled in op's entry (ops/op_entry.h): a failed torch call made through
// the stable ABI's own functions as op's error with torch's reason where this torch can say it, anything else as it
// was.
[[noreturn]] void rethrow_naming_op(const char* op, const std::runtime_error& failure);

// Why failure happened: torch's reason for a failed torch call where this torch can say it, else its what().
std::string failure_reason(const std::exception& failure);

template <typename... Parts>
[[noreturn]] void fail_shim_call(const Parts&... doing) {
  std::ostringstream message;
  (message << ... << doing);
  throw_shim_error(message.str());
}

}  // namespace lmk_ops

// The parts are evaluated only when the condition fails.
#define LMK_CHECK(condition, ...)   \
  do {                              \
    if (!(condition)) {             \
      ::lmk_ops::fail(__VA_ARGS__); \
    }                               \
  } while (false)

// call: a C-shim call returning an AOTITorchError; the other arguments say what it was for (streamed together).
#define LMK_SHIM_CHECK(call, ...)                \
  do {                                           \
    if ((call) != TORCH_SUCCESS) {               \
      ::lmk_ops::fail_shim_call(__VA_ARGS__);    \
    }                                            \
  } while (false)
