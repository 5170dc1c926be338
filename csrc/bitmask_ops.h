// csrc/bitmask_ops.h — the apply_token_bitmask op: a grammar's allowed tokens,
// packed 32 per int32 word, applied in place to the logits of many rows at once
// (schema and checks in csrc/bitmask_ops.cpp, kernels in csrc/cpu/bitmask_cpu.cpp
// and csrc/cuda/bitmask_cuda.cu, the rule in csrc/include/specrt/bitmask.h).
//
// Bitmask row i belongs to logits row rows[i]: every token t < V whose bit is 0
// there becomes -inf. Words past V / 32 (a tokenizer wider than the logits) and
// bits past V are never read.
#pragma once

#include "aten_min.h"

#include <cstdint>

namespace specrt {

// Arguments after check_apply_token_bitmask: contiguous, on the logits' device.
struct BitmaskArgs {
  at::Tensor logits;   // [R, V] float32, bfloat16, float16 or float64, mutated
  at::Tensor bitmask;  // [n, W] int32, W >= ceil(V / 32)
  at::Tensor rows;     // [n] int32: the logits row of each bitmask row
};

BitmaskArgs check_apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows,
                                      bool check_values);

// Unchecked values stay in bounds: a bitmask row whose logits row is outside
// [0, R) is skipped. A row named twice gets both masks (writes store -inf only).
void apply_token_bitmask_cpu(const BitmaskArgs& args);
#ifdef SPECRT_WITH_CUDA
void apply_token_bitmask_cuda(const BitmaskArgs& args);
#endif

// The op body of one backend (registered for CPU and CUDA): the checks, then the kernel.
template <void (*Kernel)(const BitmaskArgs&)>
void apply_token_bitmask_op(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows,
                            bool check_values) {
  const BitmaskArgs a = check_apply_token_bitmask(logits, bitmask, rows, check_values);
  if (a.rows.size(0) > 0 && a.logits.size(1) > 0) Kernel(a);
}

}  // namespace specrt
