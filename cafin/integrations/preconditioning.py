"""What both framework callbacks need to run a preconditioner (`KFACPreconditioner`,
`TwoLevelKFAC`) between backward and the optimizer step: the argument check, the
GradScaler handling, and the check that the framework's gradient accumulation matches the
preconditioner's. Plain torch only: the frameworks are imported by their own modules.
"""
from __future__ import annotations

from typing import Any

import torch

from ..core.preconditioner import Preconditioner


def check_preconditioner(preconditioner: Any) -> Preconditioner:
    if not isinstance(preconditioner, Preconditioner):
        raise TypeError("preconditioner must be a cafin preconditioner (cafin.KFACPreconditioner or "
                        f"cafin.TwoLevelKFAC), got {type(preconditioner).__name__}; a cafin optimizer "
                        "(AdaFisher, SINGD, DyKAF) is the optimizer itself and needs no callback")
    return preconditioner


def prepare(preconditioner: Preconditioner, scaler: torch.amp.GradScaler | None,
            accumulation_steps: int, accumulation_name: str) -> None:
    """Checks and settings made once, when training starts.

    - A GradScaler in use: the preconditioner's gradient-side statistics are taken from scaled
      output gradients during backward, so it must know the scaler to unscale them; the
      framework's scaler is handed to it when it was built without one. `TwoLevelKFAC` takes no
      scaler: refused.
    - `TwoLevelKFAC` takes statistics only while `update_stats` is set: the callback trains with
      the empirical Fisher (the published README's loop), so it is set.
    - K-FAC folds its statistics every `accumulation_steps` backward passes: it must equal the
      framework's gradient accumulation, or the factors would be folded mid-accumulation.
    """
    scaling = scaler is not None and scaler.is_enabled()
    if hasattr(preconditioner, "update_stats"):  # TwoLevelKFAC
        if scaling:
            raise ValueError("TwoLevelKFAC cannot unscale its statistics under a GradScaler (fp16 "
                             "mixed precision): train in bf16 or float32, or use cafin.KFACPreconditioner")
        preconditioner.update_stats = True
    elif scaling and preconditioner.grad_scaler is None:
        preconditioner.grad_scaler = scaler
    own = getattr(preconditioner, "_accumulation_steps", 1)
    if hasattr(preconditioner, "_accumulation_steps") and own != accumulation_steps:
        raise ValueError(f"{type(preconditioner).__name__}(accumulation_steps={own}) does not match "
                         f"{accumulation_name}={accumulation_steps}: build the preconditioner with "
                         f"accumulation_steps={accumulation_steps}")


def unscale(scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer) -> None:
    """Unscale the gradients of `optimizer` (the torch optimizer the scaler steps) unless this
    step already did, e.g. to clip them. The preconditioner must see true gradients: its
    KL clipping is not scale-invariant. `scaler.step` then skips its own unscale and still
    skips the optimizer step on inf/NaN gradients."""
    if scaler is None or not scaler.is_enabled():
        return
    # GradScaler keeps no public "already unscaled" query; its per-optimizer stage is the record
    # unscale_ itself checks (a second unscale_ in one step raises).
    from torch.amp.grad_scaler import OptState
    stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
    if stage is OptState.READY:
        scaler.unscale_(optimizer)
