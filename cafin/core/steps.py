"""The step counter (k, completed optimizer steps, on the host and on every device) and a
step's closure, run so that a closure that raises leaves no trace."""
from __future__ import annotations

import contextlib

import torch

from . import route


class StepCounter:
    """k = completed optimizer steps.

    The host counts the steps and decides which passes take statistics and which steps do
    curvature work, so nothing is launched on the others, eagerly and under torch.compile alike:
    a compiled step reads the host count as a guard (Dynamo makes the count symbolic once it has
    changed, so the guards are on the phase, `k % interval == 0`, not on k: a compiled step builds
    one graph per phase, not per step; `torch.compile(dynamic=False)` would specialise on every k
    and recompile every step). A member whose kernels decide on the device at no cost (AdaFisher's
    statistics exit early) may keep one graph for every phase instead (`host_decides_compiled=False`).

    A CUDA-graph replay runs no Python at all: once a step is captured the counter is "device
    gated" for good. Then every statistic op is launched on every pass with the per-device k
    tensor and decides on the device, and the host reads k from that tensor when it must
    (checkpoints).

    A device-gated counter can still be told k by the host: `cafin.StepGraphs` knows which step
    each graph it replays is, so it "pins" k while it captures (or runs eagerly) one step. Then
    `host_due(interval)` answers False on the steps the pinned k says are not due, and the work
    they would launch is not put in the graph at all: a graph is captured per phase (which
    intervals are due) and replayed only on steps of that phase. The work that is launched still
    decides on the device, as every gated step does, so a pinned step computes what an unpinned
    gated step computes.

    Whether the host may *read* a device value (a finiteness check, a warning) is another
    question, the route's (`route.eager()`): a compiled step knows k but may not read tensors.
    """

    def __init__(self, host_decides_compiled: bool = True) -> None:
        self.host = 0
        self.host_decides_compiled = host_decides_compiled
        self.device_gated = False
        self.stepped = False  # whether any step ran (for the LR scheduler's call-order warning)
        self._tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pinned: int | None = None  # k as the host knows it, set by StepGraphs per step
        self.phase: set[tuple[int, int, bool]] = set()  # the (interval, offset, due) host_due() answered
        # interval -> k % interval == 0, the passes' answer: hooks traced in a compiled model reach
        # the counter through the module, whose int attributes Dynamo takes as constants (a
        # recompile per k); a bool is two graphs at most.
        self.due_now: dict[int, bool] = {}

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
        if route.compiled() and not self.host_decides_compiled:
            self.device_gated = True  # a store, no read: no guard, no recompile when it flips
            return True
        if not self.device_gated and route.captured():
            self.device_gated = True
        return self.device_gated

    def due(self, interval: int, device: torch.device) -> tuple[bool, torch.Tensor | None]:
        """(launch, step): launch the statistics at all, and the k tensor when the op must decide
        on the device (None when the host already decided that k % interval == 0)."""
        if self._latch():
            return self.host_due(interval) is None, self.tensor(device)
        if route.compiled() and interval in self.due_now:
            return self.due_now[interval], None
        due = self.due_now[interval] = self.host_due(interval)
        return due, None

    def host_due(self, interval: int, offset: int = 0) -> bool | None:
        """(k + offset) % interval == 0 as the host knows it, or None once the device decides.
        With k pinned, a step that is not due gets False (its work is left out of the graph) and
        a due one None (its work is launched, and decides on the device as on any gated step).
        `offset`: for a count that runs alongside k (a parameter's own step count)."""
        if not self._latch():
            # A branch, not the comparison's value: under torch.compile the count is symbolic, and
            # a symbolic answer would fail the `is False` / `is None` tests members make (Dynamo's
            # bool() keeps it symbolic); the branch guards on the phase and gives a constant.
            return True if (self.host + offset) % interval == 0 else False  # noqa: SIM210
        if self.pinned is None:
            return None
        due = (self.pinned + offset) % interval == 0
        self.phase.add((interval, offset, due))
        return None if due else False

    def advance(self) -> None:
        """One completed step: +1 on every device tensor (one op), and on the host when eager."""
        self.stepped = True
        if self._tensors:
            ks, ones = zip(*self._tensors.values())
            torch._foreach_add_(list(ks), list(ones))
        if not self._latch():
            self.host += 1
            # The comparison's value, no branch: a compiled step stores it with no guard on k + 1.
            self.due_now = {t: self.host % t == 0 for t in self.due_now}

    def value(self) -> int:
        if self.device_gated and self._tensors:
            return int(next(iter(self._tensors.values()))[0].item())
        return self.host

    def load(self, k: int) -> None:
        self.host = k
        self.due_now = {t: k % t == 0 for t in self.due_now}
        for t, _ in self._tensors.values():
            t.fill_(float(k))


class Captured:
    """What cafin.StepGraphs asks of a member (a base of every member's class); the defaults
    suit a member whose every step can be captured."""

    # Why no step of this member can be captured (StepGraphs then runs them all eagerly)
    _uncapturable: str | None = None

    def _graph_settings(self) -> tuple:
        """((name, value), ...): the settings StepGraphs' graphs depend on (the intervals that
        decide a phase); a change after capture makes StepGraphs refuse the next step."""
        return ()

    def _capture_refusal(self) -> str | None:
        """Why the coming step (its k pinned by StepGraphs) cannot be captured in a CUDA graph,
        or None when it can; StepGraphs then runs the steps of that phase eagerly."""
        return None


@contextlib.contextmanager
def undo_on_error(pass_state: list[torch.Tensor]):
    """Put the tensors a step's passes add to (statistics accumulators, counters) back as they
    were if the block raises: a closure that raises, or a step rejected after its closure ran,
    leaves no trace, and the step can be retried, closure and all."""
    saved = [t.clone() for t in pass_state]
    try:
        yield
    except BaseException:
        if pass_state:
            torch._foreach_copy_(pass_state, saved)
        raise


def run_closure(closure, pass_state: list[torch.Tensor]):
    """`closure()` with grad enabled, undone (`undo_on_error`) if it raises."""
    with undo_on_error(pass_state), torch.enable_grad():
        return closure()
