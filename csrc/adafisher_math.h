// The per-element arithmetic of AdaFisher, shared by the CPU and the CUDA kernels so that the CPU
// tests exercise the numbers the GPU computes. Semantics: cafin/reference/adafisher.py. T is the op-math type
// (double for float64 parameters, float otherwise); per-tensor scalars are computed in double from
// the step value and then cast to T, as the reference does.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <limits>

namespace cafin {

// Absolute, as published: it matters against tiny gradient statistics.
constexpr double kMinMaxEps = 1e-6;

// ------------------------------------------------------------------------------------ update

// Per-tensor coefficients of one update, already cast to T.
template <typename T>
struct UpdateCoeffs {
  T beta;
  T one_minus_beta;
  T weight_decay;
  T damping;
  // Coupled: lr / (1 - beta^t), applied to m / F. Decoupled: lr, applied to the whole update.
  T step_size;
  // Decoupled only: 1 - beta^t, which divides m / F before the decay is added.
  T bias_correction;
};

// `step` is the parameter's step count after increment (a float32 tensor value); `lr` the value of
// the op-math lr tensor.
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE UpdateCoeffs<T> update_coeffs(double lr, float step, double beta,
                                                     double weight_decay, double damping,
                                                     bool decoupled) {
  const double bias_correction = 1.0 - ::pow(beta, static_cast<double>(step));
  UpdateCoeffs<T> c;
  c.beta = static_cast<T>(beta);
  c.one_minus_beta = static_cast<T>(1.0 - beta);
  c.weight_decay = static_cast<T>(weight_decay);
  c.damping = static_cast<T>(damping);
  c.step_size = decoupled ? static_cast<T>(lr) : static_cast<T>(lr / bias_correction);
  c.bias_correction = static_cast<T>(bias_correction);
  return c;
}

// F~ = S[r] * H[c] + damping where neither factor entry holds the never-updated marker (< 0).
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T fisher_diag_updated(T s, T h, T damping) {
  return s * h + damping;
}

// F~ with the marker tested: 1 where either entry is < 0. The CPU kernel takes this form only for
// a tensor whose factors hold some markers and some updated entries (a select feeding the
// division keeps GCC from vectorising the loop); the GPU takes it always.
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T fisher_diag(T s, T h, T damping) {
  const T f = fisher_diag_updated(s, h, damping);
  return (s < T(0) || h < T(0)) ? T(1) : f;
}

// One element: theta and m are updated in place; g is already divided by the grad scale.
template <bool kDecoupled, typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE void adafisher_element(T& theta, T& m, T g, T f, const UpdateCoeffs<T>& c) {
  if (kDecoupled) {
    m = c.beta * m + c.one_minus_beta * g;
    const T update = m / (c.bias_correction * f) + c.weight_decay * theta;
    theta = theta - c.step_size * update;
  } else {
    g = g + c.weight_decay * theta;
    m = c.beta * m + c.one_minus_beta * g;
    theta = theta - c.step_size * m / f;
  }
}

// The per-element maths of the update for the row-column skeletons (cpu/row_column.h,
// cuda/row_column.cuh): R = S, C = H, the state is exp_avg. kGuarded tests the markers.
template <typename scalar_t_, typename opmath_t_, bool kDecoupled, bool kScaled>
struct AdaFisherElement {
  using scalar_t = scalar_t_;
  using opmath_t = opmath_t_;
  using state_t = opmath_t;  // exp_avg
  static constexpr bool kState = true;
  struct Coeffs {
    UpdateCoeffs<opmath_t> update;
    opmath_t grad_scale;  // the gradients' divisor when kScaled
  };

  static C10_HOST_DEVICE C10_ALWAYS_INLINE void plain(opmath_t& theta, opmath_t& m, opmath_t g,
                                                      const Coeffs& c) {
    if (kScaled) g = g / c.grad_scale;
    adafisher_element<kDecoupled>(theta, m, g, opmath_t(1), c.update);
  }

  template <bool kGuarded>
  static C10_HOST_DEVICE C10_ALWAYS_INLINE void factored(opmath_t& theta, opmath_t& m, opmath_t g,
                                                         opmath_t s, opmath_t h, const Coeffs& c) {
    if (kScaled) g = g / c.grad_scale;
    const opmath_t f = kGuarded ? fisher_diag(s, h, c.update.damping)
                                : fisher_diag_updated(s, h, c.update.damping);
    adafisher_element<kDecoupled>(theta, m, g, f, c.update);
  }
};

// ------------------------------------------------------------------------------------ factors

// The mean of an accumulated statistic entry: the reference divides by max(count, 1).
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T statistic_mean(T sum, T count, T scale_sq, bool scaled) {
  T z = sum / (count < T(1) ? T(1) : count);
  if (scaled) z = z / scale_sq;  // gradient statistics of gradients multiplied by the grad scale
  return z;
}

// The denominator of the min-max normalisation, rounded like the reference: (max - min) in T, + eps.
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T minmax_denominator(T zmin, T zmax) {
  return (zmax - zmin) + static_cast<T>(kMinMaxEps);
}

// F <- (0.1 gamma) F + (0.01 gamma) z_hat, starting from ones where F < 0 (never updated).
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T average_factor(T factor, T z, T zmin, T denominator, T keep, T add) {
  const T base = factor < T(0) ? T(1) : factor;
  return base * keep + add * ((z - zmin) / denominator);
}

template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T factor_keep(double gamma) {
  return static_cast<T>(0.1 * gamma);
}

template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T factor_add(double gamma) {
  return static_cast<T>(0.01 * gamma);
}

// ------------------------------------------------------------------------------------ gating

// Whether a statistic op with `step` given runs: fmod(step, interval) == 0 in float32, as
// torch.fmod(step, interval) computes it (NaN never runs).
C10_HOST_DEVICE C10_ALWAYS_INLINE bool statistics_due(float step, int64_t interval) {
  return ::fmodf(step, static_cast<float>(interval)) == 0.0f;
}

}  // namespace cafin
