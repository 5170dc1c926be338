// The pybind11 module specrt._C: importing it loads this library, whose static initializers
// register every torch op (csrc/sampling_ops.cpp, tree_ops.cpp, kv_ops.cpp, attention_ops.cpp,
// linear_ops.cpp, fused_ops.cpp, penalties_ops.cpp). What it binds are not tensor ops.
// pybind11 and c10's checks only, not <torch/extension.h>: this file binds no tensors.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "cpu/thread_pool.h"
#include "specrt/philox.h"

namespace py = pybind11;

namespace specrt {
void bind_layer_stack(pybind11::module_& m);   // csrc/layer_stack.cpp
void bind_suffix_index(pybind11::module_& m);  // csrc/suffix_index.cpp

namespace {

// Testing hook: the shared header's Philox4x32-10, for known-answer tests.
std::vector<int64_t> philox(std::vector<int64_t> counter, std::vector<int64_t> key) {
  TORCH_CHECK_VALUE(counter.size() == 4, "counter must have 4 words");
  TORCH_CHECK_VALUE(key.size() == 2, "key must have 2 words");
  Philox4x32 c;
  for (int i = 0; i < 4; ++i) c.v[i] = static_cast<uint32_t>(counter[i]);
  const Philox4x32 r = philox4x32_10(c, static_cast<uint32_t>(key[0]), static_cast<uint32_t>(key[1]));
  return {r.v[0], r.v[1], r.v[2], r.v[3]};
}

bool cuda_built() {
#ifdef SPECRT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace specrt

// Not tensor ops: build facts, the Philox known-answer hook, the CPU kernels' thread pool, the
// CPU layer stack and the suffix index (specrt/ops/library.py is this module's only importer).
PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  m.doc() = "specrt compiled kernels (registered as torch.ops.specrt.*); use specrt.ops, not this module";
  m.def("philox4x32_10", &specrt::philox, py::arg("counter"), py::arg("key"));
  m.def("cuda_built", &specrt::cuda_built);
  m.def("cpu_pool_stats", &specrt::cpu_pool_stats, py::arg("reset") = false);
  m.def("cpu_pool_configure", &specrt::cpu_pool_configure, py::arg("enabled") = -1, py::arg("spin_us") = -1,
        py::arg("adaptive") = -1, py::arg("threads") = -1);
  specrt::bind_layer_stack(m);
  specrt::bind_suffix_index(m);
}
