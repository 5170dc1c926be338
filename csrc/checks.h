// csrc/checks.h — argument checks shared by every op body (csrc/*_ops.cpp).
//
// Every check names the argument and says what was expected, and raises a
// Python exception (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE ->
// TypeError) instead of letting a kernel touch memory it should not.
// Value checks read the data: the op bodies run them only when the caller
// asked for them (check_values), since on CUDA tensors each costs a
// device->host sync.
#pragma once

#include "aten_min.h"

#include <string>

namespace specrt {

std::string shape_str(const at::Tensor& t);

// Defined, exact dtype, dim, on `device`, contiguous.
void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                  const at::Device& device);
void check_size(const at::Tensor& t, const char* name, int64_t dim, int64_t expected, const char* what);

// An integer argument the kernels read as int32: any integer dtype but bool
// (TypeError otherwise), dim, device, contiguity. Run the value checks on the
// wide values (`wide_host`) first: they name the real value. The int32 copy
// handed to the kernel saturates values outside int32, which the kernels treat
// as invalid (an id >= V is rejected, a count > K clamped, a top_k >= V off).
void check_int_arg(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device);
at::Tensor wide_host(const at::Tensor& t);          // int64 copy on the host (a sync for CUDA tensors)
at::Tensor saturate_int32(const at::Tensor& t);     // no copy when already int32

// Host copy for value checks (a sync for CUDA tensors).
at::Tensor host(const at::Tensor& t);

// Finite and >= 0 everywhere.
void check_probs_values(const at::Tensor& probs, const char* name);
// Row `row` ([..., V] flattened to rows) of a float32 host tensor has a positive entry.
bool row_has_mass(const at::Tensor& probs_host, int64_t row);
// num_draft_tokens[b] in [0, K] and draft_token_ids[b, :n] in [0, vocab), on the wide values.
void check_draft_values(const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens, int64_t vocab);
void check_positions(const at::Tensor& positions);
// Token trees, on the wide values: num_nodes[b] in [0, N]; for j < num_nodes[b]
// node_parents[b, j] in [-1, j-1] and node_token_ids[b, j] in [0, vocab).
void check_tree_values(const at::Tensor& node_token_ids, const at::Tensor& node_parents, const at::Tensor& num_nodes,
                       int64_t vocab);
// A KV cache [layers, 2, num_blocks, block_size, kv_heads, head_dim] on `device`.
void check_cache(const at::Tensor& cache, const std::string& name, const at::Device& device);

}  // namespace specrt
