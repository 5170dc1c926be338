// csrc/cpu/scalar_lanes.h — 16 fp32 lanes in portable C++: the scalar "ISA" of the
// linear and fused kernels (linear_scalar.cpp, linear_dynamic_scalar.cpp,
// fused_scalar.cpp). Bit casts, exact fp16 / bf16 widening, lane arithmetic
// (std::fma, as the vector paths' FMA) and the fixed 16 -> 1 reduction tree of
// linear_kernel.h, so every ISA returns identical bits.
// Included inside a per-ISA anonymous namespace (like linear_tiles.h), after <cmath>
// and <cstdint>: each file gets its own internal copy.

struct V {
  float v[16];
};

inline float bits_f(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

// Exact fp16 -> fp32 (as F16C's vcvtph2ps: NaNs come back quiet).
inline float h2f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_f(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp == 0) {
    if (mant == 0) return bits_f(sign);
    int e = -1;  // subnormal: normalise
    do {
      mant <<= 1;
      ++e;
    } while (!(mant & 0x400u));
    return bits_f(sign | ((127u - 15u - e) << 23) | ((mant & 0x3FFu) << 13));
  }
  return bits_f(sign | ((exp + 127u - 15u) << 23) | (mant << 13));
}
inline float bf2f(uint16_t h) { return bits_f(static_cast<uint32_t>(h) << 16); }

inline V vzero() { V r; for (int i = 0; i < 16; ++i) r.v[i] = 0.0f; return r; }
inline V vset1(float s) { V r; for (int i = 0; i < 16; ++i) r.v[i] = s; return r; }
inline V vadd(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] + b.v[i]; return a; }
inline V vsub(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] - b.v[i]; return a; }
inline V vmul(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] * b.v[i]; return a; }
inline V vfma(V a, V b, V c) { for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }

// The fixed tree: lanes i + 8, then i + 4, then (0+2, 1+3), then the two halves.
inline float tree16(const float* a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}
inline float vreduce(V a) { return tree16(a.v); }

// first n elements (the rest 0)
inline V load_f32_n(const float* p, int n) { V r = vzero(); for (int i = 0; i < n; ++i) r.v[i] = p[i]; return r; }
inline V load_f32(const float* p) { return load_f32_n(p, 16); }
inline V load_bf16_n(const uint16_t* p, int n) { V r = vzero(); for (int i = 0; i < n; ++i) r.v[i] = bf2f(p[i]); return r; }
inline V load_bf16(const uint16_t* p) { return load_bf16_n(p, 16); }
