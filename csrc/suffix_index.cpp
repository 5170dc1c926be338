// specrt._C.SuffixIndex: the token index behind suffix drafting (specrt/drafters/suffix.py).
//
// Its semantics are specrt/drafters/suffix_ref.py's (a naive scan); tests/test_suffix_index.py
// checks that both answer identically. Design, a suffix array kept in LSM segments:
//  * text: one int32 vector per sequence; a suffix is (slot, pos), 8 bytes.
//  * suffixes are ordered by their first max_span tokens (a suffix that ends sorts before its
//    continuations). That order is final only once max_span tokens follow a position, so the
//    last positions of a sequence wait in its unsorted "tail", which queries scan linearly.
//  * stable positions are sorted in batches into segments; a new segment is merged with the one
//    before it while it is at least 1/kGrowth of its size (a few segments, linear merges).
//  * once the tails of the sequences other than the last one appended to pass kSealTail positions,
//    they are sealed: sorted as they are (the global index, where each output is appended once,
//    keeps a short tail); if a sealed sequence grows again, its sealed positions are purged from
//    the segments and go back to its tail. remove() and eviction purge too (one filtering pass
//    over the segments that may hold the sequence).
//  * a query finds the longest matching context suffix (extending the occurrences of the context's
//    last token backwards where it is rare, else binary-searching the length), then the pattern's
//    range in each segment; within a tree node's range the suffixes are sorted by the next token,
//    so each child is a sub-range found by galloping (exact counts, no sampling). An excluded
//    sequence is scanned in full and its occurrences subtracted.
// Memory: 4 bytes of text + 8 of suffix array per token: memory_bytes() is 12.1 bytes/token for
// 1M random tokens in 1000 sequences (tests/test_suffix_index.py prints it), 14-16 for a 4k-token
// per-request index (vector growth). Speed (one core, 4k-token sequence, max_match 16,
// max_depth 16, max_nodes 32): 2-4 us per draft call from Python, 0.1-0.2 us per appended token
// (1-8 a call); 1M-token global index: 4-6 us per draft call.
// Not thread-safe: the calls hold the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace specrt {
namespace {

namespace py = pybind11;

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
constexpr uint32_t kBatch = 64;        // stable tail positions that make a new segment
constexpr uint32_t kSealTail = 512;    // tail positions of idle sequences that get sealed
constexpr int64_t kScanEnds = 256;     // context's last token rarer than this: find the match by scanning
constexpr uint64_t kGrowth = 4;        // merge a segment into its predecessor when >= 1/kGrowth of it

struct Entry {  // a suffix: sequence slot and start position
  uint32_t slot, pos;
};

struct Seq {
  int64_t id = -1;
  uint64_t serial = 0;          // creation order: eviction is oldest-first
  std::vector<int32_t> tok;
  uint32_t indexed = 0;         // positions [0, indexed) are in segments, [indexed, size) the tail
  bool in_tails = false;        // listed in tails_ (has a non-empty tail)
};

struct Segment {
  std::vector<Entry> sa;        // sorted by the first span_ tokens of each suffix
  uint64_t min_serial = 0, max_serial = 0;  // the sequences it may hold (purges skip the rest)
};

// Query scratch: a node's occurrences are segment ranges, tail occurrences and, when a sequence
// is excluded, that sequence's occurrences inside the ranges (subtracted from the counts).
struct Range {
  uint32_t seg, lo, hi;
};
struct Occ {  // an occurrence whose continuation starts at tok[at] of sequence slot
  uint32_t slot, at;
};
struct Hit {  // a tail end position and the longest context suffix that ends there
  uint32_t slot, at, len;
};
struct Node {
  double prob;
  int64_t count;
  int32_t depth, token, parent, out;  // parent: node index; out: index in the draft (-1: not yet)
  uint32_t rep_slot, rep_at;          // an occurrence: the path is tok[rep_at, rep_at + depth)
  uint32_t r0, r1, o0, o1, n0, n1;    // its ranges_, occ_ and neg_ slices
};
struct Cand {  // a child's share from one source: kind 0 segment range, 1 tail occs, 2 excluded
  int32_t token;
  uint32_t kind, seg, lo, hi;
};

class SuffixIndex {
 public:
  SuffixIndex(int64_t max_span, int64_t max_tokens) {
    if (max_span < 2 || max_span > 4096)
      throw std::invalid_argument("max_span must be in [2, 4096], got " + std::to_string(max_span));
    if (max_tokens < 0)
      throw std::invalid_argument("max_tokens must be >= 0 (0: unbounded), got " + std::to_string(max_tokens));
    span_ = static_cast<uint32_t>(max_span);
    max_tokens_ = max_tokens;
  }

  int64_t max_span() const { return span_; }
  int64_t max_tokens() const { return max_tokens_; }
  size_t size() const { return ids_.size(); }
  int64_t num_tokens() const { return total_; }
  bool contains(int64_t id) const { return ids_.count(id) != 0; }

  std::vector<int32_t> sequence(int64_t id) const {
    auto it = ids_.find(id);
    if (it == ids_.end()) throw py::key_error("no sequence " + std::to_string(id));
    return seqs_[it->second].tok;
  }

  void append(int64_t id, const std::vector<int64_t>& tokens) {
    if (id < 0) throw std::invalid_argument("seq_id must be >= 0, got " + std::to_string(id));
    for (int64_t t : tokens)
      if (t < 0 || t > std::numeric_limits<int32_t>::max())
        throw std::invalid_argument("tokens must be in [0, 2**31), got " + std::to_string(t));
    auto it = ids_.find(id);
    const uint32_t slot = it == ids_.end() ? create(id) : it->second;
    if (!tokens.empty()) {
      Seq& s = seqs_[slot];
      const uint32_t len = static_cast<uint32_t>(s.tok.size());
      if (s.indexed > stable_end(len)) {  // sealed: its unstable positions must be sorted again
        cuts_.push_back({slot, stable_end(len)});
        s.indexed = stable_end(len);
      }
      s.tok.insert(s.tok.end(), tokens.begin(), tokens.end());
      total_ += static_cast<int64_t>(tokens.size());
      if (!s.in_tails) {
        s.in_tails = true;
        tails_.push_back(slot);
      }
    }
    if (max_tokens_ > 0 && total_ > max_tokens_) evict(slot);
    if (!cuts_.empty()) purge();
    flush(slot);
  }

  bool remove(int64_t id) {
    auto it = ids_.find(id);
    if (it == ids_.end()) return false;
    cuts_.push_back({it->second, 0});
    purge();
    drop(it->second);
    return true;
  }

  size_t memory_bytes() const {
    size_t b = sizeof(*this) + seqs_.capacity() * sizeof(Seq) + segs_.capacity() * sizeof(Segment);
    for (const Seq& s : seqs_) b += s.tok.capacity() * sizeof(int32_t);
    for (const Segment& g : segs_) b += g.sa.capacity() * sizeof(Entry);
    // hash and tree nodes: the key-value pair plus about two pointers (bucket links, tree links)
    b += ids_.bucket_count() * sizeof(void*) + ids_.size() * (sizeof(std::pair<int64_t, uint32_t>) + 2 * sizeof(void*));
    b += order_.size() * (sizeof(std::pair<uint64_t, uint32_t>) + 4 * sizeof(void*));
    b += (free_.capacity() + tails_.capacity() + cut_of_.capacity()) * sizeof(uint32_t) +
         cuts_.capacity() * sizeof(Entry);
    b += ctx_.capacity() * sizeof(int32_t) + (hits_.capacity() + negs_hits_.capacity()) * sizeof(Hit) +
         (occ_.capacity() + neg_.capacity()) * sizeof(Occ) + ranges_.capacity() * sizeof(Range) +
         nodes_.capacity() * sizeof(Node) + cand_.capacity() * sizeof(Cand) + heap_.capacity() * sizeof(uint32_t);
    return b;
  }

  // Fills out_*; see suffix_ref.ReferenceSuffixIndex.draft.
  void draft(const std::vector<int64_t>& context, int64_t max_match, int64_t min_match, int64_t max_nodes,
             int64_t max_depth, double min_prob, int64_t exclude) {
    check_args(max_match, min_match, max_nodes, max_depth, min_prob);
    out_match_ = 0;
    out_tokens_.clear();
    out_parents_.clear();
    out_probs_.clear();
    out_counts_.clear();
    const int64_t mmax = std::min<int64_t>(max_match, static_cast<int64_t>(context.size()));
    if (mmax < min_match) return;
    mmax_ = static_cast<uint32_t>(mmax);
    ctx_.resize(mmax_);  // the last mmax context tokens; values no token can have become -1
    for (uint32_t i = 0; i < mmax_; ++i) {
      const int64_t t = context[context.size() - mmax_ + i];
      ctx_[i] = (t < 0 || t > std::numeric_limits<int32_t>::max()) ? -1 : static_cast<int32_t>(t);
    }
    uint32_t excl = kNone;
    if (exclude >= 0) {
      auto it = ids_.find(exclude);
      if (it != ids_.end()) excl = it->second;
    }
    const uint32_t min_m = static_cast<uint32_t>(min_match);

    // Tails: each end position and the longest context suffix that ends there. An occurrence
    // that starts in the tail is a hit (lengths capped to stay in it); best takes any length.
    hits_.clear();
    uint32_t best = min_m - 1;
    for (uint32_t slot : tails_) {
      if (slot == excl) continue;
      const Seq& s = seqs_[slot];
      const uint32_t len = static_cast<uint32_t>(s.tok.size());
      for (uint32_t e = s.indexed + 1; e < len; ++e) {
        const uint32_t l = suffix_match(s.tok.data(), e, std::min(mmax_, e));
        best = std::max(best, l);
        if (std::min(l, e - s.indexed) >= min_m) hits_.push_back({slot, e, std::min(l, e - s.indexed)});
      }
    }
    // The excluded sequence's occurrences that start in the segments (their counts come off).
    negs_hits_.clear();
    if (excl != kNone) {
      const Seq& s = seqs_[excl];
      for (uint32_t e = 1; e < s.tok.size(); ++e) {
        const uint32_t l = suffix_match(s.tok.data(), e, std::min(mmax_, e));
        if (l >= min_m && e - l < s.indexed) negs_hits_.push_back({excl, e, l});
      }
    }
    excl_ = excl;

    // The match: the largest m with an occurrence (one at m implies one at m - 1). Every
    // occurrence ends with the context's last token: where that token is rare in the segments,
    // extend each of its occurrences backwards; else binary-search m over the segments.
    if (best < mmax_) {
      ranges_.clear();
      int64_t ends = 0;
      for (uint32_t g = 0; g < segs_.size() && ends <= kScanEnds; ++g) {
        const Range r = pattern_range(g, ctx_.data() + mmax_ - 1, 1);
        if (r.lo < r.hi) ranges_.push_back(r);
        ends += r.hi - r.lo;
      }
      if (ends <= kScanEnds) {
        for (const Range& r : ranges_)
          for (uint32_t i = r.lo; i < r.hi; ++i) {
            const Entry& e = segs_[r.seg].sa[i];
            if (e.slot != excl)
              best = std::max(best, suffix_match(seqs_[e.slot].tok.data(), e.pos + 1, std::min(mmax_, e.pos + 1)));
          }
      } else if (segment_has(best + 1)) {
        uint32_t lo = best + 1, hi = mmax_ + 1;  // lo has occurrences, hi has none
        if (segment_has(mmax_)) lo = mmax_;
        while (hi - lo > 1) {
          const uint32_t mid = lo + (hi - lo) / 2;
          (segment_has(mid) ? lo : hi) = mid;
        }
        best = lo;
      }
    }
    if (best < min_m) return;
    m_ = best;
    out_match_ = best;

    // The root: all occurrences of the pattern.
    ranges_.clear();
    occ_.clear();
    neg_.clear();
    nodes_.clear();
    heap_.clear();
    const int32_t* pat = ctx_.data() + (mmax_ - m_);
    for (uint32_t g = 0; g < segs_.size(); ++g) {
      const Range r = pattern_range(g, pat, m_);
      if (r.lo < r.hi) ranges_.push_back(r);
    }
    for (const Hit& h : hits_)
      if (h.len >= m_) occ_.push_back({h.slot, h.at});
    for (const Hit& h : negs_hits_)
      if (h.len >= m_ && h.at - m_ < seqs_[excl].indexed) neg_.push_back({h.slot, h.at});
    int64_t count = static_cast<int64_t>(occ_.size()) - static_cast<int64_t>(neg_.size());
    for (const Range& r : ranges_) count += r.hi - r.lo;
    nodes_.push_back({1.0, count, 0, -1, -1, -1, 0, 0, 0, static_cast<uint32_t>(ranges_.size()), 0,
                      static_cast<uint32_t>(occ_.size()), 0, static_cast<uint32_t>(neg_.size())});
    min_prob_ = min_prob;
    expand(0);

    // Best first: pop, stop below min_prob, output, expand while shallower than max_depth.
    auto worse = [this](uint32_t a, uint32_t b) { return pops_after(a, b); };
    while (!heap_.empty() && static_cast<int64_t>(out_tokens_.size()) < max_nodes) {
      std::pop_heap(heap_.begin(), heap_.end(), worse);
      const uint32_t ni = heap_.back();
      heap_.pop_back();
      Node& n = nodes_[ni];
      if (n.prob < min_prob) break;
      n.out = static_cast<int32_t>(out_tokens_.size());
      out_tokens_.push_back(n.token);
      out_parents_.push_back(nodes_[n.parent].out);
      out_probs_.push_back(n.prob);
      out_counts_.push_back(n.count);
      if (n.depth < max_depth) expand(ni);
    }
  }

  py::tuple draft_result() const {
    return py::make_tuple(out_match_, py::cast(out_tokens_), py::cast(out_parents_), py::cast(out_probs_),
                          py::cast(out_counts_));
  }

 private:
  uint32_t stable_end(uint32_t len) const { return len >= span_ ? len - span_ + 1 : 0; }
  const int32_t* text(const Entry& e) const { return seqs_[e.slot].tok.data() + e.pos; }
  uint32_t rest(const Entry& e) const { return static_cast<uint32_t>(seqs_[e.slot].tok.size()) - e.pos; }

  void check_args(int64_t max_match, int64_t min_match, int64_t max_nodes, int64_t max_depth, double min_prob) const {
    auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
    if (min_match < 1) fail("min_match must be >= 1, got " + std::to_string(min_match));
    if (max_match < min_match)
      fail("max_match must be >= min_match (" + std::to_string(min_match) + "), got " + std::to_string(max_match));
    if (max_nodes < 0) fail("max_nodes must be >= 0, got " + std::to_string(max_nodes));
    if (max_depth < 1) fail("max_depth must be >= 1, got " + std::to_string(max_depth));
    if (!(min_prob >= 0.0 && min_prob <= 1.0)) fail("min_prob must be in [0, 1], got " + std::to_string(min_prob));
    if (max_match > static_cast<int64_t>(span_) - max_depth)
      fail("max_match + max_depth (" + std::to_string(max_match) + " + " + std::to_string(max_depth) +
           ") must be <= max_span (" + std::to_string(span_) + ")");
  }

  // Suffix order: the first span_ tokens, a suffix that ends first being the smaller.
  bool less(const Entry& a, const Entry& b) const {
    const int32_t* x = text(a);
    const int32_t* y = text(b);
    const uint32_t ra = std::min(rest(a), span_), rb = std::min(rest(b), span_);
    const uint32_t n = std::min(ra, rb);
    for (uint32_t i = 0; i < n; ++i)
      if (x[i] != y[i]) return x[i] < y[i];
    return ra < rb;
  }

  // <0, 0, >0: suffix e against pattern p (q <= span_ tokens), 0 when e starts with p.
  int compare_prefix(const Entry& e, const int32_t* p, uint32_t q) const {
    const int32_t* x = text(e);
    const uint32_t r = rest(e), n = std::min(r, q);
    for (uint32_t i = 0; i < n; ++i)
      if (x[i] != p[i]) return x[i] < p[i] ? -1 : 1;
    return r < q ? -1 : 0;
  }

  // How many of the last tokens before tok[end] equal the context's last ones (at most cap).
  uint32_t suffix_match(const int32_t* tok, uint32_t end, uint32_t cap) const {
    const int32_t* c = ctx_.data() + mmax_;
    uint32_t l = 0;
    while (l < cap && tok[end - 1 - l] == c[-1 - static_cast<int32_t>(l)]) ++l;
    return l;
  }

  // In sa[lo, hi), all starting with the same d tokens: the first suffix longer than d (those
  // that end at d sort first).
  uint32_t first_longer(const std::vector<Entry>& sa, uint32_t lo, uint32_t hi, uint32_t d) const {
    if (lo >= hi || rest(sa[lo]) > d) return lo;
    while (hi - lo > 1) {  // invariant: sa[lo] ends at d; sa[hi] (if any) does not
      const uint32_t mid = lo + (hi - lo) / 2;
      (rest(sa[mid]) > d ? hi : lo) = mid;
    }
    return hi;
  }

  // The suffixes of segment g that start with p (q tokens) and continue past it.
  Range pattern_range(uint32_t g, const int32_t* p, uint32_t q) const {
    const std::vector<Entry>& sa = segs_[g].sa;
    uint32_t lo = 0, hi = static_cast<uint32_t>(sa.size());
    while (lo < hi) {  // first >= p
      const uint32_t mid = lo + (hi - lo) / 2;
      if (compare_prefix(sa[mid], p, q) < 0) lo = mid + 1; else hi = mid;
    }
    uint32_t end = static_cast<uint32_t>(sa.size());
    for (uint32_t a = lo; a < end;) {  // first > p
      const uint32_t mid = a + (end - a) / 2;
      if (compare_prefix(sa[mid], p, q) <= 0) a = mid + 1; else end = mid;
    }
    return {g, first_longer(sa, lo, end, q), end};
  }

  // Whether the context's last m tokens occur (with a continuation) in the segments, the
  // excluded sequence's occurrences not counting.
  bool segment_has(uint32_t m) const {
    const int32_t* p = ctx_.data() + (mmax_ - m);
    int64_t n = 0;
    for (uint32_t g = 0; g < segs_.size(); ++g) {
      const std::vector<Entry>& sa = segs_[g].sa;
      uint32_t lo = 0, hi = static_cast<uint32_t>(sa.size());
      while (lo < hi) {  // first >= p
        const uint32_t mid = lo + (hi - lo) / 2;
        if (compare_prefix(sa[mid], p, m) < 0) lo = mid + 1; else hi = mid;
      }
      if (lo == sa.size() || compare_prefix(sa[lo], p, m) != 0) continue;
      if (excl_ == kNone && rest(sa[lo]) > m) return true;
      const Range r = pattern_range(g, p, m);
      n += r.hi - r.lo;
    }
    if (excl_ != kNone) {
      const uint32_t indexed = seqs_[excl_].indexed;
      for (const Hit& h : negs_hits_) n -= (h.len >= m && h.at - m < indexed) ? 1 : 0;
    }
    return n > 0;
  }

  // Node a is drafted after node b: lower probability, then deeper, then the larger token path.
  bool pops_after(uint32_t a, uint32_t b) const {
    const Node& x = nodes_[a];
    const Node& y = nodes_[b];
    if (x.prob != y.prob) return x.prob < y.prob;
    if (x.depth != y.depth) return x.depth > y.depth;
    const int32_t* p = seqs_[x.rep_slot].tok.data() + x.rep_at;
    const int32_t* q = seqs_[y.rep_slot].tok.data() + y.rep_at;
    for (int32_t i = 0; i < x.depth; ++i)
      if (p[i] != q[i]) return p[i] > q[i];
    return false;
  }

  // Sorts occurrence list v[a, b) by the token at offset depth (ended ones first) and adds its
  // runs as candidates of the given kind.
  void occ_runs(std::vector<Occ>& v, uint32_t a, uint32_t b, uint32_t depth, uint32_t kind) {
    auto next = [&](const Occ& o) {
      const std::vector<int32_t>& t = seqs_[o.slot].tok;
      return o.at + depth < t.size() ? t[o.at + depth] : -1;
    };
    std::sort(v.begin() + a, v.begin() + b, [&](const Occ& x, const Occ& y) { return next(x) < next(y); });
    for (uint32_t i = a; i < b;) {
      const int32_t t = next(v[i]);
      uint32_t j = i + 1;
      while (j < b && next(v[j]) == t) ++j;
      if (t >= 0) cand_.push_back({t, kind, 0, i, j});
      i = j;
    }
  }

  // Creates node ni's children (those at or above min_prob: the rest could never be drafted) and
  // pushes them on the heap.
  void expand(uint32_t ni) {
    const Node x = nodes_[ni];
    const uint32_t d = m_ + static_cast<uint32_t>(x.depth);  // the children's token, from a suffix start
    cand_.clear();
    for (uint32_t r = x.r0; r < x.r1; ++r) {
      const Range rg = ranges_[r];
      const std::vector<Entry>& sa = segs_[rg.seg].sa;
      for (uint32_t lo = first_longer(sa, rg.lo, rg.hi, d); lo < rg.hi;) {
        const int32_t t = text(sa[lo])[d];
        // gallop then bisect to the end of t's run
        uint32_t a = lo, b = lo + 1, step = 1;
        while (b < rg.hi && text(sa[b])[d] == t) {
          a = b;
          step <<= 1;
          b = a + step;
        }
        b = std::min(b, rg.hi);
        while (b - a > 1) {
          const uint32_t mid = a + (b - a) / 2;
          (text(sa[mid])[d] == t ? a : b) = mid;
        }
        cand_.push_back({t, 0, rg.seg, lo, b});
        lo = b;
      }
    }
    occ_runs(occ_, x.o0, x.o1, static_cast<uint32_t>(x.depth), 1);
    occ_runs(neg_, x.n0, x.n1, static_cast<uint32_t>(x.depth), 2);
    std::sort(cand_.begin(), cand_.end(),
              [](const Cand& p, const Cand& q) { return p.token != q.token ? p.token < q.token : p.kind < q.kind; });
    auto worse = [this](uint32_t a, uint32_t b) { return pops_after(a, b); };
    for (size_t i = 0; i < cand_.size();) {
      size_t j = i;
      Node c{0.0, 0, x.depth + 1, cand_[i].token, static_cast<int32_t>(ni), -1, 0, 0,
             static_cast<uint32_t>(ranges_.size()), 0, 0, 0, 0, 0};
      bool rep = false;
      for (; j < cand_.size() && cand_[j].token == c.token; ++j) {
        const Cand& k = cand_[j];
        if (k.kind == 0) {
          ranges_.push_back({k.seg, k.lo, k.hi});
          c.count += k.hi - k.lo;
          if (!rep) {
            const Entry& e = segs_[k.seg].sa[k.lo];
            c.rep_slot = e.slot;
            c.rep_at = e.pos + m_;
            rep = true;
          }
        } else if (k.kind == 1) {
          c.o0 = k.lo;
          c.o1 = k.hi;
          c.count += k.hi - k.lo;
          if (!rep) {
            c.rep_slot = occ_[k.lo].slot;
            c.rep_at = occ_[k.lo].at;
            rep = true;
          }
        } else {
          c.n0 = k.lo;
          c.n1 = k.hi;
          c.count -= k.hi - k.lo;
        }
      }
      c.r1 = static_cast<uint32_t>(ranges_.size());
      i = j;
      if (c.count <= 0) continue;  // only the excluded sequence continues this way
      c.prob = x.prob * (static_cast<double>(c.count) / static_cast<double>(x.count));
      if (c.prob < min_prob_) continue;
      nodes_.push_back(c);
      heap_.push_back(static_cast<uint32_t>(nodes_.size() - 1));
      std::push_heap(heap_.begin(), heap_.end(), worse);
    }
  }

  uint32_t create(int64_t id) {
    uint32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      slot = static_cast<uint32_t>(seqs_.size());
      seqs_.emplace_back();
    }
    Seq& s = seqs_[slot];
    s.id = id;
    s.serial = next_serial_++;
    s.indexed = 0;
    s.in_tails = false;
    ids_.emplace(id, slot);
    order_.emplace(s.serial, slot);
    return slot;
  }

  // Forgets a sequence whose suffixes are no longer in any segment.
  void drop(uint32_t slot) {
    Seq& s = seqs_[slot];
    total_ -= static_cast<int64_t>(s.tok.size());
    ids_.erase(s.id);
    order_.erase(s.serial);
    std::vector<int32_t>().swap(s.tok);
    if (s.in_tails) tails_.erase(std::find(tails_.begin(), tails_.end(), slot));
    s.in_tails = false;
    s.indexed = 0;
    free_.push_back(slot);
  }

  // Oldest-first whole-sequence eviction down to max_tokens_, sparing the sequence keep.
  void evict(uint32_t keep) {
    std::vector<uint32_t> victims;
    int64_t left = total_;
    for (auto it = order_.begin(); it != order_.end() && left > max_tokens_; ++it) {
      if (it->second == keep) continue;
      victims.push_back(it->second);
      left -= static_cast<int64_t>(seqs_[it->second].tok.size());
    }
    for (uint32_t v : victims) cuts_.push_back({v, 0});
    purge();
    for (uint32_t v : victims) drop(v);
  }

  // Removes the suffixes listed in cuts_ (slot, from: positions >= from) from the segments.
  void purge() {
    if (cut_of_.size() < seqs_.size()) cut_of_.resize(seqs_.size(), kNone);
    uint64_t lo = std::numeric_limits<uint64_t>::max(), hi = 0;
    for (const Entry& c : cuts_) {
      cut_of_[c.slot] = c.pos;
      lo = std::min(lo, seqs_[c.slot].serial);
      hi = std::max(hi, seqs_[c.slot].serial);
    }
    for (Segment& g : segs_) {
      if (g.max_serial < lo || g.min_serial > hi) continue;
      auto end = std::remove_if(g.sa.begin(), g.sa.end(), [&](const Entry& e) { return e.pos >= cut_of_[e.slot]; });
      g.sa.erase(end, g.sa.end());
      if (g.sa.size() < g.sa.capacity() / 4 * 3) g.sa.shrink_to_fit();
    }
    segs_.erase(std::remove_if(segs_.begin(), segs_.end(), [](const Segment& g) { return g.sa.empty(); }),
                segs_.end());
    for (const Entry& c : cuts_) cut_of_[c.slot] = kNone;
    cuts_.clear();
  }

  // Sorts the tails' stable positions into a new segment once there are kBatch of them, and seals
  // the tails of sequences other than keep once those pass kSealTail positions.
  void flush(uint32_t keep) {
    uint64_t stable = 0, idle = 0;
    for (uint32_t slot : tails_) {
      const Seq& s = seqs_[slot];
      const uint32_t len = static_cast<uint32_t>(s.tok.size());
      stable += stable_end(len) - s.indexed;
      if (slot != keep) idle += len - s.indexed;
    }
    const bool seal = idle > kSealTail;
    if (stable < kBatch && !seal) return;
    Segment g;
    g.min_serial = std::numeric_limits<uint64_t>::max();
    for (uint32_t slot : tails_) {
      Seq& s = seqs_[slot];
      const uint32_t len = static_cast<uint32_t>(s.tok.size());
      const uint32_t end = (seal && slot != keep) ? len : stable_end(len);
      if (end > s.indexed) {
        g.min_serial = std::min(g.min_serial, s.serial);
        g.max_serial = std::max(g.max_serial, s.serial);
      }
      for (uint32_t p = s.indexed; p < end; ++p) g.sa.push_back({slot, p});
      s.indexed = end;
      s.in_tails = end < len;
    }
    tails_.erase(std::remove_if(tails_.begin(), tails_.end(), [&](uint32_t slot) { return !seqs_[slot].in_tails; }),
                 tails_.end());
    if (g.sa.empty()) return;
    std::sort(g.sa.begin(), g.sa.end(), [this](const Entry& a, const Entry& b) { return less(a, b); });
    g.sa.shrink_to_fit();
    segs_.push_back(std::move(g));
    while (segs_.size() >= 2 && segs_.back().sa.size() * kGrowth >= segs_[segs_.size() - 2].sa.size()) {
      Segment& a = segs_[segs_.size() - 2];
      Segment& b = segs_.back();
      Segment merged;
      merged.sa.resize(a.sa.size() + b.sa.size());
      std::merge(a.sa.begin(), a.sa.end(), b.sa.begin(), b.sa.end(), merged.sa.begin(),
                 [this](const Entry& x, const Entry& y) { return less(x, y); });
      merged.min_serial = std::min(a.min_serial, b.min_serial);
      merged.max_serial = std::max(a.max_serial, b.max_serial);
      segs_.pop_back();
      segs_.back() = std::move(merged);
    }
  }

  uint32_t span_ = 64;
  int64_t max_tokens_ = 0;
  int64_t total_ = 0;
  uint64_t next_serial_ = 0;
  std::vector<Seq> seqs_;                       // by slot
  std::unordered_map<int64_t, uint32_t> ids_;   // seq_id -> slot
  std::map<uint64_t, uint32_t> order_;          // serial -> slot, oldest first
  std::vector<uint32_t> free_;                  // reusable slots
  std::vector<uint32_t> tails_;                 // slots with a non-empty tail
  std::vector<Segment> segs_;                   // oldest (largest) first
  std::vector<Entry> cuts_;                     // pending purges: (slot, first position to drop)
  std::vector<uint32_t> cut_of_;                // purge(): per slot, the first position dropped

  // draft() scratch and result
  uint32_t mmax_ = 0, m_ = 0, excl_ = kNone;
  double min_prob_ = 0.0;
  std::vector<int32_t> ctx_;
  std::vector<Hit> hits_, negs_hits_;
  std::vector<Occ> occ_, neg_;
  std::vector<Range> ranges_;
  std::vector<Node> nodes_;
  std::vector<Cand> cand_;
  std::vector<uint32_t> heap_;
  int64_t out_match_ = 0;
  std::vector<int32_t> out_tokens_, out_parents_;
  std::vector<double> out_probs_;
  std::vector<int64_t> out_counts_;
};

}  // namespace

void bind_suffix_index(py::module_& m) {
  py::class_<SuffixIndex>(m, "SuffixIndex",
                          "Suffix index for suffix drafting; semantics: specrt.drafters.suffix_ref.ReferenceSuffixIndex")
      .def(py::init<int64_t, int64_t>(), py::arg("max_span") = 64, py::arg("max_tokens") = 0)
      .def("append", &SuffixIndex::append, py::arg("seq_id"), py::arg("tokens"))
      .def("remove", &SuffixIndex::remove, py::arg("seq_id"))
      .def("__contains__", &SuffixIndex::contains, py::arg("seq_id"))
      .def("__len__", &SuffixIndex::size)
      .def_property_readonly("num_tokens", &SuffixIndex::num_tokens)
      .def_property_readonly("max_span", &SuffixIndex::max_span)
      .def_property_readonly("max_tokens", &SuffixIndex::max_tokens)
      .def("memory_bytes", &SuffixIndex::memory_bytes)
      .def("sequence", &SuffixIndex::sequence, py::arg("seq_id"))
      .def(
          "draft",
          [](SuffixIndex& self, const std::vector<int64_t>& context, int64_t max_match, int64_t min_match,
             int64_t max_nodes, int64_t max_depth, double min_prob, int64_t exclude) {
            self.draft(context, max_match, min_match, max_nodes, max_depth, min_prob, exclude);
            return self.draft_result();
          },
          py::arg("context"), py::arg("max_match"), py::arg("min_match"), py::arg("max_nodes"),
          py::arg("max_depth"), py::arg("min_prob"), py::arg("exclude") = -1);
}

}  // namespace specrt
