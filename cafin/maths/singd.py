"""SINGD's per-layer maths (arXiv 2312.05705), which both backends use: the rows a and g that a
layer's input and output gradient become, the gradient as a matrix, the natural gradient, the
preconditioner's momentum and factor steps, and the SGD update, computed the way singd 0.0.5
computes them.

The layers: Linear; Conv1d, Conv2d and Conv3d (rows = patches); transformers' `Conv1D` (a Linear
whose weight is stored [in, out]); Embedding (a Linear on one-hot inputs, its weight stored
[num_embeddings, dim]: the input side K is over the vocabulary and always diagonal, since
one-hot rows have no cross terms). In every case the gradient as a matrix is [d_C, d_K]: output
side by input side, with the bias as the last column. What each layer type is (its rows,
patches and padding, which side of its weight is stored transposed) is its view's
(`cafin.core.views`); this module keeps singd's conventions on top of it.

Structured matrices are tuples of tensors (`cafin.optim.singd.structures`). Every function here
is pure (returns new tensors) except where its name ends in `_`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..core.views import view_of

if TYPE_CHECKING:  # a type only: SINGD's package imports this module
    from ..optim.singd.structures import Structure

def is_transposed(module: nn.Module) -> bool:
    """Whether the weight is stored [input side, output side] (Embedding, transformers' Conv1D),
    the transpose of Linear's [out, in]."""
    view = view_of(module)
    return view is not None and view.transposed


def has_bias(module: nn.Module) -> bool:
    return getattr(module, "bias", None) is not None


def dims(module: nn.Module) -> tuple[int, int]:
    """(d_K, d_C): the input side (bias column included) and the output side of a layer (all
    groups of a grouped convolution: singd keeps one K for every group)."""
    groups, d_a, d_g = view_of(module).sizes(module)
    return d_a, groups * d_g

# The rows follow singd's conventions, not cafin.factors' (one row set per group, unscaled), so
# that SINGD reproduces singd's numbers: group-averaged patches, "reduce" = mean of the input rows /
# sum of the gradient rows over shared locations, 1/sqrt(rows) and sqrt(loss terms) scalings.


def patches(module: nn.Module, x: Tensor) -> Tensor:
    """[b, locations, C/groups * prod(kernel)] of a Conv1d, Conv2d or Conv3d input, entry
    order (c, k_1, ..., k_n) as `weight[o].flatten()`, locations in the output's order: the
    input padded as the convolution pads it (zeros or its padding_mode, 'same' with torch's
    split), averaged over channel groups (singd's convention for Conv2d), windows cut with
    stride and dilation."""
    view = view_of(module)
    x, padding = view.padded(module, x)
    return view.patches(module, _group_mean(module, x), padding, locations_first=True)


def _group_mean(module: nn.Module, x: Tensor) -> Tensor:
    """A padded convolution input averaged over its channel groups (singd's one K per layer)."""
    b, c = x.shape[:2]
    return x.reshape(b, module.groups, c // module.groups, *x.shape[2:]).mean(1)


def input_rows(module: nn.Module, x: Tensor, kfac_approx: str) -> Tensor:
    """a [rows, d_K]: input rows (with a ones column for a bias) divided by sqrt(rows), so that
    a^T a is the mean outer product (not for Embedding: `embedding_inner`)."""
    view = view_of(module)
    if view.conv:
        p = patches(module, x)
        a = p.reshape(-1, p.shape[2]) if kfac_approx == "expand" else p.mean(1)
    else:
        rows = view.sample_rows(module, x)  # [b, locations, d]
        a = rows.reshape(-1, rows.shape[-1]) if kfac_approx == "expand" else rows.mean(1)
    if has_bias(module):
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
    return a / math.sqrt(a.shape[0])


def embedding_inner(k: Tensor, module: nn.Embedding, x: Tensor, kfac_approx: str) -> tuple:
    """H_K = diag(K^T a^T a K) of an Embedding with diagonal K (its parts), where a holds the
    one-hot rows of the indices x as `input_rows` makes a Linear's on one-hot inputs, without
    forming them: "expand": token counts / rows; "reduce": per sample the mean one-hot over
    its positions, squared and averaged over samples. A position holding padding_idx is a zero
    row (its output never reaches a trained weight), still counted among the rows."""
    V = module.num_embeddings
    x = x.reshape(1) if x.dim() == 0 else x
    if kfac_approx == "expand":
        idx = x.reshape(-1)
        counts = torch.zeros(V, dtype=k.dtype, device=k.device).index_add_(
            0, idx, torch.ones(idx.numel(), dtype=k.dtype, device=k.device))
        if module.padding_idx is not None:
            counts[module.padding_idx] = 0.0
        sumsq = counts / idx.numel()
    else:
        idx = x.reshape(x.shape[0], -1).long()  # scatter_add_ takes int64 indices only
        mean = torch.zeros(idx.shape[0], V, dtype=k.dtype, device=k.device).scatter_add_(
            1, idx, torch.ones(idx.shape, dtype=k.dtype, device=k.device)) / idx.shape[1]
        if module.padding_idx is not None:
            mean[:, module.padding_idx] = 0.0
        a = mean / math.sqrt(idx.shape[0])
        sumsq = (a * a).sum(0)
    return ((k * k) * sumsq,)


def grad_rows(module: nn.Module, g: Tensor, loss_average: str | None, kfac_approx: str) -> Tensor:
    """g [rows, d_C]: output-gradient rows times sqrt(number of loss terms) ("batch": B,
    "batch+sequence": B times the shared locations, None: 1); "reduce" sums over locations."""
    g = view_of(module).sample_rows(module, g)  # [b, locations, c]
    scale = 1.0
    if loss_average is not None:
        terms = g.shape[0] * (g.shape[1] if loss_average == "batch+sequence" else 1)
        scale = math.sqrt(terms)
    rows = g.reshape(-1, g.shape[-1]) if kfac_approx == "expand" else g.sum(1)
    return rows * scale


def gradient_matrix(module: nn.Module, weight_grad: Tensor | None, bias_grad: Tensor | None,
                    like: Tensor) -> Tensor:
    """[d_C, d_K] = [grad W viewed (out, -1) | grad b] (a weight stored [in, out] transposed); a
    missing gradient reads as zeros."""
    d_k, d_c = dims(module)
    bias = has_bias(module)
    if weight_grad is None:
        gw = torch.zeros(d_c, d_k - bias, dtype=like.dtype, device=like.device)
    else:
        gw = view_of(module).weight_matrix(module, weight_grad)
    if not bias:
        return gw
    gb = bias_grad if bias_grad is not None else torch.zeros(d_c, dtype=gw.dtype, device=gw.device)
    return torch.cat([gw, gb.unsqueeze(1)], dim=1)


def weight_pieces(module: nn.Module, nat: Tensor) -> dict[str, Tensor]:
    """A [d_C, d_K] natural gradient split into the layer's parameters: the weight's piece in the
    weight's layout for a transposed weight, else [out, -1]; the bias's."""
    if not has_bias(module):
        return {"weight": nat.mT if is_transposed(module) else nat}
    weight = nat[:, :-1]
    return {"weight": weight.mT if is_transposed(module) else weight, "bias": nat[:, -1]}


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
