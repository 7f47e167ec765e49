"""The published implementations the bench runs beside cafin's members when they are installed
(cafin neither ships nor fetches them): heavyball's SOAP (DyKAF's closest peer), kfac-pytorch
(K-FAC's published code) and singd (SINGD's). Each loader returns None, or says why not, when its
package does not import."""
from __future__ import annotations

_SOAP_COMPILE_MODE: list = []  # heavyball's own compile mode, saved at the first call


def soap_available() -> tuple[bool, str]:
    try:
        import heavyball  # noqa: F401
    except Exception as exc:  # ImportError, or a heavyball that fails on this torch
        return False, (f"heavyball is not importable ({type(exc).__name__}: {exc}); "
                       "`pip install heavyball` adds SOAP, DyKAF's closest peer")
    return True, ""


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


def kfac_pytorch():
    """kfac-pytorch's module when the user has it installed, else None."""
    try:
        import kfac
        import kfac.preconditioner  # noqa: F401
    except ImportError:
        return None
    return kfac


def singd_class():
    """singd's SINGD when the package is importable, else None."""
    try:
        from singd.optim.optimizer import SINGD
    except ImportError:
        return None
    return SINGD
