"""SINGD's per-layer maths (arXiv 2312.05705), which both backends use: the rows a and g that a
layer's input and output gradient become, the gradient as a matrix, the natural gradient, the
preconditioner's momentum and factor steps, and the SGD update, computed the way singd 0.0.5
computes them.

Structured matrices are tuples of tensors (`cafin.structures`). Every function here is pure
(returns new tensors) except where its name ends in `_`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers import conv_padding
from ..structures import Structure

# The rows follow singd's conventions, not cafin.factors' (one row set per group, unscaled), so
# that SINGD reproduces singd's numbers: group-averaged patches, "reduce" = mean of the input rows /
# sum of the gradient rows over shared locations, 1/sqrt(rows) and sqrt(loss terms) scalings.


def _conv_input_4d(module: nn.Conv2d, x: Tensor) -> tuple[Tensor, list[int]]:
    """The input padded as the convolution pads it (padding_mode honoured), and the zero padding
    left for unfold."""
    if x.dim() == 3:  # unbatched
        x = x.unsqueeze(0)
    if module.padding_mode != "zeros":
        return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode), [0] * 4
    pads = conv_padding(module)  # [top, bottom, left, right]
    if pads[0] != pads[1] or pads[2] != pads[3]:  # 'same' with an odd total: pad explicitly
        return F.pad(x, [pads[2], pads[3], pads[0], pads[1]]), [0] * 4
    return x, pads


def input_rows(module: nn.Module, x: Tensor, kfac_approx: str) -> Tensor:
    """a [rows, d_K]: input rows (with a ones column for a bias) divided by sqrt(rows), so that
    a^T a is the mean outer product."""
    if isinstance(module, nn.Conv2d):
        x, pads = _conv_input_4d(module, x)
        b, c = x.shape[:2]
        # singd averages the input over channel groups (one K for every group)
        x = x.reshape(b, module.groups, c // module.groups, *x.shape[2:]).mean(1)
        cols = F.unfold(x, module.kernel_size, dilation=module.dilation,
                        padding=(pads[0], pads[2]), stride=module.stride)  # [b, D, L]
        if kfac_approx == "expand":
            a = cols.transpose(1, 2).reshape(-1, cols.shape[1])
        else:
            a = cols.mean(2)
    else:
        if x.dim() == 1:
            x = x.unsqueeze(0)
        a = x.reshape(-1, x.shape[-1]) if kfac_approx == "expand" else \
            x.reshape(x.shape[0], -1, x.shape[-1]).mean(1)
    if module.bias is not None:
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
    return a / math.sqrt(a.shape[0])


def grad_rows(module: nn.Module, g: Tensor, loss_average: str | None, kfac_approx: str) -> Tensor:
    """g [rows, d_C]: output-gradient rows times sqrt(number of loss terms) ("batch": B,
    "batch+sequence": B times the shared locations, None: 1); "reduce" sums over locations."""
    if isinstance(module, nn.Conv2d):
        if g.dim() == 3:
            g = g.unsqueeze(0)
        g = g.flatten(2).transpose(1, 2)  # [b, locations, c]
    elif g.dim() == 1:
        g = g.unsqueeze(0).unsqueeze(1)
    else:
        g = g.reshape(g.shape[0], -1, g.shape[-1])
    scale = 1.0
    if loss_average is not None:
        terms = g.shape[0] * (g.shape[1] if loss_average == "batch+sequence" else 1)
        scale = math.sqrt(terms)
    rows = g.reshape(-1, g.shape[-1]) if kfac_approx == "expand" else g.sum(1)
    return rows * scale


def gradient_matrix(module: nn.Module, weight_grad: Tensor | None, bias_grad: Tensor | None,
                    like: Tensor) -> Tensor:
    """[d_C, d_K] = [grad W viewed (out, -1) | grad b]; a missing gradient reads as zeros."""
    w = module.weight
    gw = weight_grad.reshape(w.shape[0], -1) if weight_grad is not None else \
        torch.zeros(w.shape[0], w[0].numel(), dtype=like.dtype, device=like.device)
    if module.bias is None:
        return gw
    gb = bias_grad if bias_grad is not None else torch.zeros(w.shape[0], dtype=gw.dtype, device=gw.device)
    return torch.cat([gw, gb.unsqueeze(1)], dim=1)


def natural_gradient(sk: type[Structure], k: tuple, sc: type[Structure], c: tuple,
                     gmat: Tensor, p_k: Tensor | None = None, p_c: Tensor | None = None) -> Tensor:
    """C C^T Gmat K K^T, as singd orders it: (K (K^T Gmat^T))^T in K's dtype, then C (C^T .) in
    C's dtype, back in the gradient's dtype. A cached P_K = K K^T (P_C = C C^T) replaces the
    two products of its side by one."""
    kt = gmat.mT.to(k[0].dtype)
    nat = (p_k @ kt if p_k is not None else sk.matmul(k, sk.rmatmat(k, kt))).mT
    nat = nat.to(c[0].dtype)
    nat = p_c @ nat if p_c is not None else sc.matmul(c, sc.rmatmat(c, nat))
    return nat.to(gmat.dtype)


def new_momentum(s: type[Structure], h: tuple, ktk: tuple, eye: tuple, c_h, c_damp, scale,
                 alpha1: float, m_old: tuple | None) -> tuple:
    """m~ = scale * (c_h * H + c_damp * Pi(K^T K) - I) (+ alpha1 * m_old), elementwise over the
    structured storage (I's parts are the identity's)."""
    out = []
    for i, (hp, kp, ep) in enumerate(zip(h, ktk, eye)):
        m = (c_h * hp + c_damp * kp - ep) * scale
        if m_old is not None:
            m = m + alpha1 * m_old[i]
        out.append(m)
    return tuple(out)


def factor_step(s: type[Structure], k: tuple, m: tuple, beta) -> tuple:
    """The truncated exponential K exp(-beta m) ~ K - beta K m, within the group."""
    km = s.product(k, m)
    return tuple(kp - beta * kmp for kp, kmp in zip(k, km))


def sgd_update_(params: list[Tensor], updates: list[Tensor], buffers: list[Tensor | None], lr,
                momentum, weight_decay) -> None:
    """u = nat + wd*theta; buf <- momentum*buf + u (torch SGD, no dampening; no momentum where
    the buffer is None); theta -= lr*buf."""
    for p, u, buf in zip(params, updates, buffers):
        u = u + weight_decay * p
        if buf is not None:
            buf.mul_(momentum).add_(u)
            u = buf
        p.sub_(lr * u)
