"""SINGD's checkpoints: the core's validated state_dict/load_state_dict, plus H_C's previous
gradient scale; a checkpoint's group settings pass the constructor's rules, and those that decide
the factors' layout must be the ones this optimizer's factors were built with.
"""
from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ...core import hyperparameter_tensor, real_number
from ...core.distribution.sharding import module_class
from .settings import check_settings


class Checkpoint:
    """state_dict and load_state_dict (a mixin of `SINGD`)."""

    def _layout(self) -> list:
        """What a checkpoint's factors must fit: each layer's name, class and (d_K, d_C)."""
        return [[layer.name, module_class(layer.module).__name__, *self.dims(layer.module)]
                for layer in self._curvature]

    def state_dict(self) -> dict[str, Any]:
        """The core's state_dict, with the previous step's gradient scale (H_C's)."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["curvature"]["grad_scale_prev"] = self._grad_scale_prev
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The core's validated load (nothing replaced unless everything checks), plus H_C's
        previous gradient scale; a numeric lr_cov comes back as a tensor on the group's device.
        SINGD's group settings are checked by the constructor's rules first, and those that
        decide the factors' layout must be the ones this optimizer's factors were built with."""
        curvature = None
        if isinstance(state_dict, dict):
            groups = state_dict.get("param_groups")
            if isinstance(groups, list):
                for index, (saved, group) in enumerate(zip(groups, self.param_groups)):
                    if not isinstance(saved, dict):
                        raise TypeError(f"checkpoint param group {index} must be a dict, got "
                                        f"{type(saved).__name__}")
                    merged = {**group, **{k: v for k, v in saved.items()
                                          if k not in ("params", "curvature")}}
                    if isinstance(merged["lr_cov"], Tensor):  # read it (no step waits on a load)
                        merged["lr_cov"] = merged["lr_cov"].detach().cpu()
                    try:
                        check_settings(merged, index)
                    except (TypeError, ValueError) as e:
                        raise type(e)(f"checkpoint {e}") from None
                    self._check_built(merged, index, where="checkpoint ")
            curvature = state_dict.get("curvature")
            if curvature is None and isinstance(groups, list) and groups and isinstance(groups[0], dict):
                curvature = groups[0].get("curvature")
        prev = curvature.get("grad_scale_prev", self._init_scale) if isinstance(curvature, dict) else None
        prev = real_number(prev, "checkpoint curvature['grad_scale_prev']") if prev is not None else None
        if prev is not None and not (math.isfinite(prev) and prev > 0.0):
            raise ValueError(f"checkpoint curvature['grad_scale_prev'] must be a finite number > 0, "
                             f"got {prev}")
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["alpha1"] = real_number(group["alpha1"], "alpha1")
            if not callable(group["lr_cov"]):
                group["lr_cov"] = hyperparameter_tensor(group["lr_cov"], group["params"])
        self._grad_scale_prev = prev

