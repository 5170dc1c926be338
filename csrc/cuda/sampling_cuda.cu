// csrc/cuda/sampling_cuda.cu — CUDA kernels of the sampling ops (docs/architecture.md §2, §3).
//
//   probs_from_logits_cuda   one block per row: argmax/max, radix-select top-k,
//                            softmax, radix-select top-p, renormalise.
//   verify_greedy_cuda       grid (rows, vocab chunks) packed argmax -> partials,
//                            then one warp per request accepts while draft == argmax.
//   rejection_sample_cuda    rejection: accept kernel (coins) -> grid (B, chunks)
//                            residual race -> finalize (fallback to the race over p).
//                            coupled: grid (B*(K+1), chunks) TARGET race -> finalize
//                            (accept while draft == winner).
//   sample_tokens_cuda       grid (N, chunks) race -> finalize.
//
// All random numbers come from specrt/philox.h and all the race / acceptance
// float math from specrt/sampling.h, so tokens are bit-identical to the CPU
// kernels and to specrt/ops/reference.py. The vocabulary is split across blocks
// (grid.y) for the argmax and the race: every block writes its local best as
// a packed u64 (score bits << 32 | ~index, see pack_race / pack_argmax) into a
// [rows, chunks] workspace from the caching allocator, and a finalize kernel
// reduces the chunks (two-pass: no memset, no atomics, deterministic).
//
// No host synchronisation anywhere: seeds, positions, num_draft_tokens and
// num_accepted are read on the device, so every op is CUDA-graph capturable.
// Device inputs are NOT validated here (the op bodies in sampling_ops.cpp do that
// on the host in debug mode); instead every data-dependent index is
// clamped/guarded so bad ids never read or write out of bounds. The CUDA
// registrations of the ops are at the end of this file.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cuda_utils.cuh"
#include "ops.h"
#include "specrt/exp_det.h"
#include "specrt/philox.h"
#include "specrt/sampling.h"

namespace specrt {
namespace {

using cuda_detail::block_max_u64;
using cuda_detail::block_sum_f64;
using cuda_detail::ceil_div;
using cuda_detail::kWarpSize;
using cuda_detail::max_u64;
using cuda_detail::warp_max_u64;

// ---------------------------------------------------------------------------
// Shared small helpers
// ---------------------------------------------------------------------------

bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Inverse of specrt::ordered_key (for keys of non-NaN floats).
__device__ __forceinline__ float key_to_float(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  return uint_as_float(bits);
}

__device__ __forceinline__ int32_t clamp_num_draft(int32_t n, int32_t max_draft) {
  return n < 0 ? 0 : (n > max_draft ? max_draft : n);
}

// Calls f(v, x) for every element of row[0, V) owned by this thread
// (block-strided). kVec: float4 loads (V % 4 == 0 and row 16-byte aligned).
// The same thread sees the same elements on every call with the same V.
template <bool kVec, typename F>
__device__ __forceinline__ void row_for_each(const float* row, int64_t V, F&& f) {
  if constexpr (kVec) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const int64_t n4 = V >> 2;
    for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) {
      const float4 a = row4[j];
      const int64_t v = j << 2;
      f(v, a.x);
      f(v + 1, a.y);
      f(v + 2, a.z);
      f(v + 3, a.w);
    }
  } else {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) f(v, row[v]);
  }
}

// Writes out[v] = g(v, out_or_in[v]) in the same thread mapping as row_for_each.
template <bool kVec, typename G>
__device__ __forceinline__ void row_transform(const float* in, float* out, int64_t V, G&& g) {
  if constexpr (kVec) {
    const float4* in4 = reinterpret_cast<const float4*>(in);
    float4* out4 = reinterpret_cast<float4*>(out);
    const int64_t n4 = V >> 2;
    for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) {
      const float4 a = in4[j];
      const int64_t v = j << 2;
      float4 r;
      r.x = g(v, a.x);
      r.y = g(v + 1, a.y);
      r.z = g(v + 2, a.z);
      r.w = g(v + 3, a.w);
      out4[j] = r;
    }
  } else {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) out[v] = g(v, in[v]);
  }
}

// Writes out[v] = g(v) (no read), same thread mapping.
template <bool kVec, typename G>
__device__ __forceinline__ void row_write(float* out, int64_t V, G&& g) {
  if constexpr (kVec) {
    float4* out4 = reinterpret_cast<float4*>(out);
    const int64_t n4 = V >> 2;
    for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) {
      const int64_t v = j << 2;
      out4[j] = make_float4(g(v), g(v + 1), g(v + 2), g(v + 3));
    }
  } else {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) out[v] = g(v);
  }
}

// ---------------------------------------------------------------------------
// probs_from_logits
// ---------------------------------------------------------------------------

constexpr int kProbsThreads = 512;
constexpr int kRadixBins = 256;

struct ProbsShared {
  uint32_t hist_count[kRadixBins];
  double hist_sum[kRadixBins];
  uint64_t scratch_u64[kProbsThreads / kWarpSize];
  double scratch_f64[kProbsThreads / kWarpSize];
  uint32_t sel_digit;
  uint32_t sel_above_count;
  double sel_above_sum;
};

// Warp-aggregated histogram updates. Logits/probabilities of one row crowd
// into a few exponent bins at the first radix level, so lanes of a warp that
// hit the same bin are combined (__match_any_sync) into ONE shared atomic by
// their lowest lane. Every lane that reaches the call takes part (those with
// valid == false form their own group and add nothing).
__device__ __forceinline__ void hist_add_count(uint32_t* hist, bool valid, uint32_t bin) {
  const unsigned peers = __match_any_sync(__activemask(), valid ? bin : 0xffffffffu);
  if (valid && static_cast<int>(threadIdx.x % kWarpSize) == __ffs(peers) - 1) {
    atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
  }
}

__device__ __forceinline__ void hist_add_count_sum(uint32_t* count, double* sum, bool valid, uint32_t bin,
                                                   double value) {
  const unsigned peers = __match_any_sync(__activemask(), valid ? bin : 0xffffffffu);
  double group_sum = 0.0;  // every lane of the group runs the same loop over the same lanes
  for (unsigned rest = peers; rest != 0; rest &= rest - 1) {
    group_sum += __shfl_sync(peers, value, __ffs(rest) - 1);
  }
  if (valid && static_cast<int>(threadIdx.x % kWarpSize) == __ffs(peers) - 1) {
    atomicAdd(&count[bin], static_cast<uint32_t>(__popc(peers)));
    atomicAdd(&sum[bin], group_sum);
  }
}

// Warp 0 only. Bins are scanned from 255 down to 0; lane l owns bins
// 255-8l .. 248-8l. Picks the first bin where the running count reaches
// `remaining` (the k-th largest lies in it); writes the digit and the count of
// elements in higher bins. If no bin reaches it (impossible for valid k) the
// lowest non-empty bin is taken.
__device__ void select_digit_by_count(ProbsShared& sh, uint32_t remaining) {
  const int lane = threadIdx.x;
  uint32_t local[8];
  uint32_t total = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    local[j] = sh.hist_count[255 - 8 * lane - j];
    total += local[j];
  }
  uint32_t incl = total;
#pragma unroll
  for (int off = 1; off < kWarpSize; off *= 2) {
    const uint32_t t = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += t;
  }
  const uint32_t excl = incl - total;
  const uint32_t hit = __ballot_sync(0xffffffffu, incl >= remaining);
  const uint32_t nonempty = __ballot_sync(0xffffffffu, total > 0);
  if (hit != 0) {
    if (lane == __ffs(hit) - 1) {
      uint32_t run = excl;
      for (int j = 0; j < 8; ++j) {
        if (run + local[j] >= remaining) {
          sh.sel_digit = 255u - 8u * lane - j;
          sh.sel_above_count = run;
          break;
        }
        run += local[j];
      }
    }
  } else if (nonempty != 0) {
    if (lane == 31 - __clz(nonempty)) {
      uint32_t run = excl;
      int last = 0;
      uint32_t above = excl;
      for (int j = 0; j < 8; ++j) {
        if (local[j] > 0) {
          last = j;
          above = run;
        }
        run += local[j];
      }
      sh.sel_digit = 255u - 8u * lane - last;
      sh.sel_above_count = above;
    }
  } else if (lane == 0) {
    sh.sel_digit = 0;
    sh.sel_above_count = 0;
  }
}

// Warp 0 only. Same scan over (sum, count) bins for top-p: picks the first
// non-empty bin where float(above_sum + running sum) >= top_p (sums in double,
// compared after rounding to float, like the CPU kernel's cumulative sum); if
// none does (the total falls short of top_p by rounding) the lowest non-empty
// bin, i.e. the reference's "smallest non-zero probability" fallback.
__device__ void select_digit_by_sum(ProbsShared& sh, double above_sum, float top_p) {
  const int lane = threadIdx.x;
  double local_sum[8];
  uint32_t local_count[8];
  double lane_total = 0.0;
  uint32_t lane_count = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    local_sum[j] = sh.hist_sum[255 - 8 * lane - j];
    local_count[j] = sh.hist_count[255 - 8 * lane - j];
    lane_total += local_sum[j];
    lane_count += local_count[j];
  }
  double incl = lane_total;
#pragma unroll
  for (int off = 1; off < kWarpSize; off *= 2) {
    const double t = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += t;
  }
  double excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = 0.0;
  // The exact quantities tested below are recomputed sequentially per lane so
  // the ballot and the in-lane choice agree.
  bool lane_hit = false;
  {
    double run = above_sum + excl;
    for (int j = 0; j < 8; ++j) {
      run += local_sum[j];
      if (local_count[j] > 0 && static_cast<float>(run) >= top_p) lane_hit = true;
    }
  }
  const uint32_t hit = __ballot_sync(0xffffffffu, lane_hit);
  const uint32_t nonempty = __ballot_sync(0xffffffffu, lane_count > 0);
  if (hit != 0) {
    if (lane == __ffs(hit) - 1) {
      double run = above_sum + excl;
      for (int j = 0; j < 8; ++j) {
        const double next = run + local_sum[j];
        if (local_count[j] > 0 && static_cast<float>(next) >= top_p) {
          sh.sel_digit = 255u - 8u * lane - j;
          sh.sel_above_sum = run;
          break;
        }
        run = next;
      }
    }
  } else if (nonempty != 0) {
    if (lane == 31 - __clz(nonempty)) {
      double run = above_sum + excl;
      int last = 0;
      double above = run;
      for (int j = 0; j < 8; ++j) {
        if (local_count[j] > 0) {
          last = j;
          above = run;
        }
        run += local_sum[j];
      }
      sh.sel_digit = 255u - 8u * lane - last;
      sh.sel_above_sum = above;
    }
  } else if (lane == 0) {
    sh.sel_digit = 0;
    sh.sel_above_sum = above_sum;
  }
}

// probs_from_logits_kernel
//   grid  (N)            one block per row, kProbsThreads threads
//   thread: block-strided (float4 when kVec) over the row in every pass.
//   passes (each reads the row once from global/L2):
//     1. packed argmax of ordered_key(x) (NaN = -inf, ties -> lowest index);
//        a greedy temperature (is_greedy_temperature: 0 or below 1e-5) or a
//        non-finite max: write the one-hot row and stop.
//     2. top-k (0 < k < V): 4 radix passes (8-bit digits, 256 shared counters)
//        find the k-th largest x/t; kept = x/t >= it (ties kept).
//     3. S = sum(exp(x/t - m)) over kept (fixed-order block reduction); min-p
//        drops the numerators exp(x/t - m) < min_p (min_p_drops).
//     4. probs = exp(x/t - m) / S (0 where not kept).
//     5. top-p (< 1): 4 radix passes over the written probs with per-bin
//        (sum, count) find tau = the largest p with sum(p' >= p) >= top_p
//        (the reference's sorted_p[cut]); S2 = sum(p >= tau); probs = p / S2.
//   bytes: reads 4V (+16V top-k) (+4V..+28V top-p) per row, writes 4V (+4V).
template <bool kVec>
__global__ void __launch_bounds__(kProbsThreads)
    probs_from_logits_kernel(const float* __restrict__ logits, const float* __restrict__ temperature,
                             const int32_t* __restrict__ top_k, const float* __restrict__ top_p,
                             const float* __restrict__ min_p, float* probs, int64_t V) {
  __shared__ ProbsShared sh;
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  float* out = probs + row * V;

  // 1. argmax / max
  uint64_t best = 0;
  row_for_each<kVec>(x, V, [&](int64_t v, float val) {
    best = max_u64(best, pack_argmax(ordered_key(val), static_cast<uint32_t>(v)));
  });
  best = block_max_u64(best, sh.scratch_u64);
  const float max_val = key_to_float(static_cast<uint32_t>(best >> 32));
  const int64_t argmax = unpack_argmax_index(best);
  const float t = temperature[row];
  if (is_greedy_temperature(t) || !isfinite(max_val)) {
    row_write<kVec>(out, V, [&](int64_t v) { return v == argmax ? 1.0f : 0.0f; });
    return;
  }
  // x / t is monotone in x for t > 0, so max(x / t) == max(x) / t exactly.
  const float m = max_val / t;

  // 2. top-k threshold (on the scaled logits, like the reference)
  const int32_t k = top_k[row];
  float kth = -INFINITY;  // keep everything
  if (k > 0 && static_cast<int64_t>(k) < V) {
    uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(k);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < kRadixBins; i += blockDim.x) sh.hist_count[i] = 0;
      __syncthreads();
      row_for_each<kVec>(x, V, [&](int64_t, float val) {
        const uint32_t key = ordered_key(val / t);
        hist_add_count(sh.hist_count, (key & mask) == prefix, (key >> shift) & 0xffu);
      });
      __syncthreads();
      if (threadIdx.x < kWarpSize) select_digit_by_count(sh, remaining);
      __syncthreads();
      prefix |= sh.sel_digit << shift;
      mask |= 0xffu << shift;
      remaining -= sh.sel_above_count;
    }
    kth = key_to_float(prefix);
  }
  // NaN / t is NaN and NaN >= kth is false: NaN logits behave as -inf (dropped
  // by top-k, exp -> 0 otherwise), exactly like the reference. min-p drops the
  // numerators below min_p (the largest is exp(0) = 1; specrt/sampling.h).
  const float mp = min_p != nullptr ? min_p[row] : 0.0f;
  auto scaled_exp = [&](float val) -> float {
    const float xs = val / t;
    if (!(xs >= kth)) return 0.0f;  // masked to -inf by top-k (or NaN)
    const float e = exp_det(xs - m);  // the CPU kernel's exp (specrt/exp_det.h); exp_det(-inf) == 0
    return min_p_drops(e, mp) ? 0.0f : e;
  };

  // 3. softmax normaliser (double accumulation like the CPU kernel, then float)
  double local = 0.0;
  row_for_each<kVec>(x, V, [&](int64_t, float val) { local += scaled_exp(val); });
  const float sum_e = static_cast<float>(block_sum_f64(local, sh.scratch_f64));

  // 4. probs
  row_transform<kVec>(x, out, V, [&](int64_t, float val) { return scaled_exp(val) / sum_e; });

  // 5. top-p
  const float p_top = top_p[row];
  if (!(p_top < 1.0f)) return;
  __syncthreads();  // `out` written by this block is re-read below
  uint32_t prefix = 0, mask = 0;
  double above_sum = 0.0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kRadixBins; i += blockDim.x) {
      sh.hist_count[i] = 0;
      sh.hist_sum[i] = 0.0;
    }
    __syncthreads();
    row_for_each<kVec>(out, V, [&](int64_t, float p) {
      const uint32_t key = ordered_key(p);
      // zeros never decide the cut
      hist_add_count_sum(sh.hist_count, sh.hist_sum, p > 0.0f && (key & mask) == prefix, (key >> shift) & 0xffu,
                         static_cast<double>(p));
    });
    __syncthreads();
    if (threadIdx.x < kWarpSize) select_digit_by_sum(sh, above_sum, p_top);
    __syncthreads();
    prefix |= sh.sel_digit << shift;
    mask |= 0xffu << shift;
    above_sum = sh.sel_above_sum;
  }
  const float tau = key_to_float(prefix);
  local = 0.0;
  row_for_each<kVec>(out, V, [&](int64_t, float p) { local += p >= tau ? p : 0.0f; });
  const float sum_kept = static_cast<float>(block_sum_f64(local, sh.scratch_f64));
  row_transform<kVec>(out, out, V, [&](int64_t, float p) { return p >= tau ? p / sum_kept : 0.0f; });
}

// ---------------------------------------------------------------------------
// Vocabulary-split race / argmax
// ---------------------------------------------------------------------------

constexpr int kRaceThreads = 256;
constexpr int64_t kTokensPerIter = 4 * kRaceThreads;  // one Philox block (4 tokens) per thread

enum RaceMode : int {
  kModeRace = 0,       // race over rows of probs (sample_tokens, coupled)
  kModeArgmax = 1,     // packed argmax over rows of logits (verify_greedy)
  kModeRejection = 2,  // residual race + race over p at each request's first rejection
};

struct RaceParams {
  const float* probs;               // [B*K1, V] target probs (or logits for kModeArgmax)
  const float* draft_probs;         // [B, K, V] or nullptr (one-hot draft)
  const int32_t* draft_token_ids;   // [B, K]
  const int32_t* num_draft_tokens;  // [B] or nullptr (every row is needed)
  const int32_t* num_accepted;      // [B] (kModeRejection: written by the accept kernel)
  const int64_t* seeds;             // [B]
  const int64_t* positions;         // [B]
  uint64_t* partial;                // [grid.x, chunks, outs] packed local maxima
  int64_t V;
  int64_t tokens_per_block;         // multiple of kTokensPerIter
  int32_t K;                        // draft slots per request (draft tensors' dim 1)
  int32_t K1;                       // rows per request in probs (K+1, or 1 for sample_tokens)
  int32_t chunks;                   // grid.y
  uint32_t purpose;
};

// Loads the 4 values [g, g+4) of `row` (g % 4 == 0); lanes past `end` get 0
// (callers skip them).
template <bool kVec>
__device__ __forceinline__ float4 load_group(const float* row, int64_t g, int64_t end) {
  if constexpr (kVec) {
    return __ldg(reinterpret_cast<const float4*>(row + g));
  } else {
    float4 a;
    a.x = g < end ? __ldg(row + g) : 0.0f;
    a.y = g + 1 < end ? __ldg(row + g + 1) : 0.0f;
    a.z = g + 2 < end ? __ldg(row + g + 2) : 0.0f;
    a.w = g + 3 < end ? __ldg(row + g + 3) : 0.0f;
    return a;
  }
}

__device__ __forceinline__ float lane_of(const float4& a, int j) {
  return j == 0 ? a.x : (j == 1 ? a.y : (j == 2 ? a.z : a.w));
}

// race_partial_kernel
//   grid  (rows, chunks); block kRaceThreads threads.
//   kModeRace / kModeArgmax: blockIdx.x = row = b*K1 + i over all rows; rows
//     with i > num_draft_tokens[b] are not needed and exit at once.
//   kModeRejection: blockIdx.x = request b; its row is i = num_accepted[b]
//     (residual if i < num_draft_tokens[b], else the bonus row p_n).
//   blockIdx.y = chunk [y*tpb, min((y+1)*tpb, V)) of the vocabulary.
//   thread: per iteration one group of 4 consecutive tokens (one float4 and one
//     Philox4x32-10 block shared by the 4 race scores), block-strided.
//   output: block max of race_candidate(score, v) (0 for score 0; or
//     pack_argmax(ordered_key(x), v) for the argmax)
//     to partial[(blockIdx.x * chunks + y) * outs + o]; kModeRejection has
//     outs = 2: o=0 the residual race max(p - q, 0), o=1 the race over p with
//     the SAME noise (the reference's fallback / bonus draw).
//   bytes: reads 4 bytes per token (8 with draft_probs in kModeRejection),
//     writes 8*outs bytes per block.
template <int kMode, bool kVec>
__global__ void __launch_bounds__(kRaceThreads) race_partial_kernel(RaceParams prm) {
  __shared__ uint64_t scratch[kRaceThreads / kWarpSize];
  constexpr int kOuts = kMode == kModeRejection ? 2 : 1;
  const int64_t V = prm.V;
  const int64_t slot = blockIdx.x;  // row (race/argmax) or request (rejection)
  const int64_t b = kMode == kModeRejection ? slot : slot / prm.K1;
  int64_t i = kMode == kModeRejection ? 0 : slot % prm.K1;
  bool residual = false;
  if constexpr (kMode == kModeRejection) {
    const int32_t n = clamp_num_draft(prm.num_draft_tokens[b], prm.K);
    const int32_t acc = prm.num_accepted[b];
    i = acc < 0 ? 0 : (acc > n ? n : acc);
    residual = i < n;
  } else {
    if (prm.num_draft_tokens != nullptr &&
        i > clamp_num_draft(prm.num_draft_tokens[b], prm.K)) {
      return;  // position never emitted; finalize never reads this partial
    }
  }
  const float* row = prm.probs + (b * prm.K1 + i) * V;
  const float* qrow = nullptr;
  int64_t one_hot = -1;  // one-hot draft token when draft_probs is null
  if constexpr (kMode == kModeRejection) {
    if (residual) {
      if (prm.draft_probs != nullptr) {
        qrow = prm.draft_probs + (b * prm.K + i) * V;
      } else {
        one_hot = prm.draft_token_ids[b * prm.K + i];  // out of range: matches nothing
      }
    }
  }
  uint64_t seed = 0;
  int64_t position = 0;
  if constexpr (kMode != kModeArgmax) {
    seed = static_cast<uint64_t>(prm.seeds[b]);
    position = prm.positions[b] + i;
  }

  const int64_t begin = static_cast<int64_t>(blockIdx.y) * prm.tokens_per_block;
  const int64_t end = begin + prm.tokens_per_block < V ? begin + prm.tokens_per_block : V;
  uint64_t best0 = 0, best1 = 0;
  for (int64_t g = begin + 4 * static_cast<int64_t>(threadIdx.x); g < end; g += kTokensPerIter) {
    const float4 p4 = load_group<kVec>(row, g, end);
    if constexpr (kMode == kModeArgmax) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (g + j < end) {
          best0 = max_u64(best0, pack_argmax(ordered_key(lane_of(p4, j)), static_cast<uint32_t>(g + j)));
        }
      }
    } else {
      const Philox4x32 block = philox_block(seed, position, prm.purpose, static_cast<uint32_t>(g));
      float4 q4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if constexpr (kMode == kModeRejection) {
        if (qrow != nullptr) q4 = load_group<kVec>(qrow, g, end);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (g + j < end) {
          const uint32_t v = static_cast<uint32_t>(g + j);
          const float p = lane_of(p4, j);
          // One E_v per token; w / E_v is bit-identical to race_score(w, u).
          const float e = exponential_from_uniform(uniform_from_bits(block.v[j]));
          best1 = max_u64(best1, race_candidate(p / e, v));
          if constexpr (kMode == kModeRejection) {
            const float q = qrow != nullptr ? lane_of(q4, j) : (g + j == one_hot ? 1.0f : 0.0f);
            best0 = max_u64(best0, race_candidate(residual_weight(p, q) / e, v));
          }
        }
      }
    }
  }
  if constexpr (kMode == kModeRace) best0 = best1;
  best0 = block_max_u64(best0, scratch);
  if constexpr (kOuts == 2) best1 = block_max_u64(best1, scratch);
  if (threadIdx.x == 0) {
    uint64_t* dst = prm.partial + (slot * prm.chunks + blockIdx.y) * kOuts;
    dst[0] = best0;
    if constexpr (kOuts == 2) dst[1] = best1;
  }
}

// Max over the `chunks` partials starting at p (stride `stride`), by one warp;
// every lane gets the result.
__device__ __forceinline__ uint64_t warp_reduce_partials(const uint64_t* p, int32_t chunks, int stride) {
  const int lane = threadIdx.x % kWarpSize;
  uint64_t best = 0;
  for (int c = lane; c < chunks; c += kWarpSize) best = max_u64(best, p[static_cast<int64_t>(c) * stride]);
  return warp_max_u64(best);
}

constexpr int kFinalizeThreads = 128;  // 4 warps = 4 requests per block

// accept_while_equal_kernel (verify_greedy and coupled)
//   grid  ceil(B / 4), block 128: one warp per request b.
//   warp: for i = 0, 1, ...: winner_i = max over chunks of partial[b*K1+i]
//     (argmax or TARGET race winner); out[b,i] = winner_i; continue while
//     i < n_b and draft[b,i] == winner_i. Then out[b, i+1:] = -1,
//     num_accepted[b] = i.
//   bytes: reads <= (K+1)*chunks*8 + 4K, writes 4(K+1) + 4 per request.
__global__ void __launch_bounds__(kFinalizeThreads)
    accept_while_equal_kernel(const uint64_t* __restrict__ partial, const int32_t* __restrict__ draft_token_ids,
                              const int32_t* __restrict__ num_draft_tokens, int32_t* __restrict__ output_token_ids,
                              int32_t* __restrict__ num_accepted, int64_t B, int32_t K, int32_t chunks) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (b >= B) return;  // whole warp exits together
  const int32_t K1 = K + 1;
  const int32_t n = clamp_num_draft(num_draft_tokens[b], K);
  int32_t* out = output_token_ids + b * K1;
  int32_t i = 0;
  while (true) {
    const uint64_t best = warp_reduce_partials(partial + (b * K1 + i) * chunks, chunks, 1);
    const int32_t winner = race_winner(best);  // argmax packs are never 0
    if (lane == 0) out[i] = winner;
    if (i < n && draft_token_ids[b * K + i] == winner) {
      ++i;
      continue;
    }
    break;
  }
  for (int32_t j = i + 1 + lane; j < K1; j += kWarpSize) out[j] = -1;
  if (lane == 0) num_accepted[b] = i;
}

// rejection_accept_kernel
//   grid  ceil(B / 128), block 128: one thread per request b.
//   thread: for i < n_b: x = draft[b,i] (out of range -> reject), u_i = ACCEPT
//     coin at (seed, pos+i, index 0); accept iff u_i * q_i(x) < p_i(x) (q = 1
//     for a one-hot draft). Writes out[b, :i] = accepted draft tokens,
//     out[b, i:] = -1 (slot i is filled by the finalize kernel), num_accepted[b] = i.
//   bytes: reads <= K*(4 + 4 + 4) + 16 per request, writes 4(K+1) + 4.
__global__ void __launch_bounds__(kFinalizeThreads)
    rejection_accept_kernel(const float* __restrict__ target_probs, const float* __restrict__ draft_probs,
                            const int32_t* __restrict__ draft_token_ids, const int32_t* __restrict__ num_draft_tokens,
                            const int64_t* __restrict__ seeds, const int64_t* __restrict__ positions,
                            int32_t* __restrict__ output_token_ids, int32_t* __restrict__ num_accepted, int64_t B,
                            int32_t K, int64_t V) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int32_t K1 = K + 1;
  const int32_t n = clamp_num_draft(num_draft_tokens[b], K);
  const uint64_t seed = static_cast<uint64_t>(seeds[b]);
  const int64_t pos = positions[b];
  int32_t* out = output_token_ids + b * K1;
  int32_t i = 0;
  for (; i < n; ++i) {
    const int32_t x = draft_token_ids[b * K + i];
    if (x < 0 || static_cast<int64_t>(x) >= V) break;  // invalid id: reject, never read
    const float p_x = target_probs[(b * K1 + i) * V + x];
    const float q_x = draft_probs != nullptr ? draft_probs[(b * K + i) * V + x] : 1.0f;
    const float u = uniform(seed, pos + i, kPurposeAccept, 0u);
    if (!accept_draft(u, p_x, q_x)) break;
    out[i] = x;
  }
  for (int32_t j = i; j < K1; ++j) out[j] = -1;
  num_accepted[b] = i;
}

// rejection_finalize_kernel
//   grid  ceil(B / 4), block 128: one warp per request b.
//   warp: reduce the (residual, p) partials of the race kernel; at a rejection
//     (i < n_b) emit the residual winner unless its score is 0 (residual all
//     zero), then the p winner; for the bonus row (i == n_b) the p winner.
//   bytes: reads chunks*16 + 8, writes 4 per request.
__global__ void __launch_bounds__(kFinalizeThreads)
    rejection_finalize_kernel(const uint64_t* __restrict__ partial, const int32_t* __restrict__ num_draft_tokens,
                              const int32_t* __restrict__ num_accepted, int32_t* __restrict__ output_token_ids,
                              int64_t B, int32_t K, int32_t chunks) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (b >= B) return;
  const int32_t n = clamp_num_draft(num_draft_tokens[b], K);
  const int32_t acc = num_accepted[b];
  const int32_t i = acc < 0 ? 0 : (acc > n ? n : acc);
  const uint64_t* p = partial + b * chunks * 2;
  const uint64_t best_residual = warp_reduce_partials(p, chunks, 2);
  const uint64_t best_p = warp_reduce_partials(p + 1, chunks, 2);
  if (lane == 0) {
    // residual all zero (best_residual == 0): fall back to the race over p
    const bool use_residual = i < n && best_residual != 0ull;
    output_token_ids[b * (K + 1) + i] = race_winner(use_residual ? best_residual : best_p);
  }
}

// sample_finalize_kernel
//   grid  ceil(N / 4), block 128: one warp per row; tokens[r] = winner.
__global__ void __launch_bounds__(kFinalizeThreads)
    sample_finalize_kernel(const uint64_t* __restrict__ partial, int32_t* __restrict__ tokens, int64_t N,
                           int32_t chunks) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  if (r >= N) return;
  const uint64_t best = warp_reduce_partials(partial + r * chunks, chunks, 1);
  if (threadIdx.x % kWarpSize == 0) tokens[r] = race_winner(best);
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------

// Vocabulary chunk per block: a multiple of kTokensPerIter, large enough that
// a block does real work, small enough that rows * chunks ~ 4 waves of SMs
// (so one request with V = 128k still spreads over the whole GPU).
int64_t race_tokens_per_block(int64_t rows, int64_t V, int device) {
  const int64_t target_blocks = 4 * static_cast<int64_t>(cuda_detail::sm_count(device));
  const int64_t want_chunks = std::max<int64_t>(1, ceil_div(target_blocks, std::max<int64_t>(rows, 1)));
  int64_t tpb = ceil_div(ceil_div(V, want_chunks), kTokensPerIter) * kTokensPerIter;
  tpb = std::max<int64_t>(tpb, kTokensPerIter);
  tpb = std::min<int64_t>(tpb, 16 * kTokensPerIter);
  // grid.y is limited to 65535 chunks
  while (ceil_div(V, tpb) > 65535) tpb *= 2;
  return tpb;
}

template <int kMode>
void launch_race(RaceParams prm, int64_t grid_rows, bool vec, cudaStream_t stream) {
  TORCH_CHECK(grid_rows <= 0x7fffffff, "specrt: too many rows for one launch: ", grid_rows);
  const dim3 grid(static_cast<unsigned>(grid_rows), static_cast<unsigned>(prm.chunks));
  if (vec) {
    race_partial_kernel<kMode, true><<<grid, kRaceThreads, 0, stream>>>(prm);
  } else {
    race_partial_kernel<kMode, false><<<grid, kRaceThreads, 0, stream>>>(prm);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool vec_ok(int64_t V, std::initializer_list<const void*> ptrs) {
  if (V % 4 != 0) return false;
  for (const void* p : ptrs) {
    if (p != nullptr && !is_aligned16(p)) return false;
  }
  return true;
}

unsigned finalize_blocks_for_warps(int64_t n) {
  constexpr int64_t kWarpsPerBlock = kFinalizeThreads / kWarpSize;
  return static_cast<unsigned>(std::max<int64_t>(1, ceil_div(n, kWarpsPerBlock)));
}

}  // namespace

void probs_from_logits_cuda(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                            const at::Tensor& top_p, const at::Tensor& min_p, at::Tensor& probs) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t N = logits.size(0);
  const int64_t V = logits.size(1);
  if (N == 0 || V == 0) return;
  TORCH_CHECK(N <= 0x7fffffff, "specrt: probs_from_logits: too many rows: ", N);
  TORCH_CHECK(V <= 0x7fffffff, "specrt: probs_from_logits: vocabulary too large: ", V);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(logits.device().index()).stream();
  const float* x = logits.data_ptr<float>();
  float* out = probs.data_ptr<float>();
  const float* mp = min_p.defined() ? min_p.data_ptr<float>() : nullptr;
  const bool vec = vec_ok(V, {x, out});
  if (vec) {
    probs_from_logits_kernel<true><<<static_cast<unsigned>(N), kProbsThreads, 0, stream>>>(
        x, temperature.data_ptr<float>(), top_k.data_ptr<int32_t>(), top_p.data_ptr<float>(), mp, out, V);
  } else {
    probs_from_logits_kernel<false><<<static_cast<unsigned>(N), kProbsThreads, 0, stream>>>(
        x, temperature.data_ptr<float>(), top_k.data_ptr<int32_t>(), top_p.data_ptr<float>(), mp, out, V);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void verify_greedy_cuda(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                        const at::Tensor& num_draft_tokens, at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const int64_t B = target_logits.size(0);
  const int64_t K1 = target_logits.size(1);
  const int64_t V = target_logits.size(2);
  if (B == 0) return;
  TORCH_CHECK(K1 >= 1 && V >= 1 && V <= 0x7fffffff, "specrt: verify_greedy: bad target_logits shape");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(target_logits.device().index()).stream();
  const int64_t rows = B * K1;
  const int64_t tpb = race_tokens_per_block(rows, V, target_logits.device().index());
  const int32_t chunks = static_cast<int32_t>(ceil_div(V, tpb));
  at::Tensor partial = at::empty({rows * chunks}, target_logits.options().dtype(at::kLong));

  RaceParams prm{};
  prm.probs = target_logits.data_ptr<float>();
  prm.draft_token_ids = draft_token_ids.data_ptr<int32_t>();
  prm.num_draft_tokens = num_draft_tokens.data_ptr<int32_t>();
  prm.partial = reinterpret_cast<uint64_t*>(partial.data_ptr<int64_t>());
  prm.V = V;
  prm.tokens_per_block = tpb;
  prm.K = static_cast<int32_t>(K1 - 1);
  prm.K1 = static_cast<int32_t>(K1);
  prm.chunks = chunks;
  launch_race<kModeArgmax>(prm, rows, vec_ok(V, {prm.probs}), stream);

  accept_while_equal_kernel<<<finalize_blocks_for_warps(B), kFinalizeThreads, 0, stream>>>(
      prm.partial, prm.draft_token_ids, prm.num_draft_tokens, output_token_ids.data_ptr<int32_t>(),
      num_accepted.data_ptr<int32_t>(), B, prm.K, chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rejection_sample_cuda(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                           const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens,
                           const at::Tensor& seeds, const at::Tensor& positions, AcceptMethod method,
                           at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const int64_t B = target_probs.size(0);
  const int64_t K1 = target_probs.size(1);
  const int64_t V = target_probs.size(2);
  if (B == 0) return;
  TORCH_CHECK(K1 >= 1 && V >= 1 && V <= 0x7fffffff, "specrt: rejection_sample: bad target_probs shape");
  const int device = target_probs.device().index();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();

  RaceParams prm{};
  prm.probs = target_probs.data_ptr<float>();
  prm.draft_probs = (draft_probs.has_value() && draft_probs->defined() && draft_probs->numel() > 0)
                        ? draft_probs->data_ptr<float>()
                        : nullptr;
  prm.draft_token_ids = draft_token_ids.data_ptr<int32_t>();
  prm.num_draft_tokens = num_draft_tokens.data_ptr<int32_t>();
  prm.num_accepted = num_accepted.data_ptr<int32_t>();
  prm.seeds = seeds.data_ptr<int64_t>();
  prm.positions = positions.data_ptr<int64_t>();
  prm.V = V;
  prm.K = static_cast<int32_t>(K1 - 1);
  prm.K1 = static_cast<int32_t>(K1);
  int32_t* out = output_token_ids.data_ptr<int32_t>();
  int32_t* num_acc = num_accepted.data_ptr<int32_t>();
  const bool vec = vec_ok(V, {prm.probs, prm.draft_probs});

  if (method == AcceptMethod::kCoupled) {
    // Race winners (purpose TARGET) at every needed position 0..n_b in parallel.
    const int64_t rows = B * K1;
    prm.tokens_per_block = race_tokens_per_block(rows, V, device);
    prm.chunks = static_cast<int32_t>(ceil_div(V, prm.tokens_per_block));
    prm.purpose = kPurposeTarget;
    at::Tensor partial = at::empty({rows * prm.chunks}, target_probs.options().dtype(at::kLong));
    prm.partial = reinterpret_cast<uint64_t*>(partial.data_ptr<int64_t>());
    launch_race<kModeRace>(prm, rows, vec_ok(V, {prm.probs}), stream);  // draft_probs unused
    accept_while_equal_kernel<<<finalize_blocks_for_warps(B), kFinalizeThreads, 0, stream>>>(
        prm.partial, prm.draft_token_ids, prm.num_draft_tokens, out, num_acc, B, prm.K, prm.chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  TORCH_CHECK(method == AcceptMethod::kRejection, "specrt: rejection_sample: unknown method");

  // 1. coins: accepted prefix, -1 padding, num_accepted
  rejection_accept_kernel<<<static_cast<unsigned>(ceil_div(B, kFinalizeThreads)), kFinalizeThreads, 0, stream>>>(
      prm.probs, prm.draft_probs, prm.draft_token_ids, prm.num_draft_tokens, prm.seeds, prm.positions, out,
      num_acc, B, prm.K, V);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // 2. residual (or bonus) race at each request's row num_accepted[b]
  prm.tokens_per_block = race_tokens_per_block(B, V, device);
  prm.chunks = static_cast<int32_t>(ceil_div(V, prm.tokens_per_block));
  prm.purpose = kPurposeResidual;
  at::Tensor partial = at::empty({B * prm.chunks * 2}, target_probs.options().dtype(at::kLong));
  prm.partial = reinterpret_cast<uint64_t*>(partial.data_ptr<int64_t>());
  launch_race<kModeRejection>(prm, B, vec, stream);

  // 3. pick residual winner, or fallback / bonus winner from p
  rejection_finalize_kernel<<<finalize_blocks_for_warps(B), kFinalizeThreads, 0, stream>>>(
      prm.partial, prm.num_draft_tokens, prm.num_accepted, out, B, prm.K, prm.chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void sample_tokens_cuda(const at::Tensor& probs, const at::Tensor& seeds, const at::Tensor& positions,
                        uint32_t purpose, at::Tensor& tokens) {
  const c10::cuda::CUDAGuard guard(probs.device());
  const int64_t N = probs.size(0);
  const int64_t V = probs.size(1);
  if (N == 0) return;
  TORCH_CHECK(V >= 1 && V <= 0x7fffffff, "specrt: sample_tokens: bad probs shape");
  const int device = probs.device().index();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  RaceParams prm{};
  prm.probs = probs.data_ptr<float>();
  prm.seeds = seeds.data_ptr<int64_t>();
  prm.positions = positions.data_ptr<int64_t>();
  prm.V = V;
  prm.K = 0;
  prm.K1 = 1;
  prm.tokens_per_block = race_tokens_per_block(N, V, device);
  prm.chunks = static_cast<int32_t>(ceil_div(V, prm.tokens_per_block));
  prm.purpose = purpose;
  at::Tensor partial = at::empty({N * prm.chunks}, probs.options().dtype(at::kLong));
  prm.partial = reinterpret_cast<uint64_t*>(partial.data_ptr<int64_t>());
  launch_race<kModeRace>(prm, N, vec_ok(V, {prm.probs}), stream);
  sample_finalize_kernel<<<finalize_blocks_for_warps(N), kFinalizeThreads, 0, stream>>>(
      prm.partial, tokens.data_ptr<int32_t>(), N, prm.chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace specrt

TORCH_LIBRARY_IMPL(specrt, CUDA, m) {
  using at::Tensor;
  m.impl("probs_from_logits", [](const Tensor& logits, const Tensor& temperature, const Tensor& top_k,
                                 const Tensor& top_p, const std::optional<Tensor>& min_p, bool check) {
    return specrt::probs_from_logits_op(logits, temperature, top_k, top_p, min_p, check,
                                        &specrt::probs_from_logits_cuda);
  });
  m.impl("verify_greedy", [](const Tensor& target_logits, const Tensor& draft_token_ids,
                             const Tensor& num_draft_tokens, bool check) {
    return specrt::verify_greedy_op(target_logits, draft_token_ids, num_draft_tokens, check,
                                    &specrt::verify_greedy_cuda);
  });
  m.impl("rejection_sample",
         [](const Tensor& target_probs, const std::optional<Tensor>& draft_probs, const Tensor& draft_token_ids,
            const Tensor& num_draft_tokens, const Tensor& seeds, const Tensor& positions, std::string method,
            bool check) {
           return specrt::rejection_sample_op(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seeds,
                                              positions, method, check, &specrt::rejection_sample_cuda);
         });
  m.impl("sample_tokens",
         [](const Tensor& probs, const Tensor& seeds, const Tensor& positions, int64_t purpose, bool check) {
           return specrt::sample_tokens_op(probs, seeds, positions, purpose, check, &specrt::sample_tokens_cuda);
         });
}
