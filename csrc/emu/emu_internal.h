// csrc/emu/emu_internal.h — what the emulator's runtime files share (not for kernels): the
// limits, a CUDA thread's fiber and wait state, the launch, the process-wide state and the
// functions each file offers the others.
//
//   cuda_emu.cpp         fibers, the block scheduler, __shared__, launches, thread orders
//   emu_collectives.cpp  __syncthreads() and warp collectives: arrival, mask rules, results
//   emu_errors.cpp       error messages, device faults, the CUDA error and attribute API
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <source_location>
#include <string>
#include <vector>

#include "cuda_emu.h"

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

// Context switch: a few instructions on x86-64 (callee-saved registers and the
// stack pointer), ucontext elsewhere or with -DEMU_UCONTEXT.
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_ASM_SWITCH 1
#else
#define EMU_ASM_SWITCH 0
#endif

namespace emu::internal {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kStaticSharedLimit = 48 * 1024;     // static __shared__ per block
constexpr int kDynamicSharedDefault = 48 * 1024;     // dynamic, without cudaFuncSetAttribute
constexpr int kSharedOptinLimit = 232448;            // sm_90: 227 KiB per block

enum class Order { kForward, kReverse, kShuffle };
enum class St : uint8_t { kReady, kBlocked, kDone };

struct Thread {
  ThreadIds ids;
  int linear = 0, warp = 0, lane = 0;
  St st = St::kReady;
  // where it waits, and the collective's operands
  Op op = Op::kBarrier;
  std::source_location site;
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
  unsigned bytes = 0;
  int arg = 0;
  bool is_signed = false;
  // fiber
  char* stack = nullptr;  // usable stack [stack, stack + stack_size)
  size_t stack_size = 0;
  void* sp = nullptr;
#if !EMU_ASM_SWITCH
  ucontext_t uc;
#endif
#if EMU_ASAN
  void* fake_stack = nullptr;
#endif
};

struct SharedVar {
  const void* key;
  void* ptr;
  size_t bytes;
};

struct Launch {
  const LaunchInfo* info = nullptr;
  void (*body)(void*) = nullptr;
  void* closure = nullptr;
  int nthreads = 0;
  std::vector<Thread> threads;
  uint3 block{};
  std::string error;  // first execution error
  bool failed = false;
  std::vector<SharedVar> shared;
  size_t static_shared_bytes = 0;
  void* dynamic_shared = nullptr;
};

// Process-wide state (one launch at a time; defined in cuda_emu.cpp).
extern std::mutex g_launch_mutex;
extern Launch* g_launch;
extern Thread* g_cur;
extern Order g_order;
extern std::mt19937_64 g_rng;
extern Stats g_stats;
extern std::map<const void*, int> g_func_smem;  // cudaFuncAttributeMaxDynamicSharedMemorySize

inline Thread* lane_thread(int warp, int lane) {
  const int linear = warp * kWarp + lane;
  return linear < g_launch->nthreads ? &g_launch->threads[linear] : nullptr;
}

// cuda_emu.cpp: from a fiber back to the scheduler; returns when the scheduler resumes it.
void yield_to_scheduler(bool exiting = false);

// emu_collectives.cpp: the scheduler's side of __activemask() and of a lane's exit.
bool resolve_activemask();
void check_exit_in_collective(const Thread& me);

// emu_errors.cpp: messages, and stopping a launch.
const char* op_name(Op op);
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string short_path(const char* path);   // from the repository's csrc/ or tests/ on
std::string site_str(const std::source_location& s);
bool same_site(const std::source_location& a, const std::source_location& b);
std::string ranges(const std::vector<int>& xs);   // "0-7,9,12-31" for a set of lanes / threads
std::string who(const Thread& t);
void record_error(const std::string& what);   // the launch's first error (scheduler or fiber context)
[[noreturn]] void fail_here(const std::string& what);   // from a fiber: record and never run again
std::string describe_blocked();   // each warp's lanes, grouped by what they wait at
void set_launch_error(cudaError_t e, const std::string& text);   // what cudaGetLastError() reports

}  // namespace emu::internal
