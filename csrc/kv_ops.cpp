// specrt's KV cache ops — copy_blocks, copy_slots, write_kv: schemas, op bodies and the CPU
// registrations (the CUDA registrations live in csrc/cuda/kv_cuda.cu, the CPU kernels in
// csrc/cpu/kv_cpu.cpp).
//
// Shapes, dtypes and devices are always checked, with the argument named; mapping values
// (ranges, duplicate destinations) when check_values is set, and always for a block or slot
// mapping on the host with the caches on a device (reading it costs no sync). The mutating ops
// keep autograd's default fallback, which tracks versions.
#include <torch/library.h>

#include <set>
#include <string>

#include "checks.h"
#include "ops.h"

namespace specrt {

void copy_blocks_op(at::TensorList caches, const at::Tensor& block_mapping, bool check_values,
                    CopyBlocksKernel kernel) {
  TORCH_CHECK_VALUE(!caches.empty(), "caches must be a non-empty list of cache tensors");
  TORCH_CHECK_VALUE(caches.size() <= 8, "caches: at most 8 caches per call, got ", caches.size());
  const at::Device device = caches[0].device();
  for (size_t c = 0; c < caches.size(); ++c) check_cache(caches[c], "caches[" + std::to_string(c) + "]", device);
  TORCH_CHECK_VALUE(block_mapping.defined(), "block_mapping must be a tensor, got None");
  TORCH_CHECK_TYPE(block_mapping.scalar_type() == at::kLong, "block_mapping must have dtype int64, got ",
                   c10::toString(block_mapping.scalar_type()));
  TORCH_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
                    "block_mapping must be [P, 2] (src, dst) pairs, got shape ", shape_str(block_mapping));
  TORCH_CHECK_VALUE(block_mapping.is_cpu() || block_mapping.device() == device,
                    "block_mapping must be on the CPU or on the caches' device ", device.str(), ", got ",
                    block_mapping.device().str());
  TORCH_CHECK_VALUE(block_mapping.is_contiguous(), "block_mapping must be contiguous");
  if (block_mapping.size(0) == 0) return;
  if (check_values || block_mapping.device() != device) {
    const at::Tensor h = host(block_mapping);
    const int64_t* m = h.data_ptr<int64_t>();
    std::set<int64_t> dsts, srcs;
    for (int64_t i = 0; i < h.size(0); ++i) {
      for (size_t c = 0; c < caches.size(); ++c) {
        const int64_t nb = caches[c].size(2);
        TORCH_CHECK_VALUE(m[2 * i] >= 0 && m[2 * i] < nb && m[2 * i + 1] >= 0 && m[2 * i + 1] < nb,
                          "block_mapping[", i, "] = (", m[2 * i], ", ", m[2 * i + 1], ") is out of range for caches[",
                          c, "] with ", nb, " blocks");
      }
      TORCH_CHECK_VALUE(dsts.insert(m[2 * i + 1]).second, "block_mapping has duplicate destination block ",
                        m[2 * i + 1]);
      srcs.insert(m[2 * i]);
    }
    for (int64_t d : dsts)
      TORCH_CHECK_VALUE(!srcs.count(d), "block_mapping: block ", d,
                        " is both a source and a destination (the copy order would matter)");
  }
  kernel(caches.vec(), block_mapping);
}

void copy_slots_op(at::TensorList caches, const at::Tensor& slot_mapping, bool check_values, CopySlotsKernel kernel) {
  TORCH_CHECK_VALUE(!caches.empty(), "caches must be a non-empty list of cache tensors");
  TORCH_CHECK_VALUE(caches.size() <= 8, "caches: at most 8 caches per call, got ", caches.size());
  const at::Device device = caches[0].device();
  for (size_t c = 0; c < caches.size(); ++c) check_cache(caches[c], "caches[" + std::to_string(c) + "]", device);
  TORCH_CHECK_VALUE(slot_mapping.defined(), "slot_mapping must be a tensor, got None");
  TORCH_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong, "slot_mapping must have dtype int64, got ",
                   c10::toString(slot_mapping.scalar_type()));
  TORCH_CHECK_VALUE(slot_mapping.dim() == 2 && slot_mapping.size(1) == 2,
                    "slot_mapping must be [P, 2] (src, dst) slot pairs, got shape ", shape_str(slot_mapping));
  TORCH_CHECK_VALUE(slot_mapping.is_cpu() || slot_mapping.device() == device,
                    "slot_mapping must be on the CPU or on the caches' device ", device.str(), ", got ",
                    slot_mapping.device().str());
  TORCH_CHECK_VALUE(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  if (slot_mapping.size(0) == 0) return;
  if (check_values || slot_mapping.device() != device) {
    const at::Tensor h = host(slot_mapping);
    const int64_t* m = h.data_ptr<int64_t>();
    std::set<int64_t> dsts;
    for (int64_t i = 0; i < h.size(0); ++i) {
      for (size_t c = 0; c < caches.size(); ++c) {
        const int64_t num_slots = caches[c].size(2) * caches[c].size(3);
        TORCH_CHECK_VALUE(m[2 * i] >= 0 && m[2 * i] < num_slots && m[2 * i + 1] >= 0 && m[2 * i + 1] < num_slots,
                          "slot_mapping[", i, "] = (", m[2 * i], ", ", m[2 * i + 1], ") is out of range for caches[",
                          c, "] with ", num_slots, " slots");
      }
      TORCH_CHECK_VALUE(dsts.insert(m[2 * i + 1]).second, "slot_mapping has duplicate destination slot ",
                        m[2 * i + 1]);
    }
  }
  kernel(caches.vec(), slot_mapping);
}

void write_kv_op(const at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& slot_mapping, bool check_values, WriteKvKernel kernel) {
  TORCH_CHECK_VALUE(cache.defined(), "cache must be a tensor, got None");
  const at::Device device = cache.device();
  check_cache(cache, "cache", device);
  TORCH_CHECK_VALUE(layer >= 0 && layer < cache.size(0), "layer = ", layer, " is out of range for cache with ",
                    cache.size(0), " layers");
  check_tensor(k, "k", cache.scalar_type(), 3, device);
  check_tensor(v, "v", cache.scalar_type(), 3, device);
  const int64_t tokens = k.size(0);
  TORCH_CHECK_VALUE(k.size(1) == cache.size(4) && k.size(2) == cache.size(5), "k must be [T, kv_heads=",
                    cache.size(4), ", head_dim=", cache.size(5), "], got shape ", shape_str(k));
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "v must have the shape of k ", shape_str(k), ", got ", shape_str(v));
  check_tensor(slot_mapping, "slot_mapping", at::kLong, 1, device);
  check_size(slot_mapping, "slot_mapping", 0, tokens, "T = k.shape[0]");
  if (tokens == 0) return;
  if (check_values) {
    const at::Tensor h = host(slot_mapping);
    const int64_t num_slots = cache.size(2) * cache.size(3);
    std::set<int64_t> seen;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t s = h.data_ptr<int64_t>()[t];
      TORCH_CHECK_VALUE(s >= -1 && s < num_slots, "slot_mapping[", t, "] = ", s, " is out of range [-1, ", num_slots,
                        ")");
      TORCH_CHECK_VALUE(s < 0 || seen.insert(s).second, "slot_mapping has duplicate slot ", s);
    }
  }
  at::Tensor out = cache;
  kernel(out, layer, k, v, slot_mapping);
}

}  // namespace specrt

// Schemas: one per op; mutated arguments are marked (a!). specrt/ops/ holds
// the documented Python wrappers and the fake (meta) kernels.
TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def("copy_blocks(Tensor(a!)[] caches, Tensor block_mapping, bool check_values=True) -> ()");
  m.def("copy_slots(Tensor(a!)[] caches, Tensor slot_mapping, bool check_values=True) -> ()");
  m.def("write_kv(Tensor(a!) cache, int layer, Tensor k, Tensor v, Tensor slot_mapping, "
        "bool check_values=True) -> ()");
}

TORCH_LIBRARY_IMPL(specrt, CPU, m) {
  using at::Tensor;
  m.impl("copy_blocks", [](at::TensorList caches, const Tensor& block_mapping, bool check) {
    specrt::copy_blocks_op(caches, block_mapping, check, &specrt::copy_blocks_cpu);
  });
  m.impl("copy_slots", [](at::TensorList caches, const Tensor& slot_mapping, bool check) {
    specrt::copy_slots_op(caches, slot_mapping, check, &specrt::copy_slots_cpu);
  });
  m.impl("write_kv", [](const Tensor& cache, int64_t layer, const Tensor& k, const Tensor& v,
                        const Tensor& slot_mapping, bool check) {
    specrt::write_kv_op(cache, layer, k, v, slot_mapping, check, &specrt::write_kv_cpu);
  });
}
