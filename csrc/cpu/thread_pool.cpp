// The CPU kernels' thread pool (the contract and the why: thread_pool.h).
//
// One region at a time: the caller publishes a job (the chunk function, the range, the chunk
// length) and a 64-bit state word epoch << 32 | chunks << 16 | next chunk. Every thread, caller
// included, claims chunks with one fetch_add on that word; a claim whose index is below the chunk
// count owns that chunk of that epoch, and the epoch cannot end before the chunk is done, so the
// job it then reads is the one it claimed from. The caller counts its own chunks and waits only
// for the ones helpers claimed (the `done` counter). Idle helpers poll for `spin_us`, then sleep
// on a futex that the caller rings when it publishes with sleepers present.
#include "cpu/thread_pool.h"

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>

namespace specrt {
namespace {

constexpr int kMaxThreads = 256;
constexpr int64_t kChunksPerThread = 4;      // a late helper still finds work; a stalled one holds little
constexpr int64_t kMaxChunks = 1024;         // < 2^16 with room for the claims that overshoot
constexpr int64_t kWaitSpinNs = 20'000;      // the caller polls this long for a helper's chunk, then sleeps
constexpr int64_t kStallFloorNs = 250'000;   // a wait this long (and 4x the caller's own chunk time) is a stall
constexpr int64_t kBaseBackoffNs = 20'000'000;
constexpr int64_t kMaxBackoffNs = 1'000'000'000;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return end != v && *end == '\0' && x >= 0 ? x : fallback;
}

std::atomic<bool> g_enabled{env_int("SPECRT_CPU_POOL", 0) != 0};  // opt-in (docs/notes.md: off until a nondeterminism is explained)
std::atomic<int64_t> g_spin_ns{env_int("SPECRT_CPU_POOL_SPIN_US", 100) * 1000};
std::atomic<bool> g_adaptive{env_int("SPECRT_CPU_POOL_ADAPTIVE", 1) != 0};
std::atomic<int64_t> g_threads{0};  // 0: at::get_num_threads()

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex words are plain 32-bit atomics");

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// f(lo, hi) on this thread, marked as inside a parallel region (as at::parallel_for does), so a
// kernel or torch op it calls runs its own loops inline
void run_here(pool::ChunkFn call, const void* fn, int64_t lo, int64_t hi) {
  c10::ParallelGuard guard(true);
  call(fn, lo, hi);
}

inline uint32_t epoch_of(uint64_t s) { return static_cast<uint32_t>(s >> 32); }
inline int64_t chunks_of(uint64_t s) { return static_cast<int64_t>((s >> 16) & 0xFFFF); }
inline int64_t next_of(uint64_t s) { return static_cast<int64_t>(s & 0xFFFF); }

struct Stats {
  std::atomic<uint64_t> regions{0}, chunks{0}, helper_chunks{0}, alone_regions{0}, busy_regions{0}, stalls{0},
      fallbacks{0}, wait_ns{0}, stall_ns{0};
  std::atomic<uint64_t> waits[5]{};  // caller waits for helpers: < 50 us, < 250 us, < 1 ms, < 4 ms, longer
};

class Pool {
 public:
  void run(int64_t begin, int64_t end, int64_t grain, pool::ChunkFn call, const void* fn, int threads);
  Stats stats;
  std::atomic<int> last_threads{1};
  std::atomic<int64_t> degraded_until{0}, backoff_ns{kBaseBackoffNs};

 private:
  struct Job {
    pool::ChunkFn call = nullptr;
    const void* fn = nullptr;
    int64_t begin = 0, end = 0, chunk = 0;
  };

  void start_helpers(int count);
  void helper_main(int index);
  uint64_t wait_for_work(int index, uint32_t seen);
  void run_chunk(int64_t idx);
  void wait_helpers(uint32_t target);
  void adapt(int64_t now, int64_t own_ns, int64_t own, int64_t wait_ns);

  std::mutex caller_;         // held for a whole region: one region at a time
  int started_ = 0;           // helpers started (under caller_); never stopped, detached
  uint32_t epoch_ = 0;        // under caller_
  int64_t resumed_ = 0;       // under caller_: when the last time alone ends
  Job job_;                   // written under caller_ before the state word publishes it
  std::atomic<int> active_{0};           // helpers 0..active-1 may join
  std::atomic<bool> cancelled_{false};   // a chunk threw: the rest are skipped
  std::mutex error_mu_;
  std::exception_ptr error_;
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<uint32_t> done_{0};            // chunks helpers finished this epoch
  std::atomic<uint32_t> caller_waiting_{0};
  alignas(64) std::atomic<uint32_t> wake_seq_{0};
  std::atomic<int> sleepers_{0};
};

void Pool::start_helpers(int count) {
  for (; started_ < count; ++started_) {
    std::thread t([this, i = started_] { helper_main(i); });
    const std::string name = "specrt-pool-" + std::to_string(started_);
    pthread_setname_np(t.native_handle(), name.c_str());
    t.detach();  // lives as long as the process; never joined (exit must not wait for it)
  }
}

void Pool::run_chunk(int64_t idx) {
  const Job& job = job_;
  if (cancelled_.load(std::memory_order_relaxed)) return;
  const int64_t lo = job.begin + idx * job.chunk, hi = std::min(job.end, lo + job.chunk);
  try {
    run_here(job.call, job.fn, lo, hi);
  } catch (...) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!error_) error_ = std::current_exception();
    cancelled_.store(true, std::memory_order_relaxed);
  }
}

uint64_t Pool::wait_for_work(int index, uint32_t seen) {
  const auto has_work = [&](uint64_t s) {
    return epoch_of(s) != seen && next_of(s) < chunks_of(s) && index < active_.load(std::memory_order_relaxed);
  };
  for (;;) {
    const int64_t deadline = now_ns() + g_spin_ns.load(std::memory_order_relaxed);
    for (uint32_t i = 1;; ++i) {
      const uint64_t s = state_.load(std::memory_order_acquire);
      if (has_work(s)) return s;
      relax();
      if ((i & 63) == 0 && now_ns() > deadline) break;
    }
    // sleep; the caller rings wake_seq_ after publishing when it sees a sleeper (sleepers_ is
    // raised before the last look at the state, so one of the two sees the other)
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seq = wake_seq_.load(std::memory_order_seq_cst);
    const uint64_t s = state_.load(std::memory_order_seq_cst);
    if (!has_work(s)) futex_wait(&wake_seq_, seq);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void Pool::helper_main(int index) {
  uint32_t seen = epoch_of(state_.load(std::memory_order_acquire));
  for (;;) {
    wait_for_work(index, seen);
    for (;;) {
      const uint64_t c = state_.fetch_add(1, std::memory_order_acq_rel);
      seen = epoch_of(c);
      if (next_of(c) >= chunks_of(c)) break;
      run_chunk(next_of(c));
      done_.fetch_add(1, std::memory_order_seq_cst);
      if (caller_waiting_.load(std::memory_order_seq_cst)) futex_wake_all(&done_);
    }
  }
}

void Pool::wait_helpers(uint32_t target) {
  const int64_t deadline = now_ns() + kWaitSpinNs;
  for (uint32_t i = 1; done_.load(std::memory_order_acquire) < target; ++i) {
    relax();
    if ((i & 63) == 0 && now_ns() > deadline) {
      // sleep rather than spin: an idle CPU lets the scheduler move a descheduled helper onto it
      caller_waiting_.store(1, std::memory_order_seq_cst);
      for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) < target;) futex_wait(&done_, d);
      caller_waiting_.store(0, std::memory_order_relaxed);
      return;
    }
  }
}

void Pool::adapt(int64_t now, int64_t own_ns, int64_t own, int64_t wait_ns) {
  stats.wait_ns.fetch_add(static_cast<uint64_t>(wait_ns), std::memory_order_relaxed);
  stats.waits[wait_ns < 50'000 ? 0 : wait_ns < 250'000 ? 1 : wait_ns < 1'000'000 ? 2 : wait_ns < 4'000'000 ? 3 : 4]
      .fetch_add(1, std::memory_order_relaxed);
  const int64_t per_chunk = own > 0 ? own_ns / own : 0;
  if (wait_ns <= std::max(kStallFloorNs, 4 * per_chunk)) return;
  stats.stalls.fetch_add(1, std::memory_order_relaxed);
  stats.stall_ns.fetch_add(static_cast<uint64_t>(wait_ns), std::memory_order_relaxed);
  if (!g_adaptive.load(std::memory_order_relaxed)) return;
  // A helper lost its CPU mid-chunk: run on the calling thread alone for a while. A stall soon
  // after the helpers came back (within the last time alone) doubles the time alone: a busy
  // neighbour stays busy. Otherwise (a one-off) the time alone is short: ten stalls' worth.
  int64_t backoff = backoff_ns.load(std::memory_order_relaxed);
  const bool relapse = resumed_ != 0 && now - resumed_ < backoff;
  backoff = relapse ? std::min(2 * backoff, kMaxBackoffNs) : std::max(kBaseBackoffNs, 10 * wait_ns);
  backoff_ns.store(backoff, std::memory_order_relaxed);
  degraded_until.store(now + backoff, std::memory_order_relaxed);
  resumed_ = now + backoff;
  stats.fallbacks.fetch_add(1, std::memory_order_relaxed);
}

void Pool::run(int64_t begin, int64_t end, int64_t grain, pool::ChunkFn call, const void* fn, int threads) {
  std::unique_lock<std::mutex> lock(caller_, std::try_to_lock);
  if (!lock.owns_lock()) {  // another thread is running a region: this one runs alone
    stats.busy_regions.fetch_add(1, std::memory_order_relaxed);
    run_here(call, fn, begin, end);
    return;
  }
  threads = std::min(threads, kMaxThreads);
  last_threads.store(threads, std::memory_order_relaxed);
  const int64_t t0 = now_ns();
  if (g_adaptive.load(std::memory_order_relaxed) && t0 < degraded_until.load(std::memory_order_relaxed)) {
    stats.alone_regions.fetch_add(1, std::memory_order_relaxed);
    run_here(call, fn, begin, end);
    return;
  }
  start_helpers(threads - 1);
  active_.store(threads - 1, std::memory_order_relaxed);
  const int64_t range = end - begin;
  int64_t chunks = std::min<int64_t>({(range + grain - 1) / grain, threads * kChunksPerThread, kMaxChunks});
  const int64_t chunk = (range + chunks - 1) / chunks;
  chunks = (range + chunk - 1) / chunk;
  job_ = Job{call, fn, begin, end, chunk};
  cancelled_.store(false, std::memory_order_relaxed);
  error_ = nullptr;
  done_.store(0, std::memory_order_relaxed);
  ++epoch_;
  state_.store(static_cast<uint64_t>(epoch_) << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    wake_seq_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&wake_seq_);
  }
  int64_t own = 0;
  for (;;) {
    const uint64_t c = state_.fetch_add(1, std::memory_order_acq_rel);
    if (next_of(c) >= chunks) break;
    run_chunk(next_of(c));
    ++own;
  }
  const int64_t t1 = now_ns();
  const uint32_t helper_chunks = static_cast<uint32_t>(chunks - own);
  wait_helpers(helper_chunks);  // every chunk is claimed: wait for the helpers' to finish
  const int64_t t2 = now_ns();
  stats.regions.fetch_add(1, std::memory_order_relaxed);
  stats.chunks.fetch_add(static_cast<uint64_t>(chunks), std::memory_order_relaxed);
  stats.helper_chunks.fetch_add(helper_chunks, std::memory_order_relaxed);
  adapt(t2, t1 - t0, own, t2 - t1);
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

std::atomic<Pool*> g_pool{nullptr};
std::mutex g_pool_mu;

Pool& the_pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  std::lock_guard<std::mutex> lock(g_pool_mu);
  p = g_pool.load(std::memory_order_relaxed);
  if (p == nullptr) {
    static std::once_flag atfork;
    // a forked child has none of the parent's helpers: it starts a pool of its own (the parent's
    // is leaked, never touched again)
    std::call_once(atfork, [] { pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); }); });
    p = new Pool();  // never deleted: helpers may still be asleep in it at exit
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

namespace pool {

void run(int64_t begin, int64_t end, int64_t grain, ChunkFn call, const void* fn) {
  grain = std::max<int64_t>(grain, 1);
  if (!g_enabled.load(std::memory_order_relaxed)) {
    at::parallel_for(begin, end, grain, [&](int64_t lo, int64_t hi) { call(fn, lo, hi); });
    return;
  }
  const int64_t fixed = g_threads.load(std::memory_order_relaxed);
  const int threads = at::in_parallel_region() ? 1 : fixed > 0 ? static_cast<int>(fixed) : at::get_num_threads();
  if (threads <= 1 || end - begin <= grain) {
    run_here(call, fn, begin, end);
    return;
  }
  the_pool().run(begin, end, grain, call, fn, threads);
}

}  // namespace pool

std::map<std::string, double> cpu_pool_stats(bool reset) {
  Pool& p = the_pool();
  Stats& s = p.stats;
  const auto take = [reset](std::atomic<uint64_t>& x) {
    return static_cast<double>(reset ? x.exchange(0, std::memory_order_relaxed) : x.load(std::memory_order_relaxed));
  };
  const int64_t now = now_ns(), until = p.degraded_until.load(std::memory_order_relaxed);
  std::map<std::string, double> out{
      {"threads", static_cast<double>(p.last_threads.load(std::memory_order_relaxed))},
      {"regions", take(s.regions)},
      {"chunks", take(s.chunks)},
      {"helper_chunks", take(s.helper_chunks)},
      {"alone_regions", take(s.alone_regions)},
      {"busy_regions", take(s.busy_regions)},
      {"stalls", take(s.stalls)},
      {"fallbacks", take(s.fallbacks)},
      {"wait_s", take(s.wait_ns) * 1e-9},
      {"stall_s", take(s.stall_ns) * 1e-9},
      {"alone_now", until > now ? 1.0 : 0.0},
      {"backoff_s", static_cast<double>(p.backoff_ns.load(std::memory_order_relaxed)) * 1e-9},
      {"enabled", g_enabled.load() ? 1.0 : 0.0},
      {"spin_us", static_cast<double>(g_spin_ns.load()) * 1e-3},
      {"adaptive", g_adaptive.load() ? 1.0 : 0.0},
  };
  constexpr const char* kWaitNames[] = {"waits_lt_50us", "waits_lt_250us", "waits_lt_1ms", "waits_lt_4ms",
                                        "waits_ge_4ms"};
  for (int i = 0; i < 5; ++i) out[kWaitNames[i]] = take(s.waits[i]);
  return out;
}

std::map<std::string, double> cpu_pool_configure(int64_t enabled, int64_t spin_us, int64_t adaptive, int64_t threads) {
  std::map<std::string, double> before{{"enabled", g_enabled.load() ? 1.0 : 0.0},
                                       {"spin_us", static_cast<double>(g_spin_ns.load()) * 1e-3},
                                       {"adaptive", g_adaptive.load() ? 1.0 : 0.0}};
  before["threads"] = static_cast<double>(g_threads.load());
  if (threads >= 0) g_threads.store(threads);
  if (enabled >= 0) g_enabled.store(enabled != 0);
  if (spin_us >= 0) g_spin_ns.store(spin_us * 1000);
  if (adaptive >= 0) {
    g_adaptive.store(adaptive != 0);
    Pool& p = the_pool();
    p.degraded_until.store(0);
    p.backoff_ns.store(kBaseBackoffNs);
  }
  return before;
}

}  // namespace specrt
