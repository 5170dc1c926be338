// bench/attention_tile.cpp — the CPU paged-attention kernel's AVX-512 bf16 tiles timed directly
// (issue 18), without the op around them: how long one 32-key tile of one kv head takes hot in L1,
// and streamed over a large paged cache in shuffled block order with the driver's prefetch schedule
// (Prefetch::pace over prefetch_steps). Built and run by bench/attention_tile.py; linked with
// csrc/cpu/attention_avx512.cpp. SmolLM2's shapes: 3 kv heads, head dim 64, 16-token blocks.
//
//   attention_tile LANES LEVEL CACHE_MB ROUNDS
//
// LANES: live lanes per group (3: a decode of 3 query heads per kv head; 15: a K=4 verify);
// LEVEL: 3 (keys transposed per tile, or in registers where keys_in_registers holds) or 4 (a
// many-lane group reads its keys in place), as ops.attention_cpu_isa. Each round runs "hot" (one
// tile, every kv head, repeated), "stream" (every tile of the cache once, the next tile prefetched as
// the driver does) and "nopf" (the same without prefetch), in turn. Prints one line per mode:
// nanoseconds per tile and kv head (min, median over rounds) and the KV bytes read per second.
// Exit status 2: the CPU lacks AVX-512.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/attention_tile.h"

using namespace specrt::attn_cpu;

namespace {

constexpr int kD = 64, kHeads = 3, kBlock = 16;
constexpr int64_t kRow = kHeads * kD;  // elements of one key's K row, every kv head

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

struct Bench {
  int lanes, level;
  int64_t blocks, plane;             // plane: elements of the K (or V) half of the cache
  std::vector<uint16_t> cache;       // [2][blocks][16][3][64] bf16
  std::vector<int> order;            // the blocks in shuffled order, two per tile
  std::vector<float> buf;            // per kv head: qt [64][16], acc [16][64], m [16], l [16]; kt
  LaneGroup groups[kHeads];
  float* kt = nullptr;
  Prefetch prefetch;
  int64_t steps = 0;                 // prefetch steps of one tile, every kv head

  Bench(int lanes_, int level_, int64_t mb) : lanes(lanes_), level(level_) {
    blocks = std::max<int64_t>(4, (mb << 20) / (2 * kBlock * kRow * 2)) & ~int64_t{1};
    plane = blocks * kBlock * kRow;
    cache.resize(2 * plane);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 0.5f);
    for (auto& x : cache) x = to_bf16(normal(rng));
    order.resize(blocks);
    for (int64_t i = 0; i < blocks; ++i) order[i] = static_cast<int>(i);
    std::shuffle(order.begin(), order.end(), rng);
    const int64_t per_head = kD * kLanes * 2 + 2 * kLanes;
    buf.assign(kHeads * per_head + 2 * kD * kLanes + 16, 0.0f);
    float* p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
    for (auto& g : groups) {
      float* qt = p;
      for (int i = 0; i < kD * kLanes; ++i) qt[i] = i % kLanes < lanes ? 0.125f * normal(rng) : 0.0f;
      g.qt = qt, g.acc = p + kD * kLanes, g.m = g.acc + kD * kLanes, g.l = g.m + kLanes;
      for (int i = 0; i < kLanes; ++i) g.m[i] = kNegInf, g.l[i] = 0.0f, g.pos[i] = 1 << 30;
      g.min_pos = g.max_pos = 1 << 30;
      g.live = lanes;
      p += per_head;
    }
    kt = p;
    steps = kHeads * prefetch_steps(lanes, kD, true);
  }

  int64_t tiles() const { return blocks / 2; }

  // Tile t: its 32 keys' K rows (kv head 0) and, with `queue`, the next tile's lines queued.
  void setup(int64_t t, bool queue, const uint16_t** rows0) {
    for (int j = 0; j < kTileKeys; ++j)
      rows0[j] = cache.data() + (static_cast<int64_t>(order[2 * t + j / kBlock]) * kBlock + j % kBlock) * kRow;
    prefetch.reset(plane * 2);
    if (queue && t + 1 < tiles()) {
      for (int b = 0; b < 2; ++b)
        prefetch.add(reinterpret_cast<const char*>(cache.data() + order[2 * (t + 1) + b] * kBlock * kRow),
                     kBlock * kRow * 2);
      prefetch.pace(steps);
    }
  }

  // One tile, every kv head, as the driver's process() runs it.
  void run_tile(const uint16_t* const* rows0) {
    const uint16_t* rows[kTileKeys];
    const bool in_registers = keys_in_registers(1, lanes, true);
    const bool transpose = !in_registers && !(level >= 4 && lanes >= kManyLanes);
    for (int h = 0; h < kHeads; ++h) {
      for (int j = 0; j < kTileKeys; ++j) rows[j] = rows0[j] + h * kD;
      Tile tile{nullptr, nullptr, kD, kTileKeys, 0, in_registers ? nullptr : kt};
      tile.rows = rows;
      tile.vplane = plane;
      tile.prefetch = &prefetch;
      if (transpose) transpose_tile_avx512(tile, kD, true);
      (level >= 4 ? narrow_avx512_bf16_keys : narrow_avx512_bf16)(tile, groups[h], kD, 0, false);
    }
    prefetch.drain();
  }

  // Seconds for every tile of the cache once (stream) or the first tile as many times (hot).
  double pass(int mode) {
    const uint16_t* rows0[kTileKeys];
    const auto start = std::chrono::steady_clock::now();
    for (int64_t t = 0; t < tiles(); ++t) {
      setup(mode == 0 ? 0 : t, mode == 1, rows0);
      run_tile(rows0);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s LANES LEVEL CACHE_MB ROUNDS\n", argv[0]);
    return 1;
  }
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl")) {
    std::fprintf(stderr, "this CPU has no AVX-512 F/BW/VL: the tiles timed here do not run on it\n");
    return 2;
  }
  const int lanes = std::atoi(argv[1]), level = std::atoi(argv[2]), rounds = std::atoi(argv[4]);
  const int64_t mb = std::atoll(argv[3]);
  if (lanes < 1 || lanes > kLanes || (level != 3 && level != 4) || mb < 1 || rounds < 1) {
    std::fprintf(stderr, "LANES must be 1..16, LEVEL 3 or 4, CACHE_MB and ROUNDS >= 1\n");
    return 1;
  }
  Bench bench(lanes, level, mb);
  const char* names[3] = {"hot", "stream", "nopf"};
  std::vector<double> secs[3];
  std::vector<char> evict(256 << 20, 1);  // read between passes, so a stream starts from DRAM
  long sink = 0;
  bench.pass(0);
  for (int r = 0; r < rounds; ++r)
    for (int k = 0; k < 3; ++k) {
      const int mode = (k + r) % 3;
      for (size_t i = 0; i < evict.size(); i += 64) sink += evict[i];
      secs[mode].push_back(bench.pass(mode));
    }
  const double per = static_cast<double>(bench.tiles() * kHeads);
  const double bytes = static_cast<double>(bench.tiles()) * 2 * 2 * kBlock * kRow * 2;  // K and V, bf16
  std::printf("lanes %d level %d cache %lld MB, %lld tiles, %d rounds%s\n", lanes, level,
              static_cast<long long>(mb), static_cast<long long>(bench.tiles()), rounds, sink == 42 ? " " : "");
  for (int mode = 0; mode < 3; ++mode) {
    std::vector<double>& v = secs[mode];
    std::sort(v.begin(), v.end());
    std::printf("%-6s ns_per_tile_head min %.1f median %.1f  kv_gbs %.2f\n", names[mode], v.front() / per * 1e9,
                v[v.size() / 2] / per * 1e9, bytes / v[v.size() / 2] / 1e9);
  }
  return 0;
}
