// CUDA kernels of SINGD's ops. singd_diag_step_ is the row-column skeleton (cuda/row_column.cuh)
// with SINGD's per-element maths (singd_math.h, shared with the CPU kernel); every coefficient is
// read through a device pointer (no host sync, capturable). Semantics: cafin/reference/singd.py.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "cuda/row_column.cuh"
#include "singd_checks.h"
#include "singd_math.h"

namespace cafin {
namespace cuda {
namespace {

// What the device reads for SINGD's element maths: lr, momentum, weight_decay and grad_scale, per
// launch.
template <typename scalar_t, bool kMomentum>
struct SingdDiagOnDevice : SingdDiagElement<scalar_t, at::opmath_type<scalar_t>, kMomentum> {
  using opmath_t = at::opmath_type<scalar_t>;
  using Coeffs = SingdCoeffs<opmath_t>;
  struct PerTensor {};
  struct Args {
    const opmath_t* lr;
    const opmath_t* momentum;
    const opmath_t* weight_decay;
    const opmath_t* grad_scale;  // nullptr: gradients are not scaled
  };

  __device__ static bool skip(const Args&) { return false; }

  __device__ static Coeffs coeffs(const Args& a, const PerTensor&) {
    const opmath_t scale = a.grad_scale != nullptr ? *a.grad_scale : opmath_t(1);
    return {*a.lr, *a.momentum, *a.weight_decay, scale, scale != opmath_t(1)};
  }
};

template <typename Op>
void diag_bucket(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::TensorList K,
                 at::TensorList C, at::IntArrayRef k_offsets, const typename Op::Args& args,
                 cudaStream_t stream) {
  using scalar_t = typename Op::scalar_t;
  using opmath_t = typename Op::opmath_t;
  std::vector<RowColumnMeta<Op>> metas;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool plain = C[i].numel() == 0;
    metas.push_back({params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(),
                     Op::kState ? bufs[i].mutable_data_ptr<scalar_t>() : nullptr,
                     plain ? nullptr : C[i].const_data_ptr<opmath_t>(),
                     plain ? nullptr : K[i].const_data_ptr<opmath_t>() + k_offsets[i],
                     plain ? params[i].numel() : params[i].numel() / C[i].numel(), {}});
    numels.push_back(params[i].numel());
  }
  row_column_launch<Op>(metas, numels, args, stream);
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
    const typename SingdDiagOnDevice<scalar_t, false>::Args args{
        lr.const_data_ptr<opmath_t>(), momentum.const_data_ptr<opmath_t>(),
        weight_decay.const_data_ptr<opmath_t>(),
        grad_scale.has_value() ? grad_scale->const_data_ptr<opmath_t>() : nullptr};
    if (bufs.empty()) {
      diag_bucket<SingdDiagOnDevice<scalar_t, false>>(params, grads, bufs, K, C, k_offsets, args, stream);
    } else {
      const typename SingdDiagOnDevice<scalar_t, true>::Args with_momentum{args.lr, args.momentum,
                                                                          args.weight_decay, args.grad_scale};
      diag_bucket<SingdDiagOnDevice<scalar_t, true>>(params, grads, bufs, K, C, k_offsets, with_momentum,
                                                     stream);
    }
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
  const opmath_t* scale;
  const opmath_t* alpha1;
  opmath_t pi;
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
  const opmath_t ch = *t.c_h, cd = *t.c_damp, scale = *t.scale, alpha1 = *t.alpha1;
  const bool with_old = alpha1 != opmath_t(0);
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) {
    const opmath_t old = with_old ? static_cast<opmath_t>(t.m[i]) : opmath_t(0);
    t.m[i] = static_cast<scalar_t>(singd_momentum_element<opmath_t>(
        static_cast<opmath_t>(t.H[i]), static_cast<opmath_t>(__ldg(t.KtK + i)), old,
        singd_is_eye(t.eye, i, t.rows, t.cols), ch, cd, t.pi, scale, alpha1, with_old));
    t.H[i] = scalar_t(0);
  }
}

void singd_momentum_cuda(at::TensorList m, at::TensorList H, at::TensorList KtK, at::TensorList c_h,
                         at::TensorList c_damp, at::TensorList go, at::IntArrayRef eye,
                         at::IntArrayRef pi, at::TensorList scale, at::TensorList alpha1) {
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
                       scale[i].const_data_ptr<opmath_t>(), alpha1[i].const_data_ptr<opmath_t>(),
                       static_cast<opmath_t>(pi[i]), eye[i],
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
