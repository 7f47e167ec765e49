"""AdaFisher's registry of layer types for its diagonal statistics: per module type, the sizes of
its two factors, where each of its parameters reads the activation factor H, and which statistic
op feeds each factor. The other members choose their layers themselves (`cafin.core.discover`).

A parameter of a supported module viewed as [rows = len(S), cols] is preconditioned by
F~[r, c] = S[r] * H[h_offset + c] + damping. Adding a layer type is one `register` call.
The statistic functions take `impl`, the backend (`cafin.ops` or `cafin.reference`), which
provides the ops of the same names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch.nn.functional as F
from torch import nn

from .core import discovery


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


_REGISTRY: list[LayerType] = []


def register(layer_type: LayerType) -> None:
    """Add a layer type to AdaFisher's registry of diagonal statistics (AdaFisher and AdaFisherW
    then take its statistics); earlier registrations win for subclasses of several."""
    _REGISTRY.append(layer_type)


def layer_type_of(module: nn.Module) -> LayerType | None:
    for entry in _REGISTRY:
        if isinstance(module, entry.module_type):
            return entry
    return None


def supported_types() -> list[type]:
    """The module types in AdaFisher's registry."""
    return [entry.module_type for entry in _REGISTRY]


@dataclass(eq=False)
class RegisteredLayer(discovery.Layer):
    """A layer AdaFisher takes statistics of, with its registered type."""
    kind: LayerType


def discover(model: nn.Module, optimised) -> list[RegisteredLayer]:
    """The layers of `model` whose type is registered and that own optimised parameters (the
    core's discovery, each layer's parameters named by its type's `h_offsets`)."""
    layers = discovery.discover(model, optimised, accept=lambda m: layer_type_of(m) is not None,
                                names=lambda m: layer_type_of(m).h_offsets(m))
    return [RegisteredLayer(layer.name, layer.module, layer.anchor, layer.params, layer_type_of(layer.module))
            for layer in layers]


# ------------------------------------------------------------------------------------ Linear
def _linear_input(impl, stat, module, x, step, interval):
    impl.sumsq_stats_(stat, x, x.dim() - 1, x.dim(), module.bias is not None, step, interval)


def _last_dim_grad(impl, stat, module, g, step, interval):
    impl.sumsq_stats_(stat, g, g.dim() - 1, g.dim(), False, step, interval)


register(LayerType(
    nn.Linear,
    s_size=lambda m: m.out_features,
    h_size=lambda m: m.in_features + (m.bias is not None),
    h_offsets=lambda m: {"weight": 0, "bias": m.in_features},
    input_stats=_linear_input,
    grad_stats=_last_dim_grad,
))


# ------------------------------------------------------------------------------------ Conv2d
def _conv_patch_size(m: nn.Conv2d) -> int:
    return m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]


def conv_padding(module: nn.Conv2d) -> list[int]:
    """Zero padding [top, bottom, left, right] of a Conv2d, with 'same'/'valid' resolved."""
    if module.padding == "valid":
        return [0, 0, 0, 0]
    if module.padding == "same":
        pads = []
        for d, k in zip(module.dilation, module.kernel_size):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]  # torch pads the extra one at the end
        return pads
    ph, pw = module.padding
    return [ph, ph, pw, pw]


def _conv_input(impl, stat, module, x, step, interval):
    if x.dim() == 3:  # unbatched input
        x = x.unsqueeze(0)
    if module.padding_mode != "zeros":
        # Non-zero padding is materialised once, as the convolution itself does.
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        padding = [0, 0, 0, 0]
    else:
        padding = conv_padding(module)
    impl.conv2d_input_stats_(stat, x, list(module.kernel_size), list(module.stride), padding,
                             list(module.dilation), module.groups, module.bias is not None,
                             step, interval)


def _conv_grad(impl, stat, module, g, step, interval):
    if g.dim() == 3:
        g = g.unsqueeze(0)
    impl.sumsq_stats_(stat, g, 1, 2, False, step, interval)


register(LayerType(
    nn.Conv2d,
    s_size=lambda m: m.out_channels,
    h_size=lambda m: _conv_patch_size(m) + (m.bias is not None),
    h_offsets=lambda m: {"weight": 0, "bias": _conv_patch_size(m)},
    input_stats=_conv_input,
    grad_stats=_conv_grad,
))


# ---------------------------------------------------------------------- BatchNorm2d, LayerNorm
# Both keep the published 2-vector H: weight reads H[0], bias H[1].
def _norm_input(impl, stat, module, x, step, interval):
    impl.norm_input_stats_(stat, x, step, interval)


def _batchnorm_grad(impl, stat, module, g, step, interval):
    impl.norm_grad_stats_(stat, g, 1, 2, step, interval)


def _layernorm_grad(impl, stat, module, g, step, interval):
    impl.norm_grad_stats_(stat, g, g.dim() - len(module.normalized_shape), g.dim(), step, interval)


_NORM_OFFSETS = {"weight": 0, "bias": 1}

register(LayerType(
    nn.BatchNorm2d,
    s_size=lambda m: m.num_features,
    h_size=lambda m: 2,
    h_offsets=lambda m: _NORM_OFFSETS,
    input_stats=_norm_input,
    grad_stats=_batchnorm_grad,
))

register(LayerType(
    nn.LayerNorm,
    s_size=lambda m: math.prod(m.normalized_shape),
    h_size=lambda m: 2,
    h_offsets=lambda m: _NORM_OFFSETS,
    input_stats=_norm_input,
    grad_stats=_layernorm_grad,
))
