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

#include "cpu/scalar_lanes.h"

struct BV {  // 16 (even, odd) bf16 pairs as fp32
  float even[16], odd[16];
};

inline void h2f16(const uint16_t* p, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = h2f(p[i]);
}
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
