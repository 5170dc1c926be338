// csrc/cpu/linear_dynamic.h — quantized weights x dynamically int8-quantized activations
// (an opt-in mode of the small-M linear kernel; torch-free; glue in linear_cpu.cpp).
//
// Activations: each row of x is quantized per block g of 32 features (llama.cpp's Q8_1 idea):
//   amax = max |x|, dx_g = amax / 127, id = dx_g ? 1 / dx_g : 0, xq = clamp(rint(x * id), -127, 127),
//   S_g = sum(xq of the block) (exact int), e_g = dx_g * float(S_g).
// Weights keep their format (int8 per row, Q8_0, Q4_0, Q4_1; K % 32 == 0) but are stored in the
// super-block interleaved order below. Blocks are taken 16 at a time ("super-block" s: blocks
// g = 16 s + l, l = 0..15, the last one possibly shorter); lane l of 16 owns block 16 s + l:
//   P_g = sum over the block of wq * xq, exact in int32 (q8_0 / int8: the int8 weight; q4_0: q - 8;
//         q4_1: the nibble q), accumulated over several vpdpbusd before any float work;
//   acc_l = fma(float(P_g), s_g, acc_l), s_g = dx_g for int8, fl(d_g * dx_g) otherwise;
//   q4_1 then acc_l = fma(m_g, e_g, acc_l) (its min term, same lane, right after);
// for s = 0, 1, ...; lanes past the last block get fma(0, 0, acc_l). Each output is
//   int8: y = scale[n] * R(acc)    q8_0 / q4_0 / q4_1: y = R(acc)
// where R is the fixed 16-lane tree of linear_kernel.h, then + bias. Integer sums are exact, so
// the AVX-512-VNNI, AVX2 and portable paths give the same bits for any row count, tiling or
// thread count (specrt/ops/reference.py reproduces them in torch). Results differ from the float kernel
// by the activation rounding (~0.5% of |y| on random data): opt-in only, never the default.
//
// Interleaved weight order (a permutation of each row's bytes, same shape and dtype; made once at
// load / prepare() by ops.interleave_quant_weight): a super-block of n blocks (n = 16 except maybe
// the last) of B bytes each (B = 16 for q4, 32 for int8 / q8_0) is stored as B/4 steps t, each
// holding 4 bytes per block: byte (t * n + l) * 4 + c = byte 4 t + c of block l. A q4 step t's low
// nibbles are features 4t..4t+3 of each block, its high nibbles features 16+4t..16+4t+3 (GGUF's
// nibble order). One 64-byte vector of a full super-block thus feeds one vpdpbusd per lane-block.
//
// Compact tail (the SIMD paths; same bits): when the last super-block holds only n = G % 16 blocks,
// 1 <= n <= 8 (SmolLM2's K = 576: 16 + 2 blocks), full-width steps would leave 16 - n lanes idle.
// Its weight dwords (dword t n + l = step t of block l, as stored) are instead spread over lanes
// L = t n2 + l (n2 = the power of two >= n; lanes with l >= n zero), several steps per vector, and x
// is prepared in that order once per call (DynProblem::xt); the per-lane integer sums are then
// folded (lane i += lane i + k, k = 8, 4, .., n2) into lanes 0..n-1 before the usual float step.
// Integer sums are exact, so P_g, and every bit after it, is what the full-width step gives.
#pragma once

#include <cstdint>

#include "cpu/linear_kernel.h"

namespace specrt::linear {

constexpr int kSuper = 16;  // blocks per super-block (one per lane)

struct DynProblem {
  int64_t M = 0, N = 0, K = 0, G = 0, S = 0;  // G = K / 32 blocks, S = ceil(G / 16) super-blocks
  // activations, per row m and super-block s (lanes past G zero):
  const int8_t* xq = nullptr;     // [M][S][8][16][4]: step j, lane l: xq of block 16 s + l, features 4j..4j+3
  const float* dx = nullptr;      // [M][S * 16] dx_g
  const int32_t* corr = nullptr;  // [M][S * 16] what P_g starts from: -128 S_g (int8 / q8_0: weights fed as
                                  // w + 128), -8 S_g (q4_0: the nibble's offset), 0 (q4_1)
  const float* e = nullptr;       // [M][S * 16] e_g (q4_1's min term)
  const void* w = nullptr;        // [N][K or K/2] in the interleaved order above
  WeightKind kind = WeightKind::kInt8;
  const void* scales = nullptr;   // int8: float [N]; else fp16 [N][G]
  const uint16_t* mins = nullptr; // q4_1: fp16 [N][G]
  const float* bias = nullptr;
  void* y = nullptr;              // [M, N] float or bf16
  bool y_bf16 = false;
  int tail = 0;                   // n2 of the compact tail (0: none; SIMD paths only)
  const int8_t* xt = nullptr;     // [M][kTailBytes]: the tail's x in lane order L = t n2 + l (tail_activations)
};

// The compact tail's lanes per step n2 for G blocks (0: no tail, or one too wide to compact).
static inline int tail_lanes(int64_t G) {
  const int n = static_cast<int>(G % kSuper);
  int n2 = 1;
  while (n2 < n) n2 <<= 1;
  return n == 0 || n > 8 ? 0 : n2;
}
// xt per x row: q4: dwords [0, 32) pair with each weight dword's low nibbles (lane L = t n2 + l: block
// l, x step t), dwords [32, 64) with its high nibbles (x step t + 4); int8 / q8_0: dwords [0, 64),
// lane L: block l, x step t. Zero elsewhere (int8 weights are fed offset by 128: pads must meet x = 0).
constexpr int kTailBytes = 256;
void tail_activations(const DynProblem& p, int64_t m0, int64_t m1);

// Row m's slices of p's activation buffers (what quantize_activations* write).
struct ActRow {
  int8_t* q;       // [S * 512]
  float* dx;       // [S * 16]
  int32_t* corr;   // [S * 16]
  float* e;        // [S * 16]
};
static inline ActRow act_row(const DynProblem& p, int64_t m) {
  const int64_t lanes = p.S * kSuper;
  return {const_cast<int8_t*>(p.xq) + m * lanes * 32, const_cast<float*>(p.dx) + m * lanes,
          const_cast<int32_t*>(p.corr) + m * lanes, const_cast<float*>(p.e) + m * lanes};
}

// Bytes per block of a weight row (16 for q4, 32 otherwise).
static inline int block_bytes(WeightKind kind) {
  return kind == WeightKind::kQ4_0 || kind == WeightKind::kQ4_1 ? 16 : 32;
}
// Offset of byte c of step t of block g within an interleaved row of G blocks (B bytes each).
static inline int64_t interleaved_offset(int64_t G, int B, int64_t g, int t, int c) {
  const int64_t s = g / kSuper, n = G - s * kSuper < kSuper ? G - s * kSuper : kSuper;
  return s * kSuper * B + (t * n + (g - s * kSuper)) * 4 + c;
}
// Permute rows [n0, n1) of a weight (G blocks of B bytes per row) into (or, inverse, out of) that order.
void interleave_rows(const uint8_t* src, uint8_t* dst, int64_t G, int B, int64_t n0, int64_t n1, bool inverse);

// Quantize rows [m0, m1) of x (float [M, K], rows ldx apart) into p's buffers (scalar: exact IEEE ops).
void quantize_activations(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1);
void quantize_activations_avx512(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1);
void quantize_activations_avx2(const float* x, int64_t ldx, const DynProblem& p, int64_t m0, int64_t m1);
// Output columns [n0, n1) of y for all M rows.
void dynamic_rows_scalar(const DynProblem& p, int64_t n0, int64_t n1);
void dynamic_rows_avx512vnni(const DynProblem& p, int64_t n0, int64_t n1);  // AVX-512 F/BW/VL + VNNI + F16C
void dynamic_rows_avx2(const DynProblem& p, int64_t n0, int64_t n1);        // AVX2 + FMA + F16C

}  // namespace specrt::linear
