"""AdaFisher's registry of layer types for its diagonal statistics: per module type, the sizes of
its two factors, where each of its parameters reads the activation factor H, and which statistic
op feeds each factor. The other members choose their layers themselves (`cafin.core.discover`).

A parameter of a supported module viewed as [rows = len(S), cols] is preconditioned by
F~[r, c] = S[r] * H[h_offset + c] + damping. A parameter the layer type names `transposed` is
stored the other way round, its rows on the activation side (an Embedding's [num_embeddings, dim],
transformers' Conv1D's [in, out]): viewed as [rows, cols = len(S)], F~[r, c] = H[h_offset + r] *
S[c] + damping. Adding a layer type is one `register` call. What a built-in layer type is (its
sizes, which side of its weight is stored transposed, a convolution's padding) is its view's
(`cafin.core.views`); the registry adds AdaFisher's statistic ops and its 2-vector H of a norm.
The statistic functions take `impl`, the backend (`cafin.ops` or `cafin.reference`), which
provides the ops of the same names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .core import discovery
from .core.views import BATCHNORM, CONV1D, CONVS, EMBEDDING, LAYERNORM, view_of


@dataclass(frozen=True)
class LayerType:
    """A layer type in AdaFisher's registry of diagonal statistics: F~ = S (x) H + damping for the
    parameters of a module of `module_type` (and its subclasses)."""
    module_type: type
    s_size: Callable[[nn.Module], int]  # length of the gradient-side factor S (rows)
    h_size: Callable[[nn.Module], int]  # length of the activation-side factor H
    h_offsets: Callable[[nn.Module], dict[str, int]]  # parameter name -> offset into H
    input_stats: Callable  # (impl, stat, module, x, step, interval) -> None, accumulates into stat
    grad_stats: Callable  # (impl, stat, module, grad_output, step, interval) -> None
    # Parameters stored [activation side, gradient side] (see the module docstring).
    transposed: frozenset[str] = frozenset()
    # Recognises the module instead of isinstance(module, module_type), for a type cafin does not
    # import; `name` then says what it is in messages.
    matches: Callable[[nn.Module], bool] | None = None
    name: str | None = None
    # Why a module of this type cannot be preconditioned (an option the statistics do not
    # model), or None: a layer that owns optimised parameters is then refused at construction.
    refuse: Callable[[nn.Module], str | None] | None = None

    def accepts(self, module: nn.Module) -> bool:
        if self.matches is not None:
            return self.matches(module)
        return isinstance(module, self.module_type)

    @property
    def label(self) -> str:
        return self.name or self.module_type.__name__


_REGISTRY: list[LayerType] = []


def register(layer_type: LayerType) -> None:
    """Add a layer type to AdaFisher's registry of diagonal statistics (AdaFisher and AdaFisherW
    then take its statistics); earlier registrations win for subclasses of several."""
    _REGISTRY.append(layer_type)


# The layer types of the published AdaFisher (AtlasAnalyticsLab/AdaFisher), which hooks only
# these; `published_layers=True` restricts AdaFisher to them. Subclasses count (the published code
# compares class names, which misses subclasses: a fix cafin keeps in both layer sets).
PUBLISHED_TYPES = (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm)


def _entries(published: bool) -> list[LayerType]:
    if not published:
        return _REGISTRY
    return [entry for entry in _REGISTRY
            if entry.matches is None and entry.module_type in PUBLISHED_TYPES]


def layer_type_of(module: nn.Module, published: bool = False) -> LayerType | None:
    """The registered type of `module` (the first entry that accepts it), or None; with
    `published`, only among the published layer types."""
    for entry in _entries(published):
        if entry.accepts(module):
            return entry
    return None


def supported_types(published: bool = False) -> list[type]:
    """The module types in AdaFisher's registry (those matched by isinstance); with `published`,
    those of the published layer set."""
    return [entry.module_type for entry in _entries(published) if entry.matches is None]


def supported_names(published: bool = False) -> list[str]:
    """What AdaFisher's registry supports, by name (for messages); with `published`, the
    published layer set."""
    return [entry.label for entry in _entries(published)]


@dataclass(eq=False)
class RegisteredLayer(discovery.Layer):
    """A layer AdaFisher takes statistics of, with its registered type."""
    kind: LayerType


def discover(model: nn.Module, optimised, published: bool = False) -> list[RegisteredLayer]:
    """The layers of `model` whose type is registered and that own optimised parameters (the
    core's discovery, each layer's parameters named by its type's `h_offsets`).

    `published`: the published layer set. Only `PUBLISHED_TYPES` take statistics, and a parameter
    gets curvature only from the first module that holds it (in `named_modules()` order, where
    `model.parameters()` lists it), when that module is of a published type: the published code
    pairs parameters with layers in that order, so a decoder tied to an Embedding is met as the
    Embedding's weight and takes no curvature (not the decoder's, which the first-supported-module
    rule would give it).

    Raises ValueError naming the first such layer whose type refuses it (`LayerType.refuse`);
    with `published`, the first module of a registered type that first holds an optimised
    parameter and refuses it (an Embedding with sparse=True has no dense update even without
    curvature)."""
    optimised = list(optimised)
    if published:
        first = _first_holders(model, optimised)
        for name, module in first.values():
            _check_refused(name, module)
        optimised = [p for p in optimised
                     if p in first and layer_type_of(first[p][1], published=True) is not None]
    layers = discovery.discover(model, optimised,
                                accept=lambda m: layer_type_of(m, published) is not None,
                                names=lambda m: layer_type_of(m, published).h_offsets(m))
    for layer in layers:
        _check_refused(layer.name, layer.module)
    return [RegisteredLayer(layer.name, layer.module, layer.anchor, layer.params,
                            layer_type_of(layer.module, published)) for layer in layers]


def _check_refused(name: str, module: nn.Module) -> None:
    kind = layer_type_of(module)
    why = kind.refuse(module) if kind is not None and kind.refuse is not None else None
    if why is not None:
        raise ValueError(f"layer '{name}' ({type(module).__name__}): {why}")


def _first_holders(model: nn.Module, optimised: list) -> dict:
    """Optimised parameter -> (name, module) of the first module in `named_modules()` order that
    registers it."""
    wanted = set(optimised)
    first: dict = {}
    for name, module in model.named_modules():
        for p in module._parameters.values():
            if p is not None and p in wanted and p not in first:
                first[p] = (name, module)
    return first


def _s_size(m: nn.Module) -> int:
    """S's length: the gradient side of every group."""
    groups, _, d_g = view_of(m).sizes(m)
    return groups * d_g


def _h_size(m: nn.Module) -> int:
    """H's length: the input side with the bias entry."""
    return view_of(m).sizes(m)[1]


def _weight_and_bias(m: nn.Module) -> dict[str, int]:
    """The weight reads H from 0, the bias its last entry."""
    return {"weight": 0, "bias": view_of(m).sizes(m)[1] - (m.bias is not None)}


def _transposed(view) -> frozenset[str]:
    return frozenset({"weight"}) if view.transposed else frozenset()


# ------------------------------------------------------------------------------------ Linear
def _linear_input(impl, stat, module, x, step, interval):
    impl.sumsq_stats_(stat, x, x.dim() - 1, x.dim(), module.bias is not None, step, interval)


def _last_dim_grad(impl, stat, module, g, step, interval):
    impl.sumsq_stats_(stat, g, g.dim() - 1, g.dim(), False, step, interval)


# What every layer with a Kronecker view reads of it; a Linear's statistics are also Conv1D's.
_VIEWED = dict(s_size=_s_size, h_size=_h_size, h_offsets=_weight_and_bias)
_LINEAR = dict(_VIEWED, input_stats=_linear_input, grad_stats=_last_dim_grad)
register(LayerType(nn.Linear, **_LINEAR))


# ------------------------------------------------------------------------------------ Conv2d
def conv_padding(module: nn.Conv2d) -> list[int]:
    """Zero padding [top, bottom, left, right] of a Conv2d, with 'same'/'valid' resolved."""
    return [p for pair in CONVS[2].padding_pairs(module) for p in pair]


def _conv_input(impl, stat, module, x, step, interval):
    # A non-zero padding is materialised once, as the convolution itself does; the kernel pads
    # with zeros.
    x, pairs = CONVS[2].mode_padded(module, x)
    padding = [p for pair in pairs for p in pair]
    impl.conv2d_input_stats_(stat, x, list(module.kernel_size), list(module.stride), padding,
                             list(module.dilation), module.groups, module.bias is not None,
                             step, interval)


def _conv_grad(view):
    # the view bound here, not looked up: the hooks run this every statistics step
    def grad_stats(impl, stat, module, g, step, interval):
        impl.sumsq_stats_(stat, view.batched(g), 1, 2, False, step, interval)
    return grad_stats


register(LayerType(nn.Conv2d, input_stats=_conv_input, grad_stats=_conv_grad(CONVS[2]), **_VIEWED))


# ---------------------------------------------------------------------- BatchNorm2d, LayerNorm
# Both keep the published 2-vector H: weight reads H[0], bias H[1].
def _norm_input(impl, stat, module, x, step, interval):
    impl.norm_input_stats_(stat, x, step, interval)


def _norm_grad(view):
    def grad_stats(impl, stat, module, g, step, interval):
        start, end = view.feature_dims(module, g)  # BatchNorm's dim 1, LayerNorm's last
        impl.norm_grad_stats_(stat, g, start, end, step, interval)
    return grad_stats


_NORM = dict(s_size=_s_size, h_size=lambda m: 2, h_offsets=lambda m: {"weight": 0, "bias": 1},
             input_stats=_norm_input)
register(LayerType(nn.BatchNorm2d, grad_stats=_norm_grad(BATCHNORM), **_NORM))
register(LayerType(nn.LayerNorm, grad_stats=_norm_grad(LAYERNORM), **_NORM))


# ------------------------------------------------------------------------- Conv1d and Conv3d
# Both reuse the Conv2d input statistic: a Conv1d is a Conv2d of unit height; a Conv3d's depth
# taps are unfolded into channels (channel c, depth tap t -> c * kd + t, the weight's own order
# [C_out, C_in/G, kd, kh, kw]) and its output depths into the batch, which leaves a Conv2d over
# height and width with the same patch entries and the same divisor B*od*oh*ow*D. This copies
# the input kd/stride_d times, against kd*kh*kw times for an unfold of the whole patch.
def _conv1d_input(impl, stat, module, x, step, interval):
    x, ((left, right),) = CONVS[1].mode_padded(module, x)
    impl.conv2d_input_stats_(stat, x.unsqueeze(2), [1, module.kernel_size[0]], [1, module.stride[0]],
                             [0, 0, left, right], [1, module.dilation[0]], module.groups,
                             module.bias is not None, step, interval)


def _conv3d_input(impl, stat, module, x, step, interval):
    x, ((front, back), (top, bottom), (left, right)) = CONVS[3].mode_padded(module, x)
    if front or back:
        x = F.pad(x, (0, 0, 0, 0, front, back))
    kd, sd, dd = module.kernel_size[0], module.stride[0], module.dilation[0]
    batch, channels, depth, height, width = x.shape
    out_depth = (depth - dd * (kd - 1) - 1) // sd + 1
    taps = [x[:, :, t * dd:t * dd + (out_depth - 1) * sd + 1:sd] for t in range(kd)]
    x = torch.stack(taps, dim=2)  # [B, C, kd, od, H, W]
    x = x.permute(0, 3, 1, 2, 4, 5).reshape(batch * out_depth, channels * kd, height, width)
    impl.conv2d_input_stats_(stat, x, list(module.kernel_size[1:]), list(module.stride[1:]),
                             [top, bottom, left, right], list(module.dilation[1:]), module.groups,
                             module.bias is not None, step, interval)


register(LayerType(nn.Conv1d, input_stats=_conv1d_input, grad_stats=_conv_grad(CONVS[1]), **_VIEWED))
register(LayerType(nn.Conv3d, input_stats=_conv3d_input, grad_stats=_conv_grad(CONVS[3]), **_VIEWED))


# ------------------------------------------------------------------------------- Embedding
# An Embedding is a Linear without bias on the one-hot input, with its weight stored transposed
# ([num_embeddings, dim]: rows on the activation side). The activation factor is the mean square
# of the one-hot input per row, the token counts over the number of tokens (with
# scale_grad_by_freq the gradient is that of the one-hot input divided by the count of its token
# in the batch, so each token's entry is 1/count). padding_idx: its row's gradient is zero, so it
# moves only by weight decay; the statistics count the padding token as any other (an entry of H
# for its row, its positions' output gradients in S), so with coupled weight decay (AdaFisher)
# that decay is divided by a preconditioner which grows with the padding's frequency.
# max_norm renormalises rows in place outside autograd: the gradient, and so the statistics, are
# those of a plain Embedding.
def _embedding_input(impl, stat, module, x, step, interval):
    impl.embedding_input_stats_(stat, x, module.scale_grad_by_freq, step, interval)


def _embedding_refused(module: nn.Embedding) -> str | None:
    if module.sparse:
        return ("sparse=True gives sparse gradients, which AdaFisher's dense update does not "
                "take; use sparse=False")
    return None


register(LayerType(
    nn.Embedding,
    s_size=_s_size,
    h_size=_h_size,
    h_offsets=lambda m: {"weight": 0},
    input_stats=_embedding_input,
    grad_stats=_last_dim_grad,
    transposed=_transposed(EMBEDDING),
    refuse=_embedding_refused,
))


# ------------------------------------------------------------------ transformers' Conv1D
# GPT-2's projections: a Linear whose weight is stored [in, out]; recognised by its shape contract
# (its view, `cafin.core.views.TransposedLinearView`), so transformers is never imported. Its bias
# stays on the gradient side ([out]: S[r] * H[in]), as Linear's.
register(LayerType(
    nn.Module,
    **_LINEAR,
    transposed=_transposed(CONV1D),
    matches=CONV1D.accepts,
    name="transformers Conv1D",
))
