"""How the members meet `torch.amp.GradScaler`.

A member that unscales its gradients itself (`_step_supports_amp_scaling`: AdaFisher, SINGD) is
handed the scaler's state by `GradScaler.step` as two attributes, read by `handed_over`. After
`scaler.unscale_(optimizer)` (for clipping) the gradients are unscaled but the statistics the
hooks took from the scaled gradients are not: their scale comes from the scaler the member was
given, `scale_for_statistics`. K-FAC's hooks divide each output gradient by `current_scale`.
"""
from __future__ import annotations

from typing import Any

import torch


def handed_over(optimizer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_scale, found_inf) that `GradScaler.step` set on the optimizer for this step: both
    None without a scaler; grad_scale None when the gradients were unscaled before the step."""
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


def current_scale(grad_scaler: Any) -> torch.Tensor | float | None:
    """The scale of this step's loss, without a sync: a GradScaler's scale tensor (None before
    its first `scale()`), or the value of a callable (kfac-pytorch's `grad_scaler` form)."""
    if hasattr(grad_scaler, "_get_scale_async"):
        return grad_scaler._get_scale_async()
    return grad_scaler()


def scale_for_statistics(grad_scaler: Any, owner: str, statistics: str) -> torch.Tensor:
    """The scale of the statistics taken this step when the gradients were unscaled before
    `step()` (`scaler.unscale_`); refused, naming the missing argument, without the scaler."""
    scale = None if grad_scaler is None else current_scale(grad_scaler)
    if scale is None:
        raise RuntimeError(f"{owner}: gradients were unscaled before step() (scaler.unscale_), so "
                           f"{statistics}, taken from scaled gradients, need the scale: pass "
                           f"grad_scaler=scaler to {owner}")
    return scale
