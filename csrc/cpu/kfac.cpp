// CPU kernels of the K-FAC ops: the elementwise and reduction work around the preconditioning
// GEMMs (which stay in torch). Semantics: cafin/reference/kfac.py; arithmetic: kfac_math.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/vectorize.h"
#include "kfac_checks.h"
#include "kfac_math.h"

namespace cafin {
namespace {

// v + shift rounded to T, as the write rounds it (no shift: v as it is).
template <bool kShifted, typename T>
C10_ALWAYS_INLINE T shifted(T v, T shift) {
  return kShifted ? T(v + shift) : v;
}

// sum (x[k] + shift) * y[k] in double, in kLanes independent partial sums added up at the end:
// one running sum is a chain of dependent additions (the latency of one add per term); the
// lanes vectorise.
template <bool kShifted, typename T>
CAFIN_CPU_CLONES double dot_in_double(const T* __restrict x, const T* __restrict y, int64_t n, T shift) {
  constexpr int64_t kLanes = 8;
  double lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      lanes[j] += static_cast<double>(shifted<kShifted>(x[k + j], shift)) * static_cast<double>(y[k + j]);
    }
  }
  double total = 0.0;
  for (int64_t j = 0; j < kLanes; ++j) total += lanes[j];
  for (; k < n; ++k) {
    total += static_cast<double>(shifted<kShifted>(x[k], shift)) * static_cast<double>(y[k]);
  }
  return total;
}

// precond entry i's two terms of the clip sum: <V, g> over its weight columns, over its bias
// column. `ld`: the distance between V's rows.
template <bool kShifted, typename T>
std::pair<double, double> clip_terms(const T* vp, const T* w, const T* b, int64_t rows, int64_t ld,
                                     int64_t wc, bool bias, T shift) {
  const double weight = at::parallel_reduce(0, rows, std::max<int64_t>(1, kGrainSize / ld), 0.0,
      [&](int64_t lo, int64_t hi, double acc) {
        for (int64_t r = lo; r < hi; ++r) acc += dot_in_double<kShifted>(vp + r * ld, w + r * wc, wc, shift);
        return acc;
      }, std::plus<double>());
  double bias_term = 0.0;
  if (bias) {
    for (int64_t r = 0; r < rows; ++r) {
      bias_term += static_cast<double>(shifted<kShifted>(vp[r * ld + wc], shift)) * static_cast<double>(b[r]);
    }
  }
  return {weight, bias_term};
}

// g[c] <- (v[c] + shift) * nu for one row (built for each vector width, as dot_in_double).
template <bool kShifted, typename T>
CAFIN_CPU_CLONES void scale_row(const T* __restrict v, T* __restrict g, int64_t n, T shift, T nu) {
  for (int64_t c = 0; c < n; ++c) g[c] = shifted<kShifted>(v[c], shift) * nu;
}

// g <- (V + shift) * nu over precond entry i's weight and bias columns.
template <bool kShifted, typename T>
void write_scaled(const T* vp, T* w, T* b, int64_t rows, int64_t ld, int64_t wc, bool bias, T shift, T nu) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainSize / ld), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      scale_row<kShifted>(vp + r * ld, w + r * wc, wc, shift, nu);
      if (bias) b[r] = shifted<kShifted>(vp[r * ld + wc], shift) * nu;
    }
  });
}

void kfac_factor_ema_cpu(at::TensorList factors, at::TensorList stats, at::TensorList counts,
                         const at::Tensor& decay, const std::optional<at::Tensor>& step,
                         int64_t interval, const std::optional<at::Tensor>& dropped) {
  check_kfac_factor_ema(factors, stats, counts, decay, step, interval, dropped);
  if (factors.empty()) return;
  const bool due = kfac_due(step.has_value() ? step->const_data_ptr<float>() : nullptr, interval);
  const double decay_value = *decay.const_data_ptr<double>();
  int drops = 0;
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
        drops += finite ? 0 : 1;
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
  if (dropped.has_value()) *dropped->mutable_data_ptr<float>() += static_cast<float>(drops);
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
                                 const std::optional<at::Tensor>& kl_clip,
                                 const std::optional<at::Tensor>& shift, bool abs_terms) {
  check_kfac_precondition_apply(weight_grads, bias_grads, precond, lr, kl_clip, shift);
  if (weight_grads.empty()) return;
  AT_DISPATCH_FLOATING_TYPES(weight_grads[0].scalar_type(), "kfac_precondition_apply_", [&] {
    const size_t n = precond.size();
    const scalar_t* shifts = shift.has_value() ? shift->const_data_ptr<scalar_t>() : nullptr;
    auto layout = [&](size_t i) {  // rows, distance between rows, weight columns, bias
      const bool bias = bias_grads[i].numel() > 0;
      return std::make_tuple(precond[i].size(0) * precond[i].size(1), kfac_row_stride(precond[i]),
                             precond[i].size(2) - (bias ? 1 : 0), bias);
    };
    double scale = 1.0;
    if (kl_clip.has_value()) {
      // Every term, before any gradient is overwritten (accumulated in double).
      std::vector<double> parts(2 * n);
      for (size_t i = 0; i < n; ++i) {
        const auto [rows, ld, wc, bias] = layout(i);
        const scalar_t* vp = precond[i].const_data_ptr<scalar_t>();
        const scalar_t* w = weight_grads[i].const_data_ptr<scalar_t>();
        const scalar_t* b = bias_grads[i].const_data_ptr<scalar_t>();
        std::tie(parts[2 * i], parts[2 * i + 1]) =
            shifts != nullptr ? clip_terms<true>(vp, w, b, rows, ld, wc, bias, shifts[i])
                              : clip_terms<false>(vp, w, b, rows, ld, wc, bias, scalar_t(0));
      }
      const double lr_value = *lr.const_data_ptr<double>();
      const double total = kfac_clip_sum(parts.data(), static_cast<int64_t>(parts.size()), abs_terms);
      scale = kfac_kl_scale(total * (lr_value * lr_value), *kl_clip->const_data_ptr<double>());
    }
    const scalar_t nu = static_cast<scalar_t>(scale);
    for (size_t i = 0; i < n; ++i) {
      const auto [rows, ld, wc, bias] = layout(i);
      const scalar_t* vp = precond[i].const_data_ptr<scalar_t>();
      scalar_t* w = weight_grads[i].mutable_data_ptr<scalar_t>();
      scalar_t* b = bias_grads[i].mutable_data_ptr<scalar_t>();
      if (shifts != nullptr) {
        write_scaled<true>(vp, w, b, rows, ld, wc, bias, shifts[i], nu);
      } else {
        write_scaled<false>(vp, w, b, rows, ld, wc, bias, scalar_t(0), nu);
      }
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
