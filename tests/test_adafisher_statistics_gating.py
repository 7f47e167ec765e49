"""Device-gated statistics (compiled or captured steps pass a step tensor and the interval, and
the kernels decide): a call on a step that is not due allocates nothing, copies nothing and leaves
the statistic untouched, whatever the input's layout; a captured step with TCov=100 needs no more
graph memory than one without statistics. And the statistics are deterministic: no value added
atomically, the same bits on every run, no complaint under torch.use_deterministic_algorithms(True)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cafin
from cafin import ops
from cafin import reference as ref

from devices import CUDA_MARKS, DEVICES
from test_ops import RTOL, assert_close, assert_unchanged, gen, randn, stat_like

def needs_cuda(test):
    for mark in CUDA_MARKS:
        test = mark(test)
    return test

LAYOUTS = ["contiguous", "channels_last", "noncontiguous"]


def input_in(kind, g, device, dtype=torch.float32):
    x = randn(g, 6, 8, 9, 7, dtype=dtype, device=device)
    if kind == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif kind == "noncontiguous":
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    return x


def calls(x, g, device):
    """(name, stat, arguments after stat) of one call of each statistics op on x."""
    state = ops.state_dtype(x.dtype)
    return [
        ("sumsq_stats_", stat_like(g, 8 + 2, state, device), (x, 1, 2, True)),
        ("conv2d_input_stats_", stat_like(g, 4 * 9 + 2, state, device),
         (x, [3, 3], [2, 1], [1, 1, 0, 2], [1, 2], 2, True)),
        ("norm_input_stats_", stat_like(g, 3, state, device), (x,)),
        ("norm_grad_stats_", stat_like(g, 8 + 1, state, device), (x, 1, 2)),
    ]


def cpu_allocations(fn) -> list:
    """The profiled ops that allocated CPU memory (bytes > 0, their children's included) while fn runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return [e for e in prof.events() if e.cpu_memory_usage > 0]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_not_due_allocates_nothing_cpu(kind):
    g = gen(31)
    x = input_in(kind, g, "cpu")
    step = torch.tensor(3.0)
    for name, stat, rest in calls(x, g, "cpu"):
        before = stat.clone()
        allocations = cpu_allocations(lambda: getattr(ops, name)(stat, *rest, step=step, interval=2))
        assert allocations == [], f"{name}: {[(e.name, e.cpu_memory_usage) for e in allocations]}"
        assert_unchanged(stat, before)


def test_allocation_probe_sees_a_copy():
    """The probe above can fail: a due call on a layout the kernels read from a copy allocates."""
    g = gen(32)
    x = randn(g, 9, 8, 5).transpose(0, 1)  # channels dim 0 of a transposed view: no strided view
    stat = stat_like(g, 5 + 1, torch.float32, "cpu")
    allocations = cpu_allocations(lambda: ops.norm_grad_stats_(stat, x, 2, 3, step=torch.tensor(4.0),
                                                               interval=2))
    assert max(e.cpu_memory_usage for e in allocations) >= x.numel() * x.element_size()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_due_gated_equals_ungated(device, kind):
    g = gen(33)
    x = input_in(kind, g, device)
    for name, stat, rest in calls(x, g, device):
        want = stat.clone()
        getattr(ref, name)(want, *rest)
        getattr(ops, name)(stat, *rest, step=torch.tensor(200.0, device=device), interval=100)
        assert_close(stat, want, RTOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_deterministic(device, kind):
    """Twice the same call gives the same bits, under torch.use_deterministic_algorithms(True)
    (which raises on a kernel that declares itself nondeterministic)."""
    g = gen(34)
    x = input_in(kind, g, device) * 3 + 1
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = []
        for _ in range(2):
            out = []
            for name, stat, rest in calls(x, gen(35), device):
                getattr(ops, name)(stat, *rest)
                out.append(stat)
            results.append(out)
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.parametrize("kind", LAYOUTS)
def test_not_due_copies_nothing_cuda(kind):
    """On CUDA the host cannot read the step, so a call queues its launches whatever the step;
    with the workspaces AdaFisher keeps (made by a first call) it allocates nothing, and never
    copies the input."""
    g = gen(36)
    x = input_in(kind, g, "cuda")
    step = torch.tensor(3.0, device="cuda")
    impl = ops.StatisticsWorkspaces(ops)
    for name, stat, rest in calls(x, g, "cuda"):
        getattr(impl, name)(stat, *rest, step=step, interval=2)
        before = stat.clone()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
        getattr(impl, name)(stat, *rest, step=step, interval=2)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - start
        assert allocated == 0, f"{name} allocated {allocated} bytes"
        assert_unchanged(stat, before)


def _capture_pool_bytes(model, opt, x, y) -> int:
    """Bytes the caching allocator reserves for a graph of one training step."""
    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved() - before
    graph.replay()
    torch.cuda.synchronize()
    del graph
    return reserved


@needs_cuda
def test_graph_pool_with_statistics_is_the_pool_without():
    """A captured step with TCov=100 on channels_last activations reserves what the same step
    without statistics hooks reserves, up to one 2 MiB small-allocation segment (the workspaces
    the capture stream gets): an input copy per statistic (4 MiB activations here) would show as
    20 MiB large-pool segments.
    The parameters stay contiguous (AdaFisher refuses others); the input is channels_last, so
    the convolutions' outputs, which the BatchNorms and the second convolution take statistics
    of, are channels_last too."""
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).cuda()
    x = torch.randn(32, 32, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (32,), device="cuda")
    with torch.no_grad():
        activation = base[0](x)
    assert activation.is_contiguous(memory_format=torch.channels_last) and not activation.is_contiguous()
    pools = {}
    for with_stats in (True, False):
        model = copy.deepcopy(base)
        opt = cafin.AdaFisher(model, lr=1e-3, TCov=100)
        if not with_stats:
            opt.remove_hooks()
        pools[with_stats] = _capture_pool_bytes(model, opt, x, y)
    assert pools[True] <= pools[False] + 2 * 2**20, pools
