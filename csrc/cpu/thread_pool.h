// csrc/cpu/thread_pool.h — the CPU kernels' parallel loop: at::parallel_for's contract on a pool
// that keeps working when another process takes a core (csrc/cpu/thread_pool.cpp).
//
// OpenMP (at::parallel_for) splits a range statically and joins every thread at the end, so one
// thread descheduled by another process stalls the whole region for a scheduler slice; a decode
// step runs ~120 such regions. Here the range is split into chunks that any thread claims: the
// calling thread works through them and waits only for chunks a helper has already started, so
// a helper that is not running costs nothing. A helper descheduled in the middle of a chunk still
// stalls the caller; when that happens the pool runs regions on the calling thread alone for a
// while (backing off, doubling while it keeps happening) and counts it (specrt.ops.cpu_pool_stats).
//
// Thread count: at::get_num_threads() (torch.set_num_threads), read at every region. f(lo, hi)
// gets contiguous, disjoint sub-ranges covering [begin, end), each at least `grain` long except
// perhaps the last; the kernels' results never depend on how the range is split.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace specrt {

namespace pool {
using ChunkFn = void (*)(const void* fn, int64_t lo, int64_t hi);
void run(int64_t begin, int64_t end, int64_t grain, ChunkFn call, const void* fn);
}  // namespace pool

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  pool::run(begin, end, grain, [](const void* fn, int64_t lo, int64_t hi) { (*static_cast<const F*>(fn))(lo, hi); },
            &f);
}

// Counters since the last reset (cpu_pool_stats) and the knobs (cpu_pool_configure; negative =
// unchanged): enabled 0 = at::parallel_for (OpenMP) instead, spin_us = how long an idle helper
// polls for work before it sleeps, adaptive 0 = never fall back to the calling thread alone.
std::map<std::string, double> cpu_pool_stats(bool reset);
std::map<std::string, double> cpu_pool_configure(int64_t enabled, int64_t spin_us, int64_t adaptive, int64_t threads);

}  // namespace specrt
