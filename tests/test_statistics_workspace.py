"""The kept workspaces of the statistics ops: their sizes and checks, that the CPU kernels leave
them alone, and, on CUDA, that one workspace serves many calls of its channel count over every
reading path, leaves its counters at zero after each call and gives the reference's numbers, that
a Conv2d input's X2 can be kept, and that AdaFisher keeps one per device, stream, dtype and
channel count (or C*H*W)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import cafin
from cafin import ops
from cafin import reference as ref

from devices import CUDA_MARKS
from test_ops import RTOL, assert_close, assert_unchanged, gen, randn, reference_stat, stat_like


def needs_cuda(test):
    for mark in CUDA_MARKS:
        test = mark(test)
    return test


def counters(workspace: torch.Tensor, channels: int) -> torch.Tensor:
    """The tail a call counts its blocks in: one counter per channel and one for the call."""
    return workspace[workspace.numel() - channels - 1:]


@pytest.mark.parametrize("channels", [1, 5, 512, 513, 700])
def test_numel_is_the_kernels(channels):
    """The Python size is the one the C++ check asks for, exactly: one more or one less is refused
    (a larger workspace would put the counters of one channel count on another's partial sums)."""
    g = gen(40)
    x = randn(g, 3, channels)
    stat = stat_like(g, channels + 1, torch.float32, "cpu")
    n = ops.statistics_workspace_numel(channels)
    assert n >= 64 * channels + 2 * channels + 1 and n >= 32768
    ops.sumsq_stats_(stat, x, 1, 2, False, workspace=torch.zeros(n))
    for wrong in (n - 1, n + 1):
        with pytest.raises(ValueError, match=rf"sumsq_stats_: workspace must be a contiguous 1-D tensor of {n} "
                                             rf"elements for {channels} channels"):
            torch.ops.cafin.sumsq_stats_(stat, x, 1, 2, False, workspace=torch.zeros(wrong))


def test_bad_workspaces_are_refused_writing_nothing():
    g = gen(41)
    x = randn(g, 3, 4, 5)
    n = ops.statistics_workspace_numel(4)
    cases = [
        ("sumsq_stats_", (x, 1, 2, True), 4 + 2, torch.zeros(n, dtype=torch.float64), TypeError,
         r"sumsq_stats_: workspace has dtype torch.float64, expected the stat's torch.float32"),
        ("norm_grad_stats_", (x, 1, 2), 4 + 1, torch.zeros(1, n), ValueError,
         r"norm_grad_stats_: workspace must be a contiguous 1-D tensor of"),
        ("norm_input_stats_", (x,), 3, torch.zeros(2 * n)[::2], ValueError,
         r"norm_input_stats_: workspace must be a contiguous 1-D tensor of"),
    ]
    for name, rest, length, workspace, exc, match in cases:
        stat = stat_like(g, length, torch.float32, "cpu")
        before = stat.clone(), workspace.clone()
        with pytest.raises(exc, match=match):
            getattr(ops, name)(stat, *rest, workspace=workspace)
        assert_unchanged(stat, before[0])
        assert torch.equal(workspace, before[1])


def test_conv2d_workspace_is_c_h_w():
    g = gen(47)
    x = randn(g, 2, 4, 5, 6)
    stat = stat_like(g, 2 * 9 + 1, torch.float32, "cpu")
    geometry = ([3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 2, False)
    want = reference_stat(ref.conv2d_input_stats_, stat, x, *geometry)
    workspace = torch.rand(4 * 5 * 6, generator=g)
    before = workspace.clone()
    ops.conv2d_input_stats_(stat, x, *geometry, workspace=workspace)
    assert_close(stat, want, RTOL[torch.float32])
    assert torch.equal(workspace, before)
    for wrong in (torch.zeros(4 * 5 * 6 + 1), torch.zeros(4 * 5 * 6, dtype=torch.float64)):
        with pytest.raises((ValueError, TypeError), match=r"conv2d_input_stats_: workspace"):
            ops.conv2d_input_stats_(stat, x, *geometry, workspace=wrong)
    with pytest.raises(ValueError, match=r"tensor of 120 elements for 120 positions \(C\*H\*W\)"):
        ops.conv2d_input_stats_(stat, x, *geometry, workspace=torch.zeros(121))


def test_cpu_kernels_leave_the_workspace():
    """On the CPU a workspace changes nothing: the same bits as without one, the workspace as given."""
    g = gen(42)
    x = randn(g, 6, 7, 5, 3)
    for name, rest, channels, length in [("sumsq_stats_", (1, 2, True), 7, 9),
                                         ("norm_grad_stats_", (2, 4), 15, 16),
                                         ("norm_input_stats_", (), 7, 3)]:
        plain = stat_like(g, length, torch.float32, "cpu")
        kept = plain.clone()
        workspace = torch.rand(ops.statistics_workspace_numel(channels), generator=g)
        before = workspace.clone()
        getattr(ops, name)(plain, x, *rest)
        getattr(ops, name)(kept, x, *rest, workspace=workspace)
        assert torch.equal(kept, plain)
        assert_unchanged(workspace, before)


def small_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.LayerNorm(8 * 6 * 6), nn.Linear(8 * 6 * 6, 5))


def test_adafisher_keeps_no_workspace_on_cpu():
    torch.manual_seed(0)
    model = small_model()
    opt = cafin.AdaFisher(model, lr=1e-3)
    nn.functional.cross_entropy(model(torch.randn(4, 3, 6, 6)), torch.randint(0, 5, (4,))).backward()
    opt.step()
    assert isinstance(opt._stats_impl, ops.StatisticsWorkspaces)
    assert opt._stats_impl._kept == {}
    assert cafin.AdaFisher(small_model(), lr=1e-3, backend="reference")._stats_impl is ref


# -------------------------------------------------------------------------------------- CUDA
def reading_paths(g, channels, dtype):
    """(what, op, input, the arguments after it) over `channels` channels, one per reading path of
    the CUDA kernels: column sums, short runs read as blocks, long runs (several segments),
    a transposed [N, C], a layout no strided view covers, and the norm statistics."""
    c = channels
    x4 = randn(g, 7, c, 3, 3, dtype=dtype, device="cuda")
    return [
        ("columns", "sumsq_stats_", randn(g, 300, c, dtype=dtype, device="cuda"), (1, 2, True)),
        ("blocks", "sumsq_stats_", x4, (1, 2, False)),
        ("segments", "sumsq_stats_", randn(g, 2, c, 9000, dtype=dtype, device="cuda"), (1, 2, False)),
        ("transposed", "sumsq_stats_", randn(g, c, 257, dtype=dtype, device="cuda").t(), (1, 2, False)),
        ("walk", "sumsq_stats_", randn(g, 5, 4, c, 6, dtype=dtype, device="cuda").permute(1, 3, 2, 0), (2, 3, True)),
        ("norm-grad", "norm_grad_stats_", x4, (1, 2)),
        ("norm-grad-columns", "norm_grad_stats_", x4.contiguous(memory_format=torch.channels_last), (1, 2)),
        ("norm-input", "norm_input_stats_", x4 + 0.5, ()),
        ("norm-input-runs", "norm_input_stats_", randn(g, 3, c, 100, dtype=dtype, device="cuda") + 0.5, ()),
    ]


def stat_length(name, channels, rest):
    if name == "sumsq_stats_":
        return channels + rest[-1] + 1
    return 3 if name == "norm_input_stats_" else channels + 1


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels", [3, 40, 600])
def test_one_workspace_serves_every_path(dtype, channels):
    """One workspace, used by every path in turn and then again: each call equals the reference,
    leaves the counters at zero, and the second round gives the first round's bits."""
    g = gen(43)
    state = ops.state_dtype(dtype)
    workspace = torch.zeros(ops.statistics_workspace_numel(channels), dtype=state, device="cuda")
    paths = reading_paths(g, channels, dtype)
    rounds = []
    for _ in range(2):
        results = []
        for what, name, x, rest in paths:
            stat = stat_like(gen(44), stat_length(name, channels, rest), state, "cuda")
            want = reference_stat(getattr(ref, name), stat, x, *rest)
            getattr(ops, name)(stat, x, *rest, workspace=workspace)
            torch.cuda.synchronize()
            assert_close(stat, want, RTOL[state] if dtype == torch.float64 else 3e-5)
            assert torch.count_nonzero(counters(workspace, channels)) == 0, what
            results.append(stat)
        rounds.append(results)
    for first, second in zip(*rounds):
        assert torch.equal(first, second)


@needs_cuda
def test_not_due_leaves_the_workspace():
    g = gen(45)
    channels = 40
    workspace = torch.zeros(ops.statistics_workspace_numel(channels), device="cuda")
    step = torch.tensor(3.0, device="cuda")
    for what, name, x, rest in reading_paths(g, channels, torch.float32):
        stat = stat_like(g, stat_length(name, channels, rest), torch.float32, "cuda")
        before = stat.clone(), workspace.clone()
        getattr(ops, name)(stat, x, *rest, step=step, interval=2, workspace=workspace)
        torch.cuda.synchronize()
        assert_unchanged(stat, before[0])
        assert_unchanged(workspace, before[1])


@needs_cuda
def test_a_call_with_a_workspace_allocates_nothing():
    g = gen(46)
    x = randn(g, 64, 3, 9, 9, device="cuda")
    calls = [
        ("sumsq_stats_", 3 + 1, (1, 2, False), torch.zeros(ops.statistics_workspace_numel(3), device="cuda")),
        ("conv2d_input_stats_", 27 + 1, ([3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1, False),
         torch.empty(3 * 9 * 9, device="cuda")),
    ]
    for name, length, rest, workspace in calls:
        stat = stat_like(g, length, torch.float32, "cuda")
        want = reference_stat(getattr(ref, name), stat, x, *rest)
        getattr(ops, name)(stat, x, *rest, workspace=workspace)  # warm
        torch.cuda.synchronize()
        start = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
        getattr(ops, name)(stat, x, *rest, workspace=workspace)
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocated_bytes.all.allocated"] == start, name
        getattr(ref, name)(want, x, *rest)
        assert_close(stat, want, 3e-5)


@needs_cuda
def test_adafisher_keeps_one_workspace_per_channel_count():
    """AdaFisher's statistics on CUDA: one workspace per stream, dtype and channel count, at zero
    counters after a pass, and the factors of the reference backend."""
    torch.manual_seed(0)
    models = [small_model().cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [cafin.AdaFisher(models[0], lr=1e-3), cafin.AdaFisher(models[1], lr=1e-3, backend="reference")]
    x, y = torch.randn(4, 3, 6, 6, device="cuda"), torch.randint(0, 5, (4,), device="cuda")
    for _ in range(3):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    kept = opts[0]._stats_impl._kept
    # (channels, None) of the channel statistics: Conv2d grad 8, BatchNorm2d input 8 (its T) and
    # grad 8; LayerNorm input 288 and grad 288; Linear input 288, grad 5. (0, C*H*W) of the
    # Conv2d input's X2.
    assert sorted(key[3:] for key in kept if key[4] is None) == [(5, None), (8, None), (288, None)]
    assert [key[3:] for key in kept if key[4] is not None] == [(0, 3 * 6 * 6)]
    for (_, _, _, channels, positions), workspace in kept.items():
        if positions is None:
            assert torch.count_nonzero(counters(workspace, channels)) == 0
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert_close(a, b, 1e-4)
