"""K-FAC's settings: the constructor's argument checks (run before anything is built), the
hyperparameter rules (damping, factor_decay, kl_clip, lr: numbers or callables of the step), the
update intervals, kfac-pytorch's KAISA options as read-only properties, and `repr`."""
from __future__ import annotations

import math
import re
import warnings

import torch
from torch import nn

from ...core import Real, check_int, distributed, route
from .compat import ComputeMethod, as_enum, kaisa_options

_PRECISIONS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_PRECISION_NAMES = ", ".join(map(str, _PRECISIONS))


class Settings:
    """The settings part of `KFACPreconditioner`."""

    # numbers or callables of the step (kfac-pytorch's contract); kl_clip None: no clipping
    settings = {"damping": Real(0.0, math.inf, low_open=True),
                "factor_decay": Real(0.0, 1.0, low_open=True),
                "kl_clip": Real(0.0, math.inf, low_open=True),
                "lr": Real(0.0, math.inf)}
    optional_settings = ("kl_clip",)
    callable_settings = True

    def _check_arguments(self, model, *, factor_update_steps, inv_update_steps, damping, factor_decay,
                         kl_clip, lr, accumulation_steps, allreduce_bucket_cap_mb, assignment_strategy,
                         colocate_factors, compute_method, compute_eigenvalue_outer_product,
                         grad_worker_fraction, symmetry_aware, factor_dtype, inv_dtype, decompose_dtype,
                         skip_layers, update_factors_in_hook, backend, process_group):
        """Validate the constructor's arguments before anything is built (the schedule settings
        are stored as they are checked); returns (compute_method, kaisa options, skip patterns)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        route.check_backend(backend, "KFACPreconditioner")
        compute_method = as_enum(compute_method, ComputeMethod, "compute_method")
        for name, flag in (("compute_eigenvalue_outer_product", compute_eigenvalue_outer_product),
                           ("update_factors_in_hook", update_factors_in_hook)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        kaisa = kaisa_options(
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb, assignment_strategy=assignment_strategy,
            colocate_factors=colocate_factors, grad_worker_fraction=grad_worker_fraction,
            symmetry_aware=symmetry_aware, compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product)
        for name, value in (("factor_update_steps", factor_update_steps),
                            ("inv_update_steps", inv_update_steps)):
            if not callable(value):
                check_int(value, name, 1)
        check_int(accumulation_steps, "accumulation_steps", 1)
        self._init_settings(dict(damping=damping, factor_decay=factor_decay, kl_clip=kl_clip, lr=lr))
        # The precisions the factors' statistics and EMA, and the preconditioning products, run
        # in (docs/kfac.md "Reduced precision"); float8 and the like have no GEMMs to run them.
        if inv_dtype not in _PRECISIONS:
            raise TypeError(f"inv_dtype must be one of {_PRECISION_NAMES}, got {inv_dtype!r}")
        if decompose_dtype not in (torch.float32, torch.float64):  # eigh and inv_ex take only these
            raise TypeError(f"decompose_dtype must be torch.float32 or torch.float64, got {decompose_dtype!r}")
        if factor_dtype is not None and factor_dtype not in _PRECISIONS:
            raise TypeError(f"factor_dtype must be None or one of {_PRECISION_NAMES}, got {factor_dtype!r}")
        skip_layers = _patterns(skip_layers)
        if (not callable(inv_update_steps) and not callable(factor_update_steps)
                and inv_update_steps % factor_update_steps != 0):
            warnings.warn("It is suggested that inv_update_steps be an integer multiple of "
                          "factor_update_steps", stacklevel=3)
        if process_group is not None and not distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        return compute_method, kaisa, skip_layers

    def _interval(self, name: str) -> int:
        value = getattr(self, "_" + name)
        if not callable(value):
            return value
        v = value(self.steps)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r} (returned by its callable at "
                             f"step {self.steps})")
        return v

    @property
    def factor_update_steps(self) -> int:
        return self._interval("factor_update_steps")

    @property
    def inv_update_steps(self) -> int:
        return self._interval("inv_update_steps")

    # kfac-pytorch's KAISA options, as checked at construction (compat.py).
    allreduce_bucket_cap_mb = property(lambda self: self._kaisa.allreduce_bucket_cap_mb)
    assignment_strategy = property(lambda self: self._kaisa.assignment_strategy)
    colocate_factors = property(lambda self: self._kaisa.colocate_factors)
    grad_worker_fraction = property(lambda self: self._kaisa.grad_worker_fraction)
    distributed_strategy = property(lambda self: self._kaisa.distributed_strategy)
    symmetry_aware = property(lambda self: self._kaisa.symmetry_aware)


    def __repr__(self) -> str:
        items = [("accumulation_steps", self._accumulation_steps), ("backend", self.backend),
                 ("compute_method", self.compute_method), ("damping", self._values["damping"]),
                 ("factor_decay", self._values["factor_decay"]),
                 ("factor_update_steps", self._factor_update_steps),
                 ("inv_update_steps", self._inv_update_steps), ("kfac_approx", self.kfac_approx),
                 ("kl_clip", self._values["kl_clip"]),
                 ("layers", len(self._layers)), ("lr", self._values["lr"]),
                 ("update_factors_in_hook", self._update_factors_in_hook)]
        return "KFACPreconditioner(\n" + "\n".join(f"  {k}={v}," for k, v in items) + "\n)"


def _patterns(skip_layers) -> list[str]:
    """skip_layers as a list of regular expressions (a single string is one pattern)."""
    if skip_layers is None:
        return []
    patterns = [skip_layers] if isinstance(skip_layers, str) else skip_layers
    try:
        patterns = list(patterns)
    except TypeError:
        raise TypeError(f"skip_layers must be a string or a list of strings, got {skip_layers!r}") from None
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"skip_layers must be a string or a list of strings, got the entry {p!r}")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"skip_layers holds an invalid regular expression {p!r}: {e}") from None
    return patterns
