"""One view per module type: what the members' statistics know of a layer, said once.

A layer the Kronecker members precondition computes, per group q of its G groups,

    out_q = W_q abar_q,    abar = [a; 1] when the layer has a bias,

with input rows a [groups, N, d_in] and output-gradient rows g [groups, N, d_g], so that its
weight gradient as a matrix is dW_q = sum_n g[q, n] abar[q, n]^T, [groups, d_g, d_a] (gradient
side by input side, the bias gradient as the last column). A view says, for its module type:

- `transposed`: whether the weight is stored [input side, gradient side] (an Embedding's
  [num_embeddings, dim], transformers' Conv1D's [in, out]) instead of Linear's [out, in];
- `sizes(module)`: (groups, d_a with the bias column, d_g);
- `input_rows(module, x)` and `grad_rows(module, g)`: the rows above (a convolution's input rows
  are its patches: entry order (c, k_1, ..., k_n) as `weight[o].flatten()`, one row per output
  location, stride, padding ('same', 'valid', asymmetric, non-zero modes), dilation and groups);
- `sample_rows(module, t)`: a Linear-like input or any output gradient as [samples, locations,
  features] (a view where torch can make one);
- `weight_view(module, w)` / `grad_matrix(module, w, b)`: the weight gradient oriented [gradient
  side, input side] (a view), and the whole gradient as [groups, d_g, d_a].

A convolution view adds the padding facts (`padding_pairs`, `padded`, `patches`, `out_sizes`).
BatchNorm and LayerNorm scale each feature by its weight: their gradient as a matrix is [features,
1 (+1)] and their rows are not a Kronecker statistic (`kronecker` False); AdaFisher alone takes
their statistics (its published 2-vector). `view_of(module)` finds a module's view (None when
there is none). Nothing here holds state: a member keeps what it computes from the view (and
hands `gradient_matrices_into` the dict of buffers it keeps).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["View", "LinearView", "TransposedLinearView", "ConvView", "EmbeddingView",
           "BatchNormView", "LayerNormView", "VIEWS", "view_of", "view_named", "is_transposed_linear",
           "gradient_matrices_into"]


def is_transposed_linear(module: nn.Module) -> bool:
    """A `transformers.pytorch_utils.Conv1D` (GPT-2's projections): a Linear whose weight is stored
    transposed, [in_features, out_features], computing x @ weight + bias.

    Recognised by its shape contract (a class named `Conv1D` among the module's classes, so that
    subclasses and FSDP2's generated `FSDPConv1D` count; attributes `nx` = in and `nf` = out; a
    weight of shape [nx, nf]) so that `transformers` is never imported."""
    if all(cls.__name__ != "Conv1D" for cls in type(module).__mro__):
        return False
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return (isinstance(weight, nn.Parameter) and isinstance(nx, int) and isinstance(nf, int)
            and tuple(weight.shape) == (nx, nf))


class View:
    """The facts of one module type (see the module docstring); the base is a Linear on one
    location per row."""
    label = ""
    module_type: type = nn.Module
    transposed = False      # weight stored [input side, gradient side]
    kronecker = True        # its weight gradient is sum_n g abar^T over rows of its input
    diagonal_input = False  # its input rows are one-hot: A is diagonal, kept as a vector
    conv = False

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, self.module_type)

    @staticmethod
    def has_bias(module: nn.Module) -> bool:
        return getattr(module, "bias", None) is not None

    def sizes(self, module: nn.Module) -> tuple[int, int, int]:
        """(groups, d_a, d_g): A is [groups, d_a, d_a] with the bias column, G [groups, d_g, d_g]."""
        raise NotImplementedError

    def sample_rows(self, module: nn.Module, t: torch.Tensor) -> torch.Tensor:
        """[samples, locations, features] of a tensor whose last dim is the features (a 1-dim
        tensor is one sample at one location); the dims between the first and the last are the
        locations."""
        if t.dim() == 1:
            return t.reshape(1, 1, t.shape[0])
        return t.reshape(t.shape[0], -1, t.shape[-1])

    def locations(self, module: nn.Module, g: torch.Tensor) -> int:
        """Output locations per sample L that share the weight within one row set (1 but for a
        convolution), from the output gradient."""
        return 1

    def input_rows(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The rows a [groups, N, d_in], no bias column."""
        return x.reshape(-1, x.shape[-1]).unsqueeze(0)

    def grad_rows(self, module: nn.Module, g: torch.Tensor) -> torch.Tensor:
        """The rows g [groups, N, d_g] of an output gradient."""
        return g.reshape(-1, g.shape[-1]).unsqueeze(0)

    def weight_view(self, module: nn.Module, weight_grad: torch.Tensor) -> torch.Tensor:
        """The weight gradient oriented [gradient side, input side...] as a view: the transpose
        of a weight stored transposed, the gradient itself otherwise."""
        return weight_grad.t() if self.transposed else weight_grad

    def weight_matrix(self, module: nn.Module, weight_grad: torch.Tensor) -> torch.Tensor:
        """The weight gradient as [out, in] (all groups' rows stacked; a view where it can be)."""
        if self.transposed:
            return weight_grad.t()
        return weight_grad.reshape(weight_grad.shape[0], -1)

    def grad_matrix(self, module: nn.Module, weight_grad: torch.Tensor,
                    bias_grad: torch.Tensor | None) -> torch.Tensor:
        """[groups, d_g, d_a]: the weight gradient per group with the bias gradient as last column."""
        groups, _, d_g = self.sizes(module)
        w = self.weight_view(module, weight_grad).reshape(groups, d_g, -1)
        if bias_grad is None:
            return w
        return torch.cat([w, bias_grad.reshape(groups, d_g, 1)], dim=2)


class LinearView(View):
    label, module_type = "Linear", nn.Linear

    def sizes(self, module):
        return 1, module.in_features + self.has_bias(module), module.out_features


class TransposedLinearView(View):
    """transformers' Conv1D: a Linear with its weight stored [in, out] (`is_transposed_linear`);
    its bias stays on the gradient side, [out], as Linear's."""
    label, transposed = "Conv1D", True

    def accepts(self, module):
        return is_transposed_linear(module)

    def sizes(self, module):
        return 1, module.nx + self.has_bias(module), module.nf


class EmbeddingView(View):
    """A Linear without bias on one-hot inputs, its weight stored [num_embeddings, dim]. A
    position holding padding_idx is a zero row: its row of the weight gets no gradient."""
    label, module_type, transposed, diagonal_input = "Embedding", nn.Embedding, True, True

    def sizes(self, module):
        return 1, module.num_embeddings, module.embedding_dim

    def input_rows(self, module, x):
        rows = F.one_hot(x.reshape(-1), module.num_embeddings).to(module.weight.dtype)
        if module.padding_idx is not None:
            rows[:, module.padding_idx] = 0
        return rows.unsqueeze(0)

    def token_counts(self, module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[num_embeddings] how often each token occurs in x, padding_idx not counted: the
        diagonal of sum_n a a^T."""
        idx = x.reshape(-1)
        if module.padding_idx is not None:
            idx = idx[idx != module.padding_idx]
        counts = torch.zeros(module.num_embeddings, dtype=dtype, device=x.device)
        return counts.index_add_(0, idx, torch.ones(idx.shape, dtype=dtype, device=x.device))


class ConvView(View):
    """Conv1d, Conv2d or Conv3d (`dims` spatial dims); rows are patches, one per output location."""
    conv = True

    def __init__(self, dims: int):
        self.dims = dims
        self.module_type = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.label = self.module_type.__name__

    def patch_size(self, module) -> int:
        """d_in of one group: C_in / groups * prod(kernel)."""
        return module.in_channels // module.groups * math.prod(module.kernel_size)

    def sizes(self, module):
        g = module.groups
        return g, self.patch_size(module) + self.has_bias(module), module.out_channels // g

    # ------------------------------------------------------------------------ padding
    def batched(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor with a batch dim (an unbatched input or output gradient gets one)."""
        return t.unsqueeze(0) if t.dim() == self.dims + 1 else t

    @staticmethod
    def padding_pairs(module) -> list[list[int]]:
        """[before, after] zero padding per spatial dim, first dim first, 'same'/'valid' resolved
        as torch resolves them ('same' puts the odd one at the end)."""
        pairs = module._reversed_padding_repeated_twice  # the last dim's pair first
        n = len(module.kernel_size)
        return [[pairs[2 * i], pairs[2 * i + 1]] for i in range(n)][::-1]

    def mode_padded(self, module, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
        """The input batched and, for a non-zero padding_mode, padded as the convolution pads it;
        and the zero padding still to apply ([before, after] per spatial dim)."""
        x = self.batched(x)
        if module.padding_mode != "zeros":
            return (F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode),
                    [[0, 0] for _ in range(self.dims)])
        return x, self.padding_pairs(module)

    def padded(self, module, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The input batched and padded as the convolution pads it, and the symmetric zero
        padding per dim left for `patches` to apply (a Conv2d's symmetric zero padding is left
        to F.unfold; every other padding is applied here)."""
        x, pairs = self.mode_padded(module, x)
        if self.dims == 2 and all(a == b for a, b in pairs):
            return x, tuple(a for a, _ in pairs)
        flat = [p for pair in reversed(pairs) for p in pair]
        if any(flat):
            x = F.pad(x, flat)
        return x, (0,) * self.dims

    def out_sizes(self, module, padded: list[int]) -> list[int]:
        """Output sizes of the convolution over padded spatial sizes."""
        return [(s - module.dilation[i] * (k - 1) - 1) // module.stride[i] + 1
                for i, (s, k) in enumerate(zip(padded, module.kernel_size))]

    def input_locations(self, module, x: torch.Tensor) -> tuple[int, int]:
        """(samples, L) of an input, from its shape alone."""
        batch = x.shape[0] if x.dim() == self.dims + 2 else 1
        padded = [s + a + b for s, (a, b) in zip(x.shape[x.dim() - self.dims:],
                                                 self.padding_pairs(module))]
        return batch, math.prod(self.out_sizes(module, padded))

    def locations(self, module, g):
        return math.prod(g.shape[g.dim() - self.dims:])

    def patches(self, module, xp: torch.Tensor, padding: tuple[int, ...],
                locations_first: bool = False) -> torch.Tensor:
        """Patches [b, C * prod(k), L] of a `padded` batch (C: xp's channels), entry order
        (c, k_1, ..., k_n), locations in row-major output order; `locations_first`: [b, L, C *
        prod(k)] (a Conv2d's as a transposed view of F.unfold's, the others contiguous)."""
        if self.dims == 2:
            p = F.unfold(xp, module.kernel_size, dilation=module.dilation, padding=padding,
                         stride=module.stride)
            return p.transpose(1, 2) if locations_first else p
        n = self.dims
        p = xp
        for i, k in enumerate(module.kernel_size):  # one strided window per spatial dim, no copy
            p = p.unfold(2 + i, module.dilation[i] * (k - 1) + 1, module.stride[i])
        p = p[(Ellipsis,) + tuple(slice(None, None, d) for d in module.dilation)]  # dilated taps
        if locations_first:  # [b, C, o..., k...] -> [b, o..., C, k...]
            p = p.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
            return p.reshape(p.shape[0], -1, p.shape[1 + n:].numel())
        p = p.permute(0, 1, *range(2 + n, 2 + 2 * n), *range(2, 2 + n))  # [b, C, k..., o...]
        return p.reshape(p.shape[0], -1, math.prod(p.shape[2 + n:]))

    def patch_chunks(self, module, x: torch.Tensor, dtype: torch.dtype, chunk_bytes: int):
        """The patches of an input a few samples at a time (at most `chunk_bytes` each), as
        [b, groups, d_in, L] in `dtype`."""
        groups, d = module.groups, self.patch_size(module)
        xp, padding = self.padded(module, x)
        L = math.prod(self.out_sizes(module, [s + 2 * p for s, p in zip(xp.shape[2:], padding)]))
        per_sample = max(1, groups * d * L * torch.empty((), dtype=dtype).element_size())
        step = max(1, chunk_bytes // per_sample)
        for s in range(0, xp.shape[0], step):
            p = self.patches(module, xp[s:s + step].to(dtype), padding)  # [b, groups*d, L]
            yield p.view(p.shape[0], groups, d, p.shape[2])

    # ------------------------------------------------------------------------ rows
    def sample_rows(self, module, t):
        """[samples, L, channels] of an output gradient (a transposed view)."""
        return self.batched(t).flatten(2).transpose(1, 2)

    def input_rows(self, module, x):
        if self.dims != 2:
            p = torch.cat(list(self.patch_chunks(module, x, x.dtype, 1 << 62)))  # [B, g, d, L]
            return p.permute(1, 0, 3, 2).reshape(module.groups, -1, p.shape[2])
        xp, padding = self.padded(module, x)
        p = self.patches(module, xp, padding)  # [B, C*kh*kw, L]
        g = module.groups
        b, _, L = p.shape
        return p.view(b, g, -1, L).permute(1, 0, 3, 2).reshape(g, b * L, -1)

    def grad_rows(self, module, g):
        rows = self.sample_rows(module, g)  # [B, L, C_out]
        groups = module.groups
        return rows.reshape(-1, groups, rows.shape[2] // groups).transpose(0, 1)


class _NormView(View):
    """A layer that scales each feature by its weight (and shifts it by its bias): its gradient
    as a matrix is [features, 1 (+1)], one row per feature. Its weight multiplies the normalised
    input, which the view does not compute: `input_rows` is not defined."""
    kronecker = False

    def features(self, module) -> int:
        raise NotImplementedError

    def feature_dims(self, module, g: torch.Tensor) -> tuple[int, int]:
        """[start, end) of the dims of an output gradient that index the features."""
        raise NotImplementedError

    def sizes(self, module):
        return 1, 1 + self.has_bias(module), self.features(module)

    def input_rows(self, module, x):
        raise TypeError(f"{self.label}: its weight multiplies the normalised input, which has no "
                        "rows a view can read off the module's input")

    def sample_rows(self, module, t):
        start, end = self.feature_dims(module, t)
        t = t.movedim(tuple(range(start, end)), tuple(range(t.dim() - (end - start), t.dim())))
        return t.reshape(t.shape[0] if t.dim() > end - start else 1, -1, self.features(module))

    def grad_rows(self, module, g):
        return self.sample_rows(module, g).reshape(-1, self.features(module)).unsqueeze(0)

    def weight_matrix(self, module, weight_grad):
        return weight_grad.reshape(-1, 1)

    def grad_matrix(self, module, weight_grad, bias_grad):
        w = weight_grad.reshape(1, -1, 1)
        if bias_grad is None:
            return w
        return torch.cat([w, bias_grad.reshape(1, -1, 1)], dim=2)


class BatchNormView(_NormView):
    """BatchNorm1d/2d/3d: features on dim 1."""
    label, module_type = "BatchNorm", nn.modules.batchnorm._BatchNorm

    def features(self, module):
        return module.num_features

    def feature_dims(self, module, g):
        return 1, 2


class LayerNormView(_NormView):
    """LayerNorm: features on the last len(normalized_shape) dims."""
    label, module_type = "LayerNorm", nn.LayerNorm

    def features(self, module):
        return math.prod(module.normalized_shape)

    def feature_dims(self, module, g):
        return g.dim() - len(module.normalized_shape), g.dim()


LINEAR, CONV1D = LinearView(), TransposedLinearView()
CONVS = {n: ConvView(n) for n in (1, 2, 3)}
EMBEDDING, BATCHNORM, LAYERNORM = EmbeddingView(), BatchNormView(), LayerNormView()
# Earlier entries win for a module several accept.
VIEWS: tuple[View, ...] = (LINEAR, *CONVS.values(), EMBEDDING, CONV1D, BATCHNORM, LAYERNORM)


_BY_LABEL = {view.label: view for view in VIEWS}


def view_of(module: nn.Module) -> View | None:
    """The view of `module`'s type (its subclasses count), or None."""
    for view in VIEWS:
        if view.accepts(module):
            return view
    return None


def view_named(label: str) -> View:
    """The view whose `label` is `label` ("Linear", "Conv2d", "Conv1D", ...): for a member that
    keeps a layer's type by name (in a checkpointed param group) and not the module."""
    try:
        return _BY_LABEL[label]
    except KeyError:
        raise ValueError(f"label {label!r} names no module view; known: {sorted(_BY_LABEL)}") from None


def gradient_matrices_into(store: dict, entries) -> list[torch.Tensor]:
    """Gradient matrices [d_g, d_a (+1)], the bias gradient as the last column, in buffers kept
    in `store` (remade when a shape, dtype or device changes), all written by one
    `_foreach_copy_`: no concatenation per layer, nothing allocated from step to step.
    `entries`: (key in store, the weight gradient as a [d_g, d_a] matrix, the bias gradient or
    None, the matrix's dtype). Returns the matrices, in the entries' order."""
    out, dsts, srcs = [], [], []
    for key, w, b, dtype in entries:
        shape = (w.shape[0], w.shape[1] + (b is not None))
        kept = store.get(key)
        if kept is None or kept.shape != shape or kept.dtype != dtype or kept.device != w.device:
            kept = store[key] = torch.empty(shape, dtype=dtype, device=w.device)
        dsts.append(kept[:, :w.shape[1]])
        srcs.append(w)
        if b is not None:
            dsts.append(kept[:, -1])
            srcs.append(b.reshape(-1))
        out.append(kept)
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return out
