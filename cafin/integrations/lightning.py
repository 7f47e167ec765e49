"""PyTorch Lightning integration, for the `lightning` package (``import lightning.pytorch as pl``;
``pip install "cafin[integrations]"``). Code that imports `pytorch_lightning` uses
`cafin.integrations.pytorch_lightning` instead: each namespace's `Trainer` accepts only callbacks
derived from its own `Callback`, so each gets its own class over the same methods.

cafin optimizers need nothing here: return one from ``configure_optimizers`` (the module is the
model: ``cafin.AdaFisher(self, ...)``) and automatic optimization calls ``optimizer.step(closure)``,
which every member evaluates once per step (forward, backward, the curvature statistics), then
updates.

`PreconditionerCallback` runs a `cafin.KFACPreconditioner` or `cafin.TwoLevelKFAC` on the
gradients before each optimizer step and keeps its state in the Lightning checkpoint.

Recipes: docs/integrations.md.
"""
from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
except ModuleNotFoundError as e:
    if e.name not in ("lightning", "lightning.pytorch"):
        raise
    raise ModuleNotFoundError(
        "cafin.integrations.lightning needs the `lightning` package (pip install lightning); with "
        "`pytorch_lightning` (import pytorch_lightning as pl), use "
        "cafin.integrations.pytorch_lightning.PreconditionerCallback", name=e.name) from e

from .lightning_callback import PreconditionerHooks

__all__ = ["PreconditionerCallback"]


class PreconditionerCallback(PreconditionerHooks, Callback):
    __doc__ = PreconditionerHooks.__doc__
