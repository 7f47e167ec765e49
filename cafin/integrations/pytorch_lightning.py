"""PyTorch Lightning integration for the `pytorch_lightning` namespace (``import pytorch_lightning as
pl``): the same `PreconditionerCallback` as `cafin.integrations.lightning`, derived from
`pytorch_lightning`'s `Callback`, the only kind that namespace's `Trainer` accepts.

Recipes: docs/integrations.md.
"""
from __future__ import annotations

try:
    from pytorch_lightning.callbacks import Callback
except ModuleNotFoundError as e:
    if e.name != "pytorch_lightning":
        raise
    raise ModuleNotFoundError(
        "cafin.integrations.pytorch_lightning needs the `pytorch_lightning` package (pip install "
        "pytorch-lightning); with `lightning` (import lightning.pytorch as pl), use "
        "cafin.integrations.lightning.PreconditionerCallback", name=e.name) from e

from .lightning_callback import PreconditionerHooks

__all__ = ["PreconditionerCallback"]


class PreconditionerCallback(PreconditionerHooks, Callback):
    __doc__ = PreconditionerHooks.__doc__
