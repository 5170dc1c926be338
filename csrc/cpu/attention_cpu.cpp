// CPU kernel of paged multi-position attention (csrc/attention_ops.h): each
// request's 1..K+1 new queries attend directly over its paged KV blocks, no
// gather copy. The algorithm and its float math are the ones written down in
// csrc/include/specrt/attention.h (shared with the CUDA kernel).
//
// Work item = (request, kv head, 256-key chunk), taken dynamically by the
// threads (the result of an item does not depend on who computes it). All
// queries of the request that share the kv head (G query heads x query_len
// new tokens) are "lanes": 16 lanes form a group held in one AVX-512 vector,
// so every K/V row is loaded once per tile for all of them. The hot tile
// update has an AVX-512 version (attention_avx512.cpp) and a portable one
// (attention_portable.cpp, compiled for AVX2+FMA and the baseline); all three
// return the same bits. A group with few live lanes (decode: G heads x 1
// token) wastes most of a 16-lane vector, so with AVX-512 groups take a
// "narrow" tile instead, with keys (scores) and head dims (p * v) along the
// vector: the same operations per lane in the same order, so the same bits, at
// a cost proportional to the live lanes (and on a bf16 cache reading K and V in
// place, no float copy).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "attention_ops.h"
#include "cpu/attention_tile.h"
#include "cpu/cpu_isa.h"
#include "cpu/thread_pool.h"
#include "specrt/attention.h"

namespace specrt {
namespace {

using attn::kChunkKeys;
using namespace attn_cpu;  // LaneGroup, Tile, the tiles

// ---------------------------------------------------------------- dispatch
struct Isa {
  void (*tile)(const Tile&, LaneGroup&, int, int32_t, bool);
  void (*narrow)(const Tile&, LaneGroup&, int, int32_t, bool);  // null: every group takes `tile`
  void (*narrow_bf16)(const Tile&, LaneGroup&, int, int32_t, bool);  // narrow, bf16 cache read in place
  void (*transpose)(const Tile&, int, bool);                          // the narrow tile's keys
  void (*combine)(const float*, int64_t, int64_t, int, float*, float*);
  void (*convert)(const void*, int, int64_t, float*);
  bool keys_in_place = false;  // narrow_bf16's many-lane groups read no transposed keys
};

// The highest level the instruction-set ceiling allows (cpu_isa.h): AVX-512 -> 4, AVX2 -> 1.
int detected_isa() {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512: return 4;
    case CpuIsa::kAvx2: return 1;
    default: return 0;
  }
}

// The level used unless a test caps it: 4 on AMD, whose vector shifts and ands issue beside the fmas
// (Zen 4), 3 elsewhere (on Intel they share the fma ports, and level 3 is faster there).
int preferred_isa() {
  const int d = detected_isa();
  return d == 4 && !cpu_features().amd ? 3 : d;
}

std::atomic<int> g_isa_cap{-1};  // -1: preferred_isa()

int active_isa() {
  const int cap = g_isa_cap.load(std::memory_order_relaxed);
  return cap < 0 ? preferred_isa() : std::min(detected_isa(), cap);
}

Isa isa_ops(int level) {
  // 4: 3 with the many-lane tile's scores reading a bf16 cache's keys in place; 3: AVX-512 with narrow
  // groups; 2: AVX-512, every group 16 lanes wide (same bits, for tests)
  if (level >= 4)
    return {tile_avx512, narrow_avx512_float, narrow_avx512_bf16_keys, transpose_tile_avx512, combine_avx512,
            convert_avx512, true};
  if (level == 3)
    return {tile_avx512, narrow_avx512_float, narrow_avx512_bf16, transpose_tile_avx512, combine_avx512, convert_avx512};
  if (level == 2) return {tile_avx512, nullptr, nullptr, nullptr, combine_avx512, convert_avx512};
  if (level == 1) return {tile_avx2, nullptr, nullptr, nullptr, combine_avx2, convert_avx2};
  return {tile_baseline, nullptr, nullptr, nullptr, combine_baseline, convert_baseline};
}

// ---------------------------------------------------------------- driver
struct Request {
  int64_t q0, query_len, seq_len, first_key;
  int64_t chunk_first, num_chunks;
  int64_t part_offset;  // floats into the partials buffer (multi-chunk requests)
  int64_t qt_offset;    // floats into the transposed-query buffer: [Hkv][groups][D][16]
};

// One work item: request b, its chunk c (counted from its first visible chunk), all kv heads.
struct Item {
  int32_t b, c;
};

class Kernel {
 public:
  explicit Kernel(const PagedAttentionArgs& a) : a_(a), isa_(isa_ops(active_isa())) {
    T_ = a.q.size(0);
    H_ = a.q.size(1);
    D_ = static_cast<int>(a.q.size(2));
    bs_ = a.kv_cache.size(2);
    Hkv_ = a.kv_cache.size(3);
    G_ = H_ / Hkv_;
    B_ = a.seq_lens.size(0);
    M_ = a.block_tables.size(1);
    plane_ = a.kv_cache.size(1) * bs_ * Hkv_ * D_;
    const at::ScalarType dt = a.kv_cache.scalar_type();
    kind_ = dt == at::kFloat ? kF32 : dt == at::kBFloat16 ? kBF16 : kF16;
    narrow_ = isa_.narrow != nullptr && D_ % 16 == 0;
    direct_ = narrow_ && kind_ == kBF16 && D_ % 32 == 0;  // the narrow tile reads a bf16 cache in place
    if (a.tree_mask.defined()) tree_ = a.tree_mask.data_ptr<int64_t>();
  }

  void run() {
    plan();
    // one buffer: the transposed queries (64-byte aligned), then the chunk partials
    const at::Tensor buf = at::empty({qt_floats_ + 16 + part_floats_}, a_.q.options());
    qt_ = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data_ptr<float>()) + 63) & ~uintptr_t{63});
    part_ = qt_ + qt_floats_;
    parallel_for(0, B_, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) transpose_queries(reqs_[b]);
    });
    // dynamic scheduling: items differ in cost; an item's result does not depend on its thread
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(items_.size());
    parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      Scratch sc(Hkv_ * max_groups_, D_);
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) process(items_[i], sc, next);
    });
    combine_all();
    float* out = a_.out.data_ptr<float>();
    const int64_t rows = a_.query_start_loc.data_ptr<int64_t>()[B_];
    std::fill(out + rows * H_ * D_, out + T_ * H_ * D_, 0.0f);  // padding rows
  }

 private:
  struct Scratch {
    std::vector<float> buf;
    std::vector<LaneGroup> groups;  // [Hkv][max_groups]
    float *kbuf, *vbuf;             // [kTileKeys][D]: one kv head's tile
    float* kt;                      // [kTileKeys][D]: the narrow tile's transposed keys
    const uint16_t* rows[kTileKeys];  // a direct narrow tile's K rows (this kv head)
    Prefetch prefetch;                // the next tile's cache lines
    int64_t off[kTileKeys];           // and their offsets for kv head 0
    Scratch(int64_t num_groups, int D) : buf(num_groups * (D + 2) * kLanes + 3 * kTileKeys * D + 16),
                                         groups(num_groups) {
      // every part is a multiple of 16 floats: from a 64-byte aligned start, no vector load splits a line
      float* p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
      for (auto& g : groups) {
        g.acc = p, p += D * kLanes;
        g.m = p, p += kLanes;
        g.l = p, p += kLanes;
      }
      kbuf = p, p += kTileKeys * D;
      vbuf = p, p += kTileKeys * D;
      kt = p;
    }
  };

  void plan() {
    const int64_t* seq = a_.seq_lens.data_ptr<int64_t>();
    const int64_t* qsl = a_.query_start_loc.data_ptr<int64_t>();
    reqs_.resize(B_);
    for (int64_t b = 0; b < B_; ++b) {
      Request& r = reqs_[b];
      r.q0 = qsl[b];
      r.query_len = qsl[b + 1] - qsl[b];
      r.seq_len = seq[b];
      r.num_chunks = 0;
      if (r.query_len == 0) continue;
      r.first_key = attn::first_visible_key(r.seq_len, r.query_len, a_.window);
      r.chunk_first = r.first_key / kChunkKeys;
      r.num_chunks = (r.seq_len - 1) / kChunkKeys - r.chunk_first + 1;
      const int64_t lanes = G_ * r.query_len;
      max_groups_ = std::max(max_groups_, (lanes + kLanes - 1) / kLanes);
      r.part_offset = part_floats_;
      if (r.num_chunks > 1) part_floats_ += Hkv_ * r.num_chunks * lanes * (D_ + 2);
      r.qt_offset = qt_floats_;
      qt_floats_ += Hkv_ * ((lanes + kLanes - 1) / kLanes) * D_ * kLanes;
      for (int64_t c = 0; c < r.num_chunks; ++c) items_.push_back({static_cast<int32_t>(b), static_cast<int32_t>(c)});
    }
  }

  // The request's queries as lanes, q * qscale transposed to [D][16] per (kv head, group): once per
  // request, read by every chunk. Lane i of group gi of kv head h = query (lane / G) of the request,
  // query head h * G + lane % G; padding lanes are 0.
  void transpose_queries(const Request& r) const {
    if (r.num_chunks == 0) return;
    const float* q = a_.q.data_ptr<float>();
    const int64_t lanes = G_ * r.query_len, groups = (lanes + kLanes - 1) / kLanes;
    float* qt = qt_ + r.qt_offset;
    std::fill(qt, qt + Hkv_ * groups * D_ * kLanes, 0.0f);
    for (int64_t h = 0; h < Hkv_; ++h)
      for (int64_t lane = 0; lane < lanes; ++lane) {
        const float* qrow = q + ((r.q0 + lane / G_) * H_ + h * G_ + lane % G_) * D_;
        float* col = qt + ((h * groups + lane / kLanes) * D_) * kLanes + lane % kLanes;
        for (int d = 0; d < D_; ++d) col[d * kLanes] = qrow[d] * a_.qscale;
      }
  }

  // A chunk's fresh state for group gi of kv head h.
  void setup_group(const Request& r, int64_t h, int64_t gi, LaneGroup& g) const {
    const int64_t lanes = G_ * r.query_len, groups = (lanes + kLanes - 1) / kLanes;
    g.qt = qt_ + r.qt_offset + (h * groups + gi) * D_ * kLanes;
    std::fill(g.acc, g.acc + D_ * kLanes, 0.0f);
    std::fill(g.m, g.m + kLanes, kNegInf);
    std::fill(g.l, g.l + kLanes, 0.0f);
    g.min_pos = std::numeric_limits<int32_t>::max();
    g.max_pos = -1;
    g.live = static_cast<int>(std::min<int64_t>(kLanes, lanes - gi * kLanes));
    g.tree = false;
    g.tree_min_pos = std::numeric_limits<int32_t>::max();
    g.tree_max_pos = -1;
    for (int i = 0; i < kLanes; ++i) {
      const int64_t lane = std::min(gi * kLanes + i, lanes - 1);  // padding lanes repeat the last position
      g.pos[i] = static_cast<int32_t>(r.seq_len - r.query_len + lane / G_);
      g.tree_mask[i] = -1;
      if (gi * kLanes + i >= lanes) continue;
      g.min_pos = std::min(g.min_pos, g.pos[i]);
      g.max_pos = std::max(g.max_pos, g.pos[i]);
      if (tree_ == nullptr || tree_[r.q0 + lane / G_] == -1) continue;
      g.tree_mask[i] = tree_[r.q0 + lane / G_];
      g.tree = true;
      g.tree_min_pos = std::min(g.tree_min_pos, g.pos[i]);
      g.tree_max_pos = std::max(g.tree_max_pos, g.pos[i]);
    }
  }

  // Keys [k0, k1) of request b, kv head h, as float rows [k1 - k0][D] (8 KB each for D = 64: the
  // tile's K and V stay in L1 while every lane group of the head reads them).
  void load_tile(int64_t b, int64_t h, int64_t k0, int64_t k1, Scratch& sc) const {
    const int32_t* table = a_.block_tables.data_ptr<int32_t>() + b * M_;
    const int64_t row = Hkv_ * D_;
    const char* base = static_cast<const char*>(a_.kv_cache.data_ptr());
    const int64_t elem = a_.kv_cache.element_size();
    for (int64_t kp = k0; kp < k1;) {  // one block segment at a time
      const int64_t off = kp % bs_;
      const int64_t n = std::min(k1 - kp, bs_ - off);
      const int64_t src = (static_cast<int64_t>(table[kp / bs_]) * bs_ + off) * row + h * D_;
      for (int64_t i = 0; i < n; ++i) {
        isa_.convert(base + (src + i * row) * elem, kind_, D_, sc.kbuf + (kp - k0 + i) * D_);
        isa_.convert(base + (plane_ + src + i * row) * elem, kind_, D_, sc.vbuf + (kp - k0 + i) * D_);
      }
      kp += n;
    }
  }

  // The cache lines of keys [k0, k1) of request b (K and V rows, every kv head), queued in sc.prefetch:
  // the narrow tile requests them over the `steps` prefetch steps of the tile computed meanwhile.
  void queue_prefetch(int64_t b, int64_t k0, int64_t k1, int64_t steps, Scratch& sc) const {
    const int32_t* table = a_.block_tables.data_ptr<int32_t>() + b * M_;
    const int64_t row_bytes = Hkv_ * D_ * a_.kv_cache.element_size();
    const char* base = static_cast<const char*>(a_.kv_cache.data_ptr());
    Prefetch& p = sc.prefetch;
    p.reset(plane_ * a_.kv_cache.element_size());
    for (int64_t kp = k0; kp < k1;) {  // one block segment at a time
      const int64_t off = kp % bs_;
      const int64_t n = std::min(k1 - kp, bs_ - off);
      p.add(base + (static_cast<int64_t>(table[kp / bs_]) * bs_ + off) * row_bytes, n * row_bytes);
      kp += n;
    }
    p.pace(steps);  // over the tile's prefetch steps (every kv head runs them)
    if (!narrow_) p.drain();  // the other tiles take them in one burst
  }

  // Keys [begin, end) of an item's chunk.
  std::pair<int64_t, int64_t> chunk_keys(const Item& it) const {
    const Request& r = reqs_[it.b];
    const int64_t c = r.chunk_first + it.c;
    return {std::max(c * kChunkKeys, r.first_key), std::min((c + 1) * kChunkKeys, r.seq_len)};
  }

  // next: the work queue's cursor; the item it points at is the one this thread most likely takes next.
  void process(const Item& it, Scratch& sc, const std::atomic<int64_t>& next) const {
    const Request& r = reqs_[it.b];
    const int64_t num_groups = (G_ * r.query_len + kLanes - 1) / kLanes;
    int64_t steps = 0;  // the prefetch steps of a tile, every kv head and group (prefetch_steps)
    // some group reads the tile's transposed keys (the groups before the last have 16 live lanes)
    const int64_t last_live = (G_ * r.query_len - 1) % kLanes + 1;
    const bool in_registers = keys_in_registers(num_groups, static_cast<int>(last_live), direct_);
    const bool transpose = narrow_ && !in_registers && !(direct_ && isa_.keys_in_place && last_live >= kManyLanes);
    for (int64_t h = 0; h < Hkv_; ++h)
      for (int64_t gi = 0; gi < num_groups; ++gi) {
        setup_group(r, h, gi, sc.groups[h * num_groups + gi]);
        steps += prefetch_steps(sc.groups[h * num_groups + gi].live, D_, direct_);
      }
    const auto [key_begin, key_end] = chunk_keys(it);
    const int32_t window = static_cast<int32_t>(a_.window > 0 && a_.window < r.seq_len ? a_.window : 0);
    const uint16_t* cache16 = static_cast<const uint16_t*>(a_.kv_cache.data_ptr());
    const int32_t* table = a_.block_tables.data_ptr<int32_t>() + it.b * M_;
    for (int64_t t0 = key_begin - key_begin % kTileKeys; t0 < key_end; t0 += kTileKeys) {
      const int64_t k0 = std::max(t0, key_begin), k1 = std::min(t0 + kTileKeys, key_end);
      // the next tile; after the chunk's last, the first tile of the item at the queue's head
      if (t0 + kTileKeys < key_end) {
        queue_prefetch(it.b, t0 + kTileKeys, std::min(t0 + 2 * kTileKeys, key_end), steps, sc);
      } else if (const int64_t i = next.load(std::memory_order_relaxed); i < static_cast<int64_t>(items_.size())) {
        const auto [b, e] = chunk_keys(items_[i]);
        queue_prefetch(items_[i].b, b, std::min(b - b % kTileKeys + kTileKeys, e), steps, sc);
      } else {
        queue_prefetch(it.b, 0, 0, steps, sc);  // nothing
      }
      if (direct_) {  // cache offset of each key's row (keys past k1 repeat the last), one division per tile
        int64_t blk = k0 / bs_, o = k0 % bs_;
        for (int64_t j = 0; j < kTileKeys; ++j) {
          if (k0 + j >= k1) {
            sc.off[j] = sc.off[j - 1];
            continue;
          }
          sc.off[j] = (static_cast<int64_t>(table[blk]) * bs_ + o) * Hkv_ * D_;
          if (++o == bs_) o = 0, ++blk;
        }
      }
      for (int64_t h = 0; h < Hkv_; ++h) {
        Tile tile{sc.kbuf, sc.vbuf, D_, static_cast<int>(k1 - k0), static_cast<int32_t>(k0),
                  in_registers ? nullptr : sc.kt};
        tile.prefetch = &sc.prefetch;
        if (direct_) {
          for (int64_t j = 0; j < kTileKeys; ++j) sc.rows[j] = cache16 + sc.off[j] + h * D_;
          tile.rows = sc.rows;
          tile.vplane = plane_;
        } else {
          load_tile(it.b, h, k0, k1, sc);
        }
        if (transpose) isa_.transpose(tile, D_, direct_);
        for (int64_t gi = 0; gi < num_groups; ++gi) {
          LaneGroup& g = sc.groups[h * num_groups + gi];
          // a tile no lane of the group can see changes nothing (see attention.h): skip it
          if (k0 > g.max_pos || (window != 0 && k1 - 1 <= g.min_pos - window)) continue;
          // ... and one holding keys within attn::kTreeBits of a lane with tree bits masks them too
          const bool masked = k1 - 1 > g.min_pos || (window != 0 && k0 <= g.max_pos - window) ||
                              (g.tree && k1 - 1 > g.tree_min_pos - attn::kTreeBits && k0 <= g.tree_max_pos);
          (narrow_ ? (direct_ ? isa_.narrow_bf16 : isa_.narrow) : isa_.tile)(tile, g, D_, window, masked);
        }
      }
      sc.prefetch.drain();  // what skipped groups left
    }
    for (int64_t h = 0; h < Hkv_; ++h) finish(r, h, it.c, sc.groups.data() + h * num_groups);
  }

  float* out_row(const Request& r, int64_t h, int64_t lane) const {
    return a_.out.data_ptr<float>() + ((r.q0 + lane / G_) * H_ + h * G_ + lane % G_) * D_;
  }

  // Lane i's acc in dim order: [D][16] (wide), [16][D] (narrow), and a direct narrow tile keeps each
  // 32 dims as [even 16 | odd 16].
  void lane_acc(const LaneGroup& g, int i, float* dst) const {
    if (!narrow_) {
      for (int d = 0; d < D_; ++d) dst[d] = g.acc[d * kLanes + i];
    } else if (!direct_) {
      std::memcpy(dst, g.acc + i * D_, D_ * sizeof(float));
    } else {
      const float* acc = g.acc + i * D_;
      for (int c = 0; c < D_; c += 32)
        for (int k = 0; k < 16; ++k) dst[c + 2 * k] = acc[c + k], dst[c + 2 * k + 1] = acc[c + 16 + k];
    }
  }

  // One chunk: the output (acc / l). Several: this chunk's partial (m, l, acc) of every lane.
  void finish(const Request& r, int64_t h, int64_t c, const LaneGroup* groups) const {
    const int64_t lanes = G_ * r.query_len;
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const LaneGroup& g = groups[lane / kLanes];
      const int i = lane % kLanes;
      if (r.num_chunks == 1) {
        float* o = out_row(r, h, lane);
        lane_acc(g, i, o);
        const float l = g.l[i];
        for (int d = 0; d < D_; ++d) o[d] = o[d] / l;
        continue;
      }
      float* p = part_ + r.part_offset + ((h * r.num_chunks + c) * lanes + lane) * (D_ + 2);
      p[0] = g.m[i];
      p[1] = g.l[i];
      lane_acc(g, i, p + 2);
    }
  }

  // Requests whose keys span several chunks: combine the partials in chunk order.
  void combine_all() const {
    std::vector<std::pair<int32_t, int32_t>> todo;  // (request, kv head)
    for (int64_t b = 0; b < B_; ++b)
      if (reqs_[b].num_chunks > 1)
        for (int64_t h = 0; h < Hkv_; ++h) todo.emplace_back(static_cast<int32_t>(b), static_cast<int32_t>(h));
    parallel_for(0, static_cast<int64_t>(todo.size()), 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> a(D_);
      for (int64_t i = lo; i < hi; ++i) {
        const Request& r = reqs_[todo[i].first];
        const int64_t h = todo[i].second;
        const int64_t lanes = G_ * r.query_len;
        const int64_t stride = lanes * (D_ + 2);
        const float* part = part_ + r.part_offset + h * r.num_chunks * stride;
        for (int64_t lane = 0; lane < lanes; ++lane)
          isa_.combine(part + lane * (D_ + 2), r.num_chunks, stride, D_, a.data(), out_row(r, h, lane));
      }
    });
  }

  const PagedAttentionArgs& a_;
  const Isa isa_;
  int64_t T_, H_, bs_, Hkv_, G_, B_, M_, plane_;
  int D_;
  int kind_;
  bool narrow_, direct_;  // every group takes the narrow tile; it reads K and V from the bf16 cache
  std::vector<Request> reqs_;
  std::vector<Item> items_;
  int64_t max_groups_ = 1;
  int64_t part_floats_ = 0, qt_floats_ = 0;
  float* part_ = nullptr;
  float* qt_ = nullptr;  // transposed queries, every request's (transpose_queries)
  const int64_t* tree_ = nullptr;  // [T] ancestor bits of each query row; null: every row causal
};

}  // namespace

void paged_attention_cpu(const PagedAttentionArgs& args) { Kernel(args).run(); }

int64_t attention_cpu_isa(int64_t cap) {
  const int before = active_isa();
  if (cap >= 0) g_isa_cap.store(static_cast<int>(std::min<int64_t>(cap, 4)), std::memory_order_relaxed);
  return before;
}

}  // namespace specrt
