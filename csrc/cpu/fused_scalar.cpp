// The fused decoder kernels, portable C++: the same 16 lanes and operation order as
// the vector paths (fused_rows.h), so every ISA returns identical bits. Used where
// the CPU has neither AVX2 nor AVX-512, and by tests as the reference order.
#include <cmath>

#include "cpu/fused_kernel.h"

namespace specrt::fused {
namespace scalar_isa {
namespace {

#include "cpu/scalar_lanes.h"

#define SPECRT_LANES(expr) \
  V r;                     \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr); \
  return r

inline V vdiv(V a, V b) { SPECRT_LANES(a.v[i] / b.v[i]); }
inline V vmax(V a, V b) { SPECRT_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline V vmin(V a, V b) { SPECRT_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
inline V vrint(V a) { SPECRT_LANES(std::nearbyint(a.v[i])); }
inline V vpow2i(V n) { SPECRT_LANES(bits_f(static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23)); }
inline V vselect_gt(V x, V t, V a, V b) { SPECRT_LANES(x.v[i] > t.v[i] ? a.v[i] : b.v[i]); }
inline V vround_bf16(V a) {
  V r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t u = f_bits(a.v[i]);
    r.v[i] = a.v[i] != a.v[i] ? bits_f(0x7FC00000u) : bits_f((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  }
  return r;
}
#undef SPECRT_LANES

inline void store_f32_n(float* p, V v, int n) {
  for (int i = 0; i < n; ++i) p[i] = v.v[i];
}
inline void store_bf16_n(uint16_t* p, V v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint16_t>(f_bits(v.v[i]) >> 16);
}

#include "cpu/fused_rows.h"

}  // namespace
}  // namespace scalar_isa

void rms_norm_rows_scalar(const NormProblem& p, int64_t t0, int64_t t1) { scalar_isa::run_norm(p, t0, t1); }
void silu_mul_rows_scalar(const SiluMulProblem& p, int64_t t0, int64_t t1) { scalar_isa::run_silu_mul(p, t0, t1); }
void rotary_rows_scalar(const RotaryProblem& p, int64_t t0, int64_t t1) { scalar_isa::run_rotary(p, t0, t1); }

}  // namespace specrt::fused
