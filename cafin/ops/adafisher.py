"""The Python face of the fused ops: typed wrappers that check their arguments with clear errors,
and the fake (meta) implementations that let torch.compile trace them.

Schemas: csrc/ops.cpp. Semantics: the function of the same name in cafin/reference/adafisher.py.
The kernels check their inputs again before writing anything, so a rejected call writes nothing.
The statistics ops leave their checks to the kernels (see the statistics section).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..core import route
from ..maths import state_dtype
from ..reference import adafisher as _reference

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

__all__ = [
    "adafisher_step_", "sumsq_stats_", "conv2d_input_stats_", "embedding_input_stats_",
    "norm_input_stats_", "norm_grad_stats_", "fisher_average_", "state_dtype",
    "statistics_workspace_numel", "StatisticsWorkspaces",
]


# ----------------------------------------------------------------------------------- checks
def _check(cond: bool, msg: str, exc: type = ValueError) -> None:
    if not cond:
        raise exc(msg)


def _check_scalar_tensor(t, name, device, dtype=None):
    _check(isinstance(t, torch.Tensor), f"{name} must be a Tensor, got {type(t).__name__}", TypeError)
    _check(t.numel() == 1 and t.dim() == 0, f"{name} must be a 0-dim tensor, got shape {tuple(t.shape)}")
    _check(t.device == device, f"{name} is on {t.device}, expected {device}")
    if dtype is not None:
        _check(t.dtype == dtype, f"{name} has dtype {t.dtype}, expected {dtype}", TypeError)


def _hyperparameter(value, name, device, dtype, valid, rule):
    """A 0-dim `dtype` tensor on `device`. A Python number is checked and wrapped (a convenience
    for direct calls: optimizers keep their hyperparameters as tensors). A tensor's value is
    checked where that costs no sync: on the CPU, eagerly (the CPU kernel checks it again)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check(valid(float(value)), f"{name} must be {rule}, got {value}")
        return torch.tensor(float(value), dtype=dtype, device=device)
    _check_scalar_tensor(value, name, device, dtype)
    if value.device.type == "cpu" and route.eager():
        _check(valid(float(value)), f"{name} must be {rule}, got {float(value)}")
    return value


# ----------------------------------------------------------------------------------- update
def adafisher_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    exp_avgs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor],
                    fisher_S: Sequence[torch.Tensor], fisher_H: Sequence[torch.Tensor],
                    h_offsets: Sequence[int], lr: torch.Tensor, beta: torch.Tensor,
                    weight_decay: torch.Tensor, damping: torch.Tensor, decoupled: bool,
                    grad_scale: torch.Tensor | None = None,
                    found_inf: torch.Tensor | None = None) -> None:
    """AdaFisher (decoupled=False) or AdaFisherW (decoupled=True) update of one bucket of
    parameters (one device, one dtype), in place: params and exp_avgs are written.

    lr is a 0-dim tensor of the op-math dtype (float64 for float64 parameters, float32
    otherwise), beta, weight_decay and damping 0-dim float64 tensors (numbers are accepted), all
    on the parameters' device: read on the device, so a schedule that changes them neither syncs
    nor recompiles."""
    n = len(params)
    lists = dict(grads=grads, exp_avgs=exp_avgs, steps=steps, fisher_S=fisher_S,
                 fisher_H=fisher_H, h_offsets=h_offsets)
    for name, values in lists.items():
        _check(len(values) == n, f"{name} has {len(values)} entries but params has {n}")
    if n == 0:
        return  # an empty tensor list cannot be dispatched
    device, dtype = params[0].device, params[0].dtype
    _check(dtype in _FLOATS, f"params[0] has dtype {dtype}; cafin supports {list(_FLOATS)}", TypeError)
    work = state_dtype(dtype)
    _check_scalar_tensor(lr, "lr", device, work)
    f64 = torch.float64
    beta = _hyperparameter(beta, "beta", device, f64, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    damping = _hyperparameter(damping, "damping", device, f64, lambda v: 0.0 < v < math.inf,
                              "> 0 and finite")
    weight_decay = _hyperparameter(weight_decay, "weight_decay", device, f64,
                                   lambda v: 0.0 <= v < math.inf, ">= 0 and finite")
    if grad_scale is not None:
        _check_scalar_tensor(grad_scale, "grad_scale", device, torch.float32)
    if found_inf is not None:
        _check_scalar_tensor(found_inf, "found_inf", device, torch.float32)
    # Per-tensor shapes, dtypes and devices are checked by the kernel (csrc/checks.h) with the
    # same messages, before it writes anything: a Python loop here would cost more than the
    # update of a small model.
    torch.ops.cafin.adafisher_step_(list(params), list(grads), list(exp_avgs), list(steps),
                                    list(fisher_S), list(fisher_H), list(h_offsets), lr, beta,
                                    weight_decay, damping, decoupled, grad_scale, found_inf)


@torch.library.register_fake("cafin::adafisher_step_")
def _adafisher_step_fake(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets, lr, beta,
                         weight_decay, damping, decoupled, grad_scale=None, found_inf=None):
    torch._check(len(grads) == len(params) and len(exp_avgs) == len(params))
    torch._check(len(steps) == len(params) and len(h_offsets) == len(params))
    torch._check(len(fisher_S) == len(params) and len(fisher_H) == len(params))
    for p, g, m in zip(params, grads, exp_avgs):
        torch._check(g.shape == p.shape and m.shape == p.shape)
    return None


# ----------------------------------------------------------------------------------- statistics
# The statistics run in forward and backward hooks, many per step: their arguments are checked by
# the kernels (csrc/checks.h, the same conditions, exception types and messages, before anything is
# written), not again here, which would cost more than the statistic of a small layer. Only what
# cannot reach a kernel (a non-tensor) is caught here.
def _check_tensors(stat, x) -> None:
    if not (isinstance(stat, torch.Tensor) and isinstance(x, torch.Tensor)):
        raise TypeError("stat and the input must be Tensors")


# The statistics ops take an optional `workspace`, their scratch on CUDA: with one kept by the
# caller, a call allocates nothing and a channel statistic (sumsq, norm input, norm grad) is one
# launch, where without one each call allocates its own (and a channel statistic zeroes it).
_WORKSPACE_ITEMS_PER_CHANNEL = 64  # csrc/checks.h: kWorkspaceItemsPerChannel
_WORKSPACE_MIN_PARTIALS = 32768    # csrc/checks.h: kWorkspaceMinPartials


def statistics_workspace_numel(channels: int) -> int:
    """Elements of the workspace of a channel statistic over `channels` channels (sumsq and norm
    grad: the product of dims [start_dim, end_dim); norm input: x.shape[1]).

    A workspace is a contiguous 1-D tensor of exactly this many elements, of the stat's dtype and
    device, created as zeros (`torch.zeros`). Its tail counts the blocks of a call, and every call
    leaves that tail at zero again; the rest holds partial sums, so a workspace serves one channel
    count, and one stream at a time. The CPU kernels need none (they check it and leave it)."""
    return max(_WORKSPACE_ITEMS_PER_CHANNEL * channels, _WORKSPACE_MIN_PARTIALS) + 2 * channels + 1


class StatisticsWorkspaces:
    """The statistics ops of `impl` (cafin.ops), with a kept workspace for every CUDA call: for a
    channel statistic one per device, stream, dtype and channel count, for a Conv2d input one per
    device, stream, dtype and C*H*W; each created at its first call. The other ops (and every CPU
    call) go to `impl` unchanged."""

    def __init__(self, impl) -> None:
        self._impl = impl
        self._kept: dict[tuple, torch.Tensor] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not set yet (a copy being built): no delegation
            raise AttributeError(name)
        return getattr(self._impl, name)

    def workspace(self, stat: torch.Tensor, channels: int, positions: int | None = None) -> torch.Tensor | None:
        """The kept workspace for a call on `stat` over `channels` channels (or, for a Conv2d
        input, of `positions` = C*H*W); None off CUDA and under torch.compile's trace (where the
        op's own one is functional)."""
        if stat.device.type != "cuda" or route.compiled():
            return None
        stream = torch.cuda.current_stream(stat.device).cuda_stream
        key = (stat.device, stream, stat.dtype, channels, positions)
        kept = self._kept.get(key)
        if kept is None:
            numel = statistics_workspace_numel(channels) if positions is None else positions
            kept = torch.zeros(numel, dtype=stat.dtype, device=stat.device)
            self._kept[key] = kept
        return kept

    def conv2d_input_stats_(self, stat, x, kernel_size, stride, padding, dilation, groups, append_one,
                            step=None, interval=1):
        workspace = self.workspace(stat, 0, math.prod(x.shape[1:])) if x.dim() == 4 else None
        self._impl.conv2d_input_stats_(stat, x, kernel_size, stride, padding, dilation, groups, append_one,
                                       step, interval, workspace)

    def sumsq_stats_(self, stat, x, start_dim, end_dim, append_one, step=None, interval=1):
        workspace = self.workspace(stat, math.prod(x.shape[start_dim:end_dim]))
        self._impl.sumsq_stats_(stat, x, start_dim, end_dim, append_one, step, interval, workspace)

    def norm_input_stats_(self, stat, x, step=None, interval=1):
        workspace = self.workspace(stat, x.shape[1]) if x.dim() >= 2 else None
        self._impl.norm_input_stats_(stat, x, step, interval, workspace)

    def norm_grad_stats_(self, stat, g, start_dim, end_dim, step=None, interval=1):
        workspace = self.workspace(stat, math.prod(g.shape[start_dim:end_dim]))
        self._impl.norm_grad_stats_(stat, g, start_dim, end_dim, step, interval, workspace)


def sumsq_stats_(stat: torch.Tensor, x: torch.Tensor, start_dim: int, end_dim: int,
                 append_one: bool, step: torch.Tensor | None = None, interval: int = 1,
                 workspace: torch.Tensor | None = None) -> None:
    """stat[c] += mean of x^2 over every dim outside [start_dim, end_dim) (flattened into c);
    with append_one one more entry += 1 (a bias input); the last entry counts contributions.
    `workspace`: see `statistics_workspace_numel`."""
    _check_tensors(stat, x)
    torch.ops.cafin.sumsq_stats_(stat, x, start_dim, end_dim, append_one, step, interval, workspace)


@torch.library.register_fake("cafin::sumsq_stats_")
def _sumsq_stats_fake(stat, x, start_dim, end_dim, append_one, step=None, interval=1, workspace=None):
    torch._check(stat.dim() == 1)
    return None


def conv2d_input_stats_(stat: torch.Tensor, x: torch.Tensor, kernel_size: Sequence[int],
                        stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                        groups: int, append_one: bool, step: torch.Tensor | None = None,
                        interval: int = 1, workspace: torch.Tensor | None = None) -> None:
    """Conv2d input side without unfold: stat[(c,i,j)] += sum over batch, group and output position
    of the squared patch entry, / (B*oh*ow*D); padding is [top, bottom, left, right] of zeros.
    `workspace`: where the CUDA kernels keep X2 (the batch's sum of x^2 per position), a contiguous
    1-D tensor of C*H*W elements of the stat's dtype (any values: every entry is written before
    it is read); without one a CUDA call allocates it. The CPU kernels need none."""
    _check_tensors(stat, x)
    torch.ops.cafin.conv2d_input_stats_(stat, x, list(kernel_size), list(stride), list(padding),
                                        list(dilation), groups, append_one, step, interval, workspace)


@torch.library.register_fake("cafin::conv2d_input_stats_")
def _conv2d_input_stats_fake(stat, x, kernel_size, stride, padding, dilation, groups, append_one,
                             step=None, interval=1, workspace=None):
    torch._check(x.dim() == 4 and stat.dim() == 1)
    return None


def embedding_input_stats_(stat: torch.Tensor, indices: torch.Tensor, scale_grad_by_freq: bool = False,
                           step: torch.Tensor | None = None, interval: int = 1) -> None:
    """Embedding input side: stat[v] += (count of token v in `indices`) / N, or 1/N for every
    token present with scale_grad_by_freq; the last entry counts contributions.

    No kernel: the statistic is one scatter of ones, which torch already runs in one pass; this
    checks the arguments and runs the plain-PyTorch function of the same name."""
    _check_tensors(stat, indices)
    _check(indices.dtype in (torch.int64, torch.int32),
           f"indices must be int64 or int32, got {indices.dtype}", TypeError)
    # A compiled forward traces this inside a gradient hook, where Dynamo refuses a stride query:
    # there the caller is AdaFisher, whose statistics are contiguous by construction.
    _check(stat.dtype in (torch.float32, torch.float64) and stat.dim() == 1 and stat.numel() >= 2
           and (route.compiled() or stat.is_contiguous()),
           "stat must be a contiguous 1-D float32/float64 tensor of num_embeddings + 1 entries")
    _check(stat.device == indices.device,
           f"stat is on {stat.device} but the indices are on {indices.device}")
    _check(indices.numel() > 0, "embedding_input_stats_: the indices are empty")
    if step is not None:
        _check_scalar_tensor(step, "step", stat.device, torch.float32)
    _reference.embedding_input_stats_(stat, indices, scale_grad_by_freq, step, interval)


def norm_input_stats_(stat: torch.Tensor, x: torch.Tensor, step: torch.Tensor | None = None,
                      interval: int = 1, workspace: torch.Tensor | None = None) -> None:
    """BatchNorm2d/LayerNorm input side: stat[:2] += [sum_t u[t]^2, T] / B^2 with
    u[t] = sum of x over every dim but 1, / (product of the dims after 1)^2. `workspace`: see
    `statistics_workspace_numel` (its channels are T = x.shape[1])."""
    _check_tensors(stat, x)
    torch.ops.cafin.norm_input_stats_(stat, x, step, interval, workspace)


@torch.library.register_fake("cafin::norm_input_stats_")
def _norm_input_stats_fake(stat, x, step=None, interval=1, workspace=None):
    torch._check(stat.dim() == 1)
    return None


def norm_grad_stats_(stat: torch.Tensor, g: torch.Tensor, start_dim: int, end_dim: int,
                     step: torch.Tensor | None = None, interval: int = 1,
                     workspace: torch.Tensor | None = None) -> None:
    """BatchNorm2d/LayerNorm gradient side: stat[c] += (sum of g over the dims outside
    [start_dim, end_dim))^2 / g.shape[0]. `workspace`: see `statistics_workspace_numel`."""
    _check_tensors(stat, g)
    torch.ops.cafin.norm_grad_stats_(stat, g, start_dim, end_dim, step, interval, workspace)


@torch.library.register_fake("cafin::norm_grad_stats_")
def _norm_grad_stats_fake(stat, g, start_dim, end_dim, step=None, interval=1, workspace=None):
    torch._check(stat.dim() == 1)
    return None


# ----------------------------------------------------------------------------------- factors
def fisher_average_(factors: Sequence[torch.Tensor], stats: Sequence[torch.Tensor],
                    skipped: torch.Tensor, gamma: torch.Tensor | float, grad_side: Sequence[bool],
                    grad_scale: torch.Tensor | None = None,
                    found_inf: torch.Tensor | None = None) -> None:
    """For every statistic with contributions: normalise its mean and fold it into the factor
    (F <- 0.1*gamma*F + 0.01*gamma*z_hat; ones the first time); NaN or inf drops it and counts in
    `skipped`. Every statistic is emptied. gamma is a 0-dim float64 tensor on the factors' device
    (a number is accepted)."""
    n = len(factors)
    _check(len(stats) == n and len(grad_side) == n,
           f"factors, stats and grad_side must have one entry each, got {n}, {len(stats)}, {len(grad_side)}")
    if n == 0:
        if isinstance(gamma, (int, float)) and not isinstance(gamma, bool):
            _check(0.0 < gamma <= 10.0, f"gamma must be in (0, 10], got {gamma}")
        return
    device = factors[0].device
    gamma = _hyperparameter(gamma, "gamma", device, torch.float64, lambda v: 0.0 < v <= 10.0, "in (0, 10]")
    _check_scalar_tensor(skipped, "skipped", device, torch.float32)
    if grad_scale is not None:
        _check_scalar_tensor(grad_scale, "grad_scale", device, torch.float32)
    if found_inf is not None:
        _check_scalar_tensor(found_inf, "found_inf", device, torch.float32)
    # Per-tensor checks: in the kernel (csrc/checks.h), as for adafisher_step_.
    torch.ops.cafin.fisher_average_(list(factors), list(stats), skipped, gamma,
                                    [bool(b) for b in grad_side], grad_scale, found_inf)


@torch.library.register_fake("cafin::fisher_average_")
def _fisher_average_fake(factors, stats, skipped, gamma, grad_side, grad_scale=None, found_inf=None):
    torch._check(len(stats) == len(factors) and len(grad_side) == len(factors))
    for f, s in zip(factors, stats):
        torch._check(s.numel() == f.numel() + 1)
    return None
