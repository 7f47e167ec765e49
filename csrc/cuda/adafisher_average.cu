// CUDA kernel of fisher_average_: one block per statistic vector, all vectors in one launch (a
// table passed by value, like the update's; more launches only past kMaxEntries vectors). NaN
// drops are counted on the device in `skipped`; there is no warning, which would need a host sync.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "adafisher_math.h"
#include "checks.h"

namespace cafin {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxEntries = 128;

struct AverageTable {
  void* factor[kMaxEntries];
  void* stat[kMaxEntries];
  int64_t numel[kMaxEntries];
  bool scaled[kMaxEntries];  // a gradient-side statistic with a grad scale given
  bool is_double[kMaxEntries];
};

struct AverageArgs {
  float* skipped;
  const float* grad_scale;
  const float* found_inf;
  const double* gamma;
};

static_assert(sizeof(AverageTable) + sizeof(AverageArgs) <= 4000, "kernel arguments must stay under 4 KB");

// Block-wide min and max, valid in every thread.
template <typename T>
__device__ void block_min_max(T& lo, T& hi) {
  __shared__ T mins[kWarps];
  __shared__ T maxs[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
  }
  if (threadIdx.x % 32 == 0) {
    mins[threadIdx.x / 32] = lo;
    maxs[threadIdx.x / 32] = hi;
  }
  __syncthreads();
  lo = mins[0];
  hi = maxs[0];
  for (int w = 1; w < kWarps; ++w) {
    lo = min(lo, mins[w]);
    hi = max(hi, maxs[w]);
  }
}

template <typename T>
__device__ void fold_statistic(T* factor, T* stat, int64_t n, bool scaled, const AverageArgs& args) {
  const T count = stat[n];  // every thread reads it before the barrier in block_min_max
  const T scale = scaled ? static_cast<T>(*args.grad_scale) : T(1);
  const T scale_sq = scale * scale;
  const bool active = count > T(0);
  T lo = std::numeric_limits<T>::infinity();
  T hi = -lo;
  bool nonfinite = false;  // a mean is NaN or +-inf: the statistic is dropped
  if (active) {
    for (int64_t k = threadIdx.x; k < n; k += kThreads) {
      const T z = statistic_mean(stat[k], count, scale_sq, scaled);
      nonfinite = nonfinite || !isfinite(z);
      lo = min(lo, z);
      hi = max(hi, z);
    }
  }
  nonfinite = __syncthreads_or(nonfinite);
  block_min_max(lo, hi);
  if (active && !nonfinite) {
    const T denominator = minmax_denominator(lo, hi);
    const T keep = factor_keep<T>(*args.gamma);
    const T add = factor_add<T>(*args.gamma);
    for (int64_t k = threadIdx.x; k < n; k += kThreads) {
      const T z = statistic_mean(stat[k], count, scale_sq, scaled);
      factor[k] = average_factor(factor[k], z, lo, denominator, keep, add);
    }
  }
  if (active && nonfinite && threadIdx.x == 0) atomicAdd(args.skipped, 1.0f);
  // Each thread empties the entries it read; the count was read by all before the barriers above.
  for (int64_t k = threadIdx.x; k <= n; k += kThreads) stat[k] = T(0);
}

template <typename T>
__device__ void clear(T* stat, int64_t n) {
  for (int64_t k = threadIdx.x; k <= n; k += kThreads) stat[k] = T(0);
}

__global__ void __launch_bounds__(kThreads) fisher_average_kernel(const AverageTable table, const AverageArgs args) {
  const int e = blockIdx.x;
  const int64_t n = table.numel[e];
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) {  // the statistics of a skipped step are void
    table.is_double[e] ? clear(static_cast<double*>(table.stat[e]), n)
                       : clear(static_cast<float*>(table.stat[e]), n);
    return;
  }
  if (table.is_double[e]) {
    fold_statistic(static_cast<double*>(table.factor[e]), static_cast<double*>(table.stat[e]), n,
                   table.scaled[e], args);
  } else {
    fold_statistic(static_cast<float*>(table.factor[e]), static_cast<float*>(table.stat[e]), n,
                   table.scaled[e], args);
  }
}

void fisher_average_cuda(at::TensorList factors, at::TensorList stats, const at::Tensor& skipped,
                         const at::Tensor& gamma, const c10::List<bool>& grad_side,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf) {
  check_fisher_average(factors, stats, skipped, gamma, grad_side, grad_scale, found_inf);
  if (factors.empty()) return;
  const c10::cuda::CUDAGuard guard(factors[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const AverageArgs args{skipped.mutable_data_ptr<float>(),
                         grad_scale.has_value() ? grad_scale->const_data_ptr<float>() : nullptr,
                         found_inf.has_value() ? found_inf->const_data_ptr<float>() : nullptr,
                         gamma.const_data_ptr<double>()};
  AverageTable table;
  int entries = 0;
  for (size_t i = 0; i < factors.size(); ++i) {
    table.factor[entries] = factors[i].mutable_data_ptr();
    table.stat[entries] = stats[i].mutable_data_ptr();
    table.numel[entries] = factors[i].numel();
    table.scaled[entries] = grad_side[i] && grad_scale.has_value();
    table.is_double[entries] = factors[i].scalar_type() == at::kDouble;
    if (++entries == kMaxEntries || i + 1 == factors.size()) {
      fisher_average_kernel<<<entries, kThreads, 0, stream>>>(table, args);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      entries = 0;
    }
  }
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(cafin, CUDA, m) {
  m.impl("fisher_average_", &cuda::fisher_average_cuda);
}

}  // namespace cafin
