// csrc/cpu/cpu_isa.h — the one CPU feature detector and the one instruction-set knob.
//
// cpu_features() detects the CPU once. cpu_isa() is the instruction-set ceiling of every CPU
// kernel: the best the CPU runs, unless SPECRT_CPU_ISA=scalar|avx2|avx512 (read once) or the
// debug op specrt::set_cpu_isa lowers it. The sampling, tree and fused kernels run on it; the
// attention and linear kernels take their best path at or below it (their testing hooks
// _attention_cpu_isa and set_linear_isa pick a lower one). Every vectorized path has a scalar
// twin with bit-identical results (docs/architecture.md section 1): the choice only changes speed.
#pragma once

namespace specrt {

// What the kernels branch on, from the CPU (all false off x86-64).
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512bf16 = false;
  // Intel AMX tiles with BF16 multiplies, usable: the CPU has them, the OS saves their state, and
  // the process was granted their data (Linux arch_prctl ARCH_REQ_XCOMP_PERM, asked at detection)
  bool amx_bf16 = false;
  bool amd = false;  // vendor: the attention kernel's preferred level differs (attention_cpu.cpp)
};

// Detected on first use, then constant.
const CpuFeatures& cpu_features();

// kAvx2 needs AVX2 + FMA + F16C; kAvx512 that plus AVX-512 F/BW/VL/DQ.
enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The ceiling in use now.
CpuIsa cpu_isa();
// Whether this CPU (and this build) can run `isa`.
bool cpu_isa_supported(CpuIsa isa);
const char* cpu_isa_name(CpuIsa isa);

}  // namespace specrt
