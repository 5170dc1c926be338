// specrt/tree.h — the float math of token-tree verification (verify_tree_greedy,
// rejection_sample_tree), shared by csrc/cpu/tree_cpu.cpp and
// csrc/cuda/tree_cuda.cu and mirrored operation for operation by
// specrt/ops/reference.py (rejection_sample_tree and its helpers).
//
// A tree is a set of nodes per request: node j has a token and a parent in
// [-1, j-1] (-1 = the root, the request's pending token); siblings are tried
// in increasing node index, their rank r = 0, 1, ... Verification walks from
// the root; at a node of depth a (root 0) its target row is p and every
// random number is keyed at position positions[b] + a (the children's
// position, and the position of the token emitted if none is accepted).
//
// Recursive rejection sampling (SpecInfer's multi-draft rule) keeps the
// current node's residual as unnormalised weights r_v and their mass m, with
// p_res = r / m:
//
//   start            r = p (the target row, taken as normalised), m = 1
//   child of rank k  accept iff  u_k * q_k(x) < r_x / m      (tree_accept)
//                    u_k = uniform(seed, pos, ACCEPT, k)
//   reject           r'_v = max(r_v / m - q_k(v), 0) where r_v / m > 0, else 0
//                    (tree_residual_weight); m' = the fixed-order mass of r' (below)
//   none accepted    emit the RESIDUAL race over r at pos; a residual with no
//                    mass (q >= p_res everywhere, only by rounding) falls back
//                    to the race over p, as the chain kernel does; once m' = 0
//                    no later sibling is tried (nothing is left to accept)
//   leaf             emit the bonus: the RESIDUAL race over p at pos
//
// Dividing by m = 1 is exact, so rank 0 tests u * q(x) < p(x) and its
// residual weights are the chain kernel's max(p - q, 0) bit for bit: a chain
// given as a tree returns rejection_sample's tokens. The race is invariant to
// the scale of its weights, so the final race runs on r unnormalised.
//
// The mass is a float32 sum in a FIXED order, so every device gets the same
// bits: element v goes to lane v % kTreeMassLanes, each lane adds its
// elements in increasing v starting from +0, then the lanes combine pairwise
// (tree_mass_from_lanes). The CPU kernel keeps 256 lane accumulators (which
// vectorise), the CUDA kernel one lane per thread of a 256-thread block;
// specrt/ops/reference.py's tree_mass spells the order out in torch.
#pragma once

#include "specrt/common.h"
#include "specrt/philox.h"
#include "specrt/sampling.h"

namespace specrt {

constexpr int kTreeMassLanes = 256;

// p_res(v) = r_v / m (m = 1 exactly at the start of a node: r_v itself).
SPECRT_HOST_DEVICE float tree_residual_prob(float r, float mass) { return r / mass; }

// Sibling acceptance against the residual left by the siblings rejected before it.
SPECRT_HOST_DEVICE bool tree_accept(float u, float r_x, float mass, float q_x) {
  return accept_draft(u, tree_residual_prob(r_x, mass), q_x);
}

// The residual weight after rejecting a sibling drawn from q: max(p_res - q, 0)
// where p_res > 0 (0 where it is 0 or NaN), as the chain kernel's race weights.
SPECRT_HOST_DEVICE float tree_residual_weight(float r, float mass, float q) {
  const float a = tree_residual_prob(r, mass);
  return a > 0.0f ? residual_weight(a, q) : 0.0f;
}

// q_k(v) of a deterministic (one-hot) sibling with token x.
SPECRT_HOST_DEVICE float onehot_prob(int64_t v, int64_t x) { return v == x ? 1.0f : 0.0f; }

// Combine the lane sums in place, pairwise: lanes[i] += lanes[i + s] for
// s = 128, 64, ..., 1; the mass is lanes[0].
SPECRT_HOST_DEVICE float tree_mass_from_lanes(float* lanes) {
  for (int s = kTreeMassLanes / 2; s > 0; s >>= 1)
    for (int i = 0; i < s; ++i) lanes[i] = lanes[i] + lanes[i + s];
  return lanes[0];
}

// Children of node `parent` (-1 = root) are the nodes j in (parent, n) with
// parents[j] == parent, in index order. Returns the first at or after `from`,
// or n. A node whose parent is not in [-1, j-1] is unreachable (never a child).
SPECRT_HOST_DEVICE int32_t tree_next_child(const int32_t* parents, int32_t n, int32_t parent, int32_t from) {
  for (int32_t j = from > parent + 1 ? from : parent + 1; j < n; ++j)
    if (parents[j] == parent) return j;
  return n;
}

// Clamp an unchecked node count to [0, max_nodes].
SPECRT_HOST_DEVICE int32_t clamp_num_nodes(int32_t n, int32_t max_nodes) {
  return n < 0 ? 0 : (n > max_nodes ? max_nodes : n);
}

}  // namespace specrt
