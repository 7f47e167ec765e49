"""The registry of the optimizers the bench compares: one file per member of the family, each
the one place that says how the member is built on a model (for the speed bench and, where it
has one, for `python -m bench convergence`) and how a step drives it (a preconditioner followed
by SGD goes through `bench.measure.PreconditionedSGD`).

Plugging a member in: add `bench/members/<name>.py` defining `MEMBER = Member(...)`; nothing else
changes (the files of this package are discovered). `python -m bench --optimizers a,b` then
selects it by `Member.name`. A member's own phases live in `bench/<name>_phases.py`, which its
file imports; phases modules import only the leaves (bench/measure.py, bench/models.py,
bench/peers.py), never a member's file nor the report.

What a member supplies (see `Member`):
- `build(model, backend, curvature_every)`: a fresh optimizer for `model` (already on its device)
  with `step()` and `zero_grad(set_to_none=...)`. The optimizer takes its curvature statistics on
  the forward/backward passes of the iterations k = 0, curvature_every, 2*curvature_every, ...
  (k counts completed `step()` calls), as AdaFisher's TCov does; a member with several
  intervals (K-FAC: factor and inverse updates) maps this one onto all of them. `backend` is one
  of `Member.backends`. The step phase calls `step()` many times on the same gradients without
  a new backward: a preconditioner that rewrites `.grad` must keep that repeatable (precondition
  a copy, or restore the gradients), or the timings run on numbers that grow without bound.
- `backends`: the implementations the bench times, headline first ("fused", then usually
  "reference": the member's plain-PyTorch reference).
- `compiles` / `captures`: whether `torch.compile(opt.step, fullgraph=True)` works and whether a
  whole training step can be captured in a CUDA graph (the bench then times those variants).
- `default_variants`: what a plain `python -m bench` measures for this member; keep it to the
  headline rows (the default run shows every member and must stay under 3 minutes on 2 cores).
- `published(module, model, curvature_every)`: optional; builds the published implementation from
  the user's own copy of its file (`--published NAME=PATH`), loaded as `module`.
- `overhead_goal`: optional; the target for the whole training step's time over AdamW's at the
  curvature interval of 100 (AdaFisher: 0.03, i.e. at most 3 % slower).
- `details(context)`: optional member-specific phases (AdaFisher: the statistics of one curvature
  step on captured activations, and fused-vs-reference agreement; DyKAF: its refresh step and
  heavyball's SOAP as a peer). Results of a phase other than step/statistics get their own table.
- `targets(run)`: optional; the member's own target rows (dicts: target, measured, goal, verdict).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from torch import nn

# The variants the step and whole-step phases know, in table order.
VARIANTS = ("published", "reference", "reference-compiled", "fused", "fused-compiled", "cuda-graph")


@dataclass(frozen=True)
class Member:
    name: str  # the --optimizers name
    label: str  # how tables name it
    build: Callable[[nn.Module, str, int], Any]
    backends: tuple[str, ...] = ("fused", "reference")
    compiles: bool = True
    captures: bool = True
    default_variants: tuple[str, ...] = ("fused",)
    published: Callable[[ModuleType, nn.Module, int], Any] | None = None
    published_file: str = ""  # the file --published expects, for messages
    published_class: str = ""  # the class that file must define
    details: Callable[[Any], None] | None = None
    overhead_goal: float | None = None  # the target for the whole-step overhead over AdamW
    targets: Callable[[Any], list[dict]] | None = None  # its own target rows, from the run
    order: int = 100  # table order; AdaFisher first
    # The models a plain `python -m bench` (no --optimizers) runs this member on when the device
    # is the CPU (None: every model). K-FAC and DyKAF decompose ResNet-18's 4609 x 4609 factors,
    # minutes of LAPACK on two cores: their CPU headline rows come from the smaller models.
    cpu_default_models: tuple[str, ...] | None = None

    def runs_by_default(self, model: str | None, device: str | None) -> bool:
        return (self.cpu_default_models is None or device != "cpu" or model is None
                or model in self.cpu_default_models)

    def variants(self) -> tuple[str, ...]:
        """Every variant this member can run (on a CUDA device; the bench drops what a device
        cannot run)."""
        out = []
        for v in VARIANTS:
            backend = v.removesuffix("-compiled")
            if v == "published":
                ok = self.published is not None
            elif v == "cuda-graph":
                ok = self.captures and "fused" in self.backends
            else:
                ok = backend in self.backends and (self.compiles or not v.endswith("-compiled"))
            if ok:
                out.append(v)
        return tuple(out)


def registry() -> dict[str, Member]:
    """Every member found in this package, in table order."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        member = getattr(module, "MEMBER", None)
        if not isinstance(member, Member):
            raise TypeError(f"bench/members/{info.name}.py must define MEMBER = Member(...)")
        found.append(member)
    found.sort(key=lambda m: (m.order, m.name))
    names = [m.name for m in found]
    if len(set(names)) != len(names):
        raise ValueError(f"two bench members share a name: {names}")
    return {m.name: m for m in found}


def select(spec: str | None, model: str | None = None, device: str | None = None) -> list[Member]:
    """The members a comma list names (None or empty: the default selection, every member that
    runs by default on `model` and `device`), in table order; an unknown name raises ValueError
    naming it and the known ones."""
    members = registry()
    if not spec:
        return [m for m in members.values() if m.runs_by_default(model, device)]
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in members]
    if unknown:
        raise ValueError(f"unknown optimizer{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; choose from {', '.join(members)}")
    return [m for m in members.values() if m.name in names]
