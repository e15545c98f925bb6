#pragma once
// Devices named in the op layer's errors without c10::Device's printer, which lives in libc10 (not the stable ABI).
#include <ATen/core/Tensor.h>

#include <string>

namespace lmk_ops {

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
