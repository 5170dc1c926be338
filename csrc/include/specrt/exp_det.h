// specrt/exp_det.h — the softmax's exp, shared by the CPU kernel (csrc/cpu/probs.h
// and its vector twin exp_det_v in csrc/cpu/probs_simd.h) and the CUDA kernel
// (csrc/cuda/sampling_cuda.cu), so probs_from_logits returns the same bits on
// both: plain float operations in a fixed order (no FMA: gcc -ffp-contract=off,
// nvcc --fmad=false), no libm and no device expf (whose results differ from
// the CPU's by up to 2 ulp).
#pragma once

#include <cstdint>

#include "specrt/common.h"

namespace specrt {

// exp(y) for y <= 0 (Cephes expf: Cody-Waite reduction by ln 2, degree-6
// polynomial, within ~1 ulp); y < -104, -inf and NaN give 0. The scale 2^n
// (n >= -150) is applied as 2^floor(n/2) * 2^(n - floor(n/2)): two normal
// factors, so the product rounds once, also into the subnormal range.
SPECRT_HOST_DEVICE float exp_det(float y) {
  if (!(y >= -104.0f)) return 0.0f;
  const float n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (y - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  const int32_t k = static_cast<int32_t>(n);
  const int32_t k1 = k >> 1;  // floor(k / 2)
  const float s1 = uint_as_float(static_cast<uint32_t>(k1 + 127) << 23);
  const float s2 = uint_as_float(static_cast<uint32_t>(k - k1 + 127) << 23);
  return (p * s1) * s2;
}

}  // namespace specrt
