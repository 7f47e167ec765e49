"""The whole-training-step phase: zero_grad, forward, backward and step, per iteration, for AdamW
(the baseline users compare against), each member's fused variants and its published code.

Every optimizer trains its own copy of one model on one batch with a curvature interval of 2, so
curvature and plain iterations alternate; the iterations of every optimizer are interleaved in
rounds (each round runs two iterations of each), so a change in the machine's load falls on all
of them alike. The median of each kind of iteration then gives the mean over a whole cycle of
the interval T the report asks for (default 100, the published default TCov):

    cycle(T) = ((T - 1) * plain + curvature) / T,

the curvature iteration amortised as it is in training; "overhead" is cycle(T) over AdamW's
iteration, minus one. The curvature iteration's extra time (curvature - plain) is the cost of the
statistics inside training, hooks and all: the same measure for cafin and for the published code.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .measure import Context, Skip, adamw_fused_supported, is_cuda, sync
from .models import loss_for, relu_in_place

INTERVAL = 2  # the curvature interval the phase trains at: curvature and plain alternate
LR = 1e-3
WHOLE_STEP_VARIANTS = ("published", "fused", "fused-compiled", "cuda-graph")


@dataclass
class Trainer:
    optimizer: str  # "adamw" or a member's name
    variant: str
    iterate: Callable[[], object]
    k: int = 0  # iterations run: the k of the next one
    alternates: bool = True  # False for AdamW: every iteration is the same
    plain_ms: list[float] = field(default_factory=list)
    curvature_ms: list[float] = field(default_factory=list)
    first_s: float = 0.0
    # What the iteration reads and writes, kept alive as long as the trainer: a CUDA graph's
    # replay holds no reference to the model, the optimizer or their tensors, so without this
    # they would be freed once built, their memory handed to the next trainer's model, and every
    # replay would write this trainer's step into that model.
    keep: tuple = ()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _iqr(xs: list[float]) -> float | None:
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def _plain_iteration(name, model, x, y, zero_grad, step) -> Callable[[], None]:
    def iterate():
        zero_grad()
        loss_for(name, model(x), y).backward()
        step()
    return iterate


def _captured_iteration(name, model, opt, x, y, device) -> tuple[Callable[[], None], int]:
    """A whole iteration captured in a CUDA graph after `warmup` eager iterations on a side stream
    (as torch.cuda.graph asks); returns the replay and the iterations already run. The replay
    reads and writes the model's and the optimizer's memory without holding them: the caller
    keeps them alive (`Trainer.keep`)."""
    warmup = 3
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            loss_for(name, model(x), y).backward()
            opt.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients in its pool
    with torch.cuda.graph(graph):
        loss_for(name, model(x), y).backward()
        opt.step()
    return graph.replay, warmup


def trainers(ctx: Context) -> list[Trainer]:
    """Build every selected trainer; what cannot run here goes to ctx.run.skipped."""
    run, device, name = ctx.run, ctx.run.device, ctx.run.model
    base = copy.deepcopy(ctx.base)
    if ctx.published:  # one model for every row: the published hooks cannot take in-place ReLU
        relu_in_place(base, False)
    out = []
    kind = "fused" if adamw_fused_supported(device) else "foreach"
    model = copy.deepcopy(base)
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, **{kind: True})
    out.append(Trainer("adamw", f"adamw-{kind}", _plain_iteration(
        name, model, ctx.x, ctx.y, lambda: adamw.zero_grad(set_to_none=True), adamw.step),
        alternates=False, keep=(model, adamw)))
    for member in ctx.members:
        for variant in WHOLE_STEP_VARIANTS:
            if variant not in ctx.selected(member):
                continue
            why = ctx.why_not(member, variant)
            if why:
                run.skipped.append(Skip(name, "whole-step", variant, why, optimizer=member.name))
                continue
            model = copy.deepcopy(base)
            try:
                if variant == "published":
                    opt = member.published(ctx.published[member.name], model, INTERVAL)
                else:
                    opt = member.build(model, "fused", INTERVAL)
                zero = (lambda o=opt: o.zero_grad(set_to_none=True))
                if variant == "cuda-graph":
                    iterate, done = _captured_iteration(name, model, opt, ctx.x, ctx.y, device)
                    out.append(Trainer(member.name, variant, iterate, k=done,
                                       keep=(model, opt, iterate.__self__)))
                    continue
                step = opt.step
                if variant == "fused-compiled":
                    compiled = torch.compile(opt.step, fullgraph=True)

                    def step(compiled=compiled):
                        with torch.no_grad():
                            compiled()
                out.append(Trainer(member.name, variant,
                                   _plain_iteration(name, model, ctx.x, ctx.y, zero, step),
                                   keep=(model, opt)))
            except Exception as exc:
                run.skipped.append(_failure(name, member.name, variant, exc))
    return out


def _failure(model: str, optimizer: str, variant: str, exc: Exception):
    text = f"{type(exc).__name__}: {exc}"
    if variant == "published":  # the user's file failing is not a failure of the bench
        return Skip(model, "whole-step", variant, f"the published code raised {text}",
                    optimizer=optimizer)
    return Skip(model, "whole-step", variant, text, error=True, optimizer=optimizer)


def _timed(trainer: Trainer, device: torch.device) -> tuple[float, bool]:
    curvature = trainer.alternates and trainer.k % INTERVAL == 0
    sync(device)
    began = time.perf_counter()
    trainer.iterate()
    sync(device)
    trainer.k += 1
    return (time.perf_counter() - began) * 1e3, curvature


def run_phase(ctx: Context) -> None:
    run, device, progress = ctx.run, ctx.run.device, ctx.progress
    budget = run.budget
    task = progress.add_task("whole step build + compile", total=1)
    live = trainers(ctx)
    progress.advance(task)
    max_rounds = max(budget.min_repeats, budget.max_repeats // 4)
    time_s = 8 * budget.time_s  # 20 s in full: ResNet-18 rounds take seconds
    task = progress.add_task("whole step (interleaved)", total=1 + max_rounds)
    for trainer in list(live):  # the first cycle: state creation, compiles, lazy init
        try:
            began = time.perf_counter()
            for _ in range(INTERVAL):
                _timed(trainer, device)
            trainer.first_s = time.perf_counter() - began
        except Exception as exc:
            run.skipped.append(_failure(run.model, trainer.optimizer, trainer.variant, exc))
            live.remove(trainer)
    progress.advance(task)
    rounds, began = 0, time.perf_counter()  # the first cycle above was the warm-up
    while live and rounds < max_rounds:
        for trainer in list(live):
            try:
                for _ in range(INTERVAL):
                    ms, curvature = _timed(trainer, device)
                    (trainer.curvature_ms if curvature else trainer.plain_ms).append(ms)
            except Exception as exc:
                run.skipped.append(_failure(run.model, trainer.optimizer, trainer.variant, exc))
                live.remove(trainer)
        rounds += 1
        progress.advance(task)
        if rounds >= budget.min_repeats and time.perf_counter() - began > time_s:
            break
    progress.update(task, total=1 + rounds, completed=1 + rounds)
    run.whole_step = summarise(live, run.tcov)
    run.whole_step_from_phases = from_phases(run)
    if is_cuda(device):
        torch.cuda.empty_cache()


def summarise(done: list[Trainer], tcov: int) -> list[dict]:
    rows = []
    for t in done:
        samples = t.plain_ms + t.curvature_ms if not t.alternates else t.plain_ms
        plain = _median(samples)
        curvature = _median(t.curvature_ms) if t.alternates else plain
        rows.append({"optimizer": t.optimizer, "variant": t.variant,
                     "plain_ms": plain, "curvature_ms": curvature,
                     "plain_n": len(samples), "curvature_n": len(t.curvature_ms),
                     "plain_iqr_over_median": _iqr(samples),
                     "statistics_in_training_ms": curvature - plain,
                     "cycle_ms": ((tcov - 1) * plain + curvature) / tcov, "tcov": tcov,
                     "first_cycle_s": t.first_s})
    base = next((r for r in rows if r["optimizer"] == "adamw"), None)
    for r in rows:
        r["overhead_vs_adamw"] = (r["cycle_ms"] / base["cycle_ms"] - 1) if base else None
        # The overhead split: what every iteration pays (hooks, step) and what the curvature
        # iterations add, amortised over the cycle.
        r["plain_overhead_vs_adamw"] = (r["plain_ms"] / base["plain_ms"] - 1) if base else None
        r["amortised_statistics_vs_adamw"] = (r["statistics_in_training_ms"] / tcov
                                              / base["plain_ms"]) if base else None
    # JSON has no NaN (a variant with too few samples of a kind): None instead.
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in r.items()} for r in rows]


def from_phases(run) -> list[dict]:
    """The same overhead composed from the step and statistics phases, which time short calls
    many times and so are steadier than whole iterations on a busy machine: per member with
    both, (its fused step - AdamW's step + its fused statistics / TCov) over AdamW's measured
    iteration. Hooks on plain iterations are left out (they launch nothing there)."""
    base = next((w for w in run.whole_step if w["optimizer"] == "adamw"), None)
    adamw = run.result("step", base["variant"], "adamw") if base else None
    out = []
    if adamw is None or not base["plain_ms"]:
        return out
    for optimizer in dict.fromkeys(w["optimizer"] for w in run.whole_step):
        step = run.result("step", "fused", optimizer)
        stats = run.result("statistics", "fused", optimizer)
        if optimizer == "adamw" or step is None or stats is None:
            continue
        extra = step.median_ms - adamw.median_ms + stats.median_ms / run.tcov
        out.append({"optimizer": optimizer, "variant": "fused", "step_ms": step.median_ms,
                    "adamw_step_ms": adamw.median_ms, "statistics_ms": stats.median_ms,
                    "adamw_iteration_ms": base["plain_ms"], "tcov": run.tcov,
                    "extra_ms": extra, "overhead_vs_adamw": extra / base["plain_ms"]})
    return out
