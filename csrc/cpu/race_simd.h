// csrc/cpu/race_simd.h — the exponential race (csrc/cpu/race.h) written once
// over a vector-traits struct V, for csrc/cpu/sampling_avx2.cpp and
// sampling_avx512.cpp.
//
// Include it only inside an instruction-set target region and an ISA-specific
// namespace, after V is defined (it includes nothing itself). It reproduces
// race_scalar bit for bit:
//  - Philox4x32-10 for V::kLanes / 4 blocks at once, one block per 128-bit lane
//    laid out as its counter words (c0, c1, c2, c3), so one 32x32->64 multiply
//    serves both multiplies of a round and the output words land in token order;
//  - uniform, log_det and the race score with the same IEEE float operations in
//    the same order (no FMA), so every lane rounds exactly like the scalar code;
//  - work that cannot change the winner is skipped: with s the best score so
//    far, an entry scores strictly less than s when w < s * kPruneMargin * (1 - U),
//    which needs no log, and when w < s * kPruneMargin * 2^-24 it needs no Philox
//    either (nor do weight-0 entries). Only vectors with a possible winner
//    evaluate log_det; only vectors with an entry above that floor draw Philox.

template <class V>
inline typename V::F log_det_v(typename V::F x) {
  using F = typename V::F;
  using I = typename V::I;
  const I bits = V::as_int(x);
  I exponent = V::sub_i(V::and_i(V::template srli<23>(bits), V::set1_i(0xff)), V::set1_i(127));
  F m = V::as_float(V::or_i(V::and_i(bits, V::set1_i(0x007fffff)), V::set1_i(0x3f800000)));  // [1, 2)
  const typename V::M big = V::gt(m, V::set1(1.41421354f));
  m = V::select(big, V::mul(m, V::set1(0.5f)), m);
  exponent = V::add_one_where(big, exponent);
  const F f = V::sub(m, V::set1(1.0f));
  const F s = V::div(f, V::add(V::set1(2.0f), f));
  const F z = V::mul(s, s);
  const F w = V::mul(z, z);
  const F t1 = V::mul(w, V::add(V::set1(4.0000000596e-01f), V::mul(w, V::set1(2.2222198546e-01f))));
  const F t2 = V::mul(z, V::add(V::set1(6.6666668653e-01f), V::mul(w, V::set1(2.8571429849e-01f))));
  const F r = V::add(t2, t1);
  const F hfsq = V::mul(V::mul(V::set1(0.5f), f), f);
  const F dk = V::cvt(exponent);
  const F inner = V::sub(V::sub(hfsq, V::add(V::mul(s, V::add(hfsq, r)), V::mul(dk, V::set1(9.0580006145e-06f)))), f);
  return V::sub(V::mul(dk, V::set1(6.9313812256e-01f)), inner);
}

template <class V>
void exponential_noise(const float* u, float* e, int64_t n) {
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::store(e + i, V::neg(log_det_v<V>(V::load(u + i))));
  for (; i < n; ++i) e[i] = exponential_from_uniform(u[i]);
}

template <class V>
struct RaceSimd {
  using F = typename V::F;
  using I = typename V::I;
  static constexpr int64_t kLanes = V::kLanes;
  static constexpr int kGroup = 4;  // vectors per step: independent Philox chains in flight

  const RaceRow& row;
  I keys[10];  // round keys (k0, 0, k1, 0) per block
  I counter_base;

  explicit RaceSimd(const RaceRow& r) : row(r) {
    uint32_t k0 = static_cast<uint32_t>(row.seed), k1 = static_cast<uint32_t>(row.seed >> 32);
    for (I& key : keys) {
      key = V::block_words(k0, 0u, k1, 0u);
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    const uint64_t pos = static_cast<uint64_t>(row.position);
    counter_base = V::counter_base(static_cast<uint32_t>(pos), static_cast<uint32_t>(pos >> 32), row.purpose);
  }

  template <RaceWeights W>
  F weights(int64_t v) const {
    const F p = V::load(row.p + v);
    if constexpr (W == RaceWeights::kP) {
      return p;
    } else if constexpr (W == RaceWeights::kResidual) {
      const F d = V::sub(p, V::load(row.q + v));
      const F zero = V::zero();
      return V::select(V::and_m(V::gt(p, zero), V::gt(d, zero)), d, zero);
    } else {
      if (static_cast<uint64_t>(row.onehot - v) >= static_cast<uint64_t>(kLanes)) return p;
      alignas(64) float lanes[kLanes];
      V::store(lanes, p);
      lanes[row.onehot - v] = race_weight(row, row.onehot);
      return V::load(lanes);
    }
  }

  // s * kPruneMargin * 2^-23 for the best score s so far; 0 (no pruning) while
  // s is tiny, so that the bounds below never leave the normal float range.
  static float prune_scale(uint64_t best) {
    const float s = unpack_race_score(best);
    return s >= 1e-30f ? (s * kPruneMargin) * 1.1920928955078125e-07f : 0.0f;
  }

  // The exact scores of one vector (the scalar operation sequence), reduced.
  static uint64_t score_vector(F w, I bits, int64_t v) {
    const F u = V::mul(V::add(V::cvt(V::template srli<9>(bits)), V::set1(0.5f)), V::set1(1.1920928955078125e-07f));
    const F score = V::div(w, V::neg(log_det_v<V>(u)));
    alignas(64) float s[kLanes];
    V::store(s, score);
    uint64_t best = 0;
    for (int64_t l = 0; l < kLanes; ++l) best = std::max(best, race_candidate(s[l], static_cast<uint32_t>(v + l)));
    return best;
  }

  // An entry can only win if w >= bound(U) = scale * (((~bits) >> 9) + 1/2), where
  // scale * (((~bits) >> 9) + 1/2) rounds s * margin * (1 - U) (exact but for the
  // rounding of scale and of the product; kPruneMargin covers both). bound(U) >=
  // scale / 2 for every U: lighter entries need no noise at all, and neither do
  // entries of weight 0 (the least positive float stands in while s = 0).
  static F floor_of(float scale) { return V::set1(scale > 0.0f ? scale * 0.5f : 1.40129846e-45f); }

  // Philox and the pruning bound for G vectors at at[g] (multiples of 4, increasing).
  template <int G>
  uint64_t draw(const int64_t* at, const F* w, uint64_t best) const {
    const I mul = V::block_words(kPhiloxM0, 0u, kPhiloxM1, 0u);
    I c[G];
    for (int g = 0; g < G; ++g) c[g] = V::counter_at(counter_base, static_cast<uint32_t>(at[g]) >> 2);
    for (int round = 0; round < 10; ++round)
      for (int g = 0; g < G; ++g) c[g] = V::philox_round(c[g], mul, keys[round]);
    float scale = prune_scale(best);
    for (int g = 0; g < G; ++g) {
      const F bound = V::mul(V::set1(scale), V::add(V::cvt(V::template srli<9>(V::not_i(c[g]))), V::set1(0.5f)));
      if (V::bits(V::ge(w[g], bound)) == 0) continue;
      best = std::max(best, score_vector(w[g], c[g], at[g]));
      scale = prune_scale(best);
    }
    return best;
  }

  // One step over G vectors from v (v a multiple of 4): when none has an entry
  // above the floor nothing is drawn, when one has it draws alone, else all G
  // draw together (independent Philox chains in flight: two cost about one).
  template <RaceWeights W, int G>
  uint64_t step(int64_t v, uint64_t best) const {
    const F floor = floor_of(prune_scale(best));
    int64_t at[G];
    F w[G];
    uint32_t live = 0;
    for (int g = 0; g < G; ++g) {
      at[g] = v + g * kLanes;
      w[g] = weights<W>(at[g]);
      live |= static_cast<uint32_t>(V::bits(V::ge(w[g], floor)) != 0) << g;
    }
    if (live == 0) return best;
    if (G == 1 || (live & (live - 1)) != 0) return draw<G>(at, w, best);  // two or more: together
    const int g = __builtin_ctz(live);
    return draw<1>(at + g, w + g, best);
  }

  template <RaceWeights W>
  uint64_t run(int64_t begin, int64_t end) const {
    int64_t v = std::min(end, (begin + 3) & ~int64_t{3});  // to a Philox block boundary
    uint64_t best = race_scalar(row, begin, v);
    for (; v + kGroup * kLanes <= end; v += kGroup * kLanes) best = step<W, kGroup>(v, best);
    for (; v + kLanes <= end; v += kLanes) best = step<W, 1>(v, best);
    return std::max(best, race_scalar(row, v, end));
  }

  uint64_t run(int64_t begin, int64_t end) const {
    switch (row.weights) {
      case RaceWeights::kResidual:
        return run<RaceWeights::kResidual>(begin, end);
      case RaceWeights::kResidualOneHot:
        return run<RaceWeights::kResidualOneHot>(begin, end);
      default:
        return run<RaceWeights::kP>(begin, end);
    }
  }
};
