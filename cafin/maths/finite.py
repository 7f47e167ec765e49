"""Whether tensors hold only finite values, without a tensor of their size."""
from __future__ import annotations

import torch


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A bool per tensor (a [len(tensors)] device tensor, no host read): every entry finite.

    From each tensor's minimum and maximum (`aminmax` propagates NaN, and an inf is an
    extreme), so it reads each tensor once and allocates two numbers per tensor, where
    `isfinite(t).all()` makes a bool tensor of t's size (and a float one's several temporaries)."""
    if not tensors:
        return torch.ones(0, dtype=torch.bool)
    ends = torch.stack([torch.stack(torch.aminmax(t)) if t.numel() else t.new_zeros(2)
                        for t in tensors])
    return torch.isfinite(ends).all(1)
