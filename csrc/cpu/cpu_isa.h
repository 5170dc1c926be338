// csrc/cpu/cpu_isa.h — which vector instruction set the CPU kernels use.
//
// Every vectorized CPU path has a scalar twin and returns bit-identical results
// (docs/architecture.md section 1), so the choice only changes speed. The default is the
// best the running CPU supports; SPECRT_CPU_ISA=scalar|avx2|avx512 (read once)
// or the debug op specrt::set_cpu_isa forces one, so tests can run every path.
#pragma once

namespace specrt {

enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The instruction set the kernels use now.
CpuIsa cpu_isa();
// Whether this CPU (and this build) can run `isa`.
bool cpu_isa_supported(CpuIsa isa);
const char* cpu_isa_name(CpuIsa isa);

}  // namespace specrt
