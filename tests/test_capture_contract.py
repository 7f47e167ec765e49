"""What a CUDA graph needs of every member, checked on the CPU (float64), over the table in
tests/members.py:

- the stand-in (tests/capture.py) models a capture: a host decision replays frozen, an in-place
  counter advances on every replay, a host read during capture raises, the backward's ops are
  recorded;
- in place: once a step has run, and again after a curvature, refresh or inverse step, every
  state tensor a step writes keeps its storage (the same data_ptr), so a graph's replays read
  and write what the next eager code reads;
- once the counter is device gated no decision reads a host value: one training step (forward
  with the statistics hooks, backward, step) captured with the stand-in and replayed over three
  curvature intervals (intervals 2 and 3) equals the eager run of the same batches, step by step.

The recipe each member's users follow (docs/compile-and-graphs.md): K-FAC captures with
`decompose_in_step = False` and calls `decompose()` eagerly, outside the graph, on inverse steps;
two-level K-FAC refuses a capture, naming why.
"""
from __future__ import annotations

import math
import warnings
import pytest
import torch
from torch import nn

from capture import CASES, Case, Graph, HostSyncDuringCapture
from members import Run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WARMUP = 2  # eager steps before the capture, as torch.cuda.graph's side-stream warm-up


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6, bias=False), nn.Tanh(),
                         nn.Linear(6, 3)).double()


def batches(n, seed=1, batch=6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(n)]


# ----------------------------------------------------------------------------- the stand-in itself
def test_stand_in_replays_a_host_decision_frozen():
    """A Python branch taken at capture is the branch every replay takes (a graph holds no
    Python): the step below adds on even host counts only, and the capture ran at an even one."""
    x = torch.zeros(3, dtype=torch.float64)
    counter = {"k": 0}

    def step():
        if counter["k"] % 2 == 0:
            x.add_(1.0)
        counter["k"] += 1

    graph = Graph()
    with graph.capture():
        step()
    assert torch.equal(x, torch.zeros(3, dtype=torch.float64))  # the capture ran nothing
    for _ in range(3):
        graph.replay()
    assert counter["k"] == 1  # Python ran once, at capture
    assert torch.equal(x, torch.full((3,), 3.0, dtype=torch.float64))


def test_stand_in_advances_an_in_place_counter_and_reads_inputs_as_they_are():
    k = torch.zeros((), dtype=torch.float64)
    inp = torch.ones(4, dtype=torch.float64)
    out = {}

    def step():
        k.add_(1.0)
        out["y"] = inp * k  # a new tensor: the graph's pool, written again by every replay

    graph = Graph()
    with graph.capture():
        step()
    assert k.item() == 0.0
    assert torch.isnan(out["y"]).all()  # pool memory is undefined until a replay writes it
    for i in range(1, 4):
        inp.fill_(float(i))
        graph.replay()
        assert k.item() == float(i)
        assert torch.equal(out["y"], torch.full((4,), float(i * i), dtype=torch.float64))


@pytest.mark.parametrize("read", ["item", "bool", "nonzero", "eigh"])
def test_stand_in_refuses_host_reads_during_capture(read):
    t = torch.ones(3, 3, dtype=torch.float64)
    reads = {"item": lambda: t.sum().item(), "bool": lambda: bool(t.sum() > 0),
             "nonzero": lambda: t.nonzero(), "eigh": lambda: torch.linalg.eigh(t)}
    graph = Graph()
    with pytest.raises(HostSyncDuringCapture):
        with graph.capture():
            reads[read]()


def test_stand_in_records_the_backward_and_tells_cafin_it_captures():
    from cafin.core import route
    model = mlp()
    x, y = batches(1)[0]
    graph = Graph()
    with graph.capture():
        assert route.capturing() and route.captured() and not route.eager()
        nn.functional.cross_entropy(model(x), y).backward()
    assert not route.capturing() and route.eager()
    names = [str(op[0]) for op in graph.ops]
    assert any("tanh_backward" in n for n in names), names  # the engine ran on this thread
    grad = model[0].weight.grad
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=g, dtype=x.dtype))
        graph.replay()
        ref = mlp()
        nn.functional.cross_entropy(ref(x), y).backward()
        torch.testing.assert_close(grad, ref[0].weight.grad, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- the members' recipes
CASE_IDS = [c.id for c in CASES]
CAPTURED = [c for c in CASES if not c.refused]


def build(case: Case, interval: int) -> Run:
    return case.build(mlp(), interval)


def eager_steps(case: Case, interval: int, data, on_step=None) -> Run:
    return case.eager(mlp(), interval, data, WARMUP, on_step)


# ----------------------------------------------------------------------------- in place
def _owned_tensors(obj, path="", seen=None, depth=0) -> dict[str, torch.Tensor]:
    """Every tensor reachable from a cafin object (its state, settings, internal buffers),
    by path; the model (modules, parameters, gradients) is not the member's."""
    seen = set() if seen is None else seen
    found: dict[str, torch.Tensor] = {}
    if depth > 8 or id(obj) in seen or isinstance(obj, (nn.Module, str, bytes, int, float, bool, type(None))):
        return found
    if isinstance(obj, torch.Tensor):
        if not isinstance(obj, nn.Parameter):
            found[path] = obj
        return found
    seen.add(id(obj))
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(list(obj.items())):
            name = k if isinstance(k, (str, int)) else (f"p{i}" if isinstance(k, torch.Tensor) else repr(k))
            found.update(_owned_tensors(v, f"{path}/{name}", seen, depth + 1))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found.update(_owned_tensors(v, f"{path}/{i}", seen, depth + 1))
    elif type(obj).__module__.startswith(("cafin", "torch.optim")) or hasattr(obj, "__dataclass_fields__"):
        attrs = getattr(obj, "__dict__", None)
        if attrs is None and hasattr(obj, "__slots__"):
            attrs = {s: getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s)}
        for k, v in (attrs or {}).items():
            found.update(_owned_tensors(v, f"{path}.{k}", seen, depth + 1))
    return found


# Per-pass references, not state: what a hook keeps of this pass (its activations, its output
# gradients) is the pass's own tensor, read by the same step; a graph holds both.
_PER_PASS = ("_pending", "calls")


def _pointers(run: Run) -> dict[str, tuple[int, tuple]]:
    return {path: (t.data_ptr(), tuple(t.shape)) for path, t in _owned_tensors(run.curvature).items()
            if not any(part in path for part in _PER_PASS)}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_step_writes_state_in_place(case):
    """After a first eager step, every state tensor keeps its storage through a plain step, a
    curvature step and an inverse/refresh step: eagerly, and once the counter is device gated
    (latched by a capture; for a member that refuses capture, latched as a compile latches it),
    K-FAC's outside decompose() included. A member that refuses capture (two-level K-FAC) may
    replace its entries on eager steps: that is how a step of it that raises is undone."""
    interval = 2
    data = batches(8)
    run = build(case, interval)
    run.step(*data[0])  # state built
    run.step(*data[1])  # k = 1: a plain step
    before = _pointers(run)
    assert before, "no state tensor found"
    case.before_step(run, 2, interval)
    run.step(*data[2])  # k = 2: curvature and inverse/refresh step
    run.step(*data[3])
    now = _pointers(run)
    moved = [p for p, v in before.items() if p in now and now[p] != v]
    if case.refused:
        run.curvature._steps.device_gated = True  # as a capture would latch it
    else:
        assert not moved, f"{case.id}: eager steps rebind {moved}"
        graph = Graph()
        case.before_capture(run)
        with graph.capture():
            run.step(*data[4])
        assert run.curvature._steps.device_gated
    before = _pointers(run)
    for k in (4, 5, 6):  # k = 4 and 6: curvature steps
        case.before_step(run, k, interval)
        run.step(*data[k])
    now = _pointers(run)
    moved = [p for p, v in before.items() if p in now and now[p] != v]
    assert not moved, f"{case.id}: device-gated steps rebind {moved}"


# ----------------------------------------------------------------------------- captured equals eager
@pytest.mark.parametrize("interval", [2, 3])
@pytest.mark.parametrize("case", CAPTURED, ids=[c.id for c in CAPTURED])
def test_captured_step_replays_like_eager(case, interval):
    """A whole training step captured after WARMUP eager steps and replayed over three curvature
    intervals equals the eager run of the same batches after every step (parameters), and at the
    end (the member's state)."""
    steps = WARMUP + 3 * interval + 1
    data = batches(steps)
    eager_params = {}
    eager = eager_steps(case, interval, data, on_step=lambda k, run: eager_params.__setitem__(
        k, [p.detach().clone() for p in run.model.parameters()]))

    def check(k, run):
        for i, (p, q) in enumerate(zip(run.model.parameters(), eager_params[k])):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12,
                                       msg=lambda m, i=i: f"{case.id} step {k} parameter {i}: {m}")

    run = case.replayed(mlp(), interval, data, WARMUP, on_step=check)
    got, want = run.curvature.state_dict(), eager.curvature.state_dict()
    _assert_state_close(got, want, case.id)


def _assert_state_close(a, b, path):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, path
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda m: f"{path}: {m}")
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (path, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _assert_state_close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_state_close(u, v, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("case", [c for c in CASES if c.refused], ids=[c.id for c in CASES if c.refused])
def test_capture_refused_names_why_and_changes_nothing(case):
    data = batches(4)
    run = build(case, 2)
    for x, y in data[:WARMUP]:
        run.step(x, y)
    state = [p.detach().clone() for p in run.model.parameters()]
    graph = Graph()
    with pytest.raises(RuntimeError) as info:
        with graph.capture():
            run.step(*data[WARMUP])
    for word in case.refused:
        assert word in str(info.value), (word, str(info.value))
    assert all(torch.equal(p, q) for p, q in zip(run.model.parameters(), state))
    # eager steps go on, as if no capture had been tried
    reference = eager_steps(case, 2, data)
    for x, y in data[WARMUP:]:
        run.step(x, y)
    for p, q in zip(run.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_kfac_eigen_capture_with_decompositions_in_the_step_is_refused():
    """K-FAC's eigen method decomposes with eigh (a sync on CUDA): capturing a step that would
    decompose raises before the step writes anything, naming the recipe."""
    case = next(c for c in CASES if c.id == "KFACPreconditioner")
    data = batches(3)
    run = build(case, 2)
    for x, y in data[:WARMUP]:
        run.step(x, y)
    before = [p.detach().clone() for p in run.model.parameters()]
    with pytest.raises(RuntimeError, match="decompose_in_step"):
        with Graph().capture():
            run.step(*data[WARMUP])
    assert all(torch.equal(p, q) for p, q in zip(run.model.parameters(), before))
