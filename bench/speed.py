"""`python -m bench`: speed, memory and agreement of cafin's AdaFisher, fused against the reference.

Phases (one model per run, ratios within the run; see DESIGN.md section 6):
- step: the optimizer step alone, on gradients and factors prepared once by one real curvature
  step. Variants: reference (eager, the published way), reference-compiled, fused, fused-compiled,
  cuda-graph (CUDA only), and torch's AdamW (foreach, fused) as baselines. The floor is 20 bytes
  per parameter (read theta, g, m; write theta, m) over the copy bandwidth measured in this run.
- statistics: the curvature work of one curvature step (every module's input and gradient
  statistics plus one fisher_average_) on activations and output gradients captured once.
- memory: bytes allocated inside one call of each variant.
- agreement: fused against reference over --steps training steps in float32, in lockstep (the
  fused copy takes the reference copy's parameters before each step).
--quick leaves out reference-compiled: inductor takes 1.5 to 3.5 minutes to compile the reference
step of ResNet-18 on 2 cores with a cold cache (about 10 s warm).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from . import report
from .measure import (Allocations, allocated_bytes, copy_bandwidth, device_name, is_cuda,
                      machine_threads, sync, time_calls)
from .models import MODELS, batch_for, loss_for

LR = 1e-3
TIMED_TCOV = 10**9  # k % TCov == 0 only at k = 0: the preparing step curves, every timed step does not
AGREEMENT_TCOV = 2  # curvature and plain steps alternate
DEFAULT_BATCH = {"resnet18": 32, "gpt": 16, "mlp": 128}
STEP_VARIANTS = ("reference", "reference-compiled", "fused", "fused-compiled", "cuda-graph",
                 "adamw-foreach", "adamw-fused")
STATS_VARIANTS = ("reference", "fused")
FUSED_OPS = ("adafisher_step_", "sumsq_stats_", "conv2d_input_stats_", "norm_input_stats_",
             "norm_grad_stats_", "fisher_average_")


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

    def to_json(self) -> dict:
        return {"model": self.model, "phase": self.phase, "variant": self.variant,
                "median_ms": self.median_ms, "min_ms": self.min_ms,
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
    error: bool = False  # True: it was attempted and raised; False: not available here

    def to_json(self) -> dict:
        return {"model": self.model, "phase": self.phase, "variant": self.variant,
                "reason": self.reason, "error": self.error}


@dataclass
class Run:
    model: str
    device: torch.device
    batch_size: int
    steps: int
    quick: bool
    budget: Budget
    results: list[Result] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    agreement: list[dict] = field(default_factory=list)
    floor: dict = field(default_factory=dict)
    breakdown: list[dict] = field(default_factory=list)  # the fused statistics, per op

    def result(self, phase: str, variant: str) -> Result | None:
        for r in self.results:
            if r.phase == phase and r.variant == variant:
                return r
        return None


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def fused_kernels_missing(device: torch.device) -> list[str]:
    """The cafin ops with no kernel for this device type in the loaded extension."""
    import cafin  # noqa: F401  (registers the ops)
    key = "CUDA" if is_cuda(device) else "CPU"
    return [op for op in FUSED_OPS
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"cafin::{op}", key)]


def adamw_fused_supported(device: torch.device) -> bool:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # an older torch: try it
        return True


# --------------------------------------------------------------------------------- the setup
@dataclass
class Prepared:
    """A model right after one real curvature step: parameters, gradients, optimizer state."""
    model: torch.nn.Module
    grads: list[torch.Tensor | None]
    state: dict
    params: int  # trainable parameter elements updated by a step


def _set_grads(model: torch.nn.Module, grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else g.clone()


def prepare(name: str, base: torch.nn.Module, x, y, backend: str) -> Prepared:
    import cafin
    model = copy.deepcopy(base)
    opt = cafin.AdaFisher(model, lr=LR, TCov=TIMED_TCOV, backend=backend)
    loss_for(name, model(x), y).backward()
    opt.step()  # k = 0: a curvature step; the factors are now real
    opt.remove_hooks()  # so deep copies of the model carry no hook of this optimizer
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    params = sum(p.numel() for p in model.parameters() if p.grad is not None)
    return Prepared(model, grads, opt.state_dict(), params)


def _adafisher_from(prepared: Prepared, backend: str):
    import cafin
    model = copy.deepcopy(prepared.model)
    _set_grads(model, prepared.grads)
    opt = cafin.AdaFisher(model, lr=LR, TCov=TIMED_TCOV, backend=backend)
    opt.load_state_dict(prepared.state)  # k = 1: every timed step is a plain step
    return model, opt


def step_variant(variant: str, prepared: Prepared, device: torch.device) -> Callable[[], object]:
    """The callable that runs one optimizer step of `variant` (objects it needs stay alive in its
    closure)."""
    if variant.startswith("adamw-"):
        model = copy.deepcopy(prepared.model)
        _set_grads(model, prepared.grads)
        kind = variant.split("-", 1)[1]
        opt = torch.optim.AdamW(model.parameters(), lr=LR, **{kind: True})
        return opt.step  # its first (warm-up) call creates the state
    backend = "fused" if variant.startswith(("fused", "cuda-graph")) else "reference"
    model, opt = _adafisher_from(prepared, backend)
    if variant.endswith("-compiled"):
        compiled = torch.compile(opt.step, fullgraph=True)

        def run_compiled():
            with torch.no_grad():
                compiled()
        return run_compiled
    if variant == "cuda-graph":
        return _capture(opt.step, device)
    return opt.step


def _capture(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up outside the graph, as torch.cuda.graphs asks
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


# --------------------------------------------------------------------------------- statistics
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
    from cafin.layers import can_take_statistics
    from cafin.reference import state_dtype
    model = copy.deepcopy(base)
    opt = cafin.AdaFisher(model, lr=LR, TCov=TIMED_TCOV, backend="reference")
    opt.remove_hooks()
    buffers, stats, factors, grad_side = {}, [], [], []
    for record in opt._curvature:  # the supported modules with optimised parameters
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
        for record in opt._curvature]
    loss_for(name, model(x), y).backward()
    for h in handles:
        h.remove()
    nbytes = sum(t.numel() * t.element_size() for c in calls for t in c[2:4] if t is not None)
    return Captured([tuple(c) for c in calls], stats, factors, grad_side, nbytes)


def statistics_variant(variant: str, captured: Captured, device: torch.device) -> Callable[[], None]:
    import cafin
    impl = cafin.ops if variant == "fused" else cafin.reference
    skipped = torch.zeros((), device=device)
    gamma = 0.8

    def run():
        for kind, module, x, g, stat_h, stat_s in captured.calls:
            kind.input_stats(impl, stat_h, module, x, None, 1)
            if g is not None:
                kind.grad_stats(impl, stat_s, module, g, None, 1)
        impl.fisher_average_(captured.factors, captured.stats, skipped, gamma, captured.grad_side)
    return run


def statistics_breakdown(captured: Captured, device: torch.device, passes: int) -> list[dict]:
    """Where the fused statistics spend their time: per (layer type, side) the calls' summed
    time, the median over `passes` passes after one warm-up pass, and the bytes they read."""
    import cafin
    impl = cafin.ops
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
        entry = groups.setdefault(group, {"op": group, "calls": 0, "bytes": 0, "times": []})
        entry["calls"] += 1
        entry["bytes"] += nbytes
    for index in range(passes + 1):
        spent = dict.fromkeys(groups, 0.0)
        for group, _, call in work:
            sync(device)
            began = time.perf_counter()
            call()
            sync(device)
            spent[group] += time.perf_counter() - began
        if index:  # the first pass warms up
            for group, seconds in spent.items():
                groups[group]["times"].append(seconds * 1e3)
    return [{"op": e["op"], "calls": e["calls"], "bytes": e["bytes"],
             "median_ms": statistics.median(e["times"])} for e in groups.values()]


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


# --------------------------------------------------------------------------------- the run
def _measure(run: Run, progress, phase: str, variant: str, build: Callable[[], Callable]) -> None:
    budget = run.budget
    task = progress.add_task(f"{phase:<10} {variant}", total=budget.warmup + budget.max_repeats)
    try:
        fn = build()
        if variant.endswith("-compiled"):
            progress.update(task, description=f"{phase:<10} {variant} (compiling)")
        first = time.perf_counter()
        fn()  # the first call: state creation, compilation
        sync(run.device)
        first_s = time.perf_counter() - first
        progress.update(task, description=f"{phase:<10} {variant}", advance=1)
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
        run.skipped.append(Skip(run.model, phase, variant, f"{type(exc).__name__}: {exc}", error=True))
        progress.update(task, description=f"[red]{phase:<10} {variant} failed", completed=0, total=1)
        return
    finally:
        if is_cuda(run.device):
            torch.cuda.empty_cache()
    run.results.append(Result(run.model, phase, variant, timing.median_ms, allocations.total_bytes,
                              len(timing.samples_ms), timing.spread, first_s, min(timing.samples_ms),
                              allocations))
    progress.update(task, total=budget.warmup + len(timing.samples_ms),
                    completed=budget.warmup + len(timing.samples_ms))


def bench(run: Run, variants: set[str], console) -> None:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn)
    device, name = run.device, run.model
    torch.manual_seed(0)
    base = MODELS[name]().to(device)
    base.train()
    x, y = (t.to(device) for t in batch_for(name, base, run.batch_size,
                                            generator=torch.Generator().manual_seed(0)))
    missing = fused_kernels_missing(device)
    fused_ok = not missing
    why_not_fused = f"no {device.type} kernel for cafin::{', '.join(missing)}"

    columns = (SpinnerColumn(), TextColumn("{task.description:<34}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("prepare    one curvature step", total=1)
        prepared = None
        if fused_ok:
            try:
                prepared = prepare(name, base, x, y, "fused")
            except Exception as exc:
                run.skipped.append(Skip(name, "step", "prepare (fused)",
                                        f"{type(exc).__name__}: {exc}", error=True))
        if prepared is None:
            prepared = prepare(name, base, x, y, "reference")
        progress.advance(task)
        # The floor: copy a buffer pair with the step's working set (theta, g, m, and the write).
        task = progress.add_task("floor      copy bandwidth", total=1)
        numel = max(2 * prepared.params, 1 << 20)
        bandwidth = copy_bandwidth(numel, device)
        progress.advance(task)
        step_bytes = 20 * prepared.params
        run.floor = {"model": name, "copy_bandwidth_gb_s": bandwidth / 1e9, "copy_buffer_bytes": 4 * numel,
                     "parameters": prepared.params, "bytes_per_step": step_bytes,
                     "step_floor_ms": step_bytes / bandwidth * 1e3}

        for variant in STEP_VARIANTS:
            if variant not in variants:
                continue
            reason = None
            if variant.startswith(("fused", "cuda-graph")) and not fused_ok:
                reason = why_not_fused
            elif variant == "cuda-graph" and not is_cuda(device):
                reason = "CUDA only"
            elif variant == "adamw-fused" and not adamw_fused_supported(device):
                reason = f"this torch build has no fused AdamW for {device.type}"
            if reason:
                run.skipped.append(Skip(name, "step", variant, reason))
                continue
            _measure(run, progress, "step", variant, lambda v=variant: step_variant(v, prepared, device))
        del prepared

        if any(v in variants for v in STATS_VARIANTS):
            task = progress.add_task("statistics capture", total=1)
            captured = capture(name, base, x, y)
            progress.advance(task)
            run.floor["statistics_bytes"] = captured.activation_bytes
            run.floor["statistics_floor_ms"] = captured.activation_bytes / bandwidth * 1e3
            run.floor["statistics_output_bytes"] = captured.output_bytes
            for variant in STATS_VARIANTS:
                if variant not in variants:
                    continue
                if variant == "fused" and not fused_ok:
                    run.skipped.append(Skip(name, "statistics", variant, why_not_fused))
                    continue
                _measure(run, progress, "statistics", variant,
                         lambda v=variant: statistics_variant(v, captured, device))
            if run.result("statistics", "fused"):
                task = progress.add_task("statistics fused, per op", total=1)
                try:
                    run.breakdown = statistics_breakdown(captured, device, 3 if run.quick else 7)
                except Exception as exc:
                    run.skipped.append(Skip(name, "statistics", "fused, per op",
                                            f"{type(exc).__name__}: {exc}", error=True))
                progress.advance(task)
            del captured

        if "agreement" in variants:
            if not fused_ok:
                run.skipped.append(Skip(name, "agreement", "fused", why_not_fused))
            else:
                task = progress.add_task(f"agreement  {run.steps} steps", total=1)
                try:
                    run.agreement.append(agreement(name, base, run.batch_size, run.steps, device))
                except Exception as exc:
                    run.skipped.append(Skip(name, "agreement", "fused",
                                            f"{type(exc).__name__}: {exc}", error=True))
                progress.advance(task)


def environment(device: torch.device, threads: int) -> dict:
    import cafin
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
            "device_name": device_name(device), "threads": threads,
            "cuda_kernels_built": bool(cafin.cuda_kernels_built()),
            "fused_kernels_for_device": not fused_kernels_missing(device),
            "load_average_1m": load}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None,
                        help="cpu or cuda[:i] (default: cuda when available, else cpu)")
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"default per model: {DEFAULT_BATCH}")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps of the agreement check (default 3, 2 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="short budgets (under a minute on 2 CPU cores); skips the slow "
                             "reference-compiled variant")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--variants", default=None,
                        help="comma list of what to run (default: all) out of "
                             f"{', '.join(STEP_VARIANTS)}, agreement; 'reference' and 'fused' "
                             "also select the statistics variants of those names")
    args = parser.parse_args(argv)
    if args.batch_size is not None and args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if is_cuda(device) and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available in this torch build", file=sys.stderr)
        return 2
    if is_cuda(device) and device.index is not None:
        torch.cuda.set_device(device)
    threads = machine_threads()
    torch.set_num_threads(threads)
    # torch.optim's step wrapper opens a profiler region that dynamo notes it drops: noise here.
    for logger in ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch"):
        logging.getLogger(logger).addFilter(
            lambda record: "will be ignored" not in record.getMessage())

    all_variants = set(STEP_VARIANTS) | {"agreement"}
    if args.variants:
        variants = {v.strip() for v in args.variants.split(",") if v.strip()}
        unknown = variants - all_variants
        if unknown:
            print(f"--variants: unknown {sorted(unknown)}; choose from {sorted(all_variants)}",
                  file=sys.stderr)
            return 2
    else:
        variants = all_variants - ({"reference-compiled"} if args.quick else set())

    console = Console(width=None if sys.stdout.isatty() else 120)
    began = time.perf_counter()
    run = Run(model=args.model, device=device,
              batch_size=args.batch_size or DEFAULT_BATCH[args.model],
              steps=args.steps or (2 if args.quick else 3), quick=args.quick,
              budget=QUICK if args.quick else FULL)
    env = environment(device, threads)
    console.print(report.header(env, run))
    if args.quick and not args.variants:
        run.skipped.append(Skip(run.model, "step", "reference-compiled",
                                "--quick: compiling the reference step takes minutes on a CPU"))
    bench(run, variants, console)
    elapsed = time.perf_counter() - began
    if hasattr(os, "getloadavg"):
        env["load_average_1m_end"] = os.getloadavg()[0]
    targets = report.targets(run)
    report.print_all(console, run, env, targets, elapsed)
    if args.json:
        out = {"environment": env, "floor": run.floor,
               "results": [r.to_json() for r in run.results],
               "agreement": run.agreement,
               "statistics_breakdown": [{"model": run.model, "variant": "fused", **b}
                                        for b in run.breakdown],
               "targets": targets,
               "skipped": [s.to_json() for s in run.skipped],
               "config": {"model": run.model, "batch_size": run.batch_size, "steps": run.steps,
                          "quick": run.quick, "lr": LR, "elapsed_s": elapsed}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        console.print(f"JSON written to {args.json}")
    return 1 if any(s.error for s in run.skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
