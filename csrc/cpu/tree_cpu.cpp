// CPU kernels of token-tree verification: verify_tree_greedy and
// rejection_sample_tree (docs/architecture.md section 2, "Token trees"). The float math is
// csrc/include/specrt/tree.h (shared with csrc/cuda/tree_cuda.cu); the
// reference of each function is the function of the same name in
// specrt/ops/reference.py.
//
// Parallelism: parallel_for (csrc/cpu/thread_pool.h) over requests; one request walks its tree
// sequentially (each step depends on the one before). Per visited node the
// work is one pass over the vocabulary: an argmax (greedy), a race (coupled,
// and the final draw of rejection) or, per rejected sibling, one residual pass
// (csrc/cpu/tree_rows.h, vectorised for AVX2 / AVX-512 with the same bits).

#include <algorithm>
#include <vector>

#include "cpu/cpu_isa.h"
#include "cpu/probs.h"
#include "cpu/race.h"
#include "cpu/simd_target.h"
#include "cpu/thread_pool.h"
#include "ops.h"
#include "specrt/philox.h"
#include "specrt/sampling.h"
#include "specrt/tree.h"

namespace specrt {
namespace tree_scalar {
#include "cpu/tree_rows.h"
}  // namespace tree_scalar
}  // namespace specrt

#if SPECRT_X86_SIMD
SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX2)
namespace specrt {
namespace tree_avx2 {
#include "cpu/tree_rows.h"
}  // namespace tree_avx2
}  // namespace specrt
SPECRT_TARGET_END

SPECRT_TARGET_BEGIN(SPECRT_ISA_AVX512)
namespace specrt {
namespace tree_avx512 {
#include "cpu/tree_rows.h"
}  // namespace tree_avx512
}  // namespace specrt
SPECRT_TARGET_END
#endif

namespace specrt {
namespace {

float residual_pass(CpuIsa isa, const float* r, float mass, const float* q, int64_t onehot, int64_t n, float* out) {
#if SPECRT_X86_SIMD
  if (isa == CpuIsa::kAvx512) return tree_avx512::residual_pass(r, mass, q, onehot, n, out);
  if (isa == CpuIsa::kAvx2) return tree_avx2::residual_pass(r, mass, q, onehot, n, out);
#endif
  return tree_scalar::residual_pass(r, mass, q, onehot, n, out);
}

// One request's tree: node j < n has token tokens[j] and parent parents[j].
struct Tree {
  const int32_t* tokens;
  const int32_t* parents;
  int32_t n;
  int32_t first_child(int32_t node) const { return tree_next_child(parents, n, node, node + 1); }
  int32_t next_sibling(int32_t node, int32_t child) const { return tree_next_child(parents, n, node, child + 1); }
  // The first child of `node` whose token is t, or -1.
  int32_t child_with_token(int32_t node, int32_t t) const {
    for (int32_t j = first_child(node); j < n; j = next_sibling(node, j))
      if (tokens[j] == t) return j;
    return -1;
  }
};

// Writes request b's path: out [N+1] and nodes [N] (-1 padded), returns its length.
struct PathWriter {
  int32_t* out;
  int32_t* nodes;
  int32_t length = 0;
  void accept(int32_t node, int32_t token) {
    out[length] = token;
    nodes[length] = node;
    ++length;
  }
  void emit(int32_t token) { out[length] = token; }
};

uint64_t race_row(CpuIsa isa, const float* w, int64_t vocab, uint64_t seed, int64_t position, uint32_t purpose) {
  RaceRow row;
  row.p = w;
  row.seed = seed;
  row.position = position;
  row.purpose = purpose;
  return race(isa, row, 0, vocab);
}

}  // namespace

void verify_tree_greedy_cpu(const at::Tensor& target_logits, const at::Tensor& node_token_ids,
                            const at::Tensor& node_parents, const at::Tensor& num_nodes,
                            at::Tensor& output_token_ids, at::Tensor& num_accepted, at::Tensor& accepted_nodes) {
  const int64_t batch = target_logits.size(0);
  const int64_t n1 = target_logits.size(1);
  const int64_t max_nodes = n1 - 1;
  const int64_t vocab = target_logits.size(2);
  const float* logits = target_logits.data_ptr<float>();
  const int32_t* tokens = node_token_ids.data_ptr<int32_t>();
  const int32_t* parents = node_parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  int32_t* out = output_token_ids.data_ptr<int32_t>();
  int32_t* n_acc = num_accepted.data_ptr<int32_t>();
  int32_t* path = accepted_nodes.data_ptr<int32_t>();
  const CpuIsa isa = cpu_isa();
  std::fill(out, out + batch * n1, -1);
  std::fill(path, path + batch * max_nodes, -1);
  parallel_for(0, batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const Tree tree{tokens + b * max_nodes, parents + b * max_nodes,
                      clamp_num_nodes(counts[b], static_cast<int32_t>(max_nodes))};
      PathWriter w{out + b * n1, path + b * max_nodes};
      int32_t node = -1;
      while (true) {
        // unchecked inputs stay in bounds: a bad id never equals an argmax
        const int32_t t = static_cast<int32_t>(argmax(isa, logits + (b * n1 + node + 1) * vocab, vocab));
        const int32_t child = tree.child_with_token(node, t);
        if (child < 0) {
          w.emit(t);
          break;
        }
        w.accept(child, t);
        node = child;
      }
      n_acc[b] = w.length;
    }
  });
}

void rejection_sample_tree_cpu(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                               const at::Tensor& node_token_ids, const at::Tensor& node_parents,
                               const at::Tensor& num_nodes, const at::Tensor& seeds, const at::Tensor& positions,
                               AcceptMethod method, at::Tensor& output_token_ids, at::Tensor& num_accepted,
                               at::Tensor& accepted_nodes) {
  const int64_t batch = target_probs.size(0);
  const int64_t n1 = target_probs.size(1);
  const int64_t max_nodes = n1 - 1;
  const int64_t vocab = target_probs.size(2);
  const float* p = target_probs.data_ptr<float>();
  const float* q = draft_probs.has_value() && method == AcceptMethod::kRejection ? draft_probs->data_ptr<float>()
                                                                                  : nullptr;
  const int32_t* tokens = node_token_ids.data_ptr<int32_t>();
  const int32_t* parents = node_parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int32_t* out = output_token_ids.data_ptr<int32_t>();
  int32_t* n_acc = num_accepted.data_ptr<int32_t>();
  int32_t* path = accepted_nodes.data_ptr<int32_t>();
  const CpuIsa isa = cpu_isa();
  std::fill(out, out + batch * n1, -1);
  std::fill(path, path + batch * max_nodes, -1);
  parallel_for(0, batch, 1, [&](int64_t lo, int64_t hi) {
    // two residual buffers: a pass reads one and writes the other
    std::vector<float> scratch(method == AcceptMethod::kRejection ? static_cast<size_t>(2 * vocab) : 0);
    for (int64_t b = lo; b < hi; ++b) {
      const Tree tree{tokens + b * max_nodes, parents + b * max_nodes,
                      clamp_num_nodes(counts[b], static_cast<int32_t>(max_nodes))};
      PathWriter w{out + b * n1, path + b * max_nodes};
      const uint64_t s = static_cast<uint64_t>(seed[b]);
      int32_t node = -1;
      while (true) {
        const float* row = p + (b * n1 + node + 1) * vocab;  // target row of the current node
        const int64_t position = pos[b] + w.length;
        if (method == AcceptMethod::kCoupled) {
          // the target's own race winner; the first child that drafted it is accepted
          const int32_t winner = race_winner(race_row(isa, row, vocab, s, position, kPurposeTarget));
          const int32_t child = tree.child_with_token(node, winner);
          if (child < 0) {
            w.emit(winner);
            break;
          }
          w.accept(child, winner);
          node = child;
          continue;
        }
        // rejection: siblings in order against the residual (specrt/tree.h)
        const float* r = row;
        float mass = 1.0f;
        uint32_t rank = 0;
        int32_t accepted = -1;
        for (int32_t j = tree.first_child(node); j < tree.n; j = tree.next_sibling(node, j)) {
          if (rank > 0 && !(mass > 0.0f)) break;  // nothing left to accept: the race below falls back to p
          const int32_t x = tree.tokens[j];
          const float* qj = q != nullptr ? q + (b * max_nodes + j) * vocab : nullptr;
          if (x >= 0 && x < vocab) {  // an out-of-range id is rejected, never read
            const float u = uniform(s, position, kPurposeAccept, rank);
            if (tree_accept(u, r[x], mass, qj != nullptr ? qj[x] : 1.0f)) {
              accepted = j;
              break;
            }
          }
          float* next = scratch.data() + (rank % 2) * vocab;
          mass = residual_pass(isa, r, mass, qj, x, vocab, next);
          r = next;
          ++rank;
        }
        if (accepted >= 0) {
          w.accept(accepted, tree.tokens[accepted]);
          node = accepted;
          continue;
        }
        // all rejected: race the residual; none left (or a leaf): race p (the bonus draw)
        uint64_t best = rank > 0 ? race_row(isa, r, vocab, s, position, kPurposeResidual) : 0;
        if (best == 0) best = race_row(isa, row, vocab, s, position, kPurposeResidual);
        w.emit(race_winner(best));
        break;
      }
      n_acc[b] = w.length;
    }
  });
}

}  // namespace specrt
