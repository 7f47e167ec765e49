// CUDA kernel of singd_diag_step_: one multi-tensor-apply launch per table of the bucket; lr,
// momentum, weight_decay and grad_scale are read through device pointers (no host sync,
// capturable). Semantics: cafin/reference/singd.py; arithmetic: singd_math.h, shared with the CPU
// kernel.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "cuda/multi_tensor.cuh"
#include "singd_checks.h"
#include "singd_math.h"

namespace cafin {
namespace cuda {
namespace {

template <typename scalar_t, typename opmath_t>
struct DiagMeta {
  scalar_t* theta;
  const scalar_t* grad;
  scalar_t* buf;       // nullptr: no momentum
  const opmath_t* K;   // already advanced by the parameter's k_offset
  const opmath_t* C;   // nullptr (and K too): no factors, the update is the gradient
  int64_t cols;
};

template <typename opmath_t>
struct DiagArgs {
  const opmath_t* lr;
  const opmath_t* momentum;
  const opmath_t* weight_decay;
  const opmath_t* grad_scale;  // nullptr: gradients are not scaled
};

constexpr int kMaxDiagTensors = 30;

template <typename scalar_t, typename opmath_t>
using DiagTable = TensorTable<DiagMeta<scalar_t, opmath_t>, kMaxDiagTensors>;

static_assert(sizeof(DiagTable<double, double>) + sizeof(DiagArgs<double>) <= 4000,
              "kernel arguments must stay under 4 KB");

template <bool kMomentum, typename scalar_t, typename opmath_t>
__global__ void __launch_bounds__(kBlockSize)
    singd_diag_kernel(const DiagTable<scalar_t, opmath_t> table, const DiagArgs<opmath_t> args) {
  const int slot = table.block_to_tensor[blockIdx.x];
  const DiagMeta<scalar_t, opmath_t>& t = table.meta[slot];
  const int64_t begin = static_cast<int64_t>(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = min(table.numel[slot], begin + kChunkSize);
  const opmath_t scale = args.grad_scale != nullptr ? *args.grad_scale : opmath_t(1);
  const SingdCoeffs<opmath_t> s{*args.lr, *args.momentum, *args.weight_decay, scale, scale != opmath_t(1)};
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) {
    const int64_t row = i / t.cols;
    opmath_t th = static_cast<opmath_t>(t.theta[i]);
    opmath_t b = kMomentum ? static_cast<opmath_t>(t.buf[i]) : opmath_t(0);
    // No factors (C null): K = C = 1, which leaves the gradient exactly as it is.
    const opmath_t k = t.C != nullptr ? __ldg(t.K + (i - row * t.cols)) : opmath_t(1);
    const opmath_t c = t.C != nullptr ? __ldg(t.C + row) : opmath_t(1);
    singd_diag_element<kMomentum>(th, b, static_cast<opmath_t>(t.grad[i]), k, c, s);
    t.theta[i] = static_cast<scalar_t>(th);
    if (kMomentum) t.buf[i] = static_cast<scalar_t>(b);
  }
}

void singd_diag_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList bufs,
                          at::TensorList K, at::TensorList C, at::IntArrayRef k_offsets,
                          const at::Tensor& lr, const at::Tensor& momentum,
                          const at::Tensor& weight_decay, const std::optional<at::Tensor>& grad_scale) {
  check_singd_diag_step(params, grads, bufs, K, C, k_offsets, lr, momentum, weight_decay, grad_scale);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "singd_diag_step_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<DiagMeta<scalar_t, opmath_t>> metas;
    std::vector<int64_t> numels;
    for (size_t i = 0; i < params.size(); ++i) {
      metas.push_back({params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(),
                       bufs.empty() ? nullptr : bufs[i].mutable_data_ptr<scalar_t>(),
                       C[i].numel() == 0 ? nullptr : K[i].const_data_ptr<opmath_t>() + k_offsets[i],
                       C[i].numel() == 0 ? nullptr : C[i].const_data_ptr<opmath_t>(),
                       C[i].numel() == 0 ? params[i].numel() : params[i].numel() / C[i].numel()});
      numels.push_back(params[i].numel());
    }
    const DiagArgs<opmath_t> args{lr.const_data_ptr<opmath_t>(), momentum.const_data_ptr<opmath_t>(),
                                  weight_decay.const_data_ptr<opmath_t>(),
                                  grad_scale.has_value() ? grad_scale->const_data_ptr<opmath_t>() : nullptr};
    multi_tensor_apply<DiagMeta<scalar_t, opmath_t>, kMaxDiagTensors>(
        metas, numels, [&](const DiagTable<scalar_t, opmath_t>& table, int blocks) {
          if (bufs.empty()) {
            singd_diag_kernel<false><<<blocks, kBlockSize, 0, stream>>>(table, args);
          } else {
            singd_diag_kernel<true><<<blocks, kBlockSize, 0, stream>>>(table, args);
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
}

// ------------------------------------------------------------------ preconditioner update
template <typename scalar_t, typename opmath_t>
struct MomentumMeta {
  scalar_t* m;
  scalar_t* H;
  const scalar_t* KtK;
  const opmath_t* c_h;
  const opmath_t* c_damp;
  const bool* go;
  opmath_t pi, scale, alpha1;
  int64_t eye, rows, cols;
};

constexpr int kMaxMomentumTensors = 20;

template <typename scalar_t, typename opmath_t>
using MomentumTable = TensorTable<MomentumMeta<scalar_t, opmath_t>, kMaxMomentumTensors>;

static_assert(sizeof(MomentumTable<double, double>) <= 4000, "kernel arguments must stay under 4 KB");

template <typename scalar_t, typename opmath_t>
__global__ void __launch_bounds__(kBlockSize)
    singd_momentum_kernel(const MomentumTable<scalar_t, opmath_t> table) {
  const int slot = table.block_to_tensor[blockIdx.x];
  const MomentumMeta<scalar_t, opmath_t>& t = table.meta[slot];
  if (!*t.go) return;  // decided on the device: no host sync, capturable
  const int64_t begin = static_cast<int64_t>(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = min(table.numel[slot], begin + kChunkSize);
  const opmath_t ch = *t.c_h, cd = *t.c_damp;
  const bool with_old = t.alpha1 != opmath_t(0);
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) {
    const opmath_t old = with_old ? static_cast<opmath_t>(t.m[i]) : opmath_t(0);
    t.m[i] = static_cast<scalar_t>(singd_momentum_element<opmath_t>(
        static_cast<opmath_t>(t.H[i]), static_cast<opmath_t>(__ldg(t.KtK + i)), old,
        singd_is_eye(t.eye, i, t.rows, t.cols), ch, cd, t.pi, t.scale, t.alpha1, with_old));
    t.H[i] = scalar_t(0);
  }
}

void singd_momentum_cuda(at::TensorList m, at::TensorList H, at::TensorList KtK, at::TensorList c_h,
                         at::TensorList c_damp, at::TensorList go, at::IntArrayRef eye,
                         c10::ArrayRef<double> pi, c10::ArrayRef<double> scale,
                         c10::ArrayRef<double> alpha1) {
  check_singd_momentum(m, H, KtK, c_h, c_damp, go, eye, pi, scale, alpha1);
  if (m.empty()) return;
  const c10::cuda::CUDAGuard guard(m[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, m[0].scalar_type(), "singd_momentum_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<MomentumMeta<scalar_t, opmath_t>> metas;
    std::vector<int64_t> numels;
    for (size_t i = 0; i < m.size(); ++i) {
      metas.push_back({m[i].mutable_data_ptr<scalar_t>(), H[i].mutable_data_ptr<scalar_t>(),
                       KtK[i].const_data_ptr<scalar_t>(), c_h[i].const_data_ptr<opmath_t>(),
                       c_damp[i].const_data_ptr<opmath_t>(), go[i].const_data_ptr<bool>(),
                       static_cast<opmath_t>(pi[i]), static_cast<opmath_t>(scale[i]),
                       static_cast<opmath_t>(alpha1[i]), eye[i],
                       m[i].dim() >= 2 ? m[i].size(-2) : 1, m[i].dim() >= 1 ? m[i].size(-1) : 1});
      numels.push_back(m[i].numel());
    }
    multi_tensor_apply<MomentumMeta<scalar_t, opmath_t>, kMaxMomentumTensors>(
        metas, numels, [&](const MomentumTable<scalar_t, opmath_t>& table, int blocks) {
          singd_momentum_kernel<<<blocks, kBlockSize, 0, stream>>>(table);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
}

template <typename scalar_t, typename opmath_t>
struct FactorMeta {
  scalar_t* K;
  const scalar_t* KM;
  const opmath_t* beta;
  const bool* go;
  bool elementwise;
};

constexpr int kMaxFactorTensors = 40;

template <typename scalar_t, typename opmath_t>
using FactorTable = TensorTable<FactorMeta<scalar_t, opmath_t>, kMaxFactorTensors>;

static_assert(sizeof(FactorTable<double, double>) <= 4000, "kernel arguments must stay under 4 KB");

template <typename scalar_t, typename opmath_t>
__global__ void __launch_bounds__(kBlockSize)
    singd_factor_kernel(const FactorTable<scalar_t, opmath_t> table) {
  const int slot = table.block_to_tensor[blockIdx.x];
  const FactorMeta<scalar_t, opmath_t>& t = table.meta[slot];
  if (!*t.go) return;
  const int64_t begin = static_cast<int64_t>(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = min(table.numel[slot], begin + kChunkSize);
  const opmath_t beta = *t.beta;
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) {
    t.K[i] = static_cast<scalar_t>(singd_factor_element<opmath_t>(
        static_cast<opmath_t>(t.K[i]), static_cast<opmath_t>(__ldg(t.KM + i)), beta, t.elementwise));
  }
}

void singd_factor_step_cuda(at::TensorList K, at::TensorList KM, at::TensorList beta, at::TensorList go,
                            const c10::List<bool>& elementwise) {
  check_singd_factor_step(K, KM, beta, go, elementwise);
  if (K.empty()) return;
  const c10::cuda::CUDAGuard guard(K[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, K[0].scalar_type(), "singd_factor_step_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<FactorMeta<scalar_t, opmath_t>> metas;
    std::vector<int64_t> numels;
    for (size_t i = 0; i < K.size(); ++i) {
      metas.push_back({K[i].mutable_data_ptr<scalar_t>(), KM[i].const_data_ptr<scalar_t>(),
                       beta[i].const_data_ptr<opmath_t>(), go[i].const_data_ptr<bool>(),
                       static_cast<bool>(elementwise[i])});
      numels.push_back(K[i].numel());
    }
    multi_tensor_apply<FactorMeta<scalar_t, opmath_t>, kMaxFactorTensors>(
        metas, numels, [&](const FactorTable<scalar_t, opmath_t>& table, int blocks) {
          singd_factor_kernel<<<blocks, kBlockSize, 0, stream>>>(table);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(cafin, CUDA, m) {
  m.impl("singd_diag_step_", &cuda::singd_diag_step_cuda);
  m.impl("singd_momentum_", &cuda::singd_momentum_cuda);
  m.impl("singd_factor_step_", &cuda::singd_factor_step_cuda);
}

}  // namespace cafin
