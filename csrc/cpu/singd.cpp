// CPU kernel of singd_diag_step_: the whole SINGD step of layers whose K and C are diagonal, one
// pass over the bucket (read theta, g, buf and the factor entries; write theta, buf), threads over
// each tensor's elements. Semantics: cafin/reference/singd.py; arithmetic: singd_math.h.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "cpu/vectorize.h"
#include "singd_checks.h"
#include "singd_math.h"

namespace cafin {
namespace {

// Rows [r0, r1) of a parameter viewed as [rows, cols]: C[r] is constant along a row and K runs
// with the columns, so the inner loop is a plain vectorisable stream (no division per element).
// K and C null: no factors, the row is a flat range of the parameter.
template <bool kMomentum, typename scalar_t, typename opmath_t>
CAFIN_CPU_CLONES void diag_rows(scalar_t* theta, const scalar_t* grad, scalar_t* buf, const opmath_t* K,
                                const opmath_t* C, int64_t r0, int64_t r1, int64_t cols,
                                SingdCoeffs<opmath_t> s) {
  for (int64_t r = r0; r < r1; ++r) {
    const opmath_t c = C != nullptr ? C[r] : opmath_t(1);
    scalar_t* th_row = theta + r * cols;
    const scalar_t* g_row = grad + r * cols;
    scalar_t* b_row = kMomentum ? buf + r * cols : nullptr;
    for (int64_t j = 0; j < cols; ++j) {
      const opmath_t k = K != nullptr ? K[j] : opmath_t(1);
      opmath_t th = static_cast<opmath_t>(th_row[j]);
      opmath_t b = kMomentum ? static_cast<opmath_t>(b_row[j]) : opmath_t(0);
      singd_diag_element<kMomentum>(th, b, static_cast<opmath_t>(g_row[j]), k, c, s);
      th_row[j] = static_cast<scalar_t>(th);
      if (kMomentum) b_row[j] = static_cast<scalar_t>(b);
    }
  }
}

template <bool kMomentum, typename scalar_t, typename opmath_t>
void diag_tensor(scalar_t* theta, const scalar_t* grad, scalar_t* buf, const opmath_t* K,
                 const opmath_t* C, int64_t numel, int64_t cols, const SingdCoeffs<opmath_t>& s) {
  if (C == nullptr) {  // no factors: flat chunks, so threads still share one big tensor
    constexpr int64_t kChunk = 4096;
    const int64_t chunks = (numel + kChunk - 1) / kChunk;
    at::parallel_for(0, chunks, std::max<int64_t>(1, kGrainSize / kChunk), [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t lo = c * kChunk, len = std::min(kChunk, numel - lo);
        diag_rows<kMomentum>(theta + lo, grad + lo, kMomentum ? buf + lo : buf, K, C, 0, 1, len, s);
      }
    });
    return;
  }
  const int64_t rows = numel / cols;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(cols, 1)),
                   [&](int64_t r0, int64_t r1) { diag_rows<kMomentum>(theta, grad, buf, K, C, r0, r1, cols, s); });
}

void singd_diag_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList bufs,
                         at::TensorList K, at::TensorList C, at::IntArrayRef k_offsets,
                         const at::Tensor& lr, const at::Tensor& momentum,
                         const at::Tensor& weight_decay, const std::optional<at::Tensor>& grad_scale) {
  check_singd_diag_step(params, grads, bufs, K, C, k_offsets, lr, momentum, weight_decay, grad_scale);
  if (params.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "singd_diag_step_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t scale = grad_scale.has_value() ? *grad_scale->const_data_ptr<opmath_t>() : opmath_t(1);
    const SingdCoeffs<opmath_t> s{*lr.const_data_ptr<opmath_t>(), *momentum.const_data_ptr<opmath_t>(),
                                  *weight_decay.const_data_ptr<opmath_t>(), scale, scale != opmath_t(1)};
    for (size_t i = 0; i < params.size(); ++i) {
      const bool plain = C[i].numel() == 0;
      const int64_t cols = plain ? params[i].numel() : params[i].numel() / C[i].numel();
      scalar_t* buf = bufs.empty() ? nullptr : bufs[i].mutable_data_ptr<scalar_t>();
      const opmath_t* k = plain ? nullptr : K[i].const_data_ptr<opmath_t>() + k_offsets[i];
      const opmath_t* c = plain ? nullptr : C[i].const_data_ptr<opmath_t>();
      if (buf != nullptr) {
        diag_tensor<true>(params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(), buf,
                          k, c, params[i].numel(), cols, s);
      } else {
        diag_tensor<false>(params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(), buf,
                           k, c, params[i].numel(), cols, s);
      }
    }
  });
}

void singd_momentum_cpu(at::TensorList m, at::TensorList H, at::TensorList KtK, at::TensorList c_h,
                        at::TensorList c_damp, at::TensorList go, at::IntArrayRef eye,
                        c10::ArrayRef<double> pi, c10::ArrayRef<double> scale,
                        c10::ArrayRef<double> alpha1) {
  check_singd_momentum(m, H, KtK, c_h, c_damp, go, eye, pi, scale, alpha1);
  if (m.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, m[0].scalar_type(), "singd_momentum_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    for (size_t i = 0; i < m.size(); ++i) {
      if (!*go[i].const_data_ptr<bool>()) continue;
      scalar_t* mp = m[i].mutable_data_ptr<scalar_t>();
      scalar_t* hp = H[i].mutable_data_ptr<scalar_t>();
      const scalar_t* kp = KtK[i].const_data_ptr<scalar_t>();
      const opmath_t ch = *c_h[i].const_data_ptr<opmath_t>(), cd = *c_damp[i].const_data_ptr<opmath_t>();
      const opmath_t p = static_cast<opmath_t>(pi[i]), sc = static_cast<opmath_t>(scale[i]);
      const opmath_t a1 = static_cast<opmath_t>(alpha1[i]);
      const bool with_old = alpha1[i] != 0.0;
      const int64_t kind = eye[i];
      const int64_t cols = m[i].dim() >= 1 ? m[i].size(-1) : 1;
      const int64_t rows = m[i].dim() >= 2 ? m[i].size(-2) : 1;
      at::parallel_for(0, m[i].numel(), 16384, [&](int64_t begin, int64_t end) {
        for (int64_t e = begin; e < end; ++e) {
          const opmath_t old = with_old ? static_cast<opmath_t>(mp[e]) : opmath_t(0);
          mp[e] = static_cast<scalar_t>(singd_momentum_element<opmath_t>(
              static_cast<opmath_t>(hp[e]), static_cast<opmath_t>(kp[e]), old,
              singd_is_eye(kind, e, rows, cols), ch, cd, p, sc, a1, with_old));
          hp[e] = scalar_t(0);
        }
      });
    }
  });
}

void singd_factor_step_cpu(at::TensorList K, at::TensorList KM, at::TensorList beta, at::TensorList go,
                           const c10::List<bool>& elementwise) {
  check_singd_factor_step(K, KM, beta, go, elementwise);
  if (K.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, K[0].scalar_type(), "singd_factor_step_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    for (size_t i = 0; i < K.size(); ++i) {
      if (!*go[i].const_data_ptr<bool>()) continue;
      scalar_t* kp = K[i].mutable_data_ptr<scalar_t>();
      const scalar_t* km = KM[i].const_data_ptr<scalar_t>();
      const opmath_t b = *beta[i].const_data_ptr<opmath_t>();
      const bool ew = elementwise[i];
      at::parallel_for(0, K[i].numel(), 16384, [&](int64_t begin, int64_t end) {
        for (int64_t e = begin; e < end; ++e) {
          kp[e] = static_cast<scalar_t>(singd_factor_element<opmath_t>(
              static_cast<opmath_t>(kp[e]), static_cast<opmath_t>(km[e]), b, ew));
        }
      });
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CPU, m) {
  m.impl("singd_diag_step_", &singd_diag_step_cpu);
  m.impl("singd_momentum_", &singd_momentum_cpu);
  m.impl("singd_factor_step_", &singd_factor_step_cpu);
}

}  // namespace cafin
