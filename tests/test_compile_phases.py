"""torch.compile of every member's step, over its curvature intervals (the recipes of
tests/capture.py's table): the compiled step equals the eager one, builds a graph per phase and
none once every phase has come, and a step that is not due does the eager step's matrix
products and no decomposition (a member whose curvature work is elementwise has no product to
show: the graph bound holds it)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from bench.proxies import product_work
from capture import CASES

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

INTERVAL = 2
# Phases at interval 2 (every interval of a member equal): due and not due; DyKAF adds the step
# after a refresh, which projects its moment again. AdaFisher decides on the device: one graph.
PHASES = {"AdaFisher": 0, "DyKAF": 3}
TOLERANCE = {"KFACPreconditioner": dict(rtol=1e-5, atol=1e-7)}


def profiled_step(fn) -> tuple[int, set[str]]:
    """`product_work(fn)`, asserting that no graph was compiled meanwhile (a compile's tracing
    is no step's work)."""
    graphs = counters["stats"]["unique_graphs"]
    out = product_work(fn)
    assert counters["stats"]["unique_graphs"] == graphs, "a graph was compiled while profiling"
    return out


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16, bias=False), nn.Tanh(),
                         nn.Linear(16, 5)).double()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiled_step_builds_a_graph_per_phase_and_skips_what_is_not_due(case):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(10, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (10,), generator=g))
            for _ in range(9)]
    eager, compiled = case.build(_model(), INTERVAL), case.build(_model(), INTERVAL)
    # the member's step compiled; the follower (SGD after a preconditioner) stays eager
    kw = {"update_params": True} if case.member == "TwoLevelKFAC" else {}
    curvature_step = torch.compile(compiled.curvature.step, backend="aot_eager", fullgraph=True)

    def step():
        curvature_step(**kw)
        if compiled.follower is not None:
            compiled.follower.step()
    work = {}
    for k, (x, y) in enumerate(data):
        for run, update in ((eager, eager.update), (compiled, step if k else compiled.update)):
            def iteration(run=run, update=update):
                run.backward(x, y)
                update()
            if k in (6, 7):  # due, not due: phases whose graphs earlier steps made
                work[(run is compiled, k)] = profiled_step(iteration)
            else:
                iteration()
        if k == 5:
            assert counters["stats"]["unique_graphs"] <= 1 + PHASES.get(case.member, 2), dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for p, q in zip(compiled.model.parameters(), eager.model.parameters()):
        # K-FAC keeps its eigenbases in float32 (inv_dtype), where eager's fused products and
        # the compiled plain ones round apart
        torch.testing.assert_close(p, q, **TOLERANCE.get(case.member, dict(rtol=1e-9, atol=1e-12)))
    (due, _), (not_due, decompositions) = work[(True, 6)], work[(True, 7)]
    assert not_due <= 1.05 * work[(False, 7)][0] and not decompositions, work
    assert due >= not_due, work
