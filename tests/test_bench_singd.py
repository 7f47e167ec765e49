"""SINGD's per-structure bench rows (bench/singd_phases.py): the timed calls do what their rows
say (an update step consumes the same restored statistics every call; a plain step updates
nothing but the parameters), and the amortised figure is (update + (T-1) plain) / T. No timing
assertions: speed is measured only in the bench."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import singd_phases  # noqa: E402
from bench.measure import Result  # noqa: E402


def _ctx():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 10))
    x, y = torch.randn(8, 20), torch.randint(0, 10, (8,))
    run = SimpleNamespace(model="mlp", results=[], skipped=[])
    return SimpleNamespace(base=base, x=x, y=y, run=run)


@pytest.mark.parametrize("structure", ["dense", "hierarchical15_15", "diagonal"])
@pytest.mark.parametrize("variant", ["reference", "fused", "fused-cached"])
def test_update_calls_are_repeatable_and_leave_the_base_model(structure, variant):
    """Two fresh setups give the same parameters after two timed update calls each, and the
    base model every setup copies is untouched."""
    runs = []
    for _ in range(2):
        ctx = _ctx()
        start = [p.detach().clone() for p in ctx.base.parameters()]
        call = singd_phases.step_call(ctx, variant, structure, update=True)
        call()
        call()
        assert all(torch.equal(a, b) for a, b in zip(start, ctx.base.parameters()))
        runs.append([p.detach().clone() for p in call.optimizer.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert any(not torch.equal(a, b) for a, b in zip(runs[0], start))


def _watched(call) -> list[tuple[list[float], list[torch.Tensor]]]:
    """(H_count per layer, copies of the K and C factors) of the timed call's optimizer, before and
    after each of its steps (torch.optim's public step hooks)."""
    opt, seen = call.optimizer, []

    def record(*_):
        seen.append(([st["H_count"].item() for st in opt.state.values() if "H_count" in st],
                     [t.clone() for st in opt.state.values() for k, t in st.items()
                      if k.startswith(("K.", "C."))]))
    opt.register_step_pre_hook(record)
    opt.register_step_post_hook(record)
    return seen


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_each_update_call_updates_the_preconditioner_from_restored_statistics():
    call = singd_phases.step_call(_ctx(), "fused", "dense", update=True)
    seen = _watched(call)
    call()
    call()
    (before1, k0), (after1, k1), (before2, k1_again), (after2, k2) = seen
    # Every call: the same one pass of statistics again, consumed by an update of the factors.
    assert before1 == before2 == [1.0, 1.0] and after1 == after2 == [0.0, 0.0]
    assert not _same(k0, k1) and _same(k1, k1_again) and not _same(k1, k2)
    plain = singd_phases.step_call(_ctx(), "fused", "dense", update=False)
    seen = _watched(plain)
    plain()
    (before, k0), (after, k1) = seen
    assert before == after == [0.0, 0.0] and _same(k0, k1)  # the plain step updates no factor


def test_amortised():
    run = SimpleNamespace(results=[])

    def add(structure, kind, variant, ms):
        run.results.append(Result("mlp", f"SINGD {structure} {kind}", variant, ms, 0, 3, 0.0, 0.0, ms,
                                  optimizer=singd_phases.OPTIMIZER))
    run.result = lambda phase, variant, optimizer: next(
        (r for r in run.results if (r.phase, r.variant, r.optimizer) == (phase, variant, optimizer)), None)
    add("dense", "plain step", "singd", 10.0)
    add("dense", "update step", "singd", 30.0)
    add("dense", "plain step", "fused", 5.0)
    add("dense", "update step", "fused", 15.0)
    add("dense", "plain step", "reference", 9.0)  # no update row: no amortised figure
    rows = {r["variant"]: r for r in singd_phases.amortised(run)}
    assert set(rows) == {"singd", "fused"}
    assert rows["singd"]["ms"] == pytest.approx((30 + 9 * 10) / 10)
    assert rows["fused"]["vs_singd"] == pytest.approx(12.0 / 6.0)
