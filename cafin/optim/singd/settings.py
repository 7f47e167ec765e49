"""SINGD's settings: the layers it preconditions, the rules of its group entries (checked at
construction, between steps, in the forward pass and in a checkpoint) and the settings a group's
factors are built with, which stay fixed.
"""
from __future__ import annotations

import math
import operator
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from ...core import Choice, Flag, Layer, check_int, check_range, hyperparameter_tensor, real_number
from ...core import route
from ...core.views import view_of
from .structures import structure

# Rules of the settings the statistics hooks read, shared by the constructor's, a checkpoint's and
# the forward pass's checks.
_LOSS_AVERAGE = Choice(None, "batch", "batch+sequence")
_KFAC_APPROX = Choice("expand", "reduce")
_FLAG = Flag()

# Every group entry `check_settings` and `_check_built` read.
_SETTINGS = ("alpha1", "lr_cov", "T", "kfac_like", "normalize_lr_cov", "exact_block_transposes",
             "loss_average", "kfac_approx", "structures", "preconditioner_dtype")


def _check_statistics_choices(group: dict[str, Any], where: str) -> None:
    _LOSS_AVERAGE.check(group["loss_average"], f"{where}loss_average")
    _KFAC_APPROX.check(group["kfac_approx"], f"{where}kfac_approx")


def supports(module: nn.Module) -> bool:
    """Linear, Conv1d/2d/3d, Embedding and transformers' Conv1D: the layers with a Kronecker view."""
    view = view_of(module)
    return view is not None and view.kronecker


def check_options(layer: Layer) -> None:
    """Refuse layer options whose gradient is not the outer product the factors model."""
    module = layer.module
    if not isinstance(module, nn.Embedding):
        return
    refused = (("max_norm", module.max_norm is not None,
                "it renormalises rows of the weight in the forward pass"),
               ("sparse", module.sparse, "its gradient is sparse; SINGD forms a dense natural "
                                         "gradient"),
               ("scale_grad_by_freq", module.scale_grad_by_freq,
                "it divides gradient rows by token frequencies"))
    for name, present, why in refused:
        if present:
            raise ValueError(f"SINGD: Embedding layer '{layer.name}' ({module}) has "
                             f"{name}={getattr(module, name)!r}, which SINGD does not support: "
                             f"{why}. Construct it without {name}, or leave its parameters out "
                             "of params")


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def check_grad_scale(value, name: str) -> float:
    """A gradient scale (init_grad_scale, set_current_grad_scale's): finite and > 0."""
    v = real_number(value, name)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {v}")
    return v


def lr_cov_value(value, where: str = "") -> None:
    """A value of lr_cov (beta1): a real number >= 0 (a tensor off the CPU is not read: no sync)."""
    if isinstance(value, Tensor) and (value.numel() != 1 or not value.is_floating_point()):
        raise ValueError(f"{where}lr_cov must be a number, a 0-dim float tensor or a callable "
                         f"of the step, got a {value.dtype} tensor of shape {tuple(value.shape)}")
    if not isinstance(value, Tensor) or value.device.type == "cpu":
        v = real_number(value, f"{where}lr_cov")
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{where}lr_cov must be a finite number >= 0, got {v}")


def trainable(model: nn.Module, warn_unsupported: bool) -> list[Tensor]:
    """The trainable parameters of the model's supported layers (params= not given)."""
    found = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if supports(module):
            found += [p for p in own if all(p is not q for q in found)]
        elif own and warn_unsupported:
            warnings.warn(f"Found un-supported parameter(s) that will not be trained in layer "
                          f"{name}: {module}. To disable this warning, construct the optimizer "
                          "with `warn_unsupported=False`.", UserWarning, stacklevel=4)
    return found


def check_settings(group: dict[str, Any], index: int) -> None:
    """SINGD's settings outside the core's hyperparameter table (names as singd's errors)."""
    where = f"param group {index}: "
    try:
        # Riemannian momentum (m <- m~ + alpha1*m): at 1 or more it never decays (and
        # normalize_lr_cov's half step 0.5*(1 - alpha1) is 0 or negative)
        check_range(group["alpha1"], "alpha1", 0.0, 1.0, high_open=True)
        if not callable(group["lr_cov"]):
            lr_cov_value(group["lr_cov"])
        check_int(group["T"], "T", 1)
        for name in ("kfac_like", "normalize_lr_cov", "exact_block_transposes"):
            _FLAG.check(group[name], name)
        _check_statistics_choices(group, "")
        st = group["structures"]
        if not (isinstance(st, (tuple, list)) and len(st) == 2):
            raise ValueError(f"structures must be a pair of structure names, got {st!r}")
        for s in st:
            structure(s)
        pd = group["preconditioner_dtype"]
        if not (isinstance(pd, (tuple, list)) and len(pd) == 2
                and all(d is None or (isinstance(d, torch.dtype) and d.is_floating_point)
                        for d in pd)):
            raise ValueError(f"preconditioner_dtype must be a pair of floating dtypes or None, "
                             f"got {pd!r}")
    except (TypeError, ValueError) as e:
        raise type(e)(where + str(e)) from None


def build_settings(group: dict[str, Any]) -> tuple:
    """What a group's factors were built with: their structures, their dtypes, whether the
    Riemannian momenta m_K, m_C exist."""
    return tuple(group["structures"]), tuple(group["preconditioner_dtype"]), group["alpha1"] != 0.0


class Settings:
    """SINGD's group entries beside the core's hyperparameter table (a mixin of `SINGD`)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The core's validated add_param_group (ranges, tensor hyperparameters, nothing left
        behind by a rejected group), after SINGD's own settings are checked."""
        if isinstance(param_group, dict):
            merged = {**self.defaults, **param_group}
            check_settings(merged, len(self.param_groups))
            if merged["kfac_like"] and merged["alpha1"] != 0.0:
                warnings.warn(f"Parameter group {len(self.param_groups)} has kfac_like=True but "
                              f"was initialized with non-zero Riemannian momentum "
                              f"(alpha1={merged['alpha1']}). Setting alpha1 to zero.",
                              UserWarning, stacklevel=3)
                param_group["alpha1"] = 0.0
            elif "alpha1" in param_group:
                param_group["alpha1"] = real_number(param_group["alpha1"], "alpha1")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for name in ("structures", "preconditioner_dtype"):  # tuples: the hooks compare them
            group[name] = tuple(group[name])
        if not callable(group["lr_cov"]):
            group["lr_cov"] = hyperparameter_tensor(group["lr_cov"], group["params"])

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        """The core's checks, then SINGD's own settings, which are read again only when one of
        them is another object than the one that passed (or lr_cov, a tensor, was written)."""
        super()._check_group(index, group)
        if route.compiled():
            return
        values = [group[name] for name in _SETTINGS]
        lr_cov = group["lr_cov"]
        version = lr_cov._version if isinstance(lr_cov, Tensor) and not lr_cov.is_inference() else None
        seen = self._settings_checked.get(id(group))
        if (seen is not None and seen[0] is group and version is not None and seen[2] == version
                and all(map(operator.is_, values, seen[1]))):
            return
        check_settings(group, index)
        self._check_built(group, index)
        if isinstance(group["structures"], tuple) and isinstance(group["preconditioner_dtype"], tuple):
            self._settings_checked[id(group)] = (group, values, version)  # (a list can change in place)

    def _check_built(self, group: dict[str, Any], index: int, where: str = "") -> None:
        """The settings that decide the factors' layout must stay what the factors were built
        with (the settings themselves are checked already)."""
        where = f"{where}param group {index}: "
        structures, dtypes, momenta = self._built[index]
        for name, built in (("structures", structures), ("preconditioner_dtype", dtypes)):
            if tuple(group[name]) != built:
                raise ValueError(f"{where}{name} is {tuple(group[name])!r}, but the factors were "
                                 f"built with {built!r}; it is fixed at construction")
        if group["alpha1"] != 0.0 and not momenta:
            raise ValueError(f"{where}alpha1 is {group['alpha1']}, but the factors were built "
                             "with alpha1 = 0 (no Riemannian momentum kept); a zero alpha1 is "
                             "fixed at construction")
        if group["kfac_like"] and group["alpha1"] != 0.0:
            raise ValueError(f"{where}kfac_like=True needs alpha1 = 0, got alpha1 = "
                             f"{group['alpha1']}")

    def _check_statistics_settings(self, group: dict[str, Any], index: int) -> None:
        """The settings the statistics hooks read, which a user may have set between steps:
        checked in the forward pass, before its statistics are taken (the step checks the rest)."""
        where = f"param group {index}: "
        check_int(group["T"], f"{where}T", 1)
        _check_statistics_choices(group, where)
        structures, dtypes, _ = self._built[index]
        if group["structures"] != structures or group["preconditioner_dtype"] != dtypes:
            check_settings(group, index)
            self._check_built(group, index)

