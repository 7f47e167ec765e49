// Argument checks of the SINGD ops, shared by the CPU and CUDA entry points (they run before
// anything is written).
#pragma once

#include <ATen/core/Tensor.h>

#include "checks.h"

namespace cafin {

inline void check_singd_diag_step(at::TensorList params, at::TensorList grads, at::TensorList bufs,
                           at::TensorList K, at::TensorList C, at::IntArrayRef k_offsets,
                           const at::Tensor& lr, const at::Tensor& momentum,
                           const at::Tensor& weight_decay) {
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

}  // namespace cafin
