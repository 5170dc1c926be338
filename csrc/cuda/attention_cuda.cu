// csrc/cuda/attention_cuda.cu — CUDA kernel of paged multi-position attention
// (csrc/attention_ops.h) and its TORCH_LIBRARY_IMPL(specrt, CUDA) registration.
//
//   attention_chunk_kernel    grid (chunk, kv head x lane group, request), 128 threads.
//                             One CTA = up to 16 queries ("lanes": the query heads
//                             of one kv head x the request's new tokens) over one
//                             256-key chunk of the request's context, 32-key tiles:
//                             stage K/V rows of the tile in shared memory (read
//                             through the block table, converted to float), one
//                             thread per (lane, key) score, per-lane online softmax
//                             update, one thread per (lane, d) output accumulator.
//                             A request with one chunk writes its output here;
//                             otherwise (m, l, acc) partials go to a workspace.
//   attention_combine_kernel  grid (kv head x lane group, request): the partials
//                             of each lane combined in chunk order.
//
// The float math is csrc/include/specrt/attention.h, operation for operation
// the CPU kernel's (same tiles, chunks, fmaf order, exp2_det, combine), so the
// two return the same bits. No atomics, no host synchronisation (grid sizes
// come from the host-side max_query_len / max_seq_len). Device values are not
// validated here (check_paged_attention does that on the host in debug mode);
// every data-dependent index is guarded instead: bad block ids read zeros,
// rows / chunks / lanes beyond the grid or q are skipped.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

#include "attention_ops.h"
#include "cuda_utils.cuh"
#include "specrt/attention.h"

namespace specrt {
namespace {

using attn::kChunkKeys;
using attn::kLanes;
using attn::kTileKeys;
using cuda_detail::ceil_div;

constexpr int kThreads = 128;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxElems = kLanes * kMaxHeadDim / kThreads;  // output accumulators per thread

struct AttnParams {
  const float* q;               // [T, H, D]
  const void* cache;            // [2, NB, bs, Hkv, D]
  const int32_t* block_tables;  // [B, M]
  const int64_t* seq_lens;      // [B]
  const int64_t* qsl;           // [B+1]
  const int64_t* tree_mask;     // [T] ancestor bits of each query row (attn::tree_visible); null: causal
  float* out;                   // [T, H, D]
  float* part;                  // [B, Hkv, lane_groups, max_chunks, 16, D + 2]
  int64_t T, H, Hkv, G, D, num_blocks, block_size, M, window;
  int lane_groups, max_chunks;
  float qscale;
};

__device__ __forceinline__ float to_float(float x) { return x; }

template <bool kBf16>
__device__ __forceinline__ float to_float(uint16_t x) {
  return kBf16 ? attn::bf16_bits_to_float(x) : attn::half_bits_to_float(x);
}

template <typename Elem, bool kBf16>
__device__ __forceinline__ float load_elem(const Elem* p) {
  if constexpr (sizeof(Elem) == 4) {
    return to_float(*p);
  } else {
    return to_float<kBf16>(*p);
  }
}

// What one CTA's request looks like (all values read on the device).
struct RequestView {
  int64_t seq_len, q0, query_len, first_key, chunk_first, num_chunks;
  bool valid;
};

__device__ __forceinline__ RequestView request_view(const AttnParams& p, int64_t b) {
  RequestView r;
  r.seq_len = p.seq_lens[b];
  r.q0 = p.qsl[b];
  r.query_len = p.qsl[b + 1] - r.q0;
  r.valid = r.query_len > 0 && r.seq_len >= r.query_len && r.q0 >= 0;
  if (!r.valid) return r;
  r.first_key = attn::first_visible_key(r.seq_len, r.query_len, p.window);
  r.chunk_first = r.first_key / kChunkKeys;
  r.num_chunks = (r.seq_len - 1) / kChunkKeys - r.chunk_first + 1;
  if (r.num_chunks > p.max_chunks) r.num_chunks = p.max_chunks;  // seq_len beyond max_seq_len: not computed
  return r;
}

// Shared memory: per-lane tree bits [16] (first: 8-byte aligned), q [16][D], K and V tiles [32][D+1]
// (padded: conflict-free column reads), scores / probabilities [16][32], per-lane state.
struct Smem {
  int64_t* tree;
  float *q, *k, *v, *s, *m, *l, *alpha, *m_safe;
  __device__ explicit Smem(float* base, int64_t D) {
    tree = reinterpret_cast<int64_t*>(base);
    q = base + 2 * kLanes;
    k = q + kLanes * D;
    v = k + kTileKeys * (D + 1);
    s = v + kTileKeys * (D + 1);
    m = s + kLanes * kTileKeys;
    l = m + kLanes;
    alpha = l + kLanes;
    m_safe = alpha + kLanes;
  }
  static int64_t floats(int64_t D) { return 6 * kLanes + kLanes * D + 2 * kTileKeys * (D + 1) + kLanes * kTileKeys; }
};

template <typename Elem, bool kBf16>
__global__ void __launch_bounds__(kThreads) attention_chunk_kernel(const AttnParams p) {
  extern __shared__ float smem_raw[];
  const int64_t b = blockIdx.z;
  const int64_t h = blockIdx.y / p.lane_groups;
  const int64_t lg = blockIdx.y % p.lane_groups;
  const int64_t c = blockIdx.x;  // counted from the request's first visible chunk
  const RequestView r = request_view(p, b);
  const int64_t lanes = p.G * r.query_len;
  if (!r.valid || c >= r.num_chunks || lg * kLanes >= lanes) return;
  const int64_t D = p.D;
  const int tid = threadIdx.x;
  Smem sm(smem_raw, D);

  // lane i: query (lane / G) of the request, query head h * G + lane % G
  const int64_t lane_begin = lg * kLanes;
  const int64_t lane_last = (lane_begin + kLanes < lanes ? lane_begin + kLanes : lanes) - 1;
  const int64_t pos0 = r.seq_len - r.query_len;
  const int64_t min_pos = pos0 + lane_begin / p.G, max_pos = pos0 + lane_last / p.G;
  for (int64_t idx = tid; idx < kLanes * D; idx += kThreads) {
    const int64_t i = idx / D, d = idx % D;
    const int64_t lane = lane_begin + i;
    const int64_t row = r.q0 + lane / p.G;
    float x = 0.0f;
    if (lane < lanes && row < p.T) x = p.q[(row * p.H + h * p.G + lane % p.G) * D + d] * p.qscale;
    sm.q[i * D + d] = x;
  }
  if (tid < kLanes) {
    sm.m[tid] = __int_as_float(0xff800000u);  // -inf
    sm.l[tid] = 0.0f;
    const int64_t lane = lane_begin + tid;
    const int64_t row = r.q0 + lane / p.G;
    sm.tree[tid] = p.tree_mask != nullptr && lane < lanes && row < p.T ? p.tree_mask[row] : -1;
  }
  float acc[kMaxElems];
#pragma unroll
  for (int e = 0; e < kMaxElems; ++e) acc[e] = 0.0f;

  const int64_t window = p.window > 0 && p.window < r.seq_len ? p.window : 0;
  const int64_t chunk = r.chunk_first + c;
  const int64_t key_begin = max(chunk * kChunkKeys, r.first_key);
  const int64_t key_end = min((chunk + 1) * kChunkKeys, r.seq_len);
  const Elem* cache_k = static_cast<const Elem*>(p.cache);
  const int64_t plane = p.num_blocks * p.block_size * p.Hkv * D;
  const int32_t* table = p.block_tables + b * p.M;
  const float neg_inf = __int_as_float(0xff800000u);

  for (int64_t t0 = key_begin - key_begin % kTileKeys; t0 < key_end; t0 += kTileKeys) {
    const int64_t k0 = max(t0, key_begin), k1 = min(t0 + kTileKeys, key_end);
    const int n = static_cast<int>(k1 - k0);
    // a tile no lane of this CTA can see changes nothing (see attention.h): skip it, as the CPU does
    if (k0 > max_pos || (window != 0 && k1 - 1 <= min_pos - window)) continue;
    __syncthreads();  // the previous tile's K/V/scores are no longer read
    for (int64_t idx = tid; idx < n * D; idx += kThreads) {
      const int64_t j = idx / D, d = idx % D;
      const int64_t kp = k0 + j;
      const int64_t col = kp / p.block_size;
      const int32_t block = col < p.M ? table[col] : -1;
      float kx = 0.0f, vx = 0.0f;
      if (block >= 0 && block < p.num_blocks) {
        const int64_t off = ((block * p.block_size + kp % p.block_size) * p.Hkv + h) * D + d;
        kx = load_elem<Elem, kBf16>(cache_k + off);
        vx = load_elem<Elem, kBf16>(cache_k + plane + off);
      }
      sm.k[j * (D + 1) + d] = kx;
      sm.v[j * (D + 1) + d] = vx;
    }
    __syncthreads();
    // scores: thread per (lane, key), fmaf over d in order
    for (int idx = tid; idx < kLanes * kTileKeys; idx += kThreads) {
      const int i = idx / kTileKeys, j = idx % kTileKeys;
      if (j >= n) continue;
      const float* qrow = sm.q + i * D;
      const float* krow = sm.k + j * (D + 1);
      float dot = 0.0f;
      for (int d = 0; d < static_cast<int>(D); ++d) dot = fmaf(qrow[d], krow[d], dot);
      const int64_t lane = lane_begin + i < lanes ? lane_begin + i : lanes - 1;
      const int64_t pos = pos0 + lane / p.G;
      const int64_t kp = k0 + j;
      const bool visible =
          kp <= pos && (window == 0 || kp > pos - window) && attn::tree_visible(pos, kp, sm.tree[i]);
      sm.s[idx] = visible ? dot : neg_inf;
    }
    __syncthreads();
    if (tid < kLanes) {
      float mt = neg_inf;
      for (int j = 0; j < n; ++j) {
        const float x = sm.s[tid * kTileKeys + j];
        mt = mt > x ? mt : x;
      }
      const float m_old = sm.m[tid];
      const float m_new = m_old > mt ? m_old : mt;
      const float m_safe = m_new == neg_inf ? 0.0f : m_new;
      sm.alpha[tid] = attn::exp2_det(m_old - m_safe);
      sm.m_safe[tid] = m_safe;
      sm.m[tid] = m_new;
    }
    __syncthreads();
    for (int idx = tid; idx < kLanes * kTileKeys; idx += kThreads) {
      const int i = idx / kTileKeys, j = idx % kTileKeys;
      if (j < n) sm.s[idx] = attn::exp2_det(sm.s[idx] - sm.m_safe[i]);
    }
    __syncthreads();
    if (tid < kLanes) {
      float l = sm.l[tid] * sm.alpha[tid];
      for (int j = 0; j < n; ++j) l = l + sm.s[tid * kTileKeys + j];
      sm.l[tid] = l;
    }
    // output accumulators: thread per (lane, d), fmaf over the tile's keys in order
#pragma unroll
    for (int e = 0; e < kMaxElems; ++e) {
      const int64_t idx = tid + static_cast<int64_t>(e) * kThreads;
      if (idx < kLanes * D) {
        const int64_t i = idx / D, d = idx % D;
        const float* pi = sm.s + i * kTileKeys;
        float a = acc[e] * sm.alpha[i];
        for (int j = 0; j < n; ++j) a = fmaf(pi[j], sm.v[j * (D + 1) + d], a);
        acc[e] = a;
      }
    }
  }
  __syncthreads();  // l and m final

  float* part = p.part + ((((b * p.Hkv + h) * p.lane_groups + lg) * p.max_chunks + c) * kLanes) * (D + 2);
#pragma unroll
  for (int e = 0; e < kMaxElems; ++e) {
    const int64_t idx = tid + static_cast<int64_t>(e) * kThreads;
    if (idx >= kLanes * D) continue;
    const int64_t i = idx / D, d = idx % D;
    const int64_t lane = lane_begin + i;
    const int64_t row = r.q0 + lane / p.G;
    if (lane >= lanes || row >= p.T) continue;
    if (r.num_chunks == 1) {
      p.out[(row * p.H + h * p.G + lane % p.G) * D + d] = acc[e] / sm.l[i];
    } else {
      float* pl = part + i * (D + 2);
      if (d == 0) {
        pl[0] = sm.m[i];
        pl[1] = sm.l[i];
      }
      pl[2 + d] = acc[e];
    }
  }
}

// Per (request, kv head, lane group): out = sum_c acc_c w_c / sum_c l_c w_c, chunks in order.
__global__ void __launch_bounds__(kThreads) attention_combine_kernel(const AttnParams p) {
  const int64_t b = blockIdx.y;
  const int64_t h = blockIdx.x / p.lane_groups;
  const int64_t lg = blockIdx.x % p.lane_groups;
  const RequestView r = request_view(p, b);
  const int64_t lanes = p.G * r.query_len;
  if (!r.valid || r.num_chunks <= 1 || lg * kLanes >= lanes) return;
  const int64_t D = p.D;
  const int64_t stride = kLanes * (D + 2);
  const float* part = p.part + (((b * p.Hkv + h) * p.lane_groups + lg) * p.max_chunks) * stride;
  for (int64_t idx = threadIdx.x; idx < kLanes * D; idx += kThreads) {
    const int64_t i = idx / D, d = idx % D;
    const int64_t lane = lg * kLanes + i;
    const int64_t row = r.q0 + lane / p.G;
    if (lane >= lanes || row >= p.T) continue;
    const float* pl = part + i * (D + 2);
    float big_m = __int_as_float(0xff800000u);
    for (int64_t c = 0; c < r.num_chunks; ++c) {
      const float m = pl[c * stride];
      big_m = big_m > m ? big_m : m;
    }
    float big_l = 0.0f, a = 0.0f;
    for (int64_t c = 0; c < r.num_chunks; ++c) {
      const float* q = pl + c * stride;
      const float w = attn::exp2_det(q[0] - big_m);
      big_l = fmaf(q[1], w, big_l);
      a = fmaf(q[2 + d], w, a);
    }
    p.out[(row * p.H + h * p.G + lane % p.G) * D + d] = a / big_l;
  }
}

template <typename Elem, bool kBf16>
void launch(const AttnParams& p, int64_t B, int64_t smem_bytes, cudaStream_t stream) {
  auto kernel = attention_chunk_kernel<Elem, kBf16>;
  if (smem_bytes > 48 * 1024) {  // beyond the default limit: opt in (a host-side attribute, no sync)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem_bytes)));
  }
  const dim3 grid(static_cast<unsigned>(p.max_chunks), static_cast<unsigned>(p.Hkv * p.lane_groups),
                  static_cast<unsigned>(B));
  kernel<<<grid, kThreads, smem_bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void paged_attention_cuda(const PagedAttentionArgs& a) {
  const c10::cuda::CUDAGuard guard(a.q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.q.device().index()).stream();
  a.out.zero_();  // padding rows and rows of skipped (invalid) requests stay zero
  const int64_t B = a.seq_lens.size(0);
  if (B == 0 || a.max_query_len == 0 || a.max_seq_len == 0 || a.q.size(0) == 0) return;
  AttnParams p{};
  p.q = a.q.data_ptr<float>();
  p.cache = a.kv_cache.data_ptr();
  p.block_tables = a.block_tables.data_ptr<int32_t>();
  p.seq_lens = a.seq_lens.data_ptr<int64_t>();
  p.qsl = a.query_start_loc.data_ptr<int64_t>();
  p.tree_mask = a.tree_mask.defined() ? a.tree_mask.data_ptr<int64_t>() : nullptr;
  p.out = a.out.data_ptr<float>();
  p.T = a.q.size(0);
  p.H = a.q.size(1);
  p.D = a.q.size(2);
  p.Hkv = a.kv_cache.size(3);
  p.G = p.H / p.Hkv;
  p.num_blocks = a.kv_cache.size(1);
  p.block_size = a.kv_cache.size(2);
  p.M = a.block_tables.size(1);
  p.window = a.window;
  p.qscale = a.qscale;
  TORCH_CHECK_VALUE(p.D <= kMaxHeadDim, "paged_attention on CUDA supports head_dim <= ", kMaxHeadDim, ", got ", p.D);
  const int64_t lane_groups = ceil_div(p.G * a.max_query_len, kLanes);
  const int64_t max_chunks = ceil_div(a.max_seq_len, kChunkKeys);
  TORCH_CHECK_VALUE(B <= 65535 && p.Hkv * lane_groups <= 65535, "paged_attention on CUDA: too many requests (", B,
                    ") or kv heads x query lanes (", p.Hkv * lane_groups, ") for one grid");
  p.lane_groups = static_cast<int>(lane_groups);
  p.max_chunks = static_cast<int>(max_chunks);
  at::Tensor part;
  if (max_chunks > 1) {
    part = at::empty({B * p.Hkv * lane_groups * max_chunks * kLanes * (p.D + 2)}, a.q.options());
    p.part = part.data_ptr<float>();
  }
  const int64_t smem_bytes = Smem::floats(p.D) * static_cast<int64_t>(sizeof(float));
  switch (a.kv_cache.scalar_type()) {
    case at::kFloat: launch<float, false>(p, B, smem_bytes, stream); break;
    case at::kBFloat16: launch<uint16_t, true>(p, B, smem_bytes, stream); break;
    default: launch<uint16_t, false>(p, B, smem_bytes, stream); break;
  }
  if (max_chunks > 1) {
    attention_combine_kernel<<<dim3(static_cast<unsigned>(p.Hkv * lane_groups), static_cast<unsigned>(B)), kThreads,
                               0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

namespace {

at::Tensor paged_attention_cuda_op(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                   int64_t window, int64_t max_query_len, int64_t max_seq_len, bool check_values,
                                   const std::optional<at::Tensor>& tree_mask) {
  const PagedAttentionArgs args = check_paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                                        window, max_query_len, max_seq_len, check_values, tree_mask);
  paged_attention_cuda(args);
  return args.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specrt, CUDA, m) { m.impl("paged_attention", &paged_attention_cuda_op); }

}  // namespace specrt
