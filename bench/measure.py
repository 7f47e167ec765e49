"""What every phase of the speed bench shares; it imports nothing from bench, so every other
module of bench may import it:

- measuring primitives: wall-clock medians, copy bandwidth, bytes allocated;
- the run's records: `Budget`, `Result`, `Skip`, `Run`, and `Context` (what a phase is handed);
- `measure()`: one variant of one phase timed, its allocations counted, or its failure recorded;
- `PreconditionedSGD`: a preconditioner that rewrites `.grad` followed by torch's SGD, as one
  optimizer (K-FAC and two-level K-FAC as their users run them);
- the number formats of the tables and of the members' target rows.

Every CUDA call is guarded by the device type, so a CPU-only build never touches a CUDA API.
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import torch


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def sync(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def machine_threads() -> int:
    """The cores this process may run on (the affinity mask, not the host's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def device_name(device: torch.device) -> str:
    if is_cuda(device):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def adamw_fused_supported(device: torch.device) -> bool:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # an older torch: try it
        return True


# ------------------------------------------------------------------------------------ timing
@dataclass
class Timing:
    samples_ms: list[float]
    warmup_ms: list[float] = field(default_factory=list)  # the first one holds any compile

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: how noisy the samples were."""
        if len(self.samples_ms) < 4:
            return float("nan")
        q = statistics.quantiles(self.samples_ms, n=4)
        return (q[2] - q[0]) / self.median_ms


def time_calls(fn: Callable[[], object], device: torch.device, *, warmup: int, min_repeats: int,
               max_repeats: int, budget_s: float, tick: Callable[[], None] | None = None) -> Timing:
    """Wall-clock milliseconds of `fn()` per call, synchronised on CUDA (so host launch overhead
    counts, as it does in a training loop). `warmup` untimed calls first; then at least
    `min_repeats` and at most `max_repeats` timed calls, stopping early once `budget_s` is spent."""
    warm = []
    for _ in range(warmup):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        warm.append((time.perf_counter() - start) * 1e3)
        if tick:
            tick()
    samples = []
    began = time.perf_counter()
    while len(samples) < max_repeats:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
        if tick:
            tick()
        if len(samples) >= min_repeats and time.perf_counter() - began > budget_s:
            break
    return Timing(samples, warm)


def capture_replay(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """`step` captured in a CUDA graph (after three warm-up calls on a side stream, as
    torch.cuda.graphs asks): returns the graph's replay, which holds `step` (and so whatever it
    writes to)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay(step=step):
        graph.replay()
    return replay


def copy_bandwidth(numel: int, device: torch.device, repeats: int = 15) -> float:
    """Bytes per second of `dst.copy_(src)` over fp32 buffers of `numel` elements, counting the
    read and the write (2 * bytes / time); the median over `repeats` copies."""
    src = torch.rand(numel, device=device)
    dst = torch.empty_like(src)
    timing = time_calls(lambda: dst.copy_(src), device, warmup=3, min_repeats=repeats,
                        max_repeats=repeats, budget_s=0.0)
    return 2 * src.numel() * src.element_size() / (timing.median_ms * 1e-3)


def sgemm_rate(n: int, device: torch.device, repeats: int = 15) -> float:
    """FLOP per second of `torch.mm(a, b, out=c)` on float32 [n, n] matrices (2 n^3 FLOPs); the
    median over `repeats` products."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.rand(n, n, generator=gen).to(device) for _ in range(2))
    c = torch.empty(n, n, device=device)
    timing = time_calls(lambda: torch.mm(a, b, out=c), device, warmup=3, min_repeats=repeats,
                        max_repeats=repeats, budget_s=0.0)
    return 2 * n ** 3 / (timing.median_ms * 1e-3)


# ------------------------------------------------------------------------------------ memory
@dataclass
class Allocations:
    total_bytes: int
    count: int
    # CPU only: the allocations grouped by where they come from, largest total first:
    # (total bytes, count, "innermost op <- ... <- nearest Python frame outside torch").
    sources: list[tuple[int, int, str]] = field(default_factory=list)


def _source(chain: list[str]) -> str:
    """An allocation's origin: the ops around it, innermost first, then the first Python frame
    that is not torch's own (for a profiled Python frame, its name holds 'file(line): function')."""
    ops, frame = [], None
    for name in chain:
        if "): " in name and "(" in name:  # a Python frame
            if "torch/" not in name and "<built-in" not in name:
                frame = name
                break
        elif not name.startswith("<built-in"):
            ops.append(name)
    return " <- ".join(ops + ([frame] if frame else []))


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def allocated_bytes(fn: Callable[[], object], device: torch.device, *, keep: int = 8) -> Allocations:
    """Bytes allocated while `fn()` runs: the sum of every allocation, frees not subtracted.

    CPU: torch.profiler with profile_memory=True; the sum of the positive allocation events on
    the device, each attributed to the ops (and Python frames) around it. CUDA: the caching
    allocator's cumulative `allocated_bytes.all.allocated` counter, before and after."""
    if is_cuda(device):
        sync(device)
        before = torch.cuda.memory_stats(device)
        fn()
        sync(device)
        after = torch.cuda.memory_stats(device)
        key_b, key_n = "allocated_bytes.all.allocated", "allocation.all.allocated"
        return Allocations(after.get(key_b, 0) - before.get(key_b, 0),
                           after.get(key_n, 0) - before.get(key_n, 0))
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        fn()
    total, count, groups = 0, 0, {}
    for node in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.tag != _EventType.Allocation:
            continue
        extra = node.extra_fields
        if extra.alloc_size <= 0 or extra.device.type != device.type:
            continue
        chain, parent = [], node.parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.parent
        size = int(extra.alloc_size)
        total, count = total + size, count + 1
        key = _source(chain)
        got = groups.get(key, (0, 0))
        groups[key] = (got[0] + size, got[1] + 1)
    sources = sorted(((b, n, k) for k, (b, n) in groups.items()), key=lambda g: -g[0])
    return Allocations(total, count, sources[:keep])


# ------------------------------------------------------------------------------------ the run
DEFAULT_TCOV = 100  # the published default, at which the whole-step overhead is stated


@dataclass(frozen=True)
class Budget:
    """How long each measurement may take. The first call is untimed (state creation, compile);
    more warm-up calls, up to `warmup` in all, run while warm-up has taken under warm_s (a
    compile does not count); then timed calls until time_s is spent, within [min, max] repeats."""
    warmup: int
    warm_s: float
    min_repeats: int
    max_repeats: int
    time_s: float


FULL = Budget(warmup=5, warm_s=1.0, min_repeats=3, max_repeats=200, time_s=2.5)
QUICK = Budget(warmup=2, warm_s=0.3, min_repeats=3, max_repeats=40, time_s=0.5)


@dataclass
class Result:
    model: str
    phase: str
    variant: str
    median_ms: float
    allocated_bytes: int
    repeats: int
    spread: float
    first_call_s: float  # the first warm-up call: it holds the compile of compiled variants
    min_ms: float
    allocations: Allocations | None = None
    optimizer: str = "adafisher"

    def to_json(self) -> dict:
        return {"model": self.model, "phase": self.phase, "optimizer": self.optimizer,
                "variant": self.variant, "median_ms": self.median_ms, "min_ms": self.min_ms,
                "allocated_bytes": self.allocated_bytes,
                "repeats": self.repeats, "iqr_over_median": _finite_or_none(self.spread),
                "first_call_s": self.first_call_s,
                "allocation_sources": [{"bytes": b, "count": n, "source": where} for b, n, where
                                       in (self.allocations.sources if self.allocations else [])]}


@dataclass
class Skip:
    model: str
    phase: str
    variant: str
    reason: str
    error: bool = False  # True: cafin or the bench raised; False: not available, or not cafin's
    optimizer: str = "adafisher"

    def to_json(self) -> dict:
        return {"model": self.model, "phase": self.phase, "optimizer": self.optimizer,
                "variant": self.variant, "reason": self.reason, "error": self.error}


@dataclass
class Run:
    model: str
    device: torch.device
    batch_size: int
    steps: int
    quick: bool
    budget: Budget
    tcov: int = DEFAULT_TCOV
    optimizers: list[str] = field(default_factory=list)
    published: dict[str, str] = field(default_factory=dict)  # member -> path of the user's file
    results: list[Result] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    agreement: list[dict] = field(default_factory=list)
    floor: dict = field(default_factory=dict)
    breakdown: list[dict] = field(default_factory=list)  # the fused statistics, per op
    whole_step: list[dict] = field(default_factory=list)
    whole_step_from_phases: list[dict] = field(default_factory=list)

    def result(self, phase: str, variant: str, optimizer: str | None = None) -> Result | None:
        """The result of a phase and variant; optimizer None: AdaFisher's, or AdamW's for the
        adamw-* variants."""
        if optimizer is None:
            optimizer = "adamw" if variant.startswith("adamw-") else "adafisher"
        for r in self.results:
            if r.phase == phase and r.variant == variant and r.optimizer == optimizer:
                return r
        return None

    def whole(self, optimizer: str, variant: str | None = None) -> dict | None:
        for w in self.whole_step:
            if w["optimizer"] == optimizer and (variant is None or w["variant"] == variant):
                return w
        return None


@dataclass
class Context:
    """What a phase needs: the run, its model and batch, and the selection."""
    run: Run
    progress: object
    base: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    members: list  # the selected entries of bench/members (Member)
    published: dict[str, ModuleType]
    chosen: dict[str, set[str]]  # member -> the variants selected for it
    baselines: set[str]
    phases: set[str]
    fused_ok: bool
    why_not_fused: str
    bandwidth: float = math.nan
    requested: set[str] = field(default_factory=set)  # --variants as given (members' own phases)
    statistics_threads: list[int] | None = None  # --statistics-threads: the breakdown's counts

    def selected(self, member) -> set[str]:
        return self.chosen.get(member.name, set())

    @property
    def variants(self) -> set[str]:  # AdaFisher's selection, for its own phases
        return self.chosen.get("adafisher", set())

    def why_not(self, member, variant: str) -> str | None:
        """Why `variant` of `member` cannot run here, or None."""
        if variant == "published" and member.name not in self.published:
            return (f"give your copy of the published {member.published_file or 'code'} with "
                    f"--published {'' if member.name == 'adafisher' else member.name + '='}PATH")
        if variant.startswith(("fused", "cuda-graph")) and not self.fused_ok:
            return self.why_not_fused
        if variant == "cuda-graph" and not is_cuda(self.run.device):
            return "CUDA only"
        return None


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def measure(run: Run, progress, phase: str, optimizer: str, variant: str,
            build: Callable[[], Callable]) -> None:
    """Time the callable `build()` returns (first call, cheap warm-up, then timed calls within the
    run's budget) and count its allocations: a `Result` in run.results, or, when building or
    calling it raises, a `Skip` in run.skipped (an error unless it is the user's published code)."""
    budget = run.budget
    task = progress.add_task(f"{phase:<10} {optimizer} {variant}",
                             total=budget.warmup + budget.max_repeats)
    try:
        fn = build()
        if variant.endswith("-compiled"):
            progress.update(task, description=f"{phase:<10} {optimizer} {variant} (compiling)")
        first = time.perf_counter()
        fn()  # the first call: state creation, compilation
        sync(run.device)
        first_s = time.perf_counter() - first
        progress.update(task, description=f"{phase:<10} {optimizer} {variant}", advance=1)
        # More warm-up only while it is cheap; a compiled variant gets one more call regardless
        # (its first call was the compile, not a run).
        warm_spent = 0.0 if variant.endswith("-compiled") else first_s
        for _ in range(budget.warmup - 1):
            if warm_spent > budget.warm_s:
                break
            began = time.perf_counter()
            fn()
            sync(run.device)
            warm_spent += time.perf_counter() - began
            progress.advance(task)
        sync(run.device)
        progress.update(task, completed=budget.warmup)
        timing = time_calls(fn, run.device, warmup=0, min_repeats=budget.min_repeats,
                            max_repeats=budget.max_repeats, budget_s=budget.time_s,
                            tick=lambda: progress.advance(task))
        allocations = allocated_bytes(fn, run.device)
    except Exception as exc:  # one broken variant must not hide the others' numbers
        text = f"{type(exc).__name__}: {exc}"
        if variant == "published":  # the user's file failing is not a failure of cafin
            run.skipped.append(Skip(run.model, phase, variant, f"the published code raised {text}",
                                    optimizer=optimizer))
        else:
            run.skipped.append(Skip(run.model, phase, variant, text, error=True, optimizer=optimizer))
        progress.update(task, description=f"[red]{phase:<10} {optimizer} {variant} failed",
                        completed=0, total=1)
        return
    finally:
        if is_cuda(run.device):
            torch.cuda.empty_cache()
    run.results.append(Result(run.model, phase, variant, timing.median_ms, allocations.total_bytes,
                              len(timing.samples_ms), timing.spread, first_s, min(timing.samples_ms),
                              allocations, optimizer=optimizer))
    progress.update(task, total=budget.warmup + len(timing.samples_ms),
                    completed=budget.warmup + len(timing.samples_ms))


# ------------------------------------------------------------------------ preconditioner + SGD
class PreconditionedSGD:
    """A preconditioner that rewrites `.grad` (K-FAC, two-level K-FAC, kfac-pytorch) and the torch
    SGD its users run after it, as one optimizer with `zero_grad()`, `step()` and `remove_hooks()`.

    - `opt` None: the preconditioner alone.
    - `stats_flag`: the preconditioner takes statistics only while its `update_stats` is True
      (two-level K-FAC, as its published README trains): raised here and by `zero_grad()`, so the
      next forward/backward feeds it, and lowered after the step, so that evaluation passes in
      between never reach the statistics. Its step is then `step(update_params=True)`.
    - `restore_grads`: the gradients are put back after each step (two copies, counted in the
      step's time: into buffers kept from step to step before it, back after it, each one
      `torch._foreach_copy_`), so the speed bench can repeat `step()` on the same gradients
      without their growing from one preconditioning to the next.
    - `precondition`: the call that rewrites the gradients (`pre.step` unless replaced, e.g. by a
      compiled one)."""

    def __init__(self, pre, opt: torch.optim.Optimizer | None = None, *, params=None,
                 stats_flag: bool = False, restore_grads: bool = False):
        self.pre, self.opt = pre, opt
        if params is None:
            params = [p for group in opt.param_groups for p in group["params"]]
        self.params = list(params)
        self.stats_flag, self.restore_grads = stats_flag, restore_grads
        self._saved: list[torch.Tensor] = []  # the gradients' copies, kept (restore_grads)
        if stats_flag:
            pre.update_stats = True
            self.precondition = lambda: pre.step(update_params=True)
        else:
            self.precondition = pre.step

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=set_to_none)
        if self.stats_flag:
            self.pre.update_stats = True

    def step(self) -> None:
        params = [p for p in self.params if p.grad is not None] if self.restore_grads else []
        if params:
            self._save([p.grad for p in params])
        self.precondition()
        if self.stats_flag:
            self.pre.update_stats = False
        if self.opt is not None:
            self.opt.step()
        if params:
            torch._foreach_copy_([p.grad for p in params], self._saved)

    def _save(self, grads: list[torch.Tensor]) -> None:
        """Copy the gradients into the kept buffers (made again when the gradients' shapes,
        dtypes or devices are not theirs)."""
        saved = self._saved
        if len(saved) != len(grads) or any(s.shape != g.shape or s.dtype != g.dtype or s.device != g.device
                                           for s, g in zip(saved, grads)):
            self._saved = [g.clone() for g in grads]
        else:
            torch._foreach_copy_(saved, grads)

    def remove_hooks(self) -> None:
        self.pre.remove_hooks()


# ------------------------------------------------------------------------------------ formats
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_ms(ms: float | None) -> str:
    if ms is None or not math.isfinite(ms):
        return "-"
    size = abs(ms)  # a difference of medians (statistics in training) can come out negative
    if size >= 100:
        return f"{ms:.0f}"
    if size >= 10:
        return f"{ms:.1f}"
    if size >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def fmt_ratio(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def fmt_pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{100 * x:+.1f}%"
