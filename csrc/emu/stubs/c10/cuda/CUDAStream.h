// csrc/emu/stubs/c10/cuda/CUDAStream.h — the emulated device has one stream:
// launches run to completion in order, so stream order holds trivially.
#pragma once
#include <c10/core/Device.h>

#include "cuda_emu.h"

namespace c10::cuda {
struct CUDAStream {
  cudaStream_t stream() const { return nullptr; }
  operator cudaStream_t() const { return nullptr; }
  c10::DeviceIndex device_index() const { return 0; }
  void synchronize() const {}
};
inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex = -1) { return {}; }
inline CUDAStream getDefaultCUDAStream(c10::DeviceIndex = -1) { return {}; }
}  // namespace c10::cuda
