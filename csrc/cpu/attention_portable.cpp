// The portable tile update of the CPU paged-attention kernel (attention_cpu.cpp), compiled for the
// baseline ISA (fma is a libm call there) and for AVX2+FMA, and the chunk combine (also taken with
// AVX-512). The operations and their order are attention.h's, so every build returns the same bits.
#include <cmath>
#include <cstring>

#include "cpu/attention_tile.h"
#include "cpu/simd_target.h"

namespace specrt::attn_cpu {
namespace {

using attn::exp2_det;

__attribute__((always_inline)) inline void tile_portable(const Tile& t, LaneGroup& g, int D, int32_t window,
                                                         bool masked) {
  float s[kTileKeys][kLanes];
  for (int j = 0; j < t.n; ++j) {
    float a[kLanes] = {};
    const float* kj = t.k + j * t.stride;
    for (int d = 0; d < D; ++d) {
      const float kd = kj[d];
      const float* qd = g.qt + d * kLanes;
      for (int i = 0; i < kLanes; ++i) a[i] = std::fma(qd[i], kd, a[i]);
    }
    for (int i = 0; i < kLanes; ++i) s[j][i] = a[i];
  }
  if (masked) {
    for (int j = 0; j < t.n; ++j) {
      const int32_t kp = t.k0 + j;
      for (int i = 0; i < kLanes; ++i) {
        const bool visible = kp <= g.pos[i] && (window == 0 || kp > g.pos[i] - window) &&
                             (!g.tree || attn::tree_visible(g.pos[i], kp, g.tree_mask[i]));
        if (!visible) s[j][i] = kNegInf;
      }
    }
  }
  float m_safe[kLanes], alpha[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    float mt = kNegInf;
    for (int j = 0; j < t.n; ++j) mt = max_f(mt, s[j][i]);
    const float m_new = max_f(g.m[i], mt);
    m_safe[i] = m_new == kNegInf ? 0.0f : m_new;
    alpha[i] = exp2_det(g.m[i] - m_safe[i]);
    g.m[i] = m_new;
  }
  for (int j = 0; j < t.n; ++j)
    for (int i = 0; i < kLanes; ++i) s[j][i] = exp2_det(s[j][i] - m_safe[i]);
  for (int i = 0; i < kLanes; ++i) {
    float l = g.l[i] * alpha[i];
    for (int j = 0; j < t.n; ++j) l = l + s[j][i];
    g.l[i] = l;
  }
  for (int d = 0; d < D; ++d) {
    float o[kLanes];
    float* acc = g.acc + d * kLanes;
    for (int i = 0; i < kLanes; ++i) o[i] = acc[i] * alpha[i];
    for (int j = 0; j < t.n; ++j) {
      const float vd = t.v[j * t.stride + d];
      for (int i = 0; i < kLanes; ++i) o[i] = std::fma(s[j][i], vd, o[i]);
    }
    for (int i = 0; i < kLanes; ++i) acc[i] = o[i];
  }
}

// Chunk partials of one lane, stored [chunks][stride] as (m, l, acc[D]), combined in chunk order.
__attribute__((always_inline)) inline void combine_portable(const float* part, int64_t chunks, int64_t stride,
                                                            int D, float* a, float* out) {
  float big_m = kNegInf;
  for (int64_t c = 0; c < chunks; ++c) big_m = max_f(big_m, part[c * stride]);
  float big_l = 0.0f;
  for (int d = 0; d < D; ++d) a[d] = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = part + c * stride;
    const float w = exp2_det(p[0] - big_m);
    big_l = std::fma(p[1], w, big_l);
    for (int d = 0; d < D; ++d) a[d] = std::fma(p[2 + d], w, a[d]);
  }
  for (int d = 0; d < D; ++d) out[d] = a[d] / big_l;
}

// Cache elements -> float (exact for every kind).
__attribute__((always_inline)) inline void convert_portable(const void* src, int kind, int64_t n, float* dst) {
  if (kind == kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src);
  if (kind == kBF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = attn::bf16_bits_to_float(h[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = attn::half_bits_to_float(h[i]);
  }
}

}  // namespace

// The portable code compiled for the baseline ISA (fma is a libm call there) and for AVX2+FMA.
void tile_baseline(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  tile_portable(t, g, D, window, masked);
}
void combine_baseline(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out) {
  combine_portable(part, chunks, stride, D, a, out);
}
void convert_baseline(const void* src, int kind, int64_t n, float* dst) { convert_portable(src, kind, n, dst); }

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX2)
void tile_avx2(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  tile_portable(t, g, D, window, masked);
}
void combine_avx2(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out) {
  combine_portable(part, chunks, stride, D, a, out);
}
void convert_avx2(const void* src, int kind, int64_t n, float* dst) {
  convert_portable(src, kind, n, dst);
}
SPECRT_TARGET_END

// With AVX-512 the tiles and the conversion are attention_avx512.cpp's; the combine is this code.
SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX512)
void combine_avx512(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out) {
  combine_portable(part, chunks, stride, D, a, out);
}
SPECRT_TARGET_END

}  // namespace specrt::attn_cpu
