"""K-FAC's own rows of the speed bench (the `details` of its member entry), beside the member's
step rows (preconditioner + SGD on a step that decomposes nothing):

- "preconditioner alone": `preconditioner.step()` alone on a step that decomposes nothing (the KL-clipped
  eigenbasis products), reference / fused / fused under torch.compile / kfac-pytorch;
- "inverse step": preconditioner + SGD on a step that eigendecomposes every factor (inv_update_steps=1);
  with the step rows it gives the amortised step at inv_update_steps=10 (the targets);
- "factor statistics" (run with the statistics phase): the factor statistics of one factor-update step (every
  layer's A and G covariance and its EMA fold) on activations and output gradients captured once
  (a phase of its own: the whole-step composition from the statistics phase would count it as
  K-FAC's whole curvature cost, which the decompositions dominate);
- kfac-pytorch (gpauloski/kfac-pytorch, `import kfac`) is timed beside cafin when it is installed;
  cafin does not ship it and the bench never fetches it.

Every row repeats its step on the same gradients: the preconditioner rewrites them, so they are
restored after each call (two gradient copies, in every row alike).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from . import floors
from .measure import Context, PreconditionedSGD, Skip, fmt_ms, fmt_ratio, measure
from .models import loss_for
from .peers import kfac_pytorch

# The intervals of the rows: never due again after the preparing step (k = 0), or every step.
NEVER = 10**9
EVERY = 1
AMORTISE_EVERY = 10  # inv_update_steps of the amortised-step targets (kfac-pytorch's CIFAR example)
KFAC_PYTORCH = "kfac-pytorch"
# The phases (table titles) of the rows.
PRECONDITION, INVERSE, FACTORS = "preconditioner alone", "inverse step", "factor statistics"


def build_preconditioner(variant: str, model, inv_every: int, kw: dict):
    """`kw`: the member's preconditioner settings (damping, kl_clip, lr), the same for
    kfac-pytorch."""
    if variant == KFAC_PYTORCH:
        module = kfac_pytorch()
        return module.preconditioner.KFACPreconditioner(
            model, factor_update_steps=inv_every, inv_update_steps=inv_every, **kw)
    import cafin
    backend = "reference" if variant.startswith("reference") else "fused"
    return cafin.KFACPreconditioner(model, factor_update_steps=inv_every,
                                    inv_update_steps=inv_every, backend=backend, **kw)


def prepared(ctx: Context, variant: str, inv_every: int, kw: dict,
             sgd_kw: dict | None) -> Callable[[], object]:
    """The repeatable step of `variant` (followed by torch's SGD with `sgd_kw`, or alone when
    None) on a model copy whose factors and decompositions one real step (k = 0) prepared."""
    model = copy.deepcopy(ctx.base)
    pre = build_preconditioner(variant, model, inv_every, kw)
    loss_for(ctx.run.model, model(ctx.x), ctx.y).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, **sgd_kw) if sgd_kw is not None else None
    step = PreconditionedSGD(pre, opt, params=params, restore_grads=True)
    step.step()  # k = 0: factors and decompositions; later calls decompose only if inv_every == 1
    if variant.endswith("-compiled"):
        # A compiled step cannot keep the host's step count, so it would gate eigh on the device
        # and run it on every step: decompositions stay eager, on their interval, as for capture.
        pre.decompose_in_step = False
        compiled = torch.compile(pre.step, fullgraph=True)

        def run_compiled():
            with torch.no_grad():
                compiled()
        step.precondition = run_compiled
    return step.step


def captured_statistics(ctx: Context, backend: str, kw: dict) -> Callable[[], object]:
    """The factor statistics of one factor-update step: every registered layer's input and
    output-gradient covariance and its EMA fold, on the tensors one forward/backward gave the
    preconditioner's hooks (kept once, then fed to the same methods on every call)."""
    import cafin
    model = copy.deepcopy(ctx.base)
    pre = cafin.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=NEVER,
                                   backend=backend, **kw)
    calls = []
    take_input, take_grad = pre.take_input_statistics, pre.take_grad_statistics
    pre.take_input_statistics = lambda layer, x, step: calls.append(
        (take_input, layer, x.detach().clone(), step))
    pre.take_grad_statistics = lambda layer, g, step: calls.append(
        (take_grad, layer, g.detach().clone(), step))
    loss_for(ctx.run.model, model(ctx.x), ctx.y).backward()
    pre.remove_hooks()
    if not calls:
        raise RuntimeError("no registered layer took statistics")

    def run():
        for method, layer, t, step in calls:
            method(layer, t, step)
    return run


def precondition_flops(base) -> int:
    """The floating-point operations of the eigenbasis products of one preconditioning step,
    Q_G (Q_G^T V Q_A ⊘ (d_G d_A^T + λ)) Q_A^T, over the registered layers (bench/floors.py,
    `eigenbasis_flops`). The fused and reference backends run the same products (in torch);
    only the work around them differs."""
    return sum(floors.eigenbasis_flops(*sizes) for sizes in floors.kfac_layers(base))


def run_details(ctx: Context, kw: dict, sgd_kw: dict) -> None:
    """K-FAC's rows; `kw`: the member's preconditioner settings (damping, kl_clip, lr), `sgd_kw`:
    its SGD's (lr, momentum, weight_decay)."""
    run, progress = ctx.run, ctx.progress
    run.floor["kfac_precondition_flop"] = precondition_flops(ctx.base)
    member = "kfac"
    # The compiled preconditioner only on request (--variants ...,fused-compiled): a compile.
    selected = ctx.selected(next(m for m in ctx.members if m.name == member)) | (
        {"fused-compiled"} & ctx.requested)
    have_kfac = kfac_pytorch() is not None
    why_no_kfac = ("kfac-pytorch is not installed (it is not on PyPI: install "
                   "gpauloski/kfac-pytorch yourself to time it here)")

    def row(phase, variant, build):
        if variant.startswith("fused") and not ctx.fused_ok:
            run.skipped.append(Skip(run.model, phase, variant, ctx.why_not_fused, optimizer=member))
            return
        if variant == KFAC_PYTORCH and not have_kfac:
            run.skipped.append(Skip(run.model, phase, variant, why_no_kfac, optimizer=member))
            return
        before = len(run.skipped)
        measure(run, progress, phase, member, variant, build)
        if variant == KFAC_PYTORCH:  # its failures are not cafin's
            for s in run.skipped[before:]:
                s.error = False
                s.reason = "kfac-pytorch raised " + s.reason

    if "step" in ctx.phases:
        # kfac-pytorch + SGD beside the member's own step rows (same phase, same restoring).
        row("step", KFAC_PYTORCH, lambda: prepared(ctx, KFAC_PYTORCH, NEVER, kw, sgd_kw))
        for variant in ("reference", "fused", "fused-compiled", KFAC_PYTORCH):
            if variant in selected or variant == KFAC_PYTORCH:
                row(PRECONDITION, variant,
                    lambda v=variant: prepared(ctx, v, NEVER, kw, None))
        for variant in ("reference", "fused", KFAC_PYTORCH):
            if variant in selected or variant == KFAC_PYTORCH:
                row(INVERSE, variant, lambda v=variant: prepared(ctx, v, EVERY, kw, sgd_kw))
    if "statistics" in ctx.phases:
        for variant in ("reference", "fused"):
            if variant in selected:
                row(FACTORS, variant, lambda v=variant: captured_statistics(ctx, v, kw))


def amortised(step_ms: float, inverse_ms: float, every: int = AMORTISE_EVERY) -> float:
    """One step in a cycle of `every`: (every - 1) plain steps and one that decomposes."""
    return ((every - 1) * step_ms + inverse_ms) / every


def targets(run) -> list[dict]:
    """The K-FAC targets: the amortised preconditioner + SGD step at inv_update_steps=10 against
    AdamW(fused=True)'s step, and against the same amortised step of the reference backend."""
    def ms(phase, variant, optimizer="kfac"):
        r = run.result(phase, variant, optimizer)
        return r.median_ms if r else None

    def cycle(variant):
        s, i = ms("step", variant), ms(INVERSE, variant)
        return amortised(s, i) if s is not None and i is not None else None

    out = []
    fused, ref, adamw = cycle("fused"), cycle("reference"), ms("step", "adamw-fused", "adamw")

    def add(name, measured, goal, ok, **numbers):
        out.append({"target": name, "measured": measured, "goal": goal,
                    "verdict": "n/a" if ok is None else ("met" if ok else "missed"), **numbers})

    how = f"(9 x step + inverse step) / {AMORTISE_EVERY}"
    both = fused is not None and adamw is not None
    flop, step = run.floor.get("kfac_precondition_flop"), ms("step", "fused")
    # Why the gap: the preconditioner's GEMMs against AdamW's elementwise pass over the weights.
    gemms = (f"; the eigenbasis GEMMs alone: {flop / 1e9:.2f} GFLOP per step "
             f"({flop / step / 1e6:.0f} GFLOP/s in the fused step)" if flop and step else "")
    add(f"K-FAC + SGD fused: amortised step (inv_update_steps={AMORTISE_EVERY}) vs adamw-fused",
        f"{fmt_ms(fused)} ms {how} = {fmt_ratio(fused / adamw)} AdamW's {fmt_ms(adamw)} ms{gemms}"
        if both else "-", "<= 2x its time", (fused <= 2 * adamw) if both else None,
        amortised_ms=fused, adamw_fused_ms=adamw, precondition_flop=flop)
    both = fused is not None and ref is not None
    add(f"K-FAC + SGD fused vs reference: amortised step (inv_update_steps={AMORTISE_EVERY})",
        f"{fmt_ratio(ref / fused)} faster ({fmt_ms(ref)} vs {fmt_ms(fused)} ms)" if both else "-",
        ">= 3x faster", (ref / fused >= 3) if both else None,
        amortised_ms=fused, reference_amortised_ms=ref)
    return out
