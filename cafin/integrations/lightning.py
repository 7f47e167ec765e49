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

from .lightning_callback import PreconditionerHooks, callback_base

__all__ = ["PreconditionerCallback"]


class PreconditionerCallback(PreconditionerHooks, callback_base("lightning.pytorch")):
    __doc__ = PreconditionerHooks.__doc__
