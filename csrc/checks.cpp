// Argument checks shared by the op bodies (see checks.h).
#include "checks.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace specrt {

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

void check_int_arg(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_TYPE(at::isIntegralType(t.scalar_type(), /*includeBool=*/false), name,
                   " must be an integer tensor, got ", c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got shape ", shape_str(t));
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device.str(), " (like the other inputs), got ",
                    t.device().str());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

at::Tensor host(const at::Tensor& t) { return t.is_cpu() ? t : t.cpu(); }

at::Tensor wide_host(const at::Tensor& t) { return host(t).to(at::kLong).contiguous(); }

at::Tensor saturate_int32(const at::Tensor& t) {
  if (t.scalar_type() == at::kInt) return t;
  // Device work only (no sync): safe on the CUDA hot path and under graph capture.
  return t.to(at::kLong)
      .clamp(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max())
      .to(at::kInt)
      .contiguous();
}

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

bool row_has_mass(const at::Tensor& probs_host, int64_t row) {
  const int64_t vocab = probs_host.size(-1);
  const float* p = probs_host.data_ptr<float>() + row * vocab;
  return std::any_of(p, p + vocab, [](float x) { return x > 0.0f; });
}

void check_draft_values(const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens, int64_t vocab) {
  const at::Tensor ids = wide_host(draft_token_ids);
  const at::Tensor counts = wide_host(num_draft_tokens);
  const int64_t batch = ids.size(0);
  const int64_t k = ids.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = counts.data_ptr<int64_t>()[b];
    TORCH_CHECK_VALUE(n >= 0 && n <= k, "num_draft_tokens[", b, "] = ", n, " must be in [0, K=", k, "]");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t x = ids.data_ptr<int64_t>()[b * k + i];
      TORCH_CHECK_VALUE(x >= 0 && x < vocab, "draft_token_ids[", b, ", ", i, "] = ", x,
                        " is out of range for vocabulary size ", vocab);
    }
  }
}

void check_tree_values(const at::Tensor& node_token_ids, const at::Tensor& node_parents, const at::Tensor& num_nodes,
                       int64_t vocab) {
  const at::Tensor ids = wide_host(node_token_ids);
  const at::Tensor parents = wide_host(node_parents);
  const at::Tensor counts = wide_host(num_nodes);
  const int64_t batch = ids.size(0);
  const int64_t max_nodes = ids.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = counts.data_ptr<int64_t>()[b];
    TORCH_CHECK_VALUE(n >= 0 && n <= max_nodes, "num_nodes[", b, "] = ", n, " must be in [0, N=", max_nodes, "]");
    for (int64_t j = 0; j < n; ++j) {
      const int64_t parent = parents.data_ptr<int64_t>()[b * max_nodes + j];
      TORCH_CHECK_VALUE(parent >= -1 && parent < j, "node_parents[", b, ", ", j, "] = ", parent,
                        " must be in [-1, ", j - 1, "] (-1 = the root; a parent comes before its children)");
      const int64_t x = ids.data_ptr<int64_t>()[b * max_nodes + j];
      TORCH_CHECK_VALUE(x >= 0 && x < vocab, "node_token_ids[", b, ", ", j, "] = ", x,
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

void check_cache(const at::Tensor& cache, const std::string& name, const at::Device& device) {
  TORCH_CHECK_VALUE(cache.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(cache.dim() == 6, name,
                    " must be [layers, 2, num_blocks, block_size, kv_heads, head_dim], got shape ", shape_str(cache));
  TORCH_CHECK_VALUE(cache.size(1) == 2, name, " dim 1 must be 2 (keys, values), got shape ", shape_str(cache));
  TORCH_CHECK_VALUE(cache.device() == device, name, " must be on ", device.str(), ", got ", cache.device().str());
  TORCH_CHECK_VALUE(cache.is_contiguous(), name, " must be contiguous");
}

}  // namespace specrt
