// csrc/emu/emu_ops.cpp — control ops of the emulated-kernel extension, in its
// op namespace (SPECRT_EMU_NAMESPACE): the thread / block order and counters.
#include <torch/library.h>

#include <string>
#include <vector>

#include "cuda_emu.h"

namespace {

void set_order(std::string order, int64_t seed) { emu::set_order(order.c_str(), static_cast<uint64_t>(seed)); }

std::string get_order() { return emu::order_name(); }

// launches, blocks, threads, fiber switches, barriers released, collective arrivals
std::vector<int64_t> get_stats() {
  const emu::Stats s = emu::stats();
  return {static_cast<int64_t>(s.launches), static_cast<int64_t>(s.blocks),   static_cast<int64_t>(s.threads),
          static_cast<int64_t>(s.switches), static_cast<int64_t>(s.barriers), static_cast<int64_t>(s.collectives)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SPECRT_EMU_NAMESPACE, m) {
  m.def("_emu_set_order(str order, int seed=0) -> ()", &set_order);
  m.def("_emu_order() -> str", &get_order);
  m.def("_emu_stats() -> int[]", &get_stats);
}
