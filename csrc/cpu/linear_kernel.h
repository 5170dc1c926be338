// csrc/cpu/linear_kernel.h — the small-M linear kernel's problem description and
// per-ISA entry points (torch-free; the torch glue is csrc/cpu/linear_cpu.cpp).
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), fp32 accumulation.
//
// The reduction order is fixed per output element, whatever M, the tiling or the
// thread count ("batch invariance"), and identical on every ISA of one machine:
//   * fp32 family (any weight format except bf16 x bf16): lane l of 16 accumulates
//     acc_l = fma(w[k], x[k], acc_l) for k = 16 c + l, c = 0, 1, ... (elements past K
//     are zero on both sides). The weight element is first dequantized to fp32
//     exactly as llama.cpp / gguf-py do (Q4_1: fl(fl(d * q) + m)), so a quantized
//     weight gives bit-for-bit the result of its dequantized fp32 weight.
//   * bf16 x bf16 (vdpbf16ps order): lane l accumulates per 32-element chunk c
//     acc_l = fma(w[k+2l], x[k+2l], fma(w[k+2l+1], x[k+2l+1], acc_l)), k = 32 c
//     (odd element first, as VDPBF16PS does; its denormal flushing is not emulated).
//   * in both, the 16 lanes are then summed as a fixed tree into s: s8[i] = a[i] + a[i+8],
//     s4[i] = s8[i] + s8[i+4], s2[i] = s4[i] + s4[i+2], s = s2[0] + s2[1];
//   * bf16 x bf16 on a CPU with usable AMX-BF16 and K even (the tdpbf16ps order, probed on
//     an Emerald Rapids Xeon: bench/results/2026-12-06-xeon/amx-order.txt): per 32-element chunk c,
//     e = (((w[k]x[k] + w[k+2]x[k+2]) + ...) + w[k+30]x[k+30]) over the even elements
//     k = 32 c, 32 c + 2, ..., o the same over the odd ones, s = s + (e + o), every step
//     rounded to fp32 (elements past K are zero; AMX's denormal flushing is not emulated).
//     The machine fixes the order, not the path: AMX tiles (linear_amx.cpp) serve every M,
//     and under a lowered ISA cap the portable twin (linear_amx_order.cpp) keeps its bits.
// Then y = s + bias (fp32), rounded to bf16 (nearest-even) for a bf16 output.
// Each output row is computed whole by one thread, so threads change nothing.

#pragma once

#include <cstdint>

namespace specrt::linear {

// Weight formats. Group formats use blocks of 32 consecutive input features per
// output row with fp16 scales (GGUF Q8_0 / Q4_0 / Q4_1). Q4 nibbles are packed as
// in GGUF: byte j of a group holds element j (low nibble) and element j + 16 (high).
enum class WeightKind : int32_t {
  kF32 = 0,   // float w[N][K]
  kBF16 = 1,  // bf16 w[N][K]
  kInt8 = 2,  // int8 q[N][K], fp32 scale[N]:        w = scale * q
  kQ8_0 = 3,  // int8 q[N][K], fp16 d[N][K/32]:       w = d * q
  kQ4_0 = 4,  // uint8 q[N][K/2], fp16 d[N][K/32]:    w = d * (q - 8)
  kQ4_1 = 5,  // uint8 q[N][K/2], fp16 d, m[N][K/32]: w = d * q + m
};

constexpr int kGroup = 32;  // elements per scale group (Q8_0 / Q4_0 / Q4_1)

struct Problem {
  int64_t M = 0, N = 0, K = 0;
  const void* x = nullptr;  // [M, K] rows ldx apart: float, or bf16 (uint16) when x_bf16
  int64_t ldx = 0;
  bool x_bf16 = false;      // only with kBF16 weights (the vdpbf16ps order); else x is float
  const void* w = nullptr;  // [N, ...] contiguous, layout per kind
  WeightKind kind = WeightKind::kF32;
  const void* scales = nullptr;  // kInt8: float[N]; group kinds: fp16 (uint16) [N][K/32]
  const uint16_t* mins = nullptr;  // kQ4_1: fp16 [N][K/32]
  const float* bias = nullptr;   // [N] or null
  void* y = nullptr;             // [M, N] contiguous: float, or bf16 (uint16) when y_bf16
  bool y_bf16 = false;
  const uint16_t* x_tiles = nullptr;  // the AMX path's x, packed by pack_x_tiles
};

// The AMX order applies: bf16 x bf16 with K even, on a CPU whose AMX-BF16 is usable.
inline bool amx_order(const Problem& p, bool amx_usable) { return amx_usable && p.x_bf16 && p.K % 2 == 0; }

// Compute output columns [n0, n1) of y for all M rows. All variants give
// bit-identical results (up to vdpbf16ps' denormal flushing).
void linear_rows_scalar(const Problem& p, int64_t n0, int64_t n1);
void linear_rows_avx2(const Problem& p, int64_t n0, int64_t n1);    // AVX2 + FMA + F16C
void linear_rows_avx512(const Problem& p, int64_t n0, int64_t n1);  // AVX-512 F/BW/VL + FMA + F16C
// AVX-512 + AVX512-BF16: vdpbf16ps for bf16 x bf16, else the avx512 path
void linear_rows_avx512bf16(const Problem& p, int64_t n0, int64_t n1);

// The AMX order (bf16 x bf16, K even). x is first packed as AMX B tiles: block b of x rows 16 b ..
// (h = min(16, M - 16 b) of them) at b * chunks * 512 elements, its chunk c of 32 features at
// c * 32 h, pair j at j * 2 h, row r at 2 r ([chunk][16 pairs][h rows][2] bf16). A tile reads rows
// 4 h bytes apart and exactly the pairs and rows written, so nothing is zeroed. pack_x_tiles_amx
// packs it all; pack_x_tiles rows [m0, m1) from chunk c0 on.
inline int64_t x_tile_elems(int64_t M, int64_t K) { return (K + 31) / 32 * 32 * M; }
void pack_x_tiles(const Problem& p, uint16_t* out, int64_t m0, int64_t m1, int64_t c0);
void pack_x_tiles_amx(const Problem& p, uint16_t* out);
void linear_rows_amx(const Problem& p, int64_t n0, int64_t n1);              // needs p.x_tiles
void linear_rows_amx_order_portable(const Problem& p, int64_t n0, int64_t n1);  // its portable twin

}  // namespace specrt::linear
