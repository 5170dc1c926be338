// csrc/cuda/tree_cuda.cu — CUDA kernels of token-tree verification (docs/architecture.md §2
// "Token trees", §3): verify_tree_greedy and rejection_sample_tree (both methods).
//
//   tree_walk_kernel<kMode>   grid (B), block kTreeThreads = 256 = kTreeMassLanes:
//                             one CTA walks one request's tree from the root.
//     per visited node (row = its target row, pos = positions[b] + depth):
//       greedy     block argmax of the row (NaN as -inf, ties to the lowest id)
//       coupled    block race of the row under TARGET noise at pos
//       rejection  siblings in order: the ACCEPT coin (index = sibling rank) against
//                  the residual r / m; each rejection is one residual pass over the
//                  row (thread l owns mass lane l: elements v = l, l+256, ... in
//                  increasing v, as specrt/tree.h defines the mass) into the
//                  request's workspace row; when all fail, the RESIDUAL race over r
//                  (falling back to p when r has no mass), at a leaf over p.
//     the first child whose token equals the argmax / the race winner (greedy,
//     coupled) or that passes its coin (rejection) becomes the current node.
//   bytes: per visited node reads 4V (argmax / race) and per rejected sibling
//   4V (+4V of q) and writes 4V to the workspace; the workspace [B, V] comes
//   from the caching allocator (rejection only).
//
// All float math is specrt/tree.h + specrt/sampling.h and all random numbers
// specrt/philox.h, so tokens are bit-identical to csrc/cpu/tree_cpu.cpp and to
// specrt/ops/reference.py. Every thread of a CTA computes the same control flow (the
// node arrays, coins and reduction results are the same for all of them). No
// host synchronisation: counts, seeds and positions are read on the device.
// Device inputs are not validated here (tree_ops.cpp does it on the host in
// debug mode); node counts are clamped, bad token ids never match or get read,
// and a node whose parent is out of range is simply unreachable.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

#include "cuda_utils.cuh"
#include "ops.h"
#include "specrt/philox.h"
#include "specrt/sampling.h"
#include "specrt/tree.h"

namespace specrt {
namespace {

using cuda_detail::block_max_u64;
using cuda_detail::kWarpSize;
using cuda_detail::max_u64;

constexpr int kTreeThreads = kTreeMassLanes;
static_assert(kTreeThreads % kWarpSize == 0, "whole warps");

enum TreeMode : int { kModeGreedy = 0, kModeCoupled = 1, kModeRejection = 2 };

struct TreeArgs {
  const float* target;        // [B, N+1, V] logits (greedy) or probabilities
  const float* draft;         // [B, N, V] or nullptr (one-hot drafts)
  const int32_t* tokens;      // [B, N]
  const int32_t* parents;     // [B, N]
  const int32_t* num_nodes;   // [B]
  const int64_t* seeds;       // [B]
  const int64_t* positions;   // [B]
  float* residual;            // [B, V] workspace (rejection)
  int32_t* out;               // [B, N+1]
  int32_t* num_accepted;      // [B]
  int32_t* accepted_nodes;    // [B, N]
  int64_t V;
  int32_t N;
};

__device__ __forceinline__ uint64_t block_argmax(const float* row, int64_t V, uint64_t* scratch) {
  uint64_t best = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
    best = max_u64(best, pack_argmax(ordered_key(row[v]), static_cast<uint32_t>(v)));
  return block_max_u64(best, scratch);
}

// The race over weights w[0, V) (specrt/sampling.h): thread t takes groups of
// four tokens (one Philox block each) 4t, 4t + 4*256, ...; groups without a
// positive weight skip their Philox evaluation. Returns the packed winner.
__device__ __forceinline__ uint64_t block_race(const float* w, int64_t V, uint64_t seed, int64_t position,
                                               uint32_t purpose, uint64_t* scratch) {
  uint64_t best = 0;
  for (int64_t base = 4 * static_cast<int64_t>(threadIdx.x); base < V; base += 4 * static_cast<int64_t>(blockDim.x)) {
    float weight[4];
    bool any = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      weight[i] = base + i < V ? w[base + i] : 0.0f;
      any = any || weight[i] > 0.0f;
    }
    if (!any) continue;
    const Philox4x32 block = philox_block(seed, position, purpose, static_cast<uint32_t>(base));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (!(weight[i] > 0.0f)) continue;
      const uint32_t v = static_cast<uint32_t>(base + i);
      best = max_u64(best, race_candidate(race_score_at(weight[i], block, v), v));
    }
  }
  return block_max_u64(best, scratch);
}

// out[v] = tree_residual_weight(r[v], mass, q_v) (q_v = q[v], or one-hot at
// `onehot` when q is null) and the fixed-order mass of out (specrt/tree.h):
// thread l is mass lane l. r may equal out (each thread reads, then writes,
// only its own elements). Returns the mass to every thread.
__device__ __forceinline__ float residual_pass(const float* r, float mass, const float* q, int64_t onehot,
                                               int64_t V, float* out, float* lanes) {
  float lane = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += kTreeThreads) {
    const float w = tree_residual_weight(r[v], mass, q != nullptr ? q[v] : onehot_prob(v, onehot));
    out[v] = w;
    lane = lane + w;
  }
  lanes[threadIdx.x] = lane;
  __syncthreads();
  // tree_mass_from_lanes, one level per step
  for (int s = kTreeMassLanes / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) lanes[threadIdx.x] = lanes[threadIdx.x] + lanes[threadIdx.x + s];
    __syncthreads();
  }
  const float total = lanes[0];
  __syncthreads();  // every thread has read lanes[0] before the next pass writes it
  return total;
}

// The first child of `node` whose token is t, or -1 (specrt/tree.h's order).
__device__ __forceinline__ int32_t child_with_token(const int32_t* tokens, const int32_t* parents, int32_t n,
                                                    int32_t node, int32_t t) {
  for (int32_t j = tree_next_child(parents, n, node, node + 1); j < n; j = tree_next_child(parents, n, node, j + 1))
    if (tokens[j] == t) return j;
  return -1;
}

template <int kMode>
__global__ void __launch_bounds__(kTreeThreads) tree_walk_kernel(TreeArgs a) {
  __shared__ uint64_t scratch[kTreeThreads / kWarpSize];
  __shared__ float lanes[kTreeMassLanes];
  const int64_t b = blockIdx.x;
  const int32_t N = a.N;
  const int64_t V = a.V;
  const int32_t n = clamp_num_nodes(a.num_nodes[b], N);
  const int32_t* tokens = a.tokens + b * N;
  const int32_t* parents = a.parents + b * N;
  int32_t* out = a.out + b * (N + 1);
  int32_t* path = a.accepted_nodes + b * N;
  for (int32_t i = threadIdx.x; i <= N; i += blockDim.x) {
    out[i] = -1;
    if (i < N) path[i] = -1;
  }
  __syncthreads();  // the padding is written before thread 0 writes the path over it

  const uint64_t seed = kMode == kModeGreedy ? 0 : static_cast<uint64_t>(a.seeds[b]);
  int32_t node = -1;
  int32_t length = 0;
  while (true) {
    const float* row = a.target + (b * (N + 1) + node + 1) * V;
    const int64_t position = kMode == kModeGreedy ? 0 : a.positions[b] + length;
    int32_t child = -1;
    int32_t emitted = 0;
    if constexpr (kMode == kModeGreedy || kMode == kModeCoupled) {
      const uint64_t best = kMode == kModeGreedy ? block_argmax(row, V, scratch)
                                                 : block_race(row, V, seed, position, kPurposeTarget, scratch);
      const int32_t t = kMode == kModeGreedy ? unpack_argmax_index(best) : race_winner(best);
      child = child_with_token(tokens, parents, n, node, t);
      emitted = t;
    } else {
      float* work = a.residual + b * V;
      const float* r = row;
      float mass = 1.0f;
      uint32_t rank = 0;
      for (int32_t j = tree_next_child(parents, n, node, node + 1); j < n;
           j = tree_next_child(parents, n, node, j + 1)) {
        if (rank > 0 && !(mass > 0.0f)) break;  // nothing left to accept: the race below falls back to p
        const int32_t x = tokens[j];
        const float* qj = a.draft != nullptr ? a.draft + (b * N + j) * V : nullptr;
        if (x >= 0 && static_cast<int64_t>(x) < V) {  // an out-of-range id is rejected, never read
          const float u = uniform(seed, position, kPurposeAccept, rank);
          if (tree_accept(u, r[x], mass, qj != nullptr ? qj[x] : 1.0f)) {
            child = j;
            break;
          }
        }
        __syncthreads();  // every thread has read r[x] before the pass rewrites the workspace
        mass = residual_pass(r, mass, qj, x, V, work, lanes);
        r = work;
        ++rank;
      }
      if (child >= 0) {
        emitted = tokens[child];
      } else {
        // all rejected: race the residual; none left (or a leaf): race p (the bonus draw)
        uint64_t best = rank > 0 ? block_race(r, V, seed, position, kPurposeResidual, scratch) : 0ull;
        if (best == 0ull) best = block_race(row, V, seed, position, kPurposeResidual, scratch);
        emitted = race_winner(best);
      }
    }
    if (threadIdx.x == 0) {
      out[length] = emitted;
      if (child >= 0) path[length] = child;
    }
    if (child < 0) break;
    node = child;
    ++length;
  }
  if (threadIdx.x == 0) a.num_accepted[b] = length;
}

template <int kMode>
void launch_walk(const TreeArgs& args, int64_t B, cudaStream_t stream) {
  tree_walk_kernel<kMode><<<static_cast<unsigned>(B), kTreeThreads, 0, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TreeArgs tree_args(const at::Tensor& target, const at::Tensor& node_token_ids, const at::Tensor& node_parents,
                   const at::Tensor& num_nodes, at::Tensor& output_token_ids, at::Tensor& num_accepted,
                   at::Tensor& accepted_nodes) {
  TreeArgs args{};
  args.target = target.data_ptr<float>();
  args.tokens = node_token_ids.data_ptr<int32_t>();
  args.parents = node_parents.data_ptr<int32_t>();
  args.num_nodes = num_nodes.data_ptr<int32_t>();
  args.out = output_token_ids.data_ptr<int32_t>();
  args.num_accepted = num_accepted.data_ptr<int32_t>();
  args.accepted_nodes = accepted_nodes.data_ptr<int32_t>();
  args.V = target.size(2);
  args.N = static_cast<int32_t>(target.size(1) - 1);
  return args;
}

}  // namespace

void verify_tree_greedy_cuda(const at::Tensor& target_logits, const at::Tensor& node_token_ids,
                             const at::Tensor& node_parents, const at::Tensor& num_nodes,
                             at::Tensor& output_token_ids, at::Tensor& num_accepted, at::Tensor& accepted_nodes) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const int64_t B = target_logits.size(0);
  if (B == 0) return;
  TORCH_CHECK(B <= 0x7fffffff, "specrt: verify_tree_greedy: too many requests: ", B);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(target_logits.device().index()).stream();
  const TreeArgs args = tree_args(target_logits, node_token_ids, node_parents, num_nodes, output_token_ids,
                                  num_accepted, accepted_nodes);
  launch_walk<kModeGreedy>(args, B, stream);
}

void rejection_sample_tree_cuda(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                                const at::Tensor& node_token_ids, const at::Tensor& node_parents,
                                const at::Tensor& num_nodes, const at::Tensor& seeds, const at::Tensor& positions,
                                AcceptMethod method, at::Tensor& output_token_ids, at::Tensor& num_accepted,
                                at::Tensor& accepted_nodes) {
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const int64_t B = target_probs.size(0);
  if (B == 0) return;
  TORCH_CHECK(B <= 0x7fffffff, "specrt: rejection_sample_tree: too many requests: ", B);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(target_probs.device().index()).stream();
  TreeArgs args = tree_args(target_probs, node_token_ids, node_parents, num_nodes, output_token_ids, num_accepted,
                            accepted_nodes);
  args.seeds = seeds.data_ptr<int64_t>();
  args.positions = positions.data_ptr<int64_t>();
  if (method == AcceptMethod::kCoupled) {
    launch_walk<kModeCoupled>(args, B, stream);
    return;
  }
  TORCH_CHECK(method == AcceptMethod::kRejection, "specrt: rejection_sample_tree: unknown method");
  args.draft = draft_probs.has_value() && draft_probs->defined() && draft_probs->numel() > 0
                   ? draft_probs->data_ptr<float>()
                   : nullptr;
  at::Tensor workspace = at::empty({B, args.V}, target_probs.options());
  args.residual = workspace.data_ptr<float>();
  launch_walk<kModeRejection>(args, B, stream);
}

}  // namespace specrt

TORCH_LIBRARY_IMPL(specrt, CUDA, m) {
  using at::Tensor;
  m.impl("verify_tree_greedy", [](const Tensor& target_logits, const Tensor& node_token_ids,
                                  const Tensor& node_parents, const Tensor& num_nodes, bool check) {
    return specrt::verify_tree_greedy_op(target_logits, node_token_ids, node_parents, num_nodes, check,
                                         &specrt::verify_tree_greedy_cuda);
  });
  m.impl("rejection_sample_tree",
         [](const Tensor& target_probs, const std::optional<Tensor>& draft_probs, const Tensor& node_token_ids,
            const Tensor& node_parents, const Tensor& num_nodes, const Tensor& seeds, const Tensor& positions,
            std::string method, bool check) {
           return specrt::rejection_sample_tree_op(target_probs, draft_probs, node_token_ids, node_parents,
                                                   num_nodes, seeds, positions, method, check,
                                                   &specrt::rejection_sample_tree_cuda);
         });
}
