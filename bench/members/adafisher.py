"""AdaFisher (cafin.AdaFisher): the bench's first member, and the model for the others."""
from __future__ import annotations

from .. import adafisher_phases
from . import Member

LR = 1e-3


def build(model, backend: str, curvature_every: int):
    import cafin
    return cafin.AdaFisher(model, lr=LR, TCov=curvature_every, backend=backend)


def published(module, model, curvature_every: int):
    # The published constructor: AdaFisher(model, lr=..., beta=..., Lambda=..., gamma=...,
    # TCov=..., weight_decay=..., dist=...), the same defaults as cafin's.
    return module.AdaFisher(model, lr=LR, TCov=curvature_every)

MEMBER = Member(
    name="adafisher", label="AdaFisher", build=build, backends=("fused", "reference"),
    default_variants=("published", "reference", "fused", "fused-compiled", "cuda-graph"),
    published=published, published_file="AdaFisher.py", published_class="AdaFisher",
    details=adafisher_phases.run_details, overhead_goal=0.03, order=0)
