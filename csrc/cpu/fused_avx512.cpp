// The fused decoder kernels on AVX-512 (F/BW/VL/DQ): one 16-lane register per V.
// Compiled in a SPECRT_ISA_AVX512 region (simd_target.h) and only called after a run-time
// CPU check (cpu_isa.h).
#include <immintrin.h>

#include "cpu/fused_kernel.h"
#include "cpu/simd_target.h"

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX512)
namespace specrt::fused {
namespace avx512_isa {
namespace {

using V = __m512;

inline __mmask16 mask16(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float s) { return _mm512_set1_ps(s); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vrint(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vpow2i(V n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline V vselect_gt(V x, V t, V a, V b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, t, _CMP_GT_OQ), b, a); }
inline V vround_bf16(V a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                     _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC00000)));
}
inline float vreduce(V a) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline V load_f32_n(const float* p, int n) { return _mm512_maskz_loadu_ps(mask16(n), p); }
inline V load_bf16_n(const uint16_t* p, int n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask16(n), p)), 16));
}
inline void store_f32_n(float* p, V v, int n) { _mm512_mask_storeu_ps(p, mask16(n), v); }
inline void store_bf16_n(uint16_t* p, V v, int n) {
  _mm256_mask_storeu_epi16(p, mask16(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

#include "cpu/fused_rows.h"

}  // namespace
}  // namespace avx512_isa

void rms_norm_rows_avx512(const NormProblem& p, int64_t t0, int64_t t1) { avx512_isa::run_norm(p, t0, t1); }
void silu_mul_rows_avx512(const SiluMulProblem& p, int64_t t0, int64_t t1) { avx512_isa::run_silu_mul(p, t0, t1); }
void rotary_rows_avx512(const RotaryProblem& p, int64_t t0, int64_t t1) { avx512_isa::run_rotary(p, t0, t1); }

}  // namespace specrt::fused
SPECRT_TARGET_END
