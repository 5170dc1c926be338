// csrc/ops.h — the kernel entry points behind specrt._C.
//
// csrc/bindings.cpp validates every argument (shape, dtype, device,
// contiguity, batch sizes) and then calls the *_cpu or *_cuda function below.
// The implementations may therefore assume:
//   - all tensors are contiguous and on the same device,
//   - probabilities/logits are float32, token ids int32, counts int32,
//     seeds/positions int64, block mappings / slot mappings int64,
//   - shapes are mutually consistent (B, K, V as in DESIGN.md section 2).
// Outputs are allocated by the caller (bindings.cpp) and passed in, so the
// CPU and CUDA paths share one allocation policy.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace specrt {

// method for rejection_sample
enum class AcceptMethod : int { kRejection = 0, kCoupled = 1 };

// ---- CPU (csrc/cpu) ---------------------------------------------------------
// probs[N,V] f32 <- logits[N,V] f32; temperature[N] f32, top_k[N] i32, top_p[N] f32
void probs_from_logits_cpu(const at::Tensor& logits, const at::Tensor& temperature,
                           const at::Tensor& top_k, const at::Tensor& top_p, at::Tensor& probs);
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
// caches: each [layers, 2, num_blocks, block_size, kv_heads, head_dim], any dtype;
// block_mapping[P,2] i64 (validated: in range, no duplicate destination)
void copy_blocks_cpu(const std::vector<at::Tensor>& caches, const at::Tensor& block_mapping);
// k, v [T,H,D] same dtype as cache; slot_mapping[T] i64, -1 = skip
void write_kv_cpu(at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slot_mapping);

#ifdef SPECRT_WITH_CUDA
// ---- CUDA (csrc/cuda) -------------------------------------------------------
// Same contracts. No host synchronisation; launched on the current stream;
// every launch checked with C10_CUDA_KERNEL_LAUNCH_CHECK().
void probs_from_logits_cuda(const at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& top_k, const at::Tensor& top_p, at::Tensor& probs);
void verify_greedy_cuda(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                        const at::Tensor& num_draft_tokens, at::Tensor& output_token_ids,
                        at::Tensor& num_accepted);
void rejection_sample_cuda(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                           const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens,
                           const at::Tensor& seeds, const at::Tensor& positions, AcceptMethod method,
                           at::Tensor& output_token_ids, at::Tensor& num_accepted);
void sample_tokens_cuda(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                        uint32_t purpose, at::Tensor& tokens);
// block_mapping is a device tensor here (bindings.cpp validated it on the host
// before copying it over, or the caller opted out of validation).
void copy_blocks_cuda(const std::vector<at::Tensor>& caches, const at::Tensor& block_mapping);
void write_kv_cuda(at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping);
#endif

}  // namespace specrt
