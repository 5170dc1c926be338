// csrc/cpu/linear_cpu.h — torch entry points of the small-M linear kernel
// (csrc/cpu/linear_cpu.cpp). csrc/linear_ops.cpp validates the arguments first,
// so these may assume: x [M, K] float32 or bfloat16 with unit stride in K;
// weights / scales / mins contiguous and shaped for `kind`; bias float32 [N] or
// undefined; every tensor on the CPU.
#pragma once

#include "aten_min.h"

#include <string>
#include <vector>

#include "cpu/linear_kernel.h"

namespace specrt {

// y[M, N] in x's dtype. bf16 x with bf16 weights uses the vdpbf16ps order; any
// other bf16 x is widened to fp32 first (exact).
at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                            const at::Tensor& mins, const at::Tensor& bias, linear::WeightKind kind);

// The int8-activation mode (linear_dynamic.h): quantized weights (not kF32 / kBF16, K % 32 == 0) in
// the interleaved order (interleave_quant_weight_cpu) times x quantized per row and block of 32;
// AVX-512-VNNI when the CPU has it (and the ISA cap allows avx512), else the portable path (the same bits).
at::Tensor small_linear_dynamic_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                                    const at::Tensor& mins, const at::Tensor& bias, linear::WeightKind kind);
// A contiguous quantized weight [N, K or K/2] (K % 32 == 0) permuted into (inverse: out of) that order.
at::Tensor interleave_quant_weight_cpu(const at::Tensor& qweight, linear::WeightKind kind, bool inverse);
// The path small_linear_dynamic_cpu runs on now: "avx512vnni", "avx2" or "scalar".
std::string linear_dynamic_isa();

// ISAs this CPU can run under the cpu_isa() ceiling (cpu_isa.h), best first ("avx512bf16", "avx512",
// "avx2", "scalar").
std::vector<std::string> linear_isa_names();
// Cap the ISA the kernel uses (testing: all ISAs give identical bits); "" = best.
// Returns the previous cap.
std::string set_linear_isa(const std::string& name);

}  // namespace specrt
