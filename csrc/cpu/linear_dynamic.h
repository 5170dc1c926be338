// csrc/cpu/linear_dynamic.h — quantized weights x dynamically int8-quantized activations
// (an opt-in mode of the small-M linear kernel; torch-free; glue in linear_cpu.cpp).
//
// Activations: each row of x is quantized per block g of 32 features (llama.cpp's Q8_1 idea):
//   amax = max |x|, dx_g = amax / 127, id = dx_g ? 1 / dx_g : 0, xq = clamp(rint(x * id), -127, 127),
//   e_g = dx_g * sum(xq of the block).
// Weights keep their format (int8 per row, Q8_0, Q4_0, Q4_1; K % 32 == 0). Each output is
//   int8: y = scale[n] * R(acc)   q8_0 / q4_0: y = R(acc)   q4_1: y = R(acc) + R(macc)
// where R is the fixed 16-lane tree of linear_kernel.h and, for pair p of blocks (2p, 2p+1),
// lane l = 8h + j (block g = 2p + h, features 4j..4j+3 of it):
//   P = sum_t wq[4j+t] * xq[4j+t] (exact int; q4 nibbles 0..15, q4_0 then minus 8 * sum_t xq[4j+t]),
//   acc_l = fma(float(P), s_g, acc_l), s_g = dx_g for int8, fl(d_g * dx_g) otherwise;
// and macc_l accumulates fma(m_g, e_g, macc_l) over blocks g with g % 16 == l (q4_1's mins).
// A block past K (odd block count) contributes fma(0, 0, acc). Integer sums are exact, so the
// AVX-512-VNNI path (vpdpbusd) and the portable one give the same bits, for any row count,
// tiling or thread count. Results differ from the float kernel by the activation rounding
// (~0.5% of |y| on random data): opt-in only, never the default.
#pragma once

#include <cstdint>

#include "cpu/linear_kernel.h"

namespace specrt::linear {

struct DynProblem {
  int64_t M = 0, N = 0, K = 0, pairs = 0;  // pairs = ceil(K / 64)
  const int8_t* xq = nullptr;     // [M][pairs * 64] quantized x (zero padded)
  const float* dx16 = nullptr;    // [M][pairs * 16] lane l of pair p: dx of block 2p + l / 8 (0 past K)
  const int32_t* sx8 = nullptr;   // [M][pairs * 16] 8 * sum of xq[4j..4j+3] of that lane's block (q4_0)
  const float* e = nullptr;       // [M][K / 32] dx * sum(xq) per block (q4_1)
  const void* w = nullptr;        // weights as in Problem
  WeightKind kind = WeightKind::kInt8;
  const void* scales = nullptr;
  const uint16_t* mins = nullptr;
  const float* bias = nullptr;
  void* y = nullptr;              // [M, N] float or bf16
  bool y_bf16 = false;
};

// Row m's slices of p's activation buffers (what quantize_activations* write).
struct ActRow {
  int8_t* q;      // [pairs * 64]
  float* dx16;    // [pairs * 16]
  int32_t* sx8;   // [pairs * 16]
  float* e;       // [K / 32]
};
static inline ActRow act_row(const DynProblem& p, int64_t m) {
  const int64_t lanes = p.pairs * 16;
  return {const_cast<int8_t*>(p.xq) + m * p.pairs * 64, const_cast<float*>(p.dx16) + m * lanes,
          const_cast<int32_t*>(p.sx8) + m * lanes, const_cast<float*>(p.e) + m * (p.K / kGroup)};
}

// Quantize rows [m0, m1) of x (float [M, K], rows ldx apart) into p's buffers (scalar: exact IEEE ops).
void quantize_activations(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1);
void quantize_activations_avx512(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1);
// Output columns [n0, n1) of y for all M rows.
void dynamic_rows_scalar(const DynProblem& p, int64_t n0, int64_t n1);
void dynamic_rows_avx512vnni(const DynProblem& p, int64_t n0, int64_t n1);  // AVX-512 F/BW/VL + VNNI + F16C

}  // namespace specrt::linear
