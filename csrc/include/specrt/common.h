// specrt/common.h — macros shared by the torch-free headers.
//
// Everything under csrc/include/specrt/ is header-only, torch-free and
// compiles both as host C++ and as CUDA device code. The float math in these
// headers is written so that gcc (with -ffp-contract=off) and nvcc (with
// --fmad=false) evaluate exactly the same IEEE-754 single-precision operations
// in the same order: no fused multiply-add, no library transcendental
// functions, no fast-math. That is what makes CPU and CUDA kernels return
// bit-identical tokens, and what lets specrt/ops/reference.py (pure torch float32
// elementwise ops) mirror them bit for bit.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SPECRT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SPECRT_HOST_DEVICE inline
#endif

namespace specrt {

// Reinterpret float <-> uint32 without UB on either compiler.
SPECRT_HOST_DEVICE uint32_t float_as_uint(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

SPECRT_HOST_DEVICE float uint_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  __builtin_memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

}  // namespace specrt
