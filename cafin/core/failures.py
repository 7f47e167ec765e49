"""What the members do about numbers that went wrong: statistics dropped for holding inf/NaN are
counted (`DropCounts`) and reported (`NonFiniteStatisticsWarning`), and an eigendecomposition that
failed is reported (`EigendecompositionWarning`)."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from . import route


class EigendecompositionWarning(UserWarning):
    """A factor's eigendecomposition failed in its dtype and in float64: its layer keeps its
    previous eigenbasis."""


class NonFiniteStatisticsWarning(RuntimeWarning):
    """Statistics (or a curvature update made of them) held inf/NaN: they were dropped and the
    curvature keeps its previous values. Every member counts the drops (`DropCounts`)."""


class DropCounts:
    """Statistics dropped because they held inf/NaN, counted per device in 0-dim float32 tensors
    that exist before any compile or capture and are marked static, so that compiled and captured
    steps add to them without a sync. `total()` reads them (a sync off the CPU)."""

    def __init__(self) -> None:
        self.counts: dict[torch.device, torch.Tensor] = {}
        self.reported = 0  # of the CPU counts' total

    def report(self, message: Callable[[int], str], stacklevel: int) -> None:
        """Warn (`NonFiniteStatisticsWarning`, `message(n)`) of the n drops counted on the CPU
        since the last report, where reading them costs no sync: an eager call. Drops counted
        while compiled or captured are reported by the next eager call; CUDA counts are read only
        when asked (each member's count property)."""
        if not route.eager():
            return
        total = self.total(cpu_only=True)
        if total > self.reported:
            warnings.warn(message(total - self.reported), NonFiniteStatisticsWarning,
                          stacklevel=stacklevel + 1)
            self.reported = total

    def counter(self, device: torch.device) -> torch.Tensor:
        """The count of `device`, created (and marked static) on first use."""
        if device not in self.counts:
            self.counts[device] = torch.zeros((), device=device)
            torch._dynamo.mark_static_address(self.counts[device], guard=False)
        return self.counts[device]

    def total(self, cpu_only: bool = False) -> int:
        return int(sum(c.item() for d, c in self.counts.items() if not cpu_only or d.type == "cpu"))
