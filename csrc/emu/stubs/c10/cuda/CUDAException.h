// csrc/emu/stubs/c10/cuda/CUDAException.h — error checks of the emulated CUDA runtime.
#pragma once
#include <c10/util/Exception.h>

#include "cuda_emu.h"

#define C10_CUDA_CHECK(EXPR)                                                                   \
  do {                                                                                         \
    const cudaError_t emu_err_ = (EXPR);                                                       \
    TORCH_CHECK(emu_err_ == cudaSuccess, "CUDA error: ", cudaGetErrorString(emu_err_), " (", \
                cudaGetErrorName(emu_err_), ")");                                              \
  } while (0)
#define C10_CUDA_CHECK_WARN(EXPR)                                                     \
  do {                                                                                \
    const cudaError_t emu_err_ = (EXPR);                                              \
    if (emu_err_ != cudaSuccess) TORCH_WARN("CUDA warning: ", cudaGetErrorString(emu_err_)); \
  } while (0)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())
