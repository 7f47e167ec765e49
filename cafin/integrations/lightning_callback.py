"""The methods of `PreconditionerCallback`, the same for the `lightning` and the `pytorch_lightning`
namespaces: each namespace's module derives its class from these and from its own `Callback`."""
from __future__ import annotations

import importlib
from typing import Any

from ..core.preconditioner import Preconditioner
from .preconditioning import check_preconditioner, prepare, unscale

# namespace -> (its package, cafin's module for it)
NAMESPACES = {"lightning.pytorch": ("lightning", "cafin.integrations.lightning"),
              "pytorch_lightning": ("pytorch_lightning", "cafin.integrations.pytorch_lightning")}


def callback_base(namespace: str) -> type:
    """The namespace's `Callback`, or an error that names the package and cafin's module for the
    other namespace."""
    package, _ = NAMESPACES[namespace]
    try:
        return importlib.import_module(f"{namespace}.callbacks").Callback
    except ModuleNotFoundError as e:
        if e.name not in (package, namespace):
            raise
        other = next(n for n in NAMESPACES if n != namespace)
        raise ModuleNotFoundError(
            f"{NAMESPACES[namespace][1]} needs the `{package}` package (pip install "
            f"{package.replace('_', '-')}); with `{other}`, use "
            f"{NAMESPACES[other][1]}.PreconditionerCallback", name=e.name) from e


class PreconditionerHooks:
    r"""Runs a K-FAC or two-level K-FAC preconditioner inside a Lightning `Trainer`.

    The preconditioner is built on the LightningModule (or the model it holds) before
    ``fit``; ``configure_optimizers`` returns a torch optimizer (SGD with momentum, as
    kfac-pytorch recommends). In ``on_before_optimizer_step`` (after the closure's backward,
    before gradient clipping and ``optimizer.step``) it calls ``preconditioner.step()``, which
    rewrites every hooked layer's ``.grad``.

    Mixed precision ("16-mixed"): the gradients are unscaled before the preconditioner (Lightning
    does it already for optimizers that do not unscale in their step), and Lightning's GradScaler
    is handed to a `KFACPreconditioner` built without one, so that its gradient-side statistics
    are unscaled too. `TwoLevelKFAC` takes no GradScaler and is refused under "16-mixed".

    Checkpoints: the preconditioner's ``state_dict()`` is this callback's state in the
    Lightning checkpoint (``trainer.save_checkpoint``, ``ModelCheckpoint``), loaded back by
    ``trainer.fit(..., ckpt_path=...)``.

    Args:
        preconditioner (KFACPreconditioner or TwoLevelKFAC): the preconditioner, built on the
            model being trained. K-FAC's ``accumulation_steps`` must equal the Trainer's
            ``accumulate_grad_batches``; a `TwoLevelKFAC` gets ``update_stats = True`` (the
            empirical Fisher of the published loop).
    """

    def __init__(self, preconditioner: Preconditioner) -> None:
        self.preconditioner = check_preconditioner(preconditioner)

    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}[{type(self.preconditioner).__name__}]"

    def on_fit_start(self, trainer, pl_module) -> None:
        prepare(self.preconditioner, getattr(trainer.precision_plugin, "scaler", None),
                trainer.accumulate_grad_batches, "Trainer(accumulate_grad_batches)")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        unscale(getattr(trainer.precision_plugin, "scaler", None), optimizer)
        self.preconditioner.step()

    def state_dict(self) -> dict[str, Any]:
        return self.preconditioner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.preconditioner.load_state_dict(state_dict)
