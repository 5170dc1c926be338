// csrc/emu/cuda_emu.cpp — the runtime of the SIMT emulator (csrc/emu/cuda_emu.h,
// csrc/emu/README.md): fibers, the block scheduler, shared memory, launches and thread
// orders. Torch-free. Warp collectives and __syncthreads(): emu_collectives.cpp; error
// messages and the CUDA error API: emu_errors.cpp; what the three share: emu_internal.h.
//
// One launch at a time (a process-wide mutex); one block at a time; each CUDA
// thread of the block is a fiber that runs until it exits or blocks at
// __syncthreads() or a warp collective. Rounds: every ready thread runs once,
// in the configured order; when none is ready the scheduler resolves
// __activemask() calls, then a barrier, else reports the deadlock.
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu_internal.h"

#if EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if EMU_ASM_SWITCH
extern "C" void specrt_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.p2align 4
.globl specrt_emu_switch
.hidden specrt_emu_switch
.type specrt_emu_switch,@function
specrt_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size specrt_emu_switch, .-specrt_emu_switch
)");
#endif

namespace emu {

const ThreadIds* g_ids = nullptr;

namespace internal {

// Process-wide state (one launch at a time; emu_internal.h).
std::mutex g_launch_mutex;
Launch* g_launch = nullptr;
Thread* g_cur = nullptr;
Order g_order = Order::kForward;
std::mt19937_64 g_rng(0);
Stats g_stats{};
std::map<const void*, int> g_func_smem;  // cudaFuncAttributeMaxDynamicSharedMemorySize

namespace {

#if EMU_ASM_SWITCH
void* g_sched_sp = nullptr;
#else
ucontext_t g_sched_uc;
#endif
#if EMU_ASAN
const void* g_sched_stack_lo = nullptr;
size_t g_sched_stack_size = 0;
void* g_sched_fake = nullptr;
#endif
uint64_t g_seed = 0;
unsigned char g_poison = 0xff;

struct StackPool {
  std::vector<std::pair<char*, size_t>> stacks;  // mapping incl. guard page
  size_t size = 0;
  size_t page = 0;
  char* get(size_t i) {
    while (stacks.size() <= i) {
      const size_t total = size + page;
      void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw std::runtime_error("specrt emu: cannot map a fiber stack");
      mprotect(p, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting memory
      stacks.emplace_back(static_cast<char*>(p), total);
    }
    return stacks[i].first + page;
  }
};
StackPool g_stacks;

size_t stack_bytes() {
  static const size_t bytes = [] {
    size_t kb = EMU_ASAN ? 1024 : 256;
    if (const char* e = std::getenv("SPECRT_EMU_STACK_KB")) kb = std::max<size_t>(64, std::strtoull(e, nullptr, 10));
    return kb * 1024;
  }();
  return bytes;
}

[[noreturn]] void fiber_main();

// ---- switching --------------------------------------------------------------
void switch_to_fiber(Thread& t) {
  g_cur = &t;
  g_ids = &t.ids;
  ++g_stats.switches;
#if EMU_ASAN
  __sanitizer_start_switch_fiber(&g_sched_fake, t.stack, t.stack_size);
#endif
#if EMU_ASM_SWITCH
  specrt_emu_switch(&g_sched_sp, t.sp);
#else
  swapcontext(&g_sched_uc, &t.uc);
#endif
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(g_sched_fake, nullptr, nullptr);
#endif
  g_cur = nullptr;
  g_ids = nullptr;
}

}  // namespace

// From a fiber back to the scheduler; returns when the scheduler resumes it.
void yield_to_scheduler(bool exiting) {
  Thread& t = *g_cur;
#if EMU_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &t.fake_stack, g_sched_stack_lo, g_sched_stack_size);
#else
  (void)exiting;
#endif
#if EMU_ASM_SWITCH
  specrt_emu_switch(&t.sp, g_sched_sp);
#else
  swapcontext(&t.uc, &g_sched_uc);
#endif
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(t.fake_stack, nullptr, nullptr);
#endif
}

namespace {

void reset_fiber(Thread& t) {
#if EMU_ASM_SWITCH
  // initial frame: 6 zero registers, then fiber_main as the return address
  // (entered with rsp % 16 == 8, as after a call)
  auto* top = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(t.stack + t.stack_size) & ~uintptr_t{15});
#if EMU_ASAN
  // the last fiber's fiber_main never returned: its frame's redzones may still cover these slots
  __asan_unpoison_memory_region(top - 8, 8 * sizeof(uintptr_t));
#endif
  top[-1] = 0;
  top[-2] = reinterpret_cast<uintptr_t>(&fiber_main);
  for (int i = 3; i <= 8; ++i) top[-i] = 0;
  t.sp = top - 8;
#else
  getcontext(&t.uc);
  t.uc.uc_stack.ss_sp = t.stack;
  t.uc.uc_stack.ss_size = t.stack_size;
  t.uc.uc_link = nullptr;
  makecontext(&t.uc, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
}

[[noreturn]] void fiber_main() {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_sched_stack_lo, &g_sched_stack_size);
#endif
  try {
    g_launch->body(g_launch->closure);
  } catch (const std::exception& e) {
    record_error(who(*g_cur) + ": the kernel threw: " + e.what());
  } catch (...) {
    record_error(who(*g_cur) + ": the kernel threw");
  }
  Thread& me = *g_cur;
  me.st = St::kDone;
  check_exit_in_collective(me);
  yield_to_scheduler(true);
  std::abort();
}

// ---- the block scheduler -----------------------------------------------------
bool resolve_barrier() {
  const Thread* first = nullptr;
  for (const Thread& t : g_launch->threads) {
    if (t.st == St::kDone) continue;
    if (t.st != St::kBlocked || t.op != Op::kBarrier) return false;
    if (first == nullptr) first = &t;
  }
  if (first == nullptr) return false;
  std::vector<std::pair<std::source_location, std::vector<int>>> sites;
  for (const Thread& t : g_launch->threads) {
    if (t.st == St::kDone) continue;
    auto it = std::find_if(sites.begin(), sites.end(), [&](auto& s) { return same_site(s.first, t.site); });
    if (it == sites.end()) sites.push_back({t.site, {t.linear}});
    else it->second.push_back(t.linear);
  }
  if (sites.size() > 1) {
    std::string what = "divergent __syncthreads(): the block's live threads wait at different barriers";
    for (auto& s : sites) what += "\n  threads " + ranges(s.second) + " wait at " + site_str(s.first);
    std::vector<int> exited;
    for (const Thread& t : g_launch->threads)
      if (t.st == St::kDone) exited.push_back(t.linear);
    if (!exited.empty()) what += "\n  threads " + ranges(exited) + " have exited";
    record_error(what + fmt("\n  block (%u,%u,%u)", g_launch->block.x, g_launch->block.y, g_launch->block.z));
    return false;
  }
  ++g_stats.barriers;
  for (Thread& t : g_launch->threads)
    if (t.st == St::kBlocked) t.st = St::kReady;
  return true;
}

void free_shared() {
  for (SharedVar& v : g_launch->shared) ::operator delete(v.ptr, std::align_val_t(16));
  g_launch->shared.clear();
  g_launch->static_shared_bytes = 0;
  if (g_launch->dynamic_shared != nullptr) ::operator delete(g_launch->dynamic_shared, std::align_val_t(16));
  g_launch->dynamic_shared = nullptr;
}

void run_block(uint3 block, std::vector<int>& order) {
  Launch& L = *g_launch;
  L.block = block;
  const LaunchInfo& in = *L.info;
  if (in.smem > 0) {
    L.dynamic_shared = ::operator new(in.smem, std::align_val_t(16));
    std::memset(L.dynamic_shared, g_poison, in.smem);
  }
  for (Thread& t : L.threads) {
    t.ids.block_idx = block;
    t.st = St::kReady;
    reset_fiber(t);
  }
  ++g_stats.blocks;
  g_stats.threads += L.threads.size();
  while (true) {
    bool ran = false;
    if (g_order == Order::kShuffle) std::shuffle(order.begin(), order.end(), g_rng);
    for (int i : order) {
      Thread& t = L.threads[i];
      if (t.st != St::kReady) continue;
      switch_to_fiber(t);
      ran = true;
      if (L.failed) break;
    }
    if (L.failed) break;
    if (ran) continue;
    bool all_done = true;
    for (const Thread& t : L.threads) all_done = all_done && t.st == St::kDone;
    if (all_done) break;
    if (resolve_activemask()) continue;
    if (resolve_barrier()) continue;
    if (L.failed) break;
    bool at_barrier = false, at_collective = false;
    for (const Thread& t : L.threads) {
      if (t.st != St::kBlocked) continue;
      (t.op == Op::kBarrier ? at_barrier : at_collective) = true;
    }
    record_error(std::string(at_barrier && at_collective
                                 ? "deadlock: threads wait at __syncthreads() while lanes of a warp collective wait "
                                   "for them (or the reverse)"
                                 : "deadlock: a warp collective can never complete") +
                 fmt(" in block (%u,%u,%u)", block.x, block.y, block.z) + describe_blocked());
    break;
  }
  free_shared();
}

}  // namespace
}  // namespace internal

using namespace internal;

void* block_shared_alloc(const void* key, size_t bytes, size_t align) {
  if (g_cur == nullptr) host_use("__shared__");
  Launch& L = *g_launch;
  for (const SharedVar& v : L.shared)
    if (v.key == key) return v.ptr;
  if (align > 16) device_fault("__shared__ alignment above 16 bytes is not emulated");
  L.static_shared_bytes += (bytes + 15) / 16 * 16;
  if (L.static_shared_bytes > kStaticSharedLimit)
    device_fault("static __shared__ memory exceeds 48 KiB per block");
  if (L.static_shared_bytes + L.info->smem > static_cast<size_t>(kSharedOptinLimit))
    device_fault("static + dynamic shared memory exceeds 227 KiB per block");
  void* p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(16));
  std::memset(p, g_poison, bytes);
  L.shared.push_back({key, p, bytes});
  return p;
}

void* dynamic_shared_ptr() {
  if (g_cur == nullptr) host_use("extern __shared__");
  if (g_launch->dynamic_shared == nullptr) device_fault("extern __shared__ memory used by a launch with smem = 0");
  return g_launch->dynamic_shared;
}

void run_launch(const LaunchInfo& info, void (*body)(void*), void* closure) {
  if (g_cur != nullptr) device_fault("a kernel launch from device code (dynamic parallelism) is not emulated");
  const dim3 g = info.grid, b = info.block;
  const uint64_t nthreads = uint64_t{b.x} * b.y * b.z;
  const std::string where = fmt("launch of %s at %s:%d: ", info.kernel, short_path(info.file).c_str(), info.line);
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535)
    return set_launch_error(cudaErrorInvalidConfiguration,
                            where + fmt("invalid grid (%u,%u,%u)", g.x, g.y, g.z));
  if (nthreads == 0 || nthreads > kMaxThreads || b.x > 1024 || b.y > 1024 || b.z > 64)
    return set_launch_error(cudaErrorInvalidConfiguration,
                            where + fmt("invalid block (%u,%u,%u)", b.x, b.y, b.z));
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  int dyn_limit = kDynamicSharedDefault;
  if (auto it = g_func_smem.find(info.func); it != g_func_smem.end()) dyn_limit = it->second;
  if (info.smem > static_cast<size_t>(dyn_limit))
    return set_launch_error(cudaErrorInvalidValue,
                            where + fmt("%zu bytes of dynamic shared memory exceed the kernel's limit of %d "
                                        "(cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize))",
                                        info.smem, dyn_limit));
  Launch L;
  L.info = &info;
  L.body = body;
  L.closure = closure;
  L.nthreads = static_cast<int>(nthreads);
  L.threads.resize(nthreads);
  g_stacks.size = stack_bytes();
  g_stacks.page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (int i = 0; i < L.nthreads; ++i) {
    Thread& t = L.threads[i];
    t.linear = i;
    t.warp = i / kWarp;
    t.lane = i % kWarp;
    t.ids.thread_idx = uint3{i % b.x, (i / b.x) % b.y, i / (b.x * b.y)};
    t.ids.block_dim = b;
    t.ids.grid_dim = g;
    t.stack = g_stacks.get(i);
    t.stack_size = g_stacks.size;
  }
  g_launch = &L;
  ++g_stats.launches;
  std::vector<int> thread_order(nthreads);
  for (int i = 0; i < L.nthreads; ++i) thread_order[i] = g_order == Order::kReverse ? L.nthreads - 1 - i : i;
  const uint64_t nblocks = uint64_t{g.x} * g.y * g.z;
  std::vector<uint64_t> block_order;
  if (g_order == Order::kShuffle) {
    block_order.resize(nblocks);
    for (uint64_t i = 0; i < nblocks; ++i) block_order[i] = i;
    std::shuffle(block_order.begin(), block_order.end(), g_rng);
  }
  for (uint64_t i = 0; i < nblocks && !L.failed; ++i) {
    const uint64_t k = g_order == Order::kShuffle ? block_order[i] : g_order == Order::kReverse ? nblocks - 1 - i : i;
    run_block(uint3{static_cast<unsigned>(k % g.x), static_cast<unsigned>((k / g.x) % g.y),
                    static_cast<unsigned>(k / (uint64_t{g.x} * g.y))},
              thread_order);
  }
  g_launch = nullptr;
  if (L.failed) {
#if EMU_ASAN
    // abandoned fibers leave poisoned frames on their stacks
    for (Thread& t : L.threads) __asan_unpoison_memory_region(t.stack, t.stack_size);
#endif
    throw std::runtime_error(L.error);
  }
}

void set_order(const char* order, uint64_t seed) {
  const std::string o = order;
  if (o == "forward") g_order = Order::kForward;
  else if (o == "reverse") g_order = Order::kReverse;
  else if (o == "shuffle") g_order = Order::kShuffle;
  else throw std::invalid_argument("specrt emu: order must be forward, reverse or shuffle, got '" + o + "'");
  g_seed = seed;
  g_rng.seed(seed);
  // poison byte of fresh shared memory: NaN / -1, a large float, or random
  g_poison = g_order == Order::kForward   ? 0xff
             : g_order == Order::kReverse ? 0x7f
                                          : static_cast<unsigned char>(g_rng());
}

const char* order_name() {
  static thread_local std::string s;
  s = g_order == Order::kForward ? "forward" : g_order == Order::kReverse ? "reverse" : "shuffle";
  if (g_order == Order::kShuffle) s += " (seed " + std::to_string(g_seed) + ")";
  return s.c_str();
}

Stats stats() { return g_stats; }

namespace {
struct EnvInit {
  EnvInit() {
    const char* e = std::getenv("SPECRT_EMU_ORDER");
    if (e == nullptr || *e == 0) return;
    std::string s = e;
    uint64_t seed = 0;
    if (const size_t colon = s.find(':'); colon != std::string::npos) {
      seed = std::strtoull(s.c_str() + colon + 1, nullptr, 10);
      s = s.substr(0, colon);
    }
    set_order(s.c_str(), seed);
  }
} g_env_init;
}  // namespace

}  // namespace emu
