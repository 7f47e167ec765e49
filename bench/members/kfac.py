"""K-FAC (cafin.KFACPreconditioner) with the SGD that kfac-pytorch users run after it
(kfac-pytorch's CIFAR settings: SGD lr 0.1, momentum 0.9, weight decay 5e-4).

Its `details` (bench/kfac_phases.py) add the preconditioner step alone, the step that
eigendecomposes, the factor statistics, and kfac-pytorch when it is installed; its `targets` the
amortised step at inv_update_steps=10 against AdamW and against the reference backend."""
from __future__ import annotations

from . import Member, PreconditionerWithSGD


def _build(model, backend: str, curvature_every: int) -> PreconditionerWithSGD:
    import torch
    import cafin
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)
    # The factors every curvature_every steps, the eigendecompositions as rarely.
    pre = cafin.KFACPreconditioner(
        model, factor_update_steps=curvature_every, inv_update_steps=curvature_every,
        damping=3e-3, kl_clip=1e-3, lr=0.1, backend=backend)
    return PreconditionerWithSGD(params, pre, opt)


def details(ctx) -> None:
    from ..kfac_phases import run_details
    run_details(ctx)


def targets(run) -> list[dict]:
    from ..kfac_phases import targets as kfac_targets
    return kfac_targets(run)


MEMBER = Member(
    name="kfac", label="K-FAC + SGD",
    build=_build,
    # The step rows. Compiled: only the preconditioner alone, a `details` row (--variants
    # fused-compiled); a compiled step of this class would eigendecompose on every step.
    backends=("fused", "reference"), compiles=False, captures=False,
    default_variants=("reference", "fused"), cpu_default_models=("mlp", "gpt"), order=10,
    details=details, targets=targets)
