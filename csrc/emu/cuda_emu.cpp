// csrc/emu/cuda_emu.cpp — the runtime of the SIMT emulator (csrc/emu/cuda_emu.h,
// csrc/emu/README.md): fibers, the block scheduler, barriers, warp collectives,
// shared memory and launch checks. Torch-free.
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
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emu.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

// Context switch: a few instructions on x86-64 (callee-saved registers and the
// stack pointer), ucontext elsewhere or with -DEMU_UCONTEXT.
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_ASM_SWITCH 1
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
#else
#define EMU_ASM_SWITCH 0
#endif

namespace emu {

const ThreadIds* g_ids = nullptr;

namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kStaticSharedLimit = 48 * 1024;     // static __shared__ per block
constexpr int kDynamicSharedDefault = 48 * 1024;     // dynamic, without cudaFuncSetAttribute
constexpr int kSharedOptinLimit = 232448;            // sm_90: 227 KiB per block

enum class Order { kForward, kReverse, kShuffle };
enum class St : uint8_t { kReady, kBlocked, kDone };

const char* op_name(Op op) {
  switch (op) {
    case Op::kBarrier: return "__syncthreads";
    case Op::kActiveMask: return "__activemask";
    case Op::kSyncWarp: return "__syncwarp";
    case Op::kShflIdx: return "__shfl_sync";
    case Op::kShflUp: return "__shfl_up_sync";
    case Op::kShflDown: return "__shfl_down_sync";
    case Op::kShflXor: return "__shfl_xor_sync";
    case Op::kBallot: return "__ballot_sync";
    case Op::kAny: return "__any_sync";
    case Op::kAll: return "__all_sync";
    case Op::kMatchAny: return "__match_any_sync";
    case Op::kMatchAll: return "__match_all_sync";
    case Op::kReduceAdd: return "__reduce_add_sync";
    case Op::kReduceMin: return "__reduce_min_sync";
    case Op::kReduceMax: return "__reduce_max_sync";
    case Op::kReduceAnd: return "__reduce_and_sync";
    case Op::kReduceOr: return "__reduce_or_sync";
    case Op::kReduceXor: return "__reduce_xor_sync";
  }
  return "?";
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof(buf), f, ap);
  va_end(ap);
  return buf;
}

// A path from the repository's csrc/ or tests/ on.
std::string short_path(const char* path) {
  const std::string file = path;
  for (const char* dir : {"/csrc/", "/tests/"})
    if (const size_t cut = file.rfind(dir); cut != std::string::npos) return file.substr(cut + 1);
  return file;
}

std::string site_str(const std::source_location& s) {
  return fmt("%s:%u:%u", short_path(s.file_name()).c_str(), static_cast<unsigned>(s.line()),
             static_cast<unsigned>(s.column()));
}

bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

// "0-7,9,12-31" for a set of lanes / threads.
std::string ranges(const std::vector<int>& xs) {
  std::string out;
  for (size_t i = 0; i < xs.size();) {
    size_t j = i;
    while (j + 1 < xs.size() && xs[j + 1] == xs[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? std::to_string(xs[i]) : std::to_string(xs[i]) + "-" + std::to_string(xs[j]);
    i = j + 1;
  }
  return out;
}

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

// Process-wide state (one launch at a time).
std::mutex g_launch_mutex;
Launch* g_launch = nullptr;
Thread* g_cur = nullptr;
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
Order g_order = Order::kForward;
std::mt19937_64 g_rng(0);
uint64_t g_seed = 0;
Stats g_stats{};
thread_local cudaError_t g_last_error = cudaSuccess;
thread_local std::string g_last_error_text;
thread_local cudaError_t g_last_error_text_code = cudaSuccess;
std::map<const void*, int> g_func_smem;  // cudaFuncAttributeMaxDynamicSharedMemorySize
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

// From a fiber back to the scheduler; returns when the scheduler resumes it.
void yield_to_scheduler(bool exiting = false) {
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

void reset_fiber(Thread& t) {
#if EMU_ASM_SWITCH
  // initial frame: 6 zero registers, then fiber_main as the return address
  // (entered with rsp % 16 == 8, as after a call)
  auto* top = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(t.stack + t.stack_size) & ~uintptr_t{15});
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

// ---- errors -----------------------------------------------------------------
std::string who(const Thread& t) {
  const ThreadIds& i = t.ids;
  return fmt("block (%u,%u,%u) thread (%u,%u,%u) [warp %d lane %d]", i.block_idx.x, i.block_idx.y, i.block_idx.z,
             i.thread_idx.x, i.thread_idx.y, i.thread_idx.z, t.warp, t.lane);
}

std::string kernel_str() {
  const LaunchInfo& in = *g_launch->info;
  return fmt("kernel %s launched at %s:%d with grid (%u,%u,%u) block (%u,%u,%u)", in.kernel,
             short_path(in.file).c_str(), in.line,
             in.grid.x, in.grid.y, in.grid.z, in.block.x, in.block.y, in.block.z);
}

// Records the launch's first error (scheduler or fiber context).
void record_error(const std::string& what) {
  if (g_launch->failed) return;
  g_launch->failed = true;
  g_launch->error = "specrt emu: " + what + "\n  in " + kernel_str() + "\n  order: " + order_name();
}

// From a fiber: record and never run again.
[[noreturn]] void fail_here(const std::string& what) {
  record_error(what);
  g_cur->st = St::kDone;
  yield_to_scheduler(true);
  std::abort();  // never resumed
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
  // A lane that exits while lanes of its warp wait for it at a collective.
  if (!g_launch->failed) {
    for (Thread& o : g_launch->threads) {
      if (o.warp != me.warp || o.st != St::kBlocked || o.op == Op::kBarrier || o.op == Op::kActiveMask) continue;
      if ((o.mask >> me.lane) & 1u) {
        record_error(fmt("lane %d exited while lane %d waits for it at %s (%s, mask 0x%08x): a warp collective over "
                         "an exited lane",
                         me.lane, o.lane, op_name(o.op), site_str(o.site).c_str(), o.mask) +
                     "\n  exited: " + who(me));
        break;
      }
    }
  }
  yield_to_scheduler(true);
  std::abort();
}

Thread* lane_thread(int warp, int lane) {
  const int linear = warp * kWarp + lane;
  return linear < g_launch->nthreads ? &g_launch->threads[linear] : nullptr;
}

// ---- warp collectives ---------------------------------------------------------
uint64_t combine(Op op, const Thread& me, unsigned mask, bool& bad, std::string& why) {
  const int warp = me.warp;
  auto value_of = [&](int lane) { return lane_thread(warp, lane)->value; };
  auto source = [&](int src) -> uint64_t {
    if (src < 0 || src >= kWarp) return me.value;  // out of the warp: own value (CUDA's rule)
    if (!((mask >> src) & 1u)) {
      bad = true;
      why = fmt("lane %d reads lane %d, which is not in the mask 0x%08x", me.lane, src, mask);
      return 0;
    }
    return value_of(src);
  };
  const uint64_t width_mask = me.bytes >= 8 ? ~0ull : ((1ull << (8 * me.bytes)) - 1);
  switch (op) {
    case Op::kSyncWarp: return 0;
    case Op::kShflIdx: return source(me.arg & (kWarp - 1));
    case Op::kShflUp: return me.lane - me.arg < 0 ? me.value : source(me.lane - me.arg);
    case Op::kShflDown: return me.lane + me.arg >= kWarp ? me.value : source(me.lane + me.arg);
    case Op::kShflXor: return source(me.lane ^ me.arg);
    case Op::kBallot:
    case Op::kAny:
    case Op::kAll: {
      unsigned ballot = 0;
      for (int l = 0; l < kWarp; ++l)
        if (((mask >> l) & 1u) && value_of(l) != 0) ballot |= 1u << l;
      if (op == Op::kBallot) return ballot;
      if (op == Op::kAny) return ballot != 0;
      return ballot == mask;
    }
    case Op::kMatchAny: {
      unsigned peers = 0;
      for (int l = 0; l < kWarp; ++l)
        if (((mask >> l) & 1u) && (value_of(l) & width_mask) == (me.value & width_mask)) peers |= 1u << l;
      return peers;
    }
    case Op::kMatchAll: {
      for (int l = 0; l < kWarp; ++l)
        if (((mask >> l) & 1u) && (value_of(l) & width_mask) != (me.value & width_mask)) return 0;
      return (1ull << 32) | mask;
    }
    default: {  // reductions over 32-bit values
      uint32_t acc = 0;
      bool first = true;
      for (int l = 0; l < kWarp; ++l) {
        if (!((mask >> l) & 1u)) continue;
        const uint32_t v = static_cast<uint32_t>(value_of(l));
        if (first) {
          acc = v;
          first = false;
          continue;
        }
        switch (op) {
          case Op::kReduceAdd: acc += v; break;
          case Op::kReduceAnd: acc &= v; break;
          case Op::kReduceOr: acc |= v; break;
          case Op::kReduceXor: acc ^= v; break;
          case Op::kReduceMin:
            acc = me.is_signed ? static_cast<uint32_t>(std::min<int32_t>(acc, v)) : std::min(acc, v);
            break;
          case Op::kReduceMax:
            acc = me.is_signed ? static_cast<uint32_t>(std::max<int32_t>(acc, v)) : std::max(acc, v);
            break;
          default: break;
        }
      }
      return acc;
    }
  }
}

bool same_collective(const Thread& a, const Thread& b) {
  return a.st == St::kBlocked && b.st == St::kBlocked && a.op == b.op && same_site(a.site, b.site);
}

}  // namespace

uint64_t warp_collective(Op op, unsigned mask, uint64_t value, unsigned bytes, int arg, int width, bool is_signed,
                         const std::source_location& where) {
  if (g_cur == nullptr) host_use(op_name(op));
  Thread& me = *g_cur;
  ++g_stats.collectives;
  if (width != kWarp) fail_here(fmt("%s at %s: width %d is not emulated (only 32)", op_name(op),
                                    site_str(where).c_str(), width) + "\n  " + who(me));
  if (op != Op::kActiveMask && !((mask >> me.lane) & 1u))
    fail_here(fmt("lane %d calls %s at %s with mask 0x%08x, which does not include itself", me.lane, op_name(op),
                  site_str(where).c_str(), mask) + "\n  " + who(me));
  me.st = St::kBlocked;
  me.op = op;
  me.site = where;
  me.mask = mask;
  me.value = value;
  me.bytes = bytes;
  me.arg = arg;
  me.is_signed = is_signed;
  if (op == Op::kActiveMask) {  // resolved by the scheduler once the whole warp is blocked
    yield_to_scheduler();
    return me.result;
  }
  // Complete now if every lane of the mask waits here with the same mask.
  bool complete = true;
  for (int l = 0; l < kWarp && complete; ++l) {
    if (!((mask >> l) & 1u)) continue;
    Thread* o = lane_thread(me.warp, l);
    if (o == nullptr)
      fail_here(fmt("%s at %s: mask 0x%08x names lane %d, which does not exist (the block has %d threads)",
                    op_name(op), site_str(where).c_str(), mask, l, g_launch->nthreads) + "\n  " + who(me));
    if (o->st == St::kDone)
      fail_here(fmt("%s at %s: mask 0x%08x names lane %d, which has exited: a warp collective over an exited lane",
                    op_name(op), site_str(where).c_str(), mask, l) + "\n  " + who(me));
    if (same_collective(*o, me) && o->mask != mask)
      fail_here(fmt("%s at %s: lanes %d and %d arrive with different masks 0x%08x and 0x%08x", op_name(op),
                    site_str(where).c_str(), me.lane, l, mask, o->mask) + "\n  " + who(me));
    complete = same_collective(*o, me);
  }
  if (!complete) {
    yield_to_scheduler();
    return me.result;
  }
  bool bad = false;
  std::string why;
  for (int l = 0; l < kWarp; ++l) {
    if (!((mask >> l) & 1u)) continue;
    Thread& o = *lane_thread(me.warp, l);
    o.result = combine(op, o, mask, bad, why);
    if (bad) fail_here(fmt("%s at %s: ", op_name(op), site_str(where).c_str()) + why + "\n  " + who(o));
  }
  for (int l = 0; l < kWarp; ++l)
    if ((mask >> l) & 1u) lane_thread(me.warp, l)->st = St::kReady;
  return me.result;  // the last lane to arrive keeps running (its state is kReady again)
}

void syncthreads(const std::source_location& where) {
  if (g_cur == nullptr) host_use("__syncthreads");
  Thread& me = *g_cur;
  me.st = St::kBlocked;
  me.op = Op::kBarrier;
  me.site = where;
  yield_to_scheduler();
}

namespace {

// ---- the block scheduler -----------------------------------------------------

// Every lane of a warp is blocked: lanes at the same __activemask() call get
// the set of those lanes (in shuffle mode sometimes split in two, as a
// diverged warp may be).
bool resolve_activemask() {
  bool any = false;
  const int warps = (g_launch->nthreads + kWarp - 1) / kWarp;
  for (int w = 0; w < warps; ++w) {
    std::vector<int> pending;
    for (int l = 0; l < kWarp; ++l) {
      Thread* t = lane_thread(w, l);
      if (t != nullptr && t->st == St::kBlocked && t->op == Op::kActiveMask) pending.push_back(l);
    }
    while (!pending.empty()) {
      const std::source_location site = lane_thread(w, pending[0])->site;
      std::vector<int> group, rest;
      for (int l : pending) (same_site(lane_thread(w, l)->site, site) ? group : rest).push_back(l);
      pending = rest;
      if (g_order == Order::kShuffle && group.size() > 1 && (g_rng() & 1)) {
        // a diverged warp: only part of the lanes run together now, the rest later
        std::shuffle(group.begin(), group.end(), g_rng);
        group.resize(1 + g_rng() % (group.size() - 1));
      }
      unsigned mask = 0;
      for (int l : group) mask |= 1u << l;
      for (int l : group) {
        Thread& t = *lane_thread(w, l);
        t.result = mask;
        t.st = St::kReady;
      }
      any = true;
    }
  }
  return any;
}

std::string describe_blocked() {
  std::string out;
  const int warps = (g_launch->nthreads + kWarp - 1) / kWarp;
  for (int w = 0; w < warps; ++w) {
    // group lanes by state / site
    std::vector<std::pair<std::string, std::vector<int>>> groups;
    for (int l = 0; l < kWarp; ++l) {
      const Thread* t = lane_thread(w, l);
      if (t == nullptr) continue;
      std::string key;
      if (t->st == St::kDone) key = "exited";
      else if (t->op == Op::kBarrier) key = "wait at __syncthreads (" + site_str(t->site) + ")";
      else key = fmt("wait at %s (%s, mask 0x%08x)", op_name(t->op), site_str(t->site).c_str(), t->mask);
      auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == key; });
      if (it == groups.end()) groups.push_back({key, {l}});
      else it->second.push_back(l);
    }
    if (groups.size() == 1 && groups[0].first == "exited") continue;
    out += fmt("\n  warp %d:", w);
    for (auto& g : groups) out += " lanes " + ranges(g.second) + " " + g.first + ";";
  }
  return out;
}

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

void device_fault(const char* what) {
  if (g_cur == nullptr) throw std::runtime_error(std::string("specrt emu: ") + what);
  fail_here(std::string(what) + "\n  " + who(*g_cur));
}

void host_use(const char* what) {
  throw std::runtime_error(std::string("specrt emu: ") + what + " used outside a kernel");
}

namespace {
void set_launch_error(cudaError_t e, const std::string& text) {
  g_last_error = e;
  g_last_error_text = "specrt emu: " + text;
  g_last_error_text_code = e;
}
}  // namespace

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

cudaError_t set_func_attribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > kSharedOptinLimit - 0) {
      set_launch_error(cudaErrorInvalidValue, fmt("cudaFuncSetAttribute: %d bytes of dynamic shared memory exceed "
                                                  "the device's %d", value, kSharedOptinLimit));
      return cudaErrorInvalidValue;
    }
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    g_func_smem[func] = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  set_launch_error(cudaErrorInvalidValue, fmt("cudaFuncSetAttribute: attribute %d is not emulated", attr));
  return cudaErrorInvalidValue;
}

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

cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::g_last_error;
  emu::g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return emu::g_last_error; }
const char* cudaGetErrorString(cudaError_t error) {
  if (error == cudaSuccess) return "no error";
  if (error == emu::g_last_error_text_code) return emu::g_last_error_text.c_str();
  return cudaGetErrorName(error);
}
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  (void)device;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: {
      static const int sms = [] {
        const char* e = std::getenv("SPECRT_EMU_SM_COUNT");
        return e != nullptr && std::atoi(e) > 0 ? std::atoi(e) : 132;  // H100 / H200 SXM
      }();
      *value = sms;
      return cudaSuccess;
    }
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 232448; return cudaSuccess;
  }
  emu::g_last_error = emu::g_last_error_text_code = cudaErrorInvalidValue;
  emu::g_last_error_text = "specrt emu: cudaDeviceGetAttribute: attribute not emulated";
  return cudaErrorInvalidValue;
}
