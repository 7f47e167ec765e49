"""Argument checks the members share, the hyperparameter rules (`Real`, `Pair`, `Int`, `Flag`,
`Choice`) by which `CoreOptimizer` checks and keeps the settings of its param groups, and
`checked_attribute`, a member attribute its rule checks whenever it is set."""
from __future__ import annotations

import math
from typing import Any

import torch

from . import route

def real_number(value: Any, name: str) -> float:
    """A hyperparameter as a Python float, with an error naming it when it is not a real number
    (a string from a YAML file, None, a tensor of several elements)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got a tensor of shape "
                             f"{tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor")
        return float(value.detach().cpu() if value.device.type != "meta" else math.nan)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_range(value: Any, name: str, low: float, high: float, *, low_open=False,
                high_open=False) -> float:
    """`value` as a float in the interval [low, high] (open ends as asked); infinities and NaN fail."""
    v = real_number(value, name)
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        if high == math.inf:  # no upper end: say so plainly
            raise ValueError(f"{name} must be a finite number {'>' if low_open else '>='} {low}, got {v}")
        if low == -math.inf:  # no lower end
            raise ValueError(f"{name} must be a finite number {'<' if high_open else '<='} {high}, got {v}")
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {left}{low}, {high}{right}, got {v}")
    return v


def check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def check_hyperparameter(value: Any, name: str, low: float, high: float, low_open: bool,
                         high_open: bool) -> None:
    """A hyperparameter given as a number or a 1-element real tensor, in its range."""
    check_range(value, name, low, high, low_open=low_open, high_open=high_open)


def hyperparameter_tensor(value: Any, params: list[torch.Tensor],
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 0-dim tensor on the parameters' device (the CPU for an empty group) of `dtype`, by
    default their op-math dtype: what the step reads, and what schedules update in place."""
    if dtype is None:
        dtype = torch.float64 if params and params[0].dtype == torch.float64 else torch.float32
    device = params[0].device if params else torch.device("cpu")
    if not isinstance(value, torch.Tensor):  # straight to `dtype`: no float32 detour for 0.9
        return torch.tensor(float(value), dtype=dtype, device=device)
    return value.detach().reshape(()).to(device=device, dtype=dtype).clone()


class Real:
    """A real hyperparameter in [low, high] (open ends as asked; never inf or NaN). Kept in the
    groups as a 0-dim tensor of `dtype` on the parameters' device (None: their op-math dtype), so
    schedules change it in place and a compiled step sees new values, not new constants; with
    tensor=False as a Python float (a value only the host reads)."""

    def __init__(self, low: float, high: float, low_open: bool = False, high_open: bool = False,
                 dtype: torch.dtype | None = None, tensor: bool = True) -> None:
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open
        self.dtype, self.tensor = dtype, tensor

    def check(self, value: Any, name: str) -> None:
        check_hyperparameter(value, name, self.low, self.high, self.low_open, self.high_open)

    def check_live(self, value: Any, name: str) -> None:
        """The value a group holds at a step (a schedule or a user may have put any number or
        tensor there). Values are read only where that costs no sync (numbers, CPU tensors)
        and not while compiling (they are symbolic there)."""
        if isinstance(value, torch.Tensor):
            if value.dim() != 0 or not value.is_floating_point():
                raise ValueError(f"{name} must be a number or a 0-dim float tensor, got a "
                                 f"{value.dtype} tensor of shape {tuple(value.shape)}")
            if value.device.type != "cpu" or route.compiled():
                return
        elif route.compiled():
            return
        self.check(value, name)

    def keep(self, value: Any, params: list[torch.Tensor], name: str) -> Any:
        if not self.tensor:
            return real_number(value, name)
        return hyperparameter_tensor(value, params, self.dtype)


class Pair:
    """A pair of real hyperparameters (Adam's betas), each checked and kept by its own rule."""

    def __init__(self, first: Real, second: Real) -> None:
        self.rules = (first, second)
        self.dtype = first.dtype

    def _entries(self, value: Any, name: str) -> tuple:
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise TypeError(f"{name} must be a pair of numbers (a tuple of 2), got "
                            f"{type(value).__name__} {value!r}")
        return tuple(value)

    def check(self, value: Any, name: str) -> None:
        for i, (v, rule) in enumerate(zip(self._entries(value, name), self.rules)):
            rule.check(v, f"{name}[{i}]")

    def check_live(self, value: Any, name: str) -> None:
        for i, (v, rule) in enumerate(zip(self._entries(value, name), self.rules)):
            rule.check_live(v, f"{name}[{i}]")

    def keep(self, value: Any, params: list[torch.Tensor], name: str) -> tuple:
        return tuple(rule.keep(v, params, f"{name}[{i}]")
                     for i, (v, rule) in enumerate(zip(value, self.rules)))


class Setting:
    """A setting that is not a real number (an int, a flag, a choice): kept as it is given."""
    dtype = None

    def check(self, value: Any, name: str) -> None:
        raise NotImplementedError

    def check_live(self, value: Any, name: str) -> None:
        if not route.compiled():  # a compiled step reads it as a constant
            self.check(value, name)

    def keep(self, value: Any, params: list[torch.Tensor], name: str) -> Any:
        return value


class Int(Setting):
    """An int in [low, high] (high None: no upper end)."""

    def __init__(self, low: int, high: int | None = None) -> None:
        self.low, self.high = low, high

    def check(self, value: Any, name: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < self.low or (self.high is not None and value > self.high):
            upper = "" if self.high is None else f" and <= {self.high}"
            raise ValueError(f"{name} must be an int >= {self.low}{upper}, got {value}")


class Flag(Setting):
    """True or False (an int 0/1 is not taken: a mistyped value would pass)."""

    def check(self, value: Any, name: str) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


class Choice(Setting):
    """One of a few values (strings)."""

    def __init__(self, *options: Any) -> None:
        self.options = options

    def check(self, value: Any, name: str) -> None:
        if not any(type(value) is type(option) and value == option for option in self.options):
            raise ValueError(f"{name} must be one of {', '.join(map(repr, self.options))}, "
                             f"got {value!r}")


def checked_attribute(name: str, rule: Real | Setting) -> property:
    """A member's attribute that its rule checks whenever it is set, in the constructor and
    after (`opt.TCov = 0` raises there, naming it, before any step reads it). A `Real` rule
    should have tensor=False: the value is kept as its rule keeps it (a float, an int)."""
    key = f"_{name}_value"

    def get(self):
        return getattr(self, key)

    def set_(self, value):
        rule.check(value, name)
        setattr(self, key, rule.keep(value, [], name))

    return property(get, set_, doc=f"{name}, checked when set")


def as_rule(rule: Any) -> Real | Pair | Setting:
    """A rule, or a tuple (low, high, low_open, high_open, dtype) read as a tensor `Real`."""
    return rule if isinstance(rule, (Real, Pair, Setting)) else Real(*rule)


def check_gradient(p: torch.Tensor, owner: str, where: str) -> None:
    """A parameter's gradient (if any) dense and of its parameter's shape, dtype and device, or
    an error naming `where` (kernels would reject it, or write the wrong thing)."""
    grad = p.grad
    if grad is None:
        return
    if grad.is_sparse:
        raise RuntimeError(f"{owner} does not support sparse gradients ({where})")
    if grad.shape != p.shape or grad.dtype != p.dtype or grad.device != p.device:
        raise ValueError(f"{where}: its gradient is a {grad.dtype} tensor of shape "
                         f"{tuple(grad.shape)} on {grad.device}, expected {p.dtype} of "
                         f"shape {tuple(p.shape)} on {p.device}")


def checkpoint_tensor(value: Any, what: str, shape, *, dtype: torch.dtype | None = None,
                      device: torch.device | None = None, finite: bool = True,
                      nonnegative: bool = False) -> torch.Tensor:
    """A tensor of a checkpoint, checked before anything is written: a real floating tensor of
    `shape`, finite and >= 0 where asked (in the dtype it will be kept in: a float64 value that
    overflows float32 is refused). Returned detached: copied onto `device` in `dtype` where
    either is given, else as it is."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{what} must be a real floating tensor, got "
                        f"{getattr(value, 'dtype', type(value).__name__)}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    out = value.detach()
    if dtype is not None or device is not None:
        out = out.to(device=device, dtype=dtype, copy=True)
    if finite and not bool(torch.isfinite(out).all()):
        raise ValueError(f"{what} holds non-finite (inf/NaN) values")
    if nonnegative and bool((out < 0).any()):
        raise ValueError(f"{what} holds negative values")
    return out
