// Torch glue of the fused decoder kernels: run-time ISA choice (cpu_isa.h), threading
// over rows (each row whole on one thread: thread count changes nothing), outputs,
// and the KV-cache stores of rotary_write_kv.
#include "cpu/fused_cpu.h"

#include <cstring>

#include "cpu/cpu_isa.h"
#include "cpu/fused_kernel.h"
#include "cpu/thread_pool.h"

namespace specrt {
namespace {

using fused::Dtype;

Dtype dtype_of(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? Dtype::kBF16 : Dtype::kF32; }

template <class P>
using RowsFn = void (*)(const P&, int64_t, int64_t);

template <class P>
RowsFn<P> pick(RowsFn<P> scalar, RowsFn<P> avx2, RowsFn<P> avx512) {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512: return avx512;
    case CpuIsa::kAvx2: return avx2;
    default: return scalar;
  }
}

// rows in parallel, at least ~32K elements of work per task (decode rows run inline)
template <class P>
void run_rows(RowsFn<P> fn, const P& p, int64_t T, int64_t row_elems) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, row_elems));
  if (T <= grain) {
    fn(p, 0, T);
    return;
  }
  parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) { fn(p, t0, t1); });
}

inline uint16_t bf16_bits(float f) {  // nearest-even, NaN quiet (as torch's conversion)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// n elements of src (dtype `from`) -> dst (dtype `to`)
void convert_copy(void* dst, Dtype to, const void* src, Dtype from, int64_t n) {
  if (to == from) {
    std::memcpy(dst, src, static_cast<size_t>(n) * (to == Dtype::kBF16 ? 2 : 4));
  } else if (to == Dtype::kF32) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(d + i, &u, 4);
    }
  } else {
    const float* s = static_cast<const float*>(src);
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits(s[i]);
  }
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& residual) {
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({T, H}, x.options());
  fused::NormProblem p;
  p.T = T;
  p.H = H;
  p.x = x.data_ptr();
  p.ldx = x.stride(0);
  if (residual.defined()) {
    p.residual = residual.data_ptr();
    p.ldr = residual.stride(0);
  }
  p.weight = weight.data_ptr();
  p.eps = static_cast<float>(eps);
  p.out = out.data_ptr();
  p.dtype = dtype_of(x);
  run_rows(pick<fused::NormProblem>(&fused::rms_norm_rows_scalar, &fused::rms_norm_rows_avx2,
                                    &fused::rms_norm_rows_avx512), p, T, 3 * H);
  return out;
}

at::Tensor silu_mul_cpu(const at::Tensor& x) {
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  fused::SiluMulProblem p;
  p.T = T;
  p.I = I;
  p.x = x.data_ptr();
  p.ldx = x.stride(0);
  p.out = out.data_ptr();
  p.dtype = dtype_of(x);
  run_rows(pick<fused::SiluMulProblem>(&fused::silu_mul_rows_scalar, &fused::silu_mul_rows_avx2,
                                       &fused::silu_mul_rows_avx512), p, T, 8 * I);
  return out;
}

at::Tensor rotary_write_kv_cpu(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                               int64_t num_kv_heads, at::Tensor& kv_cache, int64_t layer,
                               const at::Tensor& slot_mapping, at::ScalarType q_dtype) {
  const int64_t T = qkv.size(0), H = num_heads, Hkv = num_kv_heads, D = cos.size(1);
  at::Tensor q = at::empty({T, H, D}, qkv.options().dtype(q_dtype));
  fused::RotaryProblem p;
  p.T = T;
  p.H = H;
  p.Hkv = Hkv;
  p.D = D;
  p.qkv = qkv.data_ptr();
  p.ldqkv = qkv.stride(0);
  p.dtype = dtype_of(qkv);
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.ldcs = cos.stride(0);
  p.q = q.data_ptr();
  p.q_dtype = q_dtype == at::kBFloat16 ? Dtype::kBF16 : Dtype::kF32;
  run_rows(pick<fused::RotaryProblem>(&fused::rotary_rows_scalar, &fused::rotary_rows_avx2,
                                      &fused::rotary_rows_avx512), p, T, 3 * (H + Hkv) * D);

  // k (rotated) and v into the cache, in row order (a repeated slot keeps the last row)
  const Dtype cdt = dtype_of(kv_cache);
  const int64_t celt = kv_cache.element_size(), qelt = qkv.element_size(), n = Hkv * D;
  char* k_plane = static_cast<char*>(kv_cache.data_ptr()) + layer * kv_cache.stride(0) * celt;
  char* v_plane = k_plane + kv_cache.stride(1) * celt;
  const int64_t slot_bytes = kv_cache.stride(3) * celt;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* base = static_cast<const char*>(qkv.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    const char* row = base + t * qkv.stride(0) * qelt;
    convert_copy(k_plane + s * slot_bytes, cdt, row + H * D * qelt, p.dtype, n);
    convert_copy(v_plane + s * slot_bytes, cdt, row + (H + Hkv) * D * qelt, p.dtype, n);
  }
  return q;
}

}  // namespace specrt
