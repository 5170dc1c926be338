// csrc/cpu/linear_tiles.h — the small-M linear kernel, written once over a vector
// policy. Included (inside a per-ISA namespace) by linear_{scalar,avx2,avx512,
// avx512bf16}.cpp after they define:
//   V (16 fp32 lanes): vzero, vset1, vadd, vsub, vmul, vfma(a, b, c) = a*b + c,
//     vreduce (the fixed tree of linear_kernel.h), and loaders into fp32 lanes:
//     load_f32[_n], load_bf16[_n], load_i8[_n] (first n elements, rest 0),
//     iota16 (lanes 0..15), lut16(p, table, lo, hi) (16 packed bytes: lo = table[low
//     nibbles], hi = table[high nibbles]);
//   BV (32 bf16 for the vdpbf16ps order): load_bv[_n], vdp(acc, w, x);
//   h2f16(p, n, out) (n <= 16 exact fp16 -> fp32) and the tile sizes kNR (weight rows) and
//   kMR (x rows).
// Every tile computes each output element with the same operations in the same
// order, so the result of a row never depends on the tiling, on M or on threads.
// No torch or standard-library templates here: this code is compiled once per ISA.
// With SPECRT_LINEAR_DOT_ONLY defined only the bf16 x bf16 tiles (run_dot) are built.

#ifndef SPECRT_LINEAR_DOT_ONLY

// ---- per-row weight readers: chunk(c) = fp32 lanes of input features [16c, 16c+16)
struct RowF32 {
  const float* w;
  void init(const Problem& p, int64_t n) { w = static_cast<const float*>(p.w) + n * p.K; }
  V chunk(int64_t c) const { return load_f32(w + 16 * c); }
  V tail(int64_t c, int n) const { return load_f32_n(w + 16 * c, n); }
};

struct RowBF16 {
  const uint16_t* w;
  void init(const Problem& p, int64_t n) { w = static_cast<const uint16_t*>(p.w) + n * p.K; }
  V chunk(int64_t c) const { return load_bf16(w + 16 * c); }
  V tail(int64_t c, int n) const { return load_bf16_n(w + 16 * c, n); }
};

struct RowInt8 {  // w = scale[n] * q
  const int8_t* q;
  V scale;
  void init(const Problem& p, int64_t n) {
    q = static_cast<const int8_t*>(p.w) + n * p.K;
    scale = vset1(static_cast<const float*>(p.scales)[n]);
  }
  V chunk(int64_t c) const { return vmul(load_i8(q + 16 * c), scale); }
  V tail(int64_t c, int n) const { return vmul(load_i8_n(q + 16 * c, n), scale); }
};

// Group formats: group(g, lo, hi) = fp32 lanes of features [32g, 32g+16) and [32g+16, 32g+32),
// for g in a block of 16 groups whose fp16 scales widen(g0, n) converted beforehand.
struct GroupScales {
  const uint16_t* src;
  float v[16];
  void init(const uint16_t* p) { src = p; }
  void widen(int64_t g0, int n) { h2f16(src + g0, n, v); }
  float at(int64_t g) const { return v[g & 15]; }
};

struct RowQ8_0 {  // w = d * q
  const int8_t* q;
  GroupScales d;
  void init(const Problem& p, int64_t n) {
    const int64_t ng = p.K / kGroup;
    q = static_cast<const int8_t*>(p.w) + n * p.K;
    d.init(static_cast<const uint16_t*>(p.scales) + n * ng);
  }
  void widen(int64_t g0, int n) { d.widen(g0, n); }
  void group(int64_t g, V& lo, V& hi) const {
    const V dv = vset1(d.at(g));
    lo = vmul(load_i8(q + 32 * g), dv);
    hi = vmul(load_i8(q + 32 * g + 16), dv);
  }
};

// Q4: the 16 possible weights of a group are computed once (a table: the exact values
// llama.cpp dequantizes to), then every nibble is looked up.
struct RowQ4_0 {  // w = d * (q - 8)
  const uint8_t* q;
  GroupScales d;
  void init(const Problem& p, int64_t n) {
    const int64_t ng = p.K / kGroup;
    q = static_cast<const uint8_t*>(p.w) + n * (p.K / 2);
    d.init(static_cast<const uint16_t*>(p.scales) + n * ng);
  }
  void widen(int64_t g0, int n) { d.widen(g0, n); }
  void group(int64_t g, V& lo, V& hi) const { lut16(q + 16 * g, vmul(vsub(iota16(), vset1(8.0f)), vset1(d.at(g))), lo, hi); }
};

struct RowQ4_1 {  // w = fl(fl(d * q) + m): no fused multiply-add, as gguf-py dequantizes
  const uint8_t* q;
  GroupScales d, m;
  void init(const Problem& p, int64_t n) {
    const int64_t ng = p.K / kGroup;
    q = static_cast<const uint8_t*>(p.w) + n * (p.K / 2);
    d.init(static_cast<const uint16_t*>(p.scales) + n * ng);
    m.init(p.mins + n * ng);
  }
  void widen(int64_t g0, int n) {
    d.widen(g0, n);
    m.widen(g0, n);
  }
  void group(int64_t g, V& lo, V& hi) const { lut16(q + 16 * g, vadd(vmul(iota16(), vset1(d.at(g))), vset1(m.at(g))), lo, hi); }
};

#endif  // SPECRT_LINEAR_DOT_ONLY

// ---- software prefetch. A tile's rows [n, n + NR) are contiguous in each weight stream
// (quants, scales, mins) and tiles are visited in memory order, so each stream is read
// front to back; rows are short (e.g. 576 bytes of int8), too short for the hardware
// prefetchers to ramp up. Lines are requested ahead of the linear read position: for one x
// row (little work per line) kFar ahead into L1; for more rows, where the FMAs would
// otherwise hold back the loads, kFar2 ahead into L2 and kNear ahead from L2 into L1.
// Only the first x tile over a tile of weight rows prefetches (`stream`): the later ones
// find those rows in L1, and re-requesting the stream ahead cost them ~15%.
// (Measured on Zen 4: bench/forward.py; hints only, results do not depend on them.)
constexpr int64_t kFar = 8192, kFar2 = 16384, kNear = 1024;

struct Prefetch {
  const char* base[3];
  const char* far[3];
  const char* near[3];
  int64_t rate[3];  // tile bytes per chunk, 16.16 fixed point
  int ns = 0;

  void init(const Problem& p, int64_t n, int nr, int64_t nc, bool two_level) {
    const int64_t K = p.K, G = K / kGroup;
    int64_t row[3] = {0, 0, 0};
    const void* ptr[3] = {p.w, p.scales, p.mins};
    switch (p.kind) {
      case WeightKind::kF32: row[0] = 4 * K; break;
      case WeightKind::kBF16: row[0] = 2 * K; break;
      case WeightKind::kInt8: row[0] = K; break;
      case WeightKind::kQ8_0: row[0] = K; row[1] = 2 * G; break;
      case WeightKind::kQ4_0: row[0] = K / 2; row[1] = 2 * G; break;
      case WeightKind::kQ4_1: row[0] = K / 2; row[1] = 2 * G; row[2] = 2 * G; break;
    }
    ns = 0;
    for (int s = 0; s < 3; ++s) {
      if (!row[s] || !ptr[s]) continue;
      base[ns] = static_cast<const char*>(ptr[s]) + n * row[s];
      rate[ns] = nc ? (nr * row[s] << 16) / nc : 0;
      far[ns] = base[ns] + (two_level ? kFar2 : kFar);
      near[ns] = two_level ? base[ns] + kNear : nullptr;
      ++ns;
    }
  }
  // before reading chunk c: lines up to the distances past the end of chunk c are requested
  template <bool kTwoLevel>
  void at(int64_t c) {
    for (int s = 0; s < ns; ++s) {
      const char* end = base[s] + (((c + 1) * rate[s]) >> 16);
      if constexpr (kTwoLevel) {
        for (; far[s] < end + kFar2; far[s] += 64) __builtin_prefetch(far[s], 0, 2);
        for (; near[s] < end + kNear; near[s] += 64) __builtin_prefetch(near[s], 0, 3);
      } else {
        for (; far[s] < end + kFar; far[s] += 64) __builtin_prefetch(far[s], 0, 3);
      }
    }
  }
};

#include "cpu/linear_store.h"  // store_out

#ifndef SPECRT_LINEAR_DOT_ONLY
// ---- fp32 family: NR weight rows x MR x rows, 16-element chunks
template <class Row, int NR, int MR>
static void tile_f32(const Problem& p, int64_t n, int64_t m0, bool stream) {
  Row row[NR];
  for (int r = 0; r < NR; ++r) row[r].init(p, n + r);
  const float* x = static_cast<const float*>(p.x) + m0 * p.ldx;
  const int64_t ldx = p.ldx;
  V acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = vzero();
  const int64_t nc = p.K / 16;
  constexpr bool kTwoLevel = MR >= 2;
  Prefetch pf;
  if (stream) pf.init(p, n, NR, nc, kTwoLevel);
  for (int64_t c = 0; c < nc; ++c) {
    pf.at<kTwoLevel>(c);
    V w[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) w[r] = row[r].chunk(c);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const V xv = load_f32(x + m * ldx + 16 * c);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = vfma(w[r], xv, acc[r][m]);
    }
  }
  const int rem = static_cast<int>(p.K % 16);
  if (rem) {
    V w[NR];
    for (int r = 0; r < NR; ++r) w[r] = row[r].tail(nc, rem);
    for (int m = 0; m < MR; ++m) {
      const V xv = load_f32_n(x + m * ldx + 16 * nc, rem);
      for (int r = 0; r < NR; ++r) acc[r][m] = vfma(w[r], xv, acc[r][m]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) store_out(p, m0 + m, n + r, vreduce(acc[r][m]));
}

// ---- group formats (K % 32 == 0): the same order as tile_f32, two chunks per step
template <class Row, int NR, int MR>
static void tile_group(const Problem& p, int64_t n, int64_t m0, bool stream) {
  Row row[NR];
  for (int r = 0; r < NR; ++r) row[r].init(p, n + r);
  const float* x = static_cast<const float*>(p.x) + m0 * p.ldx;
  const int64_t ldx = p.ldx;
  V acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = vzero();
  const int64_t ng = p.K / 32;
  constexpr bool kTwoLevel = MR >= 2;
  Prefetch pf;
  if (stream) pf.init(p, n, NR, 2 * ng, kTwoLevel);
  for (int64_t g0 = 0; g0 < ng; g0 += 16) {
    const int64_t g1 = (ng - g0 < 16) ? ng : g0 + 16;
    for (int r = 0; r < NR; ++r) row[r].widen(g0, static_cast<int>(g1 - g0));
    for (int64_t g = g0; g < g1; ++g) {
      pf.at<kTwoLevel>(2 * g + 1);
      V lo[NR], hi[NR];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) row[r].group(g, lo[r], hi[r]);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const V xl = load_f32(x + m * ldx + 32 * g);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) acc[r][m] = vfma(lo[r], xl, acc[r][m]);
        const V xh = load_f32(x + m * ldx + 32 * g + 16);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) acc[r][m] = vfma(hi[r], xh, acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) store_out(p, m0 + m, n + r, vreduce(acc[r][m]));
}
#endif  // SPECRT_LINEAR_DOT_ONLY

// ---- bf16 x bf16: 32-element chunks in the vdpbf16ps order
template <int NR, int MR>
static void tile_bf16dot(const Problem& p, int64_t n, int64_t m0, bool stream) {
  const uint16_t* w0 = static_cast<const uint16_t*>(p.w) + n * p.K;
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + m0 * p.ldx;
  const int64_t K = p.K, ldx = p.ldx;
  V acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = vzero();
  const int64_t nc = K / 32;
  constexpr bool kTwoLevel = MR >= 2;
  Prefetch pf;
  if (stream) pf.init(p, n, NR, nc, kTwoLevel);
  for (int64_t c = 0; c < nc; ++c) {
    pf.at<kTwoLevel>(c);
    BV w[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) w[r] = load_bv(w0 + r * K + 32 * c);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const BV xv = load_bv(x + m * ldx + 32 * c);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = vdp(acc[r][m], w[r], xv);
    }
  }
  const int rem = static_cast<int>(K % 32);
  if (rem) {
    BV w[NR];
    for (int r = 0; r < NR; ++r) w[r] = load_bv_n(w0 + r * K + 32 * nc, rem);
    for (int m = 0; m < MR; ++m) {
      const BV xv = load_bv_n(x + m * ldx + 32 * nc, rem);
      for (int r = 0; r < NR; ++r) acc[r][m] = vdp(acc[r][m], w[r], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) store_out(p, m0 + m, n + r, vreduce(acc[r][m]));
}

// ---- drivers: tiles over [n0, n1) x all M rows
#ifndef SPECRT_LINEAR_DOT_ONLY
template <class Row, int NR>
struct F32Tiles {
  template <int MR>
  static void tile(const Problem& p, int64_t n, int64_t m0, bool stream) { tile_f32<Row, NR, MR>(p, n, m0, stream); }
};

template <class Row, int NR>
struct GroupTiles {
  template <int MR>
  static void tile(const Problem& p, int64_t n, int64_t m0, bool stream) { tile_group<Row, NR, MR>(p, n, m0, stream); }
};
#endif

template <int NR>
struct DotTiles {
  template <int MR>
  static void tile(const Problem& p, int64_t n, int64_t m0, bool stream) { tile_bf16dot<NR, MR>(p, n, m0, stream); }
};

template <class T>
static void tile_mr(int mr, const Problem& p, int64_t n, int64_t m0, bool stream) {
  switch (mr) {  // kMR <= 6
    case 1: T::template tile<1>(p, n, m0, stream); break;
    case 2: if constexpr (kMR >= 2) T::template tile<2>(p, n, m0, stream); break;
    case 3: if constexpr (kMR >= 3) T::template tile<3>(p, n, m0, stream); break;
    case 4: if constexpr (kMR >= 4) T::template tile<4>(p, n, m0, stream); break;
    case 5: if constexpr (kMR >= 5) T::template tile<5>(p, n, m0, stream); break;
    case 6: if constexpr (kMR >= 6) T::template tile<6>(p, n, m0, stream); break;
    default: break;
  }
}

// x rows are taken in blocks of up to kMBlock (kept in cache while the weight
// rows stream), each split into near-equal tiles of at most kMR rows.
constexpr int64_t kMBlock = 96;

template <class Full, class One>
static void run_tiles(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t mb = 0; mb < p.M; mb += kMBlock) {
    const int64_t mlen = (p.M - mb < kMBlock) ? p.M - mb : kMBlock;
    const int64_t ntiles = (mlen + kMR - 1) / kMR;
    int64_t n = n0;
    for (; n + kNR <= n1; n += kNR) {
      int64_t m0 = mb;
      for (int64_t t = 0; t < ntiles; ++t) {
        const int mr = static_cast<int>((mlen - (m0 - mb) + (ntiles - t) - 1) / (ntiles - t));
        tile_mr<Full>(mr, p, n, m0, t == 0);
        m0 += mr;
      }
    }
    for (; n < n1; ++n) {
      int64_t m0 = mb;
      for (int64_t t = 0; t < ntiles; ++t) {
        const int mr = static_cast<int>((mlen - (m0 - mb) + (ntiles - t) - 1) / (ntiles - t));
        tile_mr<One>(mr, p, n, m0, t == 0);
        m0 += mr;
      }
    }
  }
}

// bf16 x with bf16 weights (checked by the caller)
static void run_dot(const Problem& p, int64_t n0, int64_t n1) { run_tiles<DotTiles<kNR>, DotTiles<1>>(p, n0, n1); }

#ifndef SPECRT_LINEAR_DOT_ONLY
static void run_problem(const Problem& p, int64_t n0, int64_t n1) {
  if (p.x_bf16) {
    run_dot(p, n0, n1);
    return;
  }
  switch (p.kind) {
    case WeightKind::kF32: run_tiles<F32Tiles<RowF32, kNR>, F32Tiles<RowF32, 1>>(p, n0, n1); break;
    case WeightKind::kBF16: run_tiles<F32Tiles<RowBF16, kNR>, F32Tiles<RowBF16, 1>>(p, n0, n1); break;
    case WeightKind::kInt8: run_tiles<F32Tiles<RowInt8, kNR>, F32Tiles<RowInt8, 1>>(p, n0, n1); break;
    case WeightKind::kQ8_0: run_tiles<GroupTiles<RowQ8_0, kNR>, GroupTiles<RowQ8_0, 1>>(p, n0, n1); break;
    case WeightKind::kQ4_0: run_tiles<GroupTiles<RowQ4_0, kNR>, GroupTiles<RowQ4_0, 1>>(p, n0, n1); break;
    case WeightKind::kQ4_1: run_tiles<GroupTiles<RowQ4_1, kNR>, GroupTiles<RowQ4_1, 1>>(p, n0, n1); break;
  }
}
#endif  // SPECRT_LINEAR_DOT_ONLY
