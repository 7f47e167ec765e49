"""DyKAF's fused ops in plain PyTorch, op for op: each function has the signature and in-place
semantics of the op of the same name in `cafin.ops` (schemas: csrc/ops.cpp) and computes what the
published TensorDyKAF computes (Vepricov/LIB, src/optimizers/tensor_dykaf.py), in the same order
of operations. They read per-step scalars (beta2, step size, lr) from 0-dim tensors and never read
a tensor value on the host. The factor maths both backends share is in `cafin.maths.dykaf`.
"""
from __future__ import annotations

from typing import Sequence

import torch


# ----------------------------------------------------------------------------------- rank-one moment
def _scalar(value, like: torch.Tensor) -> torch.Tensor:
    """A number or a 0-dim tensor as a 0-dim float64 tensor on `like`'s device."""
    return torch.as_tensor(value, dtype=torch.float64, device=like.device)


def _unit(x: torch.Tensor, norm: torch.Tensor, guard: torch.Tensor) -> torch.Tensor:
    """x / ||x||; with the guard on (> 0), a collapsed (zero) vector becomes the uniform direction,
    so the moment can grow back from later gradients instead of staying 0 (or turning NaN) for good."""
    uniform = torch.full_like(x, x.numel() ** -0.5)
    return torch.where((guard > 0) & ~(norm > 0), uniform, x / norm)


def dykaf_rank_one_(ls: Sequence[torch.Tensor], rs: Sequence[torch.Tensor],
                    gps: Sequence[torch.Tensor], beta2: torch.Tensor, guard=0.0) -> None:
    """One step of the rank-one second moment V = l r^T towards beta2*V + (1-beta2)*gp^2, by the
    parallel projector-splitting step (l and r updated from the previous unit vectors):
      l' = unit(beta2 |l||r| l^ + (1-beta2) gp^2 r^),  r' = unit(beta2 |l||r| r^ + (1-beta2) (gp^2)^T l^),
      c = beta2 (l'.l^)(r'.r^) |l||r| + (1-beta2) l'^T gp^2 r',  l, r <- sqrt(c) l', sqrt(c) r'.
    ls[i] has gps[i].shape[0] entries, rs[i] gps[i].shape[1]. guard > 0: see `_unit`."""
    for l, r, gp in zip(ls, rs, gps):
        guard = _scalar(guard, l)
        b = beta2.to(l.dtype)
        sq = gp.square()
        l_norm, r_norm = l.norm(), r.norm()
        l_hat, r_hat = _unit(l, l_norm, guard), _unit(r, r_norm, guard)
        scale = b * l_norm * r_norm
        l_new = scale * l_hat + (1 - b) * (sq @ r_hat)
        l_new = _unit(l_new, l_new.norm(), guard)
        r_new = scale * r_hat + (1 - b) * (sq.T @ l_hat)
        r_new = _unit(r_new, r_new.norm(), guard)
        # l'^T gp^2 r' as l' . (gp^2 r'): a vector-matrix product would be a GEMM whose result
        # matmul squeezes in place, a change of shape that a recorded capture (tests/capture.py)
        # cannot replay
        c = (b * (l_new @ l_hat) * (r_new @ r_hat) * l_norm * r_norm
             + (1 - b) * (l_new @ (sq @ r_new)))
        root = c.sqrt()
        l.copy_(l_new * root)
        r.copy_(r_new * root)


def dykaf_precondition_(mps: Sequence[torch.Tensor], ls: Sequence[torch.Tensor],
                        rs: Sequence[torch.Tensor], guard=0.0) -> None:
    """mp <- mp / (sqrt(l r^T) + guard), the denominator formed per element, never stored.
    guard = 0 is the published rule (no epsilon)."""
    for mp, l, r in zip(mps, ls, rs):
        denom = (l[:, None] * r[None, :]).sqrt()
        guard = _scalar(guard, mp)
        mp.div_(torch.where(guard > 0, denom + guard.to(denom.dtype), denom))


def dykaf_adam_precondition_(mps: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                             gps: Sequence[torch.Tensor], beta2: torch.Tensor, eps) -> None:
    """The full second moment: v <- beta2 v + (1-beta2) gp^2, then mp <- mp / (sqrt(v) + eps)."""
    for mp, v, gp in zip(mps, vs, gps):
        b = beta2.to(v.dtype)
        v.mul_(b).add_(gp.square() * (1 - b))
        mp.div_(v.sqrt().add_(_scalar(eps, v).to(v.dtype)))


def dykaf_apply_(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                 step_size: torch.Tensor, lr: torch.Tensor, weight_decay,
                 normalize: bool) -> None:
    """theta <- theta - step_size * u (u / (1e-30 + rms(u)) when normalize), then decoupled decay
    on the updated theta: theta <- theta - lr*weight_decay*theta (skipped when weight_decay is 0).
    step_size: one for all (0-dim) or one per parameter (a vector)."""
    sizes = step_size.unbind(0) if step_size.dim() == 1 else [step_size] * len(params)
    for p, u, step_size in zip(params, updates, sizes):
        work = u.dtype
        if normalize:
            u = u / (1e-30 + u.square().mean().sqrt())
        p.sub_((step_size.to(work) * u).to(p.dtype))
        decay = _scalar(weight_decay, p)
        decayed = p - (lr.to(work) * decay.to(work) * p.to(work)).to(p.dtype)
        p.copy_(torch.where(decay > 0, decayed, p))


def dykaf_split_normalize_(K: Sequence[torch.Tensor], M: Sequence[torch.Tensor],
                           L: Sequence[torch.Tensor], R: Sequence[torch.Tensor],
                           sigma: Sequence[torch.Tensor]) -> None:
    """The basis step of the factor split, for stacks [B, m, m] / [B, n, n] (sigma [B]):
    K <- unit(sigma L + K), M <- unit(sigma R + M), unit = divided by its Frobenius norm, per matrix.
    K and M hold g R g^T and g^T L g on entry; L and R are the unit factors."""
    for k, mm, l, r, s in zip(K, M, L, R, sigma):
        s = s.reshape(-1, 1, 1)
        for x, f in ((k, l), (mm, r)):
            x.copy_(f * s + x)
            x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True))


def dykaf_split_scale_(U: Sequence[torch.Tensor], V: Sequence[torch.Tensor],
                       L: Sequence[torch.Tensor], R: Sequence[torch.Tensor],
                       C: Sequence[torch.Tensor], sigma: Sequence[torch.Tensor]) -> None:
    """The Galerkin step of the factor split, per matrix of the stacks:
    S = sigma <L, U> <R, V> + <U, C> (C = g V g^T), then U, V <- sqrt(S) U, sqrt(S) V."""
    for u, v, l, r, c, s in zip(U, V, L, R, C, sigma):
        s = s.reshape(-1, 1, 1)
        dims = (-2, -1)
        S = (l * u).sum(dims, keepdim=True) * (r * v).sum(dims, keepdim=True) * s \
            + (u * c).sum(dims, keepdim=True)
        root = S.sqrt()
        u.mul_(root)
        v.mul_(root)
