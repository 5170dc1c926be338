// specrt/penalties.h — the float math of apply_penalties, shared by the CPU
// kernel (csrc/cpu/penalties_cpu.cpp) and the CUDA kernel
// (csrc/cuda/penalties_cuda.cu), and mirrored operation for operation by
// specrt/ops/reference.py (apply_penalties), so all three return the same bits.
//
// A token's logit x at one position, given what came before that position:
//   x + bias                                        logit_bias (OpenAI)
//   seen ? (x < 0 ? x * rp : x / rp) : x            repetition_penalty (HF / vLLM; seen = in the
//                                                   prompt or generated before this position)
//   count > 0 ? (x - fp * count) - pp : x           frequency / presence penalty (OpenAI; count =
//                                                   times generated before this position)
#pragma once

#include "specrt/common.h"

namespace specrt {

SPECRT_HOST_DEVICE float penalized_logit(float x, float bias, float repetition_penalty, bool in_prompt,
                                         int32_t count, float frequency_penalty, float presence_penalty) {
  x = x + bias;
  if (in_prompt || count > 0) x = x < 0.0f ? x * repetition_penalty : x / repetition_penalty;
  if (count > 0) x = (x - frequency_penalty * static_cast<float>(count)) - presence_penalty;
  return x;
}

// Index of `token` in the strictly increasing tokens[0, n), or -1.
SPECRT_HOST_DEVICE int64_t find_token(const int32_t* tokens, int64_t n, int32_t token) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (tokens[mid] < token) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < n && tokens[lo] == token ? lo : -1;
}

}  // namespace specrt
