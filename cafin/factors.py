"""Dense Kronecker statistics of Linear, Conv1d/2d/3d and Embedding layers (and transformers'
`Conv1D`, a Linear with a transposed weight), for the members that keep dense or structured
factors (K-FAC, two-level K-FAC, SINGD).

A layer's weight gradient, viewed as matrices, is per group q

    dW_q = sum_n g[q, n] abar[q, n]^T,    abar = [a; 1] when the layer has a bias,

with rows a [groups, N, d_in] and g [groups, N, d_out] (groups = 1 but for grouped
convolutions). Linear takes any leading dims (N = their product); a convolution takes the patches
of its input, entry order (c, k_1, ..., k_n) as `weight[o].flatten()`, with stride, padding
('same', 'valid', asymmetric, non-zero modes), dilation and groups, one row per output location.
What each layer type is (its rows, patches, padding, sizes, which side of its weight is stored
transposed) is its view's (`cafin.core.views`); this module adds K-FAC's covariances and scalings.

An Embedding's rows a are one-hot (out = onehot(x) W, W [num_embeddings, dim]): its A is diagonal,
kept as the vector of token counts, never as a vocabulary-sized matrix. Its weight gradient is
[vocab, dim] = (input side) x (gradient side), the transpose of Linear's [out, in]; the
gradient matrix of every layer is [groups, d_g, d_a] (`grad_matrix`), so an Embedding's and a
`Conv1D`'s are the transposes of their weight gradients (`weight_grad_view`).

Covariances never hold the whole unfold of a convolution input: patches are unfolded a few samples
at a time and accumulated with batched GEMMs, and the bias row/column of A comes from row sums
(the corner is the row count), never from a column of ones appended to the rows.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .core.views import view_of

# Bytes of unfolded patches one chunk may hold (per covariance call).
CHUNK_BYTES = 32 << 20

# The two K-FAC approximations of a layer applied at several locations of one sample (a Linear on
# [B, T, D], a convolution): "expand" takes one row per location, "reduce" one per sample.
KFAC_APPROXIMATIONS = ("expand", "reduce")

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

__all__ = [
    "supports", "is_conv", "diagonal_input", "groups_of", "locations", "factor_sizes",
    "input_rows", "grad_rows", "input_covariance", "grad_covariance",
    "kfac_input_factor", "kfac_grad_factor", "grad_matrix", "write_grad_matrix",
    "weight_grad_view", "weight_is_transposed", "unsupported_option", "KFAC_APPROXIMATIONS",
]


def _view(module: nn.Module):
    view = view_of(module)
    if view is None or not view.kronecker:
        raise TypeError(f"no dense statistics for {type(module).__name__}")
    return view


def supports(module: nn.Module) -> bool:
    view = view_of(module)
    return view is not None and view.kronecker


def is_conv(module: nn.Module) -> bool:
    view = view_of(module)
    return view is not None and view.conv


def _linear_like(module: nn.Module) -> bool:
    view = view_of(module)
    return view is not None and view.kronecker and not view.conv and not view.diagonal_input


def diagonal_input(module: nn.Module) -> bool:
    """Whether the layer's A is diagonal and kept as a vector [groups, d_a] (Embedding)."""
    view = view_of(module)
    return view is not None and view.diagonal_input


def _bias(module: nn.Module) -> bool:
    return getattr(module, "bias", None) is not None


def unsupported_option(module: nn.Module) -> str | None:
    """Why the layer's K-FAC statistics would be wrong (an option the factors do not model), or
    None. An Embedding with max_norm rescales rows of its weight in the forward pass, one with
    scale_grad_by_freq divides its gradient rows by the batch's token counts (no Kronecker form),
    and one with sparse=True has sparse gradients."""
    if isinstance(module, nn.Embedding):
        for option in ("max_norm", "sparse", "scale_grad_by_freq"):
            value = getattr(module, option)
            if value is not None and value is not False:
                return f"Embedding with {option}={value!r}"
    return None


def groups_of(module: nn.Module) -> int:
    return module.groups if is_conv(module) else 1


def factor_sizes(module: nn.Module) -> tuple[int, int, int]:
    """(groups, d_a, d_g): A is [groups, d_a, d_a] (bias column included; [groups, d_a] when
    `diagonal_input`), G [groups, d_g, d_g]."""
    return _view(module).sizes(module)


def locations(module: nn.Module, g: torch.Tensor) -> int:
    """Output locations per sample L (1 for Linear and Embedding), from the output gradient."""
    return _view(module).locations(module, g)


def input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows a [groups, N, d_in] (no bias column; one-hot rows for an Embedding). A
    convolution materialises the whole unfold: use `input_covariance` when only the covariance
    is needed."""
    return _view(module).input_rows(module, x)


def grad_rows(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """The rows g [groups, N, d_out / groups] of an output gradient."""
    return _view(module).grad_rows(module, g)


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


def _reduced_input(module: nn.Module, x: torch.Tensor, dtype, chunk_bytes):
    """The input rows averaged over each sample's shared locations, [groups, d, B] (Linear: over
    every dim between the first and the last; a convolution: over its output locations)."""
    view = _view(module)
    if not view.conv:
        return view.sample_rows(module, x).to(dtype).mean(1).t().unsqueeze(0)
    means = [p.mean(3) for p in view.patch_chunks(module, x, dtype, chunk_bytes)]  # [b, g, d]
    return torch.cat(means).permute(1, 2, 0)


def input_covariance(module: nn.Module, x: torch.Tensor, *, scale: float = 1.0,
                     bias: bool | None = None, out: torch.Tensor | None = None,
                     accumulate: bool = False, dtype: torch.dtype | None = None,
                     chunk_bytes: int = CHUNK_BYTES, approx: str = "expand") -> torch.Tensor:
    """scale * sum_n abar abar^T as [groups, d_a, d_a] (abar = [a; 1] when `bias`, default: the
    layer has one), written into `out` (added to it when `accumulate`). Computed in `dtype`
    (default: out's, else x's). Convolution patches are unfolded at most `chunk_bytes` at a time.
    An Embedding's is the diagonal only, scale * token counts as [1, num_embeddings] (default
    dtype: the weight's).
    `approx="reduce"` takes one row per sample, its rows' mean over the shared locations."""
    bias = _bias(module) if bias is None else bias
    view = _view(module)
    if view.diagonal_input:  # x holds indices: the counts take the weight's dtype
        dtype = dtype or (out.dtype if out is not None else module.weight.dtype)
        counts = view.token_counts(module, x, dtype).mul_(scale).unsqueeze(0)
        if out is None:
            return counts
        if tuple(out.shape) != tuple(counts.shape):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(counts.shape)}")
        return out.add_(counts) if accumulate else out.copy_(counts)
    dtype = dtype or (out.dtype if out is not None else x.dtype)
    groups, _, _ = view.sizes(module)
    if approx == "reduce":
        rows_t = _reduced_input(module, x, dtype, chunk_bytes)
        d = rows_t.shape[1]
        chunks = [rows_t]
    elif not view.conv:
        d = x.shape[-1]
        rows_t = x.reshape(-1, d).to(dtype).t().unsqueeze(0)
        chunks = [rows_t]
    else:
        d = view.patch_size(module)
        chunks = (p.permute(1, 2, 0, 3).reshape(groups, d, -1)
                  for p in view.patch_chunks(module, x, dtype, chunk_bytes))
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
                    dtype: torch.dtype | None = None, approx: str = "expand") -> torch.Tensor:
    """scale * sum_n g g^T as [groups, d_g, d_g], written into (or added to) `out`.
    `approx="reduce"` takes one row per sample, its rows' sum over the shared locations (an
    Embedding's rows are always expanded)."""
    dtype = dtype or (out.dtype if out is not None else g.dtype)
    view = _view(module)
    if not view.conv:
        if approx == "reduce" and not view.diagonal_input:
            g = view.sample_rows(module, g.to(dtype)).sum(1)
        rows_t = g.reshape(-1, g.shape[-1]).to(dtype).t().unsqueeze(0)
    else:
        g = view.batched(g)
        groups = module.groups
        if approx == "reduce":
            g = g.to(dtype).flatten(2).sum(2)  # [B, C_out]
            rows_t = g.t().reshape(groups, g.shape[1] // groups, -1)
        else:
            rows_t = g.to(dtype).transpose(0, 1).reshape(groups, g.shape[1] // groups, -1)
    if out is None:
        return torch.bmm(rows_t, rows_t.transpose(1, 2)).mul_(scale)
    out.baddbmm_(rows_t, rows_t.transpose(1, 2), beta=1.0 if accumulate else 0.0, alpha=scale)
    return out


# --------------------------------------------------------------- kfac-pytorch's normalisation
def _rows_and_locations(module, t, from_grad):
    """(N, L): expanded rows and output locations per sample."""
    view = _view(module)
    if view.diagonal_input and not from_grad:
        return t.numel(), 1
    if not view.conv:
        return t.numel() // t.shape[-1], 1
    if from_grad:
        L = view.locations(module, t)
        return view.batched(t).shape[0] * L, L
    batch, L = view.input_locations(module, t)
    return batch * L, L


def _shared(module, t) -> int:
    """Rows that "reduce" merges into one per sample: T of a Linear on [B, T, D] (the product of
    the dims between the first and the last), L of a convolution."""
    if is_conv(module):
        return _rows_and_locations(module, t, False)[1]
    if t.dim() <= 2:
        return 1
    return math.prod(t.shape[1:-1])


def kfac_input_factor(module, x, approx: str = "expand", **kwargs) -> torch.Tensor:
    """A as kfac-pytorch takes it: the patches (bias one appended) divided by L, then the
    second moment over the N = B*L rows, i.e. sum abar abar^T / (L^2 N); an Embedding's the
    token counts / N (its diagonal). `approx="reduce"` replaces each sample's T shared rows by
    their mean and multiplies by T (Linear: the mean of abar abar^T over the B samples), so that
    expand and reduce relate as in Eschenhagen et al. (2023); equal to expand when T = 1."""
    n, L = _rows_and_locations(module, x, False)
    scale = 1.0 / (L * L * max(n, 1))
    if approx == "reduce" and not diagonal_input(module):
        return input_covariance(module, x, scale=scale * _shared(module, x), approx=approx, **kwargs)
    return input_covariance(module, x, scale=scale, **kwargs)


def kfac_grad_factor(module, g, approx: str = "expand", **kwargs) -> torch.Tensor:
    """G as kfac-pytorch takes it: grad_output rows divided by L, second moment over the N rows,
    i.e. sum g g^T / (L^2 N), with no batch-size rescaling. `approx="reduce"` replaces each
    sample's shared rows by their sum, with the same divisor."""
    n, L = _rows_and_locations(module, g, True)
    return grad_covariance(module, g, scale=1.0 / (L * L * max(n, 1)), approx=approx, **kwargs)


# --------------------------------------------------------------- gradients as matrices
def weight_is_transposed(module: nn.Module) -> bool:
    """Whether the weight is stored [input side, gradient side]: an Embedding's [vocab, dim], a
    `Conv1D`'s [in, out]."""
    view = view_of(module)
    return view is not None and view.transposed


def weight_grad_view(module: nn.Module, weight_grad: torch.Tensor) -> torch.Tensor:
    """The weight gradient oriented [gradient side, input side] as a view: the transpose of a
    weight stored [input side, gradient side] (`weight_is_transposed`), the gradient itself
    otherwise."""
    view = view_of(module)
    return weight_grad if view is None else view.weight_view(module, weight_grad)


def grad_matrix(module: nn.Module, weight_grad: torch.Tensor,
                bias_grad: torch.Tensor | None) -> torch.Tensor:
    """[groups, d_g, d_a]: the weight gradient per group with the bias gradient as last column."""
    return _view(module).grad_matrix(module, weight_grad, bias_grad)


def grad_matrix_destinations(module: nn.Module, out: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Views of a [groups, d_g, d_a] gradient matrix `out` that the weight gradient (in the
    weight's own shape and orientation: a transposed view for a weight stored transposed) and
    the bias gradient (None without a bias) copy into: `grad_matrix_into` with the views made
    once. `out` needs rows of equal stride (a row-aligned buffer's are)."""
    groups, _, d_g = factor_sizes(module)
    d_w = out.shape[2] - _bias(module)
    bias = out[:, :, d_w].view(groups * d_g) if _bias(module) else None
    if weight_is_transposed(module):
        return out[:, :, :d_w].view(tuple(module.weight.shape)[::-1]).t(), bias
    return out[:, :, :d_w].view(tuple(module.weight.shape)), bias


def grad_matrix_into(module: nn.Module, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None,
                     out: torch.Tensor) -> torch.Tensor:
    """`grad_matrix` copied into `out` [groups, d_g, d_a] (any strides and dtype), no allocation."""
    groups, _, d_g = factor_sizes(module)
    d_w = out.shape[2] - (bias_grad is not None)
    out[:, :, :d_w].copy_(weight_grad_view(module, weight_grad).reshape(groups, d_g, d_w))
    if bias_grad is not None:
        out[:, :, d_w].copy_(bias_grad.reshape(groups, d_g))
    return out


def write_grad_matrix(module: nn.Module, matrix: torch.Tensor, weight_grad: torch.Tensor,
                      bias_grad: torch.Tensor | None) -> None:
    """Copy a [groups, d_g, d_a] matrix back into the weight (and bias) gradients in place."""
    groups, _, d_g = factor_sizes(module)
    d_w = weight_grad.numel() // (groups * d_g)
    view = weight_grad_view(module, weight_grad)
    view.copy_(matrix[:, :, :d_w].reshape(view.shape))
    if bias_grad is not None:
        bias_grad.copy_(matrix[:, :, d_w].reshape(bias_grad.shape))
