// specrt/philox.h — counter-based Philox4x32-10 (Salmon et al., SC'11) and the
// one randomness rule of specrt (docs/architecture.md section 3):
//
//   every random number = f(request seed, absolute token position, purpose, index)
//
// key     = (seed low 32 bits, seed high 32 bits)
// counter = (index / 4, position low 32, position high 32, purpose)
// output  = word (index % 4) of the Philox block
//
// so four consecutive indices (e.g. four token ids of the exponential race)
// share one Philox evaluation. Verified against the Random123 known-answer
// vectors in tests/test_randomness.py.
#pragma once

#include "specrt/common.h"

namespace specrt {

struct Philox4x32 {
  uint32_t v[4];
};

// Purposes are disjoint random streams.
enum Purpose : uint32_t {
  kPurposeDraft = 1,     // draft-token sampling (method="rejection")
  kPurposeAccept = 2,    // the u_i coins of accept/reject
  kPurposeResidual = 3,  // resample-after-reject and bonus draw (race, indexed by token id)
  kPurposeTarget = 4,    // autoregressive sampler's race; coupled drafts use it too
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

SPECRT_HOST_DEVICE void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

SPECRT_HOST_DEVICE Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t key0, uint32_t key1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kPhiloxM0, ctr.v[0], hi0, lo0);
    mulhilo32(kPhiloxM1, ctr.v[2], hi1, lo1);
    Philox4x32 next;
    next.v[0] = hi1 ^ ctr.v[1] ^ key0;
    next.v[1] = lo1;
    next.v[2] = hi0 ^ ctr.v[3] ^ key1;
    next.v[3] = lo0;
    ctr = next;
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  return ctr;
}

// The Philox block holding indices [4*(index/4), 4*(index/4)+3].
SPECRT_HOST_DEVICE Philox4x32 philox_block(uint64_t seed, int64_t position, uint32_t purpose,
                                           uint32_t index) {
  const uint64_t pos = static_cast<uint64_t>(position);
  Philox4x32 ctr;
  ctr.v[0] = index >> 2;
  ctr.v[1] = static_cast<uint32_t>(pos);
  ctr.v[2] = static_cast<uint32_t>(pos >> 32);
  ctr.v[3] = purpose;
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

SPECRT_HOST_DEVICE uint32_t random_bits(uint64_t seed, int64_t position, uint32_t purpose,
                                        uint32_t index) {
  return philox_block(seed, position, purpose, index).v[index & 3u];
}

// Uniform strictly inside (0, 1): (k + 1/2) * 2^-23 for the top 23 bits k.
// Every step is exact in float32, so the value is the same on every device;
// the extremes are 2^-24 and 1 - 2^-24.
SPECRT_HOST_DEVICE float uniform_from_bits(uint32_t bits) {
  return (static_cast<float>(bits >> 9) + 0.5f) * 1.1920928955078125e-07f;
}

SPECRT_HOST_DEVICE float uniform(uint64_t seed, int64_t position, uint32_t purpose, uint32_t index) {
  return uniform_from_bits(random_bits(seed, position, purpose, index));
}

}  // namespace specrt
