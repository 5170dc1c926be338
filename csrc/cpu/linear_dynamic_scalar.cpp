// The int8-activation mode of the small-M linear kernel, portable C++ (linear_dynamic.h):
// activation quantization (used by every ISA), the interleaved weight order, and the reference
// order of the dot products, which the AVX-512-VNNI path reproduces bit for bit.
#include <cmath>
#include <cstring>

#include "cpu/linear_dynamic.h"

namespace specrt::linear {
namespace {

#include "cpu/scalar_lanes.h"  // bits_f, h2f, tree16

// The integer weight operand of feature k (0..31) of block g of row n, as the VNNI path feeds it
// (unsigned): int8 / q8_0: w + 128 (P starts at -128 S_g to undo it); q4: the nibble 0..15.
int32_t wu(const DynProblem& p, int64_t n, int64_t g, int k) {
  const int B = block_bytes(p.kind);
  const uint8_t* row = static_cast<const uint8_t*>(p.w) + n * p.G * B;
  if (B == 32) return static_cast<int8_t>(row[interleaved_offset(p.G, B, g, k / 4, k % 4)]) + 128;
  const uint8_t b = row[interleaved_offset(p.G, B, g, (k & 15) / 4, k % 4)];
  return k < 16 ? (b & 0xF) : (b >> 4);
}

#include "cpu/linear_store.h"  // store_out

void store(const DynProblem& p, int64_t m, int64_t n, float y) { store_out(p, m, n, y); }

}  // namespace

void interleave_rows(const uint8_t* src, uint8_t* dst, int64_t G, int B, int64_t n0, int64_t n1, bool inverse) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* s = src + n * G * B;
    uint8_t* d = dst + n * G * B;
    for (int64_t g = 0; g < G; ++g)
      for (int t = 0; t < B / 4; ++t) {
        const int64_t a = g * B + 4 * t, b = interleaved_offset(G, B, g, t, 0);
        std::memcpy(d + (inverse ? a : b), s + (inverse ? b : a), 4);
      }
  }
}

void tail_activations(const DynProblem& p, int64_t m0, int64_t m1) {
  const int n2 = p.tail, q4 = block_bytes(p.kind) == 16;
  const int64_t s = p.S - 1, n = p.G - s * kSuper;
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* xs = act_row(p, m).q + s * 512;  // step j, lane l at 64 j + 4 l
    int8_t* dst = const_cast<int8_t*>(p.xt) + m * kTailBytes;
    std::memset(dst, 0, kTailBytes);
    for (int t = 0; t < (q4 ? 4 : 8); ++t)
      for (int64_t l = 0; l < n; ++l) {
        const int64_t lane = t * n2 + l;
        std::memcpy(dst + 4 * lane, xs + 64 * t + 4 * l, 4);
        if (q4) std::memcpy(dst + 128 + 4 * lane, xs + 64 * (t + 4) + 4 * l, 4);
      }
  }
}

void quantize_activations(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1) {
  const int64_t G = p.G, lanes = p.S * kSuper;
  const int shift = p.kind == WeightKind::kQ4_0 ? 3 : 7;  // corr = -(S << shift), q4_1: 0
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    const auto [q, dx, corr, e] = act_row(p, m);
    for (int64_t g = G; g < lanes; ++g) {  // lanes past the last block
      dx[g] = 0.0f;
      corr[g] = 0;
      e[g] = 0.0f;
      for (int k = 0; k < kGroup; ++k) q[(g / kSuper) * 512 + (k / 4) * 64 + (g % kSuper) * 4 + k % 4] = 0;
    }
    for (int64_t g = 0; g < G; ++g) {
      float amax = 0.0f;
      for (int k = 0; k < kGroup; ++k) {
        const float a = std::fabs(xr[32 * g + k]);
        amax = a > amax ? a : amax;
      }
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int k = 0; k < kGroup; ++k) {
        float v = std::nearbyint(xr[32 * g + k] * id);
        v = v != v ? 0.0f : (v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        q[(g / kSuper) * 512 + (k / 4) * 64 + (g % kSuper) * 4 + k % 4] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      dx[g] = d;
      e[g] = d * static_cast<float>(sum);
      corr[g] = p.kind == WeightKind::kQ4_1 ? 0 : -(sum * (1 << shift));
    }
  }
}

void dynamic_rows_scalar(const DynProblem& p, int64_t n0, int64_t n1) {
  const int64_t G = p.G;
  const uint16_t* d = static_cast<const uint16_t*>(p.scales);
  const bool int8 = p.kind == WeightKind::kInt8, q41 = p.kind == WeightKind::kQ4_1;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < p.M; ++m) {
      const auto [xq, dx, corr, e] = act_row(p, m);
      float acc[16] = {0};
      for (int64_t s = 0; s < p.S; ++s) {
        for (int l = 0; l < kSuper; ++l) {
          const int64_t g = s * kSuper + l;
          int32_t P = 0;
          float dw = 0.0f, mw = 0.0f;
          if (g < G) {
            P = corr[g];
            for (int k = 0; k < kGroup; ++k) P += wu(p, n, g, k) * xq[s * 512 + (k / 4) * 64 + l * 4 + k % 4];
            if (!int8) dw = h2f(d[n * G + g]);
            if (q41) mw = h2f(p.mins[n * G + g]);
          }
          const float sc = int8 ? dx[g] : dw * dx[g];
          acc[l] = std::fma(static_cast<float>(P), sc, acc[l]);
          if (q41) acc[l] = std::fma(mw, e[g], acc[l]);
        }
      }
      float y = tree16(acc);
      if (int8) y = static_cast<const float*>(p.scales)[n] * y;
      store(p, m, n, y);
    }
  }
}

}  // namespace specrt::linear
