// bf16 x bf16 on AVX512-BF16: vdpbf16ps (two bf16 products per fp32 lane per
// instruction, the order linear_kernel.h fixes). Other weight formats go to the
// AVX-512 path. Compiled in a SPECRT_ISA_AVX512_BF16 region; called after a run-time check.
#include <immintrin.h>

#include "cpu/linear_kernel.h"
#include "cpu/simd_target.h"

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX512_BF16)
namespace specrt::linear {
namespace avx512bf16_isa {
namespace {

constexpr int kNR = 4;
constexpr int kMR = 6;

using V = __m512;
using BV = __m512bh;

inline V vzero() { return _mm512_setzero_ps(); }
inline float vreduce(V a) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline BV load_bv(const uint16_t* p) { return reinterpret_cast<BV>(_mm512_loadu_si512(p)); }
inline BV load_bv_n(const uint16_t* p, int n) {
  return reinterpret_cast<BV>(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1ull), p));
}
inline V vdp(V acc, BV w, BV x) { return _mm512_dpbf16_ps(acc, w, x); }

// Only the bf16-dot tiles of linear_tiles.h are used here.
#define SPECRT_LINEAR_DOT_ONLY
#include "cpu/linear_tiles.h"
#undef SPECRT_LINEAR_DOT_ONLY

}  // namespace
}  // namespace avx512bf16_isa

void linear_rows_avx512bf16(const Problem& p, int64_t n0, int64_t n1) {
  if (p.x_bf16)
    avx512bf16_isa::run_dot(p, n0, n1);
  else
    linear_rows_avx512(p, n0, n1);
}

}  // namespace specrt::linear
SPECRT_TARGET_END
