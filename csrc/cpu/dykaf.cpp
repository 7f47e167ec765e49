// CPU kernels of the DyKAF ops (schemas in csrc/ops.cpp, semantics in cafin/reference/dykaf.py).
// The rotations around them are GEMMs and stay in torch; these are the elementwise and reduction
// parts: the rank-one second moment, the rotated Adam update with its denominator formed per
// element, and the parameter update with decoupled decay.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "dykaf_checks.h"
#include "dykaf_math.h"
#include "vectorize.h"

namespace cafin {
namespace {

// sum a[k] * b[k] in fixed-width lanes of T, each lane's partial sum of at most kRun terms folded
// into double. The lanes are two 32-byte GCC vectors (an AVX2 register each in the x86-64-v3
// clone), so the loop is vertical adds without -ffast-math: an array of lanes was vectorised
// across k with shuffles, and one 64-byte vector was spilled to the stack on AVX2.
template <typename T>
CAFIN_CPU_CLONES double dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  constexpr int64_t kHalf = 32 / sizeof(T), kLanes = 2 * kHalf, kRun = 1024;
  typedef T Lanes __attribute__((vector_size(32)));
  double total = 0;
  int64_t k = 0;
  while (n - k >= kLanes) {
    Lanes lo = {}, hi = {};
    const int64_t end = k + std::min<int64_t>((n - k) / kLanes, kRun) * kLanes;
    for (; k < end; k += kLanes) {
      Lanes xl, xh, yl, yh;
      std::memcpy(&xl, a + k, sizeof xl);
      std::memcpy(&xh, a + k + kHalf, sizeof xh);
      std::memcpy(&yl, b + k, sizeof yl);
      std::memcpy(&yh, b + k + kHalf, sizeof yh);
      lo += xl * yl;
      hi += xh * yh;
    }
    for (int64_t j = 0; j < kHalf; ++j) total += static_cast<double>(lo[j]);
    for (int64_t j = 0; j < kHalf; ++j) total += static_cast<double>(hi[j]);
  }
  for (; k < n; ++k) total += static_cast<double>(a[k]) * static_cast<double>(b[k]);
  return total;
}

template <typename T>
double norm_of(const T* x, int64_t n) {
  return std::sqrt(dot(x, x, n));
}

// x[k] *= s.
template <typename T>
CAFIN_CPU_CLONES void scale(T* __restrict x, T s, int64_t n) {
  for (int64_t k = 0; k < n; ++k) x[k] *= s;
}

// x / |x|, or the uniform direction when |x| = 0 and the guard is on.
template <typename T>
void unit(std::vector<T>& out, const T* x, int64_t n, double norm, bool guard) {
  out.resize(n);
  const bool uniform = guard && !(norm > 0);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = uniform ? static_cast<T>(1.0 / std::sqrt(static_cast<double>(n)))
                     : static_cast<T>(x[i] / static_cast<T>(norm));
  }
}

// sq[j] = row[j]^2.
template <typename T>
CAFIN_CPU_CLONES void square(T* __restrict sq, const T* __restrict row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) sq[j] = row[j] * row[j];
}

// acc[j] += x[j] * w.
template <typename T>
CAFIN_CPU_CLONES void add_scaled(T* __restrict acc, const T* __restrict x, T w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += x[j] * w;
}

// row[j] = dykaf_rank_one_precondition(row[j], l, r[j], guard).
template <typename T>
CAFIN_CPU_CLONES void precondition_row(T* __restrict row, T l, const T* __restrict r, T guard, int64_t n) {
  for (int64_t j = 0; j < n; ++j) row[j] = dykaf_rank_one_precondition(row[j], l, r[j], guard);
}

// x[k] = dykaf_split_sum(f[k], x[k], sigma).
template <typename T>
CAFIN_CPU_CLONES void split_sum(T* __restrict x, const T* __restrict f, T sigma, int64_t n) {
  for (int64_t k = 0; k < n; ++k) x[k] = dykaf_split_sum(f[k], x[k], sigma);
}

// x[k] /= d.
template <typename T>
CAFIN_CPU_CLONES void divide(T* __restrict x, T d, int64_t n) {
  for (int64_t k = 0; k < n; ++k) x[k] = x[k] / d;
}

template <typename T>
void rank_one_one(T* l, T* r, const T* gp, int64_t m, int64_t n, T beta2, bool guard) {
  const double l_norm = norm_of(l, m), r_norm = norm_of(r, n);
  std::vector<T> l_hat, r_hat;
  unit(l_hat, l, m, l_norm, guard);
  unit(r_hat, r, n, r_norm, guard);
  // Row sums (gp^2) r_hat and column sums (gp^2)^T l_hat in one pass over gp.
  std::vector<T> rows(m), cols(n, T(0)), sq(n);
  for (int64_t i = 0; i < m; ++i) {
    square(sq.data(), gp + i * n, n);
    add_scaled(cols.data(), sq.data(), l_hat[i], n);
    rows[i] = static_cast<T>(dot(sq.data(), r_hat.data(), n));
  }
  const T np = static_cast<T>(l_norm) * static_cast<T>(r_norm);
  std::vector<T> l_new(m), r_new(n);
  for (int64_t i = 0; i < m; ++i) l_new[i] = dykaf_rank_one_direction(l_hat[i], rows[i], beta2, np);
  for (int64_t j = 0; j < n; ++j) r_new[j] = dykaf_rank_one_direction(r_hat[j], cols[j], beta2, np);
  std::vector<T> lu, ru;
  unit(lu, l_new.data(), m, norm_of(l_new.data(), m), guard);
  unit(ru, r_new.data(), n, norm_of(r_new.data(), n), guard);
  T ll = 0, rr = 0, quad = 0;
  for (int64_t i = 0; i < m; ++i) ll += lu[i] * l_hat[i];
  for (int64_t j = 0; j < n; ++j) rr += ru[j] * r_hat[j];
  for (int64_t i = 0; i < m; ++i) {
    square(sq.data(), gp + i * n, n);
    quad += lu[i] * static_cast<T>(dot(sq.data(), ru.data(), n));
  }
  const T c = beta2 * ll * rr * static_cast<T>(l_norm) * static_cast<T>(r_norm) + (T(1) - beta2) * quad;
  const T root = std::sqrt(c);
  for (int64_t i = 0; i < m; ++i) l[i] = lu[i] * root;
  for (int64_t j = 0; j < n; ++j) r[j] = ru[j] * root;
}

void rank_one_cpu(at::TensorList ls, at::TensorList rs, at::TensorList gps, const at::Tensor& beta2,
                  const at::Tensor& guard_tensor) {
  check_dykaf_rank_one(ls, rs, gps, beta2, guard_tensor);
  if (gps.empty()) return;
  const double b2 = beta2.item<double>(), guard = guard_tensor.item<double>();
  at::parallel_for(0, static_cast<int64_t>(ls.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::Tensor& gp = gps[t];
      AT_DISPATCH_FLOATING_TYPES(gp.scalar_type(), "dykaf_rank_one_", [&] {
        rank_one_one<scalar_t>(ls[t].data_ptr<scalar_t>(), rs[t].data_ptr<scalar_t>(),
                               gp.data_ptr<scalar_t>(), gp.size(0), gp.size(1),
                               static_cast<scalar_t>(b2), guard > 0);
      });
    }
  });
}

void precondition_cpu(at::TensorList mps, at::TensorList ls, at::TensorList rs,
                      const at::Tensor& guard_tensor) {
  check_dykaf_precondition(mps, ls, rs, guard_tensor);
  if (mps.empty()) return;
  const double guard = guard_tensor.item<double>();
  for (size_t t = 0; t < mps.size(); ++t) {
    const at::Tensor& mp = mps[t];
    const int64_t m = mp.size(0), n = mp.size(1);
    AT_DISPATCH_FLOATING_TYPES(mp.scalar_type(), "dykaf_precondition_", [&] {
      scalar_t* x = mp.data_ptr<scalar_t>();
      const scalar_t* l = ls[t].data_ptr<scalar_t>();
      const scalar_t* r = rs[t].data_ptr<scalar_t>();
      const scalar_t g = static_cast<scalar_t>(guard);
      at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) precondition_row(x + i * n, l[i], r, g, n);
      });
    });
  }
}

void adam_precondition_cpu(at::TensorList mps, at::TensorList vs, at::TensorList gps,
                           const at::Tensor& beta2, const at::Tensor& eps_tensor) {
  check_dykaf_adam_precondition(mps, vs, gps, beta2, eps_tensor);
  if (mps.empty()) return;
  const double b2 = beta2.item<double>(), eps = eps_tensor.item<double>();
  for (size_t t = 0; t < mps.size(); ++t) {
    AT_DISPATCH_FLOATING_TYPES(mps[t].scalar_type(), "dykaf_adam_precondition_", [&] {
      scalar_t* x = mps[t].data_ptr<scalar_t>();
      scalar_t* v = vs[t].data_ptr<scalar_t>();
      const scalar_t* g = gps[t].data_ptr<scalar_t>();
      const scalar_t b = static_cast<scalar_t>(b2), e = static_cast<scalar_t>(eps);
      at::parallel_for(0, mps[t].numel(), 2048, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) x[k] = dykaf_adam_precondition(x[k], v[k], g[k], b, e);
      });
    });
  }
}

void apply_cpu(at::TensorList params, at::TensorList updates, const at::Tensor& step_size,
               const at::Tensor& lr, const at::Tensor& weight_decay_tensor, bool normalize) {
  check_dykaf_apply(params, updates, step_size, lr, weight_decay_tensor, normalize);
  if (params.empty()) return;
  const double* sizes = step_size.const_data_ptr<double>();
  const bool per_tensor = step_size.dim() == 1;
  const double weight_decay = weight_decay_tensor.item<double>();
  const double decay = weight_decay > 0 ? lr.item<double>() * weight_decay : 0.0;
  for (size_t t = 0; t < params.size(); ++t) {
    const double s = sizes[per_tensor ? t : 0];
    const at::Tensor& u = updates[t];
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "dykaf_apply_", [&] {
      using T = scalar_t;
      const T* x = u.data_ptr<T>();
      const int64_t n = u.numel();
      T scale = 1;
      if (normalize) {
        double sq = 0;
        for (int64_t k = 0; k < n; ++k) sq += static_cast<double>(x[k]) * static_cast<double>(x[k]);
        scale = T(1) / (static_cast<T>(1e-30) + static_cast<T>(std::sqrt(sq / static_cast<double>(n))));
      }
      const T ss = static_cast<T>(s), dd = static_cast<T>(decay);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[t].scalar_type(), "dykaf_apply_p", [&] {
        scalar_t* p = params[t].data_ptr<scalar_t>();
        at::parallel_for(0, n, 2048, [&](int64_t begin, int64_t end) {
          for (int64_t k = begin; k < end; ++k) {
            p[k] = static_cast<scalar_t>(dykaf_apply(static_cast<T>(p[k]), x[k], scale, ss, dd));
          }
        });
      });
    });
  }
}

void split_normalize_cpu(at::TensorList K, at::TensorList M, at::TensorList L, at::TensorList R,
                         at::TensorList sigma) {
  check_dykaf_split("dykaf_split_normalize_", {{"K", K}, {"M", M}, {"L", L}, {"R", R}}, sigma);
  for (size_t i = 0; i < K.size(); ++i) {
    check_dykaf_same_shape(K[i], L[i], "K", "L", i);
    check_dykaf_same_shape(M[i], R[i], "M", "R", i);
  }
  for (size_t t = 0; t < K.size(); ++t) {
    AT_DISPATCH_FLOATING_TYPES(K[t].scalar_type(), "dykaf_split_normalize_", [&] {
      using T = scalar_t;
      const T* s = sigma[t].data_ptr<T>();
      const int64_t batch = K[t].size(0);
      for (const auto& [x, f] : {std::pair<at::Tensor, at::Tensor>{K[t], L[t]}, {M[t], R[t]}}) {
        T* xp = x.data_ptr<T>();
        const T* fp = f.data_ptr<T>();
        const int64_t d2 = x.size(1) * x.size(2);
        at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
          for (int64_t b = begin; b < end; ++b) {
            T* xb = xp + b * d2;
            split_sum(xb, fp + b * d2, s[b], d2);
            divide(xb, static_cast<T>(norm_of(xb, d2)), d2);
          }
        });
      }
    });
  }
}

void split_scale_cpu(at::TensorList U, at::TensorList V, at::TensorList L, at::TensorList R,
                     at::TensorList C, at::TensorList sigma) {
  check_dykaf_split("dykaf_split_scale_", {{"U", U}, {"V", V}, {"L", L}, {"R", R}, {"C", C}}, sigma);
  for (size_t i = 0; i < U.size(); ++i) {
    check_dykaf_same_shape(U[i], L[i], "U", "L", i);
    check_dykaf_same_shape(U[i], C[i], "U", "C", i);
    check_dykaf_same_shape(V[i], R[i], "V", "R", i);
  }
  for (size_t t = 0; t < U.size(); ++t) {
    AT_DISPATCH_FLOATING_TYPES(U[t].scalar_type(), "dykaf_split_scale_", [&] {
      using T = scalar_t;
      T* u = U[t].data_ptr<T>();
      T* v = V[t].data_ptr<T>();
      const T* l = L[t].data_ptr<T>();
      const T* r = R[t].data_ptr<T>();
      const T* c = C[t].data_ptr<T>();
      const T* s = sigma[t].data_ptr<T>();
      const int64_t m2 = U[t].size(1) * U[t].size(2), n2 = V[t].size(1) * V[t].size(2);
      at::parallel_for(0, U[t].size(0), 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          T* ub = u + b * m2;
          T* vb = v + b * n2;
          const double lu = dot(l + b * m2, ub, m2), uc = dot(ub, c + b * m2, m2);
          const double rv = dot(r + b * n2, vb, n2);
          const T root = std::sqrt(dykaf_split_weight(static_cast<T>(lu), static_cast<T>(rv),
                                                      static_cast<T>(uc), s[b]));
          scale(ub, root, m2);
          scale(vb, root, n2);
        }
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CPU, m) {
  m.impl("dykaf_split_normalize_", &split_normalize_cpu);
  m.impl("dykaf_split_scale_", &split_scale_cpu);
  m.impl("dykaf_rank_one_", &rank_one_cpu);
  m.impl("dykaf_precondition_", &precondition_cpu);
  m.impl("dykaf_adam_precondition_", &adam_precondition_cpu);
  m.impl("dykaf_apply_", &apply_cpu);
}

}  // namespace cafin
