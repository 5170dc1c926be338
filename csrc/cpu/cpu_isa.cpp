// The one CPU feature detector and instruction-set knob (csrc/cpu/cpu_isa.h), and the debug
// ops that expose them to tests:
//   specrt::cpu_isa() -> str            the ceiling in use
//   specrt::set_cpu_isa(str isa) -> str force "scalar" | "avx2" | "avx512", or
//                                       "auto" (SPECRT_CPU_ISA, else the best)
//   specrt::cpu_features() -> str[]     the detected features (cpu_features' true fields)
//   specrt::cpu_exponential_noise(Tensor u) -> Tensor
//                                       -log_det(u) on the path in use (tests)
#include "cpu/cpu_isa.h"

#include "aten_min.h"
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "cpu/race.h"
#include "cpu/simd_target.h"  // SPECRT_AMX_BUILD

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace specrt {
namespace {

constexpr int kUnresolved = -1;
std::atomic<int> g_isa{kUnresolved};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// AMX-TILE + AMX-BF16 (CPUID 7.0 EDX bits 24, 22), their state enabled in XCR0 (bits 17, 18), and,
// on Linux, the tile data granted to this process (without it the first tile load faults).
bool amx_bf16_usable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv works
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
#else
  return false;
#endif
}
#endif

bool parse_isa(const std::string& name, CpuIsa& isa) {
  if (name == "scalar") isa = CpuIsa::kScalar;
  else if (name == "avx2") isa = CpuIsa::kAvx2;
  else if (name == "avx512") isa = CpuIsa::kAvx512;
  else return false;
  return true;
}

CpuIsa best_supported() {
  if (cpu_isa_supported(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (cpu_isa_supported(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

// `name` must name an instruction set this CPU runs; `origin` names the source in errors.
CpuIsa checked_isa(const std::string& name, const char* origin) {
  CpuIsa isa;
  TORCH_CHECK_VALUE(parse_isa(name, isa), origin, " must be one of scalar, avx2, avx512 (or auto), got '", name, "'");
  TORCH_CHECK_VALUE(cpu_isa_supported(isa), origin, " = ", name, ", but this CPU (or build) cannot run it");
  return isa;
}

CpuIsa resolve_default() {
  const char* env = std::getenv("SPECRT_CPU_ISA");
  if (env == nullptr || *env == '\0' || std::string(env) == "auto") return best_supported();
  return checked_isa(env, "SPECRT_CPU_ISA");
}

at::Tensor cpu_exponential_noise_op(const at::Tensor& uniforms) {
  TORCH_CHECK_VALUE(uniforms.device().is_cpu() && uniforms.scalar_type() == at::kFloat,
                    "uniforms must be a float32 CPU tensor");
  const at::Tensor u = uniforms.contiguous();
  at::Tensor e = at::empty_like(u);
  exponential_noise(cpu_isa(), u.data_ptr<float>(), e.data_ptr<float>(), u.numel());
  return e;
}

std::string cpu_isa_op() { return cpu_isa_name(cpu_isa()); }

std::vector<std::string> cpu_features_op() {
  const CpuFeatures& f = cpu_features();
  const std::pair<bool, const char*> all[] = {
      {f.avx2, "avx2"},         {f.fma, "fma"},           {f.f16c, "f16c"},
      {f.avx512f, "avx512f"},   {f.avx512bw, "avx512bw"}, {f.avx512vl, "avx512vl"},
      {f.avx512dq, "avx512dq"}, {f.avx512vnni, "avx512vnni"}, {f.avx512bf16, "avx512bf16"},
      {f.amx_bf16, "amx_bf16"}, {f.amd, "amd"}};
  std::vector<std::string> out;
  for (const auto& [on, name] : all)
    if (on) out.emplace_back(name);
  return out;
}

std::string set_cpu_isa_op(const std::string& name) {
  const CpuIsa isa = name == "auto" ? resolve_default() : checked_isa(name, "isa");
  g_isa.store(static_cast<int>(isa));
  return cpu_isa_name(isa);
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    f.f16c = __builtin_cpu_supports("f16c");
    f.avx512f = __builtin_cpu_supports("avx512f");
    f.avx512bw = __builtin_cpu_supports("avx512bw");
    f.avx512vl = __builtin_cpu_supports("avx512vl");
    f.avx512dq = __builtin_cpu_supports("avx512dq");
    f.avx512vnni = __builtin_cpu_supports("avx512vnni");
    f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
    f.amd = __builtin_cpu_is("amd");
    f.amx_bf16 = SPECRT_AMX_BUILD && amx_bf16_usable();
#endif
    return f;
  }();
  return features;
}

bool cpu_isa_supported(CpuIsa isa) {
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
      return avx2;
    case CpuIsa::kAvx512:
      return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  }
  return false;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    default:
      return "scalar";
  }
}

CpuIsa cpu_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa == kUnresolved) {
    isa = static_cast<int>(resolve_default());  // a bad SPECRT_CPU_ISA raises here, every call
    g_isa.store(isa);
  }
  return static_cast<CpuIsa>(isa);
}

}  // namespace specrt

TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def("cpu_isa() -> str", &specrt::cpu_isa_op);
  m.def("set_cpu_isa(str isa) -> str", &specrt::set_cpu_isa_op);
  m.def("cpu_features() -> str[]", &specrt::cpu_features_op);
  m.def("cpu_exponential_noise(Tensor uniforms) -> Tensor", &specrt::cpu_exponential_noise_op);
}
