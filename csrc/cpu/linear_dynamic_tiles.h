// csrc/cpu/linear_dynamic_tiles.h — what the SIMD int8-activation paths share
// (linear_dynamic_avx2.cpp, linear_dynamic_avx512vnni.cpp): the output store and the tiling driver.
// Included inside each file's anonymous namespace (after linear_dynamic.h and <utility>), so each
// ISA gets its own internal copy compiled in its own target region (no cross-ISA inline merging).
// Tile<kKind, NR, MR>::run(p, n, m0) computes weight rows n..n+NR-1 for x rows m0..m0+MR-1; a
// row's result never depends on the tile it was computed in.

constexpr bool is_q4(WeightKind k) { return k == WeightKind::kQ4_0 || k == WeightKind::kQ4_1; }

#include "cpu/linear_store.h"  // store_out: y[m, n] = y (+ bias), as float or round-to-nearest-even bf16

inline void store(const DynProblem& p, int64_t m, int64_t n, float y) { store_out(p, m, n, y); }

// Output columns [n0, n1) of every x row: tiles of kMR x rows (the remainder in one smaller tile),
// kNRFew weight rows at a time while M <= 2 (more weight rows in flight when few x rows share
// them), else one.
template <template <WeightKind, int, int> class Tile, WeightKind kKind, int kMR, int kNRFew>
void run_tiles(const DynProblem& p, int64_t n0, int64_t n1) {
  const auto rows = [&](auto nr, int64_t n) {
    constexpr int NR = decltype(nr)::value;
    int64_t m = 0;
    for (; m + kMR <= p.M; m += kMR) Tile<kKind, NR, kMR>::run(p, n, m);
    const int64_t left = p.M - m;
    [&]<int... R>(std::integer_sequence<int, R...>) {  // one tile of the remaining 1..kMR-1 rows
      ((left == R + 1 ? Tile<kKind, NR, R + 1>::run(p, n, m) : void()), ...);
    }(std::make_integer_sequence<int, kMR - 1>{});
  };
  int64_t n = n0;
  if (p.M <= 2)
    for (; n + kNRFew <= n1; n += kNRFew) rows(std::integral_constant<int, kNRFew>{}, n);
  for (; n < n1; ++n) rows(std::integral_constant<int, 1>{}, n);
}

// run_tiles for p.kind.
template <template <WeightKind, int, int> class Tile, int kMR, int kNRFew>
void run_kind(const DynProblem& p, int64_t n0, int64_t n1) {
  switch (p.kind) {
    case WeightKind::kInt8: run_tiles<Tile, WeightKind::kInt8, kMR, kNRFew>(p, n0, n1); break;
    case WeightKind::kQ8_0: run_tiles<Tile, WeightKind::kQ8_0, kMR, kNRFew>(p, n0, n1); break;
    case WeightKind::kQ4_0: run_tiles<Tile, WeightKind::kQ4_0, kMR, kNRFew>(p, n0, n1); break;
    case WeightKind::kQ4_1: run_tiles<Tile, WeightKind::kQ4_1, kMR, kNRFew>(p, n0, n1); break;
    default: break;
  }
}
