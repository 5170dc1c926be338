// Torch glue of the small-M linear kernel: run-time ISA choice, threading over
// output rows (each row whole on one thread: thread count changes nothing), and
// the fp32/bf16 plumbing. The kernels are linear_{scalar,avx2,avx512,avx512bf16,amx}.cpp.
#include "cpu/linear_cpu.h"

#include "cpu/cpu_isa.h"
#include "cpu/linear_dynamic.h"
#include "cpu/thread_pool.h"

#include <atomic>
#include <cstdint>
#include <vector>

namespace specrt {
namespace {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512", "avx512bf16", "amx"};

// The best path the instruction-set ceiling allows (cpu_isa.h); AVX-512 BF16, then AMX, where the CPU has them.
int best_isa() {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512:
      if (!cpu_features().avx512bf16) return kAvx512;
      return cpu_features().amx_bf16 ? kAmx : kAvx512Bf16;
    case CpuIsa::kAvx2: return kAvx2;
    default: return kScalar;
  }
}

std::atomic<int> g_isa_cap{kAmx};

using RowsFn = void (*)(const linear::Problem&, int64_t, int64_t);

// The machine fixes the AMX order (linear_kernel.h), whatever the ceiling or the cap: below AMX
// its portable twin runs, so SPECRT_CPU_ISA changes speed, never bits.
bool amx_order(const linear::Problem& p) { return linear::amx_order(p, cpu_features().amx_bf16); }

// The calling thread's AMX x-tile buffer, 64-byte aligned, grown as needed and kept: decode calls
// it ~200 times a step, and workers read it only inside that call's parallel_for.
uint16_t* x_tile_buffer(int64_t elems) {
  thread_local std::vector<uint16_t> buf;
  if (static_cast<int64_t>(buf.size()) < elems + 32) buf.resize(static_cast<size_t>(elems + 32));
  const auto addr = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + ((64 - addr % 64) % 64) / 2;
}

RowsFn rows_fn(const linear::Problem& p) {
  const int isa = std::min(best_isa(), g_isa_cap.load(std::memory_order_relaxed));
  if (amx_order(p)) return isa == kAmx ? &linear::linear_rows_amx : &linear::linear_rows_amx_order_portable;
  switch (isa) {
    case kAmx:
    case kAvx512Bf16: return &linear::linear_rows_avx512bf16;
    case kAvx512: return &linear::linear_rows_avx512;
    case kAvx2: return &linear::linear_rows_avx2;
    default: return &linear::linear_rows_scalar;
  }
}

}  // namespace

std::vector<std::string> linear_isa_names() {
  std::vector<std::string> out;
  for (int i = best_isa(); i >= 0; --i) out.emplace_back(kIsaNames[i]);
  return out;
}

std::string set_linear_isa(const std::string& name) {
  const std::string prev = kIsaNames[std::min(best_isa(), g_isa_cap.load())];
  int cap = kAmx;
  if (!name.empty()) {
    cap = -1;
    for (int i = 0; i <= kAmx; ++i)
      if (name == kIsaNames[i]) cap = i;
    TORCH_CHECK_VALUE(cap >= 0, "isa must be one of scalar, avx2, avx512, avx512bf16, amx or \"\", got '", name, "'");
    TORCH_CHECK_VALUE(cap <= best_isa(), "isa '", name, "' is not supported by this CPU (best: ",
                      kIsaNames[best_isa()], ")");
  }
  g_isa_cap.store(cap);
  return prev;
}

at::Tensor small_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scales,
                            const at::Tensor& mins, const at::Tensor& bias, linear::WeightKind kind) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = weight.size(0);
  const bool dot = x_in.scalar_type() == at::kBFloat16 && kind == linear::WeightKind::kBF16;
  // bf16 activations meet other weights as fp32 (exact widening, deterministic)
  const at::Tensor x = (x_in.scalar_type() == at::kBFloat16 && !dot) ? x_in.to(at::kFloat) : x_in;
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return y;

  linear::Problem p;
  p.M = M;
  p.N = N;
  p.K = K;
  p.x = x.data_ptr();
  p.ldx = x.stride(0);
  p.x_bf16 = dot;
  p.w = weight.data_ptr();
  p.kind = kind;
  p.scales = scales.defined() ? scales.data_ptr() : nullptr;
  p.mins = mins.defined() ? static_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  p.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  p.y = y.data_ptr();
  p.y_bf16 = y.scalar_type() == at::kBFloat16;

  const RowsFn fn = rows_fn(p);
  if (fn == &linear::linear_rows_amx) {
    uint16_t* tiles = x_tile_buffer(linear::x_tile_elems(M, K));
    linear::pack_x_tiles_amx(p, tiles);
    p.x_tiles = tiles;
  }
  // blocks of output rows as high as the widest tile (4, or 16 on AMX); ~64K multiply-adds per task at least
  const int64_t kBlock = fn == &linear::linear_rows_amx ? 16 : 4;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, K * M * kBlock));
  parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    fn(p, b0 * kBlock, std::min(N, b1 * kBlock));
  });
  return y;
}

// The int8-activation path in use: 2 = AVX-512 VNNI, 1 = AVX2, 0 = portable (all the same bits).
int dynamic_isa() {
  const int cap = std::min(best_isa(), g_isa_cap.load(std::memory_order_relaxed));
  if (cpu_features().avx512vnni && cap >= kAvx512) return 2;
  return cap >= kAvx2 ? 1 : 0;
}

std::string linear_dynamic_isa() {
  constexpr const char* kNames[] = {"scalar", "avx2", "avx512vnni"};
  return kNames[dynamic_isa()];
}

at::Tensor small_linear_dynamic_cpu(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scales,
                                    const at::Tensor& mins, const at::Tensor& bias, linear::WeightKind kind) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = weight.size(0), G = K / linear::kGroup;
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in : x_in.to(at::kFloat);  // exact widening
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return y;
  linear::DynProblem p;
  p.M = M;
  p.N = N;
  p.K = K;
  p.G = G;
  p.S = (G + linear::kSuper - 1) / linear::kSuper;
  const int isa = dynamic_isa();
  p.tail = isa > 0 ? linear::tail_lanes(G) : 0;
  // quantized activations in one buffer (4-byte words): xq [M][S*512] int8, dx / corr / e [M][S*16],
  // and the compact tail's xt [M][kTailBytes] when there is one
  const int64_t lanes = M * p.S * linear::kSuper, tail_words = p.tail ? M * linear::kTailBytes / 4 : 0;
  const at::Tensor buf = at::empty({lanes * 8 + 3 * lanes + tail_words}, x.options());
  p.xq = reinterpret_cast<const int8_t*>(buf.data_ptr<float>());
  p.dx = buf.data_ptr<float>() + lanes * 8;
  p.corr = reinterpret_cast<const int32_t*>(p.dx + lanes);
  p.e = p.dx + 2 * lanes;
  p.xt = p.tail ? reinterpret_cast<const int8_t*>(p.dx + 3 * lanes) : nullptr;
  p.w = weight.data_ptr();
  p.kind = kind;
  p.scales = scales.data_ptr();
  p.mins = mins.defined() ? static_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  p.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  p.y = y.data_ptr();
  p.y_bf16 = y.scalar_type() == at::kBFloat16;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const auto quant = isa == 2   ? &linear::quantize_activations_avx512
                     : isa == 1 ? &linear::quantize_activations_avx2
                                : &linear::quantize_activations;
  const int64_t qgrain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, K));
  const auto prepare = [&](int64_t m0, int64_t m1) {
    quant(xp, ldx, p, m0, m1);
    if (p.tail) linear::tail_activations(p, m0, m1);
  };
  if (M <= qgrain) {
    prepare(0, M);
  } else {
    parallel_for(0, M, qgrain, prepare);
  }
  const auto fn = isa == 2   ? &linear::dynamic_rows_avx512vnni
                  : isa == 1 ? &linear::dynamic_rows_avx2
                             : &linear::dynamic_rows_scalar;
  constexpr int64_t kBlock = 4;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, K * M * kBlock));
  parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { fn(p, b0 * kBlock, std::min(N, b1 * kBlock)); });
  return y;
}

at::Tensor interleave_quant_weight_cpu(const at::Tensor& qweight, linear::WeightKind kind, bool inverse) {
  const int B = linear::block_bytes(kind);
  const int64_t N = qweight.size(0), G = qweight.size(1) / B;
  at::Tensor out = at::empty_like(qweight);
  const auto* src = static_cast<const uint8_t*>(qweight.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, G * B)),
                   [&](int64_t n0, int64_t n1) { linear::interleave_rows(src, dst, G, B, n0, n1, inverse); });
  return out;
}

}  // namespace specrt
