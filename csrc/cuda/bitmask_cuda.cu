// csrc/cuda/bitmask_cuda.cu — CUDA kernel of apply_token_bitmask
// (csrc/bitmask_ops.h) and its TORCH_LIBRARY_IMPL(specrt, CUDA) registration.
//
// apply_token_bitmask_kernel
//   grid  (n, ceil(V / (kBitmaskThreads * kTokensPerThread)))   one bitmask row per x.
//   thread: tokens t = tile + threadIdx.x + j * kBitmaskThreads (coalesced stores; the 32
//     threads of a warp read one word, a broadcast). A refused token's logit becomes -inf
//     (specrt::token_allowed): the same bits as the CPU kernel.
//   bytes: reads V / 8 bitmask bytes per row, writes only refused logits; never reads them.
// No host synchronisation; every data-dependent index is guarded.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

#include "bitmask_ops.h"
#include "specrt/bitmask.h"

namespace specrt {
namespace {

constexpr int kBitmaskThreads = 256;
constexpr int kTokensPerThread = 8;

template <class Bits>
__global__ void __launch_bounds__(kBitmaskThreads)
    apply_token_bitmask_kernel(Bits* logits, const int32_t* __restrict__ bitmask, const int32_t* __restrict__ rows,
                               int64_t R, int64_t V, int64_t W, Bits neg_inf) {
  const int64_t i = blockIdx.x;
  const int64_t r = rows[i];
  if (r < 0 || r >= R) return;
  Bits* row = logits + r * V;
  const int32_t* w = bitmask + i * W;
  const int64_t tile = static_cast<int64_t>(blockIdx.y) * kBitmaskThreads * kTokensPerThread;
  for (int j = 0; j < kTokensPerThread; ++j) {
    const int64_t t = tile + threadIdx.x + static_cast<int64_t>(j) * kBitmaskThreads;
    if (t < V && !token_allowed(w, t)) row[t] = neg_inf;
  }
}

template <class Bits>
void launch(const BitmaskArgs& a, Bits neg_inf, cudaStream_t stream) {
  const int64_t n = a.rows.size(0), V = a.logits.size(1);
  const int64_t tiles = (V + kBitmaskThreads * kTokensPerThread - 1) / (kBitmaskThreads * kTokensPerThread);
  TORCH_CHECK(n <= 0x7fffffff && tiles <= 65535, "specrt: apply_token_bitmask: too many rows (", n,
              ") or tokens (", V, ")");
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(tiles));
  apply_token_bitmask_kernel<Bits><<<grid, kBitmaskThreads, 0, stream>>>(
      static_cast<Bits*>(a.logits.data_ptr()), a.bitmask.data_ptr<int32_t>(), a.rows.data_ptr<int32_t>(),
      a.logits.size(0), V, a.bitmask.size(1), neg_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void apply_token_bitmask_cuda(const BitmaskArgs& a) {
  const c10::cuda::CUDAGuard guard(a.logits.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.logits.device().index()).stream();
  switch (a.logits.scalar_type()) {
    case at::kFloat: launch<uint32_t>(a, kNegInfFloat32, stream); break;
    case at::kDouble: launch<uint64_t>(a, kNegInfFloat64, stream); break;
    case at::kBFloat16: launch<uint16_t>(a, kNegInfBFloat16, stream); break;
    default: launch<uint16_t>(a, kNegInfFloat16, stream); break;
  }
}

}  // namespace specrt

TORCH_LIBRARY_IMPL(specrt, CUDA, m) {
  m.impl("apply_token_bitmask", &specrt::apply_token_bitmask_op<specrt::apply_token_bitmask_cuda>);
}
