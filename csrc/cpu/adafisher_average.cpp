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
#include "cpu/vectorize.h"

namespace cafin {
namespace {

// What one scan of a statistic's means finds.
template <typename T>
struct MeanRange {
  T zmin, zmax;    // of the means
  bool nonfinite;  // a mean is NaN or +-inf: the statistic is dropped
};

// The range of a statistic's means, in independent lanes so the loop vectorises (a single running
// std::min would not); the minimum and maximum are the same whatever the order.
template <typename T>
CAFIN_CPU_CLONES MeanRange<T> mean_range(const T* __restrict stat, int64_t n, T count, T scale_sq, bool scaled) {
  constexpr int64_t kLanes = 64 / sizeof(T);
  const T inf = std::numeric_limits<T>::infinity();
  T lo[kLanes], hi[kLanes], nonfinite[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    lo[j] = inf;
    hi[j] = -inf;
    nonfinite[j] = T(0);
  }
  auto scan = [&](int64_t j, T mean) {
    // mean - mean is 0 for a finite mean and NaN for NaN or +-inf (one compare, vectorised).
    nonfinite[j] = mean - mean != T(0) ? T(1) : nonfinite[j];
    lo[j] = mean < lo[j] ? mean : lo[j];
    hi[j] = mean > hi[j] ? mean : hi[j];
  };
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) scan(j, statistic_mean(stat[k + j], count, scale_sq, scaled));
  }
  for (int64_t j = 0; k < n; ++k, ++j) scan(j, statistic_mean(stat[k], count, scale_sq, scaled));
  MeanRange<T> r{inf, -inf, false};
  for (int64_t j = 0; j < kLanes; ++j) {
    r.nonfinite = r.nonfinite || nonfinite[j] != T(0);
    r.zmin = std::min(r.zmin, lo[j]);
    r.zmax = std::max(r.zmax, hi[j]);
  }
  return r;
}

// Whether every entry of a factor was updated before (none is negative).
template <typename T>
CAFIN_CPU_CLONES bool all_updated(const T* __restrict factor, int64_t n) {
  constexpr int64_t kLanes = 64 / sizeof(T);
  T negative[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) negative[j] = factor[k + j] < T(0) ? T(1) : negative[j];
  }
  bool any = false;
  for (; k < n; ++k) any = any || factor[k] < T(0);
  for (int64_t j = 0; j < kLanes; ++j) any = any || negative[j] != T(0);
  return !any;
}

// factor[k] <- the running average with the min-max normalised mean of stat[k].
template <typename T>
void fold_means(T* factor, const T* stat, int64_t n, T count, T scale_sq, bool scaled, T zmin,
                T denominator, T keep, T add) {
  for (int64_t k = 0; k < n; ++k) {
    const T z = statistic_mean(stat[k], count, scale_sq, scaled);
    factor[k] = average_factor(factor[k], z, zmin, denominator, keep, add);
  }
}

// The same where every factor entry was updated before (all but a statistic's first fold): average_factor's arithmetic without its selects, which keep GCC from
// vectorising the division they feed.
template <typename T>
CAFIN_CPU_CLONES void fold_finite_means(T* __restrict factor, const T* __restrict stat, int64_t n, T count,
                                        T scale_sq, bool scaled, T zmin, T denominator, T keep, T add) {
  for (int64_t k = 0; k < n; ++k) {
    const T z = statistic_mean(stat[k], count, scale_sq, scaled);
    factor[k] = factor[k] * keep + add * ((z - zmin) / denominator);
  }
}

// Returns whether the statistic held NaN or inf and was dropped (its factor untouched).
template <typename T>
bool fold_statistic(T* factor, T* stat, int64_t n, bool scaled, float grad_scale, double gamma) {
  const T count = stat[n];
  bool dropped = false;
  if (count > T(0)) {
    const T scale = static_cast<T>(grad_scale);
    const T scale_sq = scale * scale;
    const MeanRange<T> r = mean_range(stat, n, count, scale_sq, scaled);
    dropped = r.nonfinite;
    if (!dropped) {
      const T denominator = minmax_denominator(r.zmin, r.zmax);
      const T keep = factor_keep<T>(gamma), add = factor_add<T>(gamma);
      if (all_updated(factor, n)) {
        fold_finite_means(factor, stat, n, count, scale_sq, scaled, r.zmin, denominator, keep, add);
      } else {
        fold_means(factor, stat, n, count, scale_sq, scaled, r.zmin, denominator, keep, add);
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
  // Chunks of whole statistics with about equal numbers of entries (a statistic's range needs all
  // of it), as many as the entries keep threads busy: a network's statistics are often fewer
  // entries than a thread's start costs.
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += factors[i].numel();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / kGrainSize));
  std::vector<int64_t> first_of(chunks + 1, n);
  for (int64_t i = 0, seen = 0, k = 0; i < n; seen += factors[i].numel(), ++i) {
    while (k < chunks && seen >= total * k / chunks) first_of[k++] = i;
  }
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_lo, int64_t chunk_hi) {
    for (int64_t i = first_of[chunk_lo]; i < first_of[chunk_hi]; ++i) {
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
