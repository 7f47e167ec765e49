"""Layer discovery: the layers of a model that a member supports and that hold optimised
parameters, matched by identity (the first supported module that holds a parameter owns it;
tied parameters once). Which modules are supported is the member's to say (`accept`)."""
from __future__ import annotations

from dataclasses import dataclass
import warnings
from typing import Callable, Iterable

import torch
from torch import nn


@dataclass(eq=False)
class Layer:
    """A supported module with at least one optimised parameter."""
    name: str
    module: nn.Module
    anchor: torch.Tensor  # the parameter whose state holds the layer's factors
    params: dict  # parameter name -> the optimised parameter this layer owns


def weight_and_bias(module: nn.Module) -> tuple[str, ...]:
    """The parameters a Linear, Conv2d, BatchNorm2d or LayerNorm layer's curvature covers, in the
    order they register them (`named_parameters(recurse=False)`). Parameters a subclass adds are
    not the layer's: they are optimised like parameters outside any layer."""
    return ("weight", "bias")


def discover(model: nn.Module, optimised: Iterable[torch.Tensor], accept: Callable[[nn.Module], bool],
             names: Callable[[nn.Module], Iterable[str]] = weight_and_bias) -> list[Layer]:
    """The modules of `model` that `accept(module)` takes and that own optimised parameters, in
    `named_modules()` order. A module's parameters are those `names(module)` names, in that
    order (the layer's anchor is the first one optimised).

    A parameter belongs to the first accepted module that holds it (a decoder tied to an
    embedding takes the embedding's curvature where the member accepts embeddings, else the
    decoder's)."""
    optimised = set(optimised)
    warn_functional_attention(model, optimised)
    owned: set[torch.Tensor] = set()
    layers = []
    for name, module in model.named_modules():
        if not accept(module):
            continue
        params = {}
        for pname in names(module):
            p = getattr(module, pname, None)
            if isinstance(p, nn.Parameter) and p in optimised and p not in owned:
                params[pname] = p
        if not params:
            continue
        owned.update(params.values())
        layers.append(Layer(name, module, next(iter(params.values())), params))
    return layers


def warn_functional_attention(model: nn.Module, optimised: set) -> None:
    """Warn, naming each one, about the `torch.nn.MultiheadAttention` modules of `model` that hold
    optimised parameters: they apply their projections functionally, so no hook sees them and they
    train without curvature (`out_proj` included). `cafin.nn.replace_multihead_attention(model)`,
    before the member is built, swaps in a drop-in whose projections are Linear layers."""
    names = [repr(name or "(the model)") for name, module in model.named_modules()
             if isinstance(module, nn.MultiheadAttention) and any(p in optimised for p in module.parameters())]
    if names:
        warnings.warn(f"torch.nn.MultiheadAttention {', '.join(names)}: its projections are applied functionally, so "
                      "they get no curvature. Call cafin.nn.replace_multihead_attention(model) before building "
                      "the optimizer to give them curvature.", UserWarning, stacklevel=3)
