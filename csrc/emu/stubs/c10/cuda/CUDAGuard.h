// csrc/emu/stubs/c10/cuda/CUDAGuard.h — device guards of the emulated device.
// The emulated device's memory is host memory: the launchers' tensors are CPU
// tensors, so a guard accepts the CPU device (and nothing else).
#pragma once
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <optional>

namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device device) {
    TORCH_CHECK(device.is_cpu(), "specrt emu: the emulated device runs on CPU tensors, got ", device);
  }
  explicit CUDAGuard(c10::DeviceIndex) {}
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
};
struct OptionalCUDAGuard {
  OptionalCUDAGuard() = default;
  explicit OptionalCUDAGuard(std::optional<c10::Device> device) {
    if (device.has_value()) CUDAGuard check(*device);
  }
};
}  // namespace c10::cuda
