// Argument checks of the K-FAC ops, shared by the CPU and CUDA entry points (every check runs
// before anything is written). They mirror cafin/ops/kfac.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "checks.h"

namespace cafin {

inline bool kfac_float(at::ScalarType t) { return t == at::kFloat || t == at::kDouble; }

inline void check_kfac_factor_ema(at::TensorList factors, at::TensorList stats, at::TensorList counts,
                                  const at::Tensor& decay, const std::optional<at::Tensor>& step,
                                  int64_t interval, const std::optional<at::Tensor>& dropped) {
  const size_t n = factors.size();
  TORCH_CHECK_VALUE(stats.size() == n && counts.size() == n,
                    "factors, stats and counts must have one entry each, got ", n, ", ", stats.size(),
                    ", ", counts.size());
  TORCH_CHECK_VALUE(interval >= 1, "interval must be >= 1, got ", interval);
  if (n == 0) return;
  const at::Device device = factors[0].device();
  check_scalar_tensor(decay, "decay", device, at::kDouble);
  if (step.has_value()) check_scalar_tensor(*step, "step", device, at::kFloat);
  if (dropped.has_value()) check_scalar_tensor(*dropped, "dropped", device, at::kFloat);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& f = factors[i];
    TORCH_CHECK_TYPE(kfac_float(f.scalar_type()) && stats[i].scalar_type() == f.scalar_type() &&
                         counts[i].scalar_type() == f.scalar_type(),
                     "factors[", i, "], stats[", i, "] and counts[", i,
                     "] must share a float32/float64 dtype, got ", dtype_name(f.scalar_type()), ", ",
                     dtype_name(stats[i].scalar_type()), ", ", dtype_name(counts[i].scalar_type()));
    TORCH_CHECK_VALUE(f.device() == device && stats[i].device() == device && counts[i].device() == device,
                      "factors[", i, "], stats[", i, "] and counts[", i, "] must be on ", device);
    TORCH_CHECK_VALUE(f.dim() == 3 && f.size(1) == f.size(2) && f.is_contiguous(), "factors[", i,
                      "] must be a contiguous [groups, d, d] tensor, got shape ", f.sizes());
    TORCH_CHECK_VALUE(stats[i].sizes() == f.sizes() && stats[i].is_contiguous(), "stats[", i,
                      "] must be contiguous with the shape of factors[", i, "] ", f.sizes(), ", got ",
                      stats[i].sizes());
    TORCH_CHECK_VALUE(counts[i].dim() == 0, "counts[", i, "] must be a 0-dim tensor");
  }
}

inline void check_kfac_eigen_scale(at::TensorList v, at::TensorList dg, at::TensorList da,
                                   const at::Tensor& damping) {
  const size_t n = v.size();
  TORCH_CHECK_VALUE(dg.size() == n && da.size() == n, "v, dg and da must have one entry each, got ", n,
                    ", ", dg.size(), ", ", da.size());
  if (n == 0) return;
  const at::Device device = v[0].device();
  check_scalar_tensor(damping, "damping", device, at::kDouble);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_TYPE(kfac_float(v[i].scalar_type()) && dg[i].scalar_type() == v[i].scalar_type() &&
                         da[i].scalar_type() == v[i].scalar_type(),
                     "v[", i, "], dg[", i, "] and da[", i, "] must share a float32/float64 dtype");
    TORCH_CHECK_VALUE(v[i].device() == device && dg[i].device() == device && da[i].device() == device,
                      "v[", i, "], dg[", i, "] and da[", i, "] must be on ", device);
    TORCH_CHECK_VALUE(v[i].dim() == 3 && v[i].is_contiguous() && dg[i].is_contiguous() &&
                          da[i].is_contiguous(),
                      "v[", i, "] must be a contiguous [groups, d_g, d_a] tensor with contiguous dg, da");
    TORCH_CHECK_VALUE(dg[i].dim() == 2 && da[i].dim() == 2 && dg[i].size(0) == v[i].size(0) &&
                          da[i].size(0) == v[i].size(0) && dg[i].size(1) == v[i].size(1) &&
                          da[i].size(1) == v[i].size(2),
                      "dg[", i, "] and da[", i, "] must have shapes [groups, d_g] and [groups, d_a] for v[",
                      i, "] of shape ", v[i].sizes(), ", got ", dg[i].sizes(), " and ", da[i].sizes());
  }
}

// The distance between the rows of a [groups, d_g, d_a] precond whose rows (groups * d_g of
// them, each d_a contiguous elements) are equally spaced, as a contiguous tensor's or a view
// of row-aligned storage's are; -1 for any other layout.
inline int64_t kfac_row_stride(const at::Tensor& v) {
  const int64_t groups = v.size(0), rows = v.size(1), cols = v.size(2);
  if (v.numel() == 0) return cols;
  if (cols > 1 && v.stride(2) != 1) return -1;
  const int64_t ld = rows > 1 ? v.stride(1) : groups > 1 ? v.stride(0) : cols;
  if (ld < cols || (rows > 1 && groups > 1 && v.stride(0) != rows * ld)) return -1;
  return ld;
}

inline void check_kfac_precondition_apply(at::TensorList weight_grads, at::TensorList bias_grads,
                                          at::TensorList precond, const at::Tensor& lr,
                                          const std::optional<at::Tensor>& kl_clip,
                                          const std::optional<at::Tensor>& shift) {
  const size_t n = weight_grads.size();
  TORCH_CHECK_VALUE(bias_grads.size() == n && precond.size() == n,
                    "weight_grads, bias_grads and precond must have one entry each, got ", n, ", ",
                    bias_grads.size(), ", ", precond.size());
  if (n == 0) return;
  const at::Device device = weight_grads[0].device();
  check_scalar_tensor(lr, "lr", device, at::kDouble);
  if (kl_clip.has_value()) check_scalar_tensor(*kl_clip, "kl_clip", device, at::kDouble);
  const at::ScalarType dtype = weight_grads[0].scalar_type();
  if (shift.has_value()) {
    TORCH_CHECK_VALUE(shift->dim() == 1 && shift->size(0) == static_cast<int64_t>(n) && shift->is_contiguous(),
                      "shift must be a 1-dim tensor of ", n, " contiguous entries (one per entry of "
                      "precond), got shape ", shift->sizes());
    TORCH_CHECK_VALUE(shift->device() == device, "shift is on ", shift->device(), ", expected ", device);
    TORCH_CHECK_TYPE(shift->scalar_type() == dtype, "shift has dtype ", dtype_name(shift->scalar_type()),
                     ", expected the gradients' ", dtype_name(dtype));
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& w = weight_grads[i];
    const at::Tensor& b = bias_grads[i];
    const at::Tensor& v = precond[i];
    TORCH_CHECK_TYPE(kfac_float(dtype) && w.scalar_type() == dtype && b.scalar_type() == dtype &&
                         v.scalar_type() == dtype,
                     "weight_grads, bias_grads and precond must share one float32/float64 dtype; entry ", i,
                     " has ", dtype_name(w.scalar_type()), ", ", dtype_name(b.scalar_type()), ", ",
                     dtype_name(v.scalar_type()));
    TORCH_CHECK_VALUE(w.device() == device && b.device() == device && v.device() == device,
                      "entry ", i, " of weight_grads, bias_grads and precond must be on ", device);
    TORCH_CHECK_VALUE(w.is_contiguous() && b.is_contiguous(),
                      "entry ", i, " of weight_grads and bias_grads must be contiguous");
    TORCH_CHECK_VALUE(v.dim() == 3, "precond[", i, "] must be [groups, d_g, d_a], got shape ", v.sizes());
    TORCH_CHECK_VALUE(kfac_row_stride(v) > 0,
                      "precond[", i, "] must have contiguous, equally spaced rows (contiguous, or a "
                      "view of row-aligned storage), got strides ", v.strides());
    const int64_t rows = v.size(0) * v.size(1);
    const int64_t bias = b.numel() > 0 ? 1 : 0;
    TORCH_CHECK_VALUE(v.size(2) > bias && w.numel() == rows * (v.size(2) - bias) &&
                          (bias == 0 || b.numel() == rows),
                      "precond[", i, "] of shape ", v.sizes(), " does not match weight_grads[", i,
                      "] of ", w.numel(), " elements and bias_grads[", i, "] of ", b.numel());
  }
}

}  // namespace cafin
