"""Layer discovery: the supported layers of a model that hold optimised parameters, matched by
identity (the first supported module that holds a parameter owns it; tied parameters once)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from ..layers import LayerType, layer_type_of


@dataclass(eq=False)
class Layer:
    """A supported module with at least one optimised parameter."""
    name: str
    module: nn.Module
    kind: LayerType
    anchor: torch.Tensor  # the parameter whose state holds the layer's factors
    params: dict  # parameter name -> the optimised parameter this layer owns


def discover(model: nn.Module, optimised: Iterable[torch.Tensor],
             accept=lambda module, kind: True) -> list[Layer]:
    """The supported layers of `model` that own optimised parameters, in `named_modules()` order.

    A parameter belongs to the first supported module that holds it (a decoder tied to an
    embedding takes the decoder's curvature). `accept(module, kind)` lets a member narrow the
    registry (K-FAC takes Linear and Conv2d only)."""
    optimised = set(optimised)
    owned: set[torch.Tensor] = set()
    layers = []
    for name, module in model.named_modules():
        kind = layer_type_of(module)
        if kind is None or not accept(module, kind):
            continue
        params = {}
        for pname in kind.h_offsets(module):
            p = getattr(module, pname, None)
            if isinstance(p, nn.Parameter) and p in optimised and p not in owned:
                params[pname] = p
        if not params:
            continue
        owned.update(params.values())
        layers.append(Layer(name, module, kind, next(iter(params.values())), params))
    return layers
