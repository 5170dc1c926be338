// The exponential race with AVX2 (csrc/cpu/race_simd.h): 8 tokens per
// vector, 2 Philox blocks per vector.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/race.h"
#include "cpu/simd_target.h"

#if SPECRT_X86_SIMD
SPECRT_TARGET_AVX2_BEGIN
namespace specrt {
namespace avx2 {

struct V {
  using F = __m256;
  using I = __m256i;
  using M = __m256;  // all-ones / all-zeros lanes
  static constexpr int64_t kLanes = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static I set1_i(int32_t x) { return _mm256_set1_epi32(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F neg(F a) { return _mm256_xor_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))); }
  static M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static M ge(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  static M and_m(M a, M b) { return _mm256_and_ps(a, b); }
  static uint32_t bits(M m) { return static_cast<uint32_t>(_mm256_movemask_ps(m)); }
  static F select(M m, F if_true, F if_false) { return _mm256_blendv_ps(if_false, if_true, m); }
  static I as_int(F x) { return _mm256_castps_si256(x); }
  static F as_float(I x) { return _mm256_castsi256_ps(x); }
  static F cvt(I x) { return _mm256_cvtepi32_ps(x); }
  template <int N>
  static I srli(I x) { return _mm256_srli_epi32(x, N); }
  static I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_i(I a, I b) { return _mm256_or_si256(a, b); }
  static I not_i(I a) { return _mm256_xor_si256(a, _mm256_set1_epi32(-1)); }
  static I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I add_one_where(M m, I x) { return _mm256_sub_epi32(x, _mm256_castps_si256(m)); }  // m lanes are -1
  static I block_words(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
    return _mm256_broadcastsi128_si256(_mm_set_epi32(static_cast<int>(w3), static_cast<int>(w2), static_cast<int>(w1),
                                                     static_cast<int>(w0)));
  }
  static I counter_base(uint32_t pos_lo, uint32_t pos_hi, uint32_t purpose) {
    return _mm256_add_epi32(block_words(0u, pos_lo, pos_hi, purpose), _mm256_set_epi32(0, 0, 0, 1, 0, 0, 0, 0));
  }
  static I counter_at(I base, uint32_t block) {
    const int b = static_cast<int>(block);
    return _mm256_add_epi32(base, _mm256_set_epi32(0, 0, 0, b, 0, 0, 0, b));
  }
  static I philox_round(I c, I mul, I key) {
    const I product = _mm256_mul_epu32(c, mul);             // (lo0, hi0, lo1, hi1)
    const I swapped = _mm256_shuffle_epi32(product, 0x1B);  // (hi1, lo1, hi0, lo0)
    return _mm256_xor_si256(_mm256_xor_si256(swapped, _mm256_srli_epi64(c, 32)), key);
  }
};

#include "cpu/race_simd.h"

}  // namespace avx2

uint64_t race_avx2(const RaceRow& row, int64_t begin, int64_t end) {
  return avx2::RaceSimd<avx2::V>(row).run(begin, end);
}

void exponential_noise_avx2(const float* u, float* e, int64_t n) {
  avx2::exponential_noise<avx2::V>(u, e, n);
}

}  // namespace specrt
SPECRT_TARGET_END
#else
namespace specrt {
uint64_t race_avx2(const RaceRow& row, int64_t begin, int64_t end) { return race_scalar(row, begin, end); }
void exponential_noise_avx2(const float* u, float* e, int64_t n) { exponential_noise(CpuIsa::kScalar, u, e, n); }
}  // namespace specrt
#endif
