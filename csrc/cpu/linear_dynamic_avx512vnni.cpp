// The int8-activation mode of the small-M linear kernel on AVX-512 + VNNI, in the order
// linear_dynamic.h fixes: lane l of a 16-lane vector owns block 16 s + l of super-block s, so 8
// vpdpbusd (4 bytes per lane each) fill the 32 products of 16 blocks in int32 before one convert
// and one or two FMAs per lane-block. A weight row's super-block (interleaved at load) is unpacked
// once into 8 registers and used by every x row of the tile. Compiled in a SPECRT_ISA_AVX512_VNNI
// region (simd_target.h) and only called after a run-time CPU check.
#include <immintrin.h>

#include <utility>

#include "cpu/linear_dynamic.h"
#include "cpu/simd_target.h"

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX512_VNNI)
namespace specrt::linear {
namespace {

#include "cpu/linear_dynamic_tiles.h"  // is_q4, store, run_kind

// software prefetch in each weight row's stream: far ahead into L2, near ahead from L2 into L1
constexpr int64_t kAhead = 16384, kNear = 1024;

inline float tree(__m512 a) {  // the fixed tree of linear_kernel.h
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// The 8 unsigned weight operands of super-block s of one row (step j pairs with x step j); ng
// blocks, the rest of the lanes zero.
template <WeightKind kKind>
inline void unpack(const uint8_t* src, int ng, __m512i (&w)[8]) {
  constexpr int kSteps = is_q4(kKind) ? 4 : 8;
  const __mmask16 mk = static_cast<__mmask16>((1u << ng) - 1u);
  for (int t = 0; t < kSteps; ++t) {
    __builtin_prefetch(src + kAhead + 64 * t, 0, 2);
    __builtin_prefetch(src + kNear + 64 * t, 0, 3);
  }
  __m512i raw[kSteps];
  if (ng == kSuper) {
    for (int t = 0; t < kSteps; ++t) raw[t] = _mm512_loadu_si512(src + 64 * t);
  } else {
    for (int t = 0; t < kSteps; ++t) raw[t] = _mm512_maskz_loadu_epi32(mk, src + 4 * ng * t);
  }
  if constexpr (is_q4(kKind)) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      w[t] = _mm512_and_si512(raw[t], low4);
      w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw[t], 4), low4);
    }
  } else {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));  // w + 128 as u8
    for (int t = 0; t < 8; ++t) w[t] = _mm512_xor_si512(raw[t], bias);
  }
}

// The compact tail (linear_dynamic.h) of NR weight rows x MR x rows: acc[r][i] += its lanes' terms.
template <WeightKind kKind, int NR, int MR, int n2>
inline void tail_block(const DynProblem& p, int64_t n, int64_t m0, __m512 (&acc)[NR][MR]) {
  constexpr int B = is_q4(kKind) ? 16 : 32, kSteps = B / 4;
  constexpr bool kInt8 = kKind == WeightKind::kInt8, kQ41 = kKind == WeightKind::kQ4_1;
  constexpr int sh = __builtin_ctz(n2), nv = (kSteps * n2 + 15) / 16;  // weight vectors (q4: 1-2, else 1-4)
  const int64_t G = p.G, lanes = p.S * kSuper, lane0 = (p.S - 1) * kSuper, rowb = G * B;
  const int ng = static_cast<int>(G - lane0);
  const __mmask16 mk = static_cast<__mmask16>((1u << ng) - 1u);
  // lane i of every vector: step (i >> sh) of the vector's first, block i & (n2 - 1), kept if < ng
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i blk = _mm512_and_si512(lane, _mm512_set1_epi32(n2 - 1));
  const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(lane, sh), _mm512_set1_epi32(ng)), blk);
  const __mmask16 keep = _mm512_cmplt_epi32_mask(blk, _mm512_set1_epi32(ng));
  const uint16_t* d = static_cast<const uint16_t*>(p.scales);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const int32_t* src = reinterpret_cast<const int32_t*>(static_cast<const uint8_t*>(p.w) + (n + r) * rowb + lane0 * B);
    __m512i w[8];  // q4: low / high nibble operands of vector v at 2 v / 2 v + 1
#pragma GCC unroll 4
    for (int v = 0; v < nv; ++v) {
      const int t0 = (16 * v) >> sh, avail = (kSteps - t0) * ng;  // dwords left from step t0 on
      const __mmask16 lm = static_cast<__mmask16>(avail >= 16 ? 0xFFFFu : (1u << avail) - 1u);
      const __m512i raw = _mm512_maskz_permutexvar_epi32(keep, idx, _mm512_maskz_loadu_epi32(lm, src + t0 * ng));
      if constexpr (is_q4(kKind)) {
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        w[2 * v] = _mm512_and_si512(raw, low4);
        w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      } else {
        w[v] = _mm512_xor_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80)));  // pads meet x = 0
      }
    }
    __m512 dw = _mm512_setzero_ps(), mw = _mm512_setzero_ps();
    if constexpr (!kInt8) dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, d + (n + r) * G + lane0));
    if constexpr (kQ41) mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, p.mins + (n + r) * G + lane0));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int64_t row = (m0 + i) * lanes + lane0;
      const int8_t* xt = p.xt + (m0 + i) * kTailBytes;
      __m512i P = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int v = 0; v < nv; ++v) {
        if constexpr (is_q4(kKind)) {
          P = _mm512_dpbusd_epi32(P, w[2 * v], _mm512_loadu_si512(xt + 64 * v));
          P = _mm512_dpbusd_epi32(P, w[2 * v + 1], _mm512_loadu_si512(xt + 128 + 64 * v));
        } else {
          P = _mm512_dpbusd_epi32(P, w[v], _mm512_loadu_si512(xt + 64 * v));
        }
      }
      const __m512i zero = _mm512_setzero_si512();  // fold lane i + k into lane i down to n2 lanes
      if constexpr (n2 <= 8) P = _mm512_add_epi32(P, _mm512_alignr_epi32(zero, P, 8));
      if constexpr (n2 <= 4) P = _mm512_add_epi32(P, _mm512_alignr_epi32(zero, P, 4));
      if constexpr (n2 <= 2) P = _mm512_add_epi32(P, _mm512_alignr_epi32(zero, P, 2));
      if constexpr (n2 <= 1) P = _mm512_add_epi32(P, _mm512_alignr_epi32(zero, P, 1));
      if constexpr (!kQ41) P = _mm512_add_epi32(P, _mm512_maskz_loadu_epi32(mk, p.corr + row));
      P = _mm512_maskz_mov_epi32(mk, P);
      const __m512 dx = _mm512_loadu_ps(p.dx + row);
      const __m512 sc = kInt8 ? dx : _mm512_mul_ps(dw, dx);
      acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), sc, acc[r][i]);
      if constexpr (kQ41) acc[r][i] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(p.e + row), acc[r][i]);
    }
  }
}

template <WeightKind kKind, int NR, int MR>
void tile(const DynProblem& p, int64_t n, int64_t m0) {
  constexpr int B = is_q4(kKind) ? 16 : 32;
  constexpr bool kInt8 = kKind == WeightKind::kInt8, kQ41 = kKind == WeightKind::kQ4_1;
  const int64_t G = p.G, lanes = p.S * kSuper, rowb = G * B;
  const uint16_t* d = static_cast<const uint16_t*>(p.scales);
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t full = p.tail ? p.S - 1 : p.S;  // super-blocks on full-width steps
  for (int64_t s = 0; s < full; ++s) {
    const int ng = static_cast<int>(G - s * kSuper < kSuper ? G - s * kSuper : kSuper);
    const __mmask16 mk = static_cast<__mmask16>((1u << ng) - 1u);
    const int64_t lane0 = s * kSuper;
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m512i w[8];
      unpack<kKind>(static_cast<const uint8_t*>(p.w) + (n + r) * rowb + s * kSuper * B, ng, w);
      __m512 dw = _mm512_setzero_ps(), mw = _mm512_setzero_ps();
      if constexpr (!kInt8) dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, d + (n + r) * G + lane0));
      if constexpr (kQ41) mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, p.mins + (n + r) * G + lane0));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int64_t row = (m0 + i) * lanes + lane0;
        const int8_t* xs = p.xq + row * 32;
        asm("" : "+r"(xs));  // one base register per row, steps as displacements (not 8 induction pointers)
        // two dependency chains of 4 vpdpbusd (exact int sums: any grouping gives P_g)
        __m512i P = kQ41 ? _mm512_setzero_si512() : _mm512_loadu_si512(p.corr + row), P1 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
          P = _mm512_dpbusd_epi32(P, w[j], _mm512_loadu_si512(xs + 64 * j));
          P1 = _mm512_dpbusd_epi32(P1, w[j + 1], _mm512_loadu_si512(xs + 64 * j + 64));
        }
        P = _mm512_add_epi32(P, P1);
        const __m512 dx = _mm512_loadu_ps(p.dx + row);
        const __m512 sc = kInt8 ? dx : _mm512_mul_ps(dw, dx);
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), sc, acc[r][i]);
        if constexpr (kQ41) acc[r][i] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(p.e + row), acc[r][i]);
      }
    }
  }
  switch (p.tail) {
    case 1: tail_block<kKind, NR, MR, 1>(p, n, m0, acc); break;
    case 2: tail_block<kKind, NR, MR, 2>(p, n, m0, acc); break;
    case 4: tail_block<kKind, NR, MR, 4>(p, n, m0, acc); break;
    case 8: tail_block<kKind, NR, MR, 8>(p, n, m0, acc); break;
    default: break;
  }
  for (int r = 0; r < NR; ++r) {
    for (int i = 0; i < MR; ++i) {
      float y = tree(acc[r][i]);
      if constexpr (kInt8) y = static_cast<const float*>(p.scales)[n + r] * y;
      store(p, m0 + i, n + r, y);
    }
  }
}

template <WeightKind kKind, int NR, int MR>
struct Tile {
  static void run(const DynProblem& p, int64_t n, int64_t m0) { tile<kKind, NR, MR>(p, n, m0); }
};

}  // namespace

// The same IEEE operations as quantize_activations (linear_dynamic_scalar.cpp), 16 lanes at a time.
void quantize_activations_avx512(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1) {
  const int64_t G = p.G, lanes = p.S * kSuper;
  const int shift = p.kind == WeightKind::kQ4_0 ? 3 : 7;  // corr = -(S << shift), q4_1: 0
  const __m512i steps = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 0, 0, 0, 0, 0, 0, 0, 0);  // dword index of step j
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    const auto [q, dx, corr, e] = act_row(p, m);
    if (G < lanes) {  // lanes past the last block: zero
      const int64_t s = G / kSuper;
      const __mmask16 pad = static_cast<__mmask16>(~((1u << (G - s * kSuper)) - 1u));
      for (int j = 0; j < 8; ++j) _mm512_mask_storeu_epi32(q + s * 512 + 64 * j, pad, _mm512_setzero_si512());
      _mm512_mask_storeu_ps(dx + s * kSuper, pad, _mm512_setzero_ps());
      _mm512_mask_storeu_epi32(corr + s * kSuper, pad, _mm512_setzero_si512());
      _mm512_mask_storeu_ps(e + s * kSuper, pad, _mm512_setzero_ps());
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512 a = _mm512_loadu_ps(xr + 32 * g), b = _mm512_loadu_ps(xr + 32 * g + 16);
      // max |x| over the block, NaNs ignored (as the portable loop does); exact in any order
      const __m512 abs_a = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), _mm512_abs_ps(a));
      const __m512 abs_b = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(b, b, _CMP_ORD_Q), _mm512_abs_ps(b));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
      // rint (to nearest even, the default rounding mode), NaN -> 0, clamp to +-127
      __m512 ra = _mm512_roundscale_ps(_mm512_mul_ps(a, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512 rb = _mm512_roundscale_ps(_mm512_mul_ps(b, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      ra = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ra, ra, _CMP_ORD_Q), _mm512_min_ps(_mm512_max_ps(ra, lo), hi));
      rb = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(rb, rb, _CMP_ORD_Q), _mm512_min_ps(_mm512_max_ps(rb, lo), hi));
      const __m512i ia = _mm512_cvtps_epi32(ra), ib = _mm512_cvtps_epi32(rb);
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));  // exact int sum
      // the block's 32 bytes as 8 dwords (features 4j..4j+3), stored 64 bytes apart in its lane
      const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(ia)),
                                                    _mm512_cvtepi32_epi8(ib), 1);
      const int64_t s = g / kSuper, l = g - s * kSuper;
      _mm512_mask_i32scatter_epi32(q + s * 512 + 4 * l, 0xFF, steps, _mm512_castsi256_si512(bytes), 4);
      dx[g] = d;
      e[g] = d * static_cast<float>(sum);
      corr[g] = p.kind == WeightKind::kQ4_1 ? 0 : -(sum * (1 << shift));
    }
  }
}

void dynamic_rows_avx512vnni(const DynProblem& p, int64_t n0, int64_t n1) {
  run_kind<Tile, 5, 4>(p, n0, n1);  // x rows 5 per tile; 4 weight rows when M <= 2
}

}  // namespace specrt::linear
SPECRT_TARGET_END
