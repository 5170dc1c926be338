// The small-M linear kernel on AVX2 + FMA + F16C: 16 fp32 lanes as two 8-lane
// registers, the same operations in the same order as every other ISA
// (linear_kernel.h). Compiled in a SPECRT_ISA_AVX2 region; called after a run-time check.
#include <immintrin.h>

#include "cpu/linear_kernel.h"
#include "cpu/simd_target.h"

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX2)
namespace specrt::linear {
namespace avx2_isa {
namespace {

constexpr int kNR = 2;
constexpr int kMR = 2;

#include "cpu/avx2_lanes.h"

struct BV {
  V even, odd;
};

inline void h2f16(const uint16_t* p, int n, float* out) {
  alignas(32) uint16_t buf[16] = {0};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf))));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf + 8))));
}

// first n (0..8) 32-bit lanes set
inline __m256i lanes8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline int clamp8(int n) { return n < 0 ? 0 : (n > 8 ? 8 : n); }

inline V load_f32(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V load_f32_n(const float* p, int n) {
  return {_mm256_maskload_ps(p, lanes8(clamp8(n))), _mm256_maskload_ps(p + 8, lanes8(clamp8(n - 8)))};
}
inline __m256 widen8_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V load_bf16(const uint16_t* p) {
  return {widen8_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen8_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V load_bf16_n(const uint16_t* p, int n) {
  alignas(32) uint16_t buf[16] = {0};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return load_bf16(buf);
}
inline __m256 widen8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V load_i8(const int8_t* p) { return {widen8_i8(p), widen8_i8(p + 8)}; }
inline V load_i8_n(const int8_t* p, int n) {
  alignas(16) int8_t buf[16] = {0};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return load_i8(buf);
}
inline V iota16() { return {_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)}; }
// table[idx & 15] for 8 lanes: vpermps reads bits [2:0], bit 3 picks the table half
inline __m256 lut8(__m256i idx, const V& table) {
  const __m256 a = _mm256_permutevar8x32_ps(table.lo, idx), b = _mm256_permutevar8x32_ps(table.hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
inline void lut16(const uint8_t* p, const V& table, V& lo, V& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i i0 = _mm256_cvtepu8_epi32(b), i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  lo = {lut8(i0, table), lut8(i1, table)};
  hi = {lut8(_mm256_srli_epi32(i0, 4), table), lut8(_mm256_srli_epi32(i1, 4), table)};
}

inline V split_even(__m256i a, __m256i b) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
}
inline V split_odd(__m256i a, __m256i b) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  return {_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi))};
}
inline BV load_bv(const uint16_t* p) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  return {split_even(a, b), split_odd(a, b)};
}
inline BV load_bv_n(const uint16_t* p, int n) {
  alignas(32) uint16_t buf[32] = {0};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return load_bv(buf);
}
inline V vdp(V acc, const BV& w, const BV& x) { return vfma(w.even, x.even, vfma(w.odd, x.odd, acc)); }

#include "cpu/linear_tiles.h"

}  // namespace
}  // namespace avx2_isa

void linear_rows_avx2(const Problem& p, int64_t n0, int64_t n1) { avx2_isa::run_problem(p, n0, n1); }

}  // namespace specrt::linear
SPECRT_TARGET_END
