// csrc/attention_ops.h — the paged multi-position attention op (schema and
// checks in csrc/attention_ops.cpp, kernels in csrc/cpu/attention_cpu.cpp and
// csrc/cuda/attention_cuda.cu, math in csrc/include/specrt/attention.h).
#pragma once

#include "aten_min.h"

#include <cstdint>
#include <optional>

namespace specrt {

// Arguments after check_paged_attention: contiguous, on one device, dtypes
// q/out float32, kv_cache float32|bfloat16|float16, block_tables int32,
// seq_lens / query_start_loc int64; shapes
//   q, out [T, H, D]; kv_cache [2, num_blocks, block_size, Hkv, D] (one layer);
//   block_tables [B, max_blocks]; seq_lens [B]; query_start_loc [B+1];
//   tree_mask [T] int64 or undefined (every row causal).
// On the CPU the values were checked too (every block the kernel reads is in
// range, 0 <= query_len <= seq_len, query_start_loc[B] <= T); on CUDA only in
// debug mode, and the kernel guards its reads instead.
struct PagedAttentionArgs {
  at::Tensor q, kv_cache, block_tables, seq_lens, query_start_loc, out;
  at::Tensor tree_mask;   // [T] ancestor bits of each query row (attn::tree_visible); undefined: causal
  float qscale;           // scale * log2(e), rounded to float once (both devices use this number)
  int64_t window;         // 0 = no sliding window
  int64_t max_query_len;  // >= every query_len (grid sizing on CUDA without a host sync)
  int64_t max_seq_len;    // >= every seq_len
};

PagedAttentionArgs check_paged_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc, double scale, int64_t window,
                                         int64_t max_query_len, int64_t max_seq_len, bool check_values,
                                         const std::optional<at::Tensor>& tree_mask = std::nullopt);

// Fills args.out (rows >= query_start_loc[B] are zero).
void paged_attention_cpu(const PagedAttentionArgs& args);

// Testing hook: caps the CPU instruction set the attention kernel uses
// (0 = portable scalar, 1 = AVX2+FMA, 2 = AVX-512; -1 = only query) and
// returns the level in use before the call (capped by what the CPU has).
int64_t attention_cpu_isa(int64_t cap);

#ifdef SPECRT_WITH_CUDA
void paged_attention_cuda(const PagedAttentionArgs& args);
#endif

}  // namespace specrt
