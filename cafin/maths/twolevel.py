"""Two-level K-FAC's coarse matrix assembled the way the published code assembles it (TwolevelKFAC
of Abdoulaye-Koroko/natural-gradients), in plain PyTorch: entry by entry, each one a Fisher-vector
product, each Conv2d projection through an N' x N' matrix. It is no op's twin: the tests and the
bench measure the optimizer's cheap assembly (`cafin.TwoLevelKFAC`, backend "fused") against it.
The published Conv2d sample pairing is corrected (bug 1 in docs/twolevel.md).

Also the two decompositions an eager step makes, one matrix per call, so that tests and the bench
can count and time them: a damped factor's eigendecomposition and the coarse matrix's inverse.
"""
from __future__ import annotations

import torch

from .eigh import protected_eigh

__all__ = ["coarse_matrix_pairwise", "factor_eigh", "coarse_inverse"]


def coarse_matrix_pairwise(rows: list[torch.Tensor], grads: list[torch.Tensor], locations: list[int],
                           vectors: list[torch.Tensor], batch_size: int, damping: float,
                           symmetric: bool = True) -> torch.Tensor:
    """F_c with (F_c)_ij = <r_i, F_ij r_j> + damping * |r_i| [i == j], where layer l has rows
    [B T_l, d_in] (its inputs, with a ones column for a bias), output gradients grads [B T_l, d_out]
    (times the batch size) and coarse vector vectors[l] [d_out, d_in]:

        F_ij r_j = (1/B) sum_n G_n,i <G_n,j, r_j>,   G_n,l = sum_t grads_l[n T_l + t] rows_l[n T_l + t]^T.

    Pair by pair, as published: <G_n,j, r_j> per location as the diagonal of grads_j r_j rows_j^T
    (an N' x N' matrix, N' = B T_j), summed per sample, then the Fisher-vector product of layer i.
    `symmetric`: the lower triangle only, mirrored (published, without Krylov vectors)."""
    n = len(vectors)
    B = batch_size
    f = rows[0].new_zeros(n, n)
    for i in range(n):
        for j in range(n):
            if symmetric and j > i:
                continue
            per_location = torch.diagonal(grads[j] @ vectors[j] @ rows[j].t())
            w = per_location.reshape(B, locations[j]).sum(1)
            fv = (grads[i] * w.repeat_interleave(locations[i]).unsqueeze(1)).t() @ rows[i] / B
            f[i, j] = (vectors[i] * fv).sum()
    if symmetric:
        f = f + f.t() - torch.diag(torch.diagonal(f))
    sizes = torch.tensor([float(v.numel()) for v in vectors], dtype=f.dtype, device=f.device)
    return f + torch.diag(damping * sizes)


def factor_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The eigendecomposition (eigenvalues ascending, eigenvectors in column-major layout, as
    LAPACK returns them) of one damped Kronecker factor [n, n], or None where it fails."""
    return protected_eigh(matrix, [(matrix.dtype, 0.0)])


def coarse_inverse(f_coarse: torch.Tensor) -> torch.Tensor:
    """The inverse of the coarse matrix [n, n] (linalg.inv_ex: torch.inverse's numbers without
    its error-check sync; column-major, as LAPACK returns it)."""
    return torch.linalg.inv_ex(f_coarse)[0]
