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
// update has an AVX-512 version (attention_avx512.cpp) and a portable one compiled
// twice (AVX2+FMA and baseline); all three return the same bits. A group with
// few live lanes (decode: G heads x 1 token) wastes most of a 16-lane vector,
// so with AVX-512 groups take a "narrow" tile instead, with keys (scores) and
// head dims (p * v) along the vector: the same operations per lane in the same
// order, so the same bits, at a cost proportional to the live lanes (and for
// a decode on a bf16 cache reading K and V in place, no float copy).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "attention_ops.h"
#include "cpu/attention_tile.h"
#include "specrt/attention.h"

namespace specrt {
namespace {

using attn::exp2_det;
using attn::kChunkKeys;
using namespace attn_cpu;  // LaneGroup, Tile, max_f, exp2_avx512, the narrow tile

// ---------------------------------------------------------------- portable version

__attribute__((always_inline)) inline void tile_portable(const Tile& t, LaneGroup& g, int D, int32_t window,
                                                         bool masked) {
  float s[kTileKeys][kLanes];
  for (int j = 0; j < t.n; ++j) {
    float a[kLanes] = {};
    const float* kj = t.k + j * t.stride;
    for (int d = 0; d < D; ++d) {
      const float kd = kj[d];
      const float* qd = g.qt + d * kLanes;
      for (int i = 0; i < kLanes; ++i) a[i] = std::fma(qd[i], kd, a[i]);
    }
    for (int i = 0; i < kLanes; ++i) s[j][i] = a[i];
  }
  if (masked) {
    for (int j = 0; j < t.n; ++j) {
      const int32_t kp = t.k0 + j;
      for (int i = 0; i < kLanes; ++i) {
        const bool visible = kp <= g.pos[i] && (window == 0 || kp > g.pos[i] - window);
        if (!visible) s[j][i] = kNegInf;
      }
    }
  }
  float m_safe[kLanes], alpha[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    float mt = kNegInf;
    for (int j = 0; j < t.n; ++j) mt = max_f(mt, s[j][i]);
    const float m_new = max_f(g.m[i], mt);
    m_safe[i] = m_new == kNegInf ? 0.0f : m_new;
    alpha[i] = exp2_det(g.m[i] - m_safe[i]);
    g.m[i] = m_new;
  }
  for (int j = 0; j < t.n; ++j)
    for (int i = 0; i < kLanes; ++i) s[j][i] = exp2_det(s[j][i] - m_safe[i]);
  for (int i = 0; i < kLanes; ++i) {
    float l = g.l[i] * alpha[i];
    for (int j = 0; j < t.n; ++j) l = l + s[j][i];
    g.l[i] = l;
  }
  for (int d = 0; d < D; ++d) {
    float o[kLanes];
    float* acc = g.acc + d * kLanes;
    for (int i = 0; i < kLanes; ++i) o[i] = acc[i] * alpha[i];
    for (int j = 0; j < t.n; ++j) {
      const float vd = t.v[j * t.stride + d];
      for (int i = 0; i < kLanes; ++i) o[i] = std::fma(s[j][i], vd, o[i]);
    }
    for (int i = 0; i < kLanes; ++i) acc[i] = o[i];
  }
}

// Chunk partials of one lane, stored [chunks][stride] as (m, l, acc[D]), combined in chunk order.
__attribute__((always_inline)) inline void combine_portable(const float* part, int64_t chunks, int64_t stride,
                                                            int D, float* a, float* out) {
  float big_m = kNegInf;
  for (int64_t c = 0; c < chunks; ++c) big_m = max_f(big_m, part[c * stride]);
  float big_l = 0.0f;
  for (int d = 0; d < D; ++d) a[d] = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = part + c * stride;
    const float w = exp2_det(p[0] - big_m);
    big_l = std::fma(p[1], w, big_l);
    for (int d = 0; d < D; ++d) a[d] = std::fma(p[2 + d], w, a[d]);
  }
  for (int d = 0; d < D; ++d) out[d] = a[d] / big_l;
}

// Cache elements -> float (exact for every kind).
__attribute__((always_inline)) inline void convert_portable(const void* src, int kind, int64_t n, float* dst) {
  if (kind == kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src);
  if (kind == kBF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = attn::bf16_bits_to_float(h[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = attn::half_bits_to_float(h[i]);
  }
}

// The portable code compiled for the baseline ISA (fma is a libm call there) and for AVX2+FMA.
void tile_baseline(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  tile_portable(t, g, D, window, masked);
}
void combine_baseline(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out) {
  combine_portable(part, chunks, stride, D, a, out);
}
void convert_baseline(const void* src, int kind, int64_t n, float* dst) { convert_portable(src, kind, n, dst); }

#define SPECRT_AVX2 __attribute__((target("avx2,fma,f16c")))
SPECRT_AVX2 void tile_avx2(const Tile& t, LaneGroup& g, int D, int32_t window, bool masked) {
  tile_portable(t, g, D, window, masked);
}
SPECRT_AVX2 void combine_avx2(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out) {
  combine_portable(part, chunks, stride, D, a, out);
}
SPECRT_AVX2 void convert_avx2(const void* src, int kind, int64_t n, float* dst) {
  convert_portable(src, kind, n, dst);
}

// ---------------------------------------------------------------- AVX-512 version
// The tiles and the conversion are in attention_avx512.cpp; the combine is the portable code.
SPECRT_AVX512 void combine_avx512(const float* part, int64_t chunks, int64_t stride, int D, float* a, float* out) {
  combine_portable(part, chunks, stride, D, a, out);
}

// ---------------------------------------------------------------- dispatch
struct Isa {
  void (*tile)(const Tile&, LaneGroup&, int, int32_t, bool);
  void (*narrow)(const Tile&, LaneGroup&, int, int32_t, bool);  // null: every group takes `tile`
  void (*narrow_bf16)(const Tile&, LaneGroup&, int, int32_t, bool);  // narrow, bf16 cache read in place
  void (*transpose)(const Tile&, int, bool);                          // the narrow tile's keys
  void (*combine)(const float*, int64_t, int64_t, int, float*, float*);
  void (*convert)(const void*, int, int64_t, float*);
};

int detected_isa() {
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return 3;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
    return 0;
  }();
  return level;
}

std::atomic<int> g_isa_cap{3};

int active_isa() { return std::min(detected_isa(), g_isa_cap.load(std::memory_order_relaxed)); }

Isa isa_ops(int level) {
  // 3: AVX-512 with narrow groups; 2: AVX-512, every group 16 lanes wide (same bits, for tests)
  if (level >= 3)
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
  }

  void run() {
    plan();
    const at::Tensor part = at::empty({part_floats_}, a_.q.options());
    part_ = part.data_ptr<float>();
    // dynamic scheduling: items differ in cost; an item's result does not depend on its thread
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(items_.size());
    at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      Scratch sc(Hkv_ * max_groups_, D_);
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) process(items_[i], sc);
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
    Scratch(int64_t num_groups, int D) : buf(num_groups * (2 * D + 2) * kLanes + 3 * kTileKeys * D + 16),
                                         groups(num_groups) {
      // every part is a multiple of 16 floats: from a 64-byte aligned start, no vector load splits a line
      float* p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
      for (auto& g : groups) {
        g.qt = p, p += D * kLanes;
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
      for (int64_t c = 0; c < r.num_chunks; ++c) items_.push_back({static_cast<int32_t>(b), static_cast<int32_t>(c)});
    }
  }

  // Lane i of group gi of kv head h = query (lane / G) of the request, query head h * G + lane % G.
  void setup_group(const Request& r, int64_t h, int64_t gi, LaneGroup& g) const {
    const float* q = a_.q.data_ptr<float>();
    const int64_t lanes = G_ * r.query_len;
    std::fill(g.qt, g.qt + D_ * kLanes, 0.0f);
    std::fill(g.acc, g.acc + D_ * kLanes, 0.0f);
    std::fill(g.m, g.m + kLanes, kNegInf);
    std::fill(g.l, g.l + kLanes, 0.0f);
    g.min_pos = std::numeric_limits<int32_t>::max();
    g.max_pos = -1;
    g.live = static_cast<int>(std::min<int64_t>(kLanes, lanes - gi * kLanes));
    for (int i = 0; i < kLanes; ++i) {
      const int64_t lane = std::min(gi * kLanes + i, lanes - 1);  // padding lanes repeat the last position
      const int64_t qi = lane / G_;
      g.pos[i] = static_cast<int32_t>(r.seq_len - r.query_len + qi);
      if (gi * kLanes + i >= lanes) continue;
      g.min_pos = std::min(g.min_pos, g.pos[i]);
      g.max_pos = std::max(g.max_pos, g.pos[i]);
      const float* qrow = q + ((r.q0 + qi) * H_ + h * G_ + lane % G_) * D_;
      for (int d = 0; d < D_; ++d) g.qt[d * kLanes + i] = qrow[d] * a_.qscale;
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
  // the narrow tile requests them a few per score step while this tile is computed.
  void queue_prefetch(int64_t b, int64_t k0, int64_t k1, Scratch& sc) const {
    const int32_t* table = a_.block_tables.data_ptr<int32_t>() + b * M_;
    const int64_t row_bytes = Hkv_ * D_ * a_.kv_cache.element_size();
    const char* base = static_cast<const char*>(a_.kv_cache.data_ptr());
    Prefetch& p = sc.prefetch;
    p.plane = plane_ * a_.kv_cache.element_size();
    p.segs = p.s = 0;
    p.x = 0;
    int64_t lines = 0;
    for (int64_t kp = k0; kp < k1;) {  // one block segment at a time
      const int64_t off = kp % bs_;
      const int64_t n = std::min(k1 - kp, bs_ - off);
      p.seg[p.segs] = base + (static_cast<int64_t>(table[kp / bs_]) * bs_ + off) * row_bytes;
      p.seg_bytes[p.segs++] = n * row_bytes;
      lines += (n * row_bytes + 63) / 64;
      kp += n;
    }
    // every kv head runs at least one score pass of D steps: drained by the last head's scores
    p.pairs_per_step = static_cast<int>((lines + Hkv_ * D_ - 1) / (Hkv_ * D_));
    if (!narrow_) p.drain();  // the other tiles take them in one burst
  }

  void process(const Item& it, Scratch& sc) const {
    const Request& r = reqs_[it.b];
    const int64_t num_groups = (G_ * r.query_len + kLanes - 1) / kLanes;
    for (int64_t h = 0; h < Hkv_; ++h)
      for (int64_t gi = 0; gi < num_groups; ++gi) setup_group(r, h, gi, sc.groups[h * num_groups + gi]);
    const int64_t c = r.chunk_first + it.c;
    const int64_t key_begin = std::max(c * kChunkKeys, r.first_key);
    const int64_t key_end = std::min((c + 1) * kChunkKeys, r.seq_len);
    const int32_t window = static_cast<int32_t>(a_.window > 0 && a_.window < r.seq_len ? a_.window : 0);
    const uint16_t* cache16 = static_cast<const uint16_t*>(a_.kv_cache.data_ptr());
    const int32_t* table = a_.block_tables.data_ptr<int32_t>() + it.b * M_;
    for (int64_t t0 = key_begin - key_begin % kTileKeys; t0 < key_end; t0 += kTileKeys) {
      const int64_t k0 = std::max(t0, key_begin), k1 = std::min(t0 + kTileKeys, key_end);
      // the next tile, also across the chunk's end (the same thread usually takes the next chunk)
      queue_prefetch(it.b, t0 + kTileKeys, std::min(t0 + 2 * kTileKeys, r.seq_len), sc);
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
        Tile tile{sc.kbuf, sc.vbuf, D_, static_cast<int>(k1 - k0), static_cast<int32_t>(k0), sc.kt};
        tile.prefetch = &sc.prefetch;
        if (direct_) {
          for (int64_t j = 0; j < kTileKeys; ++j) sc.rows[j] = cache16 + sc.off[j] + h * D_;
          tile.rows = sc.rows;
          tile.vplane = plane_;
        } else {
          load_tile(it.b, h, k0, k1, sc);
        }
        if (narrow_) isa_.transpose(tile, D_, direct_);
        for (int64_t gi = 0; gi < num_groups; ++gi) {
          LaneGroup& g = sc.groups[h * num_groups + gi];
          // a tile no lane of the group can see changes nothing (see attention.h): skip it
          if (k0 > g.max_pos || (window != 0 && k1 - 1 <= g.min_pos - window)) continue;
          const bool masked = k1 - 1 > g.min_pos || (window != 0 && k0 <= g.max_pos - window);
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

  // One chunk: the output (acc / l). Several: this chunk's partial (m, l, acc) of every lane.
  void finish(const Request& r, int64_t h, int64_t c, const LaneGroup* groups) const {
    const int64_t lanes = G_ * r.query_len;
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const LaneGroup& g = groups[lane / kLanes];
      const int i = lane % kLanes;
      const float* acc = narrow_ ? g.acc + i * D_ : g.acc + i;  // [lane][D] or [D][16]
      const int64_t step = narrow_ ? 1 : kLanes;
      if (r.num_chunks == 1) {
        float* o = out_row(r, h, lane);
        for (int d = 0; d < D_; ++d) o[d] = acc[d * step] / g.l[i];
        continue;
      }
      float* p = part_ + r.part_offset + ((h * r.num_chunks + c) * lanes + lane) * (D_ + 2);
      p[0] = g.m[i];
      p[1] = g.l[i];
      for (int d = 0; d < D_; ++d) p[2 + d] = acc[d * step];
    }
  }

  // Requests whose keys span several chunks: combine the partials in chunk order.
  void combine_all() const {
    std::vector<std::pair<int32_t, int32_t>> todo;  // (request, kv head)
    for (int64_t b = 0; b < B_; ++b)
      if (reqs_[b].num_chunks > 1)
        for (int64_t h = 0; h < Hkv_; ++h) todo.emplace_back(static_cast<int32_t>(b), static_cast<int32_t>(h));
    at::parallel_for(0, static_cast<int64_t>(todo.size()), 1, [&](int64_t lo, int64_t hi) {
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
  int64_t part_floats_ = 0;
  float* part_ = nullptr;
};

}  // namespace

void paged_attention_cpu(const PagedAttentionArgs& args) { Kernel(args).run(); }

int64_t attention_cpu_isa(int64_t cap) {
  const int before = active_isa();
  if (cap >= 0) g_isa_cap.store(static_cast<int>(std::min<int64_t>(cap, 3)), std::memory_order_relaxed);
  return before;
}

}  // namespace specrt
