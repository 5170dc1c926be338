// The fused decoder kernels on AVX2 + FMA: 16 fp32 lanes as two 8-lane registers,
// the same operations in the same order as every other ISA (fused_rows.h).
// Compiled in a SPECRT_ISA_AVX2 region (simd_target.h); called after a run-time CPU check.
#include <immintrin.h>

#include "cpu/fused_kernel.h"
#include "cpu/simd_target.h"

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX2)
namespace specrt::fused {
namespace avx2_isa {
namespace {

#include "cpu/avx2_lanes.h"

inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V vmin(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline __m256 rint8(__m256 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vrint(V a) { return {rint8(a.lo), rint8(a.hi)}; }
inline __m256 pow2i8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V vpow2i(V n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
inline __m256 select_gt8(__m256 x, __m256 t, __m256 a, __m256 b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, t, _CMP_GT_OQ));
}
inline V vselect_gt(V x, V t, V a, V b) { return {select_gt8(x.lo, t.lo, a.lo, b.lo), select_gt8(x.hi, t.hi, a.hi, b.hi)}; }
inline __m256 round_bf16_8(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
inline V vround_bf16(V a) { return {round_bf16_8(a.lo), round_bf16_8(a.hi)}; }

// first n (0..8) 32-bit lanes set
inline __m256i lanes8(int n) {
  n = n < 0 ? 0 : (n > 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V load_f32_n(const float* p, int n) {
  if (n == 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, lanes8(n)), _mm256_maskload_ps(p + 8, lanes8(n - 8))};
}
inline __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V load_bf16_n(const uint16_t* p, int n) {
  if (n == 16) {
    return {widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  alignas(32) uint16_t buf[16] = {0};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return load_bf16_n(buf, 16);
}
inline void store_f32_n(float* p, V v, int n) {
  if (n == 16) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
    return;
  }
  _mm256_maskstore_ps(p, lanes8(n), v.lo);
  _mm256_maskstore_ps(p + 8, lanes8(n - 8), v.hi);
}
inline __m128i narrow8(__m256 v) {  // top 16 bits of 8 lanes -> 8 uint16
  const __m256i s = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}
inline void store_bf16_n(uint16_t* p, V v, int n) {
  alignas(16) uint16_t buf[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), narrow8(v.lo));
  _mm_store_si128(reinterpret_cast<__m128i*>(buf + 8), narrow8(v.hi));
  for (int i = 0; i < n; ++i) p[i] = buf[i];
}

#include "cpu/fused_rows.h"

}  // namespace
}  // namespace avx2_isa

void rms_norm_rows_avx2(const NormProblem& p, int64_t t0, int64_t t1) { avx2_isa::run_norm(p, t0, t1); }
void silu_mul_rows_avx2(const SiluMulProblem& p, int64_t t0, int64_t t1) { avx2_isa::run_silu_mul(p, t0, t1); }
void rotary_rows_avx2(const RotaryProblem& p, int64_t t0, int64_t t1) { avx2_isa::run_rotary(p, t0, t1); }

}  // namespace specrt::fused
SPECRT_TARGET_END
