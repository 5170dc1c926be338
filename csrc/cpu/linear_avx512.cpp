// The small-M linear kernel on AVX-512 (F/BW/VL + FMA + F16C), compiled in a SPECRT_ISA_AVX512 region
// (simd_target.h) and only called after a run-time CPU check. bf16 x bf16 is emulated here in the
// vdpbf16ps order; linear_avx512bf16.cpp runs it natively.
#include <immintrin.h>

#include "cpu/linear_kernel.h"
#include "cpu/simd_target.h"

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX512)
namespace specrt::linear {
namespace avx512_isa {
namespace {

constexpr int kNR = 4;
constexpr int kMR = 6;

using V = __m512;
struct BV {  // 16 (even, odd) bf16 pairs widened to fp32
  __m512 even, odd;
};

inline void h2f16(const uint16_t* p, int n, float* out) {
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p)));
}
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float s) { return _mm512_set1_ps(s); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vreduce(V a) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // [s4[0]+s4[2], s4[1]+s4[3], ..]
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline __mmask16 mask16(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline V load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline V load_f32_n(const float* p, int n) { return _mm512_maskz_loadu_ps(mask16(n), p); }
inline V widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline V load_bf16(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V load_bf16_n(const uint16_t* p, int n) { return widen_bf16(_mm256_maskz_loadu_epi16(mask16(n), p)); }
inline V load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V load_i8_n(const int8_t* p, int n) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask16(n), p))); }
inline V iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline void lut16(const uint8_t* p, V table, V& lo, V& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_permutexvar_ps(b, table);  // vpermps reads index bits [3:0]: the low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}

inline BV split_bv(__m512i v) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline BV load_bv(const uint16_t* p) { return split_bv(_mm512_loadu_si512(p)); }
inline BV load_bv_n(const uint16_t* p, int n) {
  return split_bv(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1ull), p));
}
inline V vdp(V acc, const BV& w, const BV& x) {
  return _mm512_fmadd_ps(w.even, x.even, _mm512_fmadd_ps(w.odd, x.odd, acc));
}

#include "cpu/linear_tiles.h"

}  // namespace
}  // namespace avx512_isa

void linear_rows_avx512(const Problem& p, int64_t n0, int64_t n1) { avx512_isa::run_problem(p, n0, n1); }

}  // namespace specrt::linear
SPECRT_TARGET_END
