// The query of specrt._C.SuffixIndex (csrc/suffix_index.h): draft() finds the longest matching
// context suffix, then grows the draft tree best first from the pattern's occurrences in the
// segments and the tails (semantics: specrt/drafters/suffix_ref.py).
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "suffix_index.h"

namespace specrt::suffix {

void SuffixIndex::draft(const std::vector<int64_t>& context, int64_t max_match, int64_t min_match,
                        int64_t max_nodes, int64_t max_depth, double min_prob, int64_t exclude) {
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

py::tuple SuffixIndex::draft_result() const {
  return py::make_tuple(out_match_, py::cast(out_tokens_), py::cast(out_parents_), py::cast(out_probs_),
                        py::cast(out_counts_));
}

int SuffixIndex::compare_prefix(const Entry& e, const int32_t* p, uint32_t q) const {
  const int32_t* x = text(e);
  const uint32_t r = rest(e), n = std::min(r, q);
  for (uint32_t i = 0; i < n; ++i)
    if (x[i] != p[i]) return x[i] < p[i] ? -1 : 1;
  return r < q ? -1 : 0;
}

uint32_t SuffixIndex::suffix_match(const int32_t* tok, uint32_t end, uint32_t cap) const {
  const int32_t* c = ctx_.data() + mmax_;
  uint32_t l = 0;
  while (l < cap && tok[end - 1 - l] == c[-1 - static_cast<int32_t>(l)]) ++l;
  return l;
}

uint32_t SuffixIndex::first_longer(const std::vector<Entry>& sa, uint32_t lo, uint32_t hi, uint32_t d) const {
  if (lo >= hi || rest(sa[lo]) > d) return lo;
  while (hi - lo > 1) {  // invariant: sa[lo] ends at d; sa[hi] (if any) does not
    const uint32_t mid = lo + (hi - lo) / 2;
    (rest(sa[mid]) > d ? hi : lo) = mid;
  }
  return hi;
}

Range SuffixIndex::pattern_range(uint32_t g, const int32_t* p, uint32_t q) const {
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

bool SuffixIndex::segment_has(uint32_t m) const {
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

bool SuffixIndex::pops_after(uint32_t a, uint32_t b) const {
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

void SuffixIndex::occ_runs(std::vector<Occ>& v, uint32_t a, uint32_t b, uint32_t depth, uint32_t kind) {
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

void SuffixIndex::expand(uint32_t ni) {
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

}  // namespace specrt::suffix
