// The AVX-512 paths of the CPU sampling kernels: the exponential race
// (csrc/cpu/race_simd.h, 16 tokens and 4 Philox blocks per vector) and the
// probs_from_logits row passes (csrc/cpu/probs_simd.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/probs.h"
#include "cpu/race.h"
#include "cpu/simd_target.h"

#if SPECRT_X86_SIMD
SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX512)
namespace specrt {
namespace avx512 {

struct V {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr int64_t kLanes = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static I set1_i(int32_t x) { return _mm512_set1_epi32(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F neg(F a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  }
  static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M ge(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static M le(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  // The lanes of m, packed to the front, stored as a whole vector; returns their count.
  // (Compress to a register, then store: a compressing store to memory is slow on AMD.)
  static int64_t compress_store(float* out, M m, F x) {
    _mm512_storeu_ps(out, _mm512_maskz_compress_ps(m, x));
    return __builtin_popcount(m);
  }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }  // a > b ? a : b, b if either is NaN
  static M and_m(M a, M b) { return static_cast<M>(a & b); }
  static uint32_t bits(M m) { return m; }
  static F select(M m, F if_true, F if_false) { return _mm512_mask_blend_ps(m, if_false, if_true); }
  static I as_int(F x) { return _mm512_castps_si512(x); }
  static F as_float(I x) { return _mm512_castsi512_ps(x); }
  static F cvt(I x) { return _mm512_cvtepi32_ps(x); }
  template <int N>
  static I srli(I x) { return _mm512_srli_epi32(x, N); }
  static I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_i(I a, I b) { return _mm512_or_si512(a, b); }
  static I not_i(I a) { return _mm512_ternarylogic_epi32(a, a, a, 0x55); }
  static I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I cvtt(F x) { return _mm512_cvttps_epi32(x); }
  template <int N>
  static I srai(I x) { return _mm512_srai_epi32(x, N); }
  template <int N>
  static I slli(I x) { return _mm512_slli_epi32(x, N); }
  // 16 double lanes fed 16 floats at a time (probs.h).
  struct Sum16 {
    __m512d lo, hi;
    Sum16() : lo(_mm512_setzero_pd()), hi(_mm512_setzero_pd()) {}  // not implicit: see sampling_avx2.cpp
    void add(const F (&e)[1]) {
      lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e[0])));
      hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e[0], 1)));
    }
    void store(double* lanes) const {
      _mm512_storeu_pd(lanes, lo);
      _mm512_storeu_pd(lanes + 8, hi);
    }
  };
  static I add_one_where(M m, I x) { return _mm512_mask_add_epi32(x, m, x, _mm512_set1_epi32(1)); }
  // Philox: one block per 128-bit lane, words (w0, w1, w2, w3) in order.
  static I block_words(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
    return _mm512_broadcast_i32x4(_mm_set_epi32(static_cast<int>(w3), static_cast<int>(w2), static_cast<int>(w1),
                                                 static_cast<int>(w0)));
  }
  static I counter_base(uint32_t pos_lo, uint32_t pos_hi, uint32_t purpose) {
    const I lane = _mm512_set_epi32(0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0);
    return _mm512_add_epi32(block_words(0u, pos_lo, pos_hi, purpose), lane);
  }
  static I counter_at(I base, uint32_t block) {
    return _mm512_add_epi32(base, _mm512_maskz_set1_epi32(0x1111, static_cast<int>(block)));
  }
  // (c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))
  static I philox_round(I c, I mul, I key) {
    const I product = _mm512_mul_epu32(c, mul);                              // (lo0, hi0, lo1, hi1)
    const I swapped = _mm512_shuffle_epi32(product, _MM_PERM_ENUM(0x1B));     // (hi1, lo1, hi0, lo0)
    return _mm512_ternarylogic_epi32(swapped, _mm512_srli_epi64(c, 32), key, 0x96);
  }
};

#include "cpu/probs_simd.h"
#include "cpu/race_simd.h"

}  // namespace avx512

uint64_t race_avx512(const RaceRow& row, int64_t begin, int64_t end) {
  return avx512::RaceSimd<avx512::V>(row).run(begin, end);
}

void exponential_noise_avx512(const float* u, float* e, int64_t n) {
  avx512::exponential_noise<avx512::V>(u, e, n);
}

double softmax_numerators_avx512(const float* x, int64_t n, float t, float m, float floor, float* out) {
  return avx512::ProbsSimd<avx512::V>::softmax_numerators(x, n, t, m, floor, out);
}

void divide_avx512(float* out, int64_t n, float d) { avx512::ProbsSimd<avx512::V>::divide(out, n, d); }

int64_t collect_range_avx512(const float* x, int64_t n, float lo, float hi, float* out) {
  return avx512::ProbsSimd<avx512::V>::collect_range(x, n, lo, hi, out);
}

int64_t argmax_avx512(const float* x, int64_t n) { return avx512::ProbsSimd<avx512::V>::argmax(x, n); }

double keep_at_least_avx512(float* out, int64_t n, float cut) {
  return avx512::ProbsSimd<avx512::V>::keep_at_least(out, n, cut);
}

}  // namespace specrt
SPECRT_TARGET_END
#else
namespace specrt {
uint64_t race_avx512(const RaceRow& row, int64_t begin, int64_t end) { return race_scalar(row, begin, end); }
void exponential_noise_avx512(const float* u, float* e, int64_t n) { exponential_noise(CpuIsa::kScalar, u, e, n); }
double softmax_numerators_avx512(const float* x, int64_t n, float t, float m, float floor, float* out) {
  return softmax_numerators_scalar(x, n, t, m, floor, out);
}
void divide_avx512(float* out, int64_t n, float d) { divide_scalar(out, n, d); }
int64_t collect_range_avx512(const float* x, int64_t n, float lo, float hi, float* out) {
  return collect_range_scalar(x, n, lo, hi, out);
}
int64_t argmax_avx512(const float* x, int64_t n) { return argmax_scalar(x, n); }
double keep_at_least_avx512(float* out, int64_t n, float cut) { return keep_at_least_scalar(out, n, cut); }
}  // namespace specrt
#endif
