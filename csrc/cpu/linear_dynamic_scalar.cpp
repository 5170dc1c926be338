// The int8-activation mode of the small-M linear kernel, portable C++ (linear_dynamic.h):
// activation quantization (used by every ISA) and the reference order of the dot products,
// which the AVX-512-VNNI path reproduces bit for bit.
#include <cmath>

#include "cpu/linear_dynamic.h"

namespace specrt::linear {
namespace {

#include "cpu/scalar_lanes.h"  // bits_f, h2f, tree16

// weight element k of group g of row n, as the integer the dot product uses
int32_t wq(const DynProblem& p, int64_t n, int64_t g, int k) {
  if (p.kind == WeightKind::kInt8 || p.kind == WeightKind::kQ8_0)
    return static_cast<const int8_t*>(p.w)[n * p.K + 32 * g + k];
  const uint8_t b = static_cast<const uint8_t*>(p.w)[n * (p.K / 2) + 16 * g + (k & 15)];
  return k < 16 ? (b & 0xF) : (b >> 4);
}

}  // namespace

void quantize_activations(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1) {
  const int64_t K = p.K, G = K / kGroup, row = p.pairs * 64, lanes = p.pairs * 16;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    const auto [q, dx16, sx8, e] = act_row(p, m);
    for (int64_t i = 0; i < lanes; ++i) {
      dx16[i] = 0.0f;
      sx8[i] = 0;
    }
    for (int64_t i = K; i < row; ++i) q[i] = 0;
    for (int64_t g = 0; g < G; ++g) {
      float amax = 0.0f;
      for (int k = 0; k < kGroup; ++k) {
        const float a = std::fabs(xr[32 * g + k]);
        amax = a > amax ? a : amax;
      }
      const float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
      int32_t sum = 0;
      for (int k = 0; k < kGroup; ++k) {
        float v = std::nearbyint(xr[32 * g + k] * id);
        v = v != v ? 0.0f : (v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        q[32 * g + k] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      e[g] = dx * static_cast<float>(sum);
      const int64_t lane0 = (g / 2) * 16 + (g % 2) * 8;
      for (int j = 0; j < 8; ++j) {
        dx16[lane0 + j] = dx;
        sx8[lane0 + j] = 8 * (q[32 * g + 4 * j] + q[32 * g + 4 * j + 1] + q[32 * g + 4 * j + 2] + q[32 * g + 4 * j + 3]);
      }
    }
  }
}

void dynamic_rows_scalar(const DynProblem& p, int64_t n0, int64_t n1) {
  const int64_t K = p.K, G = K / kGroup, row = p.pairs * 64, lanes = p.pairs * 16;
  const uint16_t* d = static_cast<const uint16_t*>(p.scales);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < p.M; ++m) {
      const int8_t* xq = p.xq + m * row;
      const float* dx16 = p.dx16 + m * lanes;
      const int32_t* sx8 = p.sx8 + m * lanes;
      float acc[16] = {0}, macc[16] = {0};
      for (int64_t pr = 0; pr < p.pairs; ++pr) {
        for (int l = 0; l < 16; ++l) {
          const int64_t g = 2 * pr + l / 8;
          const int j = l % 8;
          int32_t P = 0;
          float dw = 0.0f;
          if (g < G) {
            for (int t = 0; t < 4; ++t) P += wq(p, n, g, 4 * j + t) * xq[32 * g + 4 * j + t];
            if (p.kind == WeightKind::kQ4_0) P -= sx8[pr * 16 + l];
            dw = p.kind == WeightKind::kInt8 ? 0.0f : h2f(d[n * G + g]);
          }
          const float dx = dx16[pr * 16 + l];
          const float s = p.kind == WeightKind::kInt8 ? dx : dw * dx;
          acc[l] = std::fma(static_cast<float>(P), s, acc[l]);
        }
      }
      float y = tree16(acc);
      if (p.kind == WeightKind::kQ4_1) {
        const float* e = p.e + m * G;
        for (int64_t g = 0; g < G; ++g) macc[g % 16] = std::fma(h2f(p.mins[n * G + g]), e[g], macc[g % 16]);
        y = y + tree16(macc);
      } else if (p.kind == WeightKind::kInt8) {
        y = static_cast<const float*>(p.scales)[n] * y;
      }
      if (p.bias) y = y + p.bias[n];
      if (p.y_bf16) {
        uint32_t u;
        __builtin_memcpy(&u, &y, 4);
        static_cast<uint16_t*>(p.y)[m * p.N + n] =
            y != y ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
      } else {
        static_cast<float*>(p.y)[m * p.N + n] = y;
      }
    }
  }
}

}  // namespace specrt::linear
