"""Dense Kronecker statistics of Linear and Conv2d layers, for every member that keeps dense or
structured factors (K-FAC, two-level K-FAC, SINGD).

A layer's weight gradient, viewed as matrices, is per group q

    dW_q = sum_n g[q, n] abar[q, n]^T,    abar = [a; 1] when the layer has a bias,

with rows a [groups, N, d_in] and g [groups, N, d_out] (groups = 1 for Linear and ungrouped
Conv2d). Linear takes any leading dims (N = their product); Conv2d takes the patches of its
input, entry order (c, kh, kw) as `weight[o].flatten()`, with stride, padding ('same', 'valid',
asymmetric, non-zero modes), dilation and groups, one row per output location.

Covariances never hold the whole unfold of a Conv2d input: patches are unfolded a few samples at a
time and accumulated with batched GEMMs, and the bias row/column of A comes from row sums (the
corner is the row count), never from a column of ones appended to the rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import conv_padding

# Bytes of unfolded patches one chunk may hold (per covariance call).
CHUNK_BYTES = 32 << 20

__all__ = [
    "supports", "groups_of", "locations", "factor_sizes",
    "input_rows", "grad_rows", "input_covariance", "grad_covariance",
    "kfac_input_factor", "kfac_grad_factor", "grad_matrix", "write_grad_matrix",
]


def supports(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Conv2d))


def groups_of(module: nn.Module) -> int:
    return module.groups if isinstance(module, nn.Conv2d) else 1


def factor_sizes(module: nn.Module) -> tuple[int, int, int]:
    """(groups, d_a, d_g): A is [groups, d_a, d_a] (bias column included), G [groups, d_g, d_g]."""
    bias = module.bias is not None
    if isinstance(module, nn.Linear):
        return 1, module.in_features + bias, module.out_features
    if isinstance(module, nn.Conv2d):
        g = module.groups
        d = module.in_channels // g * module.kernel_size[0] * module.kernel_size[1]
        return g, d + bias, module.out_channels // g
    raise TypeError(f"no dense statistics for {type(module).__name__}")


def _conv_input(module: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """The input as unfold must see it (batched, padded when unfold cannot pad it) and the
    symmetric padding left for unfold."""
    if x.dim() == 3:
        x = x.unsqueeze(0)
    top, bottom, left, right = conv_padding(module)
    if module.padding_mode != "zeros":
        return F.pad(x, [left, right, top, bottom], mode=module.padding_mode), (0, 0)
    if top != bottom or left != right:
        return F.pad(x, [left, right, top, bottom]), (0, 0)
    return x, (top, left)


def _out_size(module: nn.Conv2d, x: torch.Tensor, padding) -> tuple[int, int]:
    sizes = []
    for i in range(2):
        span = module.dilation[i] * (module.kernel_size[i] - 1) + 1
        sizes.append((x.shape[2 + i] + 2 * padding[i] - span) // module.stride[i] + 1)
    return sizes[0], sizes[1]


def locations(module: nn.Module, g: torch.Tensor) -> int:
    """Output locations per sample L (1 for Linear), from the output gradient."""
    if isinstance(module, nn.Conv2d):
        return g.shape[-1] * g.shape[-2]
    return 1


def _unfold(module: nn.Conv2d, x: torch.Tensor, padding) -> torch.Tensor:
    """Patches [b, C*kh*kw, L] of a padded batch chunk."""
    return F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding,
                    stride=module.stride)


def input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows a [groups, N, d_in] (no bias column). Conv2d materialises the whole unfold: use
    `input_covariance` when only the covariance is needed."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1]).unsqueeze(0)
    x, padding = _conv_input(module, x)
    p = _unfold(module, x, padding)  # [B, C*kh*kw, L]
    g = module.groups
    b, _, L = p.shape
    return p.view(b, g, -1, L).permute(1, 0, 3, 2).reshape(g, b * L, -1)


def grad_rows(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """The rows g [groups, N, d_out / groups] of an output gradient."""
    if isinstance(module, nn.Linear):
        return g.reshape(-1, g.shape[-1]).unsqueeze(0)
    if g.dim() == 3:
        g = g.unsqueeze(0)
    groups = module.groups
    return g.permute(0, 2, 3, 1).reshape(-1, groups, g.shape[1] // groups).transpose(0, 1)


def _accumulate_block(out, rows_t, scale, first, bias):
    """out[:, :d, :d] (+)= scale * rows_t rows_t^T and the bias row/column from row sums;
    rows_t is [groups, d, n]."""
    d, n = rows_t.shape[1], rows_t.shape[2]
    block = out[:, :d, :d]
    block.baddbmm_(rows_t, rows_t.transpose(1, 2), beta=0.0 if first else 1.0, alpha=scale)
    if bias:
        sums = rows_t.sum(dim=2).mul_(scale)
        if first:
            out[:, :d, d].copy_(sums)
            out[:, d, :d].copy_(sums)
            out[:, d, d].fill_(scale * n)
        else:
            out[:, :d, d].add_(sums)
            out[:, d, :d].add_(sums)
            out[:, d, d].add_(scale * n)


def input_covariance(module: nn.Module, x: torch.Tensor, *, scale: float = 1.0,
                     bias: bool | None = None, out: torch.Tensor | None = None,
                     accumulate: bool = False, dtype: torch.dtype | None = None,
                     chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """scale * sum_n abar abar^T as [groups, d_a, d_a] (abar = [a; 1] when `bias`, default: the
    layer has one), written into `out` (added to it when `accumulate`). Computed in `dtype`
    (default: out's, else x's). Conv2d patches are unfolded at most `chunk_bytes` at a time."""
    bias = module.bias is not None if bias is None else bias
    dtype = dtype or (out.dtype if out is not None else x.dtype)
    groups, _, _ = factor_sizes(module)
    if isinstance(module, nn.Linear):
        d = x.shape[-1]
        rows_t = x.reshape(-1, d).to(dtype).t().unsqueeze(0)
        chunks = [rows_t]
    else:
        xp, padding = _conv_input(module, x)
        d = module.in_channels // groups * module.kernel_size[0] * module.kernel_size[1]
        oh, ow = _out_size(module, xp, padding)
        per_sample = max(1, module.in_channels * module.kernel_size[0] * module.kernel_size[1]
                         * oh * ow * torch.empty((), dtype=dtype).element_size())
        step = max(1, chunk_bytes // per_sample)

        def conv_chunks():
            for s in range(0, xp.shape[0], step):
                p = _unfold(module, xp[s:s + step].to(dtype), padding)  # [b, groups*d, L]
                b, _, L = p.shape
                yield p.view(b, groups, d, L).permute(1, 2, 0, 3).reshape(groups, d, b * L)
        chunks = conv_chunks()
    size = d + bias
    if out is None:
        out = torch.zeros(groups, size, size, dtype=dtype, device=x.device)
        accumulate = True  # zeros are as good as a first write
    elif tuple(out.shape) != (groups, size, size):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(groups, size, size)}")
    first = not accumulate
    for rows_t in chunks:
        _accumulate_block(out, rows_t, scale, first, bias)
        first = False
    if first:  # no rows at all
        out.zero_()
    return out


def grad_covariance(module: nn.Module, g: torch.Tensor, *, scale: float = 1.0,
                    out: torch.Tensor | None = None, accumulate: bool = False,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """scale * sum_n g g^T as [groups, d_g, d_g], written into (or added to) `out`."""
    dtype = dtype or (out.dtype if out is not None else g.dtype)
    if isinstance(module, nn.Linear):
        rows_t = g.reshape(-1, g.shape[-1]).to(dtype).t().unsqueeze(0)
    else:
        if g.dim() == 3:
            g = g.unsqueeze(0)
        groups = module.groups
        rows_t = g.to(dtype).transpose(0, 1).reshape(groups, g.shape[1] // groups, -1)
    if out is None:
        return torch.bmm(rows_t, rows_t.transpose(1, 2)).mul_(scale)
    out.baddbmm_(rows_t, rows_t.transpose(1, 2), beta=1.0 if accumulate else 0.0, alpha=scale)
    return out


# --------------------------------------------------------------- kfac-pytorch's normalisation
def _rows_and_locations(module, t, from_grad):
    if isinstance(module, nn.Linear):
        return t.numel() // t.shape[-1], 1
    if from_grad:
        L = t.shape[-1] * t.shape[-2]
        batch = t.shape[0] if t.dim() == 4 else 1
        return batch * L, L
    xp, padding = _conv_input(module, t)
    oh, ow = _out_size(module, xp, padding)
    return xp.shape[0] * oh * ow, oh * ow


def kfac_input_factor(module, x, **kwargs) -> torch.Tensor:
    """A as kfac-pytorch takes it: the patches (bias one appended) divided by L, then the
    second moment over the N = B*L rows, i.e. sum abar abar^T / (L^2 N)."""
    n, L = _rows_and_locations(module, x, False)
    return input_covariance(module, x, scale=1.0 / (L * L * max(n, 1)), **kwargs)


def kfac_grad_factor(module, g, **kwargs) -> torch.Tensor:
    """G as kfac-pytorch takes it: grad_output rows divided by L, second moment over the N rows,
    i.e. sum g g^T / (L^2 N), with no batch-size rescaling."""
    n, L = _rows_and_locations(module, g, True)
    return grad_covariance(module, g, scale=1.0 / (L * L * max(n, 1)), **kwargs)


# --------------------------------------------------------------- gradients as matrices
def grad_matrix(module: nn.Module, weight_grad: torch.Tensor,
                bias_grad: torch.Tensor | None) -> torch.Tensor:
    """[groups, d_g, d_a]: the weight gradient per group with the bias gradient as last column."""
    groups, _, d_g = factor_sizes(module)
    w = weight_grad.reshape(groups, d_g, -1)
    if bias_grad is None:
        return w
    return torch.cat([w, bias_grad.reshape(groups, d_g, 1)], dim=2)


def write_grad_matrix(module: nn.Module, matrix: torch.Tensor, weight_grad: torch.Tensor,
                      bias_grad: torch.Tensor | None) -> None:
    """Copy a [groups, d_g, d_a] matrix back into the weight (and bias) gradients in place."""
    groups, _, d_g = factor_sizes(module)
    d_w = weight_grad.numel() // (groups * d_g)
    weight_grad.copy_(matrix[:, :, :d_w].reshape(weight_grad.shape))
    if bias_grad is not None:
        bias_grad.copy_(matrix[:, :, d_w].reshape(bias_grad.shape))
