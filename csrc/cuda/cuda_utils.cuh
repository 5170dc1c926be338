// csrc/cuda/cuda_utils.cuh — small device helpers private to csrc/cuda.
//
// Warp/block reductions with a FIXED combination order (so float sums are
// deterministic for a given block size), the u64 "packed argmax" max used by
// the race and argmax kernels, and a cached SM count for grid sizing.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>

namespace specrt {
namespace cuda_detail {

constexpr int kWarpSize = 32;

__device__ __forceinline__ uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = max_u64(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

__device__ __forceinline__ float warp_sum_f32(float x) {
  // xor butterfly: every lane ends with the same bits (same pairing order).
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// Max over the block; the result is returned to EVERY thread.
// scratch: >= blockDim.x / 32 entries of shared memory. Contains barriers:
// call from all threads of the block.
__device__ __forceinline__ uint64_t block_max_u64(uint64_t x, uint64_t* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  x = warp_max_u64(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  uint64_t r = 0;
  for (int w = 0; w < num_warps; ++w) r = max_u64(r, scratch[w]);
  return r;
}

// Deterministic float sum over the block (fixed order), returned to every thread.
__device__ __forceinline__ float block_sum_f32(float x, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  x = warp_sum_f32(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = 0.0f;
  for (int w = 0; w < num_warps; ++w) r += scratch[w];
  return r;
}

__device__ __forceinline__ double warp_sum_f64(double x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// Deterministic double sum over the block (fixed order), returned to every
// thread. The CPU kernels accumulate probabilities in double too, so the two
// normalisers agree to far below float32 rounding.
__device__ __forceinline__ double block_sum_f64(double x, double* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  x = warp_sum_f64(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  double r = 0.0;
  for (int w = 0; w < num_warps; ++w) r += scratch[w];
  return r;
}

// Number of SMs of `device`, queried once per device (cudaDeviceGetAttribute
// is a host-side query: no stream work, no synchronisation, graph-safe).
inline int sm_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (count <= 0) count = 1;
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace cuda_detail
}  // namespace specrt
