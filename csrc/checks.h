// Argument checks shared by the CPU and CUDA entry points. They mirror cafin/ops/ (same
// conditions, same exception types, similar messages) because the ops can be called directly
// through torch.ops.cafin: every kernel runs all of its checks before it writes anything.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

namespace cafin {

// dtype of moments, factors and statistics for parameters/activations of dtype `t`.
inline at::ScalarType state_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Messages name dtypes as Python does (torch.float32), not as C++ does (Float).
inline std::string dtype_name(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_scalar_tensor(const at::Tensor& t, const std::string& name, const at::Device& device,
                                std::optional<at::ScalarType> dtype = std::nullopt) {
  TORCH_CHECK_VALUE(t.dim() == 0, name, " must be a 0-dim tensor, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, name, " is on ", t.device(), ", expected ", device);
  if (dtype.has_value()) {
    TORCH_CHECK_TYPE(t.scalar_type() == *dtype, name, " has dtype ", dtype_name(t.scalar_type()),
                     ", expected ", dtype_name(*dtype));
  }
}

inline void check_optional_scalar(const std::optional<at::Tensor>& t, const char* name,
                                  const at::Device& device) {
  if (t.has_value()) check_scalar_tensor(*t, name, device, at::kFloat);
}

// ------------------------------------------------------------------------------------ update

inline void check_adafisher_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                 at::TensorList steps, at::TensorList fisher_S, at::TensorList fisher_H,
                                 at::IntArrayRef h_offsets, const at::Tensor& lr,
                                 const at::Tensor& beta, const at::Tensor& weight_decay,
                                 const at::Tensor& damping,
                                 const std::optional<at::Tensor>& grad_scale,
                                 const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  const std::pair<const char*, size_t> lengths[] = {
      {"grads", grads.size()},       {"exp_avgs", exp_avgs.size()}, {"steps", steps.size()},
      {"fisher_S", fisher_S.size()}, {"fisher_H", fisher_H.size()}, {"h_offsets", h_offsets.size()}};
  for (const auto& [name, len] : lengths) {
    TORCH_CHECK_VALUE(len == n, name, " has ", len, " entries but params has ", n);
  }
  if (n == 0) return;
  const at::Device device = params[0].device();
  const at::ScalarType dtype = params[0].scalar_type();
  TORCH_CHECK_TYPE(is_supported_float(dtype), "params[0] has dtype ", dtype_name(dtype),
                   "; cafin supports float32, float64, bfloat16 and float16");
  const at::ScalarType work = state_dtype(dtype);
  check_scalar_tensor(lr, "lr", device, work);
  // float64 whatever the parameters: the published code forms these coefficients from Python
  // floats, and 1 - beta of a float32 beta would not round like 1 - 0.9.
  check_scalar_tensor(beta, "beta", device, at::kDouble);
  check_scalar_tensor(weight_decay, "weight_decay", device, at::kDouble);
  check_scalar_tensor(damping, "damping", device, at::kDouble);
  if (device.is_cpu()) {  // values are read without a sync only on the CPU
    const double b = beta.item<double>(), d = damping.item<double>(), wd = weight_decay.item<double>();
    TORCH_CHECK_VALUE(0.0 <= b && b < 1.0, "beta must be in [0, 1), got ", b);
    TORCH_CHECK_VALUE(d > 0.0 && std::isfinite(d), "damping must be > 0 and finite, got ", d);
    TORCH_CHECK_VALUE(wd >= 0.0 && std::isfinite(wd), "weight_decay must be >= 0 and finite, got ", wd);
  }
  check_optional_scalar(grad_scale, "grad_scale", device);
  check_optional_scalar(found_inf, "found_inf", device);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const at::Tensor& m = exp_avgs[i];
    const at::Tensor& S = fisher_S[i];
    const at::Tensor& H = fisher_H[i];
    TORCH_CHECK_VALUE(p.device() == device && p.scalar_type() == dtype, "params[", i, "] is ",
                      dtype_name(p.scalar_type()), " on ", p.device(),
                      "; a bucket is one device and one dtype (", dtype_name(dtype), " on ", device, ")");
    TORCH_CHECK_VALUE(p.is_contiguous(), "params[", i, "] must be contiguous");
    TORCH_CHECK_VALUE(g.sizes() == p.sizes() && g.scalar_type() == dtype && g.device() == device &&
                          g.is_contiguous(),
                      "grads[", i, "] must be a contiguous ", dtype_name(dtype), " tensor of shape ", p.sizes(),
                      " on ", device, ", got ", dtype_name(g.scalar_type()), " ", g.sizes(), " on ",
                      g.device());
    TORCH_CHECK_VALUE(m.sizes() == p.sizes() && m.scalar_type() == work && m.device() == device &&
                          m.is_contiguous(),
                      "exp_avgs[", i, "] must be a contiguous ", dtype_name(work), " tensor of shape ", p.sizes(),
                      " on ", device);
    check_scalar_tensor(steps[i], "steps[" + std::to_string(i) + "]", device, at::kFloat);
    TORCH_CHECK_VALUE((S.numel() == 0) == (H.numel() == 0), "fisher_S[", i, "] and fisher_H[", i,
                      "] must both be empty (no curvature) or both non-empty");
    if (S.numel() == 0) continue;
    for (const auto& [name, f] : {std::pair<const char*, const at::Tensor&>{"fisher_S", S},
                                  std::pair<const char*, const at::Tensor&>{"fisher_H", H}}) {
      TORCH_CHECK_VALUE(f.dim() == 1 && f.scalar_type() == work && f.device() == device &&
                            f.is_contiguous(),
                        name, "[", i, "] must be a contiguous 1-D ", dtype_name(work), " tensor on ", device);
    }
    TORCH_CHECK_VALUE(p.numel() % S.numel() == 0, "params[", i, "] has ", p.numel(),
                      " elements, not a multiple of len(fisher_S[", i, "]) = ", S.numel());
    const int64_t cols = p.numel() / S.numel();
    TORCH_CHECK_VALUE(h_offsets[i] >= 0 && h_offsets[i] + cols <= H.numel(), "h_offsets[", i,
                      "] = ", h_offsets[i], " with ", cols, " columns does not fit fisher_H[", i,
                      "] of length ", H.numel());
  }
}

// ------------------------------------------------------------------------------------ statistics

inline void check_stat(const at::Tensor& stat, const at::Tensor& x, int64_t length) {
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()), "input dtype ", dtype_name(x.scalar_type()),
                   " is not a floating type cafin supports");
  TORCH_CHECK_TYPE(stat.scalar_type() == state_dtype(x.scalar_type()), "stat has dtype ",
                   dtype_name(stat.scalar_type()), ", expected ", dtype_name(state_dtype(x.scalar_type())),
                   " for input dtype ", dtype_name(x.scalar_type()));
  TORCH_CHECK_VALUE(stat.device() == x.device(), "stat is on ", stat.device(), " but the input is on ",
                    x.device());
  TORCH_CHECK_VALUE(stat.dim() == 1 && stat.is_contiguous(), "stat must be a contiguous 1-D tensor");
  TORCH_CHECK_VALUE(stat.numel() == length, "stat has ", stat.numel(), " elements, expected ", length,
                    " (statistics plus a count)");
}

inline void check_gate(const std::optional<at::Tensor>& step, int64_t interval, const at::Device& device) {
  if (step.has_value()) check_scalar_tensor(*step, "step", device, at::kFloat);
  TORCH_CHECK_VALUE(interval >= 1, "interval must be an int >= 1, got ", interval);
}

// x viewed as [outer, channels, inner]: dims before start_dim, [start_dim, end_dim), after.
struct ChannelView {
  int64_t outer = 1;
  int64_t channels = 1;
  int64_t inner = 1;
};

inline ChannelView check_channels(const at::Tensor& x, int64_t start_dim, int64_t end_dim,
                                  const char* what) {
  const int64_t ndim = x.dim();
  TORCH_CHECK_VALUE(0 <= start_dim && start_dim < end_dim && end_dim <= ndim, what,
                    ": need 0 <= start_dim < end_dim <= ndim, got ", start_dim, ", ", end_dim,
                    " for ndim ", ndim);
  ChannelView v;
  for (int64_t d = 0; d < ndim; ++d) {
    int64_t& part = d < start_dim ? v.outer : (d < end_dim ? v.channels : v.inner);
    part *= x.size(d);
  }
  return v;
}

// The scratch of a channel statistic on CUDA (`workspace`): partial sums, then one sum per channel,
// then one arrival counter per channel and one for the call. The caller creates it as zeros and
// keeps it; every call leaves the counters at zero again, but not the rest, so a workspace serves
// one channel count (its counters would sit on another count's partial sums) and one stream at a
// time. kWorkspaceItemsPerChannel partial sums per channel, at least kWorkspaceMinPartials in all;
// the CPU kernels need none.
constexpr int64_t kWorkspaceItemsPerChannel = 64;
constexpr int64_t kWorkspaceMinPartials = 32768;

inline int64_t statistics_workspace_numel(int64_t channels) {
  return std::max(kWorkspaceItemsPerChannel * channels, kWorkspaceMinPartials) + 2 * channels + 1;
}

// `need`: statistics_workspace_numel(channels) for a channel statistic, C*H*W for a Conv2d input
// (its X2, every entry written before it is read, so any values will do).
inline void check_workspace(const std::optional<at::Tensor>& workspace, const at::Tensor& stat, int64_t need,
                            const char* what, const char* of, int64_t count) {
  if (!workspace.has_value()) return;
  const at::Tensor& w = *workspace;
  TORCH_CHECK_TYPE(w.scalar_type() == stat.scalar_type(), what, ": workspace has dtype ",
                   dtype_name(w.scalar_type()), ", expected the stat's ", dtype_name(stat.scalar_type()));
  TORCH_CHECK_VALUE(w.device() == stat.device(), what, ": workspace is on ", w.device(), " but stat is on ",
                    stat.device());
  TORCH_CHECK_VALUE(w.dim() == 1 && w.is_contiguous() && w.numel() == need, what,
                    ": workspace must be a contiguous 1-D tensor of ", need, " elements for ", count, " ", of,
                    ", got shape ", w.sizes());
}

inline void check_channel_workspace(const std::optional<at::Tensor>& workspace, const at::Tensor& stat,
                                    int64_t channels, const char* what) {
  check_workspace(workspace, stat, statistics_workspace_numel(channels), what,
                  "channels (statistics_workspace_numel)", channels);
}

inline ChannelView check_sumsq_stats(const at::Tensor& stat, const at::Tensor& x, int64_t start_dim,
                                     int64_t end_dim, bool append_one,
                                     const std::optional<at::Tensor>& step, int64_t interval,
                                     const std::optional<at::Tensor>& workspace) {
  const ChannelView v = check_channels(x, start_dim, end_dim, "sumsq_stats_");
  check_stat(stat, x, v.channels + (append_one ? 1 : 0) + 1);
  TORCH_CHECK_VALUE(x.numel() > 0, "sumsq_stats_: the input is empty");
  check_gate(step, interval, x.device());
  check_channel_workspace(workspace, stat, v.channels, "sumsq_stats_");
  return v;
}

inline ChannelView check_norm_grad_stats(const at::Tensor& stat, const at::Tensor& g, int64_t start_dim,
                                         int64_t end_dim, const std::optional<at::Tensor>& step,
                                         int64_t interval, const std::optional<at::Tensor>& workspace) {
  const ChannelView v = check_channels(g, start_dim, end_dim, "norm_grad_stats_");
  check_stat(stat, g, v.channels + 1);
  TORCH_CHECK_VALUE(g.numel() > 0, "norm_grad_stats_: the gradient is empty");
  check_gate(step, interval, g.device());
  check_channel_workspace(workspace, stat, v.channels, "norm_grad_stats_");
  return v;
}

// x viewed as [B, T, rest] for the BatchNorm2d/LayerNorm input side: the channels are T.
inline ChannelView check_norm_input_stats(const at::Tensor& stat, const at::Tensor& x,
                                          const std::optional<at::Tensor>& step, int64_t interval,
                                          const std::optional<at::Tensor>& workspace) {
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.numel() > 0,
                    "norm_input_stats_: input must have at least 2 dims and elements, got ", x.sizes());
  check_stat(stat, x, 3);
  check_gate(step, interval, x.device());
  check_channel_workspace(workspace, stat, x.size(1), "norm_input_stats_");
  return ChannelView{x.size(0), x.size(1), x.numel() / (x.size(0) * x.size(1))};
}

struct ConvGeometry {
  int64_t batch, channels, height, width;
  int64_t kh, kw, sh, sw, dh, dw, top, left;
  int64_t groups, out_h, out_w;
  // constexpr, so CUDA kernels may call them too (--expt-relaxed-constexpr).
  constexpr int64_t group_channels() const { return channels / groups; }
  constexpr int64_t patch() const { return group_channels() * kh * kw; }  // D
};

inline ConvGeometry check_conv2d_input_stats(const at::Tensor& stat, const at::Tensor& x,
                                             at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                             at::IntArrayRef padding, at::IntArrayRef dilation,
                                             int64_t groups, bool append_one,
                                             const std::optional<at::Tensor>& step, int64_t interval,
                                             const std::optional<at::Tensor>& workspace) {
  TORCH_CHECK_VALUE(x.dim() == 4, "conv2d_input_stats_: input must be [B, C, H, W], got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(kernel_size.size() == 2 && stride.size() == 2 && dilation.size() == 2 &&
                        padding.size() == 4,
                    "conv2d_input_stats_: kernel_size, stride, dilation take 2 ints and padding 4");
  bool ranges_ok = true;
  for (int k = 0; k < 2; ++k) {
    ranges_ok = ranges_ok && kernel_size[k] >= 1 && stride[k] >= 1 && dilation[k] >= 1;
  }
  for (int k = 0; k < 4; ++k) ranges_ok = ranges_ok && padding[k] >= 0;
  TORCH_CHECK_VALUE(ranges_ok,
                    "conv2d_input_stats_: kernel_size, stride, dilation must be >= 1 and padding >= 0");
  TORCH_CHECK_VALUE(groups >= 1 && x.size(1) % groups == 0, "conv2d_input_stats_: ", x.size(1),
                    " input channels do not split into ", groups, " groups");
  ConvGeometry c{x.size(0),      x.size(1),   x.size(2),   x.size(3),  kernel_size[0], kernel_size[1],
                 stride[0],      stride[1],   dilation[0], dilation[1], padding[0],    padding[2],
                 groups,         0,           0};
  // Floor division of a possibly negative numerator, as Python's // computes it.
  auto out_size = [](int64_t in, int64_t pad, int64_t dil, int64_t k, int64_t s) {
    const int64_t num = in + pad - dil * (k - 1) - 1;
    return (num >= 0 ? num / s : -((-num + s - 1) / s)) + 1;
  };
  c.out_h = out_size(c.height, padding[0] + padding[1], c.dh, c.kh, c.sh);
  c.out_w = out_size(c.width, padding[2] + padding[3], c.dw, c.kw, c.sw);
  TORCH_CHECK_VALUE(c.out_h >= 1 && c.out_w >= 1 && c.batch >= 1, "conv2d_input_stats_: input ",
                    x.sizes(), " gives an empty output");
  check_stat(stat, x, c.patch() + (append_one ? 1 : 0) + 1);
  check_gate(step, interval, x.device());
  const int64_t positions = c.channels * c.height * c.width;
  check_workspace(workspace, stat, positions, "conv2d_input_stats_", "positions (C*H*W)", positions);
  return c;
}

// ------------------------------------------------------------------------------------ factors

inline void check_fisher_average(at::TensorList factors, at::TensorList stats, const at::Tensor& skipped,
                                 const at::Tensor& gamma, const c10::List<bool>& grad_side,
                                 const std::optional<at::Tensor>& grad_scale,
                                 const std::optional<at::Tensor>& found_inf) {
  const size_t n = factors.size();
  TORCH_CHECK_VALUE(stats.size() == n && grad_side.size() == n,
                    "factors, stats and grad_side must have one entry each, got ", n, ", ",
                    stats.size(), ", ", grad_side.size());
  if (n == 0) return;
  const at::Device device = factors[0].device();
  check_scalar_tensor(gamma, "gamma", device, at::kDouble);
  if (device.is_cpu()) {  // read without a sync only on the CPU
    const double g = gamma.item<double>();
    TORCH_CHECK_VALUE(0.0 < g && g <= 10.0, "gamma must be in (0, 10], got ", g);
  }
  check_scalar_tensor(skipped, "skipped", device, at::kFloat);
  check_optional_scalar(grad_scale, "grad_scale", device);
  check_optional_scalar(found_inf, "found_inf", device);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& f = factors[i];
    const at::Tensor& s = stats[i];
    TORCH_CHECK_VALUE(f.device() == device && s.device() == device, "factors[", i, "] and stats[", i,
                      "] must be on ", device, ", got ", f.device(), " and ", s.device());
    TORCH_CHECK_TYPE((f.scalar_type() == at::kFloat || f.scalar_type() == at::kDouble) &&
                         s.scalar_type() == f.scalar_type(),
                     "factors[", i, "] and stats[", i,
                     "] must share a float32/float64 dtype, got ", dtype_name(f.scalar_type()), ", ",
                     dtype_name(s.scalar_type()));
    TORCH_CHECK_VALUE(f.dim() == 1 && s.dim() == 1 && f.is_contiguous() && s.is_contiguous(),
                      "factors[", i, "] and stats[", i, "] must be contiguous 1-D tensors");
    TORCH_CHECK_VALUE(f.numel() >= 1 && s.numel() == f.numel() + 1, "stats[", i,
                      "] must hold len(factors[", i, "]) + 1 = ", f.numel() + 1, " entries, got ",
                      s.numel());
  }
}

}  // namespace cafin
