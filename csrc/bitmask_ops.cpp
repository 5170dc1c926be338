// specrt::apply_token_bitmask — schema, argument checks and the CPU registration
// (the CUDA registration lives in csrc/cuda/bitmask_cuda.cu).
//
// Every check names the argument. Shapes, dtypes, devices and contiguity are
// always checked; the row indices when check_values is set (specrt/ops/ sets it
// for CPU tensors and, in debug mode, for CUDA tensors: a device->host sync).
#include <torch/library.h>

#include "bitmask_ops.h"
#include "checks.h"

namespace specrt {

BitmaskArgs check_apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows,
                                      bool check_values) {
  TORCH_CHECK_VALUE(logits.defined(), "logits must be a tensor, got None");
  const at::Device device = logits.device();
  const at::ScalarType dt = logits.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kDouble,
                   "logits must be float32, bfloat16, float16 or float64, got ", dt);
  check_tensor(logits, "logits", dt, 2, device);
  const int64_t R = logits.size(0), V = logits.size(1);
  check_tensor(bitmask, "bitmask", at::kInt, 2, device);
  const int64_t n = bitmask.size(0);
  TORCH_CHECK_VALUE(bitmask.size(1) >= (V + 31) / 32, "bitmask must have at least ceil(V / 32) = ", (V + 31) / 32,
                    " int32 words per row for the logits' V = ", V, " tokens, got shape ", shape_str(bitmask));
  check_int_arg(rows, "rows", 1, device);
  check_size(rows, "rows", 0, n, "rows of bitmask");
  if (check_values) {
    const at::Tensor r = wide_host(rows);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = r.data_ptr<int64_t>()[i];
      TORCH_CHECK_VALUE(v >= 0 && v < R, "rows[", i, "] = ", v, " must be in [0, R=", R, ") (rows of logits)");
    }
  }
  return BitmaskArgs{logits, bitmask, saturate_int32(rows)};
}

}  // namespace specrt

TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows, bool check_values=True) -> ()");
}

TORCH_LIBRARY_IMPL(specrt, CPU, m) {
  m.impl("apply_token_bitmask", &specrt::apply_token_bitmask_op<specrt::apply_token_bitmask_cpu>);
}
