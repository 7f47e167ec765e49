"""The rest of the family as plain optimizers for the convergence tasks: each built with its
published recommended usage, wrapped (where the published usage is a preconditioner followed by a
torch optimizer) into one object with zero_grad(), step() and remove_hooks().

Only the public constructors of cafin are used. heavyball (SOAP, DyKAF's closest peer) is
optional: `soap_available()` says whether it imports, and why not.
"""
from __future__ import annotations

import torch
from torch import nn

import cafin


class PreconditionedSGD:
    """K-FAC as kfac-pytorch users run it: backward, `preconditioner.step()` (rewrites the
    gradients), then SGD."""

    def __init__(self, pre, opt: torch.optim.Optimizer):
        self.pre, self.opt = pre, opt

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.pre.step()
        self.opt.step()

    def remove_hooks(self) -> None:
        self.pre.remove_hooks()


class TwoLevelSGD(PreconditionedSGD):
    """Two-level K-FAC as its published README trains (empirical Fisher): `update_stats = True`
    before the forward pass, `step(update_params=True)` after backward, then SGD. The flag is
    lowered after the step so that the evaluation passes in between never reach the statistics."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
        self.pre.update_stats = True

    def step(self) -> None:
        self.pre.step(update_params=True)
        self.pre.update_stats = False
        self.opt.step()


class _CoarseOff(cafin.TwoLevelKFAC):
    """The same K-FAC (factors, damping, schedule, conventions, clipping) with the coarse
    correction off: the baseline the two-level paper compares against. It replaces one internal
    method; when that method is gone (TwoLevelKFAC was reorganised) `coarse_off_supported()`
    says so and the rows are not offered."""

    def _two_level(self, raws, pres):  # noqa: D401 - the K-FAC directions, uncorrected
        return pres


def coarse_off_supported() -> bool:
    return callable(getattr(cafin.TwoLevelKFAC, "_two_level", None))


# ----------------------------------------------------------------------------------- K-FAC
# kfac-pytorch's CIFAR-10 example (examples/torch_cifar10_resnet.py): batch 128 per worker,
# SGD lr 0.1, momentum 0.9, weight decay 5e-4, factor_update_steps 1, inv_update_steps 10,
# damping 3e-3, kl_clip 1e-3 (with a warm-up and step decays over 100+ epochs).
KFAC_REFERENCE_BATCH = 128
KFAC_LR_AT_REFERENCE_BATCH = 0.1


def kfac_lr(batch_size: int) -> float:
    """The example's lr scaled linearly to this batch size (0.025 at batch 32)."""
    return KFAC_LR_AT_REFERENCE_BATCH * batch_size / KFAC_REFERENCE_BATCH


def kfac_sgd(model: nn.Module, batch_size: int, backend: str = "fused") -> PreconditionedSGD:
    lr = kfac_lr(batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    pre = cafin.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10,
                                   damping=3e-3, kl_clip=1e-3, lr=lr, backend=backend)
    return PreconditionedSGD(pre, opt)


# ----------------------------------------------------------------------------------- two-level
COARSE_SPACES = ("nicolaides", "spectral", "residual", "tselepidis")
KRYLOV_SPACES = ("nicolaides", "residual")  # krylov=True is defined for these only


def twolevel_sgd(model: nn.Module, lr: float, coarse_space: str | None, krylov: bool = False,
                 **kwargs) -> TwoLevelSGD:
    """coarse_space None: the same K-FAC with the coarse correction off."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if coarse_space is None:
        pre = _CoarseOff(model, **kwargs)
    else:
        pre = cafin.TwoLevelKFAC(model, coarse_space=coarse_space, krylov=krylov, **kwargs)
    return TwoLevelSGD(pre, opt)


def twolevel_label(coarse_space: str | None, krylov: bool = False) -> str:
    if coarse_space is None:
        return "K-FAC (two-level's, coarse off)"
    return f"two-level K-FAC ({coarse_space}{' + krylov' if krylov else ''})"


# ----------------------------------------------------------------------------------- SOAP
def soap_available() -> tuple[bool, str]:
    try:
        import heavyball  # noqa: F401
    except Exception as exc:  # ImportError, or a heavyball that fails on this torch
        return False, (f"heavyball is not importable ({type(exc).__name__}: {exc}); "
                       "`pip install heavyball` adds SOAP, DyKAF's closest peer")
    return True, ""


_SOAP_COMPILE_MODE: list = []  # heavyball's own compile mode, saved at the first call


def soap(params, eager: bool, lr: float = 3e-3, precondition_frequency: int | None = None):
    """heavyball.SOAP with its defaults (lr 3e-3, betas (0.9, 0.95), shampoo_beta 0.95, weight
    decay 0.01, precondition_frequency 2). heavyball wraps its building blocks in torch.compile
    (mode max-autotune-no-cudagraphs); eager=True runs them eagerly through heavyball's own
    module switch, `heavyball.utils.compile_mode = None`, which its decorators read on every call
    (the switch is process-wide: the last SOAP built decides for all)."""
    import heavyball
    import heavyball.utils
    if not _SOAP_COMPILE_MODE:
        _SOAP_COMPILE_MODE.append(heavyball.utils.compile_mode)
    heavyball.utils.compile_mode = None if eager else _SOAP_COMPILE_MODE[0]
    kwargs = {}
    if precondition_frequency is not None:
        kwargs["precondition_frequency"] = precondition_frequency
    return heavyball.SOAP(params, lr=lr, **kwargs)
