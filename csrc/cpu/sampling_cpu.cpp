// CPU kernels of the sampling ops (DESIGN.md section 2). The math lives in
// csrc/include/specrt/sampling.h and is shared with csrc/cuda; the reference
// of each function is the function of the same name in specrt/reference.py.
//
// Parallelism: at::parallel_for over (row, vocabulary chunk) tasks, so one
// request with a 128k vocabulary still uses every core; per-chunk winners are
// packed u64 (key, lowest index) and reduced with max, exactly as the CUDA
// kernels reduce with atomicMax.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops.h"
#include "specrt/sampling.h"

namespace specrt {
namespace {

// Vocabulary chunk per task: a multiple of 4 so a Philox block never straddles
// two tasks.
constexpr int64_t kChunk = 8192;

int64_t num_chunks(int64_t vocab) { return (vocab + kChunk - 1) / kChunk; }

// Packed race winner over [begin, end) of one row. weight(v) gives w_v >= 0.
template <typename WeightFn>
uint64_t race_chunk(const WeightFn& weight, uint64_t seed, int64_t position, uint32_t purpose,
                    int64_t begin, int64_t end) {
  uint64_t best = 0;
  Philox4x32 block{};
  for (int64_t v = begin; v < end; ++v) {
    if (v == begin || (v & 3) == 0) block = philox_block(seed, position, purpose, static_cast<uint32_t>(v));
    const float w = weight(v);
    if (w > 0.0f) best = std::max(best, race_candidate(race_score_at(w, block, static_cast<uint32_t>(v)),
                                                       static_cast<uint32_t>(v)));
  }
  return best;
}

// Run task(row, begin, end) -> u64 over every (row, chunk) pair in parallel and
// reduce each row's chunks with max. rows are given by index into `row_ids`.
template <typename TaskFn>
std::vector<uint64_t> reduce_rows_by_chunks(int64_t num_rows, int64_t vocab, const TaskFn& task) {
  const int64_t chunks = num_chunks(vocab);
  std::vector<uint64_t> partial(static_cast<size_t>(num_rows * chunks), 0);
  at::parallel_for(0, num_rows * chunks, 1, [&](int64_t lo, int64_t hi) {
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

// argmax with NaN as -inf and ties to the lowest index, as a packed u64 (the
// same answer as a scan with pack_argmax(ordered_key(x), v)). Two passes: the
// max with 8 independent accumulators (x > m is false for NaN, so NaN never
// wins), then the first index equal to it (-0.0 == +0.0).
uint64_t argmax_chunk(const float* row, int64_t begin, int64_t end) {
  float acc[8];
  for (float& a : acc) a = -INFINITY;
  int64_t v = begin;
  for (; v + 8 <= end; v += 8)
    for (int j = 0; j < 8; ++j) acc[j] = row[v + j] > acc[j] ? row[v + j] : acc[j];
  for (; v < end; ++v) acc[0] = row[v] > acc[0] ? row[v] : acc[0];
  float m = acc[0];
  for (int j = 1; j < 8; ++j) m = acc[j] > m ? acc[j] : m;
  int64_t first = begin;  // every entry is -inf or NaN: they tie, the lowest index wins
  if (m != -INFINITY) {
    for (first = begin; first < end && !(row[first] == m); ++first) {
    }
  }
  return pack_argmax(ordered_key(m), static_cast<uint32_t>(first));
}

// One row of probs_from_logits; `scratch` has room for V floats.
void probs_row(const float* logits, float temperature, int32_t top_k, float top_p, int64_t vocab,
               float* out, std::vector<float>& scratch) {
  const int32_t best = unpack_argmax_index(argmax_chunk(logits, 0, vocab));
  const float max_logit = logits[best] != logits[best] ? -INFINITY : logits[best];
  if (temperature == 0.0f || !std::isfinite(max_logit)) {
    std::fill(out, out + vocab, 0.0f);
    out[best] = 1.0f;
    return;
  }
  // temperature, NaN as -inf
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = logits[v];
    out[v] = x != x ? -INFINITY : x / temperature;
  }
  // top-k: keep every logit >= the k-th largest
  if (top_k > 0 && top_k < vocab) {
    scratch.assign(out, out + vocab);
    std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(), std::greater<float>());
    const float kth = scratch[top_k - 1];
    for (int64_t v = 0; v < vocab; ++v)
      if (!(out[v] >= kth)) out[v] = -INFINITY;
  }
  // softmax
  const float m = max_logit / temperature;
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float e = std::exp(out[v] - m);
    out[v] = e;
    sum += e;
  }
  const float inv = static_cast<float>(sum);
  for (int64_t v = 0; v < vocab; ++v) out[v] = out[v] / inv;
  // top-p: keep every prob >= the prob where the descending cumsum reaches top_p
  if (top_p < 1.0f) {
    scratch.clear();
    for (int64_t v = 0; v < vocab; ++v)
      if (out[v] > 0.0f) scratch.push_back(out[v]);
    std::sort(scratch.begin(), scratch.end(), std::greater<float>());
    double csum = 0.0;
    float cut = scratch.empty() ? 0.0f : scratch.back();
    for (float p : scratch) {
      csum += p;
      if (static_cast<float>(csum) >= top_p) {
        cut = p;
        break;
      }
    }
    double kept = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      if (out[v] >= cut) kept += out[v];
      else out[v] = 0.0f;
    }
    const float norm = static_cast<float>(kept);
    for (int64_t v = 0; v < vocab; ++v) out[v] = out[v] / norm;
  }
}

}  // namespace

void probs_from_logits_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                           const at::Tensor& top_p, at::Tensor& probs) {
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const float* x = logits.data_ptr<float>();
  const float* t = temperature.data_ptr<float>();
  const int32_t* k = top_k.data_ptr<int32_t>();
  const float* p = top_p.data_ptr<float>();
  float* out = probs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch;
    scratch.reserve(static_cast<size_t>(vocab));
    for (int64_t r = lo; r < hi; ++r) probs_row(x + r * vocab, t[r], k[r], p[r], vocab, out + r * vocab, scratch);
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
  // argmax of every (request, position) row the request can reach (positions
  // 0..num_draft_tokens), vocabulary split in chunks
  const auto best = reduce_rows_by_chunks(batch * k1, vocab, [&](int64_t row, int64_t lo, int64_t hi) {
    if (row % k1 > std::clamp<int64_t>(n_draft[row / k1], 0, k1 - 1)) return uint64_t{0};
    return argmax_chunk(logits + row * vocab, lo, hi);
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
  std::fill(out, out + batch * k1, -1);

  if (method == AcceptMethod::kCoupled) {
    // Round i: every request still accepting races its target row i under
    // TARGET noise; accept while the draft equals the winner.
    std::vector<int64_t> active(static_cast<size_t>(batch));
    std::iota(active.begin(), active.end(), 0);
    for (int64_t i = 0; i <= k && !active.empty(); ++i) {
      const auto best = reduce_rows_by_chunks(
          static_cast<int64_t>(active.size()), vocab, [&](int64_t a, int64_t lo, int64_t hi) {
            const int64_t b = active[a];
            const float* row = p + (b * k1 + i) * vocab;
            return race_chunk([row](int64_t v) { return row[v]; }, static_cast<uint64_t>(seed[b]), pos[b] + i,
                              kPurposeTarget, lo, hi);
          });
      std::vector<int64_t> still;
      for (size_t a = 0; a < active.size(); ++a) {
        const int64_t b = active[a];
        const int32_t winner = race_winner(best[a]);
        out[b * k1 + i] = winner;
        if (i < std::clamp<int64_t>(n_draft[b], 0, k) && draft[b * k + i] == winner) {
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
  at::parallel_for(0, batch, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n = std::clamp<int64_t>(n_draft[b], 0, k);  // unchecked inputs stay in bounds
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
  });

  // Phase 2: one race per request over its residual row (rejected) or p_n
  // (bonus), RESIDUAL noise at the emitted position. The same noise also races
  // p itself: the fallback when the residual is all zero.
  const int64_t chunks = num_chunks(vocab);
  std::vector<uint64_t> partial(static_cast<size_t>(batch * chunks * 2), 0);
  at::parallel_for(0, batch * chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / chunks;
      const int64_t c = t % chunks;
      const int64_t begin = c * kChunk;
      const int64_t end = std::min(vocab, begin + kChunk);
      const int64_t i = first[b];
      const bool rejected = i < std::clamp<int64_t>(n_draft[b], 0, k);
      const float* prow = p + (b * k1 + i) * vocab;
      const uint64_t s = static_cast<uint64_t>(seed[b]);
      if (!rejected) {
        partial[2 * t] = race_chunk([prow](int64_t v) { return prow[v]; }, s, pos[b] + i, kPurposeResidual,
                                    begin, end);
        continue;
      }
      const int32_t x = draft[b * k + i];
      const float* qrow = q ? q + (b * k + i) * vocab : nullptr;
      uint64_t best_residual = 0;
      uint64_t best_p = 0;
      Philox4x32 block{};
      for (int64_t v = begin; v < end; ++v) {
        if (v == begin || (v & 3) == 0)
          block = philox_block(s, pos[b] + i, kPurposeResidual, static_cast<uint32_t>(v));
        const float pv = prow[v];
        if (!(pv > 0.0f)) continue;  // residual max(p - q, 0) is 0 too
        const float qv = qrow ? qrow[v] : (v == x ? 1.0f : 0.0f);
        const float e = exponential_from_uniform(uniform_from_bits(block.v[v & 3]));
        const float w = residual_weight(pv, qv);
        best_residual = std::max(best_residual, race_candidate(w / e, static_cast<uint32_t>(v)));
        best_p = std::max(best_p, race_candidate(pv / e, static_cast<uint32_t>(v)));
      }
      partial[2 * t] = best_residual;
      partial[2 * t + 1] = best_p;
    }
  });
  for (int64_t b = 0; b < batch; ++b) {
    uint64_t best_residual = 0, best_p = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      best_residual = std::max(best_residual, partial[2 * (b * chunks + c)]);
      best_p = std::max(best_p, partial[2 * (b * chunks + c) + 1]);
    }
    const bool rejected = first[b] < std::clamp<int64_t>(n_draft[b], 0, k);
    out[b * k1 + first[b]] = race_winner(rejected && best_residual == 0 ? best_p : best_residual);
  }
}

void sample_tokens_cpu(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                       uint32_t purpose, at::Tensor& tokens) {
  const int64_t rows = probs.size(0);
  const int64_t vocab = probs.size(1);
  const float* p = probs.data_ptr<float>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int32_t* out = tokens.data_ptr<int32_t>();
  const auto best = reduce_rows_by_chunks(rows, vocab, [&](int64_t r, int64_t lo, int64_t hi) {
    const float* row = p + r * vocab;
    return race_chunk([row](int64_t v) { return row[v]; }, static_cast<uint64_t>(seed[r]), pos[r], purpose, lo, hi);
  });
  for (int64_t r = 0; r < rows; ++r) out[r] = race_winner(best[r]);
}

}  // namespace specrt
