// csrc/cpu/attention_tile.h — what the CPU paged-attention driver (attention_cpu.cpp) and its
// tiles (attention_avx512.cpp, attention_portable.cpp) share: a lane group's state and a tile of keys.
// Internal to the CPU kernel.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "specrt/attention.h"

namespace specrt::attn_cpu {

using attn::kLanes;
using attn::kTileKeys;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Cache element kinds (the kernel's `kind` argument).
enum CacheKind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Up to 16 queries of one (request, kv head); buffers are transposed [D][16].
struct LaneGroup {
  const float* qt;  // [D][16] q * qscale (padding lanes 0), shared by every chunk of the request
  float* acc;   // [D][16] running sum of p * v; narrow tile [16][D], on a bf16 cache each 32 dims
                //   stored as [even 16 | odd 16] (pv_pairs)
  float* m;     // [16] running max (base-2 score domain)
  float* l;     // [16] running sum of p
  int32_t pos[kLanes];  // absolute position of each lane's query (padding lanes: a real one's)
  int32_t min_pos, max_pos;
  int live;     // lanes holding a real query (1..16)
  // Tree attention (attn::tree_visible): each lane's ancestor bits (padding lanes -1), read only when
  // some live lane's are not -1 (`tree`); those lanes' positions span [tree_min_pos, tree_max_pos].
  bool tree = false;
  int32_t tree_min_pos = 0, tree_max_pos = -1;
  int64_t tree_mask[kLanes];
};

// The tree check inside a masked tile, scalar (a tree lane has at most 3 masked tiles): keys k0 .. k0+15
// (bit j: key k0 + j) that a lane at pos with ancestor bits `mask` sees, and the lanes (bit i) of g that
// see key kp.
inline uint32_t tree_keys16(int64_t mask, int32_t pos, int32_t k0) {
  if (mask == -1) return 0xFFFFu;
  uint32_t keep = 0;
  for (int j = 0; j < 16; ++j)
    if (attn::tree_visible(pos, k0 + j, mask)) keep |= 1u << j;
  return keep;
}
inline uint32_t tree_lanes16(const LaneGroup& g, int32_t kp) {
  uint32_t keep = 0;
  for (int i = 0; i < kLanes; ++i)
    if (attn::tree_visible(g.pos[i], kp, g.tree_mask[i])) keep |= 1u << i;
  return keep;
}

// The next tile's cache lines, requested a few per step of the AVX-512 score loops (and, on a bf16
// cache, of the narrow tile's p * v key loops) while this tile is computed: spread over its arithmetic,
// since a burst holds every fill buffer until its lines arrive and stalls the core. The tile's keys are
// a few contiguous block segments of K rows; each V line is `plane` bytes after its K line.
struct Prefetch {
  const char* seg[kTileKeys + 1];
  int64_t seg_bytes[kTileKeys + 1];
  int64_t plane = 0;
  int segs = 0;
  int s = 0;           // cursor: segment s, byte x
  int64_t x = 0;
  int pairs_per_step = 0;  // K + V line pairs per prefetch step
  int step_mask = 0;       // ... on the steps d with (d & step_mask) == 0
  // An empty queue; V lines `plane_bytes` after their K lines.
  void reset(int64_t plane_bytes) {
    plane = plane_bytes;
    segs = s = 0;
    x = 0;
    pairs_per_step = step_mask = 0;
  }
  void add(const char* p, int64_t bytes) { seg[segs] = p, seg_bytes[segs++] = bytes; }
  // Spread the queued lines over `steps` prefetch steps: a few pairs per step, or one every 2^n steps.
  void pace(int64_t steps) {
    int64_t lines = 0;
    for (int i = 0; i < segs; ++i) lines += (seg_bytes[i] + 63) / 64;
    pairs_per_step = static_cast<int>((lines + steps - 1) / steps);
    step_mask = 0;
    while (pairs_per_step == 1 && (step_mask + 1) * 2 * lines <= steps) step_mask = 2 * step_mask + 1;
  }
  // Up to `pairs` line pairs from cursor (s, x), which advances; the score loop passes a copy of the
  // cursor held in registers. Into L2 (locality 2), or into L1 (3) for the many-lane tile: the faster
  // level for each (from L1 a decode's narrow tile slows down).
  template <int kLocality = 2>
  void issue(int& s_, int64_t& x_, int pairs) const {
    for (; pairs > 0 && s_ < segs; --pairs) {
      __builtin_prefetch(seg[s_] + x_, 0, kLocality);
      __builtin_prefetch(seg[s_] + plane + x_, 0, kLocality);
      if ((x_ += 64) >= seg_bytes[s_]) x_ = 0, ++s_;
    }
  }
  void drain() { issue(s, x, 1 << 30); }
};

// Keys k0 .. k0+n-1 of one tile for one kv head, converted to float: key j's row is k + j * stride.
struct Tile {
  const float* k;
  const float* v;
  int64_t stride;
  int n;
  int32_t k0;
  float* kt;  // [2][D][16]: the tile's keys transposed for the narrow tile (transpose_tile_avx512); null
              //   where the group transposes them in registers (keys_in_registers)
  // narrow tile on a bf16 cache, read in place (k, v unused): key j's K row of this kv head; its V row
  // is vplane elements further (rows past n repeat row n - 1)
  const uint16_t* const* rows = nullptr;
  int64_t vplane = 0;
  Prefetch* prefetch = nullptr;  // the next tile's lines (narrow tile; null: none)
};

// Score passes of the narrow tile over a group of `live` lanes (at most 8 lanes, 16 accumulators, each);
// on a bf16 cache its p * v also takes lanes 8 at a time.
inline int score_passes(int live) { return live <= 8 ? 1 : 2; }

// A narrow group that is its tile's only one, on a bf16 cache, whose score passes have at most
// kRegisterKeyLanes lanes (1-6 or 9-12: a decode, or a verify of a few tokens) transposes the keys in
// registers inside its score loop (the tile's t.kt null, transpose_tile_avx512 not called). A group of
// at most kFewLanes lanes takes p * v 64 dims per key loop.
constexpr int kFewLanes = 4;
constexpr int kRegisterKeyLanes = 6;
inline bool keys_in_registers(int64_t groups, int live, bool direct) {
  return direct && groups == 1 && (live <= kRegisterKeyLanes || (live > 8 && live <= 2 * kRegisterKeyLanes));
}

// max(a, b) as AVX-512 / the CUDA kernel compute it (a > b ? a : b).
inline float max_f(float a, float b) { return a > b ? a : b; }

// The portable tile, combine and conversion (attention_portable.cpp), for the baseline ISA and AVX2+FMA;
// the combine also for AVX-512 (all return the same bits). A combine merges one lane's chunk partials
// (m, l, acc[D]) `stride` floats apart, in chunk order, into out; a is D floats of scratch.
void tile_baseline(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked);
void combine_baseline(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out);
void convert_baseline(const void* src, int kind, int64_t n, float* dst);
void tile_avx2(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked);
void combine_avx2(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out);
void convert_avx2(const void* src, int kind, int64_t n, float* dst);
void combine_avx512(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out);

// With AVX-512 every lane group takes the narrow tile: keys along the vector, so a decode's few lanes
// do not pay for 16. Call these only where AVX-512 F/BW/VL is available.
// t.kt = the tile's keys transposed, from the float tile t.k (D % 16 == 0) or, direct, from the bf16
// cache rows t.rows (D % 32 == 0); once per tile and kv head, shared by its lane groups.
void transpose_tile_avx512(const Tile& t, int D, bool direct);
// A group's update from t.kt and V from the float tile t.v, or (bf16) from the cache rows t.rows.
void narrow_avx512_float(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked);
// The 16-lane tile (every group as wide as the vector; ISA level 2 and groups the narrow tile does not
// take), from the float tile t.k / t.v; and cache elements of `kind` -> float.
void tile_avx512(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked);
void convert_avx512(const void* src, int kind, int64_t n, float* dst);
void narrow_avx512_bf16(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked);
// The same, with groups of kManyLanes or more reading their keys in place (t.kt not read).
void narrow_avx512_bf16_keys(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked);
constexpr int kManyLanes = 15;  // live lanes from which a group on a bf16 cache takes the many-lane tile

// The steps over which a narrow group's tile issues the next tile's prefetch: its score steps (D per
// pass) and, on a bf16 cache below kManyLanes lanes, its p * v key steps (kTileKeys per key loop: one
// per 32 dims, per 64 up to kFewLanes lanes), so a memory-bound decode keeps requests in flight through
// p * v too.
inline int pv_key_loops(int lanes, int D) { return lanes <= kFewLanes ? D / 64 + D % 64 / 32 : D / 32; }
inline int prefetch_steps(int live, int D, bool direct) {
  if (!direct || live >= kManyLanes) return score_passes(live) * D;
  const int pv = live <= 8 ? pv_key_loops(live, D) : pv_key_loops(live - live / 2, D) + pv_key_loops(live / 2, D);
  return score_passes(live) * D + kTileKeys * pv;
}

}  // namespace specrt::attn_cpu
