// specrt/sampling.h — the float math of accept/reject sampling, shared by the
// CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda), and mirrored
// operation for operation by specrt/ops/reference.py.
//
// Exponential race: sampling token v with probability proportional to w_v is
//   argmax_v  w_v / E_v,   E_v = -log(U_v),  U_v ~ Uniform(0,1) i.i.d.
// (w_v / E_v = 1 / Exp(rate w_v); the smallest arrival wins with probability
// w_v / sum(w)). It needs no normalisation, no prefix sum, and the noise for
// token v depends only on (seed, position, purpose, v), so it is
// batch-invariant and splits across thread blocks trivially.
#pragma once

#include "specrt/common.h"
#include "specrt/philox.h"

namespace specrt {

// Natural log of a positive normal float, fdlibm's e_logf reduction and
// polynomial, written with plain +,-,*,/ (each correctly rounded in IEEE-754)
// so that every compiler and device returns the same bits.
SPECRT_HOST_DEVICE float log_det(float x) {
  constexpr float kLn2Hi = 6.9313812256e-01f;
  constexpr float kLn2Lo = 9.0580006145e-06f;
  constexpr float kLg1 = 6.6666668653e-01f;
  constexpr float kLg2 = 4.0000000596e-01f;
  constexpr float kLg3 = 2.8571429849e-01f;
  constexpr float kLg4 = 2.2222198546e-01f;
  constexpr float kSqrt2 = 1.41421354f;
  const uint32_t bits = float_as_uint(x);
  int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127;
  float m = uint_as_float((bits & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  if (m > kSqrt2) {
    m = m * 0.5f;
    exponent += 1;
  }
  const float f = m - 1.0f;
  const float s = f / (2.0f + f);
  const float z = s * s;
  const float w = z * z;
  const float t1 = w * (kLg2 + w * kLg4);
  const float t2 = z * (kLg1 + w * kLg3);
  const float r = t2 + t1;
  const float hfsq = (0.5f * f) * f;
  const float dk = static_cast<float>(exponent);
  return dk * kLn2Hi - ((hfsq - (s * (hfsq + r) + dk * kLn2Lo)) - f);
}

// E = -log(U) > 0 for U strictly inside (0, 1).
SPECRT_HOST_DEVICE float exponential_from_uniform(float u) { return -log_det(u); }

// Race score of weight w (>= 0) against noise U: w / E. Weight 0 scores 0 and
// never wins against a positive weight.
SPECRT_HOST_DEVICE float race_score(float weight, float u) {
  return weight / exponential_from_uniform(u);
}

// The four race scores of tokens [4j, 4j+3] share one Philox block.
SPECRT_HOST_DEVICE float race_score_at(float weight, const Philox4x32& block, uint32_t token) {
  return race_score(weight, uniform_from_bits(block.v[token & 3u]));
}

// The one greedy rule: temperatures below kGreedyTemperature (0, tiny, negative
// or NaN) are greedy, a one-hot row at the argmax. Dividing float32 logits by a
// smaller positive temperature overflows (x / t = inf, inf - inf = NaN) for
// ordinary logits. The extension exposes the threshold (specrt::greedy_temperature),
// which Python's one copy of the rule, specrt.ops.is_greedy, reads.
constexpr float kGreedyTemperature = 1e-5f;

SPECRT_HOST_DEVICE bool is_greedy_temperature(float t) { return !(t >= kGreedyTemperature); }

// min-p keeps token v iff p_v >= min_p * max_u p_u. On the softmax numerators
// e_v = exp(x_v / t - max_u x_u / t), whose largest is exactly 1 (exp of 0),
// that is e_v >= min_p: one comparison, before the normalisation, so it needs
// no second pass over the row. min_p <= 0 (or NaN) is off; top-k keeps the
// largest logit, so the two commute; top-p then cuts the min-p renormalised row.
SPECRT_HOST_DEVICE bool min_p_drops(float numerator, float min_p) { return min_p > 0.0f && !(numerator >= min_p); }

// Residual weight after rejecting a draft: max(p - q, 0).
SPECRT_HOST_DEVICE float residual_weight(float p, float q) {
  const float d = p - q;
  return d > 0.0f ? d : 0.0f;
}

// Leviathan/Chen acceptance test for draft token x: accept iff u * q(x) < p(x).
SPECRT_HOST_DEVICE bool accept_draft(float u, float p_x, float q_x) { return u * q_x < p_x; }

// Total order on floats for argmax: NaN sorts as -inf and -0.0 equals +0.0
// (as torch.argmax sees them), so ties go to the lowest index.
SPECRT_HOST_DEVICE uint32_t ordered_key(float x) {
  if (x != x) x = uint_as_float(0xff800000u);  // NaN -> -inf
  if (x == 0.0f) x = 0.0f;                     // -0.0 -> +0.0
  const uint32_t bits = float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// (key, index) packed so that the maximum is the largest key and, among
// equal keys, the LOWEST index. Used by atomicMax on the device and by plain
// comparisons on the host.
SPECRT_HOST_DEVICE uint64_t pack_argmax(uint32_t key, uint32_t index) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint64_t>(0xffffffffu - index);
}

SPECRT_HOST_DEVICE int32_t unpack_argmax_index(uint64_t packed) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(packed));
}

// Race scores are >= 0, so their IEEE bits are already ordered.
SPECRT_HOST_DEVICE uint64_t pack_race(float score, uint32_t index) {
  return pack_argmax(float_as_uint(score), index);
}

SPECRT_HOST_DEVICE float unpack_race_score(uint64_t packed) {
  return uint_as_float(static_cast<uint32_t>(packed >> 32));
}

// A race entrant: a score of 0 never wins (it packs to 0, the identity of
// max), so a row whose scores are all 0 reduces to 0 ...
SPECRT_HOST_DEVICE uint64_t race_candidate(float score, uint32_t index) {
  return score > 0.0f ? pack_race(score, index) : 0ull;
}

// ... and such a row's winner is token 0 with score 0 (torch.argmax's answer
// on an all-zero row, which reference.py uses).
SPECRT_HOST_DEVICE int32_t race_winner(uint64_t packed) {
  return packed == 0ull ? 0 : unpack_argmax_index(packed);
}

}  // namespace specrt
