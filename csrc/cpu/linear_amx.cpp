// bf16 x bf16 on Intel AMX tiles (tdpbf16ps), in the AMX order of linear_kernel.h, for every M.
// W is the A operand as it lies (16 weight rows x 32 elements per tile, rows 2K bytes apart), x the
// B operand packed by pack_x_tiles, so C tiles hold y^T [16 weight rows][16 x rows]. Up to 4 C
// tiles (64 weight rows) share each x tile. Compiled in a SPECRT_ISA_AMX_BF16 region; called only
// where cpu_features().amx_bf16 (the process holds the tile permission).
#include <cstdlib>
#include <cstring>

#include "cpu/linear_kernel.h"
#include "cpu/simd_target.h"

#if SPECRT_AMX_BUILD
#include <immintrin.h>

SPECRT_TARGET_BEGIN(SPECRT_ISA_AMX_BF16)
namespace specrt::linear {
namespace amx_isa {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C [rows][mlen] fp32; tmm4: W [rows][32] bf16; tmm5: x [16 pairs][mlen][2];
// tmm6 / tmm7: the same two for the last chunk when K % 32 != 0 (`tail` pairs)
void configure(int rows, int mlen, int tail) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = static_cast<uint16_t>(4 * mlen);
  }
  c.rows[4] = static_cast<uint8_t>(rows);
  c.colsb[4] = 64;
  c.rows[5] = 16;
  c.colsb[5] = static_cast<uint16_t>(4 * mlen);
  if (tail) {
    c.rows[6] = static_cast<uint8_t>(rows);
    c.colsb[6] = static_cast<uint16_t>(4 * tail);
    c.rows[7] = static_cast<uint8_t>(tail);
    c.colsb[7] = static_cast<uint16_t>(4 * mlen);
  }
  _tile_loadconfig(&c);
}

// r[i] (16 x 32-bit lanes) -> r[j] holding the old r[0..15][j]: a 16 x 16 transpose in 64 shuffles
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// A C tile [rows][mlen] (y^T) out to y[m0.., n..]: column m is y's row m0 + m, 16 weight rows wide.
// The same rule as store_out (linear_store.h): + bias in fp32, then bf16 nearest-even, NaN 0x7FC0.
void store_tile(const Problem& p, const float (*c)[16], int64_t n, int rows, int64_t m0, int mlen) {
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1u);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(keep, p.bias + n) : _mm512_setzero_ps();
  __m512i t[16];
  if (mlen == 16) {  // a whole tile: transposed in registers (a gather per x row otherwise)
    for (int r = 0; r < 16; ++r) t[r] = _mm512_load_si512(c[r]);
    transpose16(t);
  }
  for (int m = 0; m < mlen; ++m) {
    __m512 v = mlen == 16 ? _mm512_castsi512_ps(t[m]) : _mm512_i32gather_ps(column, &c[0][m], 4);
    if (p.bias) v = _mm512_add_ps(v, bias);
    if (!p.y_bf16) {
      _mm512_mask_storeu_ps(static_cast<float*>(p.y) + (m0 + m) * p.N + n, keep, v);
      continue;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.y) + (m0 + m) * p.N + n, keep, _mm512_cvtepi32_epi16(h));
  }
}

// Tile numbers are immediates that GCC's intrinsics paste into the instruction text: literals only.
#define SPECRT_DP(t, a, b, w) \
  do {                           \
    _tile_loadd(a, (w), ldw);    \
    _tile_dpbf16ps(t, a, b);     \
  } while (0)
// every C tile of T: weight tile register a (rows `step` elements apart from wc), x tile register b
#define SPECRT_DP_ALL(a, b, wc)                                \
  do {                                                         \
    const uint16_t* w0 = (wc);                                 \
    SPECRT_DP(0, a, b, w0);                                    \
    if constexpr (T > 1) SPECRT_DP(1, a, b, w0 + step);        \
    if constexpr (T > 2) SPECRT_DP(2, a, b, w0 + 2 * step);    \
    if constexpr (T > 3) SPECRT_DP(3, a, b, w0 + 3 * step);    \
  } while (0)

// T C tiles: weight rows [n, n + 16 T) (the last tile `rows` high), x rows [m0, m0 + mlen).
// While they run, the next `ahead` bytes of weights are requested into L2, spread over the chunks:
// a tile reads 16 rows at once, more streams than the hardware prefetchers follow.
template <int T>
void tiles(const Problem& p, const uint16_t* xb, int64_t n, int rows, int64_t m0, int mlen, int64_t ahead) {
  const auto* w = static_cast<const uint16_t*>(p.w) + n * p.K;
  const int64_t K = p.K, ldw = 2 * K, full = K / 32, step = 16 * K;
  const char* pf = reinterpret_cast<const char*>(w + 16 * T * K);
  const int64_t pf_step = full ? (ahead / full + 63) / 64 * 64 : 0;
  _tile_zero(0);
  if constexpr (T > 1) _tile_zero(1);
  if constexpr (T > 2) _tile_zero(2);
  if constexpr (T > 3) _tile_zero(3);
  for (int64_t c = 0; c < full; ++c) {
    for (int64_t b = 0; b < pf_step; b += 64) _mm_prefetch(pf + c * pf_step + b, _MM_HINT_T1);
    _tile_loadd(5, xb + c * 32 * mlen, 4 * mlen);
    SPECRT_DP_ALL(4, 5, w + 32 * c);
  }
  if (K % 32) {
    _tile_loadd(7, xb + full * 32 * mlen, 4 * mlen);
    SPECRT_DP_ALL(6, 7, w + 32 * full);
  }
  alignas(64) float c[4][16][16];
  _tile_stored(0, c[0], 64);
  if constexpr (T > 1) _tile_stored(1, c[1], 64);
  if constexpr (T > 2) _tile_stored(2, c[2], 64);
  if constexpr (T > 3) _tile_stored(3, c[3], 64);
  for (int t = 0; t < T; ++t) store_tile(p, c[t], n + 16 * t, t == T - 1 ? rows : 16, m0, mlen);
}

#undef SPECRT_DP_ALL
#undef SPECRT_DP

}  // namespace
}  // namespace amx_isa

// Whole 16-row blocks and 32-element chunks by 16 x 16 transposes of x's bf16 pairs; the rest
// (rows past the last whole block, K's last partial chunk) by the portable packer.
void pack_x_tiles_amx(const Problem& p, uint16_t* out) {
  const auto* x = static_cast<const uint16_t*>(p.x);
  const int64_t chunks = (p.K + 31) / 32, full = p.K / 32, rows = p.M / 16 * 16;
  for (int64_t m0 = 0; m0 < rows; m0 += 16) {
    uint16_t* block = out + m0 / 16 * chunks * 512;
    for (int64_t c = 0; c < full; ++c) {
      __m512i r[16];
      for (int m = 0; m < 16; ++m) r[m] = _mm512_loadu_si512(x + (m0 + m) * p.ldx + 32 * c);
      amx_isa::transpose16(r);  // r[j]: pair j of the 16 rows
      for (int j = 0; j < 16; ++j) _mm512_store_si512(block + c * 512 + j * 32, r[j]);
    }
  }
  if (full < chunks) pack_x_tiles(p, out, 0, rows, full);
  pack_x_tiles(p, out, rows, p.M, 0);
}

// Weight rows in groups of 64 (4 C tiles), each group over every block of 16 x rows while it is
// in cache; the tile shapes are reconfigured only when the block or the group's height changes.
void linear_rows_amx(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t chunks = (p.K + 31) / 32;
  const int tail = static_cast<int>(p.K % 32) / 2;
  int shape_rows = -1, shape_mlen = -1;
  for (int64_t n = n0; n < n1; n += 64) {
    const int64_t height = n1 - n < 64 ? n1 - n : 64;
    const int T = static_cast<int>((height + 15) / 16), rows = static_cast<int>(height - 16 * (T - 1));
    const int64_t next = n1 - (n + height) < 64 ? n1 - (n + height) : 64;  // rows of the next group
    for (int64_t m0 = 0; m0 < p.M; m0 += 16) {
      const int mlen = static_cast<int>(p.M - m0 < 16 ? p.M - m0 : 16);
      const uint16_t* xb = p.x_tiles + (m0 / 16) * chunks * 512;
      const int64_t ahead = m0 == 0 ? next * 2 * p.K : 0;  // the first x block fetches
      if (T > 1 && (shape_rows != 16 || shape_mlen != mlen)) {  // whole tiles first
        amx_isa::configure(16, mlen, tail);
        shape_rows = 16;
        shape_mlen = mlen;
      }
      if (T > 1) {
        const int64_t whole = rows == 16 ? T : T - 1;
        if (whole == 4) amx_isa::tiles<4>(p, xb, n, 16, m0, mlen, ahead);
        if (whole == 3) amx_isa::tiles<3>(p, xb, n, 16, m0, mlen, ahead);
        if (whole == 2) amx_isa::tiles<2>(p, xb, n, 16, m0, mlen, ahead);
        if (whole == 1) amx_isa::tiles<1>(p, xb, n, 16, m0, mlen, ahead);
        if (whole == T) continue;
      }
      if (shape_rows != rows || shape_mlen != mlen) {  // the group's last tile, `rows` high
        amx_isa::configure(rows, mlen, tail);
        shape_rows = rows;
        shape_mlen = mlen;
      }
      amx_isa::tiles<1>(p, xb, n + 16 * (T - 1), rows, m0, mlen, 0);
    }
  }
  _tile_release();
}

}  // namespace specrt::linear
SPECRT_TARGET_END
#else
namespace specrt::linear {
// unreachable: amx_bf16 is false
void pack_x_tiles_amx(const Problem&, uint16_t*) { std::abort(); }
void linear_rows_amx(const Problem&, int64_t, int64_t) { std::abort(); }
}  // namespace specrt::linear
#endif
