"""K-FAC's ops in plain PyTorch: the semantics of the fused ops of the same names
(cafin/ops/kfac.py), and the reusable pieces of K-FAC preconditioning (decompositions and the
preconditioned gradient) that two-level K-FAC builds on.

Layouts: a layer's factors are A [groups, d_a, d_a] and G [groups, d_g, d_g]; its gradient as a
matrix is [groups, d_g, d_a] with the bias gradient as the last column (cafin.factors).
"""
from __future__ import annotations

import torch

__all__ = [
    "kfac_factor_ema_", "kfac_eigen_scale_", "kfac_precondition_apply_",
    "eigen_decompose", "damped_inverse", "eigen_precondition", "inverse_precondition",
    "kl_clip_scale",
]


def _due(step, interval):
    """k % interval == 0 as a device bool (True when the host decided: step is None)."""
    if step is None:
        return None
    return torch.remainder(step, interval) == 0


# ------------------------------------------------------------------------------------- ops
def kfac_factor_ema_(factors: list[torch.Tensor], stats: list[torch.Tensor],
                     counts: list[torch.Tensor], decay: torch.Tensor,
                     step: torch.Tensor | None = None, interval: int = 1) -> None:
    """Fold accumulated statistics into the factors and empty the statistics.

    Per i with counts[i] > 0, every entry of stats[i] finite (a GradScaler overflow step's
    statistics hold inf: they are dropped, never folded) and, with `step` given,
    step % interval == 0:
    factors[i] <- decay * factors[i] + (1 - decay) * (S + S^T) / (2 * counts[i]) with
    S = stats[i] (a sum of counts[i] covariances, symmetrised as kfac-pytorch does each one).
    stats and counts are zeroed either way."""
    due = _due(step, interval)
    for f, s, c in zip(factors, stats, counts):
        sym = (s + s.transpose(-1, -2)) / 2
        new = decay.to(f.dtype) * f + (1 - decay.to(f.dtype)) * (sym / c.clamp_min(1).to(f.dtype))
        keep = (c > 0) & torch.isfinite(s).all()
        if due is not None:
            keep = keep & due
        f.copy_(torch.where(keep, new, f))
        s.zero_()
        c.zero_()


def kfac_eigen_scale_(v: list[torch.Tensor], dg: list[torch.Tensor], da: list[torch.Tensor],
                      damping: torch.Tensor) -> None:
    """v[i] [groups, m, n] <- v[i] / (dg[i][:, :, None] * da[i][:, None, :] + damping)."""
    for x, g, a in zip(v, dg, da):
        x.div_(g.unsqueeze(-1) * a.unsqueeze(-2) + damping.to(x.dtype))


def kl_clip_scale(vg_sum: torch.Tensor, kl_clip: torch.Tensor) -> torch.Tensor:
    """min(1, sqrt(kl_clip / |vg_sum|)), 1 when the sum is 0 (kfac-pytorch's rule), on the device.
    A NaN kl_clip (a kl_clip callable that returned None: clipping off) gives 1, as the kernels do."""
    one = torch.ones_like(vg_sum)
    safe = torch.where(vg_sum == 0, one, vg_sum.abs())
    scale = torch.sqrt(kl_clip.to(vg_sum.dtype) / safe)
    return torch.where((vg_sum == 0) | ~(scale < 1), one, scale)


def kfac_precondition_apply_(weight_grads: list[torch.Tensor], bias_grads: list[torch.Tensor],
                             precond: list[torch.Tensor], lr: torch.Tensor,
                             kl_clip: torch.Tensor | None = None) -> None:
    """Write the preconditioned gradients, KL-clipped, over the gradients.

    precond[i] is layer i's preconditioned gradient [groups, d_g, d_a] in its gradients' dtype,
    the last column its bias when bias_grads[i] is not empty. With kl_clip given,
    nu = min(1, sqrt(kl_clip / |lr^2 sum_i <precond_i, grad_i>|)) (1 when the sum is 0 or
    kl_clip is NaN),
    computed from the gradients before they are overwritten, and every gradient becomes
    nu * precond; without it, precond."""
    pieces = []
    for w, b, v in zip(weight_grads, bias_grads, precond):
        rows = v.shape[0] * v.shape[1]
        flat = v.reshape(rows, v.shape[2])
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
            vg = vg + (p.to(acc) * g.to(acc)).sum()
        vg = vg * lr.to(acc) ** 2
        scale = kl_clip_scale(vg, kl_clip)
    for g, p in pieces:
        g.copy_(p if scale is None else p * scale.to(p.dtype))


# ------------------------------------------------------------------ reusable K-FAC pieces
def eigen_decompose(factor: torch.Tensor, *, decompose_dtype: torch.dtype = torch.float32,
                    out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, Q) of symmetric factors [..., d, d]: eigh on a `decompose_dtype` copy (kfac-pytorch
    decomposes a float32 copy), cast to `out_dtype`, eigenvalues clamped at 0."""
    d, q = torch.linalg.eigh(factor.to(decompose_dtype))
    return d.to(out_dtype).clamp(min=0.0), q.to(out_dtype)


def damped_inverse(factor: torch.Tensor, damping, *, decompose_dtype: torch.dtype = torch.float32,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(F + damping I)^-1 of factors [..., d, d]: damping added in the factor's dtype, inverted
    in `decompose_dtype` with inv_ex (no host sync), cast to `out_dtype`."""
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    damped = factor + eye * (damping.to(factor.dtype) if isinstance(damping, torch.Tensor) else damping)
    return torch.linalg.inv_ex(damped.to(decompose_dtype))[0].to(out_dtype)


def eigenvalue_reciprocal(dg: torch.Tensor, da: torch.Tensor, damping) -> torch.Tensor:
    """1 / (dg da^T + damping), [groups, d_g, d_a]: compute_eigenvalue_outer_product."""
    return 1.0 / (dg.unsqueeze(-1) * da.unsqueeze(-2) + damping)


def eigen_precondition(grad: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor, *,
                       dgda: torch.Tensor | None = None, da: torch.Tensor | None = None,
                       dg: torch.Tensor | None = None, damping=None, scale_=None) -> torch.Tensor:
    """Q_G [(Q_G^T grad Q_A) (*) dgda] Q_A^T, or with (dg da^T + damping) divided out when
    dgda is None; grad [groups, d_g, d_a] in the decomposition's dtype."""
    v = torch.matmul(torch.matmul(qg.transpose(-1, -2), grad), qa)
    if dgda is not None:
        v.mul_(dgda)
    elif scale_ is not None:
        scale_([v], [dg], [da], damping)
    else:
        v.div_(dg.unsqueeze(-1) * da.unsqueeze(-2) + damping)
    return torch.matmul(torch.matmul(qg, v), qa.transpose(-1, -2))


def inverse_precondition(grad: torch.Tensor, a_inv: torch.Tensor, g_inv: torch.Tensor) -> torch.Tensor:
    """G^-1 grad A^-1."""
    return torch.matmul(torch.matmul(g_inv, grad), a_inv)
