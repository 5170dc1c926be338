// csrc/cuda/kv_cuda.cu — paged KV-cache kernels (docs/architecture.md §2, §5).
//
//   copy_blocks_cuda  ONE launch copies every (src, dst) block of every layer
//                     and K/V plane of every cache (target and draft, any
//                     dtypes/shapes). The cache pointers/strides travel in a
//                     small struct passed BY VALUE as the kernel argument: no
//                     per-call host-to-device pointer table, graph-safe.
//   copy_slots_cuda   copies single token slots src -> dst in every layer and K/V
//                     plane of every cache: a gather launch into a staging
//                     buffer, then a scatter launch (all sources are read before
//                     any destination is written, whatever the overlap).
//   write_kv_cuda     scatters new K/V rows [T, H, D] into their slots.
//
// Both are pure byte copies (dtype-agnostic) with the widest access unit (16,
// 8, 4, 2 or 1 bytes) that divides every address and the row length; 16-byte
// uint4 copies in the normal case. Device-side block ids / slots are guarded:
// out-of-range values are skipped, never read or written.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda_utils.cuh"
#include "ops.h"

namespace specrt {
namespace {

constexpr int kMaxCaches = 8;
constexpr int kCopyThreads = 256;
constexpr int kMaxGridY = 65535;

// Widest access unit (bytes) dividing `bytes` and every address.
int copy_unit(int64_t bytes, std::initializer_list<const void*> ptrs) {
  for (int unit : {16, 8, 4, 2}) {
    bool ok = bytes % unit == 0;
    for (const void* p : ptrs) ok = ok && (reinterpret_cast<uintptr_t>(p) % unit == 0);
    if (ok) return unit;
  }
  return 1;
}

template <typename T>
__device__ __forceinline__ void copy_units(const char* src, char* dst, int64_t bytes) {
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) d[j] = s[j];
}

// Block-cooperative copy of `bytes` bytes with access unit `unit` (uniform
// across the block).
__device__ __forceinline__ void copy_bytes(const char* src, char* dst, int64_t bytes, int unit) {
  switch (unit) {
    case 16: copy_units<uint4>(src, dst, bytes); break;
    case 8: copy_units<uint2>(src, dst, bytes); break;
    case 4: copy_units<uint32_t>(src, dst, bytes); break;
    case 2: copy_units<uint16_t>(src, dst, bytes); break;
    default: copy_units<uint8_t>(src, dst, bytes); break;
  }
}

// Up to kMaxCaches caches, passed by value (~330 bytes of kernel parameters).
// Cache c is [layers, 2, num_blocks, block_size, kv_heads, head_dim]; it owns
// planes [plane_begin[c], plane_begin[c+1]) = its layers*2 (layer, k|v)
// planes, each num_blocks * block_bytes long.
struct CopyBlocksArgs {
  char* base[kMaxCaches];
  int64_t block_bytes[kMaxCaches];  // block_size * kv_heads * head_dim * element size
  int64_t num_blocks[kMaxCaches];
  int32_t plane_begin[kMaxCaches + 1];
  int32_t unit[kMaxCaches];
  int32_t num_caches;
};

// copy_blocks_kernel
//   grid  (P, min(total_planes, 65535)); block 256 threads.
//   blockIdx.x = mapping pair p; blockIdx.y strides over every (cache, layer,
//   k|v) plane of all caches. The block copies block_bytes bytes of plane
//   from block src to block dst with unit-wide (normally 16-byte) accesses,
//   threads striding over the block.
//   bytes: reads + writes block_bytes per (pair, plane) = 2 * P * sum_c(cache_c bytes / num_blocks_c).
//   Guard: src/dst outside [0, num_blocks_c) -> that cache is skipped.
__global__ void __launch_bounds__(kCopyThreads)
    copy_blocks_kernel(CopyBlocksArgs args, const int64_t* __restrict__ block_mapping) {
  const int64_t pair = blockIdx.x;
  const int64_t src_block = block_mapping[2 * pair];
  const int64_t dst_block = block_mapping[2 * pair + 1];
  const int32_t total_planes = args.plane_begin[args.num_caches];
  for (int32_t plane = blockIdx.y; plane < total_planes; plane += gridDim.y) {
    int c = 0;
    while (c + 1 < args.num_caches && plane >= args.plane_begin[c + 1]) ++c;
    const int64_t nb = args.num_blocks[c];
    if (src_block < 0 || src_block >= nb || dst_block < 0 || dst_block >= nb) continue;
    const int64_t bb = args.block_bytes[c];
    char* plane_base = args.base[c] + static_cast<int64_t>(plane - args.plane_begin[c]) * nb * bb;
    copy_bytes(plane_base + src_block * bb, plane_base + dst_block * bb, bb, args.unit[c]);
  }
}

// Up to kMaxCaches caches for copy_slots. Cache c's planes are
// [plane_begin[c], plane_begin[c+1]); slot s of a plane is slot_bytes long at
// s * slot_bytes (slot = block * block_size + offset); its staging area holds
// (plane, pair) rows of slot_bytes, plane-major.
struct CopySlotsArgs {
  char* base[kMaxCaches];
  char* staged[kMaxCaches];
  int64_t slot_bytes[kMaxCaches];  // kv_heads * head_dim * element size
  int64_t num_slots[kMaxCaches];   // num_blocks * block_size
  int32_t plane_begin[kMaxCaches + 1];
  int32_t unit[kMaxCaches];
  int32_t num_caches;
};

// copy_slots_kernel<kGather>
//   grid  (P, min(total_planes, 65535)); block 256 threads.
//   blockIdx.x = mapping pair p, blockIdx.y strides over the planes of all caches.
//   kGather:  staged[plane, p] = plane slot src_p;   otherwise: plane slot dst_p = staged[plane, p].
//   The two launches run in order on one stream, so every source is read before
//   any destination is written.
//   bytes: each launch reads + writes slot_bytes per (pair, plane).
//   Guard: src or dst outside [0, num_slots_c) -> that pair is skipped for cache c.
template <bool kGather>
__global__ void __launch_bounds__(kCopyThreads)
    copy_slots_kernel(CopySlotsArgs args, const int64_t* __restrict__ slot_mapping, int64_t pairs) {
  const int64_t pair = blockIdx.x;
  const int64_t src = slot_mapping[2 * pair];
  const int64_t dst = slot_mapping[2 * pair + 1];
  const int32_t total_planes = args.plane_begin[args.num_caches];
  for (int32_t plane = blockIdx.y; plane < total_planes; plane += gridDim.y) {
    int c = 0;
    while (c + 1 < args.num_caches && plane >= args.plane_begin[c + 1]) ++c;
    const int64_t ns = args.num_slots[c];
    if (src < 0 || src >= ns || dst < 0 || dst >= ns) continue;
    const int64_t sb = args.slot_bytes[c];
    const int64_t local = plane - args.plane_begin[c];
    char* plane_base = args.base[c] + local * ns * sb;
    char* stage = args.staged[c] + (local * pairs + pair) * sb;
    if (kGather) {
      copy_bytes(plane_base + src * sb, stage, sb, args.unit[c]);
    } else {
      copy_bytes(stage, plane_base + dst * sb, sb, args.unit[c]);
    }
  }
}

// write_kv_kernel
//   grid  (T, 2); block 256 threads. blockIdx.x = token t, blockIdx.y = 0 (k) / 1 (v).
//   The block copies row_bytes = H*D*element bytes from k[t] (or v[t]) to
//   cache[layer, y, slot / block_size, slot % block_size].
//   bytes: reads + writes 2 * T * row_bytes. slot < 0 (padding) or
//   slot >= num_blocks * block_size (bad device input) -> skipped.
__global__ void __launch_bounds__(kCopyThreads)
    write_kv_kernel(char* cache, const char* __restrict__ k, const char* __restrict__ v,
                    const int64_t* __restrict__ slot_mapping, int64_t layer, int64_t num_blocks, int64_t block_size,
                    int64_t row_bytes, int unit) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_blocks * block_size) return;
  const int64_t kv = blockIdx.y;
  const char* src = (kv == 0 ? k : v) + t * row_bytes;
  const int64_t row = ((layer * 2 + kv) * num_blocks + slot / block_size) * block_size + slot % block_size;
  copy_bytes(src, cache + row * row_bytes, row_bytes, unit);
}

}  // namespace

void copy_blocks_cuda(const std::vector<at::Tensor>& caches, const at::Tensor& block_mapping) {
  const int64_t P = block_mapping.size(0);
  if (P == 0 || caches.empty()) return;
  TORCH_CHECK(P <= 0x7fffffff, "specrt: copy_blocks: too many block pairs: ", P);
  const c10::cuda::CUDAGuard guard(block_mapping.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(block_mapping.device().index()).stream();
  const int64_t* mapping = block_mapping.data_ptr<int64_t>();

  // Normally one launch (<= kMaxCaches caches); more caches -> one launch per 8.
  for (size_t first = 0; first < caches.size(); first += kMaxCaches) {
    CopyBlocksArgs args{};
    int n = 0;
    int64_t planes = 0;
    for (size_t c = first; c < caches.size() && c < first + kMaxCaches; ++c) {
      const at::Tensor& cache = caches[c];
      TORCH_CHECK(cache.dim() == 6, "specrt: copy_blocks: caches[", c,
                  "] must be [layers, 2, num_blocks, block_size, kv_heads, head_dim]");
      TORCH_CHECK(cache.device() == block_mapping.device(), "specrt: copy_blocks: caches[", c,
                  "] is on ", cache.device(), " but block_mapping is on ", block_mapping.device());
      if (cache.numel() == 0) continue;
      const int64_t num_blocks = cache.size(2);
      const int64_t block_bytes = cache.size(3) * cache.size(4) * cache.size(5) * cache.element_size();
      args.base[n] = static_cast<char*>(cache.data_ptr());
      args.block_bytes[n] = block_bytes;
      args.num_blocks[n] = num_blocks;
      args.unit[n] = copy_unit(block_bytes, {cache.data_ptr()});
      args.plane_begin[n] = static_cast<int32_t>(planes);
      planes += cache.size(0) * 2;
      TORCH_CHECK(planes <= 0x7fffffff, "specrt: copy_blocks: too many layers");
      ++n;
    }
    if (n == 0) continue;
    args.plane_begin[n] = static_cast<int32_t>(planes);
    args.num_caches = n;
    const dim3 grid(static_cast<unsigned>(P), static_cast<unsigned>(std::min<int64_t>(planes, kMaxGridY)));
    copy_blocks_kernel<<<grid, kCopyThreads, 0, stream>>>(args, mapping);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void copy_slots_cuda(const std::vector<at::Tensor>& caches, const at::Tensor& slot_mapping) {
  const int64_t P = slot_mapping.size(0);
  if (P == 0 || caches.empty()) return;
  TORCH_CHECK(P <= 0x7fffffff, "specrt: copy_slots: too many slot pairs: ", P);
  const c10::cuda::CUDAGuard guard(slot_mapping.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(slot_mapping.device().index()).stream();
  const int64_t* mapping = slot_mapping.data_ptr<int64_t>();

  for (size_t first = 0; first < caches.size(); first += kMaxCaches) {
    CopySlotsArgs args{};
    int64_t offsets[kMaxCaches] = {};
    int n = 0;
    int64_t planes = 0;
    int64_t staged_bytes = 0;
    for (size_t c = first; c < caches.size() && c < first + kMaxCaches; ++c) {
      const at::Tensor& cache = caches[c];
      TORCH_CHECK(cache.dim() == 6, "specrt: copy_slots: caches[", c,
                  "] must be [layers, 2, num_blocks, block_size, kv_heads, head_dim]");
      TORCH_CHECK(cache.device() == slot_mapping.device(), "specrt: copy_slots: caches[", c, "] is on ",
                  cache.device(), " but slot_mapping is on ", slot_mapping.device());
      if (cache.numel() == 0) continue;
      const int64_t slot_bytes = cache.size(4) * cache.size(5) * cache.element_size();
      args.base[n] = static_cast<char*>(cache.data_ptr());
      args.slot_bytes[n] = slot_bytes;
      args.num_slots[n] = cache.size(2) * cache.size(3);
      args.plane_begin[n] = static_cast<int32_t>(planes);
      offsets[n] = staged_bytes;
      staged_bytes += (cache.size(0) * 2 * P * slot_bytes + 15) / 16 * 16;  // 16-byte aligned areas
      planes += cache.size(0) * 2;
      TORCH_CHECK(planes <= 0x7fffffff, "specrt: copy_slots: too many layers");
      ++n;
    }
    if (n == 0) continue;
    args.plane_begin[n] = static_cast<int32_t>(planes);
    args.num_caches = n;
    // staging from the caching allocator: its memory stays ours until the
    // scatter launch, queued behind the gather on this stream, has run
    at::Tensor staged = at::empty({staged_bytes}, slot_mapping.options().dtype(at::kByte));
    char* staged_base = static_cast<char*>(staged.data_ptr());
    for (int c = 0; c < n; ++c) {
      args.staged[c] = staged_base + offsets[c];
      args.unit[c] = copy_unit(args.slot_bytes[c], {args.base[c], args.staged[c]});
    }
    const dim3 grid(static_cast<unsigned>(P), static_cast<unsigned>(std::min<int64_t>(planes, kMaxGridY)));
    copy_slots_kernel<true><<<grid, kCopyThreads, 0, stream>>>(args, mapping, P);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    copy_slots_kernel<false><<<grid, kCopyThreads, 0, stream>>>(args, mapping, P);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void write_kv_cuda(at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping) {
  const int64_t T = slot_mapping.size(0);
  if (T == 0 || cache.numel() == 0) return;
  TORCH_CHECK(cache.dim() == 6, "specrt: write_kv: cache must be [layers, 2, num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(layer >= 0 && layer < cache.size(0), "specrt: write_kv: layer ", layer, " out of range [0, ",
              cache.size(0), ")");
  TORCH_CHECK(T <= 0x7fffffff, "specrt: write_kv: too many tokens: ", T);
  const c10::cuda::CUDAGuard guard(cache.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(cache.device().index()).stream();
  const int64_t row_bytes = cache.size(4) * cache.size(5) * cache.element_size();
  const int unit = copy_unit(row_bytes, {cache.data_ptr(), k.data_ptr(), v.data_ptr()});
  write_kv_kernel<<<dim3(static_cast<unsigned>(T), 2), kCopyThreads, 0, stream>>>(
      static_cast<char*>(cache.data_ptr()), static_cast<const char*>(k.data_ptr()),
      static_cast<const char*>(v.data_ptr()), slot_mapping.data_ptr<int64_t>(), layer, cache.size(2), cache.size(3),
      row_bytes, unit);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

// A CPU mapping (validated on the host by the op body) goes over through
// pinned memory: an asynchronous H2D copy, no sync.
void copy_blocks_cuda_any_mapping(const std::vector<at::Tensor>& caches, const at::Tensor& block_mapping) {
  const at::Device device = caches[0].device();
  if (block_mapping.device() == device) return copy_blocks_cuda(caches, block_mapping);
  copy_blocks_cuda(caches, block_mapping.pin_memory().to(device, /*non_blocking=*/true));
}

void copy_slots_cuda_any_mapping(const std::vector<at::Tensor>& caches, const at::Tensor& slot_mapping) {
  const at::Device device = caches[0].device();
  if (slot_mapping.device() == device) return copy_slots_cuda(caches, slot_mapping);
  copy_slots_cuda(caches, slot_mapping.pin_memory().to(device, /*non_blocking=*/true));
}

}  // namespace
}  // namespace specrt

TORCH_LIBRARY_IMPL(specrt, CUDA, m) {
  m.impl("copy_blocks", [](at::TensorList caches, const at::Tensor& block_mapping, bool check) {
    specrt::copy_blocks_op(caches, block_mapping, check, &specrt::copy_blocks_cuda_any_mapping);
  });
  m.impl("copy_slots", [](at::TensorList caches, const at::Tensor& slot_mapping, bool check) {
    specrt::copy_slots_op(caches, slot_mapping, check, &specrt::copy_slots_cuda_any_mapping);
  });
  m.impl("write_kv", [](const at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& slot_mapping, bool check) {
    specrt::write_kv_op(cache, layer, k, v, slot_mapping, check, &specrt::write_kv_cuda);
  });
}
