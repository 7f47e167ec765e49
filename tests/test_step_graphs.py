"""cafin.StepGraphs on the CPU stand-in of CUDA graphs (tests/capture.py), over every member:

- replayed over several curvature intervals, the graphs give the eager run's parameters after
  every step and its state at the end (float64), with distinct intervals for the statistics and
  the decompositions (K-FAC, whose eigendecompositions run eagerly on their steps);
- a step that is not due replays a graph with no curvature work in it: its FLOPs are at most
  1.05x the eager not-due step's, and it holds no decomposition;
- one graph per phase, captured the first time the phase comes;
- bad arguments are refused, naming them.

The same on a GPU with real CUDA graphs: tests/test_cuda_graphs_members.py.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import cafin
from capture import Graph
from members import MEMBERS, Run
from test_capture_contract import _assert_state_close, batches, mlp

WARMUP = 2


def _member(name):
    return next(m for m in MEMBERS if m.name == name)


# (id, member, keywords of the statistics interval, keywords of the second interval or {})
SETUPS = [
    ("AdaFisher", "AdaFisher", lambda t: {"TCov": t}),
    ("KFAC-eigen", "KFACPreconditioner",
     lambda t: {"factor_update_steps": t, "inv_update_steps": 2 * t}),
    ("KFAC-inverse", "KFACPreconditioner",
     lambda t: {"factor_update_steps": t, "inv_update_steps": 2 * t, "compute_method": "inverse"}),
    ("SINGD-dense", "SINGD", lambda t: {"T": t, "structures": ("dense", "dense")}),
    ("SINGD-diagonal", "SINGD", lambda t: {"T": t, "structures": ("diagonal", "diagonal")}),
    ("DyKAF", "DyKAF", lambda t: {"precondition_frequency": t, "eps": 1e-4, "init": "eps"}),
    ("TwoLevelKFAC", "TwoLevelKFAC", lambda t: {"T_cov": t, "T_inv": t}),
]
IDS = [s[0] for s in SETUPS]


def _run(setup, interval, **extra) -> Run:
    _, name, kwargs = setup
    return Run(_member(name), mlp(), **kwargs(interval), **extra)


def _graphs(run: Run, static) -> cafin.StepGraphs:
    def step():
        run.step(*static)
        return run.model[0].weight.sum()
    return cafin.StepGraphs(step, run.curvature, warmup=WARMUP, graph=Graph)


@pytest.mark.parametrize("interval", [2, 3])
@pytest.mark.parametrize("setup", SETUPS, ids=IDS)
def test_replays_equal_eager(setup, interval):
    steps = WARMUP + 4 * interval + 1
    data = batches(steps)
    eager = _run(setup, interval)
    want = []
    for x, y in data:
        eager.step(x, y)
        want.append([p.detach().clone() for p in eager.model.parameters()])

    run = _run(setup, interval)
    static = [t.clone() for t in data[0]]
    graphs = _graphs(run, static)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, (x, y) in enumerate(data):
            static[0].copy_(x)
            static[1].copy_(y)
            graphs()
            for i, (p, q) in enumerate(zip(run.model.parameters(), want[k])):
                torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12,
                                           msg=lambda m, k=k, i=i: f"{setup[0]} step {k} param {i}: {m}")
    _assert_state_close(run.curvature.state_dict(), eager.curvature.state_dict(), setup[0])
    refusals = [str(w.message) for w in caught if "StepGraphs" in str(w.message)]
    if setup[0] == "TwoLevelKFAC":  # refused: every step eager, said once
        assert graphs.graphs == 0 and graphs.eager_steps == steps and len(refusals) == 1
    elif setup[0] == "KFAC-eigen":  # the inverse steps eager, the others replayed
        assert len(refusals) == 1 and "eigh" in refusals[0]
        inverse_steps = sum(1 for k in range(WARMUP, steps) if k % (2 * interval) == 0)
        assert graphs.eager_steps == WARMUP + inverse_steps
        assert graphs.replays == steps - WARMUP - inverse_steps
    else:
        assert not refusals and graphs.eager_steps == WARMUP
        assert graphs.replays == steps - WARMUP


def _flops(fn) -> int:
    from bench.proxies import count_flops  # torch's counter, plus the GEMMs inside cafin's ops
    return count_flops(fn)


@pytest.mark.parametrize("setup", [s for s in SETUPS if s[0] != "TwoLevelKFAC"],
                         ids=[i for i in IDS if i != "TwoLevelKFAC"])
def test_a_step_not_due_replays_no_curvature_work(setup):
    """At interval 4, steps 2 and 3 are not due (2 is not due for the decompositions either):
    the graph replayed on step 3 does at most 1.05x the FLOPs of the eager not-due step, and
    holds no decomposition; the graph of a due step does more (the test can fail)."""
    interval = 4
    data = batches(6)
    eager = _run(setup, interval)
    for x, y in data[:3]:
        eager.step(x, y)
    eager_flops = _flops(lambda: eager.step(*data[3]))

    run = _run(setup, interval)
    static = [t.clone() for t in data[0]]
    graphs = _graphs(run, static)
    for x, y in data[:4]:
        static[0].copy_(x)
        static[1].copy_(y)
        graphs()
    assert graphs.graphs == 1  # steps 2 and 3 share the not-due graph
    phase, graph, _ = graphs._graphs[0]
    names = " ".join(str(op[0]) for op in graph.ops)
    for decomposition in ("eigh", "linalg_inv", "linalg_qr", "cholesky"):
        assert decomposition not in names, f"{setup[0]}: {decomposition} in the not-due graph"
    not_due = _flops(graph.replay)
    assert not_due <= 1.05 * eager_flops, (setup[0], not_due, eager_flops)
    static[0].copy_(data[4][0])
    static[1].copy_(data[4][1])
    graphs()  # k = 4: due, a second graph (or the eager inverse step)
    if graphs.graphs == 2:  # the statistics of some members are elementwise: ops, not FLOPs
        due = graphs._graphs[1][1]
        assert len(due.ops) > len(graph.ops) and _flops(due.replay) >= not_due


@pytest.mark.parametrize("setup, change", [
    (SETUPS[0], lambda run: setattr(run.curvature, "TCov", 3)),
    (SETUPS[1], lambda run: setattr(run.curvature, "decompose_in_step", False)),
    (SETUPS[3], lambda run: run.curvature.param_groups[0].__setitem__("T", 3)),
], ids=["AdaFisher-TCov", "KFAC-decompose_in_step", "SINGD-T"])
def test_an_interval_changed_after_capture_is_refused(setup, change):
    """The graphs were chosen under the old setting: replaying them would keep it silently."""
    data = batches(4)
    run = _run(setup, 2)
    static = [t.clone() for t in data[0]]
    graphs = _graphs(run, static)
    for _ in range(3):
        graphs()
    before = [p.detach().clone() for p in run.model.parameters()]
    change(run)
    with pytest.raises(RuntimeError, match="changed after its graphs were captured"):
        graphs()
    assert all(torch.equal(p, q) for p, q in zip(run.model.parameters(), before))


def test_a_callable_interval_is_refused():
    run = Run(_member("KFACPreconditioner"), mlp(), factor_update_steps=lambda k: 2, inv_update_steps=4)
    with pytest.raises(TypeError, match="factor_update_steps is a callable"):
        cafin.StepGraphs(lambda: None, run.curvature)


def test_bad_arguments_are_refused():
    run = _run(SETUPS[0], 2)
    with pytest.raises(TypeError, match="step must be callable"):
        cafin.StepGraphs(None, run.curvature)
    with pytest.raises(ValueError, match="pass the cafin optimizers"):
        cafin.StepGraphs(lambda: None)
    with pytest.raises(ValueError, match="warmup"):
        cafin.StepGraphs(lambda: None, run.curvature, warmup=0)
    sgd = torch.optim.SGD(run.model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="SGD is not a cafin optimizer"):
        cafin.StepGraphs(lambda: None, sgd)
