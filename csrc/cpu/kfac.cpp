// CPU kernels of the K-FAC ops: the elementwise and reduction work around the preconditioning
// GEMMs (which stay in torch). Semantics: cafin/reference/kfac.py; arithmetic: kfac_math.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "cpu/vectorize.h"
#include "kfac_checks.h"
#include "kfac_math.h"

namespace cafin {
namespace {

// sum x[k] * y[k] in double, in kLanes independent partial sums added up at the end: one running
// sum is a chain of dependent additions (the latency of one add per term); the lanes vectorise.
template <typename T>
CAFIN_CPU_CLONES double dot_in_double(const T* __restrict x, const T* __restrict y, int64_t n) {
  constexpr int64_t kLanes = 8;
  double lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += static_cast<double>(x[k + j]) * static_cast<double>(y[k + j]);
  }
  double total = 0.0;
  for (int64_t j = 0; j < kLanes; ++j) total += lanes[j];
  for (; k < n; ++k) total += static_cast<double>(x[k]) * static_cast<double>(y[k]);
  return total;
}

void kfac_factor_ema_cpu(at::TensorList factors, at::TensorList stats, at::TensorList counts,
                         const at::Tensor& decay, const std::optional<at::Tensor>& step,
                         int64_t interval) {
  check_kfac_factor_ema(factors, stats, counts, decay, step, interval);
  if (factors.empty()) return;
  const bool due = kfac_due(step.has_value() ? step->const_data_ptr<float>() : nullptr, interval);
  const double decay_value = *decay.const_data_ptr<double>();
  for (size_t i = 0; i < factors.size(); ++i) {
    AT_DISPATCH_FLOATING_TYPES(factors[i].scalar_type(), "kfac_factor_ema_", [&] {
      scalar_t* f = factors[i].mutable_data_ptr<scalar_t>();
      scalar_t* s = stats[i].mutable_data_ptr<scalar_t>();
      scalar_t* c = counts[i].mutable_data_ptr<scalar_t>();
      const int64_t d = factors[i].size(1);
      const int64_t groups = factors[i].size(0);
      bool finite = true;
      if (due && *c > scalar_t(0)) {
        const int64_t n = stats[i].numel();
        for (int64_t k = 0; k < n && finite; ++k) finite = std::isfinite(s[k]);
      }
      if (due && *c > scalar_t(0) && finite) {
        const scalar_t count = *c;
        const scalar_t dec = static_cast<scalar_t>(decay_value);
        // One row of the upper triangle per task: entry (r, j) and its mirror are read once and
        // written together, so the statistic can be emptied in the same pass.
        at::parallel_for(0, groups * d, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(d, 1)),
                         [&](int64_t lo, int64_t hi) {
          for (int64_t gr = lo; gr < hi; ++gr) {
            const int64_t base = (gr / d) * d * d;
            const int64_t r = gr % d;
            for (int64_t j = r; j < d; ++j) {
              const int64_t a = base + r * d + j, b = base + j * d + r;
              const scalar_t sa = s[a], sb = s[b];
              f[a] = kfac_ema(f[a], sa, sb, count, dec);
              if (a != b) f[b] = kfac_ema(f[b], sb, sa, count, dec);
            }
          }
        });
      }
      stats[i].zero_();
      *c = scalar_t(0);
    });
  }
}

void kfac_eigen_scale_cpu(at::TensorList v, at::TensorList dg, at::TensorList da,
                          const at::Tensor& damping) {
  check_kfac_eigen_scale(v, dg, da, damping);
  const double damping_value = v.empty() ? 0.0 : *damping.const_data_ptr<double>();
  for (size_t i = 0; i < v.size(); ++i) {
    AT_DISPATCH_FLOATING_TYPES(v[i].scalar_type(), "kfac_eigen_scale_", [&] {
      scalar_t* x = v[i].mutable_data_ptr<scalar_t>();
      const scalar_t* g = dg[i].const_data_ptr<scalar_t>();
      const scalar_t* a = da[i].const_data_ptr<scalar_t>();
      const int64_t rows = v[i].size(1), cols = v[i].size(2);
      const scalar_t lam = static_cast<scalar_t>(damping_value);
      at::parallel_for(0, v[i].size(0) * rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(cols, 1)),
                       [&](int64_t lo, int64_t hi) {
        for (int64_t gr = lo; gr < hi; ++gr) {
          const scalar_t gv = g[gr];
          const scalar_t* arow = a + (gr / rows) * cols;
          scalar_t* xrow = x + gr * cols;
          for (int64_t c = 0; c < cols; ++c) xrow[c] = kfac_eigen_scale(xrow[c], gv, arow[c], lam);
        }
      });
    });
  }
}

void kfac_precondition_apply_cpu(at::TensorList weight_grads, at::TensorList bias_grads,
                                 at::TensorList precond, const at::Tensor& lr,
                                 const std::optional<at::Tensor>& kl_clip) {
  check_kfac_precondition_apply(weight_grads, bias_grads, precond, lr, kl_clip);
  if (weight_grads.empty()) return;
  AT_DISPATCH_FLOATING_TYPES(weight_grads[0].scalar_type(), "kfac_precondition_apply_", [&] {
    double scale = 1.0;
    if (kl_clip.has_value()) {
      // <V, g> over every layer, before any gradient is overwritten (accumulated in double).
      double dot = 0.0;
      for (size_t i = 0; i < precond.size(); ++i) {
        const scalar_t* vp = precond[i].const_data_ptr<scalar_t>();
        const scalar_t* w = weight_grads[i].const_data_ptr<scalar_t>();
        const scalar_t* b = bias_grads[i].const_data_ptr<scalar_t>();
        const bool bias = bias_grads[i].numel() > 0;
        const int64_t rows = precond[i].size(0) * precond[i].size(1), cols = precond[i].size(2);
        const int64_t wc = cols - (bias ? 1 : 0);
        dot += at::parallel_reduce(0, rows, std::max<int64_t>(1, kGrainSize / cols), 0.0,
            [&](int64_t lo, int64_t hi, double acc) {
              for (int64_t r = lo; r < hi; ++r) {
                acc += dot_in_double(vp + r * cols, w + r * wc, wc);
                if (bias) acc += double(vp[r * cols + wc]) * double(b[r]);
              }
              return acc;
            }, std::plus<double>());
      }
      const double lr_value = *lr.const_data_ptr<double>();
      scale = kfac_kl_scale(dot * (lr_value * lr_value), *kl_clip->const_data_ptr<double>());
    }
    const scalar_t nu = static_cast<scalar_t>(scale);
    for (size_t i = 0; i < precond.size(); ++i) {
      const scalar_t* vp = precond[i].const_data_ptr<scalar_t>();
      scalar_t* w = weight_grads[i].mutable_data_ptr<scalar_t>();
      scalar_t* b = bias_grads[i].mutable_data_ptr<scalar_t>();
      const bool bias = bias_grads[i].numel() > 0;
      const int64_t rows = precond[i].size(0) * precond[i].size(1), cols = precond[i].size(2);
      const int64_t wc = cols - (bias ? 1 : 0);
      at::parallel_for(0, rows, std::max<int64_t>(1, kGrainSize / cols), [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          for (int64_t c = 0; c < wc; ++c) w[r * wc + c] = vp[r * cols + c] * nu;
          if (bias) b[r] = vp[r * cols + wc] * nu;
        }
      });
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CPU, m) {
  m.impl("kfac_factor_ema_", &kfac_factor_ema_cpu);
  m.impl("kfac_eigen_scale_", &kfac_eigen_scale_cpu);
  m.impl("kfac_precondition_apply_", &kfac_precondition_apply_cpu);
}

}  // namespace cafin
