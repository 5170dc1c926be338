// specrt::linear / specrt::quant_linear: schemas, argument checks and the CPU
// implementation registration of the small-M linear kernel (csrc/cpu/linear_*.cpp).
// CPU only: on GPUs the Python layer keeps torch's cuBLAS path. Every check names
// the argument (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError).
#include <torch/library.h>

#include <string>

#include "checks.h"
#include "cpu/linear_cpu.h"
#include "cpu/linear_dynamic.h"

namespace specrt {
namespace {

using linear::WeightKind;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU (specrt's linear kernel is CPU-only), got ",
                    t.device().str());
}

void check_x(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "x must be float32 or bfloat16, got ", c10::toString(x.scalar_type()));
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D [M, K], got shape ", shape_str(x));
  TORCH_CHECK_VALUE(x.stride(1) == 1 || x.size(1) <= 1, "x must have unit stride in its last dim");
}

void check_exact(const at::Tensor& t, const char* name, at::ScalarType dtype, std::initializer_list<int64_t> shape,
                 const char* what) {
  check_cpu(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", c10::toString(dtype), ", got ",
                   c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.sizes().vec() == std::vector<int64_t>(shape), name, " must have shape ", what, ", got ",
                    shape_str(t));
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

at::Tensor bias_f32(const std::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  check_cpu(*bias, "bias");
  TORCH_CHECK_TYPE(bias->is_floating_point(), "bias must be a floating-point tensor, got ",
                   c10::toString(bias->scalar_type()));
  TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "bias must have shape [N=", N, "], got ",
                    shape_str(*bias));
  return bias->to(at::kFloat).contiguous();
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_x(x);
  check_cpu(weight, "weight");
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
                   "weight must be float32 or bfloat16, got ", c10::toString(weight.scalar_type()));
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(1), "weight must have shape [N, K=", x.size(1),
                    "] (K from x ", shape_str(x), "), got ", shape_str(weight));
  TORCH_CHECK_VALUE(weight.is_contiguous(), "weight must be contiguous");
  const WeightKind kind = weight.scalar_type() == at::kFloat ? WeightKind::kF32 : WeightKind::kBF16;
  return small_linear_cpu(x, weight, at::Tensor(), at::Tensor(), bias_f32(bias, weight.size(0)), kind);
}

WeightKind parse_kind(const std::string& kind) {
  if (kind == "int8") return WeightKind::kInt8;
  if (kind == "q8_0") return WeightKind::kQ8_0;
  if (kind == "q4_0") return WeightKind::kQ4_0;
  if (kind == "q4_1") return WeightKind::kQ4_1;
  TORCH_CHECK_VALUE(false, "kind must be one of int8, q8_0, q4_0, q4_1, got '", kind, "'");
  return WeightKind::kF32;
}

// Checks quant_linear and quant_linear_dynamic share (x already checked); returns the kind.
WeightKind check_quant(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::string& kind_name) {
  const WeightKind kind = parse_kind(kind_name);
  check_cpu(qweight, "qweight");
  TORCH_CHECK_VALUE(qweight.dim() == 2, "qweight must be 2-D, got shape ", shape_str(qweight));
  const int64_t N = qweight.size(0), K = x.size(1), G = K / linear::kGroup;
  const bool grouped = kind != WeightKind::kInt8;
  TORCH_CHECK_VALUE(!grouped || K % linear::kGroup == 0, "x has K=", K, " input features: ", kind_name,
                    " needs a multiple of ", linear::kGroup);
  const bool q4 = kind == WeightKind::kQ4_0 || kind == WeightKind::kQ4_1;
  const std::string wshape = "[N, " + std::to_string(q4 ? K / 2 : K) + "]";
  check_exact(qweight, "qweight", q4 ? at::kByte : at::kChar, {N, q4 ? K / 2 : K}, wshape.c_str());
  const bool has_mins = mins.has_value() && mins->defined();
  if (grouped) {
    const std::string gshape = "[N=" + std::to_string(N) + ", K/32=" + std::to_string(G) + "]";
    check_exact(scales, "scales", at::kHalf, {N, G}, gshape.c_str());
    TORCH_CHECK_VALUE(has_mins == (kind == WeightKind::kQ4_1), "mins must be ",
                      kind == WeightKind::kQ4_1 ? "given" : "None", " for kind ", kind_name);
    if (has_mins) check_exact(*mins, "mins", at::kHalf, {N, G}, gshape.c_str());
  } else {
    const std::string sshape = "[N=" + std::to_string(N) + "]";
    check_exact(scales, "scales", at::kFloat, {N}, sshape.c_str());
    TORCH_CHECK_VALUE(!has_mins, "mins must be None for kind int8");
  }
  return kind;
}

at::Tensor quant_linear_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                           const std::string& kind_name) {
  check_x(x);
  const WeightKind kind = check_quant(x, qweight, scales, mins, kind_name);
  const bool has_mins = mins.has_value() && mins->defined();
  return small_linear_cpu(x, qweight, scales, has_mins ? *mins : at::Tensor(), bias_f32(bias, qweight.size(0)), kind);
}

// qweight in the interleaved order (interleave_quant_weight): same shape and dtype, not checkable here.
at::Tensor quant_linear_dynamic_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                                   const std::string& kind_name) {
  check_x(x);
  TORCH_CHECK_VALUE(x.size(1) % linear::kGroup == 0, "x has K=", x.size(1), " input features: int8 activations ",
                    "need a multiple of ", linear::kGroup);
  const WeightKind kind = check_quant(x, qweight, scales, mins, kind_name);
  const bool has_mins = mins.has_value() && mins->defined();
  return small_linear_dynamic_cpu(x, qweight, scales, has_mins ? *mins : at::Tensor(),
                                  bias_f32(bias, qweight.size(0)), kind);
}

at::Tensor interleave_quant_weight_op(const at::Tensor& qweight, const std::string& kind_name, bool inverse) {
  const WeightKind kind = parse_kind(kind_name);
  check_cpu(qweight, "qweight");
  const bool q4 = kind == WeightKind::kQ4_0 || kind == WeightKind::kQ4_1;
  TORCH_CHECK_TYPE(qweight.scalar_type() == (q4 ? at::kByte : at::kChar), "qweight must have dtype ",
                   q4 ? "uint8" : "int8", " for kind ", kind_name, ", got ", c10::toString(qweight.scalar_type()));
  TORCH_CHECK_VALUE(qweight.dim() == 2, "qweight must be 2-D, got shape ", shape_str(qweight));
  const int B = linear::block_bytes(kind);
  TORCH_CHECK_VALUE(qweight.size(1) % B == 0, "qweight has ", qweight.size(1), " bytes per row: kind ", kind_name,
                    " in the interleaved order needs a multiple of ", B, " (K a multiple of 32)");
  return interleave_quant_weight_cpu(qweight.contiguous(), kind, inverse);
}

}  // namespace
}  // namespace specrt

TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, str kind) -> Tensor");
  m.def("quant_linear_dynamic(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, str kind) -> Tensor");
  m.def("interleave_quant_weight(Tensor qweight, str kind, bool inverse=False) -> Tensor");
  m.def("linear_dynamic_isa() -> str", &specrt::linear_dynamic_isa);
  m.def("linear_isa_names() -> str[]", &specrt::linear_isa_names);
  m.def("set_linear_isa(str name) -> str", &specrt::set_linear_isa);
}

TORCH_LIBRARY_IMPL(specrt, CPU, m) {
  m.impl("linear", &specrt::linear_op);
  m.impl("quant_linear", &specrt::quant_linear_op);
  m.impl("quant_linear_dynamic", &specrt::quant_linear_dynamic_op);
  m.impl("interleave_quant_weight", &specrt::interleave_quant_weight_op);
}
