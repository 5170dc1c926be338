// csrc/emu/cuda_emu.h — a small SIMT emulator: CUDA C++ kernels compiled by the
// host compiler and run on the CPU, for tests (csrc/emu/README.md).
//
// How: every CUDA thread is a fiber, blocks run one after another, and the
// threads of a block are switched only at __syncthreads() and at warp
// collectives. A barrier is released only when every live thread of the block
// waits at the same call site; a warp collective completes only when every
// lane of its mask has arrived at the same call site with the same mask.
// Anything else (a divergent barrier, a shuffle over an exited lane, a lane
// outside its own mask, a deadlock) stops the launch with an error naming the
// kernel, block, lanes and source lines. Threads and blocks run in forward,
// reversed or shuffled order (emu::set_order / SPECRT_EMU_ORDER), so results
// that depend on the order of unsynchronised accesses change between runs.
//
// What is not here does not compile (no silent host fallback): only the
// built-ins below exist. Device math that cannot be reproduced bit for bit on
// a CPU (expf, logf, __expf, ...) is rejected by csrc/emu/cu2cpp.py before
// compiling. `kernel<<<grid, block, smem, stream>>>(args)` and `__shared__`
// declarations are rewritten by cu2cpp.py into emu::launch / emu::block_shared.
//
// This header is torch-free; csrc/emu/torch_prelude.h adds the torch side.
#pragma once

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------
// Qualifiers
// ---------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// __restrict__ is a GCC keyword. __constant__ memory is not emulated:
#define __constant__ static_assert(::emu::kUnsupported<0>, "specrt emu: __constant__ memory is not emulated");

// ---------------------------------------------------------------------------
// Vector types (same sizes and alignment as CUDA's)
// ---------------------------------------------------------------------------
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
};
struct uint3 { unsigned int x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) int2 { int x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }

constexpr int warpSize = 32;
struct CUstream_st;  // cudaStream_t points to it

namespace emu {

template <int>
constexpr bool kUnsupported = false;

// ---------------------------------------------------------------------------
// Runtime (csrc/emu/cuda_emu.cpp, emu_collectives.cpp, emu_errors.cpp)
// ---------------------------------------------------------------------------
struct ThreadIds {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
extern const ThreadIds* g_ids;  // the running CUDA thread, or null on the host
[[noreturn]] void host_use(const char* what);
inline const ThreadIds& ids(const char* what) {
  if (g_ids == nullptr) host_use(what);
  return *g_ids;
}

enum class Op : uint8_t {
  kBarrier, kActiveMask, kSyncWarp, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll,
  kMatchAny, kMatchAll, kReduceAdd, kReduceMin, kReduceMax, kReduceAnd, kReduceOr, kReduceXor,
};

// The calling lane arrives at a warp collective (value: the bits of the
// operand, `bytes` wide); returns the bits of its result.
uint64_t warp_collective(Op op, unsigned mask, uint64_t value, unsigned bytes, int arg, int width, bool is_signed,
                         const std::source_location& where);
void syncthreads(const std::source_location& where);
// Per-block __shared__ storage (poisoned; one per declaration `key`) and the
// launch's dynamic shared memory.
void* block_shared_alloc(const void* key, size_t bytes, size_t align);
void* dynamic_shared_ptr();
// Device-side fault: stops the launch with `what`.
[[noreturn]] void device_fault(const char* what);

struct LaunchInfo {
  const void* func;
  const char* kernel;  // source text of the kernel expression
  const char* file;
  int line;
  dim3 grid, block;
  size_t smem;
};
// Runs body(closure) for every thread of every block. Configuration errors
// set cudaGetLastError() (as CUDA does); execution errors throw std::runtime_error.
void run_launch(const LaunchInfo& info, void (*body)(void*), void* closure);

// Thread / block order: "forward", "reverse" or "shuffle" (seeded).
void set_order(const char* order, uint64_t seed);
const char* order_name();
struct Stats {
  uint64_t launches, blocks, threads, switches, barriers, collectives;
};
Stats stats();

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "specrt emu: warp operand must be <= 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
inline T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

template <class T>
T& block_shared(const void* key) {
  return *static_cast<T*>(block_shared_alloc(key, sizeof(T), alignof(T)));
}
template <class T>
T* dynamic_shared() {
  return static_cast<T*>(dynamic_shared_ptr());
}

// Kernel launch: emu::launch(kernel, "kernel", __FILE__, __LINE__, grid, block[, smem[, stream]])(args...)
template <class T>
T implicit_arg(std::type_identity_t<T> v) {  // converts like a call does
  return v;
}
template <class... P>
struct Launcher {
  void (*kernel)(P...);
  LaunchInfo info;
  template <class... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "specrt emu: kernel launched with the wrong number of arguments");
    std::tuple<std::decay_t<P>...> params(implicit_arg<std::decay_t<P>>(std::forward<A>(args))...);
    auto body = [&] { std::apply(kernel, params); };  // each thread gets its own copy of the parameters
    using Body = decltype(body);
    run_launch(info, [](void* c) { (*static_cast<Body*>(c))(); }, &body);
  }
};
template <class... P>
Launcher<P...> launch(void (*kernel)(P...), const char* text, const char* file, int line, dim3 grid, dim3 block,
                      size_t smem = 0, ::CUstream_st* = nullptr) {
  return Launcher<P...>{kernel, LaunchInfo{reinterpret_cast<const void*>(kernel), text, file, line, grid, block, smem}};
}

}  // namespace emu

// ---------------------------------------------------------------------------
// Built-in variables
// ---------------------------------------------------------------------------
#define threadIdx (::emu::ids("threadIdx").thread_idx)
#define blockIdx (::emu::ids("blockIdx").block_idx)
#define blockDim (::emu::ids("blockDim").block_dim)
#define gridDim (::emu::ids("gridDim").grid_dim)

// ---------------------------------------------------------------------------
// Synchronisation and warp collectives (width must be 32)
// ---------------------------------------------------------------------------
#define EMU_HERE std::source_location where = std::source_location::current()
inline void __syncthreads(EMU_HERE) { emu::syncthreads(where); }
inline void __syncwarp(unsigned mask = 0xffffffffu, EMU_HERE) {
  emu::warp_collective(emu::Op::kSyncWarp, mask, 0, 0, 0, 32, false, where);
}
inline unsigned __activemask(EMU_HERE) {
  return static_cast<unsigned>(emu::warp_collective(emu::Op::kActiveMask, 0xffffffffu, 0, 0, 0, 32, false, where));
}
#define EMU_SHFL(name, op)                                                                                    \
  template <class T>                                                                                          \
  T name(unsigned mask, T var, int arg, int width = 32, EMU_HERE) {                                          \
    static_assert(std::is_arithmetic_v<T>, "specrt emu: " #name " of a non-arithmetic type");                 \
    return emu::from_bits<T>(emu::warp_collective(emu::Op::op, mask, emu::to_bits(var), sizeof(T), arg, width, \
                                                  false, where));                                             \
  }
EMU_SHFL(__shfl_sync, kShflIdx)
EMU_SHFL(__shfl_up_sync, kShflUp)
EMU_SHFL(__shfl_down_sync, kShflDown)
EMU_SHFL(__shfl_xor_sync, kShflXor)
#undef EMU_SHFL
inline unsigned __ballot_sync(unsigned mask, int pred, EMU_HERE) {
  return static_cast<unsigned>(emu::warp_collective(emu::Op::kBallot, mask, pred != 0, 4, 0, 32, false, where));
}
inline int __any_sync(unsigned mask, int pred, EMU_HERE) {
  return static_cast<int>(emu::warp_collective(emu::Op::kAny, mask, pred != 0, 4, 0, 32, false, where));
}
inline int __all_sync(unsigned mask, int pred, EMU_HERE) {
  return static_cast<int>(emu::warp_collective(emu::Op::kAll, mask, pred != 0, 4, 0, 32, false, where));
}
template <class T>
unsigned __match_any_sync(unsigned mask, T value, EMU_HERE) {
  static_assert(std::is_arithmetic_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "specrt emu: __match_any_sync type");
  return static_cast<unsigned>(
      emu::warp_collective(emu::Op::kMatchAny, mask, emu::to_bits(value), sizeof(T), 0, 32, false, where));
}
template <class T>
unsigned __match_all_sync(unsigned mask, T value, int* pred, EMU_HERE) {
  static_assert(std::is_arithmetic_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "specrt emu: __match_all_sync type");
  const uint64_t r =
      emu::warp_collective(emu::Op::kMatchAll, mask, emu::to_bits(value), sizeof(T), 0, 32, false, where);
  *pred = static_cast<int>(r >> 32);
  return static_cast<unsigned>(r);
}
#define EMU_REDUCE(name, op)                                                                                       \
  inline unsigned name(unsigned mask, unsigned value, EMU_HERE) {                                                  \
    return static_cast<unsigned>(emu::warp_collective(emu::Op::op, mask, value, 4, 0, 32, false, where));          \
  }                                                                                                                \
  inline int name(unsigned mask, int value, EMU_HERE) {                                                            \
    return static_cast<int>(                                                                                       \
        emu::warp_collective(emu::Op::op, mask, static_cast<unsigned>(value), 4, 0, 32, true, where));             \
  }
EMU_REDUCE(__reduce_add_sync, kReduceAdd)
EMU_REDUCE(__reduce_min_sync, kReduceMin)
EMU_REDUCE(__reduce_max_sync, kReduceMax)
EMU_REDUCE(__reduce_and_sync, kReduceAnd)
EMU_REDUCE(__reduce_or_sync, kReduceOr)
EMU_REDUCE(__reduce_xor_sync, kReduceXor)
#undef EMU_REDUCE
#undef EMU_HERE

// ---------------------------------------------------------------------------
// Atomics. Fibers of one launch run on one OS thread and switch only at
// barriers and collectives, so plain read-modify-writes are atomic here.
// ---------------------------------------------------------------------------
#define EMU_ATOMIC_RMW(name, expr)                                                              \
  template <class T>                                                                            \
    requires(std::is_same_v<T, int> || std::is_same_v<T, unsigned int> ||                       \
             std::is_same_v<T, unsigned long long> || std::is_same_v<T, float> ||               \
             std::is_same_v<T, double>)                                                         \
  T name(T* address, std::type_identity_t<T> val) {                                             \
    const T old = *address;                                                                     \
    *address = (expr);                                                                          \
    return old;                                                                                 \
  }
EMU_ATOMIC_RMW(atomicAdd, old + val)
EMU_ATOMIC_RMW(atomicSub, old - val)
EMU_ATOMIC_RMW(atomicExch, val)
EMU_ATOMIC_RMW(atomicMax, old < val ? val : old)
EMU_ATOMIC_RMW(atomicMin, val < old ? val : old)
#undef EMU_ATOMIC_RMW
#define EMU_ATOMIC_BITS(name, expr)                                                                              \
  template <class T>                                                                                             \
    requires(std::is_same_v<T, int> || std::is_same_v<T, unsigned int> || std::is_same_v<T, unsigned long long>) \
  T name(T* address, std::type_identity_t<T> val) {                                                              \
    const T old = *address;                                                                                      \
    *address = (expr);                                                                                           \
    return old;                                                                                                  \
  }
EMU_ATOMIC_BITS(atomicAnd, old & val)
EMU_ATOMIC_BITS(atomicOr, old | val)
EMU_ATOMIC_BITS(atomicXor, old ^ val)
#undef EMU_ATOMIC_BITS
template <class T>
  requires(std::is_same_v<T, int> || std::is_same_v<T, unsigned int> || std::is_same_v<T, unsigned long long>)
T atomicCAS(T* address, std::type_identity_t<T> compare, std::type_identity_t<T> val) {
  const T old = *address;
  if (old == compare) *address = val;
  return old;
}

// ---------------------------------------------------------------------------
// Exact intrinsics and math (the same bits as on the device; inexact device
// math is rejected by cu2cpp.py)
// ---------------------------------------------------------------------------
template <class T>
T __ldg(const T* p) {
  return *p;
}
inline float __int_as_float(int x) { return emu::from_bits<float>(static_cast<uint32_t>(x)); }
inline int __float_as_int(float x) { return static_cast<int>(emu::to_bits(x)); }
inline float __uint_as_float(unsigned x) { return emu::from_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return static_cast<unsigned>(emu::to_bits(x)); }
inline double __longlong_as_double(long long x) { return emu::from_bits<double>(static_cast<uint64_t>(x)); }
inline long long __double_as_longlong(double x) { return static_cast<long long>(emu::to_bits(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

// CUDA's integer / float min and max in the global namespace.
template <class A, class B>
  requires(std::is_integral_v<A> && std::is_integral_v<B>)
constexpr std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
template <class A, class B>
  requires(std::is_integral_v<A> && std::is_integral_v<B>)
constexpr std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }

// ---------------------------------------------------------------------------
// Runtime API subset (the launchers' host side)
// ---------------------------------------------------------------------------
typedef struct CUstream_st* cudaStream_t;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
const char* cudaGetErrorName(cudaError_t error);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
namespace emu {
cudaError_t set_func_attribute(const void* func, cudaFuncAttribute attr, int value);
}
template <class... P>
cudaError_t cudaFuncSetAttribute(void (*func)(P...), cudaFuncAttribute attr, int value) {
  return emu::set_func_attribute(reinterpret_cast<const void*>(func), attr, value);
}
