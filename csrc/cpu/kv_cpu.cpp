// CPU kernels of the KV-cache ops: copy_blocks, copy_slots and write_kv
// (docs/architecture.md section 2). All are plain byte copies; references in specrt/ops/reference.py.
// kv_ops.cpp has checked shapes and dtypes (mapping values too when check_values is set).

#include <cstring>
#include <vector>

#include "cpu/thread_pool.h"
#include "ops.h"

namespace specrt {

// Every cache is [layers, 2, num_blocks, block_size, kv_heads, head_dim]; one
// block of one (layer, k|v) plane is block_size*kv_heads*head_dim contiguous
// elements. Parallel over mapping rows (destinations are distinct, so tasks
// never write the same bytes).
void copy_blocks_cpu(const std::vector<at::Tensor>& caches, const at::Tensor& block_mapping) {
  const int64_t pairs = block_mapping.size(0);
  const int64_t* mapping = block_mapping.data_ptr<int64_t>();
  for (const at::Tensor& cache : caches) {
    const int64_t planes = cache.size(0) * 2;
    const int64_t num_blocks = cache.size(2);
    const int64_t block_bytes = cache.stride(2) * cache.element_size();
    char* base = static_cast<char*>(cache.data_ptr());
    parallel_for(0, pairs, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t src = mapping[2 * i];
        const int64_t dst = mapping[2 * i + 1];
        if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) continue;  // unchecked input: skip
        for (int64_t plane = 0; plane < planes; ++plane) {
          char* plane_base = base + plane * num_blocks * block_bytes;
          std::memcpy(plane_base + dst * block_bytes, plane_base + src * block_bytes,
                      static_cast<size_t>(block_bytes));
        }
      }
    });
  }
}

// One slot of one (layer, k|v) plane is kv_heads*head_dim contiguous elements,
// slot s at s * slot_bytes from the plane's start. Every source row of a plane
// is gathered before any destination row of it is written, so overlapping
// sources and destinations copy as the mapping says (a path's slots moved down
// onto earlier ones). Parallel over planes: each task owns its plane.
void copy_slots_cpu(const std::vector<at::Tensor>& caches, const at::Tensor& slot_mapping) {
  const int64_t pairs = slot_mapping.size(0);
  const int64_t* mapping = slot_mapping.data_ptr<int64_t>();
  for (const at::Tensor& cache : caches) {
    const int64_t planes = cache.size(0) * 2;
    const int64_t num_slots = cache.size(2) * cache.size(3);
    const int64_t slot_bytes = cache.stride(3) * cache.element_size();
    const int64_t plane_bytes = cache.stride(1) * cache.element_size();
    char* base = static_cast<char*>(cache.data_ptr());
    auto valid = [&](int64_t i) {  // unchecked input: a pair with a slot out of range is skipped
      const int64_t src = mapping[2 * i], dst = mapping[2 * i + 1];
      return src >= 0 && src < num_slots && dst >= 0 && dst < num_slots;
    };
    parallel_for(0, planes, 1, [&](int64_t lo, int64_t hi) {
      std::vector<char> staged(static_cast<size_t>(pairs * slot_bytes));
      for (int64_t plane = lo; plane < hi; ++plane) {
        char* plane_base = base + plane * plane_bytes;
        for (int64_t i = 0; i < pairs; ++i)
          if (valid(i))
            std::memcpy(staged.data() + i * slot_bytes, plane_base + mapping[2 * i] * slot_bytes,
                        static_cast<size_t>(slot_bytes));
        for (int64_t i = 0; i < pairs; ++i)
          if (valid(i))
            std::memcpy(plane_base + mapping[2 * i + 1] * slot_bytes, staged.data() + i * slot_bytes,
                        static_cast<size_t>(slot_bytes));
      }
    });
  }
}

// cache[layer, 0|1, slot / block_size, slot % block_size, :, :] = k|v[t]
void write_kv_cpu(at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slot_mapping) {
  const int64_t tokens = k.size(0);
  const int64_t token_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t plane_bytes = cache.stride(1) * cache.element_size();
  const int64_t slot_bytes = cache.stride(3) * cache.element_size();
  char* layer_base = static_cast<char*>(cache.data_ptr()) + layer * cache.stride(0) * cache.element_size();
  const char* k_ptr = static_cast<const char*>(k.data_ptr());
  const char* v_ptr = static_cast<const char*>(v.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = cache.size(2) * cache.size(3);
  parallel_for(0, tokens, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= num_slots) continue;  // padding, or an unchecked bad slot: skip
      // slot * slot_bytes == (slot / block_size) * block stride + (slot % block_size) * slot stride
      std::memcpy(layer_base + slot * slot_bytes, k_ptr + t * token_bytes, static_cast<size_t>(token_bytes));
      std::memcpy(layer_base + plane_bytes + slot * slot_bytes, v_ptr + t * token_bytes,
                  static_cast<size_t>(token_bytes));
    }
  });
}

}  // namespace specrt
