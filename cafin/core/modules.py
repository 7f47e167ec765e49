"""Module types the members recognise without importing the library that defines them."""
from __future__ import annotations

from torch import nn


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
