"""PyTorch Lightning integration for the `pytorch_lightning` namespace (``import pytorch_lightning as
pl``): the same `PreconditionerCallback` as `cafin.integrations.lightning`, derived from
`pytorch_lightning`'s `Callback`, the only kind that namespace's `Trainer` accepts.

Recipes: docs/integrations.md.
"""
from __future__ import annotations

from .lightning_callback import PreconditionerHooks, callback_base

__all__ = ["PreconditionerCallback"]


class PreconditionerCallback(PreconditionerHooks, callback_base("pytorch_lightning")):
    __doc__ = PreconditionerHooks.__doc__
