"""Every member's whole training step (forward with its statistics hooks, backward, the member's
step and, for the preconditioners, the SGD step that follows) captured in a CUDA graph and
replayed over three curvature intervals against the eager run of the same batches; and each
member's step compiled with mode="reduce-overhead". The recipes are tests/capture.py's `CASES`
(the ones tests/test_capture_contract.py runs on the CPU stand-in): K-FAC with `decompose()`
outside the graph, K-FAC's inverse method with its inverses in the graph, SINGD dense and
diagonal, DyKAF through its refresh steps; two-level K-FAC refuses a capture, naming why.
AdaFisher's own captured and compiled steps are tests/test_cuda_graphs.py's. Last, every member
through cafin.StepGraphs (one graph per phase; on the CPU: tests/test_step_graphs.py).

These need a CUDA GPU and cafin's CUDA kernels; tools/gpu_check.sh runs them."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from capture import CASES
from devices import CUDA_MARKS
from test_step_graphs import SETUPS

pytestmark = [*CUDA_MARKS, pytest.mark.filterwarnings("ignore::UserWarning")]

WARMUP = 3  # eager steps on a side stream before the capture, as torch.cuda.graph asks
MEMBER_CASES = [c for c in CASES if c.member != "AdaFisher"]
CAPTURED = [c for c in MEMBER_CASES if not c.refused]
REFUSED = [c for c in MEMBER_CASES if c.refused]
# Both sides differ by the order of some products (a captured K-FAC step runs the plain products,
# an eager one its kept chains), which eigh amplifies near equal eigenvalues (about 3e-9 in
# float64 after 12 steps on the CPU stand-in): float64 is still 1000x tighter than float32.
TOLERANCE = {torch.float64: dict(rtol=1e-6, atol=1e-8), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def model(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16, bias=False), nn.Tanh(),
                         nn.Linear(16, 5)).to(device="cuda", dtype=dtype)


def batches(n, dtype, batch=10):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(batch, 12, device="cuda", dtype=dtype, generator=g),
             torch.randint(0, 5, (batch,), device="cuda", generator=g)) for _ in range(n)]


def params(run):
    return [p.detach().clone() for p in run.model.parameters()]


# float32 at both intervals; float64 (the tight check) at one: tools/gpu_check.sh gives this
# file about four minutes, most of them the cold compiles below
@pytest.mark.parametrize("interval, dtype", [(2, torch.float32), (3, torch.float32), (3, torch.float64)],
                         ids=["2-fp32", "3-fp32", "3-fp64"])
@pytest.mark.parametrize("case", CAPTURED, ids=[c.id for c in CAPTURED])
def test_captured_training_step_replays_like_eager(case, interval, dtype):
    steps = WARMUP + 3 * interval + 1
    data = batches(steps, dtype)
    expected = {}
    case.eager(model(dtype), interval, data, WARMUP,
               on_step=lambda k, run: expected.__setitem__(k, params(run)))

    run = case.build(model(dtype), interval)
    static_x, static_y = data[WARMUP][0].clone(), data[WARMUP][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in data[:WARMUP]:
            run.step(x, y)
    torch.cuda.current_stream().wait_stream(side)
    case.before_capture(run)
    graph = torch.cuda.CUDAGraph()
    run.model.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients in its pool
    with torch.cuda.graph(graph):
        run.step(static_x, static_y)
    for k in range(WARMUP, steps):
        case.before_step(run, k, interval)  # eager, outside the graph (K-FAC's decompose())
        static_x.copy_(data[k][0])
        static_y.copy_(data[k][1])
        graph.replay()
        for i, (p, q) in enumerate(zip(run.model.parameters(), expected[k])):
            torch.testing.assert_close(p, q, **TOLERANCE[dtype],
                                       msg=lambda m, k=k, i=i: f"{case.id} step {k} parameter {i}: {m}")
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


@pytest.mark.parametrize("case", REFUSED, ids=[c.id for c in REFUSED])
def test_capture_is_refused_naming_why(case):
    data = batches(WARMUP + 3, torch.float32)
    run = case.build(model(torch.float32), 2)
    for x, y in data[:WARMUP]:
        run.step(x, y)
    torch.cuda.synchronize()
    before = params(run)
    graph = torch.cuda.CUDAGraph()
    run.model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError) as info:
        with torch.cuda.graph(graph):
            run.step(*data[WARMUP])
    for word in case.refused:
        assert word in str(info.value), (word, str(info.value))
    assert all(torch.equal(p, q) for p, q in zip(run.model.parameters(), before))
    for x, y in data[WARMUP:]:  # eager steps go on
        run.step(x, y)
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


@pytest.mark.parametrize("case", MEMBER_CASES, ids=[c.id for c in MEMBER_CASES])
def test_reduce_overhead_step_keeps_cudagraphs(case):
    """The member's step (and the follower's) compiled with mode="reduce-overhead" after one eager
    step trains like the eager run, in CUDA graphs (no cudagraph skip). K-FAC decomposes outside
    the compiled step as it does outside a captured one. Two-level K-FAC's step holds eigh in a
    torch.cond, which inductor cannot put in a CUDA graph: only its results are checked."""
    torch._dynamo.reset()
    counters.clear()
    interval, dtype = 2, torch.float32
    steps = 1 + 3 * interval + 1
    data = batches(steps, dtype)
    expected = {}
    case.eager(model(dtype), interval, data, 1, on_step=lambda k, run: expected.__setitem__(k, params(run)))
    run = case.build(model(dtype), interval)
    compiled = torch.compile(run.update, mode="reduce-overhead", fullgraph=True)
    for k, (x, y) in enumerate(data):
        if k == 1:
            case.before_capture(run)
        if k >= 1:
            case.before_step(run, k, interval)
        run.backward(x, y)
        torch.compiler.cudagraph_mark_step_begin()
        if k == 0:
            run.update()  # one eager step first: the state the compiled step updates
        else:
            compiled()
        for i, (p, q) in enumerate(zip(run.model.parameters(), expected[k])):
            torch.testing.assert_close(p, q, **TOLERANCE[dtype],
                                       msg=lambda m, k=k, i=i: f"{case.id} step {k} parameter {i}: {m}")
    if not case.refused:
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("setup", SETUPS, ids=[s[0] for s in SETUPS])
def test_step_graphs_replay_like_eager(setup, dtype):
    """cafin.StepGraphs with real CUDA graphs (one per phase, in one pool), statistics every 2
    steps and K-FAC's decompositions every 4, over three inverse intervals, against the plain
    eager run; two-level K-FAC runs eagerly, said once."""
    from members import MEMBERS, Run
    import cafin
    _, name, kwargs = setup
    member = next(m for m in MEMBERS if m.name == name)
    steps = WARMUP + 12 + 1
    data = batches(steps, dtype)
    eager = Run(member, model(dtype), **kwargs(2))
    expected = []
    for x, y in data:
        eager.step(x, y)
        expected.append(params(eager))

    run = Run(member, model(dtype), **kwargs(2))
    static_x, static_y = data[0][0].clone(), data[0][1].clone()

    def step():
        run.step(static_x, static_y)
        return run.model[0].weight.sum()

    graphs = cafin.StepGraphs(step, run.curvature, warmup=WARMUP)
    for k, (x, y) in enumerate(data):
        static_x.copy_(x)
        static_y.copy_(y)
        graphs()
        for i, (p, q) in enumerate(zip(run.model.parameters(), expected[k])):
            torch.testing.assert_close(p, q, **TOLERANCE[dtype],
                                       msg=lambda m, k=k, i=i: f"{name} step {k} param {i}: {m}")
    if name == "TwoLevelKFAC":
        assert graphs.graphs == 0
    else:
        assert graphs.graphs >= 2 and graphs.replays > 0
