"""`StepGraphs`: a whole training step (forward with the statistics hooks, backward, the
optimizer's step) captured in CUDA graphs, with the curvature work only on the steps it is due.

A single captured step cannot skip work: a graph replays the same kernels every time, so every
replay would launch the statistics, the factor updates and the decompositions, and each kernel
would decide on the device to do nothing. StepGraphs captures one graph per *phase* (which of the
member's intervals are due on that step: statistics every `TCov`, decompositions every
`inv_update_steps`, ...) and replays, on each step, the graph of that step's phase. A step that
is not due replays a graph with no curvature kernel in it. The graphs share one memory pool.

The host knows which step each call is, so it "pins" the members' step counters while it
captures: a member asks `StepCounter.launch(interval)` whether to put work in the graph. What a
graph does launch still decides on the device from the members' k tensors, as every compiled or
captured step does, so the replays compute what an eager step computes (tests/test_step_graphs.py).

A phase a graph cannot hold (K-FAC's eigendecompositions in the step: `torch.linalg.eigh` syncs
with the host on CUDA) runs eagerly on its steps, with a warning naming why; a member no step of
which can be captured (two-level K-FAC) makes every step eager.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

from .core.steps import StepCounter

__all__ = ["StepGraphs"]


class _CUDAGraph:
    """torch.cuda.CUDAGraph behind the two calls StepGraphs makes, in a pool shared by the
    graphs of one StepGraphs (their replays never overlap)."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @contextlib.contextmanager
    def capture(self):
        with torch.cuda.graph(self.graph, pool=self.pool):
            yield

    def replay(self) -> None:
        self.graph.replay()


def _counter(member) -> StepCounter:
    counter = getattr(member, "_steps", None)
    if not isinstance(counter, StepCounter):
        raise TypeError(f"StepGraphs: {type(member).__name__} is not a cafin optimizer or "
                        "preconditioner (pass the cafin members the step drives; a torch "
                        "optimizer needs nothing from StepGraphs)")
    return counter


class StepGraphs:
    """Capture `step` (no arguments; forward, backward and every optimizer's step on tensors
    that stay the same, returning the tensors the caller reads, e.g. the loss) once per phase of
    `members`' curvature intervals, and replay the right graph on each call.

        static_x, static_y = x0.clone(), y0.clone()
        def train_step():
            opt.zero_grad()
            loss = loss_fn(model(static_x), static_y)
            loss.backward()
            opt.step()
            return loss

        step = cafin.StepGraphs(train_step, opt)
        for x, y in loader:
            static_x.copy_(x); static_y.copy_(y)
            loss = step()          # valid until the next call

    The first `warmup` calls run `step` eagerly (on a side stream on CUDA), so that every state
    tensor exists before a graph records its address. After that the members' counters decide on
    the device, for good. Each call then replays the graph of its step's phase, capturing it the
    first time that phase comes. `graph` builds the graphs (default: CUDA graphs in one shared
    pool); it exists so that tests can capture on the CPU.
    """

    def __init__(self, step: Callable[[], Any], *members, warmup: int = 3,
                 graph: Callable[[], Any] | None = None) -> None:
        if not callable(step):
            raise TypeError(f"StepGraphs: step must be callable, got {type(step).__name__}")
        if not members:
            raise ValueError("StepGraphs: pass the cafin optimizers (and K-FAC preconditioners) "
                             "that step drives")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"StepGraphs: warmup must be an int >= 1 (state is built on eager "
                             f"steps), got {warmup!r}")
        self.step, self.members, self.warmup = step, members, warmup
        self.counters = [_counter(m) for m in members]
        self._settings = [self._settings_of(m) for m in members]
        self._make_graph = graph if graph is not None else self._cuda_graph
        self._pool = None
        self._graphs: list[tuple[tuple[frozenset, ...], Any, Any]] = []  # (phase, graph, outputs)
        self._eager_phases: list[tuple[frozenset, ...]] = []
        self._k: list[int] | None = None  # each counter's k, once pinned
        self.calls = 0
        self.replays = 0
        self.eager_steps = 0
        self._warned: set[str] = set()

    @property
    def graphs(self) -> int:
        """How many graphs are captured (one per phase met so far)."""
        return len(self._graphs)

    def _cuda_graph(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return _CUDAGraph(self._pool)

    def __call__(self):
        self.calls += 1
        if self._k is None and self.calls <= self.warmup:
            return self._eager(warm=True)
        if self._never():
            return self._eager(warm=False)
        for member, settings in zip(self.members, self._settings):
            if self._settings_of(member) != settings:
                raise RuntimeError(
                    f"StepGraphs: {type(member).__name__}'s {self._changed(member, settings)} changed "
                    "after its graphs were captured, and they replay the old one: build a new "
                    "StepGraphs after changing it")
        if self._k is None:
            for counter in self.counters:
                counter.device_gated = True
            self._k = [counter.value() for counter in self.counters]
        for phase, graph, outputs in self._graphs:
            if self._matches(phase):
                graph.replay()
                self.replays += 1
                self._advance()
                return outputs
        if any(self._matches(phase) for phase in self._eager_phases):
            return self._pinned_eager()
        return self._capture()

    @staticmethod
    def _settings_of(member) -> tuple:
        settings = member._graph_settings()
        for name, value in settings:
            if callable(value):
                raise TypeError(f"StepGraphs: {type(member).__name__}'s {name} is a callable of the "
                                "step; its graphs are chosen by interval, so give it a number")
        return settings

    def _changed(self, member, settings) -> str:
        now = dict(self._settings_of(member))
        return ", ".join(f"{name} ({old!r} -> {now.get(name)!r})"
                         for name, old in settings if now.get(name) != old)

    def _never(self) -> bool:
        """Whether a member captures no step at all: then every step runs eagerly, with the
        members' counters on the host (said once)."""
        why = [f"{type(m).__name__}: {m._uncapturable}" for m in self.members if m._uncapturable]
        if why and not self._warned:
            self._warned.add(why[0])
            warnings.warn(f"StepGraphs: every step runs eagerly: {why[0]}", UserWarning, stacklevel=3)
        return bool(why)

    def _matches(self, phase: tuple[frozenset, ...]) -> bool:
        return all(((k + offset) % interval == 0) == due
                   for k, answered in zip(self._k, phase) for interval, offset, due in answered)

    @contextlib.contextmanager
    def _pinned(self):
        for counter, k in zip(self.counters, self._k):
            counter.pinned, counter.phase = k, set()
        try:
            yield
        finally:
            for counter in self.counters:
                counter.pinned = None

    def _phase(self) -> tuple[frozenset, ...]:
        return tuple(frozenset(counter.phase) for counter in self.counters)

    def _advance(self) -> None:
        self._k = [k + 1 for k in self._k]

    def _eager(self, warm: bool):
        if warm and torch.cuda.is_available() and torch.cuda.is_initialized():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            out = self.step()
        self.eager_steps += 1
        return out

    def _refusal(self) -> str | None:
        for member in self.members:
            why = member._capture_refusal()
            if why is not None:
                return f"{type(member).__name__}: {why}"
        return None

    def _pinned_eager(self):
        with self._pinned():
            out = self._eager(warm=False)
        self._advance()
        return out

    def _capture(self):
        with self._pinned():
            why = self._refusal()
            # A refused phase is what the refusal asked about (K-FAC: its inverse interval due).
            refused = self._phase()
            if why is None:
                graph = self._make_graph()
                with graph.capture():
                    outputs = self.step()
                phase = self._phase()
        if why is not None:
            self._eager_phases.append(refused)
            if why not in self._warned:
                self._warned.add(why)
                warnings.warn(f"StepGraphs: steps of this phase run eagerly: {why}",
                              UserWarning, stacklevel=3)
            return self._pinned_eager()
        self._graphs.append((phase, graph, outputs))
        graph.replay()  # a capture runs nothing: this step's work is the first replay
        self.replays += 1
        self._advance()
        return outputs
