// CPU kernel of adafisher_step_. The update is memory-bound (read theta, g, m; write theta, m), so
// the work is one flat range over every element of every tensor, split evenly between threads
// (a bucket mixes tensors of a few elements with tensors of millions), and processed in runs along
// a row, where S[r] is constant and H is contiguous, with loops the compiler vectorises.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "adafisher_math.h"
#include "checks.h"
#include "cpu/vectorize.h"

namespace cafin {
namespace {

template <typename scalar_t, typename opmath_t>
struct UpdateTensor {
  scalar_t* theta;
  const scalar_t* grad;
  opmath_t* exp_avg;
  const opmath_t* S;  // nullptr: no curvature, F = 1
  const opmath_t* H;  // already advanced by the parameter's h_offset
  int64_t cols;
  UpdateCoeffs<opmath_t> coeffs;
};

struct UpdateMode {
  bool decoupled;
  bool scaled;
};

// A run of n elements whose F is fisher_diag(s, h[k]) (kCurvature) or 1.
template <bool kDecoupled, bool kScaled, bool kCurvature, typename scalar_t, typename opmath_t>
C10_ALWAYS_INLINE void update_run(scalar_t* __restrict theta, const scalar_t* __restrict grad,
                                  opmath_t* __restrict exp_avg, const opmath_t* __restrict h,
                                  opmath_t s, int64_t n, const UpdateCoeffs<opmath_t> c,
                                  opmath_t grad_scale) {
  for (int64_t k = 0; k < n; ++k) {
    opmath_t th = static_cast<opmath_t>(theta[k]);
    opmath_t g = static_cast<opmath_t>(grad[k]);
    if (kScaled) g = g / grad_scale;
    const opmath_t f = kCurvature ? fisher_diag(s, h[k], c.damping) : opmath_t(1);
    opmath_t m = exp_avg[k];
    adafisher_element<kDecoupled>(th, m, g, f, c);
    exp_avg[k] = m;
    theta[k] = static_cast<scalar_t>(th);
  }
}

template <bool kDecoupled, bool kScaled, typename scalar_t, typename opmath_t>
C10_ALWAYS_INLINE void update_part(const UpdateTensor<scalar_t, opmath_t>& t, int64_t lo, int64_t hi,
                                   opmath_t grad_scale) {
  // Explicit calls, not a helper lambda: a lambda would not be inlined into the ISA clones below.
  const auto& c = t.coeffs;
  if (t.S == nullptr) {
    update_run<kDecoupled, kScaled, false>(t.theta + lo, t.grad + lo, t.exp_avg + lo, t.H, opmath_t(0),
                                           hi - lo, c, grad_scale);
  } else if (t.cols == 1) {
    // One element per row: S runs along the range and the H entry is constant (S*H == H*S).
    update_run<kDecoupled, kScaled, true>(t.theta + lo, t.grad + lo, t.exp_avg + lo, t.S + lo, t.H[0],
                                          hi - lo, c, grad_scale);
  } else {
    int64_t row = lo / t.cols;
    int64_t col = lo - row * t.cols;
    for (int64_t k = lo; k < hi; ++row, col = 0) {
      const int64_t n = std::min(hi - k, t.cols - col);
      const opmath_t s = t.S[row];
      if (s < opmath_t(0)) {  // the row's factor was never updated: F = 1
        update_run<kDecoupled, kScaled, false>(t.theta + k, t.grad + k, t.exp_avg + k, t.H, s, n, c,
                                               grad_scale);
      } else {
        update_run<kDecoupled, kScaled, true>(t.theta + k, t.grad + k, t.exp_avg + k, t.H + col, s, n,
                                              c, grad_scale);
      }
      k += n;
    }
  }
}

// Elements [lo, hi) of one tensor.
template <typename scalar_t, typename opmath_t>
CAFIN_CPU_CLONES void update_range(const UpdateTensor<scalar_t, opmath_t>& t, int64_t lo, int64_t hi,
                                   UpdateMode mode, opmath_t grad_scale) {
  if (mode.decoupled) {
    mode.scaled ? update_part<true, true>(t, lo, hi, grad_scale)
                : update_part<true, false>(t, lo, hi, grad_scale);
  } else {
    mode.scaled ? update_part<false, true>(t, lo, hi, grad_scale)
                : update_part<false, false>(t, lo, hi, grad_scale);
  }
}

template <typename scalar_t>
void update_bucket(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                   at::IntArrayRef h_offsets, double lr, double beta, double weight_decay,
                   double damping, UpdateMode mode, double grad_scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  const size_t n = params.size();
  std::vector<UpdateTensor<scalar_t, opmath_t>> tensors;
  std::vector<int64_t> starts(1, 0);  // tensor i owns flat elements [starts[i], starts[i + 1])
  tensors.reserve(n);
  starts.reserve(n + 1);
  for (size_t i = 0; i < n; ++i) {
    const bool curved = fisher_S[i].numel() > 0;
    const float step = *steps[i].const_data_ptr<float>();
    tensors.push_back({params[i].mutable_data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(),
                       exp_avgs[i].mutable_data_ptr<opmath_t>(),
                       curved ? fisher_S[i].const_data_ptr<opmath_t>() : nullptr,
                       curved ? fisher_H[i].const_data_ptr<opmath_t>() + h_offsets[i] : nullptr,
                       curved ? params[i].numel() / fisher_S[i].numel() : 1,
                       update_coeffs<opmath_t>(lr, step, beta, weight_decay, damping, mode.decoupled)});
    starts.push_back(starts.back() + params[i].numel());
  }
  const opmath_t scale = static_cast<opmath_t>(grad_scale);
  at::parallel_for(0, starts.back(), kGrainSize, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; begin < end; ++i) {
      const int64_t stop = std::min(end, starts[i + 1]);
      if (stop > begin) update_range(tensors[i], begin - starts[i], stop - starts[i], mode, scale);
      begin = stop;
    }
  });
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
  const UpdateMode mode{decoupled, grad_scale.has_value()};
  const double scale = mode.scaled ? *grad_scale->const_data_ptr<float>() : 1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "adafisher_step_", [&] {
    update_bucket<scalar_t>(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets,
                            lr.item<double>(), beta.item<double>(), weight_decay.item<double>(),
                            damping.item<double>(), mode, scale);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CPU, m) {
  m.impl("adafisher_step_", &adafisher_step_cpu);
}

}  // namespace cafin
