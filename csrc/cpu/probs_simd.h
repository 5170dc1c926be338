// csrc/cpu/probs_simd.h — the row passes of probs_from_logits (csrc/cpu/probs.h)
// written once over a vector-traits struct V, for csrc/cpu/sampling_avx2.cpp
// and sampling_avx512.cpp. Like race_simd.h: include it only inside a target
// region and an ISA-specific namespace, after V; it includes nothing itself.
//
// Each pass handles 16 entries per step (16 / V::kLanes vectors), so entry v
// lands in double lane v % 16 exactly as in the scalar definitions, and the
// remainder (< 16 entries) runs the scalar definition on the same lanes.

// exp_det (probs.h) lane by lane: the same float operations in the same order.
template <class V>
inline typename V::F exp_det_v(typename V::F y) {
  using F = typename V::F;
  using I = typename V::I;
  const F magic = V::set1(12582912.0f);
  const F n = V::sub(V::add(V::mul(y, V::set1(1.44269504088896341f)), magic), magic);
  const F r = V::sub(V::sub(y, V::mul(n, V::set1(0.693359375f))), V::mul(n, V::set1(-2.12194440e-4f)));
  F p = V::set1(1.9875691500e-4f);
  p = V::add(V::mul(p, r), V::set1(1.3981999507e-3f));
  p = V::add(V::mul(p, r), V::set1(8.3334519073e-3f));
  p = V::add(V::mul(p, r), V::set1(4.1665795894e-2f));
  p = V::add(V::mul(p, r), V::set1(1.6666665459e-1f));
  p = V::add(V::mul(p, r), V::set1(5.0000001201e-1f));
  p = V::add(V::add(V::mul(p, V::mul(r, r)), r), V::set1(1.0f));
  const I k = V::cvtt(n);
  const I k1 = V::template srai<1>(k);
  const I bias = V::set1_i(127);
  const F s1 = V::as_float(V::template slli<23>(V::add_i(k1, bias)));
  const F s2 = V::as_float(V::template slli<23>(V::add_i(V::sub_i(k, k1), bias)));
  return V::select(V::ge(y, V::set1(-104.0f)), V::mul(V::mul(p, s1), s2), V::zero());
}

template <class V>
struct ProbsSimd {
  using F = typename V::F;
  static constexpr int R = kSumLanes / V::kLanes;  // vectors per 16 entries

  static int64_t collect_range(const float* x, int64_t n, float lo, float hi, float* out) {
    const F lov = V::set1(lo), hiv = V::set1(hi);
    int64_t count = 0, v = 0;
    for (; v + V::kLanes <= n; v += V::kLanes) {
      const F value = V::load(x + v);
      count += V::compress_store(out + count, V::and_m(V::gt(value, lov), V::le(value, hiv)), value);
    }
    return count + collect_range_scalar(x + v, n - v, lo, hi, out + count);
  }

  static int64_t argmax(const float* x, int64_t n) {
    F acc = V::set1(-INFINITY);
    int64_t v = 0;
    for (; v + V::kLanes <= n; v += V::kLanes) acc = V::max(V::load(x + v), acc);  // x > acc ? x : acc
    alignas(64) float lanes[V::kLanes];
    V::store(lanes, acc);
    float m = -INFINITY;
    for (float lane : lanes) m = lane > m ? lane : m;
    for (int64_t w = v; w < n; ++w) m = x[w] > m ? x[w] : m;
    if (m == -INFINITY) return 0;
    const F mv = V::set1(m);
    for (v = 0; v + V::kLanes <= n; v += V::kLanes) {
      const uint32_t hit = V::bits(V::eq(V::load(x + v), mv));
      if (hit != 0) return v + __builtin_ctz(hit);
    }
    while (!(x[v] == m)) ++v;
    return v;
  }

  static double softmax_numerators(const float* x, int64_t n, float t, float m, float floor, float* out) {
    typename V::Sum16 acc;
    const F tv = V::set1(t), mv = V::set1(m), fv = V::set1(floor);
    int64_t v = 0;
    for (; v + kSumLanes <= n; v += kSumLanes) {
      F y[R];
      typename V::M keep[R];
      uint32_t any = 0;
      for (int r = 0; r < R; ++r) {
        y[r] = V::div(V::load(x + v + r * V::kLanes), tv);
        keep[r] = V::ge(y[r], fv);
        any |= V::bits(keep[r]);
      }
      F e[R];
      for (int r = 0; r < R; ++r) {
        e[r] = any ? V::select(keep[r], exp_det_v<V>(V::sub(y[r], mv)), V::zero()) : V::zero();
        V::store(out + v + r * V::kLanes, e[r]);
      }
      if (any) acc.add(e);  // adding +0.0 would change no lane
    }
    double lanes[kSumLanes];
    acc.store(lanes);
    for (; v < n; ++v) {
      const float y = x[v] / t;
      out[v] = y >= floor ? exp_det(y - m) : 0.0f;
      lanes[v % kSumLanes] += out[v];
    }
    return sum_lanes(lanes);
  }

  static void divide(float* out, int64_t n, float d) {
    const F dv = V::set1(d);
    const uint32_t all = (1u << V::kLanes) - 1;
    const bool skip_zeros = d > 0.0f && d < INFINITY;  // then 0 / d is 0: masked-out entries stay as they are
    int64_t v = 0;
    for (; v + V::kLanes <= n; v += V::kLanes) {
      const F o = V::load(out + v);
      if (skip_zeros && V::bits(V::eq(o, V::zero())) == all) continue;
      V::store(out + v, V::div(o, dv));
    }
    for (; v < n; ++v) out[v] = out[v] / d;
  }

  static double keep_at_least(float* out, int64_t n, float cut) {
    typename V::Sum16 acc;
    const F cv = V::set1(cut);
    int64_t v = 0;
    for (; v + kSumLanes <= n; v += kSumLanes) {
      F e[R];
      for (int r = 0; r < R; ++r) {
        const F o = V::load(out + v + r * V::kLanes);
        e[r] = V::select(V::ge(o, cv), o, V::zero());
        V::store(out + v + r * V::kLanes, e[r]);
      }
      acc.add(e);
    }
    double lanes[kSumLanes];
    acc.store(lanes);
    for (; v < n; ++v) {
      if (!(out[v] >= cut)) out[v] = 0.0f;
      lanes[v % kSumLanes] += out[v];
    }
    return sum_lanes(lanes);
  }
};
