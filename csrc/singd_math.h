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

// The per-element maths of singd_diag_step_ for the row-column skeletons (cpu/row_column.h,
// cuda/row_column.cuh): R = C, C = K, the state is the momentum buffer (parameters' dtype).
template <typename scalar_t_, typename opmath_t_, bool kMomentum>
struct SingdDiagElement {
  using scalar_t = scalar_t_;
  using opmath_t = opmath_t_;
  using state_t = scalar_t;
  static constexpr bool kState = kMomentum;
  using Coeffs = SingdCoeffs<opmath_t>;

  // No factors: K = C = 1, which leaves the gradient exactly as it is.
  static C10_HOST_DEVICE C10_ALWAYS_INLINE void plain(opmath_t& theta, opmath_t& buf, opmath_t g,
                                                      const Coeffs& s) {
    singd_diag_element<kMomentum>(theta, buf, g, opmath_t(1), opmath_t(1), s);
  }

  // No markers in SINGD's factors: kGuarded changes nothing.
  template <bool kGuarded>
  static C10_HOST_DEVICE C10_ALWAYS_INLINE void factored(opmath_t& theta, opmath_t& buf, opmath_t g,
                                                         opmath_t c, opmath_t k, const Coeffs& s) {
    singd_diag_element<kMomentum>(theta, buf, g, k, c, s);
  }
};

// The preconditioner update of one structured factor, elementwise over its storage (the matrix
// products around it stay in BLAS):
//   m <- scale * (c_h * H + c_damp * (pi * KtK) - I) + alpha1 * m,   H <- 0
//   K <- K - beta * KM   (KM = K m from a GEMM, or K * m for an elementwise part)
// pi is the projection's factor on this part of Pi(K^T K) (2 where a symmetric matrix's lower
// part folds onto the stored upper part, else 1). `eye` is the identity's entry here.
enum SingdEye : int64_t { kEyeNone = 0, kEyeMatrixDiagonal = 1, kEyeAll = 2, kEyeFirst = 3 };

// Whether flat index e of a part holds a diagonal entry of the identity. A matrix part is a stack
// of [rows, cols] matrices (cols = its last dimension).
C10_HOST_DEVICE inline bool singd_is_eye(int64_t kind, int64_t e, int64_t rows, int64_t cols) {
  if (kind == kEyeAll) return true;
  if (kind == kEyeFirst) return e == 0;
  if (kind == kEyeMatrixDiagonal) {
    const int64_t within = e % (rows * cols);
    return within / cols == within % cols;
  }
  return false;
}

template <typename T>
C10_HOST_DEVICE inline T singd_momentum_element(T h, T ktk, T m_old, bool eye, T c_h, T c_damp,
                                                T pi, T scale, T alpha1, bool with_old) {
  T m = (c_h * h + c_damp * (pi * ktk) - (eye ? T(1) : T(0))) * scale;
  if (with_old) m = m + alpha1 * m_old;
  return m;
}

template <typename T>
C10_HOST_DEVICE inline T singd_factor_element(T k, T km, T beta, bool elementwise) {
  return k - beta * (elementwise ? k * km : km);
}

}  // namespace cafin
