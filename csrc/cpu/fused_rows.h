// csrc/cpu/fused_rows.h — the fused decoder kernels (fused_kernel.h), written once
// over a vector policy. Included inside a per-ISA namespace by fused_{scalar,avx2,
// avx512}.cpp after they define V (16 fp32 lanes) and:
//   vzero, vset1, vadd, vsub, vmul, vdiv, vfma(a, b, c) = a*b + c, vmax / vmin
//   (a > b ? a : b / a < b ? a : b, as maxps / minps), vrint (to nearest even),
//   vpow2i(n) (2^n for integer-valued n in [-126, 127]), vselect_gt(x, t, a, b)
//   (x > t ? a : b), vreduce (the fixed tree of linear_kernel.h), vround_bf16 (to
//   bf16 precision, nearest-even, NaN kept quiet), and for n <= 16 elements (rest 0):
//   load_f32_n, load_bf16_n, store_f32_n, store_bf16_n (of an already rounded value).
// Every function is a fixed sequence of IEEE operations per lane, so all ISAs agree bit
// for bit. No torch or standard-library templates here: compiled once per ISA.

template <bool kB>
inline V ld(const void* p, int64_t i, int n) {
  if constexpr (kB) return load_bf16_n(static_cast<const uint16_t*>(p) + i, n);
  else return load_f32_n(static_cast<const float*>(p) + i, n);
}

// the result of an operation in the tensors' dtype: bf16 rounds, float32 is exact already
template <bool kB>
inline V rnd(V v) {
  if constexpr (kB) return vround_bf16(v);
  else return v;
}

template <bool kB>
inline void st(void* p, int64_t i, V v, int n) {  // v representable in the dtype
  if constexpr (kB) store_bf16_n(static_cast<uint16_t*>(p) + i, v, n);
  else store_f32_n(static_cast<float*>(p) + i, v, n);
}

inline int lanes(int64_t len, int64_t i) { return (len - i < 16) ? static_cast<int>(len - i) : 16; }

// exp(x) (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial); +inf above 88
inline V vexp(V x) {
  const V xc = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  const V n = vrint(vmul(xc, vset1(1.44269504088896341f)));
  V r = vfma(n, vset1(-0.693359375f), xc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  const V z = vmul(r, r);
  V y = vfma(vset1(1.9875691500e-4f), r, vset1(1.3981999507e-3f));
  y = vfma(y, r, vset1(8.3334519073e-3f));
  y = vfma(y, r, vset1(4.1665795894e-2f));
  y = vfma(y, r, vset1(1.6666665459e-1f));
  y = vfma(y, r, vset1(5.0000001201e-1f));
  y = vadd(vfma(y, z, r), vset1(1.0f));
  return vselect_gt(x, vset1(88.0f), vset1(__builtin_huge_valf()), vmul(y, vpow2i(n)));
}

// ---- RMSNorm (optionally after the residual add)
template <bool kB>
static void norm_rows(const NormProblem& p, int64_t t0, int64_t t1) {
  const int64_t H = p.H;
  for (int64_t t = t0; t < t1; ++t) {
    const void* src = static_cast<const char*>(p.x) + t * p.ldx * (kB ? 2 : 4);
    if (p.residual) {  // residual = round(residual + x), then normalize the sum
      void* res = static_cast<char*>(p.residual) + t * p.ldr * (kB ? 2 : 4);
      for (int64_t i = 0; i < H; i += 16) {
        const int n = lanes(H, i);
        st<kB>(res, i, rnd<kB>(vadd(ld<kB>(res, i, n), ld<kB>(src, i, n))), n);
      }
      src = res;
    }
    V acc = vzero();
    for (int64_t i = 0; i < H; i += 16) {
      const V v = ld<kB>(src, i, lanes(H, i));
      acc = vfma(v, v, acc);
    }
    const float var = vreduce(acc) / static_cast<float>(H);
    const V inv = vset1(1.0f / __builtin_sqrtf(var + p.eps));
    void* out = static_cast<char*>(p.out) + t * H * (kB ? 2 : 4);
    for (int64_t i = 0; i < H; i += 16) {
      const int n = lanes(H, i);
      const V normed = rnd<kB>(vmul(ld<kB>(src, i, n), inv));
      st<kB>(out, i, rnd<kB>(vmul(ld<kB>(p.weight, i, n), normed)), n);
    }
  }
}

// ---- SwiGLU: silu(g) * u, silu(g) = g / (1 + exp(-g)) as torch computes it
template <bool kB>
static void silu_mul_rows(const SiluMulProblem& p, int64_t t0, int64_t t1) {
  const int64_t I = p.I;
  for (int64_t t = t0; t < t1; ++t) {
    const void* x = static_cast<const char*>(p.x) + t * p.ldx * (kB ? 2 : 4);
    void* out = static_cast<char*>(p.out) + t * I * (kB ? 2 : 4);
    for (int64_t i = 0; i < I; i += 16) {
      const int n = lanes(I, i);
      const V g = ld<kB>(x, i, n);
      const V e = vexp(vsub(vzero(), g));
      const V s = rnd<kB>(vdiv(g, vadd(vset1(1.0f), e)));
      st<kB>(out, i, rnd<kB>(vmul(s, ld<kB>(x, I + i, n))), n);
    }
  }
}

// ---- RoPE on q (into p.q) and k (in place): x * cos + rotate_half(x) * sin, products rounded
template <bool kB, bool kQB>
static void rotary_rows(const RotaryProblem& p, int64_t t0, int64_t t1) {
  const int64_t D = p.D, half = D / 2, heads = p.H + p.Hkv;
  constexpr int64_t kEl = kB ? 2 : 4;
  for (int64_t t = t0; t < t1; ++t) {
    char* row = static_cast<char*>(p.qkv) + t * p.ldqkv * kEl;
    const void* cs = static_cast<const char*>(p.cos) + t * p.ldcs * kEl;
    const void* sn = static_cast<const char*>(p.sin) + t * p.ldcs * kEl;
    for (int64_t h = 0; h < heads; ++h) {
      void* x = row + h * D * kEl;
      for (int64_t i = 0; i < half; i += 16) {
        const int n = lanes(half, i);
        const V a = ld<kB>(x, i, n), b = ld<kB>(x, half + i, n);
        const V lo = rnd<kB>(vsub(rnd<kB>(vmul(a, ld<kB>(cs, i, n))), rnd<kB>(vmul(b, ld<kB>(sn, i, n)))));
        const V hi = rnd<kB>(vadd(rnd<kB>(vmul(b, ld<kB>(cs, half + i, n))), rnd<kB>(vmul(a, ld<kB>(sn, half + i, n)))));
        if (h < p.H) {
          void* q = static_cast<char*>(p.q) + ((t * p.H + h) * D) * (kQB ? 2 : 4);
          st<kQB>(q, i, lo, n);  // exact: lo is representable in the (no narrower) q dtype
          st<kQB>(q, half + i, hi, n);
        } else {
          st<kB>(x, i, lo, n);
          st<kB>(x, half + i, hi, n);
        }
      }
    }
  }
}

static void run_norm(const NormProblem& p, int64_t t0, int64_t t1) {
  if (p.dtype == Dtype::kBF16) norm_rows<true>(p, t0, t1);
  else norm_rows<false>(p, t0, t1);
}

static void run_silu_mul(const SiluMulProblem& p, int64_t t0, int64_t t1) {
  if (p.dtype == Dtype::kBF16) silu_mul_rows<true>(p, t0, t1);
  else silu_mul_rows<false>(p, t0, t1);
}

static void run_rotary(const RotaryProblem& p, int64_t t0, int64_t t1) {
  const bool b = p.dtype == Dtype::kBF16, qb = p.q_dtype == Dtype::kBF16;
  if (b && qb) rotary_rows<true, true>(p, t0, t1);
  else if (b) rotary_rows<true, false>(p, t0, t1);
  else rotary_rows<false, false>(p, t0, t1);  // float32 qkv gives a float32 q (checked by the caller)
}
