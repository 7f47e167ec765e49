// CUDA kernel of adafisher_step_: one multi-tensor-apply launch per table of the bucket. The step
// counts, lr, beta, weight_decay, damping, grad_scale and found_inf are read through device pointers: no host sync, so the
// update can be captured in a CUDA graph. Semantics: cafin/reference/adafisher.py; arithmetic:
// adafisher_math.h, shared with the CPU kernel.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "adafisher_math.h"
#include "checks.h"
#include "cuda/multi_tensor.cuh"

namespace cafin {
namespace cuda {
namespace {

template <typename scalar_t, typename opmath_t>
struct UpdateMeta {
  scalar_t* theta;
  const scalar_t* grad;
  opmath_t* exp_avg;
  const opmath_t* S;  // nullptr: no curvature, F = 1
  const opmath_t* H;  // already advanced by the parameter's h_offset
  const float* step;
  int64_t cols;
};

template <typename opmath_t>
struct UpdateArgs {
  const opmath_t* lr;
  const float* grad_scale;  // nullptr: gradients are not scaled
  const float* found_inf;   // nullptr: always apply
  const double* beta;
  const double* weight_decay;
  const double* damping;
  bool decoupled;
};

constexpr int kMaxUpdateTensors = 30;

template <typename scalar_t, typename opmath_t>
using UpdateTable = TensorTable<UpdateMeta<scalar_t, opmath_t>, kMaxUpdateTensors>;

static_assert(sizeof(UpdateTable<double, double>) + sizeof(UpdateArgs<double>) <= 4000,
              "kernel arguments must stay under 4 KB");

template <typename opmath_t>
__device__ __forceinline__ opmath_t fisher_at(const opmath_t* S, const opmath_t* H, int64_t row,
                                              int64_t col, opmath_t damping) {
  return S == nullptr ? opmath_t(1) : fisher_diag(__ldg(S + row), __ldg(H + col), damping);
}

template <bool kDecoupled, typename scalar_t, typename opmath_t>
__device__ __forceinline__ void update_one(scalar_t& theta, opmath_t& m, scalar_t grad, opmath_t f,
                                           opmath_t scale, bool scaled, const UpdateCoeffs<opmath_t>& c) {
  opmath_t th = static_cast<opmath_t>(theta);
  opmath_t g = static_cast<opmath_t>(grad);
  if (scaled) g = g / scale;
  adafisher_element<kDecoupled>(th, m, g, f, c);
  theta = static_cast<scalar_t>(th);
}

template <bool kDecoupled, typename scalar_t, typename opmath_t>
__global__ void __launch_bounds__(kBlockSize)
    adafisher_kernel(const UpdateTable<scalar_t, opmath_t> table, const UpdateArgs<opmath_t> args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;
  const int slot = table.block_to_tensor[blockIdx.x];
  const UpdateMeta<scalar_t, opmath_t>& t = table.meta[slot];
  const int64_t begin = static_cast<int64_t>(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = min(table.numel[slot], begin + kChunkSize);
  const UpdateCoeffs<opmath_t> c = update_coeffs<opmath_t>(
      static_cast<double>(*args.lr), *t.step, *args.beta, *args.weight_decay, *args.damping,
      kDecoupled);
  const bool scaled = args.grad_scale != nullptr;
  const opmath_t scale = scaled ? static_cast<opmath_t>(*args.grad_scale) : opmath_t(1);

  // Chunks start at multiples of kChunkSize, so only the pointers and the length decide alignment.
  const bool vectorised = (end - begin) % kILP == 0 && is_aligned<kILP>(t.theta) &&
                          is_aligned<kILP>(t.grad) && is_aligned<kILP>(t.exp_avg);
  if (vectorised) {
    using ParamVec = AlignedVector<scalar_t, kILP>;
    using StateVec = AlignedVector<opmath_t, kILP>;
    for (int64_t i = begin + threadIdx.x * kILP; i < end; i += kBlockSize * kILP) {
      ParamVec theta = *reinterpret_cast<const ParamVec*>(t.theta + i);
      const ParamVec grad = *reinterpret_cast<const ParamVec*>(t.grad + i);
      StateVec m = *reinterpret_cast<const StateVec*>(t.exp_avg + i);
      int64_t row = i / t.cols;
      int64_t col = i - row * t.cols;
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        const opmath_t f = fisher_at(t.S, t.H, row, col, c.damping);
        update_one<kDecoupled>(theta.val[k], m.val[k], grad.val[k], f, scale, scaled, c);
        if (++col == t.cols) {
          col = 0;
          ++row;
        }
      }
      *reinterpret_cast<ParamVec*>(t.theta + i) = theta;
      *reinterpret_cast<StateVec*>(t.exp_avg + i) = m;
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) {
      const int64_t row = i / t.cols;
      const opmath_t f = fisher_at(t.S, t.H, row, i - row * t.cols, c.damping);
      update_one<kDecoupled>(t.theta[i], t.exp_avg[i], t.grad[i], f, scale, scaled, c);
    }
  }
}

template <typename scalar_t>
void update_bucket(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                   at::IntArrayRef h_offsets, const UpdateArgs<at::opmath_type<scalar_t>>& args) {
  using opmath_t = at::opmath_type<scalar_t>;
  std::vector<UpdateMeta<scalar_t, opmath_t>> metas;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool curved = fisher_S[i].numel() > 0;
    metas.push_back({params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(),
                     exp_avgs[i].mutable_data_ptr<opmath_t>(),
                     curved ? fisher_S[i].const_data_ptr<opmath_t>() : nullptr,
                     curved ? fisher_H[i].const_data_ptr<opmath_t>() + h_offsets[i] : nullptr,
                     steps[i].const_data_ptr<float>(),
                     curved ? params[i].numel() / fisher_S[i].numel() : 1});
    numels.push_back(params[i].numel());
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  multi_tensor_apply<UpdateMeta<scalar_t, opmath_t>, kMaxUpdateTensors>(
      metas, numels, [&](const UpdateTable<scalar_t, opmath_t>& table, int blocks) {
        if (args.decoupled) {
          adafisher_kernel<true><<<blocks, kBlockSize, 0, stream>>>(table, args);
        } else {
          adafisher_kernel<false><<<blocks, kBlockSize, 0, stream>>>(table, args);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

void adafisher_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                         at::IntArrayRef h_offsets, const at::Tensor& lr, const at::Tensor& beta,
                         const at::Tensor& weight_decay, const at::Tensor& damping, bool decoupled,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf) {
  check_adafisher_step(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets, lr, beta,
                       weight_decay, damping, grad_scale, found_inf);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "adafisher_step_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const UpdateArgs<opmath_t> args{lr.const_data_ptr<opmath_t>(),
                                    grad_scale.has_value() ? grad_scale->const_data_ptr<float>() : nullptr,
                                    found_inf.has_value() ? found_inf->const_data_ptr<float>() : nullptr,
                                    beta.const_data_ptr<double>(),
                                    weight_decay.const_data_ptr<double>(),
                                    damping.const_data_ptr<double>(), decoupled};
    update_bucket<scalar_t>(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets, args);
  });
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(cafin, CUDA, m) {
  m.impl("adafisher_step_", &cuda::adafisher_step_cuda);
}

}  // namespace cafin
