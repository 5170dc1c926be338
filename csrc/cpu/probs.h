// csrc/cpu/probs.h — the row passes of probs_from_logits on the CPU: scalar
// definitions here, AVX2 / AVX-512 versions (csrc/cpu/probs_simd.h) that
// return the same floats bit for bit.
//
// Bit identity across paths needs a fixed operation order: exp is exp_det
// (specrt/exp_det.h, shared with the CUDA kernel: plain float operations, no
// FMA, no libm), and every row sum is kept in 16 double lanes (entry v goes to
// lane v % 16) that are added in lane order at the end, which is what a
// 16-float vector loop does naturally.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu/cpu_isa.h"
#include "specrt/common.h"
#include "specrt/exp_det.h"

namespace specrt {

constexpr int kSumLanes = 16;

inline double sum_lanes(const double (&lanes)[kSumLanes]) {
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return sum;
}

// out[v] = exp_det(x_v / t - m) where x_v / t >= floor, else 0 (NaN x gives 0).
// Returns the sum of out (16 lanes, see above).
inline double softmax_numerators_scalar(const float* x, int64_t n, float t, float m, float floor, float* out) {
  double lanes[kSumLanes] = {};
  for (int64_t v = 0; v < n; ++v) {
    const float y = x[v] / t;
    out[v] = y >= floor ? exp_det(y - m) : 0.0f;
    lanes[v % kSumLanes] += out[v];
  }
  return sum_lanes(lanes);
}

// out[v] = out[v] / d
inline void divide_scalar(float* out, int64_t n, float d) {
  for (int64_t v = 0; v < n; ++v) out[v] = out[v] / d;
}

// out[v] = 0 where out[v] < cut; returns the sum of what is kept (16 lanes).
inline double keep_at_least_scalar(float* out, int64_t n, float cut) {
  double lanes[kSumLanes] = {};
  for (int64_t v = 0; v < n; ++v) {
    if (!(out[v] >= cut)) out[v] = 0.0f;
    lanes[v % kSumLanes] += out[v];
  }
  return sum_lanes(lanes);
}

// Appends every x[v] with lo < x[v] <= hi to out (NaN never is); returns how
// many. The vector paths store whole vectors: out needs n + kCollectSlack
// floats of room, and out may be x itself (entries are read before written).
constexpr int64_t kCollectSlack = 16;

inline int64_t collect_range_scalar(const float* x, int64_t n, float lo, float hi, float* out) {
  int64_t count = 0;
  for (int64_t v = 0; v < n; ++v) {
    const float value = x[v];
    if (value > lo && value <= hi) out[count++] = value;
  }
  return count;
}

// argmax of x[0..n) with NaN as -inf and ties to the lowest index (an all
// -inf / NaN row gives 0), as specrt/ops/reference.py's argmax_nan_low.
inline int64_t argmax_scalar(const float* x, int64_t n) {
  float m = -INFINITY;
  for (int64_t v = 0; v < n; ++v) m = x[v] > m ? x[v] : m;
  if (m == -INFINITY) return 0;
  int64_t first = 0;
  while (!(x[first] == m)) ++first;
  return first;
}

int64_t collect_range_avx2(const float* x, int64_t n, float lo, float hi, float* out);
int64_t collect_range_avx512(const float* x, int64_t n, float lo, float hi, float* out);
int64_t argmax_avx2(const float* x, int64_t n);
int64_t argmax_avx512(const float* x, int64_t n);
double softmax_numerators_avx2(const float* x, int64_t n, float t, float m, float floor, float* out);
double softmax_numerators_avx512(const float* x, int64_t n, float t, float m, float floor, float* out);
void divide_avx2(float* out, int64_t n, float d);
void divide_avx512(float* out, int64_t n, float d);
double keep_at_least_avx2(float* out, int64_t n, float cut);
double keep_at_least_avx512(float* out, int64_t n, float cut);

inline double softmax_numerators(CpuIsa isa, const float* x, int64_t n, float t, float m, float floor, float* out) {
  if (isa == CpuIsa::kAvx512) return softmax_numerators_avx512(x, n, t, m, floor, out);
  if (isa == CpuIsa::kAvx2) return softmax_numerators_avx2(x, n, t, m, floor, out);
  return softmax_numerators_scalar(x, n, t, m, floor, out);
}

inline int64_t collect_range(CpuIsa isa, const float* x, int64_t n, float lo, float hi, float* out) {
  if (isa == CpuIsa::kAvx512) return collect_range_avx512(x, n, lo, hi, out);
  if (isa == CpuIsa::kAvx2) return collect_range_avx2(x, n, lo, hi, out);
  return collect_range_scalar(x, n, lo, hi, out);
}

inline int64_t argmax(CpuIsa isa, const float* x, int64_t n) {
  if (isa == CpuIsa::kAvx512) return argmax_avx512(x, n);
  if (isa == CpuIsa::kAvx2) return argmax_avx2(x, n);
  return argmax_scalar(x, n);
}

inline void divide(CpuIsa isa, float* out, int64_t n, float d) {
  if (isa == CpuIsa::kAvx512) return divide_avx512(out, n, d);
  if (isa == CpuIsa::kAvx2) return divide_avx2(out, n, d);
  divide_scalar(out, n, d);
}

inline double keep_at_least(CpuIsa isa, float* out, int64_t n, float cut) {
  if (isa == CpuIsa::kAvx512) return keep_at_least_avx512(out, n, cut);
  if (isa == CpuIsa::kAvx2) return keep_at_least_avx2(out, n, cut);
  return keep_at_least_scalar(out, n, cut);
}

}  // namespace specrt
