// csrc/cpu/avx2_lanes.h — 16 fp32 lanes as two AVX2 registers: the lane arithmetic and
// the fixed 16 -> 1 reduction tree (linear_kernel.h) shared by linear_avx2.cpp and
// fused_avx2.cpp. Included inside their per-ISA anonymous namespace, after
// <immintrin.h>, inside their SPECRT_ISA_AVX2 region (each gets its own internal copy,
// so no AVX2 code can be picked by the linker for another ISA).

struct V {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float vreduce(V a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
