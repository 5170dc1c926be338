// csrc/cuda/penalties_cuda.cu — CUDA kernel of apply_penalties
// (csrc/penalties_ops.h) and its TORCH_LIBRARY_IMPL(specrt, CUDA) registration.
//
// apply_penalties_kernel
//   grid  (R)   one block per row, kPenaltyThreads threads.
//   thread: block-strided over the row's request entries (each counts the row's
//     earlier drafts equal to its token: i <= K compares), then over the row's
//     earlier draft positions j (a draft that is no entry and first at j is
//     rewritten by thread j's pass). Each token is rewritten by one thread,
//     with specrt::penalized_logit: the same bits as the CPU kernel.
//   bytes: reads/writes 4 bytes per entry and per draft token; never the row.
// No host synchronisation; every data-dependent index is guarded.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

#include "penalties_ops.h"
#include "specrt/penalties.h"

namespace specrt {
namespace {

constexpr int kPenaltyThreads = 128;

__global__ void __launch_bounds__(kPenaltyThreads)
    apply_penalties_kernel(float* logits, const int32_t* __restrict__ row_request,
                           const int32_t* __restrict__ row_offset, const int32_t* __restrict__ drafts,
                           const int64_t* __restrict__ entry_start, const int32_t* __restrict__ entry_token,
                           const int32_t* __restrict__ entry_count, const bool* __restrict__ entry_in_prompt,
                           const float* __restrict__ entry_bias, const float* __restrict__ rp,
                           const float* __restrict__ fp, const float* __restrict__ pp, int64_t V, int64_t B,
                           int64_t K, int64_t E) {
  const int64_t r = blockIdx.x;
  const int64_t b = row_request[r];
  if (b < 0 || b >= B) return;
  int64_t i = row_offset[r];
  i = i < 0 ? 0 : (i > K ? K : i);
  int64_t s = entry_start[b], e = entry_start[b + 1];
  s = s < 0 ? 0 : (s > E ? E : s);
  e = e < s ? s : (e > E ? E : e);
  float* row = logits + r * V;
  const int32_t* d = drafts + b * K;
  const float rep = rp[b], freq = fp[b], pres = pp[b];
  for (int64_t idx = s + threadIdx.x; idx < e; idx += blockDim.x) {
    const int32_t t = entry_token[idx];
    if (t < 0 || t >= V) continue;
    int64_t n = entry_count[idx];
    for (int64_t j = 0; j < i; ++j) n += d[j] == t;
    row[t] = penalized_logit(row[t], entry_bias[idx], rep, entry_in_prompt[idx],
                             static_cast<int32_t>(n < INT32_MAX ? n : INT32_MAX), freq, pres);
  }
  for (int64_t j = threadIdx.x; j < i; j += blockDim.x) {
    const int32_t t = d[j];
    if (t < 0 || t >= V) continue;
    bool first = true;
    for (int64_t jj = 0; jj < j && first; ++jj) first = d[jj] != t;
    if (!first || find_token(entry_token + s, e - s, t) >= 0) continue;
    int32_t n = 0;
    for (int64_t jj = 0; jj < i; ++jj) n += d[jj] == t;
    row[t] = penalized_logit(row[t], 0.0f, rep, false, n, freq, pres);
  }
}

}  // namespace

void apply_penalties_cuda(const PenaltiesArgs& a) {
  const int64_t R = a.logits.size(0);
  if (R == 0) return;
  TORCH_CHECK(R <= 0x7fffffff, "specrt: apply_penalties: too many rows: ", R);
  const c10::cuda::CUDAGuard guard(a.logits.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.logits.device().index()).stream();
  apply_penalties_kernel<<<static_cast<unsigned>(R), kPenaltyThreads, 0, stream>>>(
      a.logits.data_ptr<float>(), a.row_request.data_ptr<int32_t>(), a.row_offset.data_ptr<int32_t>(),
      a.draft_token_ids.data_ptr<int32_t>(), a.entry_start.data_ptr<int64_t>(), a.entry_token.data_ptr<int32_t>(),
      a.entry_count.data_ptr<int32_t>(), a.entry_in_prompt.data_ptr<bool>(), a.entry_bias.data_ptr<float>(),
      a.repetition_penalty.data_ptr<float>(), a.frequency_penalty.data_ptr<float>(),
      a.presence_penalty.data_ptr<float>(), a.logits.size(1), a.entry_start.size(0) - 1,
      a.draft_token_ids.size(1), a.entry_token.size(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace specrt

TORCH_LIBRARY_IMPL(specrt, CUDA, m) {
  m.impl("apply_penalties", &specrt::apply_penalties_op<specrt::apply_penalties_cuda>);
}
