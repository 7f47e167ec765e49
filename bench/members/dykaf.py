"""DyKAF (cafin.DyKAF): Adam in the eigenbasis of two Kronecker factors, refreshed every
`curvature_every` steps. It works from gradients (no hooks) and leaves them untouched, so
repeated steps on the same gradients are fine. Its details (bench/dykaf_phases.py) add the refresh
step, the amortised step and heavyball's SOAP, its closest peer, in the same run."""
from __future__ import annotations

from .. import dykaf_phases
from . import Member


def build(model, backend: str, curvature_every: int):
    import cafin
    return cafin.DyKAF(model.parameters(), lr=3e-3, init="eps",
                       precondition_frequency=curvature_every, backend=backend)

MEMBER = Member(
    name="dykaf", label="DyKAF", build=build, backends=("fused", "reference"),
    compiles=False, captures=False, default_variants=("fused",),
    details=dykaf_phases.run_details, targets=dykaf_phases.amortised_target,
    cpu_default_models=("mlp", "gpt"), order=30)
