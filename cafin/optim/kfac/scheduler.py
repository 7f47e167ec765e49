"""`LambdaParamScheduler`: kfac-pytorch 0.4.2's `kfac.scheduler.LambdaParamScheduler` for
`cafin.KFACPreconditioner`. Each `step()` multiplies the preconditioner's current value of a
hyperparameter by what its lambda returns for the step count; the intervals are then truncated
to ints, as kfac-pytorch does.

Where kfac-pytorch writes each value as it computes it (and asserts that a parameter has not
become a callable), this scheduler computes and checks every new value first and writes only when
all are valid: a bad one raises a ValueError naming the lambda and the hyperparameter and leaves
the preconditioner as it was.
"""
from __future__ import annotations

import math
from typing import Callable

from ...core import check_int, real_number
from .preconditioner import KFACPreconditioner

__all__ = ["LambdaParamScheduler"]

_INTERVALS = ("factor_update_steps", "inv_update_steps")


class LambdaParamScheduler:
    """Multiplicative schedules of a KFACPreconditioner's hyperparameters.

    Args:
        preconditioner: the KFACPreconditioner whose values are scheduled.
        factor_update_steps_lambda, inv_update_steps_lambda, damping_lambda,
        factor_decay_lambda, kl_clip_lambda, lr_lambda: callables of the step count returning
            the factor the current value is multiplied by at each `step()` (None: not
            scheduled). A hyperparameter the preconditioner holds as a callable cannot also be
            scheduled (ValueError, as kfac-pytorch), nor can kl_clip while clipping is off.

    The lambdas see `preconditioner.steps` (the number of `preconditioner.step()` calls), or the
    `step` given to `step()`. Call `step()` after `preconditioner.step()`.
    """

    def __init__(
        self,
        preconditioner: KFACPreconditioner,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        if not isinstance(preconditioner, KFACPreconditioner):
            raise TypeError(f"preconditioner must be a KFACPreconditioner, got {type(preconditioner).__name__}")
        given = dict(factor_update_steps=factor_update_steps_lambda, inv_update_steps=inv_update_steps_lambda,
                     damping=damping_lambda, factor_decay=factor_decay_lambda, kl_clip=kl_clip_lambda,
                     lr=lr_lambda)
        for name, fn in given.items():
            if fn is not None and not callable(fn):
                raise TypeError(f"{name}_lambda must be a callable of the step or None, got {fn!r}")
        self._preconditioner = preconditioner
        self._lambdas = {name: fn for name, fn in given.items() if fn is not None}
        for name in self._lambdas:
            self._check_schedulable(name)

    def _value(self, name: str):
        """The preconditioner's own (non-callable) value of `name`."""
        pre = self._preconditioner
        return getattr(pre, "_" + name) if name in _INTERVALS else pre._values[name]

    def _check_schedulable(self, name: str) -> None:
        value = self._value(name)
        if callable(value):
            raise ValueError(f"preconditioner.{name} is already a callable and cannot be updated by "
                             f"{name}_lambda")
        if value is None:  # kl_clip=None: there is no value to multiply
            raise ValueError("preconditioner.kl_clip is None (clipping off), so kl_clip_lambda has "
                             "nothing to scale")

    def step(self, step: int | None = None) -> None:
        """Multiply each scheduled value by its lambda at `step` (default: the preconditioner's
        step count). Every new value is checked before any is written."""
        pre = self._preconditioner
        k = pre.steps if step is None else check_int(step, "step", 0)
        new = {}
        for name, fn in self._lambdas.items():
            self._check_schedulable(name)
            factor = fn(k)
            what = f"{name}_lambda({k}) returned {factor!r}"
            if isinstance(factor, bool):
                raise TypeError(f"{what}; it must return a real number")
            try:
                f = real_number(factor, f"{name}_lambda({k})")
            except (TypeError, ValueError) as e:
                raise type(e)(f"{what}; it must return a real number") from None
            if not math.isfinite(f):
                raise ValueError(f"{what}; it must return a finite number")
            current = self._value(name)
            if name in _INTERVALS:
                value = int(current * f)
                if value < 1:
                    raise ValueError(f"{what}: {name} would become {value}, but {name} must be an int >= 1")
            else:
                value = real_number(current, name) * f
                try:
                    pre._check_setting(name, value)
                except ValueError as e:
                    raise ValueError(f"{what}: {e}") from None
            new[name] = value
        for name, value in new.items():
            if name in _INTERVALS:
                setattr(pre, "_" + name, value)
            else:
                setattr(pre, name, value)

    def __repr__(self) -> str:
        return f"LambdaParamScheduler({', '.join(n + '_lambda' for n in self._lambdas)})"
