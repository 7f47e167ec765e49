"""The eigendecomposition every member takes of a Kronecker factor, protected: tried in a list of
(dtype, jitter) attempts in turn, the first that succeeds kept. Each member states its policy
as the arguments (K-FAC: its decompose dtype, then float64; two-level K-FAC: the factor's dtype,
then float64, finite results only; DyKAF: the published jitters); what a member does when every
attempt fails (keep its previous basis, warn, raise) is its own."""
from __future__ import annotations

from typing import Sequence

import torch

Attempt = tuple[torch.dtype, float]


def protected_eigh(matrix: torch.Tensor, attempts: Sequence[Attempt], *, finite: bool = False,
                   errors: tuple[type[BaseException], ...] = (torch.linalg.LinAlgError,)
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(eigenvalues ascending, eigenvectors) of the symmetric `matrix` [..., n, n], from the first
    attempt (dtype, jitter) in which `torch.linalg.eigh(matrix.to(dtype) + jitter * I)` neither
    raises one of `errors` nor, with `finite`, returns an inf or NaN; in that attempt's dtype.
    None where every attempt fails. Attempts that repeat an earlier one are skipped (a float64
    factor's float64 retry would only fail again). Reading `finite` syncs with the device, as
    eigh's own error check does."""
    tried: set[Attempt] = set()
    for dtype, jitter in attempts:
        if (dtype, jitter) in tried:
            continue
        tried.add((dtype, jitter))
        m = matrix.to(dtype)
        if jitter:
            m = m + jitter * torch.eye(m.shape[-1], dtype=dtype, device=m.device)
        try:
            d, q = torch.linalg.eigh(m)
        except errors:
            continue
        if finite and not bool(torch.isfinite(d).all() & torch.isfinite(q).all()):
            continue
        return d, q
    return None
