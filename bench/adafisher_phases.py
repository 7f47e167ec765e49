"""AdaFisher's own phases of the speed bench (the `details` of its member entry):

- statistics: the curvature work of one curvature step (every module's input and gradient
  statistics plus one fisher_average_) on activations and output gradients captured once, fused
  (eagerly, and on CUDA replayed from a CUDA graph: the kernels without the host) against
  cafin's plain-PyTorch reference, with a per-op breakdown of the fused ops at each thread
  count of --statistics-threads (default on the CPU: 1 and the run's count), each against its floor;
- agreement: fused against reference over --steps training steps in float32, in lockstep (the
  fused copy takes the reference copy's parameters before each step).
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from .measure import Context, Skip, capture_replay, copy_bandwidth, is_cuda, measure, sync
from .models import batch_for, loss_for

LR = 1e-3
TIMED_TCOV = 10**9
AGREEMENT_TCOV = 2  # curvature and plain steps alternate
STATS_VARIANTS = ("reference", "fused", "cuda-graph")


@dataclass
class Captured:
    calls: list  # (layer kind, module, x, g or None, stat_H, stat_S) per call of a supported module
    stats: list[torch.Tensor]  # stat_H, stat_S per module: what the optimizer accumulates into
    factors: list[torch.Tensor]  # fisher_H, fisher_S per module
    grad_side: list[bool]
    activation_bytes: int  # every captured input and output gradient, read once

    @property
    def output_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stats + self.factors)


def capture(name: str, base: torch.nn.Module, x, y) -> Captured:
    """One forward/backward with hooks that keep each supported module's input and output
    gradient: the modules, order and dtypes the optimizer's own hooks would use."""
    import cafin
    from cafin.core.hooks import can_take_statistics
    from cafin.layers import discover
    from cafin.maths import state_dtype
    model = copy.deepcopy(base)
    opt = cafin.AdaFisher(model, lr=LR, TCov=TIMED_TCOV, backend="reference")
    opt.remove_hooks()
    # The supported modules with optimised parameters, as the optimizer finds them.
    layers = discover(opt.model, [p for group in opt.param_groups for p in group["params"]])
    buffers, stats, factors, grad_side = {}, [], [], []
    for record in layers:
        like = dict(dtype=state_dtype(record.anchor.dtype), device=record.anchor.device)
        s, h = record.kind.s_size(record.module), record.kind.h_size(record.module)
        buffers[id(record)] = (torch.zeros(h + 1, **like), torch.zeros(s + 1, **like))
        stats += buffers[id(record)]
        factors += [torch.full((h,), -1.0, **like), torch.full((s,), -1.0, **like)]
        grad_side += [False, True]
    calls: list[list] = []

    def forward_hook(record, module, inputs, output):
        if not torch.is_grad_enabled() or not inputs or not isinstance(inputs[0], torch.Tensor):
            return
        xin = inputs[0].detach()
        if not can_take_statistics(module, xin):
            return
        stat_h, stat_s = buffers[id(record)]
        call = [record.kind, module, xin.to(stat_h.dtype, copy=True), None, stat_h, stat_s]
        calls.append(call)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            def keep(grad, call=call):
                call[3] = grad.detach().to(stat_s.dtype, copy=True)
            output.register_hook(keep)

    handles = [record.module.register_forward_hook(
        lambda module, inputs, output, record=record: forward_hook(record, module, inputs, output))
        for record in layers]
    loss_for(name, model(x), y).backward()
    for h in handles:
        h.remove()
    nbytes = sum(t.numel() * t.element_size() for c in calls for t in c[2:4] if t is not None)
    return Captured([tuple(c) for c in calls], stats, factors, grad_side, nbytes)


def statistics_variant(variant: str, captured: Captured, device: torch.device) -> Callable[[], None]:
    """One statistics pass of `variant`: the reference's ops, the fused ops eagerly, or the fused
    ops captured in a CUDA graph and replayed ("cuda-graph": the kernels' own time, without the
    host's dispatch of ~80 calls)."""
    import cafin
    # The fused ops as AdaFisher calls them: with kept workspaces on CUDA.
    impl = cafin.reference if variant == "reference" else cafin.ops.StatisticsWorkspaces(cafin.ops)
    skipped = torch.zeros((), device=device)
    gamma = 0.8

    def run():
        for kind, module, x, g, stat_h, stat_s in captured.calls:
            kind.input_stats(impl, stat_h, module, x, None, 1)
            if g is not None:
                kind.grad_stats(impl, stat_s, module, g, None, 1)
        impl.fisher_average_(captured.factors, captured.stats, skipped, gamma, captured.grad_side)
    return capture_replay(run, device) if variant == "cuda-graph" else run


def statistics_breakdown(captured: Captured, device: torch.device, passes: int,
                         threads: list[int] | None = None, copy_numel: int = 1 << 22) -> list[dict]:
    """Where the fused statistics spend their time, at each torch thread count in `threads`
    (None: the current one only): per (layer type, side) the calls' summed time, and the whole
    statistics ("all ops"), with the bytes they read and their floor, those bytes at the copy
    bandwidth (`copy_numel` fp32 elements copied) measured at the same thread count in the same
    pass. The thread counts take turns pass by pass (the order alternating), so a change in the
    machine's load reaches each of them alike; one warm-up pass first. Per row: the median over
    the `passes` passes of the time, of the floor and of their ratio."""
    import cafin
    impl = cafin.ops.StatisticsWorkspaces(cafin.ops)
    skipped = torch.zeros((), device=device)
    work = []  # (group, bytes read, call)
    for kind, module, x, g, stat_h, stat_s in captured.calls:
        layer = type(module).__name__
        work.append((f"{layer} input", x.numel() * x.element_size(),
                     partial(kind.input_stats, impl, stat_h, module, x, None, 1)))
        if g is not None:
            work.append((f"{layer} gradient", g.numel() * g.element_size(),
                         partial(kind.grad_stats, impl, stat_s, module, g, None, 1)))
    work.append(("fisher_average_", sum(t.numel() * t.element_size() for t in captured.stats),
                 partial(impl.fisher_average_, captured.factors, captured.stats, skipped, 0.8,
                         captured.grad_side)))
    groups: dict[str, dict] = {}
    for group, nbytes, _ in work:
        entry = groups.setdefault(group, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += nbytes
    groups["all ops"] = {"calls": len(work), "bytes": sum(e["bytes"] for e in groups.values())}
    counts = threads or [torch.get_num_threads()]
    before = torch.get_num_threads()
    samples = {(t, group): [] for t in counts for group in groups}  # (ms, floor ms) per pass
    try:
        for index in range(passes + 1):
            for t in (counts if index % 2 else counts[::-1]):
                torch.set_num_threads(t)
                bandwidth = copy_bandwidth(copy_numel, device, repeats=5)
                spent = dict.fromkeys(groups, 0.0)
                for group, _, call in work:
                    sync(device)
                    began = time.perf_counter()
                    call()
                    sync(device)
                    spent[group] += time.perf_counter() - began
                spent["all ops"] = sum(spent.values())
                if index:  # the first pass warms up
                    for group, seconds in spent.items():
                        samples[t, group].append(
                            (seconds * 1e3, groups[group]["bytes"] / bandwidth * 1e3))
    finally:
        torch.set_num_threads(before)
    rows = []
    for t in counts:
        for group, entry in groups.items():
            got = samples[t, group]
            rows.append({"op": group, "threads": t, "calls": entry["calls"],
                         "bytes": entry["bytes"],
                         "median_ms": statistics.median(ms for ms, _ in got),
                         "floor_ms": statistics.median(f for _, f in got),
                         "x_floor": statistics.median(ms / f for ms, f in got)})
    return rows


# --------------------------------------------------------------------------------- agreement
def agreement(name: str, base: torch.nn.Module, batch_size: int, steps: int,
              device: torch.device) -> dict:
    """Train two copies of one model, fused and reference, on the same batches, in lockstep: before
    each step the fused copy takes the reference copy's parameters and buffers, so both compute
    the same activations and gradients and only the optimizers' numerics differ (their state, m
    and the factors, carries across the steps). Without the lockstep, a 1-ulp difference grows
    with the training dynamics themselves (on random data a BatchNorm bias reaches 1e-2 relative
    in two steps even reference against reference), which says nothing about the kernels.
    The measure: the largest max|theta_fused - theta_reference| / max|theta_reference| over the
    parameter tensors and the steps."""
    import cafin
    models = {b: copy.deepcopy(base) for b in ("fused", "reference")}
    opts = {b: cafin.AdaFisher(m, lr=LR, TCov=AGREEMENT_TCOV, backend=b) for b, m in models.items()}
    gen = torch.Generator().manual_seed(1234)
    per_step = []
    for _ in range(steps):
        x, y = (t.to(device) for t in batch_for(name, base, batch_size, generator=gen))
        with torch.no_grad():
            for dst, src in zip(models["fused"].state_dict().values(),
                                models["reference"].state_dict().values()):
                dst.copy_(src)
        for b, model in models.items():
            opts[b].zero_grad(set_to_none=True)
            loss_for(name, model(x), y).backward()
            opts[b].step()
        worst = 0.0
        for pf, pr in zip(models["fused"].parameters(), models["reference"].parameters()):
            pf, pr = pf.detach(), pr.detach()
            scale = pr.abs().max().clamp_min(torch.finfo(pr.dtype).tiny)
            worst = max(worst, float((pf - pr).abs().max() / scale))
        per_step.append(worst)
    return {"model": name, "max_rel_diff": max(per_step), "per_step": per_step, "steps": steps,
            "tcov": AGREEMENT_TCOV, "batch_size": batch_size, "dtype": "float32",
            "method": "lockstep"}


def breakdown_threads(ctx: Context) -> list[int]:
    """The thread counts of the per-op breakdown: --statistics-threads, else on the CPU 1 and the
    run's count (the kernels split their reductions over threads; the floor's copy scales with
    them too), on CUDA the run's count."""
    if ctx.statistics_threads:
        return list(ctx.statistics_threads)
    if is_cuda(ctx.run.device):
        return [torch.get_num_threads()]
    return sorted({1, torch.get_num_threads()})


def run_details(ctx: Context) -> None:
    """The statistics phase (with its per-op breakdown) and the agreement phase, as selected."""
    run, progress, device, name = ctx.run, ctx.progress, ctx.run.device, ctx.run.model
    fused_ok = ctx.fused_ok
    if "statistics" in ctx.phases and any(v in ctx.variants for v in STATS_VARIANTS):
        task = progress.add_task("statistics capture", total=1)
        captured = capture(name, ctx.base, ctx.x, ctx.y)
        progress.advance(task)
        run.floor["statistics_bytes"] = captured.activation_bytes
        run.floor["statistics_floor_ms"] = captured.activation_bytes / ctx.bandwidth * 1e3
        run.floor["statistics_output_bytes"] = captured.output_bytes
        for variant in STATS_VARIANTS:
            if variant not in ctx.variants:
                continue
            if variant != "reference" and not fused_ok:
                run.skipped.append(Skip(name, "statistics", variant, ctx.why_not_fused,
                                        optimizer="adafisher"))
                continue
            if variant == "cuda-graph" and not is_cuda(device):
                run.skipped.append(Skip(name, "statistics", variant, "CUDA only",
                                        optimizer="adafisher"))
                continue
            measure(run, progress, "statistics", "adafisher", variant,
                    lambda v=variant: statistics_variant(v, captured, device))
        if run.result("statistics", "fused"):
            task = progress.add_task("statistics fused, per op", total=1)
            try:
                run.breakdown = statistics_breakdown(
                    captured, device, 3 if run.quick else 7, breakdown_threads(ctx),
                    run.floor["copy_buffer_bytes"] // 4)
            except Exception as exc:
                run.skipped.append(Skip(name, "statistics", "fused, per op",
                                        f"{type(exc).__name__}: {exc}", error=True,
                                        optimizer="adafisher"))
            progress.advance(task)
        del captured
    if "agreement" in ctx.phases:
        if not fused_ok:
            run.skipped.append(Skip(name, "agreement", "fused", ctx.why_not_fused,
                                    optimizer="adafisher"))
            return
        task = progress.add_task(f"agreement  {run.steps} steps", total=1)
        try:
            run.agreement.append(agreement(name, ctx.base, run.batch_size, run.steps, device))
        except Exception as exc:
            run.skipped.append(Skip(name, "agreement", "fused", f"{type(exc).__name__}: {exc}",
                                    error=True, optimizer="adafisher"))
        progress.advance(task)
