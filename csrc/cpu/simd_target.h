// csrc/cpu/simd_target.h — the one way a CPU kernel is compiled for an instruction set the build
// does not assume (no -m or -march flags anywhere: the kernels pick a path at run time,
// csrc/cpu/cpu_isa.h). Code between SPECRT_TARGET_BEGIN(isa) and SPECRT_TARGET_END is compiled
// for `isa`, one of the sets below (one per cpu_isa level, plus the optional extensions).
// Include every header BEFORE opening a region: shared inline code (the standard library, our own
// headers) then stays at the baseline ISA, so the linker can never keep a wider copy of it for a
// baseline caller, as per-file -m flags would allow. Per-ISA code textually included inside a
// region (avx2_lanes.h, linear_tiles.h, ...) sits in an anonymous namespace of its own.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPECRT_X86_SIMD 1

// The sets, matching cpu_isa.h's levels: kAvx2 = AVX2 + FMA + F16C; kAvx512 adds F/BW/VL/DQ.
#define SPECRT_ISA_AVX2 "avx2,fma,f16c"
#define SPECRT_ISA_AVX512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"
#define SPECRT_ISA_AVX512_BF16 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
#define SPECRT_ISA_AVX512_VNNI "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define SPECRT_ISA_AMX_BF16 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16"
// AMX needs GCC 11 / clang 12; an older compiler builds without it (cpu_features().amx_bf16 stays false)
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define SPECRT_AMX_BUILD 1
#else
#define SPECRT_AMX_BUILD 0
#endif

#define SPECRT_PRAGMA(...) _Pragma(#__VA_ARGS__)
#if defined(__clang__)
#define SPECRT_TARGET_BEGIN(isa) SPECRT_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define SPECRT_TARGET_END _Pragma("clang attribute pop")
#else
// GCC 12's intrinsic headers trip -Wmaybe-uninitialized (_mm512_undefined_*): quiet inside regions.
#define SPECRT_TARGET_BEGIN(isa)                                                             \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")     \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") _Pragma("GCC push_options") \
          SPECRT_PRAGMA(GCC target(isa))
#define SPECRT_TARGET_END _Pragma("GCC pop_options") _Pragma("GCC diagnostic pop")
#endif
#else
#define SPECRT_X86_SIMD 0
#define SPECRT_AMX_BUILD 0
#endif
