"""cafin.DyKAF's whole training step (forward, backward, step) captured in a CUDA graph and replayed
through several eigenbasis refreshes equals eager steps; the CPU side of the same properties (state
written in place, device-decided refreshes, the CPU stand-in of a capture) is
tests/test_dykaf_capture.py. These need a CUDA GPU and the CUDA kernels; tools/gpu_check.sh runs
them."""
import copy

import pytest
import torch
from torch import nn

import cafin
from devices import CUDA_MARKS

pytestmark = CUDA_MARKS

FREQUENCY = 3


def model(dtype):
    """A conv kernel (4-mode split), matrices of one shape twice (one batched GEMM), a matrix
    over max_precond_dim on one side, 1-D parameters."""
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(6 * 6 * 6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 5)).to("cuda", dtype)


def batches(n, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [(torch.randn(7, 3, 6, 6, device="cuda", generator=g, dtype=dtype),
             torch.randint(0, 5, (7,), device="cuda", generator=g)) for _ in range(n)]


def train_step(net, opt, x, y):
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


SETTINGS = {
    "rank-one": dict(),
    "full-moment-1d": dict(adam_rank_one=False, precondition_1d=True),
    "one-sided-kron": dict(max_precond_dim=100, init="kron"),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_captured_training_step_replays_like_eager(name, dtype):
    """Warm-up steps on a side stream (the first builds the state), the whole step captured with
    torch.cuda.graph, replayed on new batches through three refresh intervals: the parameters,
    the device step counts, the bases and the rank-one moments equal an eager run's (float64 to
    1e-9, float32 to 2e-5), and every state tensor kept its storage."""
    torch.manual_seed(0)
    base = model(dtype)
    data = batches(3 * FREQUENCY + 4, dtype)
    kw = {**dict(lr=1e-2, eps=1e-4, init="eps", precondition_frequency=FREQUENCY), **SETTINGS[name]}
    eager = copy.deepcopy(base)
    eager_opt = cafin.DyKAF(eager.parameters(), **kw)
    for x, y in data:
        eager_opt.zero_grad(set_to_none=True)
        train_step(eager, eager_opt, x, y)

    net = copy.deepcopy(base)
    opt = cafin.DyKAF(net.parameters(), **kw)
    static_x, static_y = data[0][0].clone(), data[0][1].clone()
    warmup = 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in data[:warmup]:
            static_x.copy_(x)
            static_y.copy_(y)
            opt.zero_grad(set_to_none=True)
            train_step(net, opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    ptrs = {(id(p), k, i): t.data_ptr() for p in net.parameters() for k, v in opt.state[p].items()
            for i, t in enumerate(v if isinstance(v, list) else [v]) if torch.is_tensor(t)}
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # the graph's backward makes the gradients in its pool
    with torch.cuda.graph(graph):
        train_step(net, opt, static_x, static_y)
    for x, y in data[warmup:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    torch.cuda.synchronize()
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    worst = max(rel(p, q) for p, q in zip(net.parameters(), eager.parameters()))
    assert worst <= tol, worst
    for p, q in zip(net.parameters(), eager.parameters()):
        a, b = opt.state[p], eager_opt.state[q]
        assert float(a["device_step"]) == float(b["device_step"]) == len(data) - 1
        for key in ("l", "r"):
            if key in a:
                assert rel(a[key], b[key]) <= 100 * tol, key
        for Qa, Qb in zip(a["bases"], b["bases"]):
            if Qa is not None:  # refreshed on the same steps, to the same bases
                torch.testing.assert_close(Qa, Qb, rtol=0, atol=1e-4)
        for k, v in a.items():
            for i, t in enumerate(v if isinstance(v, list) else [v]):
                if torch.is_tensor(t):
                    assert t.data_ptr() == ptrs[id(p), k, i], (k, i)
    assert opt.state_dict()["state"][0]["step"] == len(data) - 1


def test_whole_step_phase_trains_finite_models_beside_a_captured_trainer():
    """The bench's whole-step phase (the MLP, for time): AdaFisher's captured trainer built
    before K-FAC's and DyKAF's (as the bench orders them), every trainer's model stays finite
    and DyKAF's first iteration starts every parameter (no dropped first gradient), where a
    replay writing into freed memory gave DyKAF a non-finite model."""
    import types

    from bench import whole_step
    from bench.members import registry
    from bench.models import MODELS, batch_for

    torch.manual_seed(0)
    base = MODELS["mlp"]().cuda()
    x, y = (t.cuda() for t in batch_for("mlp", base, 32, generator=torch.Generator().manual_seed(0)))
    members = [m for n, m in registry().items() if n in ("adafisher", "kfac", "dykaf")]
    run = types.SimpleNamespace(device=torch.device("cuda"), model="mlp", skipped=[])
    variants = {"adafisher": {"fused", "cuda-graph"}, "kfac": {"fused"}, "dykaf": {"fused"}}
    ctx = types.SimpleNamespace(run=run, base=base, x=x, y=y, members=members, published={},
                                selected=lambda m: variants[m.name], why_not=lambda m, v: None)
    trainers = whole_step.trainers(ctx)
    assert not run.skipped, run.skipped
    for _ in range(3):
        for t in trainers:
            t.iterate()
    torch.cuda.synchronize()
    (dykaf,) = [t for t in trainers if t.optimizer == "dykaf"]
    net, opt = dykaf.keep
    assert opt.skipped_factor_updates == 0
    assert all("step" in opt.state[p] for p in net.parameters())
    assert all(torch.isfinite(p).all() for t in trainers for p in t.keep[0].parameters())
