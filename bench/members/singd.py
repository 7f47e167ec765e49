"""SINGD (cafin.SINGD) with diagonal structures, the elementwise, AdamW-priced configuration."""
from __future__ import annotations

from . import Member


def build(model, backend: str, curvature_every: int):
    import cafin
    return cafin.SINGD(model, T=curvature_every, structures=("diagonal", "diagonal"),
                       warn_unsupported=False, backend=backend)


MEMBER = Member(
    name="singd", label="SINGD (diagonal)", build=build, backends=("fused", "reference"),
    compiles=True, captures=True, default_variants=("fused",), order=20)
