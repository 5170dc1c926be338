// The int8-activation mode of the small-M linear kernel on AVX-512 + VNNI (vpdpbusd: 64
// u8 x s8 products per instruction), in the order linear_dynamic.h fixes. Tiles of 4
// weight rows x up to 3 x rows: each weight tile is unpacked once per 3 rows. Compiled
// with those ISA flags and only called after a run-time CPU check.
#include <immintrin.h>

#include "cpu/linear_dynamic.h"

namespace specrt::linear {
namespace {

constexpr int kNR = 4, kMR = 5;
// software prefetch in each weight row's stream: far ahead into L2, near ahead from L2 into L1
constexpr int64_t kAhead = 16384, kNear = 1024;

inline float tree(__m512 a) {  // the fixed tree of linear_kernel.h
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline void store(const DynProblem& p, int64_t m, int64_t n, float y) {
  if (p.bias) y = y + p.bias[n];
  if (!p.y_bf16) {
    static_cast<float*>(p.y)[m * p.N + n] = y;
    return;
  }
  uint32_t u;
  __builtin_memcpy(&u, &y, 4);
  static_cast<uint16_t*>(p.y)[m * p.N + n] =
      y != y ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <WeightKind kKind, int NR, int MR>
void tile(const DynProblem& p, int64_t n, int64_t m0) {
  constexpr bool kQ4 = kKind == WeightKind::kQ4_0 || kKind == WeightKind::kQ4_1;
  const int64_t K = p.K, G = K / kGroup, row = p.pairs * 64, lanes = p.pairs * 16;
  const uint16_t* d = static_cast<const uint16_t*>(p.scales);
  const __m512i order = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int ng = static_cast<int>(G - g0 < 16 ? G - g0 : 16);
    __m512 dw[NR];
    if constexpr (kKind != WeightKind::kInt8)
      for (int r = 0; r < NR; ++r)
        dw[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << ng) - 1u), d + (n + r) * G + g0));
    for (int pp = 0; 2 * pp < ng; ++pp) {
      const int64_t pr = g0 / 2 + pp;
      const bool half = 2 * pp + 1 >= ng;  // the pair's second block is past K
      __m512i w[NR];
      __mmask64 neg[NR];
      __m512 dv[NR];
      for (int r = 0; r < NR; ++r) {
        if constexpr (kQ4) {
          const uint8_t* src = static_cast<const uint8_t*>(p.w) + (n + r) * (K / 2) + 32 * pr;
          __builtin_prefetch(src + kAhead, 0, 2);
          __builtin_prefetch(src + kNear, 0, 3);
          const __m256i v = half ? _mm256_maskz_loadu_epi8(0xFFFFu, src)
                                 : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
          const __m512i v2 = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
          w[r] = _mm512_permutexvar_epi64(order, v2);  // [block 2p lo | hi | block 2p+1 lo | hi]
        } else {
          const int8_t* src = static_cast<const int8_t*>(p.w) + (n + r) * K + 64 * pr;
          __builtin_prefetch(src + kAhead, 0, 2);
          __builtin_prefetch(src + kNear, 0, 3);
          const __m512i raw = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, src) : _mm512_loadu_si512(src);
          neg[r] = _mm512_movepi8_mask(raw);
          w[r] = _mm512_abs_epi8(raw);  // |w| as u8 (-128 -> 128), its sign moves onto x
        }
        if constexpr (kKind != WeightKind::kInt8) {
          const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(2 * pp),
                                               _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
          dv[r] = _mm512_permutexvar_ps(idx, dw[r]);
        }
      }
      for (int i = 0; i < MR; ++i) {
        const __m512i xq = _mm512_loadu_si512(p.xq + (m0 + i) * row + 64 * pr);
        const __m512 dx = _mm512_loadu_ps(p.dx16 + (m0 + i) * lanes + 16 * pr);
        __m512i s8 = _mm512_setzero_si512();
        if constexpr (kKind == WeightKind::kQ4_0) s8 = _mm512_loadu_si512(p.sx8 + (m0 + i) * lanes + 16 * pr);
        for (int r = 0; r < NR; ++r) {
          __m512i P;
          if constexpr (kQ4) {
            P = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xq);
          } else {
            const __m512i xs = _mm512_mask_sub_epi8(xq, neg[r], _mm512_setzero_si512(), xq);
            P = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xs);
          }
          if constexpr (kKind == WeightKind::kQ4_0) P = _mm512_sub_epi32(P, s8);
          const __m512 s = kKind == WeightKind::kInt8 ? dx : _mm512_mul_ps(dv[r], dx);
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), s, acc[r][i]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int i = 0; i < MR; ++i) {
      float y = tree(acc[r][i]);
      if constexpr (kKind == WeightKind::kQ4_1) {
        __m512 macc = _mm512_setzero_ps();
        for (int64_t g0 = 0; g0 < G; g0 += 16) {
          const __mmask16 mk = static_cast<__mmask16>((1u << (G - g0 < 16 ? G - g0 : 16)) - 1u);
          macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, p.mins + (n + r) * G + g0)),
                                 _mm512_maskz_loadu_ps(mk, p.e + (m0 + i) * G + g0), macc);
        }
        y = y + tree(macc);
      } else if constexpr (kKind == WeightKind::kInt8) {
        y = static_cast<const float*>(p.scales)[n + r] * y;
      }
      store(p, m0 + i, n + r, y);
    }
  }
}

template <WeightKind kKind, int NR>
void tiles(const DynProblem& p, int64_t n) {
  int64_t m = 0;
  for (; m + kMR <= p.M; m += kMR) tile<kKind, NR, kMR>(p, n, m);
  switch (p.M - m) {
    case 4: tile<kKind, NR, 4>(p, n, m); break;
    case 3: tile<kKind, NR, 3>(p, n, m); break;
    case 2: tile<kKind, NR, 2>(p, n, m); break;
    case 1: tile<kKind, NR, 1>(p, n, m); break;
    default: break;
  }
}

template <WeightKind kKind>
void run(const DynProblem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kNR <= n1; n += kNR) tiles<kKind, kNR>(p, n);
  for (; n < n1; ++n) tiles<kKind, 1>(p, n);
}

}  // namespace

// The same IEEE operations as quantize_activations (linear_dynamic_scalar.cpp), 16 lanes at a time.
void quantize_activations_avx512(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1) {
  const int64_t G = p.K / kGroup;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    const auto [q, dx16, sx8, e] = act_row(p, m);
    if (G % 2) {  // the missing block of the last pair
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * G), _mm256_setzero_si256());  // 32 bytes past K
      _mm256_storeu_ps(dx16 + (G / 2) * 16 + 8, _mm256_setzero_ps());
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sx8 + (G / 2) * 16 + 8), _mm256_setzero_si256());
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512 a = _mm512_loadu_ps(xr + 32 * g), b = _mm512_loadu_ps(xr + 32 * g + 16);
      // max |x| over the block, NaNs ignored (as the portable loop does); exact in any order
      const __m512 abs_a = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), _mm512_abs_ps(a));
      const __m512 abs_b = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(b, b, _CMP_ORD_Q), _mm512_abs_ps(b));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
      const float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
      const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
      // rint (to nearest even, the default rounding mode), NaN -> 0, clamp to +-127
      __m512 ra = _mm512_roundscale_ps(_mm512_mul_ps(a, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512 rb = _mm512_roundscale_ps(_mm512_mul_ps(b, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      ra = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ra, ra, _CMP_ORD_Q), _mm512_min_ps(_mm512_max_ps(ra, lo), hi));
      rb = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(rb, rb, _CMP_ORD_Q), _mm512_min_ps(_mm512_max_ps(rb, lo), hi));
      const __m512i ia = _mm512_cvtps_epi32(ra), ib = _mm512_cvtps_epi32(rb);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * g), _mm512_cvtepi32_epi8(ia));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * g + 16), _mm512_cvtepi32_epi8(ib));
      e[g] = dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib)));  // exact int sum
      // 8 * the sums of features 4j..4j+3 (v holds the block's 32 values in order)
      alignas(64) int32_t v[32];
      _mm512_store_si512(v, ia);
      _mm512_store_si512(v + 16, ib);
      const int64_t lane0 = (g / 2) * 16 + (g % 2) * 8;
      for (int j = 0; j < 8; ++j) {
        dx16[lane0 + j] = dx;
        sx8[lane0 + j] = 8 * (v[4 * j] + v[4 * j + 1] + v[4 * j + 2] + v[4 * j + 3]);
      }
    }
  }
}

void dynamic_rows_avx512vnni(const DynProblem& p, int64_t n0, int64_t n1) {
  switch (p.kind) {
    case WeightKind::kInt8: run<WeightKind::kInt8>(p, n0, n1); break;
    case WeightKind::kQ8_0: run<WeightKind::kQ8_0>(p, n0, n1); break;
    case WeightKind::kQ4_0: run<WeightKind::kQ4_0>(p, n0, n1); break;
    case WeightKind::kQ4_1: run<WeightKind::kQ4_1>(p, n0, n1); break;
    default: break;
  }
}

}  // namespace specrt::linear
