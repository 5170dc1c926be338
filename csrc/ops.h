// csrc/ops.h — the kernel entry points behind the specrt:: torch ops, and the
// op bodies that validate arguments before calling them.
//
// Each registered op (CPU impls in csrc/{sampling,tree,kv}_ops.cpp, CUDA impls in
// csrc/cuda/*.cu) is its op body below with that backend's kernel: the body
// validates every argument (shape, dtype, device, contiguity, batch sizes,
// values when asked), allocates the outputs and calls the *_cpu or *_cuda
// function. The kernels may therefore assume:
//   - all tensors are contiguous and on the same device,
//   - probabilities/logits are float32, token ids int32, counts int32,
//     seeds/positions int64, block mappings / slot mappings int64,
//   - shapes are mutually consistent (B, K, V as in docs/architecture.md section 2).
// Outputs are allocated by the op body and passed in, so the CPU and CUDA
// paths share one allocation policy.
#pragma once

#include "aten_min.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace specrt {

// method for rejection_sample
enum class AcceptMethod : int { kRejection = 0, kCoupled = 1 };

// ---- CPU (csrc/cpu) ---------------------------------------------------------
// probs[N,V] f32 <- logits[N,V] f32; temperature[N] f32, top_k[N] i32, top_p[N] f32,
// min_p[N] f32 or an undefined tensor (no min-p)
void probs_from_logits_cpu(const at::Tensor& logits, const at::Tensor& temperature,
                           const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                           at::Tensor& probs);
// output_token_ids[B,K+1] i32 (pre-filled by the kernel, -1 padded), num_accepted[B] i32
void verify_greedy_cpu(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                       const at::Tensor& num_draft_tokens, at::Tensor& output_token_ids,
                       at::Tensor& num_accepted);
// draft_probs is None for a deterministic (one-hot) draft.
void rejection_sample_cpu(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                          const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens,
                          const at::Tensor& seeds, const at::Tensor& positions, AcceptMethod method,
                          at::Tensor& output_token_ids, at::Tensor& num_accepted);
// tokens[N] i32; purpose is a specrt::Purpose value
void sample_tokens_cpu(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                       uint32_t purpose, at::Tensor& tokens);
// Token trees (csrc/cpu/tree_cpu.cpp): target rows [B,N+1,V] f32, node_token_ids /
// node_parents [B,N] i32, num_nodes [B] i32; outputs output_token_ids [B,N+1] i32,
// num_accepted [B] i32, accepted_nodes [B,N] i32 (the kernel writes the -1 padding).
void verify_tree_greedy_cpu(const at::Tensor& target_logits, const at::Tensor& node_token_ids,
                            const at::Tensor& node_parents, const at::Tensor& num_nodes,
                            at::Tensor& output_token_ids, at::Tensor& num_accepted, at::Tensor& accepted_nodes);
// draft_probs [B,N,V] or None (one-hot drafts); unused by kCoupled.
void rejection_sample_tree_cpu(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                               const at::Tensor& node_token_ids, const at::Tensor& node_parents,
                               const at::Tensor& num_nodes, const at::Tensor& seeds, const at::Tensor& positions,
                               AcceptMethod method, at::Tensor& output_token_ids, at::Tensor& num_accepted,
                               at::Tensor& accepted_nodes);
// caches: each [layers, 2, num_blocks, block_size, kv_heads, head_dim], any dtype;
// block_mapping[P,2] i64 (validated: in range, no duplicate destination)
void copy_blocks_cpu(const std::vector<at::Tensor>& caches, const at::Tensor& block_mapping);
// slot_mapping[P,2] i64 (src, dst) slots (block * block_size + offset); all sources are
// read before any destination is written (validated: in range, distinct destinations)
void copy_slots_cpu(const std::vector<at::Tensor>& caches, const at::Tensor& slot_mapping);
// k, v [T,H,D] same dtype as cache; slot_mapping[T] i64, -1 = skip
void write_kv_cpu(at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slot_mapping);

#ifdef SPECRT_WITH_CUDA
// ---- CUDA (csrc/cuda) -------------------------------------------------------
// Same contracts. No host synchronisation; launched on the current stream;
// every launch checked with C10_CUDA_KERNEL_LAUNCH_CHECK().
void probs_from_logits_cuda(const at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                            at::Tensor& probs);
void verify_greedy_cuda(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                        const at::Tensor& num_draft_tokens, at::Tensor& output_token_ids,
                        at::Tensor& num_accepted);
void rejection_sample_cuda(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                           const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens,
                           const at::Tensor& seeds, const at::Tensor& positions, AcceptMethod method,
                           at::Tensor& output_token_ids, at::Tensor& num_accepted);
void sample_tokens_cuda(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                        uint32_t purpose, at::Tensor& tokens);
void verify_tree_greedy_cuda(const at::Tensor& target_logits, const at::Tensor& node_token_ids,
                             const at::Tensor& node_parents, const at::Tensor& num_nodes,
                             at::Tensor& output_token_ids, at::Tensor& num_accepted, at::Tensor& accepted_nodes);
void rejection_sample_tree_cuda(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                                const at::Tensor& node_token_ids, const at::Tensor& node_parents,
                                const at::Tensor& num_nodes, const at::Tensor& seeds, const at::Tensor& positions,
                                AcceptMethod method, at::Tensor& output_token_ids, at::Tensor& num_accepted,
                                at::Tensor& accepted_nodes);
// block_mapping is a device tensor here (the op body validated it on the host
// before it was copied over, or the caller opted out of validation).
void copy_blocks_cuda(const std::vector<at::Tensor>& caches, const at::Tensor& block_mapping);
void copy_slots_cuda(const std::vector<at::Tensor>& caches, const at::Tensor& slot_mapping);
void write_kv_cuda(at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping);
#endif

// ---- op bodies (csrc/sampling_ops.cpp, tree_ops.cpp, kv_ops.cpp) ------------
// Kernel types: the *_cpu and *_cuda functions above (or a backend wrapper).
using ProbsFromLogitsKernel = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, at::Tensor&);
using VerifyGreedyKernel = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                    at::Tensor&);
using RejectionSampleKernel = void (*)(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                       const at::Tensor&, const at::Tensor&, const at::Tensor&, AcceptMethod,
                                       at::Tensor&, at::Tensor&);
using SampleTokensKernel = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, uint32_t,
                                    at::Tensor&);
using VerifyTreeGreedyKernel = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        at::Tensor&, at::Tensor&, at::Tensor&);
using RejectionSampleTreeKernel = void (*)(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           AcceptMethod, at::Tensor&, at::Tensor&, at::Tensor&);
using CopyBlocksKernel = void (*)(const std::vector<at::Tensor>&, const at::Tensor&);
using CopySlotsKernel = void (*)(const std::vector<at::Tensor>&, const at::Tensor&);
using WriteKvKernel = void (*)(at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&);

// Schemas and argument meaning: csrc/{sampling,tree,kv}_ops.cpp and specrt/ops/.
at::Tensor probs_from_logits_op(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                                const at::Tensor& top_p, const std::optional<at::Tensor>& min_p, bool check_values,
                                ProbsFromLogitsKernel kernel);
std::tuple<at::Tensor, at::Tensor> verify_greedy_op(const at::Tensor& target_logits,
                                                    const at::Tensor& draft_token_ids,
                                                    const at::Tensor& num_draft_tokens, bool check_values,
                                                    VerifyGreedyKernel kernel);
std::tuple<at::Tensor, at::Tensor> rejection_sample_op(const at::Tensor& target_probs,
                                                       const std::optional<at::Tensor>& draft_probs,
                                                       const at::Tensor& draft_token_ids,
                                                       const at::Tensor& num_draft_tokens, const at::Tensor& seeds,
                                                       const at::Tensor& positions, const std::string& method,
                                                       bool check_values, RejectionSampleKernel kernel);
at::Tensor sample_tokens_op(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                            int64_t purpose, bool check_values, SampleTokensKernel kernel);
// Token trees: (output_token_ids [B,N+1], num_accepted [B], accepted_nodes [B,N]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_greedy_op(const at::Tensor& target_logits,
                                                                     const at::Tensor& node_token_ids,
                                                                     const at::Tensor& node_parents,
                                                                     const at::Tensor& num_nodes, bool check_values,
                                                                     VerifyTreeGreedyKernel kernel);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rejection_sample_tree_op(
    const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs, const at::Tensor& node_token_ids,
    const at::Tensor& node_parents, const at::Tensor& num_nodes, const at::Tensor& seeds, const at::Tensor& positions,
    const std::string& method, bool check_values, RejectionSampleTreeKernel kernel);
// The mapping's values are validated on the host when check_values is set or
// when the mapping is on the CPU while the caches are not (free: no sync); a
// CPU mapping for device caches reaches the kernel still on the CPU.
void copy_blocks_op(at::TensorList caches, const at::Tensor& block_mapping, bool check_values,
                    CopyBlocksKernel kernel);
// Same validation rule as copy_blocks_op; slots in range for every cache, distinct destinations.
void copy_slots_op(at::TensorList caches, const at::Tensor& slot_mapping, bool check_values, CopySlotsKernel kernel);
void write_kv_op(const at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& slot_mapping, bool check_values, WriteKvKernel kernel);

}  // namespace specrt
