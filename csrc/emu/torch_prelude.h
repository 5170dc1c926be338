// csrc/emu/torch_prelude.h — force-included (g++ -include) before each of the
// project's .cu files when they are built for the SIMT emulator (csrc/emu/README.md).
//
// 1. The torch headers the launchers use, parsed before any CUDA macro exists.
// 2. TORCH_LIBRARY_IMPL(specrt, CUDA, m) registers into SPECRT_EMU_NAMESPACE
//    (e.g. specrt_emu) for the CPU dispatch key: the unchanged launchers then
//    serve torch.ops.specrt_emu.* on CPU tensors, which play the device's
//    memory. TORCH_LIBRARY_FRAGMENT goes to the same namespace. Any other
//    registration in a .cu file does not compile.
// 3. The emulator's CUDA built-ins (cuda_emu.h), then __CUDACC__ / __CUDA_ARCH__
//    so shared headers take their device branches, as nvcc's device pass does.
// The c10/cuda headers the .cu files include resolve to csrc/emu/stubs/.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#ifndef SPECRT_EMU_NAMESPACE
#error "build with -DSPECRT_EMU_NAMESPACE=<op namespace>, e.g. specrt_emu"
#endif

namespace emu {
constexpr bool same_name(const char* a, const char* b) {
  while (*a != 0 && *a == *b) ++a, ++b;
  return *a == *b;
}
}  // namespace emu

#undef TORCH_LIBRARY_IMPL
#define TORCH_LIBRARY_IMPL(ns, k, m) EMU_TORCH_LIBRARY_IMPL_##k(ns, m)
#define EMU_TORCH_LIBRARY_IMPL_CUDA(ns, m)                                                              \
  static_assert(::emu::same_name(#ns, "specrt"), "specrt emu: only the specrt namespace is rerouted"); \
  _TORCH_LIBRARY_IMPL(SPECRT_EMU_NAMESPACE, CPU, m, C10_UID)
#undef TORCH_LIBRARY_FRAGMENT
#define TORCH_LIBRARY_FRAGMENT(ns, m) _TORCH_LIBRARY_FRAGMENT(SPECRT_EMU_NAMESPACE, m, C10_UID)
#undef TORCH_LIBRARY
#define TORCH_LIBRARY(ns, m) \
  static_assert(::emu::kUnsupported<0>, "specrt emu: TORCH_LIBRARY in a .cu file: use TORCH_LIBRARY_FRAGMENT")

#include "cuda_emu.h"

#define __CUDACC__ 1
#define __CUDA_ARCH__ 900
