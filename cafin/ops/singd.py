"""The Python face of SINGD's fused op: a typed wrapper with clear argument errors, and the fake
implementation torch.compile traces. Schema: csrc/ops.cpp. Semantics: the function of the same
name in cafin/reference/singd.py. The kernels check their inputs again before writing anything.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["singd_diag_step_", "singd_factor_step_", "singd_momentum_"]


def singd_diag_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     momentum_buffers: Sequence[torch.Tensor], K: Sequence[torch.Tensor],
                     C: Sequence[torch.Tensor], k_offsets: Sequence[int], lr: torch.Tensor,
                     momentum: torch.Tensor, weight_decay: torch.Tensor,
                     grad_scale: torch.Tensor | None = None) -> None:
    """The SINGD step of parameters whose layers have diagonal K and C, in place (params and
    momentum_buffers written): nat = C^2 * G * K^2 (K from k_offsets[i], one entry per column of
    the parameter viewed as [C.numel(), -1]; K and C both empty: nat = G, the SGD epilogue of any
    update), u = nat + weight_decay*theta, buf = momentum*buf + u,
    theta -= lr*buf; without momentum (momentum_buffers empty) theta -= lr*u; G is the gradient
    divided by grad_scale (None: unscaled). lr, momentum, weight_decay and grad_scale are 0-dim
    tensors of the op-math dtype on the parameters' device."""
    if len(params) == 0:
        return
    for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a 0-dim Tensor, got {type(value).__name__}")
    if grad_scale is not None and not isinstance(grad_scale, torch.Tensor):
        raise TypeError(f"grad_scale must be a 0-dim Tensor or None, got {type(grad_scale).__name__}")
    torch.ops.cafin.singd_diag_step_(list(params), list(grads), list(momentum_buffers), list(K),
                                     list(C), [int(o) for o in k_offsets], lr, momentum,
                                     weight_decay, grad_scale)


@torch.library.register_fake("cafin::singd_diag_step_")
def _singd_diag_step_fake(params, grads, momentum_buffers, K, C, k_offsets, lr, momentum,
                          weight_decay, grad_scale=None) -> None:
    if len(grads) != len(params) or len(K) != len(params) or len(C) != len(params):
        raise ValueError("grads, K and C must have as many entries as params")
    return None


def singd_momentum_(m: Sequence[torch.Tensor], H: Sequence[torch.Tensor], KtK: Sequence[torch.Tensor],
                    c_h: Sequence[torch.Tensor], c_damp: Sequence[torch.Tensor],
                    go: Sequence[torch.Tensor], eye: Sequence[int], pi: Sequence[int],
                    scale: Sequence[torch.Tensor], alpha1: Sequence[torch.Tensor]) -> None:
    """The Riemannian momentum of structured factors, one entry per stored part, in place: where
    go[i] (a 0-dim bool tensor: the update is written), m <- scale*(c_h*H + c_damp*pi*KtK - I)
    + alpha1*m and H <- 0 (m is not read when alpha1 == 0); elsewhere nothing is written.
    eye[i] says where the identity's ones are (0 none, 1 each matrix's diagonal, 2 every entry,
    3 entry 0); pi[i] (1 or 2) is the projection's fold on the part. c_h, c_damp, scale and alpha1
    are 0-dim tensors of the parts' op-math dtype."""
    if len(m) == 0:
        return
    for name, values in (("c_h", c_h), ("c_damp", c_damp), ("scale", scale), ("alpha1", alpha1)):
        for i, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a 0-dim Tensor, got {type(value).__name__}")
    torch.ops.cafin.singd_momentum_(list(m), list(H), list(KtK), list(c_h), list(c_damp), list(go),
                                    [int(e) for e in eye], [int(p) for p in pi], list(scale),
                                    list(alpha1))


def singd_factor_step_(K: Sequence[torch.Tensor], KM: Sequence[torch.Tensor],
                       beta: Sequence[torch.Tensor], go: Sequence[torch.Tensor],
                       elementwise: Sequence[bool]) -> None:
    """The truncated-exponential factor update, one entry per stored part, in place: where go[i]
    (a 0-dim bool tensor: the update is written), K <- K - beta*KM (KM = K m from a GEMM), or
    K <- K - beta*K*KM where elementwise[i] (a diagonal part, KM holding m's part)."""
    if len(K) == 0:
        return
    torch.ops.cafin.singd_factor_step_(list(K), list(KM), list(beta), list(go),
                                       [bool(e) for e in elementwise])


@torch.library.register_fake("cafin::singd_momentum_")
def _singd_momentum_fake(m, H, KtK, c_h, c_damp, go, eye, pi, scale, alpha1) -> None:
    if not (len(H) == len(KtK) == len(c_h) == len(c_damp) == len(go) == len(eye) == len(pi)
            == len(scale) == len(alpha1) == len(m)):
        raise ValueError("every list must have one entry per part of m")
    return None


@torch.library.register_fake("cafin::singd_factor_step_")
def _singd_factor_step_fake(K, KM, beta, go, elementwise) -> None:
    if not (len(KM) == len(beta) == len(go) == len(elementwise) == len(K)):
        raise ValueError("KM, beta, go and elementwise must have one entry per part of K")
    return None
