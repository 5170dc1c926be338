// csrc/cpu/linear_tiles.h — the small-M linear kernel, written once over a vector
// policy. Included (inside a per-ISA namespace) by linear_{scalar,avx2,avx512,
// avx512bf16}.cpp after they define:
//   V (16 fp32 lanes): vzero, vset1, vadd, vsub, vmul, vfma(a, b, c) = a*b + c,
//     vreduce (the fixed tree of linear_kernel.h), and loaders into fp32 lanes:
//     load_f32[_n], load_bf16[_n], load_i8[_n] (first n elements, rest 0),
//     load_q4(p, half) (16 packed bytes -> low (half 0) or high (half 1) nibbles);
//   BV (32 bf16 for the vdpbf16ps order): load_bv[_n], vdp(acc, w, x);
//   h2f (exact fp16 -> fp32) and the tile sizes kNR (weight rows) and kMR (x rows).
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

struct RowQ8_0 {  // w = d * q
  const int8_t* q;
  const uint16_t* d;
  void init(const Problem& p, int64_t n) {
    q = static_cast<const int8_t*>(p.w) + n * p.K;
    d = static_cast<const uint16_t*>(p.scales) + n * (p.K / kGroup);
  }
  V chunk(int64_t c) const { return vmul(load_i8(q + 16 * c), vset1(h2f(d[c >> 1]))); }
  V tail(int64_t, int) const { return vzero(); }  // K % 32 == 0: never called
};

struct RowQ4_0 {  // w = d * (q - 8)
  const uint8_t* q;
  const uint16_t* d;
  void init(const Problem& p, int64_t n) {
    q = static_cast<const uint8_t*>(p.w) + n * (p.K / 2);
    d = static_cast<const uint16_t*>(p.scales) + n * (p.K / kGroup);
  }
  V chunk(int64_t c) const {
    return vmul(vsub(load_q4(q + 16 * (c >> 1), static_cast<int>(c & 1)), vset1(8.0f)), vset1(h2f(d[c >> 1])));
  }
  V tail(int64_t, int) const { return vzero(); }
};

struct RowQ4_1 {  // w = fl(fl(d * q) + m): no fused multiply-add, as gguf-py dequantizes
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  void init(const Problem& p, int64_t n) {
    q = static_cast<const uint8_t*>(p.w) + n * (p.K / 2);
    d = static_cast<const uint16_t*>(p.scales) + n * (p.K / kGroup);
    m = p.mins + n * (p.K / kGroup);
  }
  V chunk(int64_t c) const {
    return vadd(vmul(load_q4(q + 16 * (c >> 1), static_cast<int>(c & 1)), vset1(h2f(d[c >> 1]))),
                vset1(h2f(m[c >> 1])));
  }
  V tail(int64_t, int) const { return vzero(); }
};

#endif  // SPECRT_LINEAR_DOT_ONLY

// ---- output: y = s + bias, stored as fp32 or rounded to bf16 (nearest-even, NaN kept)
static inline void store_out(const Problem& p, int64_t m, int64_t n, float s) {
  if (p.bias) s = s + p.bias[n];
  if (!p.y_bf16) {
    static_cast<float*>(p.y)[m * p.N + n] = s;
    return;
  }
  uint32_t u;
  __builtin_memcpy(&u, &s, 4);
  const uint16_t h = (s != s) ? static_cast<uint16_t>(0x7FC0)
                              : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  static_cast<uint16_t*>(p.y)[m * p.N + n] = h;
}

#ifndef SPECRT_LINEAR_DOT_ONLY
// ---- fp32 family: NR weight rows x MR x rows, 16-element chunks
template <class Row, int NR, int MR>
static void tile_f32(const Problem& p, int64_t n, int64_t m0) {
  Row row[NR];
  for (int r = 0; r < NR; ++r) row[r].init(p, n + r);
  const float* x = static_cast<const float*>(p.x) + m0 * p.ldx;
  const int64_t ldx = p.ldx;
  V acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = vzero();
  const int64_t nc = p.K / 16;
  for (int64_t c = 0; c < nc; ++c) {
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

#endif  // SPECRT_LINEAR_DOT_ONLY

// ---- bf16 x bf16: 32-element chunks in the vdpbf16ps order
template <int NR, int MR>
static void tile_bf16dot(const Problem& p, int64_t n, int64_t m0) {
  const uint16_t* w0 = static_cast<const uint16_t*>(p.w) + n * p.K;
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + m0 * p.ldx;
  const int64_t K = p.K, ldx = p.ldx;
  V acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = vzero();
  const int64_t nc = K / 32;
  for (int64_t c = 0; c < nc; ++c) {
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
  static void tile(const Problem& p, int64_t n, int64_t m0) { tile_f32<Row, NR, MR>(p, n, m0); }
};
#endif

template <int NR>
struct DotTiles {
  template <int MR>
  static void tile(const Problem& p, int64_t n, int64_t m0) { tile_bf16dot<NR, MR>(p, n, m0); }
};

template <class T>
static void tile_mr(int mr, const Problem& p, int64_t n, int64_t m0) {
  switch (mr) {  // kMR <= 6
    case 1: T::template tile<1>(p, n, m0); break;
    case 2: if constexpr (kMR >= 2) T::template tile<2>(p, n, m0); break;
    case 3: if constexpr (kMR >= 3) T::template tile<3>(p, n, m0); break;
    case 4: if constexpr (kMR >= 4) T::template tile<4>(p, n, m0); break;
    case 5: if constexpr (kMR >= 5) T::template tile<5>(p, n, m0); break;
    case 6: if constexpr (kMR >= 6) T::template tile<6>(p, n, m0); break;
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
        tile_mr<Full>(mr, p, n, m0);
        m0 += mr;
      }
    }
    for (; n < n1; ++n) {
      int64_t m0 = mb;
      for (int64_t t = 0; t < ntiles; ++t) {
        const int mr = static_cast<int>((mlen - (m0 - mb) + (ntiles - t) - 1) / (ntiles - t));
        tile_mr<One>(mr, p, n, m0);
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
    case WeightKind::kQ8_0: run_tiles<F32Tiles<RowQ8_0, kNR>, F32Tiles<RowQ8_0, 1>>(p, n0, n1); break;
    case WeightKind::kQ4_0: run_tiles<F32Tiles<RowQ4_0, kNR>, F32Tiles<RowQ4_0, 1>>(p, n0, n1); break;
    case WeightKind::kQ4_1: run_tiles<F32Tiles<RowQ4_1, kNR>, F32Tiles<RowQ4_1, 1>>(p, n0, n1); break;
  }
}
#endif  // SPECRT_LINEAR_DOT_ONLY
