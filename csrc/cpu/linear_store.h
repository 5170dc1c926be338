// csrc/cpu/linear_store.h — the small-M linear kernel's one output rule, shared by every path
// (linear_tiles.h, linear_amx.cpp, linear_amx_order.cpp): y = s + bias in fp32, stored as fp32 or
// rounded to bf16 (nearest-even, NaN kept). ISA-free code, included inside a path's own namespace.

static inline void store_out(const Problem& p, int64_t m, int64_t n, float s) {
  if (p.bias) s = s + p.bias[n];
  if (!p.y_bf16) {
    static_cast<float*>(p.y)[m * p.N + n] = s;
    return;
  }
  uint32_t u;
  __builtin_memcpy(&u, &s, 4);
  const uint16_t h = (s != s) ? static_cast<uint16_t>(0x7FC0)
                              : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  static_cast<uint16_t*>(p.y)[m * p.N + n] = h;
}
