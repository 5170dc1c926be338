// csrc/cpu/tree_rows.h — the residual pass of rejection_sample_tree on the CPU,
// included (no include guard) once per instruction set by csrc/cpu/tree_cpu.cpp:
// in plain code and inside its AVX2 / AVX-512 target regions, so the compiler
// vectorises the same source for each. Every lane of the mass is an explicit
// accumulator and the float operations are those of specrt/tree.h (no FMA:
// -ffp-contract=off), so every instruction set returns the same bits.
//
// Include after specrt/tree.h, inside a namespace of its own.

// out[v] = tree_residual_weight(r[v], mass, q_v) for v in [0, n), with q_v =
// q[v], or the one-hot row at `onehot` when q is null; returns tree_mass(out).
// r and out must not overlap.
inline float residual_pass(const float* __restrict r, float mass, const float* __restrict q, int64_t onehot,
                           int64_t n, float* __restrict out) {
  float lanes[kTreeMassLanes];
  for (int l = 0; l < kTreeMassLanes; ++l) lanes[l] = 0.0f;
  for (int64_t v = 0; v < n; v += kTreeMassLanes) {
    const int width = n - v < kTreeMassLanes ? static_cast<int>(n - v) : kTreeMassLanes;
    if (q != nullptr) {
      const float* qv = q + v;
      if (width == kTreeMassLanes) {
        for (int l = 0; l < kTreeMassLanes; ++l) {
          const float w = tree_residual_weight(r[v + l], mass, qv[l]);
          out[v + l] = w;
          lanes[l] = lanes[l] + w;
        }
      } else {
        for (int l = 0; l < width; ++l) {
          const float w = tree_residual_weight(r[v + l], mass, qv[l]);
          out[v + l] = w;
          lanes[l] = lanes[l] + w;
        }
      }
    } else {
      // the one-hot lane of this block, or -1
      const int hot = onehot >= v && onehot < v + width ? static_cast<int>(onehot - v) : -1;
      if (width == kTreeMassLanes) {
        for (int l = 0; l < kTreeMassLanes; ++l) {
          const float w = tree_residual_weight(r[v + l], mass, l == hot ? 1.0f : 0.0f);
          out[v + l] = w;
          lanes[l] = lanes[l] + w;
        }
      } else {
        for (int l = 0; l < width; ++l) {
          const float w = tree_residual_weight(r[v + l], mass, l == hot ? 1.0f : 0.0f);
          out[v + l] = w;
          lanes[l] = lanes[l] + w;
        }
      }
    }
  }
  return tree_mass_from_lanes(lanes);
}
