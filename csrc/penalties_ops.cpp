// specrt::apply_penalties — schema, argument checks and the CPU registration
// (the CUDA registration lives in csrc/cuda/penalties_cuda.cu).
//
// Every check names the argument. Shapes, dtypes, devices and contiguity are
// always checked; values (request indices, offsets, the CSR table, token ids,
// penalties) when check_values is set: specrt/ops/ sets it for CPU tensors
// and, in debug mode, for CUDA tensors (each read is a device->host sync).
#include <torch/library.h>

#include <cmath>

#include "checks.h"
#include "penalties_ops.h"

namespace specrt {
namespace {

void check_values_of(const PenaltiesArgs& a) {
  const int64_t R = a.logits.size(0), V = a.logits.size(1);
  const int64_t B = a.entry_start.size(0) - 1, K = a.draft_token_ids.size(1), E = a.entry_token.size(0);
  const at::Tensor req = wide_host(a.row_request), off = wide_host(a.row_offset);
  const at::Tensor drafts = wide_host(a.draft_token_ids), start = host(a.entry_start);
  const at::Tensor tok = wide_host(a.entry_token), cnt = wide_host(a.entry_count), bias = host(a.entry_bias);
  const int64_t* s = start.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(s[0] == 0, "entry_start[0] = ", s[0], " must be 0");
  TORCH_CHECK_VALUE(s[B] == E, "entry_start[", B, "] = ", s[B], " must equal the ", E, " entries");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(s[b] <= s[b + 1], "entry_start must be non-decreasing, got entry_start[", b, "] = ", s[b],
                      " > entry_start[", b + 1, "] = ", s[b + 1]);
    for (int64_t e = s[b]; e < s[b + 1]; ++e) {
      const int64_t t = tok.data_ptr<int64_t>()[e];
      TORCH_CHECK_VALUE(t >= 0 && t < V, "entry_token[", e, "] = ", t, " is out of range for vocabulary size ", V);
      TORCH_CHECK_VALUE(e == s[b] || t > tok.data_ptr<int64_t>()[e - 1], "entry_token[", e, "] = ", t,
                        ": the tokens of request ", b, " must be strictly increasing");
      const int64_t c = cnt.data_ptr<int64_t>()[e];
      TORCH_CHECK_VALUE(c >= 0 && c <= INT32_MAX, "entry_count[", e, "] = ", c, " must be in [0, 2^31 - 1]");
      const float bv = bias.data_ptr<float>()[e];
      TORCH_CHECK_VALUE(std::isfinite(bv), "entry_bias[", e, "] = ", bv, " must be finite");
    }
  }
  const at::Tensor rp = host(a.repetition_penalty), fp = host(a.frequency_penalty), pp = host(a.presence_penalty);
  for (int64_t b = 0; b < B; ++b) {
    const float r = rp.data_ptr<float>()[b], f = fp.data_ptr<float>()[b], p = pp.data_ptr<float>()[b];
    TORCH_CHECK_VALUE(std::isfinite(r) && r > 0.0f, "repetition_penalty[", b, "] = ", r,
                      " must be finite and > 0 (1 disables it)");
    TORCH_CHECK_VALUE(std::isfinite(f), "frequency_penalty[", b, "] = ", f, " must be finite (0 disables it)");
    TORCH_CHECK_VALUE(std::isfinite(p), "presence_penalty[", b, "] = ", p, " must be finite (0 disables it)");
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = req.data_ptr<int64_t>()[r], i = off.data_ptr<int64_t>()[r];
    TORCH_CHECK_VALUE(b >= 0 && b < B, "row_request[", r, "] = ", b, " must be in [0, B=", B, ")");
    TORCH_CHECK_VALUE(i >= 0 && i <= K, "row_offset[", r, "] = ", i, " must be in [0, K=", K, "]");
    for (int64_t j = 0; j < i; ++j) {
      const int64_t d = drafts.data_ptr<int64_t>()[b * K + j];
      TORCH_CHECK_VALUE(d >= 0 && d < V, "draft_token_ids[", b, ", ", j, "] = ", d,
                        " is out of range for vocabulary size ", V, " (row ", r, " follows it)");
    }
  }
}

}  // namespace

PenaltiesArgs check_apply_penalties(const at::Tensor& logits, const at::Tensor& row_request,
                                    const at::Tensor& row_offset, const at::Tensor& draft_token_ids,
                                    const at::Tensor& entry_start, const at::Tensor& entry_token,
                                    const at::Tensor& entry_count, const at::Tensor& entry_in_prompt,
                                    const at::Tensor& entry_bias, const at::Tensor& repetition_penalty,
                                    const at::Tensor& frequency_penalty, const at::Tensor& presence_penalty,
                                    bool check_values) {
  TORCH_CHECK_VALUE(logits.defined(), "logits must be a tensor, got None");
  const at::Device device = logits.device();
  check_tensor(logits, "logits", at::kFloat, 2, device);
  const int64_t R = logits.size(0);
  TORCH_CHECK_VALUE(logits.size(1) >= 1 && logits.size(1) <= INT32_MAX,
                    "logits must have a vocabulary dimension in [1, 2^31 - 1], got shape ", shape_str(logits));
  check_int_arg(row_request, "row_request", 1, device);
  check_size(row_request, "row_request", 0, R, "rows of logits");
  check_int_arg(row_offset, "row_offset", 1, device);
  check_size(row_offset, "row_offset", 0, R, "rows of logits");
  check_tensor(entry_start, "entry_start", at::kLong, 1, device);
  TORCH_CHECK_VALUE(entry_start.size(0) >= 1, "entry_start must be [B+1], got shape ", shape_str(entry_start));
  const int64_t B = entry_start.size(0) - 1;
  check_int_arg(draft_token_ids, "draft_token_ids", 2, device);
  check_size(draft_token_ids, "draft_token_ids", 0, B, "B = entry_start.shape[0] - 1");
  check_int_arg(entry_token, "entry_token", 1, device);
  const int64_t E = entry_token.size(0);
  check_int_arg(entry_count, "entry_count", 1, device);
  check_size(entry_count, "entry_count", 0, E, "entries = entry_token.shape[0]");
  check_tensor(entry_in_prompt, "entry_in_prompt", at::kBool, 1, device);
  check_size(entry_in_prompt, "entry_in_prompt", 0, E, "entries = entry_token.shape[0]");
  check_tensor(entry_bias, "entry_bias", at::kFloat, 1, device);
  check_size(entry_bias, "entry_bias", 0, E, "entries = entry_token.shape[0]");
  check_tensor(repetition_penalty, "repetition_penalty", at::kFloat, 1, device);
  check_size(repetition_penalty, "repetition_penalty", 0, B, "B = entry_start.shape[0] - 1");
  check_tensor(frequency_penalty, "frequency_penalty", at::kFloat, 1, device);
  check_size(frequency_penalty, "frequency_penalty", 0, B, "B = entry_start.shape[0] - 1");
  check_tensor(presence_penalty, "presence_penalty", at::kFloat, 1, device);
  check_size(presence_penalty, "presence_penalty", 0, B, "B = entry_start.shape[0] - 1");
  PenaltiesArgs a{logits,        saturate_int32(row_request), saturate_int32(row_offset),
                  saturate_int32(draft_token_ids), entry_start, saturate_int32(entry_token),
                  saturate_int32(entry_count), entry_in_prompt, entry_bias,
                  repetition_penalty, frequency_penalty, presence_penalty};
  if (check_values) check_values_of(a);
  return a;
}

}  // namespace specrt

TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def("apply_penalties(Tensor(a!) logits, Tensor row_request, Tensor row_offset, Tensor draft_token_ids, "
        "Tensor entry_start, Tensor entry_token, Tensor entry_count, Tensor entry_in_prompt, Tensor entry_bias, "
        "Tensor repetition_penalty, Tensor frequency_penalty, Tensor presence_penalty, "
        "bool check_values=True) -> ()");
}

TORCH_LIBRARY_IMPL(specrt, CPU, m) {
  m.impl("apply_penalties", &specrt::apply_penalties_op<specrt::apply_penalties_cpu>);
}
