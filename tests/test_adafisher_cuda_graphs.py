"""A whole training step (forward with statistics hooks, backward, step) captured in a CUDA graph
and replayed; the step compiled with mode="reduce-overhead"; no host sync anywhere.
These need a CUDA GPU and the CUDA kernels; tools/gpu_check.sh runs them."""
import contextlib
import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import cafin
from devices import CUDA_MARKS

pytestmark = CUDA_MARKS

OPTIMIZERS = [cafin.AdaFisher, cafin.AdaFisherW]
TCOV = 3


def small_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 16), nn.LayerNorm(16), nn.ReLU(),
                         nn.Linear(16, 5)).cuda()


def batches(n):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [(torch.randn(7, 3, 6, 6, device="cuda", generator=g),
             torch.randint(0, 5, (7,), device="cuda", generator=g)) for _ in range(n)]


@contextlib.contextmanager
def no_host_sync():
    """Any host-device synchronisation inside raises (torch's sync debug mode "error"). Only for
    what must not sync: torch.equal, assert_close, .item() sync by design."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def train_step(model, opt, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def eager_run(cls, base, data):
    model = copy.deepcopy(base)
    opt = cls(model, lr=1e-2, TCov=TCOV, weight_decay=1e-2)
    factors = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        train_step(model, opt, x, y)
        factors.append(opt.state[opt._curvature[0].anchor]["fisher_H"].clone())
    return model, opt, factors


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_captured_training_step_replays_like_eager(cls):
    torch.manual_seed(0)
    base = small_model()
    data = batches(14)
    eager_model, eager_opt, eager_factors = eager_run(cls, base, data)

    model = copy.deepcopy(base)
    opt = cls(model, lr=1e-2, TCov=TCOV, weight_decay=1e-2)
    static_x, static_y = data[0][0].clone(), data[0][1].clone()
    warmup = 2  # eager steps k = 0, 1 on a side stream, as torch.cuda.graph asks
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in data[:warmup]:
            static_x.copy_(x)
            static_y.copy_(y)
            opt.zero_grad(set_to_none=True)
            train_step(model, opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        train_step(model, opt, static_x, static_y)

    anchor_state = opt.state[opt._curvature[0].anchor]
    for i, (x, y) in enumerate(data[warmup:], start=warmup):
        before = anchor_state["fisher_H"].clone()
        with no_host_sync():  # a training loop's part; the checks below sync, as they must
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
        changed = not torch.equal(before, anchor_state["fisher_H"])
        assert changed == (i % TCOV == 0), f"step {i}: factor changed={changed}"
        torch.testing.assert_close(anchor_state["fisher_H"], eager_factors[i], rtol=1e-5, atol=1e-7)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_eager_steps_do_not_sync(cls):
    model = small_model()
    opt = cls(model, TCov=2)
    data = batches(5)
    train_step(model, opt, *data[0])  # first step: lazy CUDA/library initialisation
    with no_host_sync():
        for x, y in data[1:]:
            opt.zero_grad()
            train_step(model, opt, x, y)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_reduce_overhead_step_keeps_cudagraphs(cls):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    base = small_model()
    data = batches(9)
    eager_model, _, _ = eager_run(cls, base, data)
    model = copy.deepcopy(base)
    opt = cls(model, lr=1e-2, TCov=TCOV, weight_decay=1e-2)
    step = torch.compile(opt.step, mode="reduce-overhead", fullgraph=True)
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        torch.compiler.cudagraph_mark_step_begin()
        if i == 0:
            opt.step()  # one eager step first, like any compiled optimizer
        else:
            step()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
