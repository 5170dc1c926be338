// CPU kernels of the sampling ops (docs/architecture.md section 2). The math lives in
// csrc/include/specrt/sampling.h and is shared with csrc/cuda; the reference
// of each function is the function of the same name in specrt/ops/reference.py.
//
// Parallelism: parallel_for (csrc/cpu/thread_pool.h) over (row, vocabulary chunk) tasks, so one
// request with a 128k vocabulary still uses every core; per-chunk winners are
// packed u64 (key, lowest index) and reduced with max, exactly as the CUDA
// kernels reduce with atomicMax, so the thread count never changes a result.
// The races run on the vector path csrc/cpu/cpu_isa.h picks (csrc/cpu/race.h):
// bit-identical to the scalar definition, much faster.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/cpu_isa.h"
#include "cpu/probs.h"
#include "cpu/probs_select.h"
#include "cpu/race.h"
#include "cpu/thread_pool.h"
#include "ops.h"
#include "specrt/sampling.h"

namespace specrt {
namespace {

// Vocabulary chunk per task: a multiple of 16 so the vector paths start on a
// Philox block (4 tokens) and a full vector.
constexpr int64_t kChunk = 8192;

int64_t num_chunks(int64_t vocab) { return (vocab + kChunk - 1) / kChunk; }

// Run task(row, begin, end) -> u64 over every (row, chunk) pair in parallel and
// reduce each row's chunks with max (rows 0..num_rows-1; the task maps them).
template <typename TaskFn>
std::vector<uint64_t> reduce_rows_by_chunks(int64_t num_rows, int64_t vocab, const TaskFn& task) {
  const int64_t chunks = num_chunks(vocab);
  std::vector<uint64_t> partial(static_cast<size_t>(num_rows * chunks), 0);
  parallel_for(0, num_rows * chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t row = t / chunks;
      const int64_t c = t % chunks;
      partial[t] = task(row, c * kChunk, std::min(vocab, (c + 1) * kChunk));
    }
  });
  std::vector<uint64_t> best(static_cast<size_t>(num_rows), 0);
  for (int64_t row = 0; row < num_rows; ++row)
    for (int64_t c = 0; c < chunks; ++c) best[row] = std::max(best[row], partial[row * chunks + c]);
  return best;
}

// argmax of row[begin, end) (NaN as -inf, ties to the lowest index) packed as
// pack_argmax(ordered_key(max), index), so chunks reduce with max.
uint64_t argmax_chunk(CpuIsa isa, const float* row, int64_t begin, int64_t end) {
  const int64_t best = begin + argmax(isa, row + begin, end - begin);
  return pack_argmax(ordered_key(row[best]), static_cast<uint32_t>(best));
}

// One row of probs_from_logits; `scratch` is working space. Each pass is one of
// csrc/cpu/probs.h on the chosen instruction set; the thresholds come from
// csrc/cpu/probs_select.h (no sort of the row).
void probs_row(CpuIsa isa, const float* logits, float temperature, int32_t top_k, float top_p, float min_p,
               int64_t vocab, float* out, std::vector<float>& scratch) {
  const int64_t best = argmax(isa, logits, vocab);
  const float max_logit = logits[best] != logits[best] ? -INFINITY : logits[best];
  if (is_greedy_temperature(temperature) || !std::isfinite(max_logit)) {
    std::fill(out, out + vocab, 0.0f);
    out[best] = 1.0f;
    return;
  }
  // top-k: keep every logit whose x / temperature is >= that of the k-th largest
  // (division is monotone, so that is the k-th largest of the x / temperature)
  float floor = -INFINITY;
  if (top_k > 0 && top_k < vocab) floor = kth_largest(isa, logits, vocab, top_k, scratch) / temperature;
  // softmax (NaN logits count as -inf and get 0)
  double sum = softmax_numerators(isa, logits, vocab, temperature, max_logit / temperature, floor, out);
  // min-p (specrt/sampling.h, min_p_drops): numerators below min_p become 0
  if (min_p > 0.0f) sum = keep_at_least(isa, out, vocab, min_p);
  divide(isa, out, vocab, static_cast<float>(sum));
  // top-p: keep every prob >= the prob where the descending cumsum reaches top_p
  if (top_p < 1.0f) {
    const float cut = top_p_cut(isa, out, vocab, top_p, scratch);
    divide(isa, out, vocab, static_cast<float>(keep_at_least(isa, out, vocab, cut)));
  }
}

}  // namespace

void probs_from_logits_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                           const at::Tensor& top_p, const at::Tensor& min_p, at::Tensor& probs) {
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const float* x = logits.data_ptr<float>();
  const float* t = temperature.data_ptr<float>();
  const int32_t* k = top_k.data_ptr<int32_t>();
  const float* p = top_p.data_ptr<float>();
  const float* mp = min_p.defined() ? min_p.data_ptr<float>() : nullptr;
  float* out = probs.data_ptr<float>();
  const CpuIsa isa = cpu_isa();
  parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch;
    for (int64_t r = lo; r < hi; ++r)
      probs_row(isa, x + r * vocab, t[r], k[r], p[r], mp ? mp[r] : 0.0f, vocab, out + r * vocab, scratch);
  });
}

void verify_greedy_cpu(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                       const at::Tensor& num_draft_tokens, at::Tensor& output_token_ids,
                       at::Tensor& num_accepted) {
  const int64_t batch = target_logits.size(0);
  const int64_t k1 = target_logits.size(1);
  const int64_t vocab = target_logits.size(2);
  const float* logits = target_logits.data_ptr<float>();
  const int32_t* draft = draft_token_ids.data_ptr<int32_t>();
  const int32_t* n_draft = num_draft_tokens.data_ptr<int32_t>();
  int32_t* out = output_token_ids.data_ptr<int32_t>();
  int32_t* n_acc = num_accepted.data_ptr<int32_t>();
  const CpuIsa isa = cpu_isa();
  // argmax of every (request, position) row the request can reach (positions
  // 0..num_draft_tokens), vocabulary split in chunks
  const auto best = reduce_rows_by_chunks(batch * k1, vocab, [&](int64_t row, int64_t lo, int64_t hi) {
    if (row % k1 > std::clamp<int64_t>(n_draft[row / k1], 0, k1 - 1)) return uint64_t{0};
    return argmax_chunk(isa, logits + row * vocab, lo, hi);
  });
  for (int64_t b = 0; b < batch; ++b) {
    // unchecked inputs stay in bounds: counts clamped to [0, K]; a bad id never equals an argmax
    const int64_t n = std::clamp<int64_t>(n_draft[b], 0, k1 - 1);
    int64_t i = 0;
    while (i < n && draft[b * (k1 - 1) + i] == unpack_argmax_index(best[b * k1 + i])) ++i;
    for (int64_t j = 0; j < k1; ++j) out[b * k1 + j] = j <= i ? unpack_argmax_index(best[b * k1 + j]) : -1;
    n_acc[b] = static_cast<int32_t>(i);
  }
}

void rejection_sample_cpu(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                          const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens,
                          const at::Tensor& seeds, const at::Tensor& positions, AcceptMethod method,
                          at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  const int64_t batch = target_probs.size(0);
  const int64_t k1 = target_probs.size(1);
  const int64_t k = k1 - 1;
  const int64_t vocab = target_probs.size(2);
  const float* p = target_probs.data_ptr<float>();
  const float* q = draft_probs.has_value() ? draft_probs->data_ptr<float>() : nullptr;
  const int32_t* draft = draft_token_ids.data_ptr<int32_t>();
  const int32_t* n_draft = num_draft_tokens.data_ptr<int32_t>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int32_t* out = output_token_ids.data_ptr<int32_t>();
  int32_t* n_acc = num_accepted.data_ptr<int32_t>();
  const CpuIsa isa = cpu_isa();
  std::fill(out, out + batch * k1, -1);
  // unchecked inputs stay in bounds: counts clamped to [0, K]
  auto drafted = [&](int64_t b) { return std::clamp<int64_t>(n_draft[b], 0, k); };

  if (method == AcceptMethod::kCoupled) {
    // Round i: every request still accepting races its target row i under
    // TARGET noise; accept while the draft equals the winner.
    std::vector<int64_t> active(static_cast<size_t>(batch));
    std::iota(active.begin(), active.end(), 0);
    for (int64_t i = 0; i <= k && !active.empty(); ++i) {
      const auto best = reduce_rows_by_chunks(
          static_cast<int64_t>(active.size()), vocab, [&](int64_t a, int64_t lo, int64_t hi) {
            const int64_t b = active[a];
            RaceRow row;
            row.p = p + (b * k1 + i) * vocab;
            row.seed = static_cast<uint64_t>(seed[b]);
            row.position = pos[b] + i;
            row.purpose = kPurposeTarget;
            return race(isa, row, lo, hi);
          });
      std::vector<int64_t> still;
      for (size_t a = 0; a < active.size(); ++a) {
        const int64_t b = active[a];
        const int32_t winner = race_winner(best[a]);
        out[b * k1 + i] = winner;
        if (i < drafted(b) && draft[b * k + i] == winner) {
          still.push_back(b);
        } else {
          n_acc[b] = static_cast<int32_t>(i);
        }
      }
      active.swap(still);
    }
    return;
  }

  // Phase 1: coins. first[b] = index of the first rejected draft, or n if all accepted.
  std::vector<int64_t> first(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = drafted(b);
    int64_t i = 0;
    for (; i < n; ++i) {
      const int32_t x = draft[b * k + i];
      if (x < 0 || x >= vocab) break;  // an out-of-range draft id is rejected, never read
      const float p_x = p[(b * k1 + i) * vocab + x];
      const float q_x = q ? q[(b * k + i) * vocab + x] : 1.0f;
      const float u = uniform(static_cast<uint64_t>(seed[b]), pos[b] + i, kPurposeAccept, 0u);
      if (!accept_draft(u, p_x, q_x)) break;
      out[b * k1 + i] = x;
    }
    first[b] = i;
    n_acc[b] = static_cast<int32_t>(i);
  }

  // Phase 2: one race per request, RESIDUAL noise at the emitted position, over
  // the only row that is sampled: the residual max(p - q, 0) at the first
  // rejection, or p_n (bonus) when every draft was accepted.
  auto sampled_row = [&](int64_t b, bool residual) {
    const int64_t i = first[b];
    RaceRow row;
    row.p = p + (b * k1 + i) * vocab;
    row.seed = static_cast<uint64_t>(seed[b]);
    row.position = pos[b] + i;
    row.purpose = kPurposeResidual;
    if (residual && i < drafted(b)) {
      row.weights = q ? RaceWeights::kResidual : RaceWeights::kResidualOneHot;
      row.q = q ? q + (b * k + i) * vocab : nullptr;
      row.onehot = draft[b * k + i];
    }
    return row;
  };
  const auto best = reduce_rows_by_chunks(batch, vocab, [&](int64_t b, int64_t lo, int64_t hi) {
    return race(isa, sampled_row(b, true), lo, hi);
  });
  // A residual that is all zero (q >= p everywhere, only by rounding) falls back
  // to racing p itself under the same noise.
  std::vector<int64_t> empty;
  for (int64_t b = 0; b < batch; ++b) {
    if (best[b] == 0 && first[b] < drafted(b)) empty.push_back(b);
    else out[b * k1 + first[b]] = race_winner(best[b]);
  }
  if (empty.empty()) return;
  const auto fallback = reduce_rows_by_chunks(static_cast<int64_t>(empty.size()), vocab,
                                              [&](int64_t e, int64_t lo, int64_t hi) {
                                                return race(isa, sampled_row(empty[e], false), lo, hi);
                                              });
  for (size_t e = 0; e < empty.size(); ++e) out[empty[e] * k1 + first[empty[e]]] = race_winner(fallback[e]);
}

void sample_tokens_cpu(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                       uint32_t purpose, at::Tensor& tokens) {
  const int64_t rows = probs.size(0);
  const int64_t vocab = probs.size(1);
  const float* p = probs.data_ptr<float>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int32_t* out = tokens.data_ptr<int32_t>();
  const CpuIsa isa = cpu_isa();
  const auto best = reduce_rows_by_chunks(rows, vocab, [&](int64_t r, int64_t lo, int64_t hi) {
    RaceRow row;
    row.p = p + r * vocab;
    row.seed = static_cast<uint64_t>(seed[r]);
    row.position = pos[r];
    row.purpose = purpose;
    return race(isa, row, lo, hi);
  });
  for (int64_t r = 0; r < rows; ++r) out[r] = race_winner(best[r]);
}

}  // namespace specrt
