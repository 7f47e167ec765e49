"""The base of the members that rewrite `.grad` and leave the update to a torch optimizer
(`KFACPreconditioner`, `TwoLevelKFAC`): what they share with each other and with the
optimizer members, so that each member's file keeps only its statistics and its update rule.

- Settings (damping, decays, clipping): numbers, or kfac-pytorch-style callables of the step
  where a member allows them, each checked by its `Real` rule when it is set and, for a
  callable, when it is called. The ops read them as 0-dim float64 tensors on every layer device,
  marked static: a compiled step sees new values, not new constants, and does not recompile.
  Each setting is a property: `precond.damping = 0.01` checks, then fills the tensors.
- The step counter (`cafin.core.steps.StepCounter`) and the statistics hooks, held weakly: a
  deleted preconditioner is freed and its hooks removed.
- Copies: `copy.deepcopy` copies the model with the preconditioner (or uses the model's copy
  when one deepcopy call copies both) and hooks the copy to it; backends and the process group
  are shared.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from . import route
from .checks import Real, real_number
from .copies import HookOwner, copy_member
from .discovery import Layer
from .hooks import Hooks
from .steps import Captured, StepCounter


class Preconditioner(HookOwner, Captured):
    """A member sets `settings` (name -> `Real` rule) and, where kfac-pytorch takes callables of
    the step, `callable_settings = True`; `optional_settings` may be None (off: NaN in their
    tensors). It calls `_init_settings(values)` and `_start(layers)` in its constructor, and
    `_refresh_settings()` where a step (or a hook) first reads this step's values."""

    settings: dict[str, Real] = {}
    optional_settings: tuple[str, ...] = ()
    callable_settings = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls.settings:
            if name not in cls.__dict__:
                setattr(cls, name, property(lambda self, n=name: self._current(n),
                                            lambda self, v, n=name: self._set(n, v),
                                            doc=f"{name}: a number" + (" or a callable of the step"
                                                                       if cls.callable_settings else "")))

    # ------------------------------------------------------------------ settings
    def _check_setting(self, name: str, value: Any, where: str = "") -> None:
        """A setting's value in its range; `where` says where the value came from."""
        if value is None and name in self.optional_settings:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
            kind = "a number or a callable of the step" if self.callable_settings else "a number"
            raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}{where}")
        try:
            self.settings[name].check(value, name)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e}{where}") from None

    def _init_settings(self, values: dict[str, Any]) -> None:
        """Check the constructor's values (callables are checked when called)."""
        for name, value in values.items():
            if callable(value) and not isinstance(value, torch.Tensor):
                if not self.callable_settings:
                    raise TypeError(f"{name} must be a number, got a callable")
            else:
                self._check_setting(name, value)
        self._values = dict(values)
        self._tensors: dict[torch.device, dict[str, torch.Tensor]] = {}
        # Whether the tensors of callable settings must be refilled for the current step count
        # (done, after checking every value, before the next eager use).
        self._stale = True

    def _current(self, name: str):
        """A setting's value at the current step count (a callable's result, checked)."""
        value = self._values[name]
        if not callable(value) or isinstance(value, torch.Tensor):
            return value
        k = self._steps.value()
        v = value(k)
        self._check_setting(name, v, f" (returned by its callable at step {k})")
        return v

    def _settings_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The 0-dim float64 tensors the ops read on `device` (float64: a Python float exactly).
        Made for every layer device in the constructor: a compiled step cannot create them."""
        if device not in self._tensors:
            ts = {}
            for name in self.settings:
                ts[name] = torch.tensor(_as_float(self._current(name)), dtype=torch.float64, device=device)
                torch._dynamo.mark_static_address(ts[name], guard=False)
            self._tensors[device] = ts
        return self._tensors[device]

    def _refresh_settings(self, quiet: bool = False) -> None:
        """Refill the tensors of callable settings for the current step count (eager only: a
        compiled step reads the tensors as they are). Every callable is called and checked
        before any tensor is written; with `quiet`, a bad value leaves them stale (the next
        eager use raises)."""
        if route.compiled() or not self._stale:
            return
        try:
            values = {name: self._current(name) for name, v in self._values.items()
                      if callable(v) and not isinstance(v, torch.Tensor)}
        except (TypeError, ValueError):
            if quiet:
                return
            raise
        for name, v in values.items():
            for ts in self._tensors.values():
                ts[name].fill_(_as_float(v))
        self._stale = False

    def _set(self, name: str, value: Any) -> None:
        if callable(value) and not isinstance(value, torch.Tensor):
            if not self.callable_settings:
                raise TypeError(f"{name} must be a number, got a callable")
            self._values[name] = value
            self._stale = True
            return
        self._check_setting(name, value)
        self._values[name] = value.detach().reshape(()).clone() if isinstance(value, torch.Tensor) else value
        for ts in self._tensors.values():
            ts[name].fill_(_as_float(value))

    def _numeric_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records: those that are not callables, as Python numbers."""
        return {name: (None if v is None else float(v)) for name, v in self._values.items()
                if not (callable(v) and not isinstance(v, torch.Tensor))}

    # ------------------------------------------------------------------ steps and hooks
    def _start(self, layers: list[Layer]) -> None:
        """The step counter, each layer device's setting tensors and k tensor (a compiled step
        cannot create them), and the hooks."""
        self._steps = StepCounter()
        for layer in layers:
            device = layer.anchor.device
            self._settings_on(device)
            self._steps.tensor(device)
        self._hooks: Hooks | None = Hooks(self, layers)

    def __deepcopy__(self, memo):
        new = copy_member(self, memo, ("_hooks",))
        new._hooks = Hooks(new, new._layers) if self._hooks is not None else None
        return new


def _as_float(value) -> float:
    """A checked setting as the float its tensor holds (None, off: NaN)."""
    return math.nan if value is None else real_number(value, "setting")

