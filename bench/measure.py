"""Measuring primitives for the speed bench: wall-clock medians, copy bandwidth, bytes allocated.

Every CUDA call is guarded by the device type, so a CPU-only build never touches a CUDA API.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field
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


def copy_bandwidth(numel: int, device: torch.device, repeats: int = 15) -> float:
    """Bytes per second of `dst.copy_(src)` over fp32 buffers of `numel` elements, counting the
    read and the write (2 * bytes / time); the median over `repeats` copies."""
    src = torch.rand(numel, device=device)
    dst = torch.empty_like(src)
    timing = time_calls(lambda: dst.copy_(src), device, warmup=3, min_repeats=repeats,
                        max_repeats=repeats, budget_s=0.0)
    return 2 * src.numel() * src.element_size() / (timing.median_ms * 1e-3)


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
