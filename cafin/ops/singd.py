"""The Python face of SINGD's fused op: a typed wrapper with clear argument errors, and the fake
implementation torch.compile traces. Schema: csrc/ops.cpp. Semantics: the function of the same
name in cafin/reference/singd.py. The kernels check their inputs again before writing anything.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["singd_diag_step_"]


def singd_diag_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     momentum_buffers: Sequence[torch.Tensor], K: Sequence[torch.Tensor],
                     C: Sequence[torch.Tensor], k_offsets: Sequence[int], lr: torch.Tensor,
                     momentum: torch.Tensor, weight_decay: torch.Tensor,
                     grad_scale: float = 1.0) -> None:
    """The SINGD step of parameters whose layers have diagonal K and C, in place (params and
    momentum_buffers written): nat = C^2 * G * K^2 (K from k_offsets[i], one entry per column of
    the parameter viewed as [C.numel(), -1]; K and C both empty: nat = G, the SGD epilogue of any
    update), u = nat + weight_decay*theta, buf = momentum*buf + u,
    theta -= lr*buf; without momentum (momentum_buffers empty) theta -= lr*u. lr, momentum and
    weight_decay are 0-dim tensors of the op-math dtype on the parameters' device."""
    if len(params) == 0:
        return
    for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a 0-dim Tensor, got {type(value).__name__}")
    torch.ops.cafin.singd_diag_step_(list(params), list(grads), list(momentum_buffers), list(K),
                                     list(C), [int(o) for o in k_offsets], lr, momentum,
                                     weight_decay, float(grad_scale))


@torch.library.register_fake("cafin::singd_diag_step_")
def _singd_diag_step_fake(params, grads, momentum_buffers, K, C, k_offsets, lr, momentum,
                          weight_decay, grad_scale=1.0) -> None:
    if len(grads) != len(params) or len(K) != len(params) or len(C) != len(params):
        raise ValueError("grads, K and C must have as many entries as params")
    return None
