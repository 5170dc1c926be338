// specrt/bitmask.h — the rule of apply_token_bitmask, shared by the CPU kernel
// (csrc/cpu/bitmask_cpu.cpp) and the CUDA kernel (csrc/cuda/bitmask_cuda.cu),
// and mirrored by specrt/ops/reference.py (apply_token_bitmask).
//
// A row's allowed tokens are a bitmask of int32 words (the layout llguidance
// and xgrammar fill): token t is allowed when bit t % 32 of word t / 32 is set.
// A refused token's logit becomes -inf; an allowed one keeps its bits.
#pragma once

#include "specrt/common.h"

namespace specrt {

SPECRT_HOST_DEVICE bool token_allowed(const int32_t* words, int64_t t) {
  return ((static_cast<uint32_t>(words[t >> 5]) >> (t & 31)) & 1u) != 0u;
}

// -inf as bits, per logits dtype: the kernels write raw bits so one kernel serves
// float64 (uint64_t), float32 (uint32_t) and bfloat16 / float16 (uint16_t) alike.
constexpr uint64_t kNegInfFloat64 = 0xfff0000000000000ull;
constexpr uint32_t kNegInfFloat32 = 0xff800000u;
constexpr uint16_t kNegInfBFloat16 = 0xff80u;
constexpr uint16_t kNegInfFloat16 = 0xfc00u;

}  // namespace specrt
