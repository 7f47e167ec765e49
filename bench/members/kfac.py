"""K-FAC (cafin.KFACPreconditioner) with the SGD that kfac-pytorch users run after it
(kfac-pytorch's CIFAR settings: SGD lr 0.1, momentum 0.9, weight decay 5e-4).

Its `details` (bench/kfac_phases.py) add the preconditioner step alone, the step that
eigendecomposes, the factor statistics, and kfac-pytorch when it is installed; its `targets` the
amortised step at inv_update_steps=10 against AdamW and against the reference backend."""
from __future__ import annotations

from . import Member


class KFACWithSGD:
    """A preconditioner and its SGD as one optimizer. The step phase repeats `step()` on the same
    gradients, and the preconditioner rewrites them: they are restored after each step (two
    copies of the gradients, counted in the step's time)."""

    def __init__(self, model, backend: str, curvature_every: int):
        import torch
        import cafin
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=0.1, momentum=0.9, weight_decay=5e-4)
        # The factors every curvature_every steps, the eigendecompositions as rarely.
        self.pre = cafin.KFACPreconditioner(
            model, factor_update_steps=curvature_every, inv_update_steps=curvature_every,
            damping=3e-3, kl_clip=1e-3, lr=0.1, backend=backend)

    def step(self):
        grads = [p for p in self.params if p.grad is not None]
        saved = [p.grad.clone() for p in grads]
        self.pre.step()
        self.opt.step()
        for p, g in zip(grads, saved):
            p.grad.copy_(g)

    def zero_grad(self, set_to_none: bool = True):
        self.opt.zero_grad(set_to_none=set_to_none)


def details(ctx) -> None:
    from ..kfac_phases import run_details
    run_details(ctx)


def targets(run) -> list[dict]:
    from ..kfac_phases import targets as kfac_targets
    return kfac_targets(run)


MEMBER = Member(
    name="kfac", label="K-FAC + SGD",
    build=lambda model, backend, every: KFACWithSGD(model, backend, every),
    # The step rows. Compiled: only the preconditioner alone, a `details` row (--variants
    # fused-compiled); a compiled step of this class would eigendecompose on every step.
    backends=("fused", "reference"), compiles=False, captures=False,
    default_variants=("reference", "fused"), cpu_default_models=("mlp", "gpt"), order=10,
    details=details, targets=targets)
