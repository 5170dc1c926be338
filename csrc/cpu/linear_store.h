// csrc/cpu/linear_store.h — the small-M linear kernel's one output rule, shared by every path
// (linear_tiles.h, linear_dynamic_tiles.h, linear_amx.cpp, linear_amx_order.cpp): y = s + bias in fp32, stored as fp32 or
// rounded to bf16 (nearest-even, NaN kept). ISA-free code, included inside a path's own namespace.

static inline uint16_t round_bf16(float s) {
  uint32_t u;
  __builtin_memcpy(&u, &s, 4);
  return (s != s) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// P: Problem or DynProblem (the same y, N, bias and y_bf16 fields)
template <class P>
static inline void store_out(const P& p, int64_t m, int64_t n, float s) {
  if (p.bias) s = s + p.bias[n];
  if (p.y_bf16)
    static_cast<uint16_t*>(p.y)[m * p.N + n] = round_bf16(s);
  else
    static_cast<float*>(p.y)[m * p.N + n] = s;
}
