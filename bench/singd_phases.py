"""SINGD's own phases of the speed bench (the `details` of its member entry): per structure
(dense, diagonal, hierarchical15_15, block30diagonal), the optimizer step with and without the
preconditioner update, for singd itself (when importable: `import singd` works), cafin's
plain-PyTorch reference backend, the fused backend and the fused backend compiled, in one run.

- "plain step": a step k with k % T != 0 on prepared gradients and factors (one real update
  step ran first): the natural gradient and the parameter update.
- "update step": a step k with k % T == 0: the preconditioner update (from curvature terms that
  one real forward/backward pass took, restored before every call: a copy of them is part of
  every implementation's time) and then the plain step's work. T = 1, so every call is one.
- "amortised over T=10": (update + 9 plain) / 10, from the two rows above (the issue's target:
  >= 3x faster than singd with the same structures).

Opt-in (`python -m bench --model mlp --optimizers singd --phases step,structures`), and only on
the models whose factors are small (mlp, gpt): dense factors of ResNet-18 (4609 x 4609) take
seconds per GEMM on a CPU core.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch

from .measure import Context, Skip, measure
from .models import loss_for
from .peers import singd_class

STRUCTURES = ("dense", "diagonal", "hierarchical15_15", "block30diagonal")
MODELS = ("mlp", "gpt")
T_AMORTISED = 10
PLAIN_T = 10**9  # k % T == 0 only at k = 0
OPTIMIZER = "SINGD"  # how these rows name the optimizer (the member's label says "diagonal")
# fused-cached: cache_preconditioner=True (K K^T and C C^T kept from each update: two GEMMs per
# step instead of four; equal to the others within rounding, not singd's order of products).
VARIANTS = ("singd", "reference", "fused", "fused-cached", "fused-compiled")


def _build(variant: str, model, structure: str, T: int):
    kw = dict(structures=(structure, structure), T=T, warn_unsupported=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if variant == "singd":
            return singd_class()(model, **kw)
        import cafin
        return cafin.SINGD(model, backend="reference" if variant == "reference" else "fused",
                           cache_preconditioner=variant == "fused-cached", **kw)


def _restorer(variant: str, opt) -> Callable[[], None]:
    """What puts back the curvature terms of the one real pass, so every timed call is a full
    preconditioner update on the same statistics."""
    if variant == "singd":
        saved_k, saved_c = copy.deepcopy(opt.H_Ks), copy.deepcopy(opt.H_Cs)

        def restore():
            opt.H_Ks = copy.deepcopy(saved_k)
            opt.H_Cs = copy.deepcopy(saved_c)
        return restore
    live = [t for state in opt.state.values() for k, t in state.items()
            if k.startswith(("H_K.", "H_C.")) or k == "H_count"]
    saved = [t.clone() for t in live]

    def restore():
        torch._foreach_copy_(live, saved)
    return restore


def step_call(ctx: Context, variant: str, structure: str, update: bool) -> Callable[[], object]:
    model = copy.deepcopy(ctx.base)
    opt = _build(variant, model, structure, 1 if update else PLAIN_T)
    loss_for(ctx.run.model, model(ctx.x), ctx.y).backward()
    opt.step()  # k = 0: a real preconditioner update; the factors are no longer the identity
    if update:  # the statistics of one more pass, kept for every timed call
        opt.zero_grad(set_to_none=False)
        loss_for(ctx.run.model, model(ctx.x), ctx.y).backward()
        restore = _restorer(variant, opt)
    step = opt.step
    if variant == "fused-compiled":
        compiled = torch.compile(opt.step, fullgraph=True)

        def step():
            with torch.no_grad():
                compiled()
    if update:
        def call():
            restore()
            step()
    else:
        def call():
            step()
    call.optimizer = opt  # for tests
    return call


def run_details(ctx: Context) -> None:
    run = ctx.run
    if "structures" not in ctx.phases:  # opt-in: python -m bench --phases step,structures
        return
    if run.model not in MODELS:
        run.skipped.append(Skip(run.model, "SINGD structures", "all", "the per-structure rows run "
                                f"on --model {' or '.join(MODELS)} (dense factors of this model "
                                "take seconds per product on a CPU core)", optimizer=OPTIMIZER))
        return
    have_singd = singd_class() is not None
    for structure in STRUCTURES:
        for kind in ("plain step", "update step"):
            phase = f"SINGD {structure} {kind}"
            for variant in VARIANTS:
                if variant == "singd" and not have_singd:
                    run.skipped.append(Skip(run.model, phase, variant, "singd is not importable "
                                            "(pip install singd)", optimizer=OPTIMIZER))
                    continue
                if variant.startswith("fused") and not ctx.fused_ok:
                    run.skipped.append(Skip(run.model, phase, variant, ctx.why_not_fused,
                                            optimizer=OPTIMIZER))
                    continue
                measure(run, ctx.progress, phase, OPTIMIZER, variant,
                        lambda v=variant, s=structure, u=kind == "update step": step_call(ctx, v, s, u))


def amortised(run) -> list[dict]:
    """Per structure and variant: (update + (T-1) plain) / T, and the speed-up over singd."""
    out = []
    for structure in STRUCTURES:
        times = {}
        for variant in VARIANTS:
            plain = run.result(f"SINGD {structure} plain step", variant, OPTIMIZER)
            upd = run.result(f"SINGD {structure} update step", variant, OPTIMIZER)
            if plain and upd:
                times[variant] = (upd.median_ms + (T_AMORTISED - 1) * plain.median_ms) / T_AMORTISED
        for variant, ms in times.items():
            out.append({"structure": structure, "variant": variant, "ms": ms,
                        "vs_singd": times["singd"] / ms if "singd" in times else None})
    return out
