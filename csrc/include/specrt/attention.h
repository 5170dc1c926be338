// specrt/attention.h — the float math of paged multi-position attention,
// shared by the CPU kernel (csrc/cpu/attention_cpu.cpp) and the CUDA kernel
// (csrc/cuda/attention_cuda.cu) so both return the same bits.
//
// The algorithm both kernels implement, per query (one "lane": a query head
// and a new token of a request, at absolute position pos):
//   * keys are visited in fixed absolute tiles [32t, 32t+32) inside fixed
//     absolute chunks [256c, 256c+256); key kp is visible iff kp <= pos,
//     (window == 0 or kp > pos - window) and tree_visible(pos, kp, mask),
//     mask being the query row's tree ancestor bits (-1 without a tree);
//   * score  s = sum_d fmaf(q[d] * qscale, k[d]) in order d = 0..D-1, with
//     qscale = scale * log2(e) (scores live in the base-2 domain);
//   * per tile: m' = max(m, max_j s_j); alpha = exp2(m - m'), p_j =
//     exp2(s_j - m') (m' == -inf counts as 0 there); l = l * alpha, then
//     l += p_j in key order; acc[d] = acc[d] * alpha, then acc[d] =
//     fmaf(p_j, v_j[d], acc[d]) in key order;
//   * a request whose visible keys span several chunks combines the chunk
//     partials in chunk order: M = max m_c, w_c = exp2(m_c - M),
//     L = fmaf(l_c, w_c, L), A[d] = fmaf(acc_c[d], w_c, A[d]); out = A / L
//     (one chunk: out = acc / l, which is the same number).
// Masked keys and empty chunks add exact zeros, so a query's output depends
// only on its own q, position and visible keys: not on batch neighbours, the
// number of queries of its request, the block size, the thread count or the
// device.
#pragma once

#include <cmath>

#include "specrt/common.h"

namespace specrt {
namespace attn {

constexpr int kTileKeys = 32;    // keys per online-softmax update
constexpr int kChunkKeys = 256;  // keys per split-context partial (threads / CTAs)
constexpr int kLanes = 16;       // queries processed together (one AVX-512 vector, one CTA)
constexpr float kLog2e = 1.4426950408889634f;

// 2^x for x <= 0 (the only domain the kernels use: differences to a running
// max), 0 below -126; NaN stays NaN. Round-to-nearest range reduction (the
// 1.5 * 2^23 trick), degree-7 Taylor polynomial of 2^f on [-0.5, 0.5]
// (truncation < 1e-8 relative) in explicit fmaf, scaled by 2^n built from the
// exponent bits. Integer bits come from t's representation, so no float ->
// int conversion (undefined for NaN in C++) is needed.
SPECRT_HOST_DEVICE float exp2_det(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float xc = x < -127.0f ? -127.0f : x;
  const float t = xc + kRound;
  const float n = t - kRound;
  const float f = xc - n;
  float p = 1.5252733804059840e-05f;
  p = fmaf(p, f, 1.5403530393381606e-04f);
  p = fmaf(p, f, 1.3333558146428443e-03f);
  p = fmaf(p, f, 9.6181291076284772e-03f);
  p = fmaf(p, f, 5.5504108664821580e-02f);
  p = fmaf(p, f, 2.4022650695910071e-01f);
  p = fmaf(p, f, 6.9314718055994531e-01f);
  p = fmaf(p, f, 1.0f);
  const uint32_t bits = (float_as_uint(t) - 0x4B400000u + 127u) << 23;
  const float r = p * uint_as_float(bits);
  return x < -126.0f ? 0.0f : r;
}

// Exact conversions of 16-bit cache elements to float.
SPECRT_HOST_DEVICE float bf16_bits_to_float(uint16_t h) { return uint_as_float(static_cast<uint32_t>(h) << 16); }

SPECRT_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return uint_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // zero or subnormal: mantissa * 2^-24, exact in float
  const float mag = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
  return uint_as_float(sign | float_as_uint(mag));
}

// Tree attention: a query at position pos whose row carries ancestor bits `mask` sees key kp <= pos
// iff kp lies kTreeBits or more positions back or bit (pos - kp) of mask is set (bit 0: the query's
// own key, bit 1 the key just before it). A mask of -1 (every bit) is plain causal attention.
constexpr int kTreeBits = 64;

SPECRT_HOST_DEVICE bool tree_visible(int64_t pos, int64_t kp, int64_t mask) {
  const int64_t back = pos - kp;
  return back >= kTreeBits || (back >= 0 && ((static_cast<uint64_t>(mask) >> back) & 1u) != 0);
}

// First key any query of a request can see: its first new token sits at
// seq_len - query_len; with a window only the last `window` positions count.
SPECRT_HOST_DEVICE int64_t first_visible_key(int64_t seq_len, int64_t query_len, int64_t window) {
  const int64_t first = seq_len - query_len - window + 1;
  return window > 0 && first > 0 ? first : 0;
}

}  // namespace attn
}  // namespace specrt
