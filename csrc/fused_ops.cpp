// specrt::rms_norm / add_rms_norm_ / silu_mul / rotary_write_kv: schemas, argument
// checks and the CPU registration of the fused decoder kernels (csrc/cpu/fused_*.cpp).
// CPU only: on GPUs the model keeps torch's ops. Every check names the argument
// (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError).
#include <torch/library.h>

#include <string>

#include "checks.h"
#include "cpu/fused_cpu.h"

namespace specrt {
namespace {

// a CPU float32 / bfloat16 matrix with unit stride in its last dim
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU (the fused kernels are CPU-only), got ",
                    t.device().str());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                   " must be float32 or bfloat16, got ", c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D [T, ...], got shape ", shape_str(t));
  TORCH_CHECK_VALUE(t.stride(1) == 1 || t.size(1) <= 1, name, " must have unit stride in its last dim");
  TORCH_CHECK_VALUE(t.stride(0) >= t.size(1) || t.size(0) <= 1, name, " rows must not overlap");
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& x, const char* xname) {
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), name, " must have the dtype of ", xname, " (",
                   c10::toString(x.scalar_type()), "), got ", c10::toString(t.scalar_type()));
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK_VALUE(weight.device().is_cpu(), "weight must be on the CPU, got ", weight.device().str());
  check_like(weight, "weight", x, "x");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must have shape [H=", x.size(1),
                    "], got ", shape_str(weight));
  TORCH_CHECK_VALUE(weight.is_contiguous(), "weight must be contiguous");
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_weight(weight, x);
  return rms_norm_cpu(x, weight, eps, at::Tensor());
}

at::Tensor add_rms_norm_op(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(x, "x");
  check_like(x, "x", residual, "residual");
  TORCH_CHECK_VALUE(x.sizes() == residual.sizes(), "x must have the shape of residual ", shape_str(residual),
                    ", got ", shape_str(x));
  check_weight(weight, x);
  return rms_norm_cpu(x, weight, eps, residual);
}

at::Tensor silu_mul_op(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0, "x must be [T, 2I] (gate | up), got an odd width ", x.size(1));
  return silu_mul_cpu(x);
}

void check_cos_sin(const at::Tensor& t, const char* name, const at::Tensor& qkv, int64_t D) {
  check_rows(t, name);
  check_like(t, name, qkv, "qkv");
  TORCH_CHECK_VALUE(t.size(0) == qkv.size(0) && t.size(1) == D, name, " must have shape [T=", qkv.size(0),
                    ", head_dim=", D, "], got ", shape_str(t));
}

void check_slots(const at::Tensor& slot_mapping, int64_t T, int64_t num_slots) {
  TORCH_CHECK_VALUE(slot_mapping.device().is_cpu(), "slot_mapping must be on the CPU");
  TORCH_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ",
                   c10::toString(slot_mapping.scalar_type()));
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.is_contiguous(),
                    "slot_mapping must be a contiguous [T=", T, "] tensor, got shape ", shape_str(slot_mapping));
  const int64_t* s = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(s[t] >= -1 && s[t] < num_slots, "slot_mapping[", t, "] = ", s[t], " is out of range [-1, ",
                      num_slots, ")");
}

at::Tensor rotary_write_kv_op(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                              int64_t num_kv_heads, at::Tensor& kv_cache, int64_t layer,
                              const at::Tensor& slot_mapping, std::optional<at::ScalarType> q_dtype) {
  check_rows(qkv, "qkv");
  TORCH_CHECK_VALUE(num_heads >= 1 && num_kv_heads >= 1, "num_heads and num_kv_heads must be >= 1, got ",
                    num_heads, " and ", num_kv_heads);
  const int64_t D = cos.dim() == 2 ? cos.size(1) : -1;
  TORCH_CHECK_VALUE(D > 0 && D % 2 == 0, "cos must be [T, head_dim] with an even head_dim, got shape ",
                    shape_str(cos));
  TORCH_CHECK_VALUE(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv must be [T, (num_heads + 2 num_kv_heads) * ",
                    "head_dim = ", (num_heads + 2 * num_kv_heads) * D, "], got shape ", shape_str(qkv));
  check_cos_sin(cos, "cos", qkv, D);
  check_cos_sin(sin, "sin", qkv, D);
  TORCH_CHECK_VALUE(sin.stride(0) == cos.stride(0), "cos and sin must have the same row stride");
  TORCH_CHECK_VALUE(kv_cache.device().is_cpu(), "kv_cache must be on the CPU, got ", kv_cache.device().str());
  TORCH_CHECK_TYPE(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
                   "kv_cache must be float32 or bfloat16, got ", c10::toString(kv_cache.scalar_type()));
  TORCH_CHECK_VALUE(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.size(4) == num_kv_heads &&
                        kv_cache.size(5) == D && kv_cache.is_contiguous(),
                    "kv_cache must be a contiguous [layers, 2, num_blocks, block_size, num_kv_heads=", num_kv_heads,
                    ", head_dim=", D, "] tensor, got shape ", shape_str(kv_cache));
  TORCH_CHECK_VALUE(layer >= 0 && layer < kv_cache.size(0), "layer = ", layer, " is out of range for kv_cache with ",
                    kv_cache.size(0), " layers");
  const at::ScalarType qdt = q_dtype.value_or(qkv.scalar_type());
  TORCH_CHECK_TYPE(qdt == at::kFloat || (qdt == at::kBFloat16 && qkv.scalar_type() == at::kBFloat16),
                   "q_dtype must be float32, or bfloat16 for a bfloat16 qkv, got ", c10::toString(qdt));
  check_slots(slot_mapping, qkv.size(0), kv_cache.size(2) * kv_cache.size(3));
  return rotary_write_kv_cpu(qkv, cos, sin, num_heads, num_kv_heads, kv_cache, layer, slot_mapping, qdt);
}

}  // namespace
}  // namespace specrt

TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("rotary_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
        "Tensor(b!) kv_cache, int layer, Tensor slot_mapping, ScalarType? q_dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specrt, CPU, m) {
  m.impl("rms_norm", &specrt::rms_norm_op);
  m.impl("add_rms_norm_", &specrt::add_rms_norm_op);
  m.impl("silu_mul", &specrt::silu_mul_op);
  m.impl("rotary_write_kv", &specrt::rotary_write_kv_op);
}
