"""The step counter (k, completed optimizer steps, on the host and on every device) and a
step's closure, run so that a closure that raises leaves no trace."""
from __future__ import annotations

import torch

from .runtime import capturing


class StepCounter:
    """k = completed optimizer steps.

    While steps run eagerly the host counts them and decides which passes take statistics, so
    nothing is launched on the other passes. A compiled step cannot keep a host count (a Python int
    it changed would be a new constant, and a recompile, every step; a tensor's version counter
    moves a backend-dependent number of times per step), and a CUDA-graph replay runs no Python at
    all: after either, the counter is "device gated" for good. Then every statistic op is launched
    on every pass with the per-device k tensor and decides on the device, and the host reads k from
    that tensor when it must (checkpoints).
    """

    def __init__(self) -> None:
        self.host = 0
        self.device_gated = False
        self.stepped = False  # whether any step ran (for the LR scheduler's call-order warning)
        self._tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _pair(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tensors:
            k = torch.full((), float(self.value()), device=device)
            # Added as a tensor: a Python 1 would become a new 0-dim tensor per call.
            one = torch.ones((), device=device)
            for t in (k, one):
                torch._dynamo.mark_static_address(t, guard=False)
            self._tensors[device] = (k, one)
        return self._tensors[device]

    def tensor(self, device: torch.device) -> torch.Tensor:
        """k on `device` (float32, 0-dim), the value device-gated ops read."""
        return self._pair(device)[0]

    def one(self, device: torch.device) -> torch.Tensor:
        return self._pair(device)[1]

    def devices(self) -> list[torch.device]:
        return list(self._tensors)

    def _latch(self) -> bool:
        """Whether decisions are made on the device from now on (latched once true)."""
        if torch.compiler.is_compiling():
            self.device_gated = True  # a store, no read: no guard, no recompile when it flips
            return True
        if not self.device_gated and capturing():
            self.device_gated = True
        return self.device_gated

    def due(self, interval: int, device: torch.device) -> tuple[bool, torch.Tensor | None]:
        """(launch, step): launch the statistics at all, and the k tensor when the op must decide
        on the device (None when the host already decided that k % interval == 0)."""
        if self._latch():
            return True, self.tensor(device)
        return self.host % interval == 0, None

    def host_due(self, interval: int) -> bool | None:
        """k % interval == 0 as the host knows it, or None once the device decides."""
        return None if self._latch() else self.host % interval == 0

    def advance(self) -> None:
        """One completed step: +1 on every device tensor (one op), and on the host when eager."""
        self.stepped = True
        if self._tensors:
            ks, ones = zip(*self._tensors.values())
            torch._foreach_add_(list(ks), list(ones))
        if not self._latch():
            self.host += 1

    def value(self) -> int:
        if self.device_gated and self._tensors:
            return int(next(iter(self._tensors.values()))[0].item())
        return self.host

    def load(self, k: int) -> None:
        self.host = k
        for t, _ in self._tensors.values():
            t.fill_(float(k))


def run_closure(closure, pass_state: list[torch.Tensor]):
    """`closure()` with grad enabled. If it raises, the tensors its passes add to (statistics
    accumulators, counters) are put back as they were: a step that raises leaves no trace."""
    saved = [t.clone() for t in pass_state]
    try:
        with torch.enable_grad():
            return closure()
    except BaseException:
        if pass_state:
            torch._foreach_copy_(pass_state, saved)
        raise
