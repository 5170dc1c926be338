// tests/cudaemu/selftest.cu — small kernels that exercise the SIMT emulator
// (csrc/emu) itself: correct ones, and deliberately broken ones it must catch.
// Torch-free; built with the emulator runtime (csrc/emu/*.cpp) into a small shared library
// that tests/test_cuda_emulated.py drives through ctypes:
//   int emu_selftest(const char* name, const char* order, uint64_t seed,
//                    long long* result, char* message, size_t message_size)
// returns 0 and a checksum of the kernel's output, or 1 and the error.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Block sum through per-warp partials in shared memory (cuda_utils.cuh's pattern).
template <bool kBarrier>
__global__ void block_sum_kernel(const float* in, float* out) {
  __shared__ float scratch[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float x = warp_sum(in[blockIdx.x * blockDim.x + threadIdx.x]);
  if (lane == 0) scratch[warp] = x;
  if (kBarrier) __syncthreads();  // removed: warps read partials that are not written yet
  float r = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) r += scratch[w];
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}

// A barrier inside warp-0-only code.
__global__ void barrier_in_warp0_kernel(float* out) {
  __shared__ float s[kThreads];
  s[threadIdx.x] = threadIdx.x;
  if (threadIdx.x < 32) {
    s[threadIdx.x] += 1.0f;
    __syncthreads();
  }
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % kThreads];
}

// A full-mask shuffle after half of each warp has returned.
__global__ void shfl_exited_kernel(float* out) {
  if (threadIdx.x % 32 >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<float>(threadIdx.x), 1);
}

// One past the end of `in` (blockDim.x floats) in the last thread.
__global__ void oob_read_kernel(const float* in, float* out) {
  out[threadIdx.x] = in[threadIdx.x + 1];
}

// The same kernel within bounds.
__global__ void in_bounds_kernel(const float* in, float* out) {
  out[threadIdx.x] = in[threadIdx.x + 1 < blockDim.x ? threadIdx.x + 1 : 0];
}

// Every lane calls a shuffle whose mask names only lane 0.
__global__ void lane_not_in_mask_kernel(float* out) {
  out[threadIdx.x] = __shfl_sync(0x1u, 1.0f, 0);
}

// Lane 0 waits at a barrier while lanes 1-31 wait for it at a shuffle.
__global__ void barrier_vs_shuffle_kernel(float* out) {
  float x = threadIdx.x;
  if (threadIdx.x % 32 == 0) __syncthreads();
  else x = __shfl_xor_sync(0xffffffffu, x, 1);
  out[threadIdx.x] = x;
}

// Reads shared memory before anyone wrote it.
__global__ void uninit_shared_kernel(float* out) {
  __shared__ float s[kThreads];
  out[threadIdx.x] = s[threadIdx.x];
}

// Per-warp histogram with __activemask + __match_any_sync (sampling_cuda.cu's
// hist_add_count): threads past n leave the loop early.
__global__ void activemask_hist_kernel(const int* bins, int n, unsigned* hist) {
  __shared__ unsigned h[8];
  if (threadIdx.x < 8) h[threadIdx.x] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const unsigned bin = static_cast<unsigned>(bins[i]);
    const unsigned peers = __match_any_sync(__activemask(), bin);
    if (static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1)
      atomicAdd(&h[bin], static_cast<unsigned>(__popc(peers)));
  }
  __syncthreads();
  if (threadIdx.x < 8) hist[threadIdx.x] = h[threadIdx.x];
}

// Ballot, shuffle up / down / idx, reductions and dynamic shared memory
// (kCopy: distinct instances for the shared-memory opt-in checks).
template <int kCopy>
__global__ void collectives_kernel(int* out) {
  extern __shared__ int dyn[];
  const int lane = threadIdx.x % 32;
  const unsigned odd = __ballot_sync(0xffffffffu, lane & 1);
  const int up = __shfl_up_sync(0xffffffffu, lane, 3);
  const int down = __shfl_down_sync(0xffffffffu, lane, 5);
  const int idx = __shfl_sync(0xffffffffu, lane * 7, 31 - lane);
  const int sum = __reduce_add_sync(0xffffffffu, lane);
  const int mx = __reduce_max_sync(0xffffffffu, -lane);
  const int any = __any_sync(0xffffffffu, lane == 17), all = __all_sync(0xffffffffu, lane < 32);
  dyn[threadIdx.x] = static_cast<int>(odd ^ 0xaaaaaaaau) + up * 3 + down * 5 + idx + sum + mx + any + all;
  __syncthreads();
  out[threadIdx.x] = dyn[(threadIdx.x + 32) % blockDim.x];
}

// Two groups of lanes at two different full-mask shuffles.
__global__ void divergent_shuffles_kernel(float* out) {
  float x = threadIdx.x;
  if (threadIdx.x % 32 < 16) x = __shfl_xor_sync(0xffffffffu, x, 1);
  else x = __shfl_xor_sync(0xffffffffu, x, 2);
  out[threadIdx.x] = x;
}

template <class T>
long long checksum(const std::vector<T>& v) {
  long long h = 0;
  for (const T& x : v) {
    long long bits = 0;
    std::memcpy(&bits, &x, sizeof(T));
    h = h * 1000003 + bits;
  }
  return h;
}

void check_launch() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
}

long long run(const std::string& name) {
  const int blocks = 3, n = blocks * kThreads;
  std::vector<float> in(n), out(n, 0.0f);
  for (int i = 0; i < n; ++i) in[i] = 1.0f / static_cast<float>(1 + (i * 37) % 101);
  if (name == "block_sum" || name == "block_sum_no_barrier") {
    if (name == "block_sum") block_sum_kernel<true><<<blocks, kThreads>>>(in.data(), out.data());
    else block_sum_kernel<false><<<blocks, kThreads>>>(in.data(), out.data());
  } else if (name == "barrier_in_warp0") {
    barrier_in_warp0_kernel<<<1, kThreads>>>(out.data());
  } else if (name == "shfl_exited") {
    shfl_exited_kernel<<<1, kThreads>>>(out.data());
  } else if (name == "oob_read" || name == "in_bounds") {
    std::vector<float> small(kThreads, 1.5f);  // exactly blockDim.x floats
    if (name == "oob_read") oob_read_kernel<<<1, kThreads>>>(small.data(), out.data());
    else in_bounds_kernel<<<1, kThreads>>>(small.data(), out.data());
  } else if (name == "lane_not_in_mask") {
    lane_not_in_mask_kernel<<<1, 32>>>(out.data());
  } else if (name == "barrier_vs_shuffle") {
    barrier_vs_shuffle_kernel<<<1, kThreads>>>(out.data());
  } else if (name == "uninit_shared") {
    uninit_shared_kernel<<<1, kThreads>>>(out.data());
  } else if (name == "activemask_hist") {
    const int m = 300;
    std::vector<int> bins(m);
    for (int i = 0; i < m; ++i) bins[i] = (i * i + 3 * i) % 8 == 5 ? 5 : (i / 7) % 8;
    std::vector<unsigned> hist(8, 0);
    activemask_hist_kernel<<<1, 256>>>(bins.data(), m, hist.data());
    check_launch();
    std::vector<unsigned> want(8, 0);
    for (int b : bins) ++want[b];
    if (hist != want) throw std::runtime_error("activemask_hist: wrong histogram");
    return checksum(hist);
  } else if (name == "collectives") {
    std::vector<int> iout(kThreads);
    collectives_kernel<0><<<2, kThreads, kThreads * sizeof(int)>>>(iout.data());
    check_launch();
    return checksum(iout);
  } else if (name == "divergent_shuffles") {
    divergent_shuffles_kernel<<<1, 32>>>(out.data());
  } else if (name == "bad_block") {
    block_sum_kernel<true><<<1, 2048>>>(in.data(), out.data());
  } else if (name == "smem_over_48k" || name == "smem_optin") {
    std::vector<int> iout(2 * kThreads);
    if (name == "smem_optin") {
      const cudaError_t e =
          cudaFuncSetAttribute(collectives_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024);
      if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
      collectives_kernel<2><<<2, kThreads, 64 * 1024>>>(iout.data());
    } else {
      collectives_kernel<1><<<2, kThreads, 64 * 1024>>>(iout.data());
    }
    check_launch();
    return checksum(iout);
  } else if (name == "threadidx_on_host") {
    return threadIdx.x;
  } else {
    throw std::runtime_error("unknown selftest " + name);
  }
  check_launch();
  return checksum(out);
}

}  // namespace

extern "C" int emu_selftest(const char* name, const char* order, uint64_t seed, long long* result, char* message,
                            size_t message_size) {
  try {
    emu::set_order(order, seed);
    *result = run(name);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(message, message_size, "%s", e.what());
    return 1;
  }
}

extern "C" void emu_stats(unsigned long long* out6) {
  const emu::Stats s = emu::stats();
  const unsigned long long v[6] = {s.launches, s.blocks, s.threads, s.switches, s.barriers, s.collectives};
  std::memcpy(out6, v, sizeof(v));
}
