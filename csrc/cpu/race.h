// csrc/cpu/race.h — the exponential race of one row over a vocabulary range,
// on the CPU: a scalar definition and AVX2 / AVX-512 versions that return the
// same packed winner bit for bit (csrc/cpu/race_simd.h).
//
// The winner is argmax_v w_v / E_v with E_v = -log_det(U_v) from Philox at
// (seed, position, purpose, v) (specrt/sampling.h), packed with pack_race so
// that ties go to the lowest index and a range without a positive score
// reduces to 0. The weights w_v come from the row in one of three ways
// (RaceWeights below), exactly as the rejection sampler defines them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/cpu_isa.h"
#include "specrt/sampling.h"

namespace specrt {

enum class RaceWeights : int {
  kP = 0,               // w_v = p_v
  kResidual = 1,        // w_v = max(p_v - q_v, 0) where p_v > 0, else 0
  kResidualOneHot = 2,  // the same with q one-hot at `onehot`: w_v = p_v, w_x = max(p_x - 1, 0)
};

struct RaceRow {
  const float* p = nullptr;  // [V]
  const float* q = nullptr;  // [V], kResidual only
  int64_t onehot = -1;       // kResidualOneHot only: the rejected draft token
  RaceWeights weights = RaceWeights::kP;
  uint64_t seed = 0;
  int64_t position = 0;
  uint32_t purpose = 0;
};

// A pruning bound of the vector paths: for every uniform U the scalar code can
// draw, E = -log_det(U) >= (1 - U) * (1 - 2^-13) (tests/test_sampling_simd.py
// checks all 2^23 of them), so an entry with w < s * kPruneMargin * (1 - U)
// scores at most s and cannot beat a winner s found at a lower index.
constexpr float kPruneMargin = 1.0f - 1.0f / 4096.0f;

// w_v of a row (the scalar definition every path reproduces).
inline float race_weight(const RaceRow& row, int64_t v) {
  const float p = row.p[v];
  if (row.weights == RaceWeights::kP) return p;
  if (!(p > 0.0f)) return 0.0f;
  if (row.weights == RaceWeights::kResidual) return residual_weight(p, row.q[v]);
  return v == row.onehot ? residual_weight(p, 1.0f) : p;
}

// The scalar race over [begin, end): the definition.
inline uint64_t race_scalar(const RaceRow& row, int64_t begin, int64_t end) {
  uint64_t best = 0;
  Philox4x32 block{};
  int64_t loaded = -1;  // the Philox block in `block` (v / 4); weight-0 entries skip theirs
  for (int64_t v = begin; v < end; ++v) {
    const float w = race_weight(row, v);
    if (!(w > 0.0f)) continue;
    if ((v >> 2) != loaded) {
      block = philox_block(row.seed, row.position, row.purpose, static_cast<uint32_t>(v));
      loaded = v >> 2;
    }
    best = std::max(best, race_candidate(race_score_at(w, block, static_cast<uint32_t>(v)), static_cast<uint32_t>(v)));
  }
  return best;
}

uint64_t race_avx2(const RaceRow& row, int64_t begin, int64_t end);
uint64_t race_avx512(const RaceRow& row, int64_t begin, int64_t end);
// e[i] = -log_det(u[i]) on that path's vector code (a test hook: proves the
// vector log bit-identical for all 2^23 uniforms).
void exponential_noise_avx2(const float* u, float* e, int64_t n);
void exponential_noise_avx512(const float* u, float* e, int64_t n);

inline uint64_t race(CpuIsa isa, const RaceRow& row, int64_t begin, int64_t end) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return race_avx512(row, begin, end);
    case CpuIsa::kAvx2:
      return race_avx2(row, begin, end);
    default:
      return race_scalar(row, begin, end);
  }
}

inline void exponential_noise(CpuIsa isa, const float* u, float* e, int64_t n) {
  if (isa == CpuIsa::kAvx512) return exponential_noise_avx512(u, e, n);
  if (isa == CpuIsa::kAvx2) return exponential_noise_avx2(u, e, n);
  for (int64_t i = 0; i < n; ++i) e[i] = exponential_from_uniform(u[i]);
}

}  // namespace specrt
