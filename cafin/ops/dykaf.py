"""The Python face of the DyKAF ops: typed wrappers with clear argument checks, and the fake
implementations torch.compile traces. Schemas: csrc/ops.cpp. Semantics: the function of the same
name in cafin/reference/dykaf.py. The kernels check their arguments again before writing anything.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..core import route
__all__ = ["dykaf_rank_one_", "dykaf_precondition_", "dykaf_adam_precondition_", "dykaf_apply_",
           "dykaf_split_normalize_", "dykaf_split_scale_"]


def _check(cond: bool, msg, exc: type = ValueError) -> None:
    """Raise exc(msg) unless cond; msg is a string or a function making it (formatted only on
    failure: the checks run on every step, for every tensor)."""
    if not cond:
        raise exc(msg() if callable(msg) else msg)


def _lengths(first: str, n: int, **lists) -> None:
    for name, values in lists.items():
        _check(len(values) == n, lambda: f"{name} has {len(values)} entries but {first} has {n}")


def _text(name) -> str:
    return name() if callable(name) else name


def _scalar(t, name, device: torch.device) -> None:
    _check(isinstance(t, torch.Tensor),
           lambda: f"{_text(name)} must be a Tensor, got {type(t).__name__}", TypeError)
    _check(t.dim() == 0, lambda: f"{_text(name)} must be a 0-dim tensor, got shape {tuple(t.shape)}")
    _check(t.dtype == torch.float64,
           lambda: f"{_text(name)} has dtype {t.dtype}, expected torch.float64", TypeError)
    _check(t.device == device, lambda: f"{_text(name)} is on {t.device}, expected {device}")


def _nonnegative(value, name: str, device: torch.device) -> torch.Tensor:
    """A 0-dim float64 tensor on `device` holding a value >= 0 (a number is checked and wrapped;
    a tensor's value is checked where that costs no sync: on the CPU)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check(value >= 0, lambda: f"{name} must be >= 0, got {value}")
        return torch.tensor(float(value), dtype=torch.float64, device=device)
    _scalar(value, name, device)
    if value.device.type == "cpu" and route.eager():
        _check(float(value) >= 0, lambda: f"{name} must be >= 0, got {float(value)}")
    return value


_FLOATS = (torch.float32, torch.float64)
_PARAM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _work(t, name, like: torch.Tensor) -> None:
    if t.dtype == like.dtype and t.dtype in _FLOATS and t.device == like.device \
            and t.is_contiguous():
        return  # the usual case, decided without the checks' messages
    _check(t.dtype in (torch.float32, torch.float64),
           lambda: f"{_text(name)} must be float32 or float64, got {t.dtype}", TypeError)
    _check(t.dtype == like.dtype,
           lambda: f"{_text(name)} has dtype {t.dtype}, expected {like.dtype}", TypeError)
    _check(t.device == like.device, lambda: f"{_text(name)} is on {t.device}, expected {like.device}")
    _check(t.is_contiguous(), lambda: f"{_text(name)} must be contiguous")


def dykaf_rank_one_(l: Sequence[torch.Tensor], r: Sequence[torch.Tensor], gp: Sequence[torch.Tensor],
                    beta2: torch.Tensor, guard: torch.Tensor | float = 0.0) -> None:
    """One projector-splitting step of the rank-one second moment l r^T; writes l and r. beta2
    and guard (>= 0; a number is accepted) are 0-dim float64 tensors on gp's device."""
    _lengths("l", len(l), r=r, gp=gp)
    if not gp:
        return
    device = gp[0].device
    guard = _nonnegative(guard, "guard", device)
    _scalar(beta2, "beta2", device)
    for i, (li, ri, g) in enumerate(zip(l, r, gp)):
        _check(g.dim() == 2, lambda: f"gp[{i}] must be 2-D, got shape {tuple(g.shape)}")
        _work(g, lambda: f"gp[{i}]", g)
        _work(li, lambda: f"l[{i}]", g)
        _work(ri, lambda: f"r[{i}]", g)
        _check(li.numel() == g.shape[0],
               lambda: f"l[{i}] has {li.numel()} entries, expected {g.shape[0]}")
        _check(ri.numel() == g.shape[1],
               lambda: f"r[{i}] has {ri.numel()} entries, expected {g.shape[1]}")
    if l:
        torch.ops.cafin.dykaf_rank_one_(list(l), list(r), list(gp), beta2, guard)


def dykaf_precondition_(mp: Sequence[torch.Tensor], l: Sequence[torch.Tensor],
                        r: Sequence[torch.Tensor], guard: torch.Tensor | float = 0.0) -> None:
    """mp <- mp / (sqrt(l r^T) + guard); writes mp. guard (>= 0; a number is accepted) is a 0-dim
    float64 tensor on mp's device."""
    _lengths("mp", len(mp), l=l, r=r)
    if not mp:
        return
    guard = _nonnegative(guard, "guard", mp[0].device)
    for i, (x, li, ri) in enumerate(zip(mp, l, r)):
        _check(x.dim() == 2, lambda: f"mp[{i}] must be 2-D, got shape {tuple(x.shape)}")
        _work(x, lambda: f"mp[{i}]", x)
        _work(li, lambda: f"l[{i}]", x)
        _work(ri, lambda: f"r[{i}]", x)
        _check(li.numel() == x.shape[0] and ri.numel() == x.shape[1],
               lambda: f"l[{i}] and r[{i}] must have {x.shape[0]} and {x.shape[1]} entries, "
               f"got {li.numel()} and {ri.numel()}")
    if mp:
        torch.ops.cafin.dykaf_precondition_(list(mp), list(l), list(r), guard)


def dykaf_adam_precondition_(mp: Sequence[torch.Tensor], v: Sequence[torch.Tensor],
                             gp: Sequence[torch.Tensor], beta2: torch.Tensor,
                             eps: torch.Tensor | float) -> None:
    """v <- beta2 v + (1-beta2) gp^2, mp <- mp / (sqrt(v) + eps); writes mp and v. beta2 and eps
    (>= 0; a number is accepted) are 0-dim float64 tensors on mp's device."""
    _lengths("mp", len(mp), v=v, gp=gp)
    if not mp:
        return
    device = mp[0].device
    eps = _nonnegative(eps, "eps", device)
    _scalar(beta2, "beta2", device)
    for i, (x, vi, g) in enumerate(zip(mp, v, gp)):
        _work(x, lambda: f"mp[{i}]", x)
        _work(vi, lambda: f"v[{i}]", x)
        _work(g, lambda: f"gp[{i}]", x)
        _check(vi.shape == x.shape and g.shape == x.shape,
               lambda: f"v[{i}] and gp[{i}] must have mp[{i}]'s shape {tuple(x.shape)}")
    if mp:
        torch.ops.cafin.dykaf_adam_precondition_(list(mp), list(v), list(gp), beta2, eps)


def dykaf_apply_(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                 step_size: torch.Tensor, lr: torch.Tensor, weight_decay: torch.Tensor | float,
                 normalize: bool) -> None:
    """theta <- theta - step_size * u (RMS-normalised when normalize), then decoupled decay.
    lr and weight_decay (>= 0; a number is accepted) are 0-dim float64 tensors on the
    parameters' device; step_size is one too, or a float64 vector of one per parameter."""
    _lengths("params", len(params), updates=updates)
    if not params:
        return
    device = params[0].device
    weight_decay = _nonnegative(weight_decay, "weight_decay", device)
    if isinstance(step_size, torch.Tensor) and step_size.dim() == 1:
        _check(step_size.numel() == len(params) and step_size.is_contiguous(),
               lambda: f"step_size must be a 0-dim tensor or a contiguous vector of one per "
                       f"parameter ({len(params)}), got shape {tuple(step_size.shape)}")
        _scalar(step_size[0], "step_size", device)  # its dtype and device
    else:
        _scalar(step_size, "step_size", device)
    _scalar(lr, "lr", device)
    for i, (p, u) in enumerate(zip(params, updates)):
        want = torch.float64 if p.dtype == torch.float64 else torch.float32
        if (p.dtype in _PARAM_DTYPES and u.dtype == want and p.is_contiguous() and u.is_contiguous()
                and u.numel() == p.numel() and p.device == device and u.device == device):
            continue  # the usual case, decided without the checks' messages
        _check(p.dtype in _PARAM_DTYPES, lambda: f"params[{i}] has dtype {p.dtype}", TypeError)
        _check(p.is_contiguous(), lambda: f"params[{i}] must be contiguous")
        _check(p.device == device, lambda: f"params[{i}] is on {p.device}, expected {device}")
        _check(u.dtype == want, lambda: f"updates[{i}] has dtype {u.dtype}, expected {want}",
               TypeError)
        _check(u.is_contiguous(), lambda: f"updates[{i}] must be contiguous")
        _check(u.numel() == p.numel() and u.device == p.device,
               lambda: f"updates[{i}] must have params[{i}]'s size and device")
    if params:
        torch.ops.cafin.dykaf_apply_(list(params), list(updates), step_size, lr, weight_decay,
                                     bool(normalize))


@torch.library.register_fake("cafin::dykaf_rank_one_")
def _(l, r, gp, beta2, guard):
    return None


@torch.library.register_fake("cafin::dykaf_precondition_")
def _(mp, l, r, guard):
    return None


@torch.library.register_fake("cafin::dykaf_adam_precondition_")
def _(mp, v, gp, beta2, eps):
    return None


@torch.library.register_fake("cafin::dykaf_apply_")
def _(params, updates, step_size, lr, weight_decay, normalize):
    return None


def _stacks(op: str, sigma, **lists) -> None:
    names = list(lists)
    first = lists[names[0]]
    _lengths(names[0], len(first), **{k: v for k, v in lists.items() if k != names[0]}, sigma=sigma)
    for i, x in enumerate(first):
        B = x.shape[0]
        if all(t.dim() == 3 and t.shape[0] == B and t.shape[1] == t.shape[2]
               and t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
               for t in (lists[name][i] for name in names)) \
                and x.dtype in _FLOATS and sigma[i].numel() == B and sigma[i].dtype == x.dtype \
                and sigma[i].device == x.device and sigma[i].is_contiguous():
            continue  # the usual case, decided without the checks' messages
        for name in names:
            t = lists[name][i]
            _work(t, lambda: f"{name}[{i}]", x)
            _check(t.dim() == 3 and t.shape[0] == x.shape[0] and t.shape[1] == t.shape[2],
                   lambda: f"{op}: {name}[{i}] must be a [{x.shape[0]}, d, d] stack, got shape "
                           f"{tuple(t.shape)}")
        _work(sigma[i], lambda: f"sigma[{i}]", x)
        _check(sigma[i].numel() == x.shape[0],
               lambda: f"sigma[{i}] has {sigma[i].numel()} entries, expected {x.shape[0]}")


def _same_shape(a, b, na: str, nb: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        _check(x.shape == y.shape,
               lambda: f"{na}[{i}] has shape {tuple(x.shape)} but {nb}[{i}] has shape "
                       f"{tuple(y.shape)}")


def dykaf_split_normalize_(K: Sequence[torch.Tensor], M: Sequence[torch.Tensor],
                           L: Sequence[torch.Tensor], R: Sequence[torch.Tensor],
                           sigma: Sequence[torch.Tensor]) -> None:
    """K <- unit(sigma L + K), M <- unit(sigma R + M) per matrix of [B, d, d] stacks; writes K, M."""
    _stacks("dykaf_split_normalize_", sigma, K=K, M=M, L=L, R=R)
    _same_shape(K, L, "K", "L")
    _same_shape(M, R, "M", "R")
    if K:
        torch.ops.cafin.dykaf_split_normalize_(list(K), list(M), list(L), list(R), list(sigma))


def dykaf_split_scale_(U: Sequence[torch.Tensor], V: Sequence[torch.Tensor],
                       L: Sequence[torch.Tensor], R: Sequence[torch.Tensor],
                       C: Sequence[torch.Tensor], sigma: Sequence[torch.Tensor]) -> None:
    """S = sigma <L,U><R,V> + <U,C>, U, V <- sqrt(S) U, sqrt(S) V per matrix; writes U, V."""
    _stacks("dykaf_split_scale_", sigma, U=U, V=V, L=L, R=R, C=C)
    _same_shape(U, L, "U", "L")
    _same_shape(U, C, "U", "C")
    _same_shape(V, R, "V", "R")
    if U:
        torch.ops.cafin.dykaf_split_scale_(list(U), list(V), list(L), list(R), list(C), list(sigma))


@torch.library.register_fake("cafin::dykaf_split_normalize_")
def _(K, M, L, R, sigma):
    return None


@torch.library.register_fake("cafin::dykaf_split_scale_")
def _(U, V, L, R, C, sigma):
    return None
