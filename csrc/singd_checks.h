// Argument checks of the SINGD ops, shared by the CPU and CUDA entry points (they run before
// anything is written).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "checks.h"
#include "singd_math.h"

namespace cafin {

inline void check_singd_diag_step(at::TensorList params, at::TensorList grads, at::TensorList bufs,
                           at::TensorList K, at::TensorList C, at::IntArrayRef k_offsets,
                           const at::Tensor& lr, const at::Tensor& momentum,
                           const at::Tensor& weight_decay,
                           const std::optional<at::Tensor>& grad_scale) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && K.size() == n && C.size() == n && k_offsets.size() == n,
                    "grads, K, C and k_offsets must have as many entries as params (", n, ")");
  TORCH_CHECK_VALUE(bufs.size() == n || bufs.empty(),
                    "momentum_buffers must have one entry per parameter (or none: no momentum); got ",
                    bufs.size(), " for ", n, " parameters");
  if (n == 0) return;
  const auto dtype = params[0].scalar_type();
  const auto device = params[0].device();
  TORCH_CHECK_TYPE(is_supported_float(dtype), "params have unsupported dtype ", dtype_name(dtype));
  const auto factor = state_dtype(dtype);
  check_scalar_tensor(lr, "lr", device, factor);
  check_scalar_tensor(momentum, "momentum", device, factor);
  check_scalar_tensor(weight_decay, "weight_decay", device, factor);
  if (grad_scale.has_value()) check_scalar_tensor(*grad_scale, "grad_scale", device, factor);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_TYPE(params[i].scalar_type() == dtype && grads[i].scalar_type() == dtype &&
                         (bufs.empty() || bufs[i].scalar_type() == dtype),
                     "params, grads and momentum_buffers must share one dtype (entry ", i, ")");
    TORCH_CHECK_TYPE(K[i].scalar_type() == factor && C[i].scalar_type() == factor, "K and C of entry ",
                     i, " must have dtype ", dtype_name(factor));
    TORCH_CHECK_VALUE(params[i].device() == device && grads[i].device() == device &&
                          K[i].device() == device && C[i].device() == device &&
                          (bufs.empty() || bufs[i].device() == device),
                      "every tensor must be on ", device, " (entry ", i, ")");
    TORCH_CHECK_VALUE(params[i].is_contiguous() && grads[i].is_contiguous() &&
                          (bufs.empty() || bufs[i].is_contiguous()) && K[i].is_contiguous() &&
                          C[i].is_contiguous(),
                      "entry ", i, ": tensors must be contiguous");
    TORCH_CHECK_VALUE(grads[i].numel() == params[i].numel() &&
                          (bufs.empty() || bufs[i].numel() == params[i].numel()),
                      "entry ", i, ": grad and momentum buffer must match the parameter's size");
    TORCH_CHECK_VALUE(K[i].dim() == 1 && C[i].dim() == 1, "entry ", i, ": K and C must be vectors");
    if (K[i].numel() == 0 && C[i].numel() == 0) {  // no preconditioning: the update is g itself
      TORCH_CHECK_VALUE(k_offsets[i] == 0, "entry ", i, ": k_offset must be 0 when K and C are empty");
      continue;
    }
    TORCH_CHECK_VALUE(C[i].numel() > 0 && params[i].numel() % C[i].numel() == 0,
                      "entry ", i, ": C must be a vector whose length divides the parameter's size");
    const int64_t cols = params[i].numel() / C[i].numel();
    TORCH_CHECK_VALUE(k_offsets[i] >= 0 && k_offsets[i] + cols <= K[i].numel(), "entry ", i,
                      ": k_offset ", k_offsets[i], " + ", cols, " columns exceeds K's ", K[i].numel());
  }
}

// One 0-dim coefficient per part, on the parts' device, of their op-math dtype (go: bool).
inline void check_singd_coefficients(at::TensorList coeffs, const char* name, size_t n,
                                     const at::Device& device, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(coeffs.size() == n, name, " must have one entry per part (", n, "), got ",
                    coeffs.size());
  for (size_t i = 0; i < n; ++i) {
    check_scalar_tensor(coeffs[i], std::string(name) + "[" + std::to_string(i) + "]", device, dtype);
  }
}

inline void check_singd_parts(at::TensorList out, at::TensorList in, const char* out_name,
                              const char* in_name, size_t i, at::ScalarType dtype,
                              const at::Device& device) {
  TORCH_CHECK_TYPE(out[i].scalar_type() == dtype && in[i].scalar_type() == dtype, out_name, "[", i,
                   "] and ", in_name, "[", i, "] must have dtype ", dtype_name(dtype));
  TORCH_CHECK_VALUE(out[i].device() == device && in[i].device() == device, out_name, "[", i, "] and ",
                    in_name, "[", i, "] must be on ", device);
  TORCH_CHECK_VALUE(out[i].is_contiguous() && in[i].is_contiguous(), out_name, "[", i, "] and ",
                    in_name, "[", i, "] must be contiguous");
  TORCH_CHECK_VALUE(out[i].sizes() == in[i].sizes(), out_name, "[", i, "] has shape ", out[i].sizes(),
                    " but ", in_name, "[", i, "] has shape ", in[i].sizes());
}

inline void check_singd_momentum(at::TensorList m, at::TensorList H, at::TensorList KtK,
                                 at::TensorList c_h, at::TensorList c_damp, at::TensorList go,
                                 at::IntArrayRef eye, at::IntArrayRef pi, at::TensorList scale,
                                 at::TensorList alpha1) {
  const size_t n = m.size();
  TORCH_CHECK_VALUE(H.size() == n && KtK.size() == n && eye.size() == n && pi.size() == n,
                    "H, KtK, eye and pi must have as many entries as m (", n, ")");
  if (n == 0) return;
  const auto dtype = m[0].scalar_type();
  const auto device = m[0].device();
  TORCH_CHECK_TYPE(is_supported_float(dtype), "m has unsupported dtype ", dtype_name(dtype));
  for (size_t i = 0; i < n; ++i) {
    check_singd_parts(m, H, "m", "H", i, dtype, device);
    check_singd_parts(m, KtK, "m", "KtK", i, dtype, device);
    TORCH_CHECK_VALUE(eye[i] >= kEyeNone && eye[i] <= kEyeFirst, "eye[", i, "] must be 0..3, got ", eye[i]);
    TORCH_CHECK_VALUE(pi[i] == 1 || pi[i] == 2, "pi[", i, "] must be 1 or 2, got ", pi[i]);
    TORCH_CHECK_VALUE(eye[i] != kEyeMatrixDiagonal || m[i].dim() >= 2, "eye[", i,
                      "] asks for a matrix diagonal but m[", i, "] has ", m[i].dim(), " dimensions");
  }
  check_singd_coefficients(c_h, "c_h", n, device, state_dtype(dtype));
  check_singd_coefficients(c_damp, "c_damp", n, device, state_dtype(dtype));
  check_singd_coefficients(scale, "scale", n, device, state_dtype(dtype));
  check_singd_coefficients(alpha1, "alpha1", n, device, state_dtype(dtype));
  check_singd_coefficients(go, "go", n, device, at::kBool);
}

inline void check_singd_factor_step(at::TensorList K, at::TensorList KM, at::TensorList beta,
                                    at::TensorList go, const c10::List<bool>& elementwise) {
  const size_t n = K.size();
  TORCH_CHECK_VALUE(KM.size() == n && elementwise.size() == n,
                    "KM and elementwise must have as many entries as K (", n, ")");
  if (n == 0) return;
  const auto dtype = K[0].scalar_type();
  const auto device = K[0].device();
  TORCH_CHECK_TYPE(is_supported_float(dtype), "K has unsupported dtype ", dtype_name(dtype));
  for (size_t i = 0; i < n; ++i) check_singd_parts(K, KM, "K", "KM", i, dtype, device);
  check_singd_coefficients(beta, "beta", n, device, state_dtype(dtype));
  check_singd_coefficients(go, "go", n, device, at::kBool);
}

}  // namespace cafin
