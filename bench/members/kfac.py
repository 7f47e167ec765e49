"""K-FAC (cafin.KFACPreconditioner) with the SGD that kfac-pytorch users run after it, in
kfac-pytorch's CIFAR-10 example settings (examples/torch_cifar10_resnet.py: batch 128 per worker,
SGD lr 0.1, momentum 0.9, weight decay 5e-4, factor_update_steps 1, inv_update_steps 10, damping
3e-3, kl_clip 1e-3, with a warm-up and step decays over 100+ epochs, dropped here).

Its `details` (bench/kfac_phases.py) add the preconditioner step alone, the step that
eigendecomposes, the factor statistics, and kfac-pytorch when it is installed; its `targets` the
amortised step at inv_update_steps=10 against AdamW and against the reference backend."""
from __future__ import annotations

import torch
from torch import nn

from .. import kfac_phases
from ..measure import PreconditionedSGD
from . import Member

PRECONDITIONER = dict(damping=3e-3, kl_clip=1e-3)
# fused: torch's one-kernel SGD (CPU and CUDA), the follower's counterpart of the fused AdamW
# baseline; same update as the default per-parameter loop, which costs ~1.8 ms on the GPT at 1
# thread (5x its bytes at the copy bandwidth) and would be timed as K-FAC's.
SGD = dict(momentum=0.9, weight_decay=5e-4, fused=True)
REFERENCE_BATCH = 128
LR_AT_REFERENCE_BATCH = 0.1


def lr_for(batch_size: int) -> float:
    """The example's lr scaled linearly to this batch size (0.025 at batch 32)."""
    return LR_AT_REFERENCE_BATCH * batch_size / REFERENCE_BATCH


def sgd(model: nn.Module, lr: float, factor_update_steps: int = 1, inv_update_steps: int = 10,
        backend: str = "fused", restore_grads: bool = False) -> PreconditionedSGD:
    """K-FAC as kfac-pytorch users run it: backward, `preconditioner.step()` (rewrites the
    gradients, its kl_clip at the same lr), then SGD."""
    import cafin
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, **SGD)
    pre = cafin.KFACPreconditioner(model, factor_update_steps=factor_update_steps,
                                   inv_update_steps=inv_update_steps, lr=lr, backend=backend,
                                   **PRECONDITIONER)
    return PreconditionedSGD(pre, opt, restore_grads=restore_grads)


def _build(model, backend: str, curvature_every: int) -> PreconditionedSGD:
    # The factors every curvature_every steps, the eigendecompositions as rarely; the gradients
    # restored after each step (the step phase repeats it on the same ones).
    return sgd(model, LR_AT_REFERENCE_BATCH, curvature_every, curvature_every, backend,
               restore_grads=True)


def details(ctx) -> None:
    kfac_phases.run_details(ctx, dict(PRECONDITIONER, lr=LR_AT_REFERENCE_BATCH),
                            dict(SGD, lr=LR_AT_REFERENCE_BATCH))


MEMBER = Member(
    name="kfac", label="K-FAC + SGD",
    build=_build,
    # The step rows. Compiled: only the preconditioner alone, a `details` row (--variants
    # fused-compiled); a compiled step of this class would eigendecompose on every step.
    backends=("fused", "reference"), compiles=False, captures=False,
    default_variants=("reference", "fused"), cpu_default_models=("mlp", "gpt"), order=10,
    details=details, targets=kfac_phases.targets)
