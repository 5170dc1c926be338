// The int8-activation mode of the small-M linear kernel on AVX2 (CPUs without AVX-512 VNNI, e.g.
// AMD Zen 2/3), in the order linear_dynamic.h fixes. A 16-lane super-block is taken as two 8-lane
// halves (one ymm each); a row's half is finished for every super-block before the other half, so
// only 8 lanes of accumulators per x row are live. Integer dot products without VNNI:
//   q4: vpmaddubsw(nibble, xq) pairs (|.| <= 2*15*127), 8 steps summed in int16 (<= 30,480), then one
//       vpmaddwd by ones; int8 / q8_0: vpmaddubsw(|w|, sign(xq, w)) (|.| <= 2*128*127, exact for
//       w = -128 too), widened with vpmaddwd per step.
// Both give P_g exactly, so the bits equal the portable and VNNI paths'. Compiled in a
// SPECRT_ISA_AVX2 region (simd_target.h) and only called after a run-time CPU check.
#include <immintrin.h>

#include <cstring>
#include <utility>

#include "cpu/linear_dynamic.h"
#include "cpu/simd_target.h"

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX2)
namespace specrt::linear {
namespace {

#include "cpu/linear_dynamic_tiles.h"  // is_q4, store, run_kind

constexpr int64_t kAhead = 16384;  // software prefetch distance in each weight row's stream

// The fixed tree of linear_kernel.h on lanes 0-7 (a) and 8-15 (b).
inline float tree(__m256 a, __m256 b) {
  const __m256 s8 = _mm256_add_ps(a, b);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// 8 fp16 values as floats; nh < 8: the first nh, the rest 0 (never read past the row).
inline __m256 load_h8(const uint16_t* src, int nh) {
  if (nh == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  // nh / 2 whole dwords by a masked load, an odd last value blended in (a copy through a stack
  // buffer would stall store forwarding)
  __m128i h = _mm_maskload_epi32(reinterpret_cast<const int*>(src),
                                 _mm_cmpgt_epi32(_mm_set1_epi32(nh / 2), _mm_setr_epi32(0, 1, 2, 3)));
  if (nh & 1) {
    const __m128i at = _mm_cmpeq_epi16(_mm_set1_epi16(static_cast<int16_t>(nh - 1)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
    h = _mm_or_si128(h, _mm_and_si128(at, _mm_set1_epi16(static_cast<int16_t>(src[nh - 1]))));
  }
  return _mm256_cvtph_ps(h);
}

// Half h of super-block s for NR weight rows x MR x rows: acc[r][i] += its 8 lanes' terms.
template <WeightKind kKind, int NR, int MR>
inline void half_block(const DynProblem& p, int64_t n, int64_t m0, int64_t s, int h, __m256 (&acc)[NR][MR]) {
  constexpr int B = is_q4(kKind) ? 16 : 32, kSteps = B / 4;
  constexpr bool kInt8 = kKind == WeightKind::kInt8, kQ41 = kKind == WeightKind::kQ4_1;
  const int64_t G = p.G, lanes = p.S * kSuper, lane0 = s * kSuper + 8 * h;
  const int ng = static_cast<int>(G - s * kSuper < kSuper ? G - s * kSuper : kSuper);
  const int nh = ng - 8 * h < 8 ? ng - 8 * h : 8;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nh), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const uint16_t* d = static_cast<const uint16_t*>(p.scales);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const uint8_t* src = static_cast<const uint8_t*>(p.w) + (n + r) * G * B + s * kSuper * B;
    __m256i raw[kSteps];
    if (ng == kSuper) {
      if (h == 0)
        for (int t = 0; t < kSteps; ++t) __builtin_prefetch(src + kAhead + 64 * t, 0, 2);
      for (int t = 0; t < kSteps; ++t) raw[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * t + 32 * h));
    } else {  // a short last super-block: ng lanes per step, stored compactly
      for (int t = 0; t < kSteps; ++t)
        raw[t] = _mm256_maskload_epi32(reinterpret_cast<const int*>(src + 4 * ng * t + 32 * h), mask);
    }
    __m256i w[8];  // the operand paired with x step j
    if constexpr (is_q4(kKind)) {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      for (int t = 0; t < 4; ++t) {
        w[t] = _mm256_and_si256(raw[t], low4);
        w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(raw[t], 4), low4);
      }
    } else {
      for (int t = 0; t < 8; ++t) w[t] = _mm256_abs_epi8(raw[t]);  // |-128| = 128 as u8
    }
    __m256 dw = _mm256_setzero_ps(), mw = _mm256_setzero_ps();
    if constexpr (!kInt8) dw = load_h8(d + (n + r) * G + lane0, nh);
    if constexpr (kQ41) mw = load_h8(p.mins + (n + r) * G + lane0, nh);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int64_t row = (m0 + i) * lanes + lane0;  // this half's first lane in row m0 + i
      const int8_t* xs = p.xq + (row - 8 * h) * 32 + 32 * h;
      __m256i P;
      if constexpr (is_q4(kKind)) {
        __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));
#pragma GCC unroll 8
        for (int j = 1; j < 8; ++j)
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 64 * j))));
        P = _mm256_madd_epi16(s16, ones);
        if constexpr (kKind == WeightKind::kQ4_0)
          P = _mm256_add_epi32(P, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.corr + row)));
      } else {
        P = _mm256_setzero_si256();  // sum w * xq directly (no +128 offset to undo)
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 64 * j));
          P = _mm256_add_epi32(P, _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], _mm256_sign_epi8(xv, raw[j])), ones));
        }
      }
      const __m256 dx = _mm256_loadu_ps(p.dx + row);
      const __m256 sc = kInt8 ? dx : _mm256_mul_ps(dw, dx);
      acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), sc, acc[r][i]);
      if constexpr (kQ41) acc[r][i] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(p.e + row), acc[r][i]);
    }
  }
}

// The compact tail (linear_dynamic.h; n <= 8 blocks: lanes 0-7 only) of NR weight rows x MR x rows.
template <WeightKind kKind, int NR, int MR, int n2>
inline void tail_block(const DynProblem& p, int64_t n, int64_t m0, __m256 (&acc)[NR][MR]) {
  constexpr int B = is_q4(kKind) ? 16 : 32, kSteps = B / 4;
  constexpr bool kInt8 = kKind == WeightKind::kInt8, kQ41 = kKind == WeightKind::kQ4_1;
  constexpr int sh = __builtin_ctz(n2), nv = (kSteps * n2 + 7) / 8;  // 8-lane weight vectors (q4: 1-4, else 1-8)
  const int64_t G = p.G, lanes = p.S * kSuper, lane0 = (p.S - 1) * kSuper;
  const int ng = static_cast<int>(G - lane0);
  const __m256i ones = _mm256_set1_epi16(1), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i blk = _mm256_and_si256(lane, _mm256_set1_epi32(n2 - 1));
  const __m256i idx = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srli_epi32(lane, sh), _mm256_set1_epi32(ng)), blk);
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng), blk);   // block < ng
  const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng), lane);  // lanes 0..ng-1
  const uint16_t* d = static_cast<const uint16_t*>(p.scales);
#pragma GCC unroll 2
  for (int r = 0; r < NR; ++r) {
    const int32_t* src = reinterpret_cast<const int32_t*>(static_cast<const uint8_t*>(p.w) + (n + r) * G * B + lane0 * B);
    __m256i w[8], sw[8];  // q4: low / high nibble operands of vector v at 2 v / 2 v + 1; else |w| and w
#pragma GCC unroll 8
    for (int v = 0; v < nv; ++v) {
      const int t0 = (8 * v) >> sh, avail = (kSteps - t0) * ng;  // dwords left from step t0 on
      const __m256i lm = _mm256_cmpgt_epi32(_mm256_set1_epi32(avail), lane);
      const __m256i raw = _mm256_and_si256(
          keep, _mm256_permutevar8x32_epi32(_mm256_maskload_epi32(src + t0 * ng, lm), idx));
      if constexpr (is_q4(kKind)) {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        w[2 * v] = _mm256_and_si256(raw, low4);  // nv <= 4 for q4
        w[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      } else {
        w[v] = _mm256_abs_epi8(raw);
        sw[v] = raw;
      }
    }
    __m256 dw = _mm256_setzero_ps(), mw = _mm256_setzero_ps();
    if constexpr (!kInt8) dw = load_h8(d + (n + r) * G + lane0, ng);
    if constexpr (kQ41) mw = load_h8(p.mins + (n + r) * G + lane0, ng);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int64_t row = (m0 + i) * lanes + lane0;
      const int8_t* xt = p.xt + (m0 + i) * kTailBytes;
      __m256i P;
      if constexpr (is_q4(kKind)) {  // <= 8 vpmaddubsw terms per int16 lane: <= 30,480
        __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v) {
          const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + 32 * v));
          const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + 128 + 32 * v));
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[2 * v], lo));
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[2 * v + 1], hi));
        }
        P = _mm256_madd_epi16(s16, ones);
      } else {
        P = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int v = 0; v < nv; ++v) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + 32 * v));
          P = _mm256_add_epi32(P, _mm256_madd_epi16(_mm256_maddubs_epi16(w[v], _mm256_sign_epi8(xv, sw[v])), ones));
        }
      }
      // fold lane (i + k) mod 8 into lane i, k = 4 .. n2: lanes 0..n2-1 get their block's sum
      if constexpr (n2 <= 4) P = _mm256_add_epi32(P, _mm256_permutevar8x32_epi32(P, _mm256_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3)));
      if constexpr (n2 <= 2) P = _mm256_add_epi32(P, _mm256_permutevar8x32_epi32(P, _mm256_setr_epi32(2, 3, 4, 5, 6, 7, 0, 1)));
      if constexpr (n2 <= 1) P = _mm256_add_epi32(P, _mm256_permutevar8x32_epi32(P, _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 0)));
      if constexpr (kKind == WeightKind::kQ4_0)
        P = _mm256_add_epi32(P, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.corr + row)));
      P = _mm256_and_si256(P, first);
      const __m256 dx = _mm256_loadu_ps(p.dx + row);
      const __m256 sc = kInt8 ? dx : _mm256_mul_ps(dw, dx);
      acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), sc, acc[r][i]);
      if constexpr (kQ41) acc[r][i] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(p.e + row), acc[r][i]);
    }
  }
}

template <WeightKind kKind, int NR, int MR>
void tile(const DynProblem& p, int64_t n, int64_t m0) {
  const int64_t G = p.G;
  __m256 lo[NR][MR], hi[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) lo[r][i] = hi[r][i] = _mm256_setzero_ps();
  // Lanes past the last block would add fma(0, 0, acc) = acc (acc starts at +0 and no fma can make
  // it -0), so halves with no block are skipped.
  const int64_t full = p.tail ? p.S - 1 : p.S;  // super-blocks on full-width steps
  for (int64_t s = 0; s < full; ++s) half_block<kKind, NR, MR>(p, n, m0, s, 0, lo);
  switch (p.tail) {
    case 1: tail_block<kKind, NR, MR, 1>(p, n, m0, lo); break;
    case 2: tail_block<kKind, NR, MR, 2>(p, n, m0, lo); break;
    case 4: tail_block<kKind, NR, MR, 4>(p, n, m0, lo); break;
    case 8: tail_block<kKind, NR, MR, 8>(p, n, m0, lo); break;
    default: break;
  }
  for (int64_t s = 0; s < p.S; ++s)
    if (G - s * kSuper > 8) half_block<kKind, NR, MR>(p, n, m0, s, 1, hi);
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) {
      float y = tree(lo[r][i], hi[r][i]);
      if constexpr (kKind == WeightKind::kInt8) y = static_cast<const float*>(p.scales)[n + r] * y;
      store(p, m0 + i, n + r, y);
    }
}

template <WeightKind kKind, int NR, int MR>
struct Tile {
  static void run(const DynProblem& p, int64_t n, int64_t m0) { tile<kKind, NR, MR>(p, n, m0); }
};

}  // namespace

// The same IEEE operations as quantize_activations (linear_dynamic_scalar.cpp), 8 lanes at a time.
void quantize_activations_avx2(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1) {
  const int64_t G = p.G, lanes = p.S * kSuper;
  const int shift = p.kind == WeightKind::kQ4_0 ? 3 : 7;  // corr = -(S << shift), q4_1: 0
  const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' dwords -> features 4j..4j+3
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    const auto [q, dx, corr, e] = act_row(p, m);
    for (int64_t g = G; g < lanes; ++g) {  // lanes past the last block
      dx[g] = 0.0f;
      corr[g] = 0;
      e[g] = 0.0f;
      for (int j = 0; j < 8; ++j) std::memset(q + (g / kSuper) * 512 + j * 64 + (g % kSuper) * 4, 0, 4);
    }
    for (int64_t g = 0; g < G; ++g) {
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        v[c] = _mm256_loadu_ps(xr + 32 * g + 8 * c);
        amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[c]), amax);  // a NaN |x| yields amax: ignored
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const float d = a / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      __m256i iv[4], isum = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[c], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 ord = _mm256_cmp_ps(r, r, _CMP_ORD_Q);  // NaN -> 0, else clamp to +-127
        iv[c] = _mm256_cvtps_epi32(_mm256_and_ps(ord, _mm256_min_ps(_mm256_max_ps(r, lo), hi)));
        isum = _mm256_add_epi32(isum, iv[c]);
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3])), order);
      alignas(32) int32_t words[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(words), bytes);
      const int64_t s = g / kSuper, l = g - s * kSuper;
      for (int j = 0; j < 8; ++j) std::memcpy(q + s * 512 + j * 64 + 4 * l, &words[j], 4);
      dx[g] = d;
      e[g] = d * static_cast<float>(sum);
      corr[g] = p.kind == WeightKind::kQ4_1 ? 0 : -(sum * (1 << shift));
    }
  }
}

void dynamic_rows_avx2(const DynProblem& p, int64_t n0, int64_t n1) {
  run_kind<Tile, 4, 2>(p, n0, n1);  // x rows 4 per tile; 2 weight rows when M <= 2
}

}  // namespace specrt::linear
SPECRT_TARGET_END
