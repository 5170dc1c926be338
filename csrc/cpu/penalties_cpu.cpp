// CPU kernel of apply_penalties (csrc/penalties_ops.h); the float math is
// specrt::penalized_logit (csrc/include/specrt/penalties.h), shared with the
// CUDA kernel, and specrt/ops/reference.py's apply_penalties is its reference.
//
// Per row: the request's draft tokens before the row are looked up in its
// sorted entries (binary search), so a row costs O(entries + i log entries)
// whatever the vocabulary; each token is rewritten once. Rows run in parallel.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/thread_pool.h"
#include "penalties_ops.h"
#include "specrt/penalties.h"

namespace specrt {

void apply_penalties_cpu(const PenaltiesArgs& a) {
  const int64_t R = a.logits.size(0), V = a.logits.size(1);
  const int64_t B = a.entry_start.size(0) - 1, K = a.draft_token_ids.size(1), E = a.entry_token.size(0);
  float* logits = a.logits.data_ptr<float>();
  const int32_t* row_request = a.row_request.data_ptr<int32_t>();
  const int32_t* row_offset = a.row_offset.data_ptr<int32_t>();
  const int32_t* drafts = a.draft_token_ids.data_ptr<int32_t>();
  const int64_t* start = a.entry_start.data_ptr<int64_t>();
  const int32_t* token = a.entry_token.data_ptr<int32_t>();
  const int32_t* count = a.entry_count.data_ptr<int32_t>();
  const bool* in_prompt = a.entry_in_prompt.data_ptr<bool>();
  const float* bias = a.entry_bias.data_ptr<float>();
  const float* rp = a.repetition_penalty.data_ptr<float>();
  const float* fp = a.frequency_penalty.data_ptr<float>();
  const float* pp = a.presence_penalty.data_ptr<float>();
  parallel_for(0, R, 16, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> hits;    // entries the row's earlier drafts hit (with multiplicity)
    std::vector<int32_t> fresh;   // the row's earlier drafts that are no entry (with multiplicity)
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t b = row_request[r];
      if (b < 0 || b >= B) continue;
      const int64_t i = std::clamp<int64_t>(row_offset[r], 0, K);
      const int64_t s = std::clamp<int64_t>(start[b], 0, E), e = std::clamp<int64_t>(start[b + 1], s, E);
      float* row = logits + r * V;
      hits.clear();
      fresh.clear();
      for (int64_t j = 0; j < i; ++j) {
        const int32_t d = drafts[b * K + j];
        if (d < 0 || d >= V) continue;
        const int64_t idx = find_token(token + s, e - s, d);
        if (idx >= 0) hits.push_back(idx);
        else fresh.push_back(d);
      }
      std::sort(hits.begin(), hits.end());
      std::sort(fresh.begin(), fresh.end());
      size_t h = 0;
      for (int64_t idx = 0; idx < e - s; ++idx) {
        int64_t n = count[s + idx];
        for (; h < hits.size() && hits[h] == idx; ++h) ++n;
        const int32_t t = token[s + idx];
        if (t < 0 || t >= V) continue;
        row[t] = penalized_logit(row[t], bias[s + idx], rp[b], in_prompt[s + idx],
                                 static_cast<int32_t>(std::min<int64_t>(n, INT32_MAX)), fp[b], pp[b]);
      }
      for (size_t f = 0; f < fresh.size();) {
        const int32_t t = fresh[f];
        int32_t n = 0;
        for (; f < fresh.size() && fresh[f] == t; ++f) ++n;
        row[t] = penalized_logit(row[t], 0.0f, rp[b], false, n, fp[b], pp[b]);
      }
    }
  });
}

}  // namespace specrt
