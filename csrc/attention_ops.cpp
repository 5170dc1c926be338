// specrt::paged_attention — schema, argument checks and the CPU registration
// (the CUDA registration lives in csrc/cuda/attention_cuda.cu).
//
// Every check names the argument and says what was expected: shapes, dtypes,
// devices and contiguity always; values (lengths, block ids) always on the CPU
// (the kernel reads through them) and on CUDA only when check_values is set
// (each read is a device->host sync; specrt/ops/ sets it in debug mode).
#include <torch/library.h>

#include <cmath>
#include <string>

#include "attention_ops.h"
#include "checks.h"
#include "specrt/attention.h"

namespace specrt {
namespace {

void check_input(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got shape ", shape_str(t));
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device.str(), " (like q), got ", t.device().str());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

std::string dtype_name(at::ScalarType dtype) { return "torch." + std::string(c10::getDtypeNames(dtype).first); }

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype_name(dtype), ", got ",
                   dtype_name(t.scalar_type()));
}

// Lengths and every block id the kernel will read (host copies: a sync on CUDA).
void check_values(const PagedAttentionArgs& a) {
  const at::Tensor seq = a.seq_lens.cpu(), qsl = a.query_start_loc.cpu(), table = a.block_tables.cpu();
  const int64_t* s = seq.data_ptr<int64_t>();
  const int64_t* starts = qsl.data_ptr<int64_t>();
  const int32_t* bt = table.data_ptr<int32_t>();
  const int64_t B = seq.size(0), M = table.size(1), T = a.q.size(0);
  const int64_t num_blocks = a.kv_cache.size(1), block_size = a.kv_cache.size(2);
  TORCH_CHECK_VALUE(starts[0] == 0, "query_start_loc[0] = ", starts[0], " must be 0");
  TORCH_CHECK_VALUE(starts[B] <= T, "query_start_loc[", B, "] = ", starts[B], " exceeds the ", T, " rows of q");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t query_len = starts[b + 1] - starts[b];
    TORCH_CHECK_VALUE(query_len >= 0, "query_start_loc must be non-decreasing, got query_start_loc[", b, "] = ",
                      starts[b], " > query_start_loc[", b + 1, "] = ", starts[b + 1]);
    TORCH_CHECK_VALUE(query_len <= a.max_query_len, "request ", b, " has query_len ", query_len,
                      " > max_query_len = ", a.max_query_len);
    TORCH_CHECK_VALUE(s[b] >= query_len, "seq_lens[", b, "] = ", s[b], " is smaller than its query_len ", query_len,
                      " (seq_lens count the new tokens too)");
    TORCH_CHECK_VALUE(s[b] <= a.max_seq_len, "seq_lens[", b, "] = ", s[b], " > max_seq_len = ", a.max_seq_len);
    if (query_len == 0) continue;
    const int64_t need = (s[b] + block_size - 1) / block_size;
    TORCH_CHECK_VALUE(need <= M, "block_tables has ", M, " columns but request ", b, " needs ", need,
                      " blocks for seq_len ", s[b], " (block_size ", block_size, ")");
    int64_t first = s[b] - query_len - a.window + 1;
    first = a.window > 0 && first > 0 ? first : 0;
    for (int64_t j = first / block_size; j < need; ++j) {
      const int32_t id = bt[b * M + j];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id,
                        " is out of range for kv_cache with ", num_blocks, " blocks");
    }
  }
}

at::Tensor paged_attention_cpu_op(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                  int64_t window, int64_t max_query_len, int64_t max_seq_len, bool check,
                                  const std::optional<at::Tensor>& tree_mask) {
  // The CPU kernel reads through the block table: its values are always checked.
  (void)check;
  const PagedAttentionArgs args = check_paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                                        window, max_query_len, max_seq_len, true, tree_mask);
  paged_attention_cpu(args);
  return args.out;
}

}  // namespace

PagedAttentionArgs check_paged_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc, double scale, int64_t window,
                                         int64_t max_query_len, int64_t max_seq_len, bool values,
                                         const std::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK_VALUE(q.defined(), "q must be a tensor, got None");
  const at::Device device = q.device();
  check_input(q, "q", 3, device);
  check_dtype(q, "q", at::kFloat);
  check_input(kv_cache, "kv_cache", 5, device);
  const at::ScalarType cache_dtype = kv_cache.scalar_type();
  TORCH_CHECK_TYPE(cache_dtype == at::kFloat || cache_dtype == at::kBFloat16 || cache_dtype == at::kHalf,
                   "kv_cache must be float32, bfloat16 or float16, got ", dtype_name(cache_dtype));
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK_VALUE(kv_cache.size(0) == 2 && kv_cache.size(1) > 0 && kv_cache.size(2) > 0 && kv_cache.size(3) > 0 &&
                        kv_cache.size(4) == D,
                    "kv_cache must be one layer's [2, num_blocks, block_size, kv_heads, head_dim=", D,
                    "] (head_dim from q), got shape ", shape_str(kv_cache));
  const int64_t Hkv = kv_cache.size(3);
  TORCH_CHECK_VALUE(H > 0 && D > 0 && H % Hkv == 0, "q must be [T, heads, head_dim] with heads a multiple of the ",
                    Hkv, " kv heads of kv_cache, got shape ", shape_str(q));
  check_input(block_tables, "block_tables", 2, device);
  check_dtype(block_tables, "block_tables", at::kInt);
  check_input(seq_lens, "seq_lens", 1, device);
  check_dtype(seq_lens, "seq_lens", at::kLong);
  check_input(query_start_loc, "query_start_loc", 1, device);
  check_dtype(query_start_loc, "query_start_loc", at::kLong);
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK_VALUE(block_tables.size(0) == B, "block_tables must have one row per request (", B,
                    " = seq_lens.shape[0]), got shape ", shape_str(block_tables));
  TORCH_CHECK_VALUE(query_start_loc.size(0) == B + 1, "query_start_loc must be [B+1] = [", B + 1,
                    "] (B from seq_lens), got shape ", shape_str(query_start_loc));
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0 (0 = no sliding window), got ", window);
  TORCH_CHECK_VALUE(max_query_len >= 0 && max_seq_len >= 0 && max_seq_len < (int64_t{1} << 31),
                    "max_query_len (", max_query_len, ") and max_seq_len (", max_seq_len,
                    ") must be in [0, 2^31)");
  TORCH_CHECK_VALUE(T * H < (int64_t{1} << 31), "q has too many rows x heads: ", shape_str(q));
  // any int64 value is a valid mask (no value checks): the same error kind for dtype, shape and device
  const bool tree = tree_mask.has_value() && tree_mask->defined();
  if (tree) {
    const at::Tensor& t = *tree_mask;
    TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, "tree_mask must have dtype torch.int64, got ",
                      dtype_name(t.scalar_type()));
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == T, "tree_mask must be [T] = [", T,
                      "] (one per row of q), got shape ", shape_str(t));
    TORCH_CHECK_VALUE(t.device() == device, "tree_mask must be on ", device.str(), " (like q), got ",
                      t.device().str());
    TORCH_CHECK_VALUE(t.is_contiguous(), "tree_mask must be contiguous");
  }

  PagedAttentionArgs a;
  a.q = q;
  a.kv_cache = kv_cache;
  a.block_tables = block_tables;
  a.seq_lens = seq_lens;
  a.query_start_loc = query_start_loc;
  a.qscale = static_cast<float>(scale * 1.4426950408889634);  // log2(e): scores in the base-2 domain
  a.window = window;
  a.max_query_len = max_query_len;
  a.max_seq_len = max_seq_len;
  if (tree) a.tree_mask = *tree_mask;
  if (values) check_values(a);
  a.out = at::empty_like(q);
  return a;
}

int64_t attention_tile_keys() { return attn::kTileKeys; }

TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "float scale, int window, int max_query_len, int max_seq_len, bool check_values, Tensor? tree_mask=None) "
      "-> Tensor");
  m.def("_attention_cpu_isa(int cap) -> int", &attention_cpu_isa);  // testing hook, no tensors: catch-all
  // keys per online-softmax update (attn::kTileKeys): a token tree inside one tile verifies with decode's bits
  m.def("attention_tile_keys() -> int", &attention_tile_keys);
}

TORCH_LIBRARY_IMPL(specrt, CPU, m) { m.impl("paged_attention", &paged_attention_cpu_op); }

}  // namespace specrt
