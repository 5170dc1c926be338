// CPU kernel of apply_token_bitmask (csrc/bitmask_ops.h); the rule is
// specrt::token_allowed (csrc/include/specrt/bitmask.h), shared with the CUDA
// kernel, and specrt/ops/reference.py's apply_token_bitmask is its reference.
//
// Word by word: a word of all ones (every token allowed) is skipped, a zero word
// (a grammar state allows few tokens, so most words) is 32 stores of -inf, and
// a mixed word is tested bit by bit. Rows run in parallel.

#include <algorithm>
#include <cstdint>

#include "bitmask_ops.h"
#include "cpu/thread_pool.h"
#include "specrt/bitmask.h"

namespace specrt {
namespace {

template <class Bits>
void refuse_rows(const BitmaskArgs& a, Bits neg_inf) {
  const int64_t R = a.logits.size(0), V = a.logits.size(1), n = a.rows.size(0), W = a.bitmask.size(1);
  Bits* logits = static_cast<Bits*>(a.logits.data_ptr());
  const int32_t* bitmask = a.bitmask.data_ptr<int32_t>();
  const int32_t* rows = a.rows.data_ptr<int32_t>();
  const int64_t words = (V + 31) / 32;
  parallel_for(0, n, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r = rows[i];
      if (r < 0 || r >= R) continue;
      Bits* row = logits + r * V;
      const int32_t* w = bitmask + i * W;
      for (int64_t k = 0; k < words; ++k) {
        if (w[k] == -1) continue;
        const int64_t t0 = k * 32, t1 = std::min<int64_t>(t0 + 32, V);
        if (w[k] == 0) {
          std::fill(row + t0, row + t1, neg_inf);
          continue;
        }
        for (int64_t t = t0; t < t1; ++t) {
          if (!token_allowed(w, t)) row[t] = neg_inf;
        }
      }
    }
  });
}

}  // namespace

void apply_token_bitmask_cpu(const BitmaskArgs& a) {
  switch (a.logits.scalar_type()) {
    case at::kFloat: refuse_rows<uint32_t>(a, kNegInfFloat32); break;
    case at::kDouble: refuse_rows<uint64_t>(a, kNegInfFloat64); break;
    case at::kBFloat16: refuse_rows<uint16_t>(a, kNegInfBFloat16); break;
    default: refuse_rows<uint16_t>(a, kNegInfFloat16); break;
  }
}

}  // namespace specrt
