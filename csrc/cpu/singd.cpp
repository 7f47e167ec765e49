// CPU kernels of SINGD's ops. singd_diag_step_ is the row-column skeleton (cpu/row_column.h)
// with SINGD's per-element maths (singd_math.h): R = C, C = K, the natural gradient
// C[r]^2 G K[c]^2 then SGD's epilogue. Semantics: cafin/reference/singd.py.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu/row_column.h"
#include "singd_checks.h"
#include "singd_math.h"

namespace cafin {
namespace {

template <typename Op>
void diag_bucket(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::TensorList K,
                 at::TensorList C, at::IntArrayRef k_offsets, const typename Op::Coeffs& s) {
  using scalar_t = typename Op::scalar_t;
  using opmath_t = typename Op::opmath_t;
  std::vector<RowColumnTensor<Op>> tensors;
  tensors.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const bool plain = C[i].numel() == 0;
    tensors.push_back({params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(),
                       Op::kState ? bufs[i].mutable_data_ptr<scalar_t>() : nullptr,
                       plain ? nullptr : C[i].const_data_ptr<opmath_t>(),
                       plain ? nullptr : K[i].const_data_ptr<opmath_t>() + k_offsets[i], params[i].numel(),
                       plain ? params[i].numel() : params[i].numel() / C[i].numel(),
                       plain ? RowColumnFactors::kNone : RowColumnFactors::kFactors, s});
  }
  row_column_apply(tensors);
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
    if (bufs.empty()) {
      diag_bucket<SingdDiagElement<scalar_t, opmath_t, false>>(params, grads, bufs, K, C, k_offsets, s);
    } else {
      diag_bucket<SingdDiagElement<scalar_t, opmath_t, true>>(params, grads, bufs, K, C, k_offsets, s);
    }
  });
}

void singd_momentum_cpu(at::TensorList m, at::TensorList H, at::TensorList KtK, at::TensorList c_h,
                        at::TensorList c_damp, at::TensorList go, at::IntArrayRef eye,
                        at::IntArrayRef pi, at::TensorList scale, at::TensorList alpha1) {
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
      const opmath_t p = static_cast<opmath_t>(pi[i]), sc = *scale[i].const_data_ptr<opmath_t>();
      const opmath_t a1 = *alpha1[i].const_data_ptr<opmath_t>();
      const bool with_old = a1 != opmath_t(0);
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
