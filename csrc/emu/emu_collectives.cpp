// csrc/emu/emu_collectives.cpp — __syncthreads() and the warp collectives of the SIMT emulator
// (csrc/emu/README.md). A lane that arrives blocks; a collective completes only when every lane
// of its mask waits at the same call site with the same mask, and each lane then gets its result.
// Anything else stops the launch: a lane outside its own mask, a mask naming an exited or missing
// lane, lanes of one call with different masks, a shuffle reading a lane outside the mask.
#include <algorithm>
#include <string>
#include <vector>

#include "emu_internal.h"

namespace emu {
namespace internal {
namespace {

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

// A lane that exits while lanes of its warp wait for it at a collective.
void check_exit_in_collective(const Thread& me) {
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
}

}  // namespace internal

using namespace internal;

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

}  // namespace emu
