// CPU kernel of adafisher_step_: the row-column skeleton (cpu/row_column.h) with AdaFisher's
// per-element maths (adafisher_math.h): R = S, C = H, F = S[r] * H[c] + damping.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "adafisher_math.h"
#include "checks.h"
#include "cpu/row_column.h"

namespace cafin {
namespace {

// Which entries of a factor hold the never-updated marker (< 0): none, some, or all.
enum class Marked { kNone, kSome, kAll };

template <typename T>
Marked marked(const T* x, int64_t n) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += x[i] < T(0) ? 1 : 0;
  return count == 0 ? Marked::kNone : (count == n ? Marked::kAll : Marked::kSome);
}

// F = 1 where S or H is marked, so a tensor whose S or H is marked throughout takes the plain
// update; one with markers in some entries tests them per element; the rest take S*H + damping
// with no test at all (after the factors' first update, every curved tensor).
template <typename T>
RowColumnFactors factors_of(const T* S, int64_t rows, const T* H, int64_t cols) {
  if (S == nullptr) return RowColumnFactors::kNone;
  const Marked s = marked(S, rows), h = marked(H, cols);
  if (s == Marked::kAll || h == Marked::kAll) return RowColumnFactors::kNone;
  if (s == Marked::kSome || h == Marked::kSome) return RowColumnFactors::kGuarded;
  return RowColumnFactors::kFactors;
}

template <typename Op>
void update_bucket(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                   at::IntArrayRef h_offsets, double lr, double beta, double weight_decay,
                   double damping, bool decoupled, double grad_scale) {
  using scalar_t = typename Op::scalar_t;
  using opmath_t = typename Op::opmath_t;
  std::vector<RowColumnTensor<Op>> tensors;
  tensors.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const bool curved = fisher_S[i].numel() > 0;
    const float step = *steps[i].const_data_ptr<float>();
    const int64_t rows = curved ? fisher_S[i].numel() : 1;
    const int64_t cols = params[i].numel() / std::max<int64_t>(rows, 1);
    const opmath_t* S = curved ? fisher_S[i].const_data_ptr<opmath_t>() : nullptr;
    const opmath_t* H = curved ? fisher_H[i].const_data_ptr<opmath_t>() + h_offsets[i] : nullptr;
    tensors.push_back({params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(),
                       exp_avgs[i].mutable_data_ptr<opmath_t>(), S, H, params[i].numel(), cols,
                       factors_of(S, rows, H, cols),
                       {update_coeffs<opmath_t>(lr, step, beta, weight_decay, damping, decoupled),
                        static_cast<opmath_t>(grad_scale)}});
  }
  row_column_apply(tensors);
}

template <typename scalar_t>
void update_bucket_of(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                      at::IntArrayRef h_offsets, double lr, double beta, double weight_decay,
                      double damping, bool decoupled, bool scaled, double grad_scale) {
  const auto run = [&](auto op) {
    update_bucket<decltype(op)>(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets, lr,
                                beta, weight_decay, damping, decoupled, grad_scale);
  };
  if (decoupled) {
    scaled ? run(AdaFisherElement<scalar_t, at::opmath_type<scalar_t>, true, true>{}) : run(AdaFisherElement<scalar_t, at::opmath_type<scalar_t>, true, false>{});
  } else {
    scaled ? run(AdaFisherElement<scalar_t, at::opmath_type<scalar_t>, false, true>{}) : run(AdaFisherElement<scalar_t, at::opmath_type<scalar_t>, false, false>{});
  }
}

void adafisher_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                        at::IntArrayRef h_offsets, const at::Tensor& lr, const at::Tensor& beta,
                        const at::Tensor& weight_decay, const at::Tensor& damping, bool decoupled,
                        const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf) {
  check_adafisher_step(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets, lr, beta,
                       weight_decay, damping, grad_scale, found_inf);
  if (params.empty()) return;
  if (found_inf.has_value() && *found_inf->const_data_ptr<float>() != 0.0f) return;
  const bool scaled = grad_scale.has_value();
  const double scale = scaled ? *grad_scale->const_data_ptr<float>() : 1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "adafisher_step_", [&] {
    update_bucket_of<scalar_t>(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets,
                               lr.item<double>(), beta.item<double>(), weight_decay.item<double>(),
                               damping.item<double>(), decoupled, scaled, scale);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CPU, m) {
  m.impl("adafisher_step_", &adafisher_step_cpu);
}

}  // namespace cafin
