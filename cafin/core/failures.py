"""What the members do about numbers that went wrong: statistics dropped for holding inf/NaN are
counted (`DropCounts`), and an eigendecomposition that failed is reported
(`EigendecompositionWarning`)."""
from __future__ import annotations

import torch


class EigendecompositionWarning(UserWarning):
    """A factor's eigendecomposition failed in its dtype and in float64: its layer keeps its
    previous eigenbasis."""


class DropCounts:
    """Statistics dropped because they held inf/NaN, counted per device in 0-dim float32 tensors
    that exist before any compile or capture and are marked static, so that compiled and captured
    steps add to them without a sync. `total()` reads them (a sync off the CPU)."""

    def __init__(self) -> None:
        self.counts: dict[torch.device, torch.Tensor] = {}

    def counter(self, device: torch.device) -> torch.Tensor:
        """The count of `device`, created (and marked static) on first use."""
        if device not in self.counts:
            self.counts[device] = torch.zeros((), device=device)
            torch._dynamo.mark_static_address(self.counts[device], guard=False)
        return self.counts[device]

    def total(self, cpu_only: bool = False) -> int:
        return int(sum(c.item() for d, c in self.counts.items() if not cpu_only or d.type == "cpu"))
