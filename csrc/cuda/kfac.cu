// CUDA kernels of the K-FAC ops. Per-step scalars (decay, damping, lr, kl_clip, the step count)
// are read through device pointers and the KL-clip factor is reduced and applied on the device:
// no host sync, so the calls can be captured in a CUDA graph. Semantics:
// cafin/reference/kfac.py; arithmetic: kfac_math.h, shared with the CPU kernels.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

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

template <typename scalar_t>
__global__ void dot_kernel(const scalar_t* __restrict v, scalar_t* w, scalar_t* b, int64_t rows,
                           int64_t cols, int64_t wc, double* __restrict out) {
  __shared__ double partial[kThreads];
  double acc = 0.0;
  const int64_t total = rows * cols;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(blockDim.x) * gridDim.x) {
    const int64_t r = idx / cols, c = idx - r * cols;
    acc += static_cast<double>(v[idx]) * static_cast<double>(*grad_at(w, b, r, c, wc));
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, partial[0]);
}

template <typename scalar_t>
__global__ void apply_kernel(const scalar_t* __restrict v, scalar_t* w, scalar_t* b, int64_t rows,
                             int64_t cols, int64_t wc, const double* __restrict dot,
                             const double* __restrict lr, const double* __restrict kl_clip) {
  scalar_t nu = scalar_t(1);
  if (kl_clip != nullptr) nu = static_cast<scalar_t>(kfac_kl_scale(*dot * (*lr * *lr), *kl_clip));
  const int64_t total = rows * cols;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(blockDim.x) * gridDim.x) {
    const int64_t r = idx / cols, c = idx - r * cols;
    *grad_at(w, b, r, c, wc) = v[idx] * nu;
  }
}

void kfac_precondition_apply_cuda(at::TensorList weight_grads, at::TensorList bias_grads,
                                  at::TensorList precond, const at::Tensor& lr,
                                  const std::optional<at::Tensor>& kl_clip) {
  check_kfac_precondition_apply(weight_grads, bias_grads, precond, lr, kl_clip);
  if (weight_grads.empty()) return;
  const c10::cuda::CUDAGuard guard(weight_grads[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Every dot product lands before any gradient is written (one stream, launches in order).
  const at::Tensor dot = at::zeros({}, lr.options());
  AT_DISPATCH_FLOATING_TYPES(weight_grads[0].scalar_type(), "kfac_precondition_apply_", [&] {
    auto layout = [&](size_t i) {
      const int64_t rows = precond[i].size(0) * precond[i].size(1), cols = precond[i].size(2);
      return std::make_pair(rows, cols - (bias_grads[i].numel() > 0 ? 1 : 0));
    };
    if (kl_clip.has_value()) {
      for (size_t i = 0; i < precond.size(); ++i) {
        const auto [rows, wc] = layout(i);
        const int64_t cols = precond[i].size(2);
        dot_kernel<scalar_t><<<std::min(blocks_for(rows * cols), 1024), kThreads, 0, stream>>>(
            precond[i].const_data_ptr<scalar_t>(), weight_grads[i].mutable_data_ptr<scalar_t>(),
            bias_grads[i].mutable_data_ptr<scalar_t>(), rows, cols, wc, dot.mutable_data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
    for (size_t i = 0; i < precond.size(); ++i) {
      const auto [rows, wc] = layout(i);
      const int64_t cols = precond[i].size(2);
      apply_kernel<scalar_t><<<blocks_for(rows * cols), kThreads, 0, stream>>>(
          precond[i].const_data_ptr<scalar_t>(), weight_grads[i].mutable_data_ptr<scalar_t>(),
          bias_grads[i].mutable_data_ptr<scalar_t>(), rows, cols, wc, dot.const_data_ptr<double>(),
          lr.const_data_ptr<double>(),
          kl_clip.has_value() ? kl_clip->const_data_ptr<double>() : nullptr);
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
