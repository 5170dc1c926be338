// The small-M linear kernel, portable C++: the same 16 lanes and operation order as
// the vector paths (linear_kernel.h), so every ISA returns identical bits. Used
// where the CPU has no AVX2/AVX-512, and by tests as the reference order.
#include <cmath>

#include "cpu/linear_kernel.h"

namespace specrt::linear {
namespace scalar_isa {
namespace {

constexpr int kNR = 1;
constexpr int kMR = 1;

struct V {
  float v[16];
};
struct BV {  // 16 (even, odd) bf16 pairs as fp32
  float even[16], odd[16];
};

inline float bits_f(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
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
inline void h2f16(const uint16_t* p, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = h2f(p[i]);
}
inline float bf2f(uint16_t h) { return bits_f(static_cast<uint32_t>(h) << 16); }

inline V vzero() { V r; for (int i = 0; i < 16; ++i) r.v[i] = 0.0f; return r; }
inline V vset1(float s) { V r; for (int i = 0; i < 16; ++i) r.v[i] = s; return r; }
inline V vadd(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] + b.v[i]; return a; }
inline V vsub(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] - b.v[i]; return a; }
inline V vmul(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] * b.v[i]; return a; }
inline V vfma(V a, V b, V c) { for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
inline float vreduce(V a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}

inline V load_f32_n(const float* p, int n) { V r = vzero(); for (int i = 0; i < n; ++i) r.v[i] = p[i]; return r; }
inline V load_f32(const float* p) { return load_f32_n(p, 16); }
inline V load_bf16_n(const uint16_t* p, int n) { V r = vzero(); for (int i = 0; i < n; ++i) r.v[i] = bf2f(p[i]); return r; }
inline V load_bf16(const uint16_t* p) { return load_bf16_n(p, 16); }
inline V load_i8_n(const int8_t* p, int n) { V r = vzero(); for (int i = 0; i < n; ++i) r.v[i] = static_cast<float>(p[i]); return r; }
inline V load_i8(const int8_t* p) { return load_i8_n(p, 16); }
inline V iota16() { V r; for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(i); return r; }
inline void lut16(const uint8_t* p, const V& table, V& lo, V& hi) {
  for (int i = 0; i < 16; ++i) {
    lo.v[i] = table.v[p[i] & 0xF];
    hi.v[i] = table.v[p[i] >> 4];
  }
}

inline BV load_bv_n(const uint16_t* p, int n) {
  BV r;
  for (int l = 0; l < 16; ++l) {
    r.even[l] = 2 * l < n ? bf2f(p[2 * l]) : 0.0f;
    r.odd[l] = 2 * l + 1 < n ? bf2f(p[2 * l + 1]) : 0.0f;
  }
  return r;
}
inline BV load_bv(const uint16_t* p) { return load_bv_n(p, 32); }
inline V vdp(V acc, const BV& w, const BV& x) {  // vdpbf16ps: odd pair element first
  for (int l = 0; l < 16; ++l) acc.v[l] = std::fma(w.even[l], x.even[l], std::fma(w.odd[l], x.odd[l], acc.v[l]));
  return acc;
}

#include "cpu/linear_tiles.h"

}  // namespace
}  // namespace scalar_isa

void linear_rows_scalar(const Problem& p, int64_t n0, int64_t n1) { scalar_isa::run_problem(p, n0, n1); }

}  // namespace specrt::linear
