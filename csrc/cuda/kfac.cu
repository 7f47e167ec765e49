// CUDA kernels of the K-FAC ops. Per-step scalars (decay, damping, lr, kl_clip, the step count)
// are read through device pointers and the KL-clip factor is reduced and applied on the device:
// no host sync, so the calls can be captured in a CUDA graph. Semantics:
// cafin/reference/kfac.py; arithmetic: kfac_math.h, shared with the CPU kernels.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "kfac_checks.h"
#include "kfac_math.h"

namespace cafin {
namespace cuda {
namespace {

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

// Marks `bad` when a statistic holds inf or NaN (an overflowing GradScaler step): it is dropped.
template <typename scalar_t>
__global__ void nonfinite_kernel(const scalar_t* __restrict s, int64_t n, int* __restrict bad) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(blockDim.x) * gridDim.x) {
    if (!isfinite(s[idx])) {
      *bad = 1;  // every writer stores the same value: no atomic needed
      return;
    }
  }
}

// Thread (r, j), j >= r, of each group folds the entry and its mirror and empties both
// statistics, so nothing is read after another thread wrote it.
template <typename scalar_t>
__global__ void factor_ema_kernel(scalar_t* __restrict f, scalar_t* __restrict s,
                                  const scalar_t* __restrict count, const double* __restrict decay,
                                  const float* __restrict step, int64_t interval, int64_t groups,
                                  int64_t d, const int* __restrict bad) {
  const bool fold = kfac_due(step, interval) && *count > scalar_t(0) && *bad == 0;
  const scalar_t c = *count;
  const scalar_t dec = static_cast<scalar_t>(*decay);
  const int64_t total = groups * d * d;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(blockDim.x) * gridDim.x) {
    const int64_t base = (idx / (d * d)) * d * d;
    const int64_t r = (idx - base) / d, j = (idx - base) % d;
    if (j < r) continue;
    const int64_t a = base + r * d + j, b = base + j * d + r;
    const scalar_t sa = s[a], sb = s[b];
    if (fold) {
      f[a] = kfac_ema(f[a], sa, sb, c, dec);
      if (a != b) f[b] = kfac_ema(f[b], sb, sa, c, dec);
    }
    s[a] = scalar_t(0);
    s[b] = scalar_t(0);
  }
}

void kfac_factor_ema_cuda(at::TensorList factors, at::TensorList stats, at::TensorList counts,
                          const at::Tensor& decay, const std::optional<at::Tensor>& step,
                          int64_t interval) {
  check_kfac_factor_ema(factors, stats, counts, decay, step, interval);
  if (factors.empty()) return;
  const c10::cuda::CUDAGuard guard(factors[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float* step_ptr = step.has_value() ? step->const_data_ptr<float>() : nullptr;
  const at::Tensor bad = at::zeros({static_cast<int64_t>(factors.size())},
                                   factors[0].options().dtype(at::kInt));
  for (size_t i = 0; i < factors.size(); ++i) {
    const int64_t n = factors[i].numel();
    if (n == 0) continue;
    AT_DISPATCH_FLOATING_TYPES(factors[i].scalar_type(), "kfac_factor_ema_", [&] {
      int* flag = bad.mutable_data_ptr<int>() + i;
      nonfinite_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
          stats[i].const_data_ptr<scalar_t>(), n, flag);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      factor_ema_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
          factors[i].mutable_data_ptr<scalar_t>(), stats[i].mutable_data_ptr<scalar_t>(),
          counts[i].const_data_ptr<scalar_t>(), decay.const_data_ptr<double>(), step_ptr, interval,
          factors[i].size(0), factors[i].size(1), flag);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  // After every fold has read its count (same stream, so in order).
  for (const at::Tensor& c : counts) const_cast<at::Tensor&>(c).zero_();
}

template <typename scalar_t>
__global__ void eigen_scale_kernel(scalar_t* __restrict v, const scalar_t* __restrict dg,
                                   const scalar_t* __restrict da, const double* __restrict damping,
                                   int64_t groups, int64_t rows, int64_t cols) {
  const scalar_t lam = static_cast<scalar_t>(*damping);
  const int64_t total = groups * rows * cols;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(blockDim.x) * gridDim.x) {
    const int64_t gr = idx / cols;          // group * rows + row
    const int64_t c = idx - gr * cols;
    const int64_t g = gr / rows;
    v[idx] = kfac_eigen_scale(v[idx], dg[gr], da[g * cols + c], lam);
  }
}

void kfac_eigen_scale_cuda(at::TensorList v, at::TensorList dg, at::TensorList da,
                           const at::Tensor& damping) {
  check_kfac_eigen_scale(v, dg, da, damping);
  if (v.empty()) return;
  const c10::cuda::CUDAGuard guard(v[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t n = v[i].numel();
    if (n == 0) continue;
    AT_DISPATCH_FLOATING_TYPES(v[i].scalar_type(), "kfac_eigen_scale_", [&] {
      eigen_scale_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
          v[i].mutable_data_ptr<scalar_t>(), dg[i].const_data_ptr<scalar_t>(),
          da[i].const_data_ptr<scalar_t>(), damping.const_data_ptr<double>(), v[i].size(0),
          v[i].size(1), v[i].size(2));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

// The gradient entry that precond entry (r, c) of a [rows, cols] matrix replaces.
template <typename scalar_t>
__device__ __forceinline__ scalar_t* grad_at(scalar_t* w, scalar_t* b, int64_t r, int64_t c,
                                             int64_t wc) {
  return c < wc ? w + r * wc + c : b + r;
}

// precond + shift at (r, c), rounded to scalar_t as the write rounds it (no shift: as it is).
template <typename scalar_t>
__device__ __forceinline__ scalar_t shifted(const scalar_t* __restrict v, int64_t r, int64_t c, int64_t ld,
                                            const scalar_t* __restrict shift) {
  return shift == nullptr ? v[r * ld + c] : scalar_t(v[r * ld + c] + *shift);
}

// One precond entry's two terms of the clip sum, <V, g> over its weight columns and over its
// bias column, added into out[0] and out[1].
template <typename scalar_t>
__global__ void dot_kernel(const scalar_t* __restrict v, const scalar_t* w, const scalar_t* b, int64_t rows,
                           int64_t cols, int64_t ld, int64_t wc, const scalar_t* __restrict shift,
                           double* __restrict out) {
  __shared__ double partial[2][kThreads];
  double acc[2] = {0.0, 0.0};
  const int64_t total = rows * cols;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(blockDim.x) * gridDim.x) {
    const int64_t r = idx / cols, c = idx - r * cols;
    const double g = c < wc ? static_cast<double>(w[r * wc + c]) : static_cast<double>(b[r]);
    acc[c < wc ? 0 : 1] += static_cast<double>(shifted(v, r, c, ld, shift)) * g;
  }
  partial[0][threadIdx.x] = acc[0];
  partial[1][threadIdx.x] = acc[1];
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      partial[0][threadIdx.x] += partial[0][threadIdx.x + stride];
      partial[1][threadIdx.x] += partial[1][threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicAdd(out, partial[0][0]);
    atomicAdd(out + 1, partial[1][0]);
  }
}

// The clip factor from every entry's two terms, on the device.
__global__ void clip_scale_kernel(const double* __restrict parts, int64_t n, bool abs_terms,
                                  const double* __restrict lr, const double* __restrict kl_clip,
                                  double* __restrict nu) {
  *nu = kfac_kl_scale(kfac_clip_sum(parts, n, abs_terms) * (*lr * *lr), *kl_clip);
}

template <typename scalar_t>
__global__ void apply_kernel(const scalar_t* __restrict v, scalar_t* w, scalar_t* b, int64_t rows,
                             int64_t cols, int64_t ld, int64_t wc, const scalar_t* __restrict shift,
                             const double* __restrict nu_ptr) {
  const scalar_t nu = nu_ptr == nullptr ? scalar_t(1) : static_cast<scalar_t>(*nu_ptr);
  const int64_t total = rows * cols;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(blockDim.x) * gridDim.x) {
    const int64_t r = idx / cols, c = idx - r * cols;
    *grad_at(w, b, r, c, wc) = shifted(v, r, c, ld, shift) * nu;
  }
}

void kfac_precondition_apply_cuda(at::TensorList weight_grads, at::TensorList bias_grads,
                                  at::TensorList precond, const at::Tensor& lr,
                                  const std::optional<at::Tensor>& kl_clip,
                                  const std::optional<at::Tensor>& shift, bool abs_terms) {
  check_kfac_precondition_apply(weight_grads, bias_grads, precond, lr, kl_clip, shift);
  if (weight_grads.empty()) return;
  const c10::cuda::CUDAGuard guard(weight_grads[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = static_cast<int64_t>(precond.size());
  // Every term lands before the factor is made, and the factor before any gradient is written
  // (one stream, launches in order).
  at::Tensor parts, nu;
  if (kl_clip.has_value()) {
    parts = at::zeros({2 * n}, lr.options());
    nu = at::empty({}, lr.options());
  }
  AT_DISPATCH_FLOATING_TYPES(weight_grads[0].scalar_type(), "kfac_precondition_apply_", [&] {
    const scalar_t* shifts = shift.has_value() ? shift->const_data_ptr<scalar_t>() : nullptr;
    auto layout = [&](int64_t i) {  // rows, columns, distance between rows, weight columns
      const int64_t cols = precond[i].size(2);
      return std::make_tuple(precond[i].size(0) * precond[i].size(1), cols, kfac_row_stride(precond[i]),
                             cols - (bias_grads[i].numel() > 0 ? 1 : 0));
    };
    if (kl_clip.has_value()) {
      for (int64_t i = 0; i < n; ++i) {
        const auto [rows, cols, ld, wc] = layout(i);
        dot_kernel<scalar_t><<<std::min(blocks_for(rows * cols), 1024), kThreads, 0, stream>>>(
            precond[i].const_data_ptr<scalar_t>(), weight_grads[i].const_data_ptr<scalar_t>(),
            bias_grads[i].const_data_ptr<scalar_t>(), rows, cols, ld, wc,
            shifts == nullptr ? nullptr : shifts + i, parts.mutable_data_ptr<double>() + 2 * i);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      clip_scale_kernel<<<1, 1, 0, stream>>>(parts.const_data_ptr<double>(), 2 * n, abs_terms,
                                             lr.const_data_ptr<double>(),
                                             kl_clip->const_data_ptr<double>(), nu.mutable_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto [rows, cols, ld, wc] = layout(i);
      apply_kernel<scalar_t><<<blocks_for(rows * cols), kThreads, 0, stream>>>(
          precond[i].const_data_ptr<scalar_t>(), weight_grads[i].mutable_data_ptr<scalar_t>(),
          bias_grads[i].mutable_data_ptr<scalar_t>(), rows, cols, ld, wc,
          shifts == nullptr ? nullptr : shifts + i,
          kl_clip.has_value() ? nu.const_data_ptr<double>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(cafin, CUDA, m) {
  m.impl("kfac_factor_ema_", &cuda::kfac_factor_ema_cuda);
  m.impl("kfac_eigen_scale_", &cuda::kfac_eigen_scale_cuda);
  m.impl("kfac_precondition_apply_", &cuda::kfac_precondition_apply_cuda);
}

}  // namespace cafin
