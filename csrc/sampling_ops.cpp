// specrt's sampling ops — probs_from_logits, verify_greedy, rejection_sample, sample_tokens and
// the randomness testing hooks uniform_noise / log_det, the greedy threshold: schemas, op bodies and the CPU
// registrations (the CUDA registrations live in csrc/cuda/sampling_cuda.cu).
//
// An op body validates every argument and names it in the error (checks.h),
// allocates the outputs and calls the backend kernel it was given (ops.h).
// Value checks (NaN, negative probabilities, token ids) read the data:
// specrt/ops/ asks for them on CPU tensors unless the caller passes
// check_values=False, and on CUDA tensors only in debug mode (each costs a
// device->host sync). Fake kernels live in specrt/ops/fakes.py.
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu/thread_pool.h"
#include "ops.h"
#include "specrt/philox.h"
#include "specrt/sampling.h"

namespace specrt {

namespace {

// A sampled row's largest finite logit divided by its temperature must stay a
// float: x / t = inf for the max gives inf - inf = NaN in the softmax.
void check_scaled_logits_finite(const at::Tensor& logits, const at::Tensor& temperature) {
  const at::Tensor x = host(logits), t = host(temperature);
  const int64_t rows = x.size(0), vocab = x.size(1);
  std::vector<float> row_max(static_cast<size_t>(rows), -INFINITY);
  parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = x.data_ptr<float>() + r * vocab;
      float m = -INFINITY;
      for (int64_t v = 0; v < vocab; ++v) m = row[v] > m ? row[v] : m;   // NaN never wins
      row_max[r] = m;
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    const float tv = t.data_ptr<float>()[r], m = row_max[r];
    if (is_greedy_temperature(tv) || !std::isfinite(m)) continue;   // one-hot rows never divide
    TORCH_CHECK_VALUE(std::isfinite(m / tv), "logits[", r, "] has largest logit ", m, ", which divided by temperature[",
                      r, "] = ", tv, " overflows float32; scale the logits or raise the temperature");
  }
}

}  // namespace

at::Tensor probs_from_logits_op(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                                const at::Tensor& top_p, const std::optional<at::Tensor>& min_p, bool check_values,
                                ProbsFromLogitsKernel kernel) {
  TORCH_CHECK_VALUE(logits.defined(), "logits must be a tensor, got None");
  const at::Device device = logits.device();
  check_tensor(logits, "logits", at::kFloat, 2, device);
  const int64_t rows = logits.size(0);
  TORCH_CHECK_VALUE(logits.size(1) > 0, "logits must have a non-empty vocabulary dimension, got shape ",
                    shape_str(logits));
  check_tensor(temperature, "temperature", at::kFloat, 1, device);
  check_int_arg(top_k, "top_k", 1, device);
  check_tensor(top_p, "top_p", at::kFloat, 1, device);
  check_size(temperature, "temperature", 0, rows, "rows of logits");
  check_size(top_k, "top_k", 0, rows, "rows of logits");
  check_size(top_p, "top_p", 0, rows, "rows of logits");
  const at::Tensor mp = min_p.has_value() ? *min_p : at::Tensor();
  if (mp.defined()) {
    check_tensor(mp, "min_p", at::kFloat, 1, device);
    check_size(mp, "min_p", 0, rows, "rows of logits");
  }
  if (check_values) {
    const at::Tensor t = host(temperature), k = wide_host(top_k), p = host(top_p);
    for (int64_t r = 0; r < rows; ++r) {
      const float tv = t.data_ptr<float>()[r];
      TORCH_CHECK_VALUE(std::isfinite(tv) && tv >= 0.0f, "temperature[", r, "] = ", tv,
                        " must be finite and >= 0 (0 means greedy)");
      const int64_t kv = k.data_ptr<int64_t>()[r];
      TORCH_CHECK_VALUE(kv >= 0, "top_k[", r, "] = ", kv, " must be >= 0 (0 disables top-k)");
      TORCH_CHECK_VALUE(kv <= INT32_MAX, "top_k[", r, "] = ", kv, " must be <= 2^31 - 1 (0 disables top-k)");
      const float pv = p.data_ptr<float>()[r];
      TORCH_CHECK_VALUE(pv > 0.0f && pv <= 1.0f, "top_p[", r, "] = ", pv, " must be in (0, 1] (1 disables top-p)");
    }
    if (mp.defined()) {
      const at::Tensor h = host(mp);
      for (int64_t r = 0; r < rows; ++r) {
        const float v = h.data_ptr<float>()[r];
        TORCH_CHECK_VALUE(v >= 0.0f && v <= 1.0f, "min_p[", r, "] = ", v, " must be in [0, 1] (0 disables min-p)");
      }
    }
  }
  if (check_values) check_scaled_logits_finite(logits, temperature);
  at::Tensor probs = at::empty_like(logits);
  if (rows > 0) kernel(logits, temperature, saturate_int32(top_k), top_p, mp, probs);
  return probs;
}

std::tuple<at::Tensor, at::Tensor> verify_greedy_op(const at::Tensor& target_logits,
                                                    const at::Tensor& draft_token_ids,
                                                    const at::Tensor& num_draft_tokens, bool check_values,
                                                    VerifyGreedyKernel kernel) {
  TORCH_CHECK_VALUE(target_logits.defined(), "target_logits must be a tensor, got None");
  const at::Device device = target_logits.device();
  check_tensor(target_logits, "target_logits", at::kFloat, 3, device);
  const int64_t batch = target_logits.size(0);
  const int64_t k1 = target_logits.size(1);
  const int64_t vocab = target_logits.size(2);
  TORCH_CHECK_VALUE(k1 >= 1 && vocab >= 1, "target_logits must be [B, K+1, V] with K+1 >= 1 and V >= 1, got ",
                    shape_str(target_logits));
  check_int_arg(draft_token_ids, "draft_token_ids", 2, device);
  check_int_arg(num_draft_tokens, "num_draft_tokens", 1, device);
  check_size(draft_token_ids, "draft_token_ids", 0, batch, "B of target_logits");
  check_size(draft_token_ids, "draft_token_ids", 1, k1 - 1, "K = target_logits.shape[1] - 1");
  check_size(num_draft_tokens, "num_draft_tokens", 0, batch, "B of target_logits");
  if (check_values) check_draft_values(draft_token_ids, num_draft_tokens, vocab);
  at::Tensor out = at::empty({batch, k1}, target_logits.options().dtype(at::kInt));
  at::Tensor n_acc = at::empty({batch}, target_logits.options().dtype(at::kInt));
  if (batch > 0)
    kernel(target_logits, saturate_int32(draft_token_ids), saturate_int32(num_draft_tokens), out, n_acc);
  return {out, n_acc};
}

namespace {

// With value checks: every row a request can reach (target rows 0..n_b, draft
// rows 0..n_b-1) holds some probability; an all-zero row would silently yield
// token 0. Run after check_draft_values, so the counts are in [0, K].
void check_reachable_rows(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                          const at::Tensor& num_draft_tokens) {
  const at::Tensor counts = wide_host(num_draft_tokens);
  const at::Tensor p = host(target_probs);
  const at::Tensor q = draft_probs.has_value() ? host(*draft_probs) : at::Tensor();
  const int64_t batch = p.size(0), k1 = p.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = counts.data_ptr<int64_t>()[b];
    for (int64_t i = 0; i <= n; ++i) {
      TORCH_CHECK_VALUE(row_has_mass(p, b * k1 + i), "target_probs[", b, ", ", i,
                        "] is all zero (request ", b, " can reach position ", i, ")");
      TORCH_CHECK_VALUE(i == n || !q.defined() || row_has_mass(q, b * (k1 - 1) + i), "draft_probs[", b, ", ", i,
                        "] is all zero, yet draft_token_ids[", b, ", ", i, "] was sampled from it");
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rejection_sample_op(const at::Tensor& target_probs,
                                                       const std::optional<at::Tensor>& draft_probs,
                                                       const at::Tensor& draft_token_ids,
                                                       const at::Tensor& num_draft_tokens, const at::Tensor& seeds,
                                                       const at::Tensor& positions, const std::string& method,
                                                       bool check_values, RejectionSampleKernel kernel) {
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
  check_int_arg(draft_token_ids, "draft_token_ids", 2, device);
  check_size(draft_token_ids, "draft_token_ids", 0, batch, "B of target_probs");
  check_size(draft_token_ids, "draft_token_ids", 1, k1 - 1, "K = target_probs.shape[1] - 1");
  check_int_arg(num_draft_tokens, "num_draft_tokens", 1, device);
  check_size(num_draft_tokens, "num_draft_tokens", 0, batch, "B of target_probs");
  check_tensor(seeds, "seeds", at::kLong, 1, device);
  check_size(seeds, "seeds", 0, batch, "B of target_probs");
  check_tensor(positions, "positions", at::kLong, 1, device);
  check_size(positions, "positions", 0, batch, "B of target_probs");
  const bool coupled = method == "coupled";
  if (check_values) {
    check_probs_values(target_probs, "target_probs");
    if (draft_probs.has_value() && !coupled) check_probs_values(*draft_probs, "draft_probs");
    check_draft_values(draft_token_ids, num_draft_tokens, vocab);
    check_positions(positions);
    check_reachable_rows(target_probs, coupled ? std::optional<at::Tensor>() : draft_probs, num_draft_tokens);
  }
  at::Tensor out = at::empty({batch, k1}, target_probs.options().dtype(at::kInt));
  at::Tensor n_acc = at::empty({batch}, target_probs.options().dtype(at::kInt));
  if (batch > 0)
    kernel(target_probs, draft_probs, saturate_int32(draft_token_ids), saturate_int32(num_draft_tokens), seeds,
           positions, coupled ? AcceptMethod::kCoupled : AcceptMethod::kRejection, out, n_acc);
  return {out, n_acc};
}

at::Tensor sample_tokens_op(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                            int64_t purpose, bool check_values, SampleTokensKernel kernel) {
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
    const at::Tensor h = host(probs);
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK_VALUE(row_has_mass(h, r), "probs[", r, "] is all zero: there is no token to sample");
  }
  at::Tensor tokens = at::empty({rows}, probs.options().dtype(at::kInt));
  if (rows > 0) kernel(probs, seeds, positions, static_cast<uint32_t>(purpose), tokens);
  return tokens;
}

namespace {

// ---- testing hooks: the shared header's random numbers, for reference-parity tests -------
at::Tensor uniform_noise_cpu(const at::Tensor& seeds, const at::Tensor& positions, int64_t purpose,
                             const at::Tensor& index) {
  TORCH_CHECK_VALUE(purpose >= kPurposeDraft && purpose <= kPurposeTarget, "purpose must be 1..4, got ", purpose);
  check_tensor(seeds, "seeds", at::kLong, 1, at::Device(at::kCPU));
  check_tensor(positions, "positions", at::kLong, 1, at::Device(at::kCPU));
  check_tensor(index, "index", at::kLong, 1, at::Device(at::kCPU));
  TORCH_CHECK_VALUE(seeds.size(0) == positions.size(0) && seeds.size(0) == index.size(0),
                    "seeds, positions and index must have the same length");
  for (int64_t i = 0; i < index.size(0); ++i) {
    const int64_t x = index.data_ptr<int64_t>()[i];
    TORCH_CHECK_VALUE(x >= 0 && x <= UINT32_MAX, "index[", i, "] = ", x, " must be in [0, 2^32)");
  }
  at::Tensor out = at::empty({seeds.size(0)}, seeds.options().dtype(at::kFloat));
  for (int64_t i = 0; i < seeds.size(0); ++i)
    out.data_ptr<float>()[i] = uniform(static_cast<uint64_t>(seeds.data_ptr<int64_t>()[i]),
                                       positions.data_ptr<int64_t>()[i], static_cast<uint32_t>(purpose),
                                       static_cast<uint32_t>(index.data_ptr<int64_t>()[i]));
  return out;
}

// The greedy threshold of sampling.h, for specrt.ops (Python's is_greedy reads it).
double greedy_temperature() { return kGreedyTemperature; }

at::Tensor log_det_cpu(const at::Tensor& x) {
  check_tensor(x, "x", at::kFloat, 1, at::Device(at::kCPU));
  at::Tensor out = at::empty_like(x);
  for (int64_t i = 0; i < x.numel(); ++i) out.data_ptr<float>()[i] = log_det(x.data_ptr<float>()[i]);
  return out;
}

}  // namespace
}  // namespace specrt

// Schemas: one per op; mutated arguments are marked (a!). specrt/ops/ holds
// the documented Python wrappers and the fake (meta) kernels.
TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def("probs_from_logits(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor? min_p=None, "
        "bool check_values=True) -> Tensor");
  m.def("verify_greedy(Tensor target_logits, Tensor draft_token_ids, Tensor num_draft_tokens, "
        "bool check_values=True) -> (Tensor output_token_ids, Tensor num_accepted)");
  m.def("rejection_sample(Tensor target_probs, Tensor? draft_probs, Tensor draft_token_ids, "
        "Tensor num_draft_tokens, Tensor seeds, Tensor positions, str method=\"rejection\", "
        "bool check_values=True) -> (Tensor output_token_ids, Tensor num_accepted)");
  m.def("sample_tokens(Tensor probs, Tensor seeds, Tensor positions, int purpose=4, "
        "bool check_values=True) -> Tensor");
  m.def("uniform_noise(Tensor seeds, Tensor positions, int purpose, Tensor index) -> Tensor");
  m.def("log_det(Tensor x) -> Tensor");
  m.def("greedy_temperature() -> float", &specrt::greedy_temperature);  // no tensors: catch-all
}

TORCH_LIBRARY_IMPL(specrt, CPU, m) {
  using at::Tensor;
  m.impl("probs_from_logits", [](const Tensor& logits, const Tensor& temperature, const Tensor& top_k,
                                 const Tensor& top_p, const std::optional<Tensor>& min_p, bool check) {
    return specrt::probs_from_logits_op(logits, temperature, top_k, top_p, min_p, check,
                                        &specrt::probs_from_logits_cpu);
  });
  m.impl("verify_greedy", [](const Tensor& target_logits, const Tensor& draft_token_ids,
                             const Tensor& num_draft_tokens, bool check) {
    return specrt::verify_greedy_op(target_logits, draft_token_ids, num_draft_tokens, check,
                                    &specrt::verify_greedy_cpu);
  });
  m.impl("rejection_sample",
         [](const Tensor& target_probs, const std::optional<Tensor>& draft_probs, const Tensor& draft_token_ids,
            const Tensor& num_draft_tokens, const Tensor& seeds, const Tensor& positions, std::string method,
            bool check) {
           return specrt::rejection_sample_op(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seeds,
                                              positions, method, check, &specrt::rejection_sample_cpu);
         });
  m.impl("sample_tokens",
         [](const Tensor& probs, const Tensor& seeds, const Tensor& positions, int64_t purpose, bool check) {
           return specrt::sample_tokens_op(probs, seeds, positions, purpose, check, &specrt::sample_tokens_cpu);
         });
  m.impl("uniform_noise", &specrt::uniform_noise_cpu);
  m.impl("log_det", &specrt::log_det_cpu);
}

// Sampling is not differentiable: outputs never require grad, whatever the inputs.
TORCH_LIBRARY_IMPL(specrt, Autograd, m) {
  for (const char* op : {"probs_from_logits", "verify_greedy", "rejection_sample", "sample_tokens", "uniform_noise",
                         "log_det"})
    m.impl(op, torch::CppFunction::makeFallthrough());
}
