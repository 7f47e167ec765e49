"""DyKAF (cafin.DyKAF): Adam in the eigenbasis of two Kronecker factors, refreshed every
`curvature_every` steps. It works from gradients (no hooks) and leaves them untouched, so
repeated steps on the same gradients are fine. Its details (bench/dykaf_phases.py) add the refresh
step, the amortised step and heavyball's SOAP, its closest peer, in the same run."""
from __future__ import annotations

from . import Member


def build(model, backend: str, curvature_every: int):
    import cafin
    return cafin.DyKAF(model.parameters(), lr=3e-3, init="eps",
                       precondition_frequency=curvature_every, backend=backend)


def details(ctx) -> None:
    from ..dykaf_phases import run_details
    run_details(ctx)


def targets(run) -> list[dict]:
    from ..dykaf_phases import amortised_target
    return amortised_target(run)


MEMBER = Member(
    name="dykaf", label="DyKAF", build=build, backends=("fused", "reference"),
    compiles=False, captures=False, default_variants=("fused",), details=details,
    targets=targets, cpu_default_models=("mlp", "gpt"), order=30)
