"""The maths both backends share: what each optimizer computes in torch whichever backend runs
its fused ops (`cafin.ops`, the kernels, or `cafin.reference`, their plain-PyTorch twins). One
module per member that has any; what several members share (`eigh.protected_eigh`, the
eigendecomposition with its retry policy as arguments) and the dtype rule every member follows.
"""
from __future__ import annotations

import torch


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of moments, factors and statistics for parameters/activations of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


from . import dykaf, eigh, kfac, singd, twolevel  # noqa: E402,F401
