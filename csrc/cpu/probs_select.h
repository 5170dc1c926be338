// csrc/cpu/probs_select.h — the two thresholds of probs_from_logits, found
// without sorting the row and with exactly the answer a full sort gives.
//
//  - kth_largest: the k-th largest logit (top-k keeps every logit >= it).
//  - top_p_cut: the prob at which the descending cumulative sum of the probs,
//    accumulated in double, first reaches top_p (top-p keeps every prob >= it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "cpu/probs.h"
#include "specrt/common.h"

namespace specrt {

// The k-th largest of x[0..n) (1 <= k <= n; NaN counts as -inf), as
// std::nth_element over the whole row would return it. One pass keeps a
// buffer that always holds every value above `floor` plus at least k values
// >= floor, where floor is the k-th largest of the values seen so far; the
// k-th largest of the buffer is then the k-th largest of the row. The scan
// (collect_range, csrc/cpu/probs.h) is vectorized; selection is exact on
// every path.
inline float kth_largest(CpuIsa isa, const float* x, int64_t n, int64_t k, std::vector<float>& buffer) {
  constexpr int64_t kSegment = 2048;  // entries scanned between two looks at the buffer
  const int64_t limit = std::max<int64_t>(2 * k, k + 256);
  buffer.resize(static_cast<size_t>(limit + kCollectSlack));
  int64_t size = 0;
  auto compact = [&] {  // keep the k largest; the k-th is the new floor
    std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.begin() + size, std::greater<float>());
    size = k;
    return buffer[k - 1];
  };
  for (; size < k; ++size) buffer[size] = x[size] != x[size] ? -INFINITY : x[size];
  float floor = compact();
  for (int64_t v = k; v < n;) {
    // at most limit - size entries can join: scan no more (the floor stays fresh early on)
    const int64_t segment = std::min({kSegment, limit - size, n - v});
    size += collect_range(isa, x + v, segment, floor, INFINITY, buffer.data() + size);
    v += segment;
    if (size >= limit) floor = compact();
  }
  return compact();
}

namespace detail {

// The old, sorting definition: sort the positive probs in descending order and
// add them up in double; the first prob where float(sum) >= top_p (or the
// smallest one if the sum never gets there).
inline float top_p_cut_by_sort(const float* p, int64_t n, float top_p, std::vector<float>& buffer) {
  buffer.clear();
  for (int64_t v = 0; v < n; ++v)
    if (p[v] > 0.0f) buffer.push_back(p[v]);
  std::sort(buffer.begin(), buffer.end(), std::greater<float>());
  double csum = 0.0;
  for (float x : buffer) {
    csum += x;
    if (static_cast<float>(csum) >= top_p) return x;
  }
  return buffer.empty() ? 0.0f : buffer.back();
}

// Probs >= 2^-29 are multiples of 2^-52, so every sum of them below 2 is exact
// in double, in any order: bins can be summed in place of single probs.
constexpr uint32_t kExactBits = (127u - 29u) << 23;

// Bin of an exact-region prob by its bits [shift, shift + 8); level 1 (shift 20)
// counts from 2^-29, so exponent and the top 3 mantissa bits fit (1.0 is bin
// 232; larger values, which a normalised row cannot hold, share bin 255).
// Bins are value-ordered within their parent bin.
inline int bin_of(float x, int shift) {
  const uint32_t bits = float_as_uint(x);
  if (shift == 20) return static_cast<int>(std::min<uint32_t>((bits - kExactBits) >> 20, 255u));
  return static_cast<int>((bits >> shift) & 0xffu);
}

// The cut among `values` (all >= 2^-29, in one bin of the level above `shift`)
// when the larger probs sum to `above` and above + sum(values) reaches top_p:
// sum 256 sub-bins, walk them from the top, refine the one that reaches top_p.
inline float cut_within(std::vector<float>& values, double above, float top_p, int shift) {
  if (values.empty()) return 0.0f;  // not reached: the caller's bin holds probs
  if (values.size() <= 64 || shift < 0) {
    std::sort(values.begin(), values.end(), std::greater<float>());
    for (float x : values) {
      above += x;
      if (static_cast<float>(above) >= top_p) return x;
    }
    return values.back();  // not reached (the caller checked the total)
  }
  double bins[4][256] = {};  // 4 interleaved copies: consecutive adds don't wait on each other
  const size_t n = values.size();
  for (size_t i = 0; i < n; ++i) bins[i & 3][bin_of(values[i], shift)] += values[i];
  int b = 255;
  for (; b >= 0; --b) {
    const double bin = ((bins[0][b] + bins[1][b]) + bins[2][b]) + bins[3][b];
    if (bin != 0.0 && static_cast<float>(above + bin) >= top_p) break;  // an empty bin holds no cut
    above += bin;
  }
  if (b < 0) return 0.0f;  // not reached (the caller checked the total)
  std::vector<float> inner;
  for (float x : values)
    if (bin_of(x, shift) == b) inner.push_back(x);
  return cut_within(inner, above, top_p, shift - 8);
}

}  // namespace detail

// The top-p cut of a row of probs (each in [0, 1]), identical to
// detail::top_p_cut_by_sort: gather the probs >= 2^-29 (vectorized), sum them
// into 256 value-ordered bins (exponent and top 3 mantissa bits), walk the bins
// from the top to the one where the exact cumulative sum reaches top_p, and
// refine only that bin (detail::cut_within).
inline float top_p_cut(CpuIsa isa, const float* p, int64_t n, float top_p, std::vector<float>& buffer) {
  using detail::kExactBits;
  buffer.resize(static_cast<size_t>(n + kCollectSlack));
  const int64_t size = collect_range(isa, p, n, uint_as_float(kExactBits - 1), INFINITY, buffer.data());
  double hist[4][256] = {};  // 4 interleaved copies: consecutive adds don't wait on each other
  const float* data = buffer.data();
  int64_t i = 0;
  for (; i + 4 <= size; i += 4)
    for (int j = 0; j < 4; ++j) hist[j][detail::bin_of(data[i + j], 20)] += data[i + j];
  for (; i < size; ++i) hist[0][detail::bin_of(data[i], 20)] += data[i];
  double bins[256], total = 0.0;
  for (int b = 0; b < 256; ++b) {
    bins[b] = ((hist[0][b] + hist[1][b]) + hist[2][b]) + hist[3][b];
    total += bins[b];  // exact
  }
  if (size == 0 || static_cast<float>(total) < top_p)
    return detail::top_p_cut_by_sort(p, n, top_p, buffer);  // the cut lies below 2^-29: not exact by bins
  double above = 0.0;
  int b = 255;
  for (; b > 0 && (bins[b] == 0.0 || static_cast<float>(above + bins[b]) < top_p); --b) above += bins[b];
  // bin b holds the bits [kExactBits + b 2^20, kExactBits + (b + 1) 2^20); the last one everything above
  const float lo = uint_as_float(kExactBits + (static_cast<uint32_t>(b) << 20) - 1u);
  const float hi = b == 255 ? INFINITY : uint_as_float(kExactBits + (static_cast<uint32_t>(b + 1) << 20) - 1u);
  buffer.resize(static_cast<size_t>(collect_range(isa, buffer.data(), size, lo, hi, buffer.data())));
  return detail::cut_within(buffer, above, top_p, b == 255 ? -1 : 12);
}

}  // namespace specrt
