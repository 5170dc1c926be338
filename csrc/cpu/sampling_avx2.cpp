// The AVX2 paths of the CPU sampling kernels: the exponential race
// (csrc/cpu/race_simd.h, 8 tokens and 2 Philox blocks per vector) and the
// probs_from_logits row passes (csrc/cpu/probs_simd.h).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "cpu/probs.h"
#include "cpu/race.h"
#include "cpu/simd_target.h"

#if SPECRT_X86_SIMD
SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX2)
namespace specrt {
namespace avx2 {

// kCompress[m] lists the set lanes of the 8-bit mask m first (for compress_store).
constexpr std::array<std::array<int32_t, 8>, 256> make_compress_table() {
  std::array<std::array<int32_t, 8>, 256> table{};
  for (int m = 0; m < 256; ++m) {
    int next = 0;
    for (int lane = 0; lane < 8; ++lane)
      if (m & (1 << lane)) table[m][next++] = lane;
  }
  return table;
}
constexpr auto kCompress = make_compress_table();

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
  static M eq(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static M le(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  // The lanes of m, packed to the front (a permutation from kCompress), stored
  // as a whole vector; returns their count.
  static int64_t compress_store(float* out, M m, F x) {
    const uint32_t lanes = bits(m);
    const __m256i order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kCompress[lanes].data()));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(x, order));
    return __builtin_popcount(lanes);
  }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }  // a > b ? a : b, b if either is NaN
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
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I cvtt(F x) { return _mm256_cvttps_epi32(x); }
  template <int N>
  static I srai(I x) { return _mm256_srai_epi32(x, N); }
  template <int N>
  static I slli(I x) { return _mm256_slli_epi32(x, N); }
  // 16 double lanes fed 16 floats (two vectors) at a time (probs.h).
  struct Sum16 {
    __m256d acc[4];
    Sum16() {  // written out: an implicit constructor would miss the target region
      for (__m256d& a : acc) a = _mm256_setzero_pd();
    }
    void add(const F (&e)[2]) {
      for (int r = 0; r < 2; ++r) {
        acc[2 * r] = _mm256_add_pd(acc[2 * r], _mm256_cvtps_pd(_mm256_castps256_ps128(e[r])));
        acc[2 * r + 1] = _mm256_add_pd(acc[2 * r + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(e[r], 1)));
      }
    }
    void store(double* lanes) const {
      for (int j = 0; j < 4; ++j) _mm256_storeu_pd(lanes + 4 * j, acc[j]);
    }
  };
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

#include "cpu/probs_simd.h"
#include "cpu/race_simd.h"

}  // namespace avx2

uint64_t race_avx2(const RaceRow& row, int64_t begin, int64_t end) {
  return avx2::RaceSimd<avx2::V>(row).run(begin, end);
}

void exponential_noise_avx2(const float* u, float* e, int64_t n) {
  avx2::exponential_noise<avx2::V>(u, e, n);
}

double softmax_numerators_avx2(const float* x, int64_t n, float t, float m, float floor, float* out) {
  return avx2::ProbsSimd<avx2::V>::softmax_numerators(x, n, t, m, floor, out);
}

void divide_avx2(float* out, int64_t n, float d) { avx2::ProbsSimd<avx2::V>::divide(out, n, d); }

int64_t collect_range_avx2(const float* x, int64_t n, float lo, float hi, float* out) {
  return avx2::ProbsSimd<avx2::V>::collect_range(x, n, lo, hi, out);
}

int64_t argmax_avx2(const float* x, int64_t n) { return avx2::ProbsSimd<avx2::V>::argmax(x, n); }

double keep_at_least_avx2(float* out, int64_t n, float cut) {
  return avx2::ProbsSimd<avx2::V>::keep_at_least(out, n, cut);
}

}  // namespace specrt
SPECRT_TARGET_END
#else
namespace specrt {
uint64_t race_avx2(const RaceRow& row, int64_t begin, int64_t end) { return race_scalar(row, begin, end); }
void exponential_noise_avx2(const float* u, float* e, int64_t n) { exponential_noise(CpuIsa::kScalar, u, e, n); }
double softmax_numerators_avx2(const float* x, int64_t n, float t, float m, float floor, float* out) {
  return softmax_numerators_scalar(x, n, t, m, floor, out);
}
void divide_avx2(float* out, int64_t n, float d) { divide_scalar(out, n, d); }
int64_t collect_range_avx2(const float* x, int64_t n, float lo, float hi, float* out) {
  return collect_range_scalar(x, n, lo, hi, out);
}
int64_t argmax_avx2(const float* x, int64_t n) { return argmax_scalar(x, n); }
double keep_at_least_avx2(float* out, int64_t n, float cut) { return keep_at_least_scalar(out, n, cut); }
}  // namespace specrt
#endif
