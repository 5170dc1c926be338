// specrt._C.LayerStack: the CPU fused decoder layers of a decode / verify step in one call.
//
// specrt/models/llama.py's fused path runs each layer as ~9 kernels (norm, qkv, RoPE + KV store,
// paged attention, o, norm, gate_up, SwiGLU, down), each dispatched from Python through
// torch.ops. This class holds a prepared model's per-layer tensors and runs the same kernels
// (the very functions the ops call, with the arguments they would get) straight from C++, so
// its outputs are bit-identical to the op-by-op fused path; Python dispatch and its cache
// footprint (paid ~270 times per SmolLM2 forward) go away. Built by llama.py at prepare() when
// every layer qualifies; the Python path still runs prefills and anything else.
#include <torch/python.h>  // the tensor type casters (not <torch/extension.h>: the whole C++ frontend)

#include <string>
#include <vector>

#include "attention_ops.h"
#include "checks.h"
#include "cpu/fused_cpu.h"
#include "cpu/linear_cpu.h"

namespace specrt {
namespace {

namespace py = pybind11;
using linear::WeightKind;

// One projection as its prepared Python callable runs it on the kernel (FloatLinear or QuantCall).
struct Proj {
  at::Tensor w, scales, mins, bias;  // bias as float32 (what the op converts it to), undefined if none
  WeightKind kind = WeightKind::kF32;
  bool dynamic = false;  // int8 activations on interleaved weights

  at::Tensor operator()(const at::Tensor& x) const {
    if (dynamic) return small_linear_dynamic_cpu(x, w, scales, mins, bias, kind);
    return small_linear_cpu(x, w, scales, mins, bias, kind);
  }
};

WeightKind parse_kind(const std::string& name, const at::Tensor& w) {
  if (name == "float") return w.scalar_type() == at::kFloat ? WeightKind::kF32 : WeightKind::kBF16;
  if (name == "int8") return WeightKind::kInt8;
  if (name == "q8_0") return WeightKind::kQ8_0;
  if (name == "q4_0") return WeightKind::kQ4_0;
  if (name == "q4_1") return WeightKind::kQ4_1;
  TORCH_CHECK_VALUE(false, "kind must be one of float, int8, q8_0, q4_0, q4_1, got '", name, "'");
  return WeightKind::kF32;  // not reached
}

at::Tensor defined_or_empty(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

struct Layer {
  at::Tensor norm1, norm2;
  double eps1 = 0, eps2 = 0;
  Proj qkv, o, gate_up, down;
  int64_t index = 0;  // the cache layer its K / V are stored into (attention reads layer i of the stack)
  double scale = 1.0;
  int64_t window = 0;
};

class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const std::string& dtype)
      : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), dtype_(dtype == "bfloat16" ? at::kBFloat16 : at::kFloat) {
    TORCH_CHECK_VALUE(H_ >= 1 && Hkv_ >= 1 && D_ >= 2 && D_ % 2 == 0 && H_ % Hkv_ == 0,
                      "num_heads, num_kv_heads and an even head_dim must be >= 1 with num_heads % num_kv_heads == 0");
    TORCH_CHECK_TYPE(dtype == "float32" || dtype == "bfloat16", "dtype must be 'float32' or 'bfloat16', got '",
                     dtype, "'");
  }

  // projs: (qkv, o, gate_up, down), each (weight, scales, mins, bias, kind, dynamic) with kind
  // "float" for a float weight (scales / mins None).
  void add_layer(const at::Tensor& norm1, double eps1, const at::Tensor& norm2, double eps2, const py::list& projs,
                 int64_t index, double scale, int64_t window) {
    TORCH_CHECK_VALUE(projs.size() == 4, "projs must hold (qkv, o, gate_up, down), got ", projs.size());
    for (const at::Tensor* t : {&norm1, &norm2})
      TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == dtype_ && t->dim() == 1 && t->is_contiguous(),
                        "the norm weights must be contiguous 1-D CPU tensors of the stack's dtype");
    Layer l;
    l.norm1 = norm1;
    l.norm2 = norm2;
    l.eps1 = eps1;
    l.eps2 = eps2;
    l.index = index;
    l.scale = scale;
    l.window = window;
    Proj* out[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (int i = 0; i < 4; ++i) {
      const auto p = projs[i].cast<py::tuple>();
      TORCH_CHECK_VALUE(p.size() == 6, "a projection is (weight, scales, mins, bias, kind, dynamic)");
      Proj& d = *out[i];
      d.w = p[0].cast<at::Tensor>();
      d.scales = defined_or_empty(p[1].cast<std::optional<at::Tensor>>());
      d.mins = defined_or_empty(p[2].cast<std::optional<at::Tensor>>());
      const at::Tensor bias = defined_or_empty(p[3].cast<std::optional<at::Tensor>>());
      d.bias = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
      d.kind = parse_kind(p[4].cast<std::string>(), d.w);
      d.dynamic = p[5].cast<bool>();
      TORCH_CHECK_VALUE(d.w.device().is_cpu() && d.w.dim() == 2 && d.w.is_contiguous(),
                        "projection weights must be contiguous 2-D CPU tensors");
    }
    layers_.push_back(std::move(l));
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // Layers 0..n-1 of one decode / verify step (llama.py _forward_fused): residual [T, hidden] (the
  // embeddings, updated in place to the stream entering layer n-1's output), cos / sin [T, D];
  // kv_cache [layers, 2, blocks, block_size, Hkv, D]; the rest as the paged-attention kernel takes
  // them (tree_mask [T] int64 or None). Returns layer n-1's output delta [T, hidden] (not yet added to residual).
  // capture_layers / capture [T, k, hidden]: the residual stream after each listed layer (< n) is copied
  // into capture[:, j] (the fused low / middle / high features an EAGLE-3 draft reads).
  at::Tensor run(at::Tensor residual, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv_cache,
                 const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 const at::Tensor& query_start_loc, int64_t max_q, int64_t max_s, int64_t n,
                 const std::optional<at::Tensor>& tree_mask, const std::vector<int64_t>& capture_layers,
                 const std::optional<at::Tensor>& capture) const {
    TORCH_CHECK_VALUE(n >= 1 && n <= size(), "n = ", n, " layers: the stack has ", size());
    const int64_t K = static_cast<int64_t>(capture_layers.size());
    TORCH_CHECK_VALUE(K == 0 || capture.has_value(), "capture_layers needs a capture tensor");
    if (capture.has_value()) {
      const at::Tensor& c = *capture;
      TORCH_CHECK_VALUE(c.scalar_type() == dtype_ && c.dim() == 3 && c.size(0) == residual.size(0) &&
                            c.size(1) == K && c.size(2) == residual.size(1) && c.is_contiguous() &&
                            c.device().is_cpu(),
                        "capture must be a contiguous [T, ", K, ", hidden] CPU tensor of the stack's dtype, got ",
                        shape_str(c));
      for (int64_t li : capture_layers)
        TORCH_CHECK_VALUE(li >= 0 && li < n, "capture layer ", li, " is outside the ", n, " layers run");
    }
    auto take = [&](int64_t layer, const at::Tensor& stream) {  // stream [T, hidden] after `layer`
      for (int64_t j = 0; j < K; ++j)
        if (capture_layers[j] == layer) capture->select(1, j).copy_(stream);
    };
    TORCH_CHECK_VALUE(residual.device().is_cpu() && residual.scalar_type() == dtype_ && residual.dim() == 2 &&
                          residual.is_contiguous(),
                      "residual must be a contiguous [T, hidden] CPU tensor of the stack's dtype");
    const int64_t T = residual.size(0);
    for (const at::Tensor* t : {&cos, &sin})
      TORCH_CHECK_VALUE(t->scalar_type() == dtype_ && t->dim() == 2 && t->size(0) == T && t->size(1) == D_ &&
                            t->stride(1) == 1,
                        "cos and sin must be [T=", T, ", head_dim=", D_, "] in the stack's dtype");
    TORCH_CHECK_VALUE(cos.stride(0) == sin.stride(0), "cos and sin must have the same row stride");
    TORCH_CHECK_VALUE(kv_cache.device().is_cpu() && kv_cache.dim() == 6 && kv_cache.size(0) >= n &&
                          kv_cache.size(1) == 2 && kv_cache.size(4) == Hkv_ && kv_cache.size(5) == D_ &&
                          kv_cache.is_contiguous() &&
                          (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16),
                      "kv_cache must be a contiguous float32 / bfloat16 [>=", n, " layers, 2, blocks, block_size, ",
                      Hkv_, ", ", D_, "] CPU tensor, got shape ", shape_str(kv_cache));
    TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                          slot_mapping.size(0) == T && slot_mapping.is_contiguous(),
                      "slot_mapping must be a contiguous int64 [T=", T, "] tensor");
    const int64_t slots = kv_cache.size(2) * kv_cache.size(3);
    const int64_t* s = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK_VALUE(s[t] >= -1 && s[t] < slots, "slot_mapping[", t, "] = ", s[t], " is out of range [-1, ",
                        slots, ")");

    at::Tensor delta;
    for (int64_t i = 0; i < n; ++i) {
      const Layer& l = layers_[i];
      TORCH_CHECK_VALUE(l.index >= 0 && l.index < kv_cache.size(0), "layer index ", l.index,
                        " is out of range for kv_cache with ", kv_cache.size(0), " layers");
      at::Tensor h = rms_norm_cpu(delta.defined() ? delta : residual, l.norm1, l.eps1,
                                  delta.defined() ? residual : at::Tensor());  // [T, hidden]
      if (i > 0 && K > 0) take(i - 1, residual);  // residual now holds layer i-1's output
      at::Tensor qkv = l.qkv(h);                                                // [T, (H + 2 Hkv) D]
      const at::Tensor q = rotary_write_kv_cpu(qkv, cos, sin, H_, Hkv_, kv_cache, l.index, slot_mapping,
                                               at::kFloat);  // [T, H, D] float32
      const PagedAttentionArgs args = check_paged_attention(q, kv_cache.select(0, i), block_tables, seq_lens,
                                                            query_start_loc, l.scale, l.window, max_q, max_s, true,
                                                            tree_mask);
      paged_attention_cpu(args);
      at::Tensor o = args.out.scalar_type() == dtype_ ? args.out : args.out.to(dtype_);
      h = rms_norm_cpu(l.o(o.view({T, H_ * D_})), l.norm2, l.eps2, residual);  // residual += attention output
      delta = l.down(silu_mul_cpu(l.gate_up(h)));
    }
    if (K > 0) take(n - 1, residual + delta);
    return delta;
  }

 private:
  int64_t H_, Hkv_, D_;
  at::ScalarType dtype_;
  std::vector<Layer> layers_;
};

}  // namespace

void bind_layer_stack(py::module_& m) {
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<int64_t, int64_t, int64_t, const std::string&>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("dtype"))
      .def("add_layer", &LayerStack::add_layer, py::arg("norm1"), py::arg("eps1"), py::arg("norm2"), py::arg("eps2"),
           py::arg("projs"), py::arg("index"), py::arg("scale"), py::arg("window"))
      .def("__len__", &LayerStack::size)
      .def("run", &LayerStack::run, py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"),
           py::arg("max_q"), py::arg("max_s"), py::arg("n"), py::arg("tree_mask") = py::none(),
           py::arg("capture_layers") = std::vector<int64_t>(), py::arg("capture") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace specrt
