"""DyKAF's own phases of the speed bench (the `details` of its member entry), with heavyball's
SOAP, its closest published peer, in the same run:

- step (SOAP rows added to the step table): the plain step, no eigenbasis refresh;
- refresh step: a step that also refreshes the eigenbases (DyKAF: one projector-splitting step
  and QR per factor; SOAP: its QR power step), timed with a refresh on every call;
- amortised at precondition_frequency F = 10 (DyKAF's published default; SOAP's is 2, set to 10
  here so both refresh equally often): (refresh + (F - 1) x plain) / F, composed from the two
  medians. The issue's target: DyKAF's amortised step no slower than SOAP's.

Variants: DyKAF fused and reference (eager); fused-compiled (torch.compile of step(), not
fullgraph: the refresh decision is taken on the host) and SOAP compiled (heavyball's own
torch.compile, its default) when `--variants` names fused-compiled; SOAP eager
(heavyball.utils.compile_mode = None) when heavyball imports. Inductor takes minutes to compile
SOAP's many regions (on 2 CPU cores, and the GPU check has minutes in all), so the compiled rows
are opt-in.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import torch

from .measure import Context, Result, Skip, measure
from .models import loss_for
from .peers import soap, soap_available

FREQUENCY = 10
NEVER = 10**9  # a refresh only at the first step
DYKAF = dict(lr=3e-3, betas=(0.95, 0.95), init="eps")


def _prepared(ctx: Context, make: Callable, compiled: bool) -> Callable[[], object]:
    model = copy.deepcopy(ctx.base)
    opt = make(model)
    loss_for(ctx.run.model, model(ctx.x), ctx.y).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad.detach().clone() for p in params]
    opt.step()  # the first step builds the factors and bases
    if any(p.grad is None for p in params):
        # heavyball drops the gradients after each step (set to None): hand the same ones back
        # before every timed step (attribute assignments, no copy).
        inner = opt.step

        def step_with_grads():
            for p, g in zip(params, grads):
                p.grad = g
            return inner()
        opt.step = step_with_grads
    if compiled:
        step = torch.compile(opt.step)

        def run():
            with torch.no_grad():
                step()
        return run
    return opt.step


def _dykaf(backend: str, frequency: int):
    import cafin
    return lambda m: cafin.DyKAF(m.parameters(), precondition_frequency=frequency,
                                 backend=backend, **DYKAF)


def _soap(eager: bool, frequency: int):
    # use_precond_schedule stays off (heavyball's default): a refresh every `frequency` steps.
    return lambda m: soap(m.parameters(), eager=eager, precondition_frequency=frequency)


def run_details(ctx: Context) -> None:
    if "step" not in ctx.phases:
        return
    run, progress = ctx.run, ctx.progress
    # Compiles take minutes (inductor, SOAP's many regions): only on request, also on CUDA, so
    # that the GPU check's quick run stays quick.
    want_compiled = "fused-compiled" in ctx.requested
    soap_ok, why_no_soap = soap_available()
    rows: list[tuple[str, str, Callable, Callable]] = []  # optimizer, variant, plain, refresh
    for backend in ("fused", "reference"):
        if backend == "fused" and not ctx.fused_ok:
            run.skipped.append(Skip(run.model, "refresh step", "fused", ctx.why_not_fused,
                                    optimizer="dykaf"))
            continue
        rows.append(("dykaf", backend, _dykaf(backend, NEVER), _dykaf(backend, 1)))
    if want_compiled and ctx.fused_ok:
        rows.append(("dykaf", "fused-compiled", _dykaf("fused", NEVER), _dykaf("fused", 1)))
    if soap_ok:
        rows.append(("soap", "heavyball (eager)", _soap(True, NEVER), _soap(True, 1)))
        if want_compiled:
            rows.append(("soap", "heavyball (compiled)", _soap(False, NEVER), _soap(False, 1)))
        else:
            run.skipped.append(Skip(run.model, "step", "heavyball (compiled)",
                                    "inductor compiles SOAP for minutes: --variants "
                                    "fused,fused-compiled adds it", optimizer="soap"))
    else:
        run.skipped.append(Skip(run.model, "step", "heavyball", why_no_soap, optimizer="soap"))
    for optimizer, variant, plain, refresh in rows:
        # heavyball compiles itself (its own switch); DyKAF's step goes through torch.compile
        compiled = variant.endswith("compiled") and optimizer == "dykaf"
        if not (optimizer == "dykaf" and variant in ("fused", "reference")
                and run.result("step", variant, "dykaf")):
            # (the member's own step rows already hold DyKAF's eager plain steps)
            measure(run, progress, "step", optimizer, variant,
                    lambda p=plain, c=compiled: _prepared(ctx, p, c))
        measure(run, progress, "refresh step", optimizer, variant,
                lambda r=refresh, c=compiled: _prepared(ctx, r, c))
    for optimizer, variant, _, _ in rows:
        p = run.result("step", variant, optimizer)
        r = run.result("refresh step", variant, optimizer)
        if p is None or r is None:
            continue
        ms = (r.median_ms + (FREQUENCY - 1) * p.median_ms) / FREQUENCY
        run.results.append(Result(run.model, f"amortised, refresh every {FREQUENCY}", variant, ms,
                                  max(p.allocated_bytes, r.allocated_bytes), 0, math.nan, 0.0, ms,
                                  optimizer=optimizer))


def amortised_target(run) -> list[dict]:
    """DyKAF's target: its amortised step (fused) no slower than heavyball SOAP's (the faster of
    SOAP's measured variants)."""
    phase = f"amortised, refresh every {FREQUENCY}"
    mine = run.result(phase, "fused", "dykaf")
    soaps = [r for r in run.results if r.phase == phase and r.optimizer == "soap"]
    if mine is None or not soaps:
        return []
    best = min(soaps, key=lambda r: r.median_ms)
    ratio = mine.median_ms / best.median_ms
    return [{"target": f"DyKAF fused amortised step (refresh every {FREQUENCY}) vs SOAP "
                       f"{best.variant}", "measured": f"{ratio:.2f}x its time",
             "goal": "<= 1.00x", "verdict": "met" if ratio <= 1.0 else "missed"}]
