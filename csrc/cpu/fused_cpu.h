// csrc/cpu/fused_cpu.h — torch entry points of the fused decoder kernels
// (csrc/cpu/fused_cpu.cpp). csrc/fused_ops.cpp validates the arguments first, so
// these may assume CPU tensors of float32 / bfloat16 with the documented shapes,
// unit stride in the last dim, and slot values in range.
#pragma once

#include "aten_min.h"

namespace specrt {

// weight * rms_norm(x) [T, H] in x's dtype; with `residual` defined, residual += x
// first (in place) and the sum is normalized.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& residual);
// silu(x[:, :I]) * x[:, I:] -> [T, I]
at::Tensor silu_mul_cpu(const at::Tensor& x);
// RoPE on q (returned [T, H, D] in q_dtype) and k (in place in qkv); then k and v of
// every row with slot >= 0 are stored into kv_cache[layer] (converted to its dtype).
at::Tensor rotary_write_kv_cpu(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                               int64_t num_kv_heads, at::Tensor& kv_cache, int64_t layer,
                               const at::Tensor& slot_mapping, at::ScalarType q_dtype);

}  // namespace specrt
