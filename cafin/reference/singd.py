"""SINGD's fused ops in plain PyTorch, op for op: each function has the signature and in-place
semantics of the op of the same name in `cafin.ops` (schemas: csrc/ops.cpp), in singd 0.0.5's
order of products. The per-layer maths both backends share is in `cafin.maths.singd`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..maths.singd import sgd_update_


def singd_diag_step_(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor],
                     K: list[Tensor], C: list[Tensor], k_offsets: list[int], lr: Tensor,
                     momentum: Tensor, weight_decay: Tensor, grad_scale: Tensor | None = None) -> None:
    """The op of the same name in plain PyTorch: the natural gradient of diagonal K and C in singd's
    order of products (K and C both empty: the gradient itself), then
    `cafin.maths.singd.sgd_update_` (no momentum when momentum_buffers is empty)."""
    updates = []
    for p, g, k, c, off in zip(params, grads, K, C, k_offsets):
        g = g.reshape(max(c.numel(), 1), -1).to(k.dtype)
        if grad_scale is not None:
            g = g / grad_scale
        if c.numel() == 0:  # no factors: the gradient itself
            updates.append(g.reshape(p.shape))
            continue
        kk = k[off:off + g.shape[1]]
        nat = c.unsqueeze(1) * (c.unsqueeze(1) * (kk * (kk * g)))
        updates.append(nat.reshape(p.shape))
    work = [p.to(lr.dtype) for p in params]
    bufs = [b.to(lr.dtype) for b in momentum_buffers] if momentum_buffers else [None] * len(params)
    sgd_update_(work, updates, bufs, lr, momentum, weight_decay)
    for p, w in zip(params, work):
        p.copy_(w)
    for b, w in zip(momentum_buffers, bufs):
        b.copy_(w)


def _eye_mask(t: Tensor, kind: int) -> Tensor:
    """The identity's ones in a part's storage (see cafin.optim.singd.structures.Structure.eye_kinds)."""
    if kind == 2:
        return torch.ones_like(t)
    out = torch.zeros_like(t)
    if kind == 1:
        torch.diagonal(out, dim1=-2, dim2=-1).fill_(1.0)
    elif kind == 3 and t.numel() > 0:
        out.view(-1)[0] = 1.0
    return out


def singd_momentum_(m: list[Tensor], H: list[Tensor], KtK: list[Tensor], c_h: list[Tensor],
                    c_damp: list[Tensor], go: list[Tensor], eye: list[int], pi: list[int],
                    scale: list[Tensor], alpha1: list[Tensor]) -> None:
    """The op of the same name in plain PyTorch (`cafin.maths.singd.new_momentum` part by part,
    written only where go[i], a 0-dim bool tensor, is true)."""
    for i in range(len(m)):
        new = (c_h[i] * H[i] + c_damp[i] * (pi[i] * KtK[i]) - _eye_mask(m[i], eye[i])) * scale[i]
        new = torch.where(alpha1[i] != 0, new + alpha1[i] * m[i], new)  # m unread when alpha1 == 0
        m[i].copy_(torch.where(go[i], new.to(m[i].dtype), m[i]))
        H[i].copy_(torch.where(go[i], torch.zeros_like(H[i]), H[i]))


def singd_factor_step_(K: list[Tensor], KM: list[Tensor], beta: list[Tensor], go: list[Tensor],
                       elementwise: list[bool]) -> None:
    """The op of the same name in plain PyTorch (`cafin.maths.singd.factor_step` part by part,
    written only where go[i], a 0-dim bool tensor, is true)."""
    for k, km, b, g, ew in zip(K, KM, beta, go, elementwise):
        new = k - b * (k * km if ew else km)
        k.copy_(torch.where(g, new.to(k.dtype), k))
