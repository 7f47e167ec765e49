"""The Python face of the K-FAC ops: typed wrappers with argument checks, and their fake
implementations for torch.compile. Schemas: csrc/ops.cpp. Semantics: cafin/reference/kfac.py.
Per-tensor checks run in the kernels (csrc/kfac_checks.h) before anything is written."""
from __future__ import annotations

from typing import Sequence

import torch

from ..core import route
__all__ = ["kfac_factor_ema_", "kfac_eigen_scale_", "kfac_eigen_products_", "kfac_precondition_apply_"]


def _check(cond: bool, msg, exc: type = ValueError) -> None:
    """Raise exc(msg) unless cond; msg is a string or a function making it (formatted only on
    failure: the per-tensor checks run on every step)."""
    if not cond:
        raise exc(msg() if callable(msg) else msg)


def _scalar(t, name, device, dtype):
    _check(isinstance(t, torch.Tensor), f"{name} must be a Tensor, got {type(t).__name__}", TypeError)
    _check(t.dim() == 0, f"{name} must be a 0-dim tensor, got shape {tuple(t.shape)}")
    _check(t.device == device, f"{name} is on {t.device}, expected {device}")
    _check(t.dtype == dtype, f"{name} has dtype {t.dtype}, expected {dtype}", TypeError)


def _lengths(names_and_lists):
    (first, ref), *rest = names_and_lists
    for name, xs in rest:
        _check(len(xs) == len(ref), f"{name} has {len(xs)} entries but {first} has {len(ref)}")


def kfac_factor_ema_(factors: Sequence[torch.Tensor], stats: Sequence[torch.Tensor],
                     counts: Sequence[torch.Tensor], decay: torch.Tensor,
                     step: torch.Tensor | None = None, interval: int = 1,
                     dropped: torch.Tensor | None = None) -> None:
    """factors[i] <- decay*factors[i] + (1-decay)*(S + S^T)/(2*counts[i]) where counts[i] > 0, S is
    finite (inf/NaN statistics are dropped) and, when step is given, step % interval == 0; stats
    and counts are emptied either way. `dropped`, a 0-dim float32 on the factors' device, counts
    the statistics dropped (counts[i] > 0, due, not finite)."""
    if not route.compiled():
        _lengths([("factors", factors), ("stats", stats), ("counts", counts)])
        _check(isinstance(interval, int) and interval >= 1, f"interval must be an int >= 1, got {interval!r}")
        if not factors:
            return
        _scalar(decay, "decay", factors[0].device, torch.float64)
        if step is not None:
            _scalar(step, "step", factors[0].device, torch.float32)
        if dropped is not None:
            _scalar(dropped, "dropped", factors[0].device, torch.float32)
        for i, (f, s) in enumerate(zip(factors, stats)):
            _check(s.shape == f.shape, lambda: f"stats[{i}] has shape {tuple(s.shape)}, expected {tuple(f.shape)}")
    if not factors:
        return
    torch.ops.cafin.kfac_factor_ema_(list(factors), list(stats), list(counts), decay, step, interval, dropped)


@torch.library.register_fake("cafin::kfac_factor_ema_")
def _kfac_factor_ema_fake(factors, stats, counts, decay, step=None, interval=1, dropped=None):
    torch._check(len(stats) == len(factors) and len(counts) == len(factors))
    return None


def kfac_eigen_scale_(v: Sequence[torch.Tensor], dg: Sequence[torch.Tensor], da: Sequence[torch.Tensor],
                      damping: torch.Tensor) -> None:
    """v[i] [groups, d_g, d_a] <- v[i] / (dg[i] da[i]^T + damping), per group."""
    if not route.compiled():
        _lengths([("v", v), ("dg", dg), ("da", da)])
        if v:
            _scalar(damping, "damping", v[0].device, torch.float64)
    if not v:
        return
    torch.ops.cafin.kfac_eigen_scale_(list(v), list(dg), list(da), damping)


@torch.library.register_fake("cafin::kfac_eigen_scale_")
def _kfac_eigen_scale_fake(v, dg, da, damping):
    torch._check(len(dg) == len(v) and len(da) == len(v))
    return None


def kfac_eigen_products_(grads: Sequence[torch.Tensor], works: Sequence[torch.Tensor],
                         sources: Sequence[torch.Tensor | None], qa: Sequence[torch.Tensor | None],
                         qg: Sequence[torch.Tensor], dgda: Sequence[torch.Tensor]) -> None:
    """grads[i] <- Q_G ((Q_G^T S Q_A) * dgda[i]) Q_A^T for every entry, S = sources[i] (None:
    grads[i] as it is), Q_A = qa[i] (None: the identity), Q_G = qg[i]; works[i] is scratch
    ([(groups,) d_a, d_g] with Q_A, else the shape of grads[i]). Entries are matrices
    [d_g, d_a] or stacks [groups, d_g, d_a], float32 or float64. The products are ATen's GEMMs;
    on the CPU each entry's products run on one thread and the entries are shared out over the
    threads (a product of a few hundred rows gains little from MKL's own threads)."""
    if not route.compiled():
        _lengths([("grads", grads), ("works", works), ("sources", sources), ("qa", qa), ("qg", qg),
                  ("dgda", dgda)])
    if not grads:
        return
    torch.ops.cafin.kfac_eigen_products_(list(grads), list(works), list(sources), list(qa), list(qg), list(dgda))


@torch.library.register_fake("cafin::kfac_eigen_products_")
def _kfac_eigen_products_fake(grads, works, sources, qa, qg, dgda):
    torch._check(len(works) == len(grads) and len(sources) == len(grads) and len(qa) == len(grads))
    return None


def kfac_precondition_apply_(weight_grads: Sequence[torch.Tensor], bias_grads: Sequence[torch.Tensor],
                             precond: Sequence[torch.Tensor], lr: torch.Tensor,
                             kl_clip: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                             abs_terms: bool = False) -> None:
    """Gradients <- nu * (precond + shift[i]) (weight columns, then the bias column when
    bias_grads[i] is not empty; shift None: 0), nu = min(1, sqrt(kl_clip / |lr^2 S|)) (1 when
    S is 0, or kl_clip is None or NaN), computed on the device before any gradient is written.
    S = sum_i <precond_i + shift_i, grad_i>; with abs_terms, the sum of the absolute values of
    each weight's and each bias's term (two-level K-FAC's Fisher norm). precond[i] may be a
    view of row-aligned storage (its rows equally spaced, each contiguous)."""
    if not route.compiled():
        _lengths([("weight_grads", weight_grads), ("bias_grads", bias_grads), ("precond", precond)])
        _check(isinstance(abs_terms, bool), f"abs_terms must be a bool, got {abs_terms!r}", TypeError)
        if weight_grads:
            device = weight_grads[0].device
            _scalar(lr, "lr", device, torch.float64)
            if kl_clip is not None:
                _scalar(kl_clip, "kl_clip", device, torch.float64)
            if shift is not None:
                _check(isinstance(shift, torch.Tensor) and shift.shape == (len(precond),),
                       f"shift must be a 1-dim tensor of {len(precond)} entries (one per entry of "
                       f"precond), got {tuple(shift.shape) if isinstance(shift, torch.Tensor) else type(shift).__name__}")
                _check(shift.device == device, f"shift is on {shift.device}, expected {device}")
                _check(shift.dtype == weight_grads[0].dtype, f"shift has dtype {shift.dtype}, expected the "
                       f"gradients' {weight_grads[0].dtype}", TypeError)
            for i, (w, b, v) in enumerate(zip(weight_grads, bias_grads, precond)):
                _check(v.dtype == w.dtype, lambda: f"precond[{i}] has dtype {v.dtype}, expected the "
                       f"gradients' {w.dtype}", TypeError)
                bias = 1 if b.numel() else 0
                _check(v.dim() == 3 and v.shape[2] > bias and
                       w.numel() == v.shape[0] * v.shape[1] * (v.shape[2] - bias),
                       lambda: f"precond[{i}] of shape {tuple(v.shape)} does not match weight_grads[{i}] "
                       f"of shape {tuple(w.shape)} (bias: {bool(bias)})")
    if not weight_grads:
        return
    torch.ops.cafin.kfac_precondition_apply_(list(weight_grads), list(bias_grads), list(precond), lr, kl_clip,
                                             shift, abs_terms)


@torch.library.register_fake("cafin::kfac_precondition_apply_")
def _kfac_precondition_apply_fake(weight_grads, bias_grads, precond, lr, kl_clip=None, shift=None,
                                  abs_terms=False):
    torch._check(len(bias_grads) == len(weight_grads) and len(precond) == len(weight_grads))
    return None
