#pragma once
// Devices named in the op layer's errors as torch prints them ("cpu", "cuda:0"); c10::Device's printer lives in
// libc10, outside the stable ABI.
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/tensor.h>

#include <string>

namespace lmk_ops {

inline std::string device_name(const torch::stable::Tensor& t) {
  const torch::stable::Device device = t.device();
  switch (device.type()) {
    case torch::headeronly::DeviceType::CPU:
      return "cpu";
    case torch::headeronly::DeviceType::CUDA:
      return "cuda:" + std::to_string(device.index());
    case torch::headeronly::DeviceType::Meta:
      return "meta";
    default:
      return "a device of type " + std::to_string(static_cast<int>(device.type()));
  }
}

}  // namespace lmk_ops
