#pragma once
// The ops' errors: LMK_CHECK(condition, parts...) throws std::runtime_error with the parts streamed together, which
// the dispatcher hands to Python as a RuntimeError. Our own rather than c10's TORCH_CHECK, which PyTorch's stable
// ABI does not offer; devices are named by device_name() for the same reason (c10::Device's printer lives in
// libc10).
#include <ATen/core/Tensor.h>

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

// "cpu", "cuda:0", as torch prints a tensor's device.
inline std::string device_name(const at::Tensor& t) {
  const auto device = t.device();
  switch (device.type()) {
    case c10::DeviceType::CPU:
      return "cpu";
    case c10::DeviceType::CUDA:
      return "cuda:" + std::to_string(device.index());
    case c10::DeviceType::Meta:
      return "meta";
    default:
      return "a device of type " + std::to_string(static_cast<int>(device.type()));
  }
}

}  // namespace lmk_ops

// The parts are evaluated only when the condition fails.
#define LMK_CHECK(condition, ...)   \
  do {                              \
    if (!(condition)) {             \
      ::lmk_ops::fail(__VA_ARGS__); \
    }                               \
  } while (false)
