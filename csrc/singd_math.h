// SINGD's per-element maths, shared by the CPU and CUDA kernels (C10_HOST_DEVICE).
//
// With diagonal K and C the natural gradient C C^T G K K^T is elementwise:
// nat[r, c] = C[r] * (C[r] * (K[c] * (K[c] * g[r, c]))), in singd's order of products, and the
// parameter update after it is torch SGD's (no dampening): u = nat + wd * theta,
// buf <- momentum * buf + u, theta <- theta - lr * buf.
#pragma once

#include <c10/macros/Macros.h>

namespace cafin {

template <typename T>
struct SingdCoeffs {
  T lr;
  T momentum;
  T weight_decay;
  T grad_scale;  // gradients are divided by it when scaled
  bool scaled;
};

template <bool kMomentum, typename T>
C10_HOST_DEVICE inline void singd_diag_element(T& theta, T& buf, T g, T k, T c,
                                               const SingdCoeffs<T>& s) {
  if (s.scaled) g = g / s.grad_scale;
  T u = c * (c * (k * (k * g)));
  if (s.weight_decay != T(0)) u = u + s.weight_decay * theta;
  if (kMomentum) {
    buf = s.momentum * buf + u;
    u = buf;
  }
  theta = theta + (-s.lr) * u;
}

}  // namespace cafin
