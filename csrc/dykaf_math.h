// DyKAF's per-element arithmetic, shared by the CPU and the CUDA kernels so the CPU tests check the
// arithmetic the GPU runs. The order of operations is the published TensorDyKAF's.
#pragma once

#include <c10/macros/Macros.h>
#include <cmath>

namespace cafin {

// The rotated momentum over the rank-one second moment, the denominator formed per element:
// mp / (sqrt(l_i * r_j) + guard). guard = 0 is the published rule (no epsilon). All in T: the
// host's ::sqrt is the double one, and a float sqrt rounded from it is the float sqrt (which the
// compiler then vectorises in float lanes); the sum and division stay in float, as on a GPU and in
// the reference.
template <typename T>
C10_HOST_DEVICE inline T dykaf_rank_one_precondition(T mp, T l, T r, T guard) {
  return mp / (static_cast<T>(::sqrt(l * r)) + guard);
}

// The full second moment: v <- beta2 * v + (1 - beta2) * gp^2, then mp / (sqrt(v) + eps).
template <typename T>
C10_HOST_DEVICE inline T dykaf_adam_precondition(T mp, T& v, T gp, T beta2, T eps) {
  v = v * beta2 + gp * gp * (T(1) - beta2);
  return mp / (::sqrt(v) + eps);
}

// theta - step_size * u * scale (scale = 1, or 1 / (1e-30 + rms(u)) with normalize_grads), then
// decoupled decay on the updated value: theta - decay * theta (decay = lr * weight_decay).
template <typename T>
C10_HOST_DEVICE inline T dykaf_apply(T theta, T u, T scale, T step_size, T decay) {
  theta = theta - step_size * (u * scale);
  return theta - decay * theta;
}

// The rank-one moment's new unnormalised direction: beta2 |l||r| x_hat + (1 - beta2) reduction.
template <typename T>
C10_HOST_DEVICE inline T dykaf_rank_one_direction(T x_hat, T reduction, T beta2, T norm_product) {
  return beta2 * norm_product * x_hat + (T(1) - beta2) * reduction;
}

}  // namespace cafin

namespace cafin {

// sigma * f + x: the basis step's sum before normalisation.
template <typename T>
C10_HOST_DEVICE inline T dykaf_split_sum(T f, T x, T sigma) {
  return f * sigma + x;
}

// The Galerkin weight S = sigma <L,U> <R,V> + <U,C>.
template <typename T>
C10_HOST_DEVICE inline T dykaf_split_weight(T lu, T rv, T uc, T sigma) {
  return lu * rv * sigma + uc;
}

}  // namespace cafin
