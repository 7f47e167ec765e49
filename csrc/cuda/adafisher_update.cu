// CUDA kernel of adafisher_step_: the row-column skeleton (cuda/row_column.cuh) with AdaFisher's
// per-element maths (adafisher_math.h, shared with the CPU kernel). The step counts, lr, beta,
// weight_decay, damping, grad_scale and found_inf are read through device pointers: no host sync,
// so the update can be captured in a CUDA graph. Semantics: cafin/reference/adafisher.py.
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
#include "cuda/row_column.cuh"

namespace cafin {
namespace cuda {
namespace {

// What the device reads for AdaFisher's element maths: the step count per tensor, the rest per launch.
template <typename scalar_t, bool kDecoupled, bool kScaled>
struct AdaFisherOnDevice : AdaFisherElement<scalar_t, at::opmath_type<scalar_t>, kDecoupled, kScaled> {
  using opmath_t = at::opmath_type<scalar_t>;
  using Coeffs = typename AdaFisherElement<scalar_t, opmath_t, kDecoupled, kScaled>::Coeffs;
  using PerTensor = const float*;  // the parameter's step count
  struct Args {
    const opmath_t* lr;
    const float* grad_scale;  // nullptr: gradients are not scaled
    const float* found_inf;   // nullptr: always apply
    const double* beta;
    const double* weight_decay;
    const double* damping;
  };

  __device__ static bool skip(const Args& a) { return a.found_inf != nullptr && *a.found_inf != 0.0f; }

  __device__ static Coeffs coeffs(const Args& a, const PerTensor& step) {
    return {update_coeffs<opmath_t>(static_cast<double>(*a.lr), *step, *a.beta, *a.weight_decay,
                                    *a.damping, kDecoupled),
            kScaled ? static_cast<opmath_t>(*a.grad_scale) : opmath_t(1)};
  }
};

template <typename Op>
void update_bucket(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                   at::IntArrayRef h_offsets, const typename Op::Args& args) {
  using scalar_t = typename Op::scalar_t;
  using opmath_t = typename Op::opmath_t;
  std::vector<RowColumnMeta<Op>> metas;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool curved = fisher_S[i].numel() > 0;
    metas.push_back({params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(),
                     exp_avgs[i].mutable_data_ptr<opmath_t>(),
                     curved ? fisher_S[i].const_data_ptr<opmath_t>() : nullptr,
                     curved ? fisher_H[i].const_data_ptr<opmath_t>() + h_offsets[i] : nullptr,
                     curved ? params[i].numel() / fisher_S[i].numel() : 1,
                     steps[i].const_data_ptr<float>()});
    numels.push_back(params[i].numel());
  }
  row_column_launch<Op>(metas, numels, args, c10::cuda::getCurrentCUDAStream());
}

template <typename Op>
void update_bucket_with(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                        at::IntArrayRef h_offsets, const at::Tensor& lr, const at::Tensor& beta,
                        const at::Tensor& weight_decay, const at::Tensor& damping,
                        const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf) {
  using opmath_t = typename Op::opmath_t;
  const typename Op::Args args{lr.const_data_ptr<opmath_t>(),
                               grad_scale.has_value() ? grad_scale->const_data_ptr<float>() : nullptr,
                               found_inf.has_value() ? found_inf->const_data_ptr<float>() : nullptr,
                               beta.const_data_ptr<double>(), weight_decay.const_data_ptr<double>(),
                               damping.const_data_ptr<double>()};
  update_bucket<Op>(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets, args);
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
    const auto run = [&](auto op) {
      update_bucket_with<decltype(op)>(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets, lr,
                                       beta, weight_decay, damping, grad_scale, found_inf);
    };
    const bool scaled = grad_scale.has_value();
    if (decoupled) {
      scaled ? run(AdaFisherOnDevice<scalar_t, true, true>{}) : run(AdaFisherOnDevice<scalar_t, true, false>{});
    } else {
      scaled ? run(AdaFisherOnDevice<scalar_t, false, true>{}) : run(AdaFisherOnDevice<scalar_t, false, false>{});
    }
  });
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(cafin, CUDA, m) {
  m.impl("adafisher_step_", &cuda::adafisher_step_cuda);
}

}  // namespace cafin
