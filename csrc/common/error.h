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

}  // namespace lmk_ops

// The parts are evaluated only when the condition fails.
#define LMK_CHECK(condition, ...)   \
  do {                              \
    if (!(condition)) {             \
      ::lmk_ops::fail(__VA_ARGS__); \
    }                               \
  } while (false)
