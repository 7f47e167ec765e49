"""Dense Kronecker statistics of Linear, Conv1d/2d/3d and Embedding layers (and transformers'
`Conv1D`, a Linear with a transposed weight), for the members that keep dense or structured
factors (K-FAC, two-level K-FAC, SINGD).

A layer's weight gradient, viewed as matrices, is per group q

    dW_q = sum_n g[q, n] abar[q, n]^T,    abar = [a; 1] when the layer has a bias,

with rows a [groups, N, d_in] and g [groups, N, d_out] (groups = 1 but for grouped
convolutions). Linear takes any leading dims (N = their product); a convolution takes the patches
of its input, entry order (c, k_1, ..., k_n) as `weight[o].flatten()`, with stride, padding
('same', 'valid', asymmetric, non-zero modes), dilation and groups, one row per output location.
Conv2d unfolds with `F.unfold`; Conv1d and Conv3d with strided views of the padded input.

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
import torch.nn.functional as F
from torch import nn

from .core.modules import is_transposed_linear
from .layers import conv_padding

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


def supports(module: nn.Module) -> bool:
    return (isinstance(module, (nn.Linear, nn.Embedding) + _CONVS)
            or is_transposed_linear(module))


def is_conv(module: nn.Module) -> bool:
    return isinstance(module, _CONVS)


def _linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


def diagonal_input(module: nn.Module) -> bool:
    """Whether the layer's A is diagonal and kept as a vector [groups, d_a] (Embedding)."""
    return isinstance(module, nn.Embedding)


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
    bias = _bias(module)
    if isinstance(module, nn.Linear):
        return 1, module.in_features + bias, module.out_features
    if is_transposed_linear(module):
        return 1, module.nx + bias, module.nf
    if isinstance(module, nn.Embedding):
        return 1, module.num_embeddings, module.embedding_dim
    if is_conv(module):
        g = module.groups
        d = module.in_channels // g * math.prod(module.kernel_size)
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


def _padded_nd(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Conv1d/Conv3d input batched and padded as the convolution pads it ('same' puts the odd
    one at the end, as torch does; non-zero modes honoured)."""
    if x.dim() == len(module.kernel_size) + 1:  # unbatched
        x = x.unsqueeze(0)
    pads = list(module._reversed_padding_repeated_twice)
    if not any(pads):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pads, mode=mode)


def _out_size_nd(module: nn.Module, xp: torch.Tensor) -> list[int]:
    return _out_sizes(module, xp.shape[2:])


def _out_sizes(module: nn.Module, padded: list[int]) -> list[int]:
    """Output sizes of a convolution over padded spatial sizes."""
    return [(s - module.dilation[i] * (k - 1) - 1) // module.stride[i] + 1
            for i, (s, k) in enumerate(zip(padded, module.kernel_size))]


def _patches_nd(module: nn.Module, xp: torch.Tensor) -> torch.Tensor:
    """Patches [b, C * prod(k), L] of a padded Conv1d/Conv3d batch chunk, entry order
    (c, k_1, ..., k_n), locations in row-major output order (what F.unfold gives for Conv2d)."""
    p = xp
    for i, k in enumerate(module.kernel_size):  # one strided window per spatial dim, no copy
        p = p.unfold(2 + i, module.dilation[i] * (k - 1) + 1, module.stride[i])
    n = len(module.kernel_size)
    p = p[(Ellipsis,) + tuple(slice(None, None, d) for d in module.dilation)]  # the dilated taps
    # [b, C, o_1..o_n, k_1..k_n] -> [b, C, k_1..k_n, o_1..o_n]
    p = p.permute(0, 1, *range(2 + n, 2 + 2 * n), *range(2, 2 + n))
    return p.reshape(p.shape[0], -1, math.prod(p.shape[2 + n:]))


def locations(module: nn.Module, g: torch.Tensor) -> int:
    """Output locations per sample L (1 for Linear and Embedding), from the output gradient."""
    if is_conv(module):
        return math.prod(g.shape[g.dim() - len(module.kernel_size):])
    return 1


def _unfold(module: nn.Conv2d, x: torch.Tensor, padding) -> torch.Tensor:
    """Patches [b, C*kh*kw, L] of a padded batch chunk."""
    return F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding,
                    stride=module.stride)


def _patch_chunks(module: nn.Module, x: torch.Tensor, dtype: torch.dtype, chunk_bytes: int):
    """The patches of a convolution input, a few samples at a time, as [b, groups, d, L]."""
    groups = module.groups
    d = module.in_channels // groups * math.prod(module.kernel_size)
    if isinstance(module, nn.Conv2d):
        xp, padding = _conv_input(module, x)
        L = math.prod(_out_size(module, xp, padding))
        extract = lambda chunk: _unfold(module, chunk, padding)  # noqa: E731
    else:
        xp = _padded_nd(module, x)
        L = math.prod(_out_size_nd(module, xp))
        extract = lambda chunk: _patches_nd(module, chunk)  # noqa: E731
    per_sample = max(1, groups * d * L * torch.empty((), dtype=dtype).element_size())
    step = max(1, chunk_bytes // per_sample)
    for s in range(0, xp.shape[0], step):
        p = extract(xp[s:s + step].to(dtype))  # [b, groups*d, L]
        yield p.view(p.shape[0], groups, d, p.shape[2])


def _token_counts(module: nn.Embedding, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[num_embeddings] how often each token occurs in x; padding_idx tokens are not counted
    (their row of the weight gets no gradient: the input they give the weight's gradient is 0)."""
    idx = x.reshape(-1)
    if module.padding_idx is not None:
        idx = idx[idx != module.padding_idx]
    counts = torch.zeros(module.num_embeddings, dtype=dtype, device=x.device)
    return counts.index_add_(0, idx, torch.ones(idx.shape, dtype=dtype, device=x.device))


def input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows a [groups, N, d_in] (no bias column; one-hot rows for an Embedding). A
    convolution materialises the whole unfold: use `input_covariance` when only the covariance
    is needed."""
    if _linear_like(module):
        return x.reshape(-1, x.shape[-1]).unsqueeze(0)
    if isinstance(module, nn.Embedding):
        rows = F.one_hot(x.reshape(-1), module.num_embeddings).to(module.weight.dtype)
        if module.padding_idx is not None:
            rows[:, module.padding_idx] = 0
        return rows.unsqueeze(0)
    if not isinstance(module, nn.Conv2d):
        p = torch.cat(list(_patch_chunks(module, x, x.dtype, 1 << 62)))  # [B, g, d, L]
        return p.permute(1, 0, 3, 2).reshape(module.groups, -1, p.shape[2])
    x, padding = _conv_input(module, x)
    p = _unfold(module, x, padding)  # [B, C*kh*kw, L]
    g = module.groups
    b, _, L = p.shape
    return p.view(b, g, -1, L).permute(1, 0, 3, 2).reshape(g, b * L, -1)


def grad_rows(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """The rows g [groups, N, d_out / groups] of an output gradient."""
    if not is_conv(module):
        return g.reshape(-1, g.shape[-1]).unsqueeze(0)
    if g.dim() == len(module.kernel_size) + 1:
        g = g.unsqueeze(0)
    groups = module.groups
    g = g.flatten(2)
    return g.permute(0, 2, 1).reshape(-1, groups, g.shape[1] // groups).transpose(0, 1)


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
    if _linear_like(module):
        if x.dim() == 1:
            x = x.unsqueeze(0)
        return x.reshape(x.shape[0], -1, x.shape[-1]).to(dtype).mean(1).t().unsqueeze(0)
    means = [p.mean(3) for p in _patch_chunks(module, x, dtype, chunk_bytes)]  # [b, g, d]
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
    if isinstance(module, nn.Embedding):  # x holds indices: the counts take the weight's dtype
        dtype = dtype or (out.dtype if out is not None else module.weight.dtype)
        counts = _token_counts(module, x, dtype).mul_(scale).unsqueeze(0)
        if out is None:
            return counts
        if tuple(out.shape) != tuple(counts.shape):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(counts.shape)}")
        return out.add_(counts) if accumulate else out.copy_(counts)
    dtype = dtype or (out.dtype if out is not None else x.dtype)
    groups, _, _ = factor_sizes(module)
    if approx == "reduce":
        rows_t = _reduced_input(module, x, dtype, chunk_bytes)
        d = rows_t.shape[1]
        chunks = [rows_t]
    elif _linear_like(module):
        d = x.shape[-1]
        rows_t = x.reshape(-1, d).to(dtype).t().unsqueeze(0)
        chunks = [rows_t]
    else:
        d = module.in_channels // groups * math.prod(module.kernel_size)
        chunks = (p.permute(1, 2, 0, 3).reshape(groups, d, -1)
                  for p in _patch_chunks(module, x, dtype, chunk_bytes))
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
    if not is_conv(module):
        if approx == "reduce" and _linear_like(module):
            if g.dim() == 1:
                g = g.unsqueeze(0)
            g = g.to(dtype).reshape(g.shape[0], -1, g.shape[-1]).sum(1)
        rows_t = g.reshape(-1, g.shape[-1]).to(dtype).t().unsqueeze(0)
    else:
        if g.dim() == len(module.kernel_size) + 1:
            g = g.unsqueeze(0)
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
    if isinstance(module, nn.Embedding) and not from_grad:
        return t.numel(), 1
    if not is_conv(module):
        return t.numel() // t.shape[-1], 1
    n = len(module.kernel_size)
    if from_grad:
        L = math.prod(t.shape[t.dim() - n:])
        batch = t.shape[0] if t.dim() == n + 2 else 1
        return batch * L, L
    if isinstance(module, nn.Conv2d):
        xp, padding = _conv_input(module, t)
        oh, ow = _out_size(module, xp, padding)
        return xp.shape[0] * oh * ow, oh * ow
    batch = t.shape[0] if t.dim() == n + 2 else 1
    pads = module._reversed_padding_repeated_twice  # the last dim's pair first
    padded = [s + pads[2 * (n - 1 - i)] + pads[2 * (n - 1 - i) + 1]
              for i, s in enumerate(t.shape[t.dim() - n:])]
    L = math.prod(_out_sizes(module, padded))
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
    if approx == "reduce" and not isinstance(module, nn.Embedding):
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
    return isinstance(module, nn.Embedding) or is_transposed_linear(module)


def weight_grad_view(module: nn.Module, weight_grad: torch.Tensor) -> torch.Tensor:
    """The weight gradient oriented [gradient side, input side] as a view: the transpose of a
    weight stored [input side, gradient side] (`weight_is_transposed`), the gradient itself
    otherwise."""
    return weight_grad.t() if weight_is_transposed(module) else weight_grad


def grad_matrix(module: nn.Module, weight_grad: torch.Tensor,
                bias_grad: torch.Tensor | None) -> torch.Tensor:
    """[groups, d_g, d_a]: the weight gradient per group with the bias gradient as last column."""
    groups, _, d_g = factor_sizes(module)
    w = weight_grad_view(module, weight_grad).reshape(groups, d_g, -1)
    if bias_grad is None:
        return w
    return torch.cat([w, bias_grad.reshape(groups, d_g, 1)], dim=2)


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
