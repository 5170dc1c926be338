// csrc/suffix_index.h — specrt._C.SuffixIndex, the token index behind suffix drafting
// (specrt/drafters/suffix.py): the segment store and its Python face in csrc/suffix_index.cpp,
// the query (draft) in csrc/suffix_query.cpp.
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
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <map>
#include <unordered_map>
#include <vector>

namespace specrt::suffix {

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
  SuffixIndex(int64_t max_span, int64_t max_tokens);

  int64_t max_span() const { return span_; }
  int64_t max_tokens() const { return max_tokens_; }
  size_t size() const { return ids_.size(); }
  int64_t num_tokens() const { return total_; }
  bool contains(int64_t id) const { return ids_.count(id) != 0; }

  std::vector<int32_t> sequence(int64_t id) const;
  void append(int64_t id, const std::vector<int64_t>& tokens);
  bool remove(int64_t id);
  size_t memory_bytes() const;

  // Fills out_*; see suffix_ref.ReferenceSuffixIndex.draft.
  void draft(const std::vector<int64_t>& context, int64_t max_match, int64_t min_match, int64_t max_nodes,
             int64_t max_depth, double min_prob, int64_t exclude);

  py::tuple draft_result() const;

 private:
  uint32_t stable_end(uint32_t len) const { return len >= span_ ? len - span_ + 1 : 0; }
  const int32_t* text(const Entry& e) const { return seqs_[e.slot].tok.data() + e.pos; }
  uint32_t rest(const Entry& e) const { return static_cast<uint32_t>(seqs_[e.slot].tok.size()) - e.pos; }

  // ---- the store and the argument checks (csrc/suffix_index.cpp)
  void check_args(int64_t max_match, int64_t min_match, int64_t max_nodes, int64_t max_depth, double min_prob) const;

  // Suffix order: the first span_ tokens, a suffix that ends first being the smaller.
  bool less(const Entry& a, const Entry& b) const;

  uint32_t create(int64_t id);

  // Forgets a sequence whose suffixes are no longer in any segment.
  void drop(uint32_t slot);

  // Oldest-first whole-sequence eviction down to max_tokens_, sparing the sequence keep.
  void evict(uint32_t keep);

  // Removes the suffixes listed in cuts_ (slot, from: positions >= from) from the segments.
  void purge();

  // Sorts the tails' stable positions into a new segment once there are kBatch of them, and seals
  // the tails of sequences other than keep once those pass kSealTail positions.
  void flush(uint32_t keep);

  // ---- the query (csrc/suffix_query.cpp)
  // <0, 0, >0: suffix e against pattern p (q <= span_ tokens), 0 when e starts with p.
  int compare_prefix(const Entry& e, const int32_t* p, uint32_t q) const;

  // How many of the last tokens before tok[end] equal the context's last ones (at most cap).
  uint32_t suffix_match(const int32_t* tok, uint32_t end, uint32_t cap) const;

  // In sa[lo, hi), all starting with the same d tokens: the first suffix longer than d (those
  // that end at d sort first).
  uint32_t first_longer(const std::vector<Entry>& sa, uint32_t lo, uint32_t hi, uint32_t d) const;

  // The suffixes of segment g that start with p (q tokens) and continue past it.
  Range pattern_range(uint32_t g, const int32_t* p, uint32_t q) const;

  // Whether the context's last m tokens occur (with a continuation) in the segments, the
  // excluded sequence's occurrences not counting.
  bool segment_has(uint32_t m) const;

  // Node a is drafted after node b: lower probability, then deeper, then the larger token path.
  bool pops_after(uint32_t a, uint32_t b) const;

  // Sorts occurrence list v[a, b) by the token at offset depth (ended ones first) and adds its
  // runs as candidates of the given kind.
  void occ_runs(std::vector<Occ>& v, uint32_t a, uint32_t b, uint32_t depth, uint32_t kind);

  // Creates node ni's children (those at or above min_prob: the rest could never be drafted) and
  // pushes them on the heap.
  void expand(uint32_t ni);

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

}  // namespace specrt::suffix
