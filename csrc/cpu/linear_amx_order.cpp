// The AMX order of bf16 x bf16 (linear_kernel.h) without AMX: the portable twin the tile path is
// tested against, and what runs under a lowered ISA cap on an AMX machine (so every path of one
// machine keeps the same bits); plus the x packing both the tile path and tests use.
#include <cstring>

#include "cpu/linear_kernel.h"

namespace specrt::linear {
namespace amx_portable {
namespace {

#include "cpu/linear_store.h"

inline float bf2f(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x . w in the AMX order: per chunk of 32, even and odd chains from zero, then s + (e + o).
// A bf16 product is exact in fp32, so e + a * b is one rounding whether or not it is contracted.
float dot(const uint16_t* x, const uint16_t* w, int64_t K) {
  float s = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const int64_t k1 = K - k0 < 32 ? K : k0 + 32;
    float e = 0.0f, o = 0.0f;
    for (int64_t k = k0; k < k1; k += 2) {
      e = e + bf2f(w[k]) * bf2f(x[k]);
      o = o + bf2f(w[k + 1]) * bf2f(x[k + 1]);  // K is even: k + 1 < k1
    }
    s = s + (e + o);
  }
  return s;
}

}  // namespace
}  // namespace amx_portable

void linear_rows_amx_order_portable(const Problem& p, int64_t n0, int64_t n1) {
  const auto* x = static_cast<const uint16_t*>(p.x);
  const auto* w = static_cast<const uint16_t*>(p.w);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < p.M; ++m) amx_portable::store_out(p, m, n, amx_portable::dot(x + m * p.ldx, w + n * p.K, p.K));
}

void pack_x_tiles(const Problem& p, uint16_t* out, int64_t m0, int64_t m1, int64_t c0) {
  const auto* x = static_cast<const uint16_t*>(p.x);
  const int64_t chunks = (p.K + 31) / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t b = m / 16, h = p.M - 16 * b < 16 ? p.M - 16 * b : 16;  // the block's rows
    uint16_t* block = out + b * chunks * 512 + (m % 16) * 2;  // [chunk][pair][h rows][2]
    const uint16_t* row = x + m * p.ldx;
    for (int64_t k = 32 * c0; k < p.K; k += 2) {
      uint16_t* dst = block + (k / 32) * 32 * h + ((k % 32) / 2) * 2 * h;
      dst[0] = row[k];
      dst[1] = row[k + 1];
    }
  }
}

}  // namespace specrt::linear
