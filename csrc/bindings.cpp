// specrt._C: argument checks and CPU/CUDA dispatch for every op.
//
// Every check names the argument and says what was expected, and raises a
// Python exception (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE ->
// TypeError) instead of letting a kernel touch memory it should not.
// Value checks (NaN, negative probabilities, token ids, mapping ranges) read
// the data: on CPU tensors they are cheap and always on unless the caller
// passes check_values=False; on CUDA tensors they would need a device->host
// sync, so specrt/ops.py enables them there only in debug mode.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <set>
#include <string>

#include "ops.h"
#include "specrt/philox.h"
#include "specrt/sampling.h"

namespace specrt {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                  const at::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", c10::toString(dtype), ", got ",
                   c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got shape ", shape_str(t));
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device.str(), " (like the other inputs), got ",
                    t.device().str());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

void check_size(const at::Tensor& t, const char* name, int64_t dim, int64_t expected, const char* what) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, name, " must have size ", expected, " (", what, ") in dim ", dim,
                    ", got shape ", shape_str(t));
}

// Host copy of a tensor for value checks (a sync for CUDA tensors: only in debug mode).
at::Tensor host(const at::Tensor& t) { return t.is_cpu() ? t : t.cpu(); }

void check_probs_values(const at::Tensor& probs, const char* name) {
  const at::Tensor h = host(probs);
  const float* data = h.data_ptr<float>();
  const int64_t n = h.numel();
  const int64_t bad = at::parallel_reduce(
      0, n, 1 << 16, n,
      [&](int64_t lo, int64_t hi, int64_t found) {
        for (int64_t i = lo; i < hi && i < found; ++i)
          if (!(data[i] >= 0.0f) || data[i] == INFINITY) return i;
        return found;
      },
      [](int64_t a, int64_t b) { return std::min(a, b); });
  TORCH_CHECK_VALUE(bad == n, name, " must hold finite non-negative probabilities; element ", bad,
                    " (flat index) is ", data[bad < n ? bad : 0]);
}

void check_draft_values(const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens, int64_t vocab) {
  const at::Tensor ids = host(draft_token_ids);
  const at::Tensor counts = host(num_draft_tokens);
  const int64_t batch = ids.size(0);
  const int64_t k = ids.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t n = counts.data_ptr<int32_t>()[b];
    TORCH_CHECK_VALUE(n >= 0 && n <= k, "num_draft_tokens[", b, "] = ", n, " must be in [0, K=", k, "]");
    for (int64_t i = 0; i < n; ++i) {
      const int32_t x = ids.data_ptr<int32_t>()[b * k + i];
      TORCH_CHECK_VALUE(x >= 0 && x < vocab, "draft_token_ids[", b, ", ", i, "] = ", x,
                        " is out of range for vocabulary size ", vocab);
    }
  }
}

void check_positions(const at::Tensor& positions) {
  const at::Tensor h = host(positions);
  for (int64_t i = 0; i < h.numel(); ++i)
    TORCH_CHECK_VALUE(h.data_ptr<int64_t>()[i] >= 0, "positions[", i, "] = ", h.data_ptr<int64_t>()[i],
                      " must be >= 0");
}

// ----------------------------------------------------------------------------
at::Tensor probs_from_logits(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                             const at::Tensor& top_p, bool check_values) {
  TORCH_CHECK_VALUE(logits.defined(), "logits must be a tensor, got None");
  const at::Device device = logits.device();
  check_tensor(logits, "logits", at::kFloat, 2, device);
  const int64_t rows = logits.size(0);
  TORCH_CHECK_VALUE(logits.size(1) > 0, "logits must have a non-empty vocabulary dimension, got shape ",
                    shape_str(logits));
  check_tensor(temperature, "temperature", at::kFloat, 1, device);
  check_tensor(top_k, "top_k", at::kInt, 1, device);
  check_tensor(top_p, "top_p", at::kFloat, 1, device);
  check_size(temperature, "temperature", 0, rows, "rows of logits");
  check_size(top_k, "top_k", 0, rows, "rows of logits");
  check_size(top_p, "top_p", 0, rows, "rows of logits");
  if (check_values) {
    const at::Tensor t = host(temperature), k = host(top_k), p = host(top_p);
    for (int64_t r = 0; r < rows; ++r) {
      const float tv = t.data_ptr<float>()[r];
      TORCH_CHECK_VALUE(std::isfinite(tv) && tv >= 0.0f, "temperature[", r, "] = ", tv,
                        " must be finite and >= 0 (0 means greedy)");
      TORCH_CHECK_VALUE(k.data_ptr<int32_t>()[r] >= 0, "top_k[", r, "] = ", k.data_ptr<int32_t>()[r],
                        " must be >= 0 (0 disables top-k)");
      const float pv = p.data_ptr<float>()[r];
      TORCH_CHECK_VALUE(pv > 0.0f && pv <= 1.0f, "top_p[", r, "] = ", pv, " must be in (0, 1] (1 disables top-p)");
    }
  }
  at::Tensor probs = at::empty_like(logits);
  if (rows == 0) return probs;
#ifdef SPECRT_WITH_CUDA
  if (device.is_cuda()) {
    probs_from_logits_cuda(logits, temperature, top_k, top_p, probs);
    return probs;
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "logits is on ", device.str(), " but this build of specrt has no kernels for it");
  probs_from_logits_cpu(logits, temperature, top_k, top_p, probs);
  return probs;
}

std::tuple<at::Tensor, at::Tensor> verify_greedy(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                                                 const at::Tensor& num_draft_tokens, bool check_values) {
  TORCH_CHECK_VALUE(target_logits.defined(), "target_logits must be a tensor, got None");
  const at::Device device = target_logits.device();
  check_tensor(target_logits, "target_logits", at::kFloat, 3, device);
  const int64_t batch = target_logits.size(0);
  const int64_t k1 = target_logits.size(1);
  const int64_t vocab = target_logits.size(2);
  TORCH_CHECK_VALUE(k1 >= 1 && vocab >= 1, "target_logits must be [B, K+1, V] with K+1 >= 1 and V >= 1, got ",
                    shape_str(target_logits));
  check_tensor(draft_token_ids, "draft_token_ids", at::kInt, 2, device);
  check_tensor(num_draft_tokens, "num_draft_tokens", at::kInt, 1, device);
  check_size(draft_token_ids, "draft_token_ids", 0, batch, "B of target_logits");
  check_size(draft_token_ids, "draft_token_ids", 1, k1 - 1, "K = target_logits.shape[1] - 1");
  check_size(num_draft_tokens, "num_draft_tokens", 0, batch, "B of target_logits");
  if (check_values) check_draft_values(draft_token_ids, num_draft_tokens, vocab);
  at::Tensor out = at::empty({batch, k1}, target_logits.options().dtype(at::kInt));
  at::Tensor n_acc = at::empty({batch}, target_logits.options().dtype(at::kInt));
  if (batch == 0) return {out, n_acc};
#ifdef SPECRT_WITH_CUDA
  if (device.is_cuda()) {
    verify_greedy_cuda(target_logits, draft_token_ids, num_draft_tokens, out, n_acc);
    return {out, n_acc};
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "target_logits is on ", device.str(), " but this build of specrt has no kernels for it");
  verify_greedy_cpu(target_logits, draft_token_ids, num_draft_tokens, out, n_acc);
  return {out, n_acc};
}

std::tuple<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& target_probs,
                                                    const std::optional<at::Tensor>& draft_probs,
                                                    const at::Tensor& draft_token_ids,
                                                    const at::Tensor& num_draft_tokens, const at::Tensor& seeds,
                                                    const at::Tensor& positions, const std::string& method,
                                                    bool check_values) {
  TORCH_CHECK_VALUE(method == "rejection" || method == "coupled", "method must be 'rejection' or 'coupled', got '",
                    method, "'");
  TORCH_CHECK_VALUE(target_probs.defined(), "target_probs must be a tensor, got None");
  const at::Device device = target_probs.device();
  check_tensor(target_probs, "target_probs", at::kFloat, 3, device);
  const int64_t batch = target_probs.size(0);
  const int64_t k1 = target_probs.size(1);
  const int64_t vocab = target_probs.size(2);
  TORCH_CHECK_VALUE(k1 >= 1 && vocab >= 1, "target_probs must be [B, K+1, V] with K+1 >= 1 and V >= 1, got ",
                    shape_str(target_probs));
  TORCH_CHECK_VALUE(vocab < (int64_t{1} << 31), "target_probs: vocabulary size ", vocab, " must be < 2^31");
  if (draft_probs.has_value()) {
    check_tensor(*draft_probs, "draft_probs", at::kFloat, 3, device);
    check_size(*draft_probs, "draft_probs", 0, batch, "B of target_probs");
    check_size(*draft_probs, "draft_probs", 1, k1 - 1, "K = target_probs.shape[1] - 1");
    check_size(*draft_probs, "draft_probs", 2, vocab, "V of target_probs");
  }
  check_tensor(draft_token_ids, "draft_token_ids", at::kInt, 2, device);
  check_size(draft_token_ids, "draft_token_ids", 0, batch, "B of target_probs");
  check_size(draft_token_ids, "draft_token_ids", 1, k1 - 1, "K = target_probs.shape[1] - 1");
  check_tensor(num_draft_tokens, "num_draft_tokens", at::kInt, 1, device);
  check_size(num_draft_tokens, "num_draft_tokens", 0, batch, "B of target_probs");
  check_tensor(seeds, "seeds", at::kLong, 1, device);
  check_size(seeds, "seeds", 0, batch, "B of target_probs");
  check_tensor(positions, "positions", at::kLong, 1, device);
  check_size(positions, "positions", 0, batch, "B of target_probs");
  if (check_values) {
    check_probs_values(target_probs, "target_probs");
    if (draft_probs.has_value() && method == "rejection") check_probs_values(*draft_probs, "draft_probs");
    check_draft_values(draft_token_ids, num_draft_tokens, vocab);
    check_positions(positions);
  }
  const AcceptMethod m = method == "coupled" ? AcceptMethod::kCoupled : AcceptMethod::kRejection;
  at::Tensor out = at::empty({batch, k1}, target_probs.options().dtype(at::kInt));
  at::Tensor n_acc = at::empty({batch}, target_probs.options().dtype(at::kInt));
  if (batch == 0) return {out, n_acc};
#ifdef SPECRT_WITH_CUDA
  if (device.is_cuda()) {
    rejection_sample_cuda(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seeds, positions, m, out,
                          n_acc);
    return {out, n_acc};
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "target_probs is on ", device.str(), " but this build of specrt has no kernels for it");
  rejection_sample_cpu(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seeds, positions, m, out, n_acc);
  return {out, n_acc};
}

at::Tensor sample_tokens(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                         int64_t purpose, bool check_values) {
  TORCH_CHECK_VALUE(purpose >= kPurposeDraft && purpose <= kPurposeTarget, "purpose must be 1..4, got ", purpose);
  TORCH_CHECK_VALUE(probs.defined(), "probs must be a tensor, got None");
  const at::Device device = probs.device();
  check_tensor(probs, "probs", at::kFloat, 2, device);
  const int64_t rows = probs.size(0);
  TORCH_CHECK_VALUE(probs.size(1) >= 1, "probs must have a non-empty vocabulary dimension, got shape ",
                    shape_str(probs));
  check_tensor(seeds, "seeds", at::kLong, 1, device);
  check_size(seeds, "seeds", 0, rows, "rows of probs");
  check_tensor(positions, "positions", at::kLong, 1, device);
  check_size(positions, "positions", 0, rows, "rows of probs");
  if (check_values) {
    check_probs_values(probs, "probs");
    check_positions(positions);
  }
  at::Tensor tokens = at::empty({rows}, probs.options().dtype(at::kInt));
  if (rows == 0) return tokens;
#ifdef SPECRT_WITH_CUDA
  if (device.is_cuda()) {
    sample_tokens_cuda(probs, seeds, positions, static_cast<uint32_t>(purpose), tokens);
    return tokens;
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "probs is on ", device.str(), " but this build of specrt has no kernels for it");
  sample_tokens_cpu(probs, seeds, positions, static_cast<uint32_t>(purpose), tokens);
  return tokens;
}

void check_cache(const at::Tensor& cache, const std::string& name, const at::Device& device) {
  TORCH_CHECK_VALUE(cache.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(cache.dim() == 6, name,
                    " must be [layers, 2, num_blocks, block_size, kv_heads, head_dim], got shape ", shape_str(cache));
  TORCH_CHECK_VALUE(cache.size(1) == 2, name, " dim 1 must be 2 (keys, values), got shape ", shape_str(cache));
  TORCH_CHECK_VALUE(cache.device() == device, name, " must be on ", device.str(), ", got ", cache.device().str());
  TORCH_CHECK_VALUE(cache.is_contiguous(), name, " must be contiguous");
}

void copy_blocks(const std::vector<at::Tensor>& caches, const at::Tensor& block_mapping, bool check_values) {
  TORCH_CHECK_VALUE(!caches.empty(), "caches must be a non-empty list of cache tensors");
  TORCH_CHECK_VALUE(caches.size() <= 8, "caches: at most 8 caches per call, got ", caches.size());
  const at::Device device = caches[0].device();
  for (size_t c = 0; c < caches.size(); ++c) check_cache(caches[c], "caches[" + std::to_string(c) + "]", device);
  TORCH_CHECK_VALUE(block_mapping.defined(), "block_mapping must be a tensor, got None");
  TORCH_CHECK_TYPE(block_mapping.scalar_type() == at::kLong, "block_mapping must have dtype int64, got ",
                   c10::toString(block_mapping.scalar_type()));
  TORCH_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
                    "block_mapping must be [P, 2] (src, dst) pairs, got shape ", shape_str(block_mapping));
  TORCH_CHECK_VALUE(block_mapping.is_cpu() || block_mapping.device() == device,
                    "block_mapping must be on the CPU or on the caches' device ", device.str(), ", got ",
                    block_mapping.device().str());
  TORCH_CHECK_VALUE(block_mapping.is_contiguous(), "block_mapping must be contiguous");
  if (block_mapping.size(0) == 0) return;
  if (check_values || block_mapping.device() != device) {
    const at::Tensor h = host(block_mapping);
    const int64_t* m = h.data_ptr<int64_t>();
    std::set<int64_t> dsts, srcs;
    for (int64_t i = 0; i < h.size(0); ++i) {
      for (size_t c = 0; c < caches.size(); ++c) {
        const int64_t nb = caches[c].size(2);
        TORCH_CHECK_VALUE(m[2 * i] >= 0 && m[2 * i] < nb && m[2 * i + 1] >= 0 && m[2 * i + 1] < nb,
                          "block_mapping[", i, "] = (", m[2 * i], ", ", m[2 * i + 1], ") is out of range for caches[",
                          c, "] with ", nb, " blocks");
      }
      TORCH_CHECK_VALUE(dsts.insert(m[2 * i + 1]).second, "block_mapping has duplicate destination block ",
                        m[2 * i + 1]);
      srcs.insert(m[2 * i]);
    }
    for (int64_t d : dsts)
      TORCH_CHECK_VALUE(!srcs.count(d), "block_mapping: block ", d,
                        " is both a source and a destination (the copy order would matter)");
  }
#ifdef SPECRT_WITH_CUDA
  if (device.is_cuda()) {
    // H2D copy of the (small) mapping through pinned memory: asynchronous.
    const at::Tensor mapping = block_mapping.device() == device
                                   ? block_mapping
                                   : block_mapping.pin_memory().to(device, /*non_blocking=*/true);
    copy_blocks_cuda(caches, mapping);
    return;
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "caches are on ", device.str(), " but this build of specrt has no kernels for it");
  copy_blocks_cpu(caches, block_mapping);
}

void write_kv(at::Tensor cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping, bool check_values) {
  TORCH_CHECK_VALUE(cache.defined(), "cache must be a tensor, got None");
  const at::Device device = cache.device();
  check_cache(cache, "cache", device);
  TORCH_CHECK_VALUE(layer >= 0 && layer < cache.size(0), "layer = ", layer, " is out of range for cache with ",
                    cache.size(0), " layers");
  check_tensor(k, "k", cache.scalar_type(), 3, device);
  check_tensor(v, "v", cache.scalar_type(), 3, device);
  const int64_t tokens = k.size(0);
  TORCH_CHECK_VALUE(k.size(1) == cache.size(4) && k.size(2) == cache.size(5), "k must be [T, kv_heads=",
                    cache.size(4), ", head_dim=", cache.size(5), "], got shape ", shape_str(k));
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "v must have the shape of k ", shape_str(k), ", got ", shape_str(v));
  check_tensor(slot_mapping, "slot_mapping", at::kLong, 1, device);
  check_size(slot_mapping, "slot_mapping", 0, tokens, "T = k.shape[0]");
  if (tokens == 0) return;
  if (check_values) {
    const at::Tensor h = host(slot_mapping);
    const int64_t num_slots = cache.size(2) * cache.size(3);
    std::set<int64_t> seen;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t s = h.data_ptr<int64_t>()[t];
      TORCH_CHECK_VALUE(s >= -1 && s < num_slots, "slot_mapping[", t, "] = ", s, " is out of range [-1, ", num_slots,
                        ")");
      TORCH_CHECK_VALUE(s < 0 || seen.insert(s).second, "slot_mapping has duplicate slot ", s);
    }
  }
#ifdef SPECRT_WITH_CUDA
  if (device.is_cuda()) {
    write_kv_cuda(cache, layer, k, v, slot_mapping);
    return;
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "cache is on ", device.str(), " but this build of specrt has no kernels for it");
  write_kv_cpu(cache, layer, k, v, slot_mapping);
}

// ---- testing hooks: the shared header's random numbers, for KAT and
// reference-parity tests ------------------------------------------------------
std::vector<int64_t> philox(std::vector<int64_t> counter, std::vector<int64_t> key) {
  TORCH_CHECK_VALUE(counter.size() == 4, "counter must have 4 words");
  TORCH_CHECK_VALUE(key.size() == 2, "key must have 2 words");
  Philox4x32 c;
  for (int i = 0; i < 4; ++i) c.v[i] = static_cast<uint32_t>(counter[i]);
  const Philox4x32 r = philox4x32_10(c, static_cast<uint32_t>(key[0]), static_cast<uint32_t>(key[1]));
  return {r.v[0], r.v[1], r.v[2], r.v[3]};
}

at::Tensor uniform_noise(const at::Tensor& seeds, const at::Tensor& positions, int64_t purpose,
                         const at::Tensor& index) {
  check_tensor(seeds, "seeds", at::kLong, 1, at::Device(at::kCPU));
  check_tensor(positions, "positions", at::kLong, 1, at::Device(at::kCPU));
  check_tensor(index, "index", at::kLong, 1, at::Device(at::kCPU));
  TORCH_CHECK_VALUE(seeds.size(0) == positions.size(0) && seeds.size(0) == index.size(0),
                    "seeds, positions and index must have the same length");
  at::Tensor out = at::empty({seeds.size(0)}, seeds.options().dtype(at::kFloat));
  for (int64_t i = 0; i < seeds.size(0); ++i)
    out.data_ptr<float>()[i] = uniform(static_cast<uint64_t>(seeds.data_ptr<int64_t>()[i]),
                                       positions.data_ptr<int64_t>()[i], static_cast<uint32_t>(purpose),
                                       static_cast<uint32_t>(index.data_ptr<int64_t>()[i]));
  return out;
}

at::Tensor log_det_tensor(const at::Tensor& x) {
  check_tensor(x, "x", at::kFloat, 1, at::Device(at::kCPU));
  at::Tensor out = at::empty_like(x);
  for (int64_t i = 0; i < x.numel(); ++i) out.data_ptr<float>()[i] = log_det(x.data_ptr<float>()[i]);
  return out;
}

bool cuda_built() {
#ifdef SPECRT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace specrt

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  m.doc() = "specrt compiled kernels; use specrt.ops, not this module";
  m.def("probs_from_logits", &specrt::probs_from_logits, py::arg("logits"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("check_values") = true);
  m.def("verify_greedy", &specrt::verify_greedy, py::arg("target_logits"), py::arg("draft_token_ids"),
        py::arg("num_draft_tokens"), py::arg("check_values") = true);
  m.def("rejection_sample", &specrt::rejection_sample, py::arg("target_probs"), py::arg("draft_probs"),
        py::arg("draft_token_ids"), py::arg("num_draft_tokens"), py::arg("seeds"), py::arg("positions"),
        py::arg("method") = "rejection", py::arg("check_values") = true);
  m.def("sample_tokens", &specrt::sample_tokens, py::arg("probs"), py::arg("seeds"), py::arg("positions"),
        py::arg("purpose") = static_cast<int64_t>(specrt::kPurposeTarget), py::arg("check_values") = true);
  m.def("copy_blocks", &specrt::copy_blocks, py::arg("caches"), py::arg("block_mapping"),
        py::arg("check_values") = true);
  m.def("write_kv", &specrt::write_kv, py::arg("cache"), py::arg("layer"), py::arg("k"), py::arg("v"),
        py::arg("slot_mapping"), py::arg("check_values") = true);
  m.def("philox4x32_10", &specrt::philox, py::arg("counter"), py::arg("key"));
  m.def("uniform", &specrt::uniform_noise, py::arg("seeds"), py::arg("positions"), py::arg("purpose"),
        py::arg("index"));
  m.def("log_det", &specrt::log_det_tensor, py::arg("x"));
  m.def("cuda_built", &specrt::cuda_built);
}
