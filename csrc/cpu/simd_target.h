// csrc/cpu/simd_target.h — open and close a region of code compiled for an
// instruction set the build does not assume (no -march flags: the kernels pick
// a path at run time, csrc/cpu/cpu_isa.h). Include every header BEFORE opening
// a region, so that no shared inline function is compiled for the wider ISA.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPECRT_X86_SIMD 1
#if defined(__clang__)
#define SPECRT_TARGET_AVX2_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2\"))), apply_to = function)")
#define SPECRT_TARGET_AVX512_BEGIN                                                                       \
  _Pragma(                                                                                               \
      "clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq\"))), " \
      "apply_to = function)")
#define SPECRT_TARGET_END _Pragma("clang attribute pop")
#else
// GCC 12's intrinsic headers trip -Wmaybe-uninitialized (_mm512_undefined_*).
#define SPECRT_GCC_QUIET \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define SPECRT_TARGET_AVX2_BEGIN \
  SPECRT_GCC_QUIET _Pragma("GCC push_options") _Pragma("GCC target(\"avx2\")")
#define SPECRT_TARGET_AVX512_BEGIN \
  SPECRT_GCC_QUIET _Pragma("GCC push_options")  \
      _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq\")")
#define SPECRT_TARGET_END _Pragma("GCC pop_options") _Pragma("GCC diagnostic pop")
#endif
#else
#define SPECRT_X86_SIMD 0
#endif
