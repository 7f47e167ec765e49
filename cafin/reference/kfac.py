"""K-FAC's fused ops in plain PyTorch, op for op: each function has the signature and in-place
semantics of the op of the same name in `cafin.ops` (schemas: csrc/ops.cpp). The preconditioning
maths both backends share is in `cafin.maths.kfac`.

Layouts: a layer's factors are A [groups, d_a, d_a] and G [groups, d_g, d_g]; its gradient as a
matrix is [groups, d_g, d_a] with the bias gradient as the last column (cafin.factors).
"""
from __future__ import annotations

import torch

from ..maths.kfac import eigen_precondition, kl_clip_scale

__all__ = ["kfac_factor_ema_", "kfac_eigen_scale_", "kfac_eigen_products_", "kfac_precondition_apply_"]


def _due(step, interval):
    """k % interval == 0 as a device bool (True when the host decided: step is None)."""
    if step is None:
        return None
    return torch.remainder(step, interval) == 0


def kfac_factor_ema_(factors: list[torch.Tensor], stats: list[torch.Tensor],
                     counts: list[torch.Tensor], decay: torch.Tensor,
                     step: torch.Tensor | None = None, interval: int = 1,
                     dropped: torch.Tensor | None = None) -> None:
    """Fold accumulated statistics into the factors and empty the statistics.

    Per i with counts[i] > 0, every entry of stats[i] finite (a GradScaler overflow step's
    statistics hold inf: they are dropped, never folded) and, with `step` given,
    step % interval == 0:
    factors[i] <- decay * factors[i] + (1 - decay) * (S + S^T) / (2 * counts[i]) with
    S = stats[i] (a sum of counts[i] covariances, symmetrised as kfac-pytorch does each one).
    stats and counts are zeroed either way. `dropped` (0-dim float32) += the number of statistics
    that would have been folded but held inf or NaN."""
    due = _due(step, interval)
    for f, s, c in zip(factors, stats, counts):
        sym = (s + s.transpose(-1, -2)) / 2
        new = decay.to(f.dtype) * f + (1 - decay.to(f.dtype)) * (sym / c.clamp_min(1).to(f.dtype))
        taken = c > 0
        if due is not None:
            taken = taken & due
        finite = torch.isfinite(s).all()
        if dropped is not None:
            dropped.add_((taken & ~finite).to(dropped.dtype))
        f.copy_(torch.where(taken & finite, new, f))
        s.zero_()
        c.zero_()


def kfac_eigen_scale_(v: list[torch.Tensor], dg: list[torch.Tensor], da: list[torch.Tensor],
                      damping: torch.Tensor) -> None:
    """v[i] [groups, m, n] <- v[i] / (dg[i][:, :, None] * da[i][:, None, :] + damping)."""
    for x, g, a in zip(v, dg, da):
        x.div_(g.unsqueeze(-1) * a.unsqueeze(-2) + damping.to(x.dtype))


def kfac_eigen_products_(grads: list[torch.Tensor], works: list[torch.Tensor],
                         sources: list[torch.Tensor | None], qa: list[torch.Tensor | None],
                         qg: list[torch.Tensor], dgda: list[torch.Tensor]) -> None:
    """grads[i] <- Q_G ((Q_G^T S Q_A) * dgda[i]) Q_A^T, S = sources[i] (None: grads[i]), Q_A = I
    where qa[i] is None; works[i] is scratch (left as the products leave it in the fused op)."""
    for g, source, q_a, q_g, d in zip(grads, sources, qa, qg, dgda):
        g.copy_(eigen_precondition(g if source is None else source, q_a, q_g, dgda=d))


def kfac_precondition_apply_(weight_grads: list[torch.Tensor], bias_grads: list[torch.Tensor],
                             precond: list[torch.Tensor], lr: torch.Tensor,
                             kl_clip: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                             abs_terms: bool = False) -> None:
    """Write the preconditioned gradients, KL-clipped, over the gradients.

    precond[i] is layer i's preconditioned gradient [groups, d_g, d_a] in its gradients' dtype,
    the last column its bias when bias_grads[i] is not empty; shift[i] (shift None: 0) is added
    to each of its entries. With kl_clip given, nu = min(1, sqrt(kl_clip / |lr^2 S|)) (1 when S
    is 0 or kl_clip is NaN), S = sum_i <precond_i + shift_i, grad_i>, or with abs_terms the sum
    over the tensors (each weight, each bias) of the absolute value of its term; computed from
    the gradients before they are overwritten, and every gradient becomes
    nu * (precond + shift); without it, precond + shift."""
    pieces = []
    for i, (w, b, v) in enumerate(zip(weight_grads, bias_grads, precond)):
        rows = v.shape[0] * v.shape[1]
        flat = v.reshape(rows, v.shape[2])
        if shift is not None:
            flat = flat + shift[i]
        if b.numel():
            pieces.append((w, flat[:, :-1].reshape(w.shape)))
            pieces.append((b, flat[:, -1].reshape(b.shape)))
        else:
            pieces.append((w, flat.reshape(w.shape)))
    scale = None
    if kl_clip is not None and pieces:
        acc = torch.float64 if pieces[0][0].dtype == torch.float64 else torch.float32
        vg = torch.zeros((), dtype=acc, device=pieces[0][0].device)
        for g, p in pieces:
            term = (p.to(acc) * g.to(acc)).sum()
            vg = vg + (term.abs() if abs_terms else term)
        vg = vg * lr.to(acc) ** 2
        scale = kl_clip_scale(vg, kl_clip)
    for g, p in pieces:
        g.copy_(p if scale is None else p * scale.to(p.dtype))
