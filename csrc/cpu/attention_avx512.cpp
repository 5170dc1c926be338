// The AVX-512 tiles of the CPU paged-attention kernel. The 16-lane (wide) tile puts a group's queries
// along the vector. The narrow tile puts keys (scores: 16 keys x D transposed in registers) or head dims
// (p * v) along the vector instead, so a decode (G = 3 queries per kv head) does not fill 3 of 16 lanes;
// per lane it does the same fmas, maxima, exp2s and sums in the same order as the wide tile, so it
// returns the same bits at a cost proportional to the live lanes. On a bf16 cache it reads K and V in
// place (a bf16 pair per 32-bit element: one transpose per 32 dims). A group of 15-16 lanes on a bf16
// cache (a K=4 verify of 3 heads per kv head) takes the many-lane tile: wide scores and softmax, narrow
// p * v. Compiled in a SPECRT_ISA_AVX512 region (simd_target.h), called only after the driver's run-time CPU
// check.
#include <cstring>

#include "cpu/attention_tile.h"
#include "cpu/simd_target.h"

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX512)
namespace specrt::attn_cpu {
namespace {

// attn::exp2_det on 16 lanes (the same operations, so the same bits).
inline __m512 exp2_avx512(__m512 x) {
  const __m512 round = _mm512_set1_ps(12582912.0f);
  // x < -127 ? -127 : x as one max: VMAXPS returns its second operand when either is NaN
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-127.0f), x);
  const __m512 t = _mm512_add_ps(xc, round);
  const __m512 n = _mm512_sub_ps(t, round);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  // (bits(t) - 0x4B400000 + 127) << 23 with the constants folded (wrapping int arithmetic: the same bits)
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(127 - 0x4B400000)), 23);
  // x < -126 ? 0 : p * 2^n as a zero-masked multiply (not-less-than holds for a NaN x, which stays NaN)
  return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ), p,
                             _mm512_castsi512_ps(bits));
}


// Transpose 16 x 16 32-bit elements held in r (row i in r[i]); column c ends up in out[c].
inline void transpose16(__m512 (&r)[16], __m512 (&out)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (r_i[0], r_i+1[0], r_i[1], r_i+1[1]) / elements 2, 3
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + e]: element e of each 128-bit lane of rows i .. i+3
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int e = 0; e < 4; ++e) {  // gather 128-bit lane L of the four row groups: column 4 L + e
    const __m512 x0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), x1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    out[0 + e] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    out[4 + e] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    out[8 + e] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    out[12 + e] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// Keys j = 0..15 (float rows `stride` apart), dims c .. c+15, as dst[d - c][j] (rows 16 floats apart).
inline void transpose_keys(const float* src, int64_t stride, float* dst) {
  __m512 r[16], out[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * stride);
  transpose16(r, out);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * 16, out[i]);
}

// The same from bf16 rows read in place, dims c .. c+31: 16 pairs of bf16 per 32-bit element, so one
// transpose covers 32 dims; a pair's low half is the even dim (<< 16 makes it a float), the high half
// the odd one (its bits with the low half cleared).
inline void transpose_keys_bf16(const uint16_t* const* rows, int c, float* dst) {
  __m512 r[16], out[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(_mm512_loadu_si512(rows[i] + c));
  transpose16(r, out);
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int p = 0; p < 16; ++p) {
    const __m512i pair = _mm512_castps_si512(out[p]);
    _mm512_storeu_ps(dst + (2 * p) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
    _mm512_storeu_ps(dst + (2 * p + 1) * 16, _mm512_castsi512_ps(_mm512_and_si512(pair, hi)));
  }
}

// Keys 0..15 of a bf16 cache read in place (rows[j]), dims d0 .. d0+15 (8 bf16 pairs per row): o[p] holds
// the 16 keys' pair p. Rows k and k + 4 share a register, so one 128-bit lane shuffle ends each column.
inline void transpose_pairs_16x8(const uint16_t* const* rows, int d0, __m512 (&o)[8]) {
  __m512 r[8], u[8];
  for (int g = 0; g < 2; ++g)
    for (int k = 0; k < 4; ++k) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[8 * g + k] + d0));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[8 * g + k + 4] + d0));
      r[4 * g + k] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
  for (int i = 0; i < 8; i += 2) {  // as transpose16: per 128-bit lane, then 64-bit pairs of elements
    u[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    u[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[i]), _mm512_castps_pd(u[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[i]), _mm512_castps_pd(u[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[i + 1]), _mm512_castps_pd(u[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[i + 1]), _mm512_castps_pd(u[i + 3])));
  }
  for (int e = 0; e < 4; ++e) {  // r[e] lanes: rows 0-3 / 4-7, columns e (lanes 0, 1) and 4 + e (2, 3)
    o[e] = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    o[4 + e] = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
  }
}

// acc[i][c .. c+CH) = acc * alpha_i, then += p_i[j] * v_j in key order (CH 16-float chunks of D; V from
// the float tile).
template <int NL, int CH>
inline void pv_narrow(const Tile& t, const float (*p)[kTileKeys], const float* alpha, int D, int c,
                                    float* acc) {
  __m512 o[NL][CH];
  for (int i = 0; i < NL; ++i)
    for (int x = 0; x < CH; ++x)
      o[i][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * (c + x)), _mm512_set1_ps(alpha[i]));
  for (int j = 0; j < t.n; ++j) {
    const float* vj = t.v + j * t.stride + 16 * c;
    for (int x = 0; x < CH; ++x) {
      const __m512 v = _mm512_loadu_ps(vj + 16 * x);
      for (int i = 0; i < NL; ++i) o[i][x] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][j]), v, o[i][x]);
    }
  }
  for (int i = 0; i < NL; ++i)
    for (int x = 0; x < CH; ++x) _mm512_storeu_ps(acc + i * D + 16 * (c + x), o[i][x]);
}

// The same on a bf16 cache read in place, 32 dims (one 64-byte line of a V row) per load: a bf16 pair
// per 32-bit element gives the even dims (<< 16) and the odd ones (high half) with one op each, so a
// lane's acc is kept [D / 32][even 16 | odd 16] (the driver's finish puts the dims back in order).
// acc[i][32 c .. 32 (c + CH)) = acc * alpha_i, then += p_i[j] * v_j in key order.
// p_i[j] is p[i * LS + j * KS]: [lane][key] (LS = kTileKeys, KS = 1) or [key][lane] (1, kLanes).
// kPrefetch: one prefetch step per key (t.prefetch, as in scores_narrow; prefetch_steps counts them).
template <int NL, int CH, int LS = kTileKeys, int KS = 1, bool kPrefetch = false>
inline void pv_pairs(const Tile& t, const float* p, const float* alpha, int D, int c, float* acc) {
  __m512 o[NL][CH][2];
  for (int i = 0; i < NL; ++i)
    for (int x = 0; x < CH; ++x)
      for (int e = 0; e < 2; ++e)
        o[i][x][e] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 32 * (c + x) + 16 * e), _mm512_set1_ps(alpha[i]));
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  Prefetch* const pf = kPrefetch ? t.prefetch : nullptr;
  int seg = pf != nullptr ? pf->s : 0;
  int64_t px = pf != nullptr ? pf->x : 0;
  const int pairs = pf != nullptr ? pf->pairs_per_step : 0;
  const int step_mask = pf != nullptr ? pf->step_mask : 0;
  for (int j = 0; j < t.n; ++j) {
    if constexpr (kPrefetch)
      if (pairs > 0 && (j & step_mask) == 0) pf->issue(seg, px, pairs);
    const uint16_t* vh = t.rows[j] + t.vplane + 32 * c;
    for (int x = 0; x < CH; ++x) {
      const __m512i pair = _mm512_loadu_si512(vh + 32 * x);
      const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(pair, hi));
      for (int i = 0; i < NL; ++i) {
        const __m512 pij = _mm512_set1_ps(p[i * LS + j * KS]);
        o[i][x][0] = _mm512_fmadd_ps(pij, ve, o[i][x][0]);
        o[i][x][1] = _mm512_fmadd_ps(pij, vo, o[i][x][1]);
      }
    }
  }
  if (kPrefetch && pf != nullptr) pf->s = seg, pf->x = px;
  for (int i = 0; i < NL; ++i)
    for (int x = 0; x < CH; ++x)
      for (int e = 0; e < 2; ++e) _mm512_storeu_ps(acc + i * D + 32 * (c + x) + 16 * e, o[i][x][e]);
}

// One score step: dim d of keys 0..15 (k0) and 16..31 (k1) into both halves' accumulators.
template <int NL>
inline void score_step(const LaneGroup& g, int d, int i0, __m512 k0, __m512 k1, __m512 (&a)[2][NL]) {
  for (int i = 0; i < NL; ++i) {
    const __m512 qd = _mm512_set1_ps(g.qt[d * kLanes + i0 + i]);
    a[0][i] = _mm512_fmadd_ps(qd, k0, a[0][i]);
    a[1][i] = _mm512_fmadd_ps(qd, k1, a[1][i]);
  }
}

// Scores of lanes i0 .. i0+NL-1 over the tile's keys, masked, into s[i0 + i]: from t.kt (transposed
// once per tile and kv head) or, with t.kt null (kDirect, a lone group: keys_in_registers), from the
// bf16 rows transposed 16 dims at a time in registers, where so few lanes would not repay a stored kt.
template <int NL, bool kDirect>
inline void scores_narrow(const Tile& t, const LaneGroup& g, int D, int i0, int32_t window, bool masked,
                                        float (*s)[kTileKeys]) {
  __m512 a[2][NL];
  for (int i = 0; i < NL; ++i) a[0][i] = a[1][i] = _mm512_setzero_ps();
  // a few of the next tile's lines per step, the cursor in locals (registers) and stored back once
  Prefetch* const pf = t.prefetch;
  int seg = pf != nullptr ? pf->s : 0;
  int64_t x = pf != nullptr ? pf->x : 0;
  const int pairs = pf != nullptr ? pf->pairs_per_step : 0;
  const int step_mask = pf != nullptr ? pf->step_mask : 0;
  if (kDirect && NL <= kRegisterKeyLanes && t.kt == nullptr) {  // compile-time false elsewhere
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 o0[8], o1[8];
      transpose_pairs_16x8(t.rows, d0, o0);
      transpose_pairs_16x8(t.rows + 16, d0, o1);
      for (int p = 0; p < 8; ++p) {  // dims d0 + 2p (low half of each pair) and d0 + 2p + 1 (high)
        const int d = d0 + 2 * p;
        if (pairs > 0 && (d & step_mask) == 0) pf->issue(seg, x, pairs);
        score_step<NL>(g, d, i0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(o0[p]), 16)),
                       _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(o1[p]), 16)), a);
        if (pairs > 0 && ((d + 1) & step_mask) == 0) pf->issue(seg, x, pairs);
        score_step<NL>(g, d + 1, i0, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(o0[p]), hi)),
                       _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(o1[p]), hi)), a);
      }
    }
  } else {
    for (int d = 0; d < D; ++d) {
      if (pairs > 0 && (d & step_mask) == 0) pf->issue(seg, x, pairs);
      score_step<NL>(g, d, i0, _mm512_loadu_ps(t.kt + d * 16), _mm512_loadu_ps(t.kt + (D + d) * 16), a);
    }
  }
  if (pf != nullptr) pf->s = seg, pf->x = x;
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int i = 0; i < NL; ++i) {
    for (int b = 0; b < 2; ++b) {
      __m512 sb = a[b][i];
      if (masked) {
        const int32_t pos = g.pos[i0 + i];
        const __m512i kp = _mm512_add_epi32(iota, _mm512_set1_epi32(t.k0 + 16 * b));
        __mmask16 visible = _mm512_cmple_epi32_mask(kp, _mm512_set1_epi32(pos));
        if (window != 0) visible &= _mm512_cmplt_epi32_mask(_mm512_set1_epi32(pos - window), kp);
        if (g.tree) visible &= static_cast<__mmask16>(tree_keys16(g.tree_mask[i0 + i], pos, t.k0 + 16 * b));
        sb = _mm512_mask_blend_ps(visible, neg_inf, sb);
      }
      _mm512_storeu_ps(s[i0 + i] + 16 * b, sb);
    }
  }
}

// p * v for lanes i0 .. i0+NL-1: from the float tile NL <= 6, 4 chunks of 16 dims at a time (NL x 4
// accumulators); from a bf16 cache NL <= 8, 32 dims at a time (NL x 2), or 64 up to kFewLanes lanes
// (NL x 4, enough independent chains to cover the fma latency), issuing the next tile's prefetch as it goes.
template <int NL, bool kDirect>
inline void pv_lanes(const Tile& t, const float (*p)[kTileKeys], const float* alpha, int D, int i0,
                                   float* acc) {
  if constexpr (kDirect) {  // 32 dims per pass: NL x 2 accumulators; up to kFewLanes lanes 64 (NL x 4)
    int c = 0;
    if constexpr (NL <= kFewLanes)
      for (; c + 2 <= D / 32; c += 2) pv_pairs<NL, 2, kTileKeys, 1, true>(t, p[i0], alpha + i0, D, c, acc + i0 * D);
    for (; c < D / 32; ++c) pv_pairs<NL, 1, kTileKeys, 1, true>(t, p[i0], alpha + i0, D, c, acc + i0 * D);
    return;
  }
  const int chunks = D / 16;
  int c = 0;
  for (; c + 4 <= chunks; c += 4) pv_narrow<NL, 4>(t, p + i0, alpha + i0, D, c, acc + i0 * D);
  for (; c < chunks; ++c) pv_narrow<NL, 1>(t, p + i0, alpha + i0, D, c, acc + i0 * D);
}

// tile_avx512's update for lanes 0..NL-1 (D % 16 == 0): per lane the same fmas, maxima, exp2s and
// sums in the same order, with 16 keys (scores, p) or 16 head dims (p * v) per vector.
// kDirect: K and V read in place from a bf16 cache (t.rows; D % 32 == 0), else from t.k / t.v.
template <int NL, bool kDirect>
void tile_narrow(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  alignas(64) float s[NL][kTileKeys];
  if constexpr (NL <= 8) {  // at most 16 score accumulators per pass (score_passes)
    scores_narrow<NL, kDirect>(t, g, D, 0, window, masked, s);
  } else {
    scores_narrow<NL / 2, kDirect>(t, g, D, 0, window, masked, s);
    scores_narrow<NL - NL / 2, kDirect>(t, g, D, NL / 2, window, masked, s);
  }
  // running max, rescale factor and the new p: the wide tile's vector code on the lane vector. The
  // tile max may be taken in any order: it differs from the wide tile's only in the sign of a zero
  // (exp2 of +-0 is 1) or with a NaN score (the lane's output is NaN either way).
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  alignas(64) float mt[kLanes], m_safe[kLanes], alpha[kLanes];
  _mm512_store_ps(mt, neg_inf);
  const __mmask16 in0 = static_cast<__mmask16>(t.n >= 16 ? 0xFFFFu : (1u << t.n) - 1u);
  const __mmask16 in1 = static_cast<__mmask16>(t.n >= 32 ? 0xFFFFu : t.n <= 16 ? 0u : (1u << (t.n - 16)) - 1u);
  for (int i = 0; i < NL; ++i)
    mt[i] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_blend_ps(in0, neg_inf, _mm512_loadu_ps(s[i])),
                                               _mm512_mask_blend_ps(in1, neg_inf, _mm512_loadu_ps(s[i] + 16))));
  const __m512 m_old = _mm512_loadu_ps(g.m);
  const __m512 m_new = _mm512_max_ps(m_old, _mm512_load_ps(mt));
  const __m512 m_safe_v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), m_new,
                                               _mm512_setzero_ps());
  const __m512 alpha_v = exp2_avx512(_mm512_sub_ps(m_old, m_safe_v));
  _mm512_storeu_ps(g.m, m_new);
  _mm512_store_ps(m_safe, m_safe_v);
  _mm512_store_ps(alpha, alpha_v);
  for (int i = 0; i < NL; ++i) {
    const __m512 ms = _mm512_set1_ps(m_safe[i]);
    for (int b = 0; b < 2; ++b)
      _mm512_storeu_ps(s[i] + 16 * b, exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(s[i] + 16 * b), ms)));
  }
  float l[NL];  // l * alpha, then + p_j in key order: NL independent chains
  for (int i = 0; i < NL; ++i) l[i] = g.l[i] * alpha[i];
  for (int j = 0; j < t.n; ++j)
    for (int i = 0; i < NL; ++i) l[i] = l[i] + s[i][j];
  for (int i = 0; i < NL; ++i) g.l[i] = l[i];
  if constexpr (kDirect) {  // lanes 8 at a time: 16 accumulators, each V line feeding 2 x 8 fmas
    if constexpr (NL <= 8) {
      pv_lanes<NL, true>(t, s, alpha, D, 0, g.acc);
    } else {
      pv_lanes<NL - NL / 2, true>(t, s, alpha, D, 0, g.acc);
      pv_lanes<NL / 2, true>(t, s, alpha, D, NL - NL / 2, g.acc);
    }
  } else if constexpr (NL <= 6) {  // lanes 6 at a time: each V load feeds 6 fmas
    pv_lanes<NL, kDirect>(t, s, alpha, D, 0, g.acc);
  } else if constexpr (NL <= 12) {
    pv_lanes<6, kDirect>(t, s, alpha, D, 0, g.acc);
    pv_lanes<NL - 6, kDirect>(t, s, alpha, D, 6, g.acc);
  } else {
    pv_lanes<6, kDirect>(t, s, alpha, D, 0, g.acc);
    pv_lanes<6, kDirect>(t, s, alpha, D, 6, g.acc);
    pv_lanes<NL - 12, kDirect>(t, s, alpha, D, 12, g.acc);
  }
}

// The online-softmax step on scores s [key][lane] (64-byte aligned), lanes along the vector: mask,
// tile max, g.m / g.l updated, s replaced by p; returns each lane's rescale factor alpha.
inline __m512 softmax_keys(const Tile& t, LaneGroup& g, int32_t window, bool masked, float* s) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  if (masked) {
    const __m512i pos = _mm512_loadu_si512(g.pos);
    const __m512i pos_w = _mm512_sub_epi32(pos, _mm512_set1_epi32(window));
    for (int j = 0; j < t.n; ++j) {
      const __m512i kp = _mm512_set1_epi32(t.k0 + j);
      __mmask16 visible = _mm512_cmple_epi32_mask(kp, pos);
      if (window != 0) visible &= _mm512_cmplt_epi32_mask(pos_w, kp);
      if (g.tree) visible &= static_cast<__mmask16>(tree_lanes16(g, t.k0 + j));
      _mm512_store_ps(s + j * kLanes, _mm512_mask_blend_ps(visible, neg_inf, _mm512_load_ps(s + j * kLanes)));
    }
  }
  __m512 mt = neg_inf;
  for (int j = 0; j < t.n; ++j) mt = _mm512_max_ps(mt, _mm512_load_ps(s + j * kLanes));
  const __m512 m_old = _mm512_loadu_ps(g.m);
  const __m512 m_new = _mm512_max_ps(m_old, mt);
  const __m512 m_safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), m_new,
                                             _mm512_setzero_ps());
  const __m512 alpha = exp2_avx512(_mm512_sub_ps(m_old, m_safe));
  _mm512_storeu_ps(g.m, m_new);
  __m512 l = _mm512_mul_ps(_mm512_loadu_ps(g.l), alpha);
  for (int j = 0; j < t.n; ++j) {
    const __m512 p = exp2_avx512(_mm512_sub_ps(_mm512_load_ps(s + j * kLanes), m_safe));
    _mm512_store_ps(s + j * kLanes, p);
    l = _mm512_add_ps(l, p);
  }
  _mm512_storeu_ps(g.l, l);
  return alpha;
}

// A group of many lanes on a bf16 cache: scores with the lanes along the vector (16 keys' accumulators,
// each fma a q row times a broadcast key), so the softmax runs on [key][lane] vectors as in the wide
// tile (a max and an l sum per key for all lanes, no per-lane reductions), then the narrow tile's
// p * v from the bf16 V rows. Per lane the same operations in the same order: the same bits.
// kInPlace: each key element is broadcast from its bf16 pair in the cache row and made a float by one
// shift or and (no transposed tile t.kt; faster where those ops do not compete with the fmas, as on
// AMD Zen 4); else broadcast from t.kt.
template <int NL, bool kInPlace>
void tile_many(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  alignas(64) float s[kTileKeys * kLanes];  // [key][lane]
  Prefetch* const pf = t.prefetch;  // as in scores_narrow
  int seg = pf != nullptr ? pf->s : 0;
  int64_t x = pf != nullptr ? pf->x : 0;
  const int pairs = pf != nullptr ? pf->pairs_per_step : 0;
  const int step_mask = pf != nullptr ? pf->step_mask : 0;
  for (int b = 0; b < 2 && 16 * b < t.n; ++b) {
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
    if constexpr (kInPlace) {  // dims d, d + 1 from one 32-bit pair: low half even, high half odd
      const uint16_t* const* rows = t.rows + 16 * b;
      const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int d = 0; d < D; d += 2) {
        if (pairs > 0 && (d & step_mask) == 0) pf->issue<3>(seg, x, pairs);  // steps d and d + 1
        if (pairs > 0 && ((d + 1) & step_mask) == 0) pf->issue<3>(seg, x, pairs);
        const __m512 qe = _mm512_loadu_ps(g.qt + d * kLanes), qo = _mm512_loadu_ps(g.qt + (d + 1) * kLanes);
        for (int j = 0; j < 16; ++j) {
          int32_t pair;
          std::memcpy(&pair, rows[j] + d, sizeof(pair));
          const __m512i w = _mm512_set1_epi32(pair);
          a[j] = _mm512_fmadd_ps(qe, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), a[j]);
          a[j] = _mm512_fmadd_ps(qo, _mm512_castsi512_ps(_mm512_and_si512(w, hi)), a[j]);
        }
      }
    } else {
      const float* kt = t.kt + b * D * 16;
      for (int d = 0; d < D; ++d) {
        if (pairs > 0 && (d & step_mask) == 0) pf->issue<3>(seg, x, pairs);
        const __m512 qd = _mm512_loadu_ps(g.qt + d * kLanes);
        for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kt[d * 16 + j]), a[j]);
      }
    }
    for (int j = 0; j < 16; ++j) _mm512_store_ps(s + (16 * b + j) * kLanes, a[j]);
  }
  if (pf != nullptr) pf->s = seg, pf->x = x;
  alignas(64) float alpha[kLanes];
  _mm512_store_ps(alpha, softmax_keys(t, g, window, masked, s));
  for (int c = 0; c < D / 32; ++c) {  // lanes in two sets, as the narrow tile's p * v
    pv_pairs<NL - NL / 2, 1, 1, kLanes>(t, s, alpha, D, c, g.acc);
    pv_pairs<NL / 2, 1, 1, kLanes>(t, s + (NL - NL / 2), alpha + (NL - NL / 2), D, c, g.acc + (NL - NL / 2) * D);
  }
}

// ---------------------------------------------------------------- the 16-lane (wide) tile
// Scores of NK consecutive keys (independent fma chains over d hide the latency).
template <int NK>
inline void scores_avx512(const float* k, int64_t stride, const float* qt, int D, float* s) {
  __m512 a[NK];
  for (int j = 0; j < NK; ++j) a[j] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 qd = _mm512_loadu_ps(qt + d * kLanes);
    for (int j = 0; j < NK; ++j) a[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(k[j * stride + d]), a[j]);
  }
  for (int j = 0; j < NK; ++j) _mm512_storeu_ps(s + j * kLanes, a[j]);
}

// acc rows d0 .. d0+R-1 += p_j * v_j[d] over the tile's keys (accumulators stay in registers).
template <int R>
inline void pv_avx512(const Tile& t, const float* s, __m512 alpha, int D, int d0, float* acc) {
  __m512 o[R];
  for (int r = 0; r < R; ++r) o[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + (d0 + r) * kLanes), alpha);
  for (int j = 0; j < t.n; ++j) {
    const __m512 p = _mm512_loadu_ps(s + j * kLanes);
    const float* vj = t.v + j * t.stride + d0;
    for (int r = 0; r < R; ++r) o[r] = _mm512_fmadd_ps(p, _mm512_set1_ps(vj[r]), o[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (d0 + r) * kLanes, o[r]);
}

// ---------------------------------------------------------------- the narrow tile's entry
template <bool kDirect, bool kKeysInPlace = false>
void narrow_avx512(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  static_assert(kManyLanes == 15, "the many-lane tile is instantiated for 15 and 16 lanes");
  if constexpr (kDirect) {  // 15 or 16 lanes: the many-lane tile (with fewer it is slower than the narrow one)
    if (g.live == 15) return tile_many<15, kKeysInPlace>(t, g, D, window, masked);
    if (g.live == 16) return tile_many<16, kKeysInPlace>(t, g, D, window, masked);
  }
  switch (g.live) {
    case 1: tile_narrow<1, kDirect>(t, g, D, window, masked); break;
    case 2: tile_narrow<2, kDirect>(t, g, D, window, masked); break;
    case 3: tile_narrow<3, kDirect>(t, g, D, window, masked); break;
    case 4: tile_narrow<4, kDirect>(t, g, D, window, masked); break;
    case 5: tile_narrow<5, kDirect>(t, g, D, window, masked); break;
    case 6: tile_narrow<6, kDirect>(t, g, D, window, masked); break;
    case 7: tile_narrow<7, kDirect>(t, g, D, window, masked); break;
    case 8: tile_narrow<8, kDirect>(t, g, D, window, masked); break;
    case 9: tile_narrow<9, kDirect>(t, g, D, window, masked); break;
    case 10: tile_narrow<10, kDirect>(t, g, D, window, masked); break;
    case 11: tile_narrow<11, kDirect>(t, g, D, window, masked); break;
    case 12: tile_narrow<12, kDirect>(t, g, D, window, masked); break;
    case 13: tile_narrow<13, kDirect>(t, g, D, window, masked); break;
    case 14: tile_narrow<14, kDirect>(t, g, D, window, masked); break;
    case 15: tile_narrow<15, kDirect>(t, g, D, window, masked); break;
    default: tile_narrow<16, kDirect>(t, g, D, window, masked); break;
  }
}


}  // namespace

void tile_avx512(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  alignas(64) float s[kTileKeys * kLanes];
  int j = 0;
  for (; j + 8 <= t.n; j += 8) scores_avx512<8>(t.k + j * t.stride, t.stride, g.qt, D, s + j * kLanes);
  for (; j < t.n; ++j) scores_avx512<1>(t.k + j * t.stride, t.stride, g.qt, D, s + j * kLanes);
  const __m512 alpha = softmax_keys(t, g, window, masked, s);
  int d = 0;
  for (; d + 16 <= D; d += 16) pv_avx512<16>(t, s, alpha, D, d, g.acc);
  for (; d < D; ++d) pv_avx512<1>(t, s, alpha, D, d, g.acc);
}

void convert_avx512(const void* src, int kind, int64_t n, float* dst) {
  if (kind == kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i));
    const __m512 f = kind == kBF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16))
                                   : _mm512_cvtph_ps(x);
    _mm512_storeu_ps(dst + i, f);
  }
  for (; i < n; ++i) dst[i] = kind == kBF16 ? attn::bf16_bits_to_float(h[i]) : attn::half_bits_to_float(h[i]);
}

void transpose_tile_avx512(const Tile& t, int D, bool direct) {
  for (int b = 0; b < 2; ++b) {  // keys 16 b .. 16 b + 15 as [D][16] (rows past t.n: stale, never used)
    if (direct) {
      for (int c = 0; c < D; c += 32) transpose_keys_bf16(t.rows + 16 * b, c, t.kt + (b * D + c) * 16);
    } else {
      for (int c = 0; c < D; c += 16) transpose_keys(t.k + 16 * b * t.stride + c, t.stride, t.kt + (b * D + c) * 16);
    }
  }
}

void narrow_avx512_float(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  narrow_avx512<false>(t, g, D, window, masked);
}
void narrow_avx512_bf16(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  narrow_avx512<true>(t, g, D, window, masked);
}
void narrow_avx512_bf16_keys(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  narrow_avx512<true, true>(t, g, D, window, masked);
}

}  // namespace specrt::attn_cpu
SPECRT_TARGET_END
