// csrc/penalties_ops.h — the apply_penalties op: logit_bias, repetition,
// frequency and presence penalties applied in place to the logits of every
// verified (or drafted) position at once, each position seeing the tokens
// before it (schema and checks in csrc/penalties_ops.cpp, kernels in
// csrc/cpu/penalties_cpu.cpp and csrc/cuda/penalties_cuda.cu, math in
// csrc/include/specrt/penalties.h).
//
// Row r of the logits belongs to request b = row_request[r] and sits after
// i = row_offset[r] of that request's draft tokens. Request b's history before
// row r is what its entries describe (prompt + generated tokens) plus
// draft_token_ids[b, :i]. The entries are a CSR table per request:
// entry_start[b] .. entry_start[b+1] index tokens that are strictly
// increasing, each with its generated count, an in-prompt flag and a bias.
#pragma once

#include "aten_min.h"

#include <cstdint>

namespace specrt {

// Arguments after check_apply_penalties: contiguous, on the logits' device;
// integers narrowed to int32 (saturating) except entry_start (int64).
struct PenaltiesArgs {
  at::Tensor logits;              // [R, V] float32, mutated
  at::Tensor row_request;         // [R] int32: request of each row
  at::Tensor row_offset;          // [R] int32: draft tokens before each row (0..K)
  at::Tensor draft_token_ids;     // [B, K] int32
  at::Tensor entry_start;         // [B+1] int64
  at::Tensor entry_token;         // [E] int32, strictly increasing within a request
  at::Tensor entry_count;         // [E] int32: times generated (prompt excluded)
  at::Tensor entry_in_prompt;     // [E] bool
  at::Tensor entry_bias;          // [E] float32: logit_bias
  at::Tensor repetition_penalty;  // [B] float32
  at::Tensor frequency_penalty;   // [B] float32
  at::Tensor presence_penalty;    // [B] float32
};

PenaltiesArgs check_apply_penalties(const at::Tensor& logits, const at::Tensor& row_request,
                                    const at::Tensor& row_offset, const at::Tensor& draft_token_ids,
                                    const at::Tensor& entry_start, const at::Tensor& entry_token,
                                    const at::Tensor& entry_count, const at::Tensor& entry_in_prompt,
                                    const at::Tensor& entry_bias, const at::Tensor& repetition_penalty,
                                    const at::Tensor& frequency_penalty, const at::Tensor& presence_penalty,
                                    bool check_values);

// Unchecked values stay in bounds: a row with a request out of range is left
// alone, offsets are clamped to [0, K], entry ranges to [0, E], and tokens
// (entries or drafts) outside [0, V) are skipped.
void apply_penalties_cpu(const PenaltiesArgs& args);
#ifdef SPECRT_WITH_CUDA
void apply_penalties_cuda(const PenaltiesArgs& args);
#endif

// The op body of one backend (registered for CPU and CUDA): the checks, then the kernel.
template <void (*Kernel)(const PenaltiesArgs&)>
void apply_penalties_op(const at::Tensor& logits, const at::Tensor& row_request, const at::Tensor& row_offset,
                        const at::Tensor& draft_token_ids, const at::Tensor& entry_start,
                        const at::Tensor& entry_token, const at::Tensor& entry_count,
                        const at::Tensor& entry_in_prompt, const at::Tensor& entry_bias,
                        const at::Tensor& repetition_penalty, const at::Tensor& frequency_penalty,
                        const at::Tensor& presence_penalty, bool check_values) {
  const PenaltiesArgs a = check_apply_penalties(logits, row_request, row_offset, draft_token_ids, entry_start,
                                                entry_token, entry_count, entry_in_prompt, entry_bias,
                                                repetition_penalty, frequency_penalty, presence_penalty,
                                                check_values);
  if (a.logits.size(0) > 0) Kernel(a);
}

}  // namespace specrt
