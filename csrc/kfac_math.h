// K-FAC's scalar maths, shared by the CPU kernels (cpu/kfac.cpp) and the CUDA kernels
// (cuda/kfac.cu), so the CPU tests exercise the arithmetic the GPU runs. Semantics:
// cafin/reference/kfac.py.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace cafin {

// Whether step k folds statistics: k % interval == 0 (k is a float32 count, exact below 2^24).
C10_HOST_DEVICE inline bool kfac_due(const float* step, int64_t interval) {
  return step == nullptr || ::fmodf(*step, static_cast<float>(interval)) == 0.0f;
}

// One factor entry after folding: decay * f + (1 - decay) * ((s_ij + s_ji) / 2) / count.
// The order of operations is the reference's (and kfac-pytorch's for float64).
template <typename T>
C10_HOST_DEVICE inline T kfac_ema(T f, T s_ij, T s_ji, T count, T decay) {
  const T x = (s_ij + s_ji) / T(2) / count;
  return decay * f + (T(1) - decay) * x;
}

// v / (dg * da + damping): the eigenbasis scaling when the outer product is not precomputed.
template <typename T>
C10_HOST_DEVICE inline T kfac_eigen_scale(T v, T dg, T da, T damping) {
  return v / (dg * da + damping);
}

// The clip sum of a write's partial sums <V, g>, two per entry (its weight columns, its bias
// column): their sum, or with abs_terms the sum of their absolute values (two-level K-FAC's
// Fisher norm, which takes each tensor's term apart).
C10_HOST_DEVICE inline double kfac_clip_sum(const double* parts, int64_t n, bool abs_terms) {
  double total = 0.0;
  for (int64_t k = 0; k < n; ++k) total += abs_terms ? ::fabs(parts[k]) : parts[k];
  return total;
}

// The KL-clip factor from vg = lr^2 * sum <V, g>: min(1, sqrt(kl_clip / |vg|)), 1 when vg == 0.
C10_HOST_DEVICE inline double kfac_kl_scale(double vg, double kl_clip) {
  if (vg == 0.0) return 1.0;
  const double s = ::sqrt(kl_clip / ::fabs(vg));
  return s < 1.0 ? s : 1.0;
}

}  // namespace cafin
