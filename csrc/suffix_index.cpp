// The segment store of specrt._C.SuffixIndex (csrc/suffix_index.h): sequences, sorting stable
// positions into segments, merging, sealing, purging and eviction; the argument checks of every
// call and the Python class. The query is in csrc/suffix_query.cpp.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "suffix_index.h"

namespace specrt {
namespace suffix {

SuffixIndex::SuffixIndex(int64_t max_span, int64_t max_tokens) {
  if (max_span < 2 || max_span > 4096)
    throw std::invalid_argument("max_span must be in [2, 4096], got " + std::to_string(max_span));
  if (max_tokens < 0)
    throw std::invalid_argument("max_tokens must be >= 0 (0: unbounded), got " + std::to_string(max_tokens));
  span_ = static_cast<uint32_t>(max_span);
  max_tokens_ = max_tokens;
}

std::vector<int32_t> SuffixIndex::sequence(int64_t id) const {
  auto it = ids_.find(id);
  if (it == ids_.end()) throw py::key_error("no sequence " + std::to_string(id));
  return seqs_[it->second].tok;
}

void SuffixIndex::append(int64_t id, const std::vector<int64_t>& tokens) {
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

bool SuffixIndex::remove(int64_t id) {
  auto it = ids_.find(id);
  if (it == ids_.end()) return false;
  cuts_.push_back({it->second, 0});
  purge();
  drop(it->second);
  return true;
}

size_t SuffixIndex::memory_bytes() const {
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

void SuffixIndex::check_args(int64_t max_match, int64_t min_match, int64_t max_nodes, int64_t max_depth,
                             double min_prob) const {
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

bool SuffixIndex::less(const Entry& a, const Entry& b) const {
  const int32_t* x = text(a);
  const int32_t* y = text(b);
  const uint32_t ra = std::min(rest(a), span_), rb = std::min(rest(b), span_);
  const uint32_t n = std::min(ra, rb);
  for (uint32_t i = 0; i < n; ++i)
    if (x[i] != y[i]) return x[i] < y[i];
  return ra < rb;
}

uint32_t SuffixIndex::create(int64_t id) {
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

void SuffixIndex::drop(uint32_t slot) {
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

void SuffixIndex::evict(uint32_t keep) {
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

void SuffixIndex::purge() {
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

void SuffixIndex::flush(uint32_t keep) {
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

}  // namespace suffix

void bind_suffix_index(pybind11::module_& m) {
  namespace py = pybind11;
  using suffix::SuffixIndex;
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
