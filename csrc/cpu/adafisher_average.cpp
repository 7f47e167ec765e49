// CPU kernel of fisher_average_: fold each accumulated statistic into its factor and empty it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "adafisher_math.h"
#include "checks.h"

namespace cafin {
namespace {

// Returns whether the statistic held NaN and was dropped (its factor untouched).
template <typename T>
bool fold_statistic(T* factor, T* stat, int64_t n, bool scaled, float grad_scale, double gamma) {
  const T count = stat[n];
  bool dropped = false;
  if (count > T(0)) {
    const T scale = static_cast<T>(grad_scale);
    const T scale_sq = scale * scale;
    auto z_at = [&](int64_t k) { return map_inf(statistic_mean(stat[k], count, scale_sq, scaled)); };
    T zmin = std::numeric_limits<T>::infinity();
    T zmax = -zmin;
    for (int64_t k = 0; k < n; ++k) {
      const T z = z_at(k);
      dropped = dropped || std::isnan(z);
      zmin = std::min(zmin, z);
      zmax = std::max(zmax, z);
    }
    if (!dropped) {
      const T denominator = minmax_denominator(zmin, zmax);
      const T keep = factor_keep<T>(gamma);
      const T add = factor_add<T>(gamma);
      for (int64_t k = 0; k < n; ++k) {
        factor[k] = average_factor(factor[k], z_at(k), zmin, denominator, keep, add);
      }
    }
  }
  std::fill(stat, stat + n + 1, T(0));
  return dropped;
}

void fisher_average_cpu(at::TensorList factors, at::TensorList stats, const at::Tensor& skipped,
                        const at::Tensor& gamma_tensor, const c10::List<bool>& grad_side,
                        const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf) {
  check_fisher_average(factors, stats, skipped, gamma_tensor, grad_side, grad_scale, found_inf);
  const int64_t n = static_cast<int64_t>(factors.size());
  if (found_inf.has_value() && *found_inf->const_data_ptr<float>() != 0.0f) {
    // The statistics of a skipped step are void.
    for (const at::Tensor& stat : stats) {
      AT_DISPATCH_FLOATING_TYPES(stat.scalar_type(), "fisher_average_", [&] {
        std::fill_n(stat.mutable_data_ptr<scalar_t>(), stat.numel(), scalar_t(0));
      });
    }
    return;
  }
  const double gamma = factors.empty() ? 0.0 : gamma_tensor.item<double>();
  const float scale = grad_scale.has_value() ? *grad_scale->const_data_ptr<float>() : 1.0f;
  std::vector<char> dropped(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const bool scaled = grad_side[i] && grad_scale.has_value();
      AT_DISPATCH_FLOATING_TYPES(factors[i].scalar_type(), "fisher_average_", [&] {
        dropped[i] = fold_statistic(factors[i].mutable_data_ptr<scalar_t>(),
                                    stats[i].mutable_data_ptr<scalar_t>(), factors[i].numel(), scaled,
                                    scale, gamma);
      });
    }
  });
  // Counted, not warned here: the optimizer turns the count into a Python warning, the same
  // for both backends (a C++ warning from a kernel is not always a catchable Python one).
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += dropped[i] ? 1 : 0;
  *skipped.mutable_data_ptr<float>() += static_cast<float>(count);
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CPU, m) {
  m.impl("fisher_average_", &fisher_average_cpu);
}

}  // namespace cafin
