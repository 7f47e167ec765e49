"""SINGD (cafin.SINGD). The shared step phase times the diagonal structure, the elementwise,
AdamW-priced configuration; its own phases (bench/singd_phases.py) time the step with and
without the preconditioner update per structure against singd itself."""
from __future__ import annotations

from .. import singd_phases
from . import Member


def build(model, backend: str, curvature_every: int):
    import cafin
    return cafin.SINGD(model, T=curvature_every, structures=("diagonal", "diagonal"),
                       warn_unsupported=False, backend=backend)

MEMBER = Member(
    name="singd", label="SINGD (diagonal)", build=build, backends=("fused", "reference"),
    compiles=True, captures=True, default_variants=("fused",), details=singd_phases.run_details,
    order=20)
