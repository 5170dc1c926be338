// csrc/cpu/fused_kernel.h — the decoder's fused elementwise CPU kernels: problem
// descriptions and per-ISA entry points (torch-free; the torch glue is
// csrc/cpu/fused_cpu.cpp, the schemas and checks csrc/fused_ops.cpp).
//
//   rms_norm      out = w * round(x * 1/sqrt(mean(x^2) + eps))
//   add_rms_norm  residual = round(residual + x); out = rms_norm(residual)
//   silu_mul      out = round(round(silu(g)) * u) for x = [g | u]
//   rotary        q, k = x * cos + rotate_half(x) * sin (each product rounded); k and v
//                 are then stored into the paged KV cache
//
// "round" is rounding to the tensors' dtype (nothing for float32, nearest-even to
// bfloat16), placed exactly where transformers' bf16 modules round, so a bf16 model
// sees the values of the op-by-op torch code. Each row is computed by one thread with
// a fixed operation order, identical on every ISA (16 fp32 lanes; the sum of squares
// as lane l += x[16c + l]^2, then the fixed tree of linear_kernel.h), so results do not
// depend on the number of rows, the thread count or the instruction set. silu uses
// its own exp (Cephes' expf polynomial, < 2 ulp), not libm's.
#pragma once

#include <cstdint>

namespace specrt::fused {

enum class Dtype : int32_t { kF32 = 0, kBF16 = 1 };

struct NormProblem {
  int64_t T = 0, H = 0;
  const void* x = nullptr;       // [T, H] rows ldx apart
  int64_t ldx = 0;
  void* residual = nullptr;      // [T, H] rows ldr apart, or null (plain rms_norm)
  int64_t ldr = 0;
  const void* weight = nullptr;  // [H]
  float eps = 0.0f;
  void* out = nullptr;           // [T, H] contiguous
  Dtype dtype = Dtype::kF32;     // of x, residual, weight and out
};

struct SiluMulProblem {
  int64_t T = 0, I = 0;
  const void* x = nullptr;  // [T, 2I] rows ldx apart: gate | up
  int64_t ldx = 0;
  void* out = nullptr;      // [T, I] contiguous
  Dtype dtype = Dtype::kF32;
};

struct RotaryProblem {
  int64_t T = 0, H = 0, Hkv = 0, D = 0;
  void* qkv = nullptr;        // [T, (H + 2 Hkv) D] rows ldqkv apart; k is rotated in place
  int64_t ldqkv = 0;
  Dtype dtype = Dtype::kF32;  // of qkv, cos and sin
  const void* cos = nullptr;  // [T, D] rows ldcs apart
  const void* sin = nullptr;
  int64_t ldcs = 0;
  void* q = nullptr;          // [T, H, D] contiguous: the rotated q (rounded to dtype first)
  Dtype q_dtype = Dtype::kF32;
};

// Rows [t0, t1) of each problem. All variants give bit-identical results.
void rms_norm_rows_scalar(const NormProblem& p, int64_t t0, int64_t t1);
void rms_norm_rows_avx2(const NormProblem& p, int64_t t0, int64_t t1);
void rms_norm_rows_avx512(const NormProblem& p, int64_t t0, int64_t t1);
void silu_mul_rows_scalar(const SiluMulProblem& p, int64_t t0, int64_t t1);
void silu_mul_rows_avx2(const SiluMulProblem& p, int64_t t0, int64_t t1);
void silu_mul_rows_avx512(const SiluMulProblem& p, int64_t t0, int64_t t1);
void rotary_rows_scalar(const RotaryProblem& p, int64_t t0, int64_t t1);
void rotary_rows_avx2(const RotaryProblem& p, int64_t t0, int64_t t1);
void rotary_rows_avx512(const RotaryProblem& p, int64_t t0, int64_t t1);

}  // namespace specrt::fused
