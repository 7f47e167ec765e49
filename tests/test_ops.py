"""The fused ops against cafin.reference, op by op, on fresh random inputs of awkward shapes.

Agreement: every element within rtol * max|expected| of the reference, rtol 1e-12 for float64 and
1e-5 for float32 (one rounding step of the stored dtype for bf16/fp16 parameters). Statistics are
compared with the reference run in float64 on the same (rounded) input values, so the measure is
the kernel's error and not the float32 reference's own summation error.
CUDA variants skip (with the reason) where no GPU or no CUDA build is at hand; their sources are
still compiled by tests/test_cuda_sources.py.
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch.testing._internal.optests import generate_opcheck_tests

from cafin import ops
from cafin.layers import conv_padding
from cafin import reference as ref
from devices import DEVICES

PARAM_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


# ----------------------------------------------------------------------------------- helpers
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def rand(g, *shape, dtype=torch.float32, device="cpu"):
    return torch.rand(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def assert_close(actual, expected, rtol):
    """Each element within rtol * max|expected| of the expected value; for bf16/fp16, within
    rtol of itself (one rounding step), since their values are rounded one by one."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    scale = e.abs().max().item() if e.numel() else 0.0
    atol = 1e-30 if actual.dtype in (torch.bfloat16, torch.float16) else rtol * max(scale, 1e-30)
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)


def assert_unchanged(after, before):
    """Bit-identical, value by value (NaN included), and not even touched."""
    assert after.dtype == before.dtype
    assert torch.equal(after.cpu().reshape(-1).view(torch.uint8), before.cpu().reshape(-1).view(torch.uint8))


def tensors_in(tree):
    out = []
    for v in (tree.values() if isinstance(tree, dict) else tree):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (a transposed copy, transposed back)."""
    if t.dim() < 2:
        return torch.stack([t, t], dim=-1)[..., 0]
    out = t.transpose(0, -1).contiguous().transpose(0, -1)
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


def stat_like(g, length, dtype, device):
    """A statistic that already holds contributions: random entries, count 2 (never zeros)."""
    stat = rand(g, length, dtype=dtype, device=device)
    stat[-1] = 2.0
    return stat


def reference_stat(fn, stat, x, *args, **kwargs):
    """The reference op in float64 on the same (rounded) values, cast back to stat's dtype."""
    expected = stat.double()
    fn(expected, x.double(), *args, **kwargs)
    return expected.to(stat.dtype)


# ----------------------------------------------------------------------------------- update
# (param shape, len(S) (0: no curvature), len(H), h_offset, step, S/H shared with the entry before)
UPDATE_SPECS = [
    ((7, 5), 7, 6, 0, 1.0, False),       # Linear weight ...
    ((7,), 7, 6, 5, 1.0, True),          # ... and its bias: the last H entry, the same factors
    ((3,), 0, 0, 0, 3.0, False),         # no curvature (F = 1)
    ((0,), 0, 0, 0, 1.0, False),         # an empty parameter
    ((4, 3, 3, 3), 4, 28, 1, 2.0, False),  # Conv2d weight at an H offset
    ((6,), 6, 2, 0, 5.0, False),         # BatchNorm weight: one element per row ...
    ((6,), 6, 2, 1, 5.0, True),          # ... and bias
    ((2, 3), 6, 2, 0, 7.0, False),       # LayerNorm weight, normalised shape (2, 3)
    ((300, 301), 300, 301, 0, 100.0, False),  # several threads: a split inside a row
    ((5, 6), 5, 6, 0, 2.0, False),       # S never updated, H updated: F = 1 throughout
    ((9,), 9, 1, 0, 3.0, False),         # one element per row, one row never updated
    ((11, 13), 11, 13, 0, 4.0, False),   # factors never updated: S and H hold -1
]


def update_bucket(device, dtype, seed=0, specs=UPDATE_SPECS, scaled=False):
    g = gen(seed)
    work = ops.state_dtype(dtype)
    params, grads, exp_avgs, steps, fisher_S, fisher_H, offsets = [], [], [], [], [], [], []
    for shape, rows, cols, offset, step, shared in specs:
        params.append(randn(g, *shape, dtype=dtype, device=device))
        grad = randn(g, *shape, dtype=dtype, device=device)
        grads.append(grad * 64 if scaled else grad)  # a grad_scale of 64 is exact in every dtype
        exp_avgs.append(0.1 * randn(g, *shape, dtype=work, device=device))
        steps.append(torch.tensor(step, device=device))
        if shared:
            S, H = fisher_S[-1], fisher_H[-1]
        elif rows == 0:
            S = H = torch.empty(0, dtype=work, device=device)
        elif shape == (11, 13):
            S = -torch.ones(rows, dtype=work, device=device)
            H = -torch.ones(cols, dtype=work, device=device)
        else:
            S = 0.01 + rand(g, rows, dtype=work, device=device)
            H = 0.01 + rand(g, cols, dtype=work, device=device)
            if shape == (7, 5):
                S[2] = -1.0  # a row never updated ...
                H[3] = -1.0  # ... and a column
            if shape == (5, 6):
                S.fill_(-1.0)
            if shape == (9,):
                S[4] = -1.0
        fisher_S.append(S)
        fisher_H.append(H)
        offsets.append(offset)
    lr = torch.tensor(1e-2, dtype=work, device=device)
    return dict(params=params, grads=grads, exp_avgs=exp_avgs, steps=steps, fisher_S=fisher_S,
                fisher_H=fisher_H, h_offsets=offsets, lr=lr,
                beta=torch.tensor(0.9, dtype=torch.float64, device=device),
                weight_decay=torch.tensor(0.1, dtype=torch.float64, device=device),
                damping=torch.tensor(1e-3, dtype=torch.float64, device=device), decoupled=False,
                grad_scale=torch.tensor(64.0, device=device) if scaled else None, found_inf=None)


def run_update(fn, args):
    """fn on a copy of args (under no_grad: the reference writes leaves that may require grad)."""
    args = copy.deepcopy(args)
    with torch.no_grad():
        fn(**args)
    return args["params"], args["exp_avgs"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("decoupled", [False, True], ids=["AdaFisher", "AdaFisherW"])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
def test_update_matches_reference(device, dtype, decoupled, scaled):
    args = update_bucket(device, dtype, seed=1, scaled=scaled)
    args["decoupled"] = decoupled
    params, exp_avgs = run_update(ops.adafisher_step_, args)
    want_params, want_exp_avgs = run_update(ref.adafisher_step_, args)
    for p, want, before in zip(params, want_params, args["params"]):
        assert_close(p, want, RTOL[dtype])
        if p.numel():
            assert (p.double() - before.double()).abs().max() > 1e-4  # it did move
    for m, want in zip(exp_avgs, want_exp_avgs):
        assert_close(m, want, RTOL[ops.state_dtype(dtype)])


@pytest.mark.parametrize("device", DEVICES)
def test_update_many_tensors(device):
    """More tensors than one launch table holds, and (on CUDA) more chunks than one launch."""
    big = 21_000_000 if device == "cuda" else 70_000
    specs = [((5 + i % 7, 3 + i % 5), 5 + i % 7, 3 + i % 5, 0, 1.0 + i, False) for i in range(40)]
    specs.insert(17, ((big,), 0, 0, 0, 2.0, False))
    specs.insert(31, ((3, 70_001), 3, 70_001, 0, 3.0, False))  # 2 chunks, odd length
    args = update_bucket(device, torch.float32, seed=2, specs=specs)
    params, exp_avgs = run_update(ops.adafisher_step_, args)
    want_params, want_exp_avgs = run_update(ref.adafisher_step_, args)
    for got, want in zip(params + exp_avgs, want_params + want_exp_avgs):
        assert_close(got, want, RTOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_update_found_inf_writes_nothing(device):
    args = update_bucket(device, torch.float32, seed=3, scaled=True)
    args["found_inf"] = torch.tensor(1.0, device=device)
    before = copy.deepcopy(args)
    ops.adafisher_step_(**args)
    for got, was in zip(args["params"] + args["exp_avgs"], before["params"] + before["exp_avgs"]):
        assert_unchanged(got, was)
    args["found_inf"].zero_()
    params, exp_avgs = run_update(ops.adafisher_step_, args)
    want_params, want_exp_avgs = run_update(ref.adafisher_step_, args)
    for got, want in zip(params + exp_avgs, want_params + want_exp_avgs):
        assert_close(got, want, RTOL[torch.float32])


# ----------------------------------------------------------------------------------- statistics
STAT_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# (id, input shape, start_dim, end_dim, append_one, non-contiguous)
SUMSQ_CASES = [
    ("linear", (33, 17), 1, 2, True, False),
    ("linear-3d", (4, 9, 17), 2, 3, True, False),
    ("conv-grad", (3, 8, 5, 7), 1, 2, False, False),
    ("tiny", (1, 1), 1, 2, True, False),
    ("channels-of-two-dims", (3, 4, 5, 6), 1, 3, False, False),
    ("channels-first", (5, 3, 4), 0, 1, True, False),
    ("linear-noncontig", (19, 23), 1, 2, True, True),
    ("conv-grad-noncontig", (2, 6, 4, 5), 1, 2, False, True),
    ("large-linear", (700, 130), 1, 2, True, False),
    ("large-conv-grad", (8, 64, 14, 14), 1, 2, False, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", STAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", SUMSQ_CASES, ids=lambda c: c[0])
def test_sumsq_stats(device, dtype, case):
    _, shape, start, end, append_one, strided = case
    g = gen(4)
    x = randn(g, *shape, dtype=dtype, device=device) * (300 if dtype == torch.float16 else 1)
    if strided:
        x = noncontiguous(x)
    channels = torch.Size(shape[start:end]).numel()
    stat = stat_like(g, channels + append_one + 1, ops.state_dtype(dtype), device)
    want = reference_stat(ref.sumsq_stats_, stat, x, start, end, append_one)
    ops.sumsq_stats_(stat, x, start, end, append_one)
    assert_close(stat, want, RTOL[stat.dtype])


# (id, input shape, kernel, stride, padding [t, b, l, r], dilation, groups, append_one, layout)
CONV_CASES = [
    ("3x3-pad1-bias", (2, 3, 8, 8), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True, None),
    ("3x3-stride2-asym-pad", (3, 4, 9, 7), (3, 3), (2, 2), (1, 0, 2, 1), (1, 1), 1, False, None),
    ("2x3-dilated-groups", (2, 6, 10, 9), (2, 3), (1, 2), (0, 1, 1, 0), (2, 1), 2, True, None),
    ("1x1-downsample", (2, 5, 4, 4), (1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1, False, None),
    ("depthwise", (2, 4, 6, 6), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 4, True, None),
    ("7x7-stem", (2, 3, 20, 20), (7, 7), (2, 2), (3, 3, 3, 3), (1, 1), 1, False, None),
    ("tiny-image-big-pad", (1, 1, 1, 1), (3, 3), (1, 1), (2, 1, 1, 2), (1, 1), 1, True, None),
    ("channels-last", (2, 6, 7, 5), (3, 2), (1, 1), (1, 1, 0, 1), (1, 2), 3, True, "channels_last"),
    ("noncontig", (3, 4, 6, 7), (2, 2), (2, 1), (0, 1, 1, 1), (1, 1), 2, False, "transposed"),
    ("large", (8, 32, 16, 16), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True, None),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", STAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: c[0])
def test_conv2d_input_stats(device, dtype, case):
    _, shape, kernel, stride, padding, dilation, groups, append_one, layout = case
    g = gen(5)
    x = randn(g, *shape, dtype=dtype, device=device) * (300 if dtype == torch.float16 else 1)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
        assert not x.is_contiguous()
    elif layout == "transposed":
        x = noncontiguous(x)
    d = shape[1] // groups * kernel[0] * kernel[1]
    stat = stat_like(g, d + append_one + 1, ops.state_dtype(dtype), device)
    geometry = (list(kernel), list(stride), list(padding), list(dilation), groups, append_one)
    want = reference_stat(ref.conv2d_input_stats_, stat, x, *geometry)
    ops.conv2d_input_stats_(stat, x, *geometry)
    assert_close(stat, want, RTOL[stat.dtype])


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", ["same", "valid", (2, 1)], ids=str)
def test_conv2d_input_stats_module_padding(device, padding):
    """layers.conv_padding resolves a Conv2d's padding (an even kernel pads one more at the end)."""
    conv = torch.nn.Conv2d(4, 6, (4, 3), padding=padding, dilation=(1, 2), groups=2)
    g = gen(6)
    x = randn(g, 3, 4, 9, 8, device=device)
    pads = conv_padding(conv)
    stat = stat_like(g, 2 * 4 * 3 + 2, torch.float32, device)
    geometry = (list(conv.kernel_size), list(conv.stride), pads, list(conv.dilation), 2, True)
    want = reference_stat(ref.conv2d_input_stats_, stat, x, *geometry)
    ops.conv2d_input_stats_(stat, x, *geometry)
    assert_close(stat, want, RTOL[torch.float32])
    # The reference's unfold over the padded input sees the conv's own output size.
    out = conv.to(device)(x)
    top, bottom, left, right = pads
    assert (9 + top + bottom - (4 - 1) - 1) // 1 + 1 == out.shape[2]
    assert (8 + left + right - 2 * (3 - 1) - 1) // 1 + 1 == out.shape[3]


# (id, input shape, non-contiguous)
NORM_INPUT_CASES = [
    ("batchnorm2d", (4, 6, 5, 5), False),
    ("layernorm-btc", (3, 7, 8), False),
    ("two-dims", (5, 4), False),
    ("layernorm-multidim", (2, 3, 4, 5), False),
    ("batchnorm2d-noncontig", (3, 5, 4, 6), True),
    ("large", (16, 64, 12, 12), False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", STAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", NORM_INPUT_CASES, ids=lambda c: c[0])
def test_norm_input_stats(device, dtype, case):
    _, shape, strided = case
    g = gen(7)
    x = randn(g, *shape, dtype=dtype, device=device) + 0.5  # means well away from zero
    if strided:
        x = noncontiguous(x)
    stat = stat_like(g, 3, ops.state_dtype(dtype), device)
    want = reference_stat(ref.norm_input_stats_, stat, x)
    ops.norm_input_stats_(stat, x)
    assert_close(stat, want, RTOL[stat.dtype])


# (id, gradient shape, start_dim, end_dim, non-contiguous)
NORM_GRAD_CASES = [
    ("batchnorm2d", (4, 6, 5, 5), 1, 2, False),
    ("layernorm-btc", (3, 7, 8), 2, 3, False),
    ("layernorm-multidim", (2, 3, 4, 5), 2, 4, False),
    ("two-dims", (5, 4), 1, 2, False),
    ("layernorm-noncontig", (4, 3, 6), 2, 3, True),
    ("large", (16, 64, 12, 12), 1, 2, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", STAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", NORM_GRAD_CASES, ids=lambda c: c[0])
def test_norm_grad_stats(device, dtype, case):
    _, shape, start, end, strided = case
    g = gen(8)
    grad = randn(g, *shape, dtype=dtype, device=device)
    if strided:
        grad = noncontiguous(grad)
    channels = torch.Size(shape[start:end]).numel()
    stat = stat_like(g, channels + 1, ops.state_dtype(dtype), device)
    want = reference_stat(ref.norm_grad_stats_, stat, grad, start, end)
    ops.norm_grad_stats_(stat, grad, start, end)
    assert_close(stat, want, RTOL[stat.dtype])


def stat_calls(device, g):
    """One valid call of each statistics op: (name, stat, the rest of the arguments)."""
    x4 = randn(g, 2, 4, 5, 5, device=device)
    return [
        ("sumsq_stats_", stat_like(g, 6, torch.float32, device), (randn(g, 3, 4, device=device), 1, 2, True)),
        ("conv2d_input_stats_", stat_like(g, 4 * 9 + 2, torch.float32, device),
         (x4, [3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1, True)),
        ("norm_input_stats_", stat_like(g, 3, torch.float32, device), (x4,)),
        ("norm_grad_stats_", stat_like(g, 5, torch.float32, device), (x4, 1, 2)),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step,interval,due", [(3.0, 2, False), (4.0, 2, True), (0.0, 5, True),
                                               (99.0, 100, False), (7.0, 1, True)])
def test_statistics_gating(device, step, interval, due):
    """With `step` given, a statistics op runs only when step % interval == 0."""
    for name, stat, rest in stat_calls(device, gen(9)):
        want = stat.clone()
        if due:
            getattr(ref, name)(want, *rest)
        getattr(ops, name)(stat, *rest, step=torch.tensor(step, device=device), interval=interval)
        if due:
            assert_close(stat, want, RTOL[torch.float32])
        else:
            assert_unchanged(stat, want)


# ----------------------------------------------------------------------------------- factors
def average_case(device, dtype, seed=10):
    """Entries: count 1; first use (factor -1) from 3 contributions; +-inf (dropped); count 0;
    constant; length 1. grad_side alternates."""
    g = gen(seed)
    f = lambda n: 0.05 + rand(g, n, dtype=dtype, device=device)  # noqa: E731
    factors = [f(5), -torch.ones(7, dtype=dtype, device=device), f(4), f(3), f(6), f(1)]
    stats = [rand(g, n.numel() + 1, dtype=dtype, device=device) for n in factors]
    counts = [1.0, 3.0, 2.0, 0.0, 4.0, 1.0]
    for s, count in zip(stats, counts):
        s[-1] = count
    stats[1][:-1] *= 3.0
    stats[2][1], stats[2][3] = float("inf"), float("-inf")
    stats[4][:-1] = 0.25
    grad_side = [i % 2 == 1 for i in range(len(factors))]
    return factors, stats, grad_side


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
def test_fisher_average_matches_reference(device, dtype, scaled):
    factors, stats, grad_side = average_case(device, dtype)
    grad_scale = torch.tensor(8.0, device=device) if scaled else None
    skipped = torch.tensor(2.0, device=device)
    before = copy.deepcopy(factors)
    want_f, want_s, want_skipped = copy.deepcopy((factors, stats, skipped))
    ref.fisher_average_(want_f, want_s, want_skipped, 0.8, grad_side, grad_scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the op only counts: the optimizer warns
        ops.fisher_average_(factors, stats, skipped, 0.8, grad_side, grad_scale)
    for got, want in zip(factors, want_f):
        assert_close(got, want, RTOL[dtype])
    for got in stats:
        assert torch.count_nonzero(got) == 0
    assert skipped.item() == want_skipped.item() == 3.0  # the +-inf statistic is dropped
    assert torch.equal(factors[2], before[2])
    assert torch.equal(factors[3], want_f[3])  # count 0: untouched


@pytest.mark.parametrize("device", DEVICES)
def test_fisher_average_drops_nan(device, capfd):
    factors, stats, grad_side = average_case(device, torch.float32, seed=11)
    stats[2][0] = float("nan")
    stats[4][2] = float("nan")
    stats[3][1] = float("nan")  # count 0: not folded, so not dropped either
    skipped = torch.tensor(1.0, device=device)
    before = copy.deepcopy(factors)
    want_f, want_s, want_skipped = copy.deepcopy((factors, stats, skipped))
    ref.fisher_average_(want_f, want_s, want_skipped, 0.8, grad_side)
    ops.fisher_average_(factors, stats, skipped, 0.8, grad_side)
    # The op only counts (the optimizer turns the count into a Python warning, where reading it
    # costs no sync): no line on stderr that `warnings` could not catch.
    assert "NaN" not in capfd.readouterr().err
    assert skipped.item() == want_skipped.item() == 3.0
    for i in (2, 3, 4):
        assert_unchanged(factors[i], before[i])
    for got, want in zip(factors, want_f):
        assert_close(got, want, RTOL[torch.float32])
    for got in stats:
        assert torch.count_nonzero(got) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_fisher_average_found_inf(device):
    factors, stats, grad_side = average_case(device, torch.float32, seed=12)
    skipped = torch.tensor(0.0, device=device)
    before = copy.deepcopy(factors)
    ops.fisher_average_(factors, stats, skipped, 0.8, grad_side, torch.tensor(4.0, device=device),
                        torch.tensor(1.0, device=device))
    for got, was in zip(factors, before):
        assert_unchanged(got, was)
    for got in stats:
        assert torch.count_nonzero(got) == 0
    assert skipped.item() == 0.0


# ----------------------------------------------------------------------------------- kernel paths
# Sizes past the single-pass limits of the CUDA kernels (csrc/cuda/adafisher_statistics.cu, adafisher_average.cu), so
# their second passes run: a run longer than one segment a warp sums, more rows than the column-sum
# grid has threads for, more runs or patch entries than the grid has warps, more input positions
# than one grid covers, more factors than one fisher_average_ launch holds. The CPU runs the same
# cases (a few seconds), which also checks the tests themselves where no GPU is at hand.
SEGMENT = 8192               # adafisher_statistics.cu kSegment: elements of a run one warp sums
GRID_WARPS = 4096 * 8        # adafisher_statistics.cu kMaxGrid blocks x kWarps
GRID_POSITIONS = 4096 * 32   # adafisher_statistics.cu kMaxGrid blocks x 32 conv2d input positions
BATCH_SLICES = 8             # adafisher_statistics.cu kBatchSlices: threads sharing a position's batch
COLUMN_GRID_ROWS = 4096 * 4  # adafisher_statistics.cu: rows (grid.y) of the column sums, divided by the column blocks
AVERAGE_ENTRIES = 128        # adafisher_average.cu kMaxEntries: statistics one fisher_average_ launch folds


def channel_view(shape, start, end):
    outer, channels, inner = 1, 1, 1
    for d, size in enumerate(shape):
        if d < start:
            outer *= size
        elif d < end:
            channels *= size
        else:
            inner *= size
    return outer, channels, inner


# (id, op, input shape, start_dim, end_dim, append_one (sumsq only), the path it reaches)
MULTI_PASS_CASES = [
    ("sumsq-long-runs", "sumsq_stats_", (3, 4, 130, 130), 1, 2, False, "segments"),
    ("norm-grad-long-runs", "norm_grad_stats_", (2, 3, 9001), 1, 2, None, "segments"),
    ("norm-input-long-runs", "norm_input_stats_", (2, 3, 95, 97), 1, 2, None, "segments"),
    ("sumsq-many-runs", "sumsq_stats_", (300, 128, 3, 3), 1, 2, False, "runs"),
    ("sumsq-many-rows", "sumsq_stats_", (40000, 5), 1, 2, True, "rows"),
    ("sumsq-many-rows-wide", "sumsq_stats_", (9000, 300), 1, 2, True, "rows"),
    ("norm-grad-many-rows", "norm_grad_stats_", (40000, 5), 1, 2, None, "rows"),
    ("norm-input-many-rows", "norm_input_stats_", (40000, 5), 1, 2, None, "rows"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", MULTI_PASS_CASES, ids=lambda c: c[0])
def test_channel_statistics_multi_pass(device, dtype, case):
    _, name, shape, start, end, append_one, path = case
    outer, channels, inner = channel_view(shape, start, end)  # norm_input_stats_ views [B, T, rest] alike
    if path == "segments":
        assert inner > SEGMENT and inner % SEGMENT != 0  # several segments per run, a partial last one
    elif path == "runs":
        assert inner > 1 and outer * channels > GRID_WARPS
    else:  # a thread sums several rows of its column
        assert inner == 1 and outer > COLUMN_GRID_ROWS // -(-channels // 256)
    g = gen(30)
    x = randn(g, *shape, dtype=dtype, device=device) + (0.5 if name == "norm_input_stats_" else 0.0)
    if name == "sumsq_stats_":
        rest, length = (start, end, append_one), channels + append_one + 1
    elif name == "norm_grad_stats_":
        rest, length = (start, end), channels + 1
    else:
        rest, length = (), 3
    stat = stat_like(g, length, dtype, device)
    want = reference_stat(getattr(ref, name), stat, x, *rest)
    getattr(ops, name)(stat, x, *rest)
    # float64 (1e-12) is what catches a row or a segment summed twice or not at all. float32 sums
    # ~1e4 partial sums in another order than the reference: 5e-6 relative.
    assert_close(stat, want, RTOL[dtype] if dtype == torch.float64 else 3e-5)


# (id, input shape, kernel, stride, padding [t, b, l, r], dilation, groups, append_one, the path)
BIG_CONV_CASES = [
    ("many-patch-entries", (1, 4096, 3, 3), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True, "entries"),
    ("3x3-same-1M-outputs", (2, 2, 1030, 1030), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True, "positions"),
    ("dilated-groups-1M-outputs", (1, 4, 1100, 1000), (2, 3), (1, 1), (0, 1, 1, 0), (2, 1), 2, False,
     "positions"),
    # A batch far larger than its planes (a network's last stage): each position's samples shared
    # out over the block's slices, a batch no multiple of them, the last block part-filled.
    ("large-batch-small-planes", (203, 5, 3, 3), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True, "batch"),
    ("large-batch-channels-last", (77, 3, 4, 5), (2, 2), (2, 1), (0, 1, 1, 0), (1, 2), 1, False, "batch"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", BIG_CONV_CASES, ids=lambda c: c[0])
def test_conv2d_input_stats_multi_pass(device, dtype, case):
    name, shape, kernel, stride, padding, dilation, groups, append_one, path = case
    batch, channels, height, width = shape
    out_h = (height + padding[0] + padding[1] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    out_w = (width + padding[2] + padding[3] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    d = channels // groups * kernel[0] * kernel[1]
    if path == "entries":  # more patch entries than the grid has warps
        assert d > GRID_WARPS
    elif path == "batch":
        assert batch > 8 * BATCH_SLICES and (channels * height * width) % 32 and batch % BATCH_SLICES
    else:  # more input positions than one grid covers, and over a million output positions
        assert channels * height * width > GRID_POSITIONS and out_h * out_w > 2 ** 20
    g = gen(31)
    x = randn(g, *shape, dtype=dtype, device=device)
    if name.endswith("channels-last"):
        x = x.contiguous(memory_format=torch.channels_last)
    stat = stat_like(g, d + append_one + 1, dtype, device)
    geometry = (list(kernel), list(stride), list(padding), list(dilation), groups, append_one)
    want = reference_stat(ref.conv2d_input_stats_, stat, x, *geometry)
    ops.conv2d_input_stats_(stat, x, *geometry)
    # float64 (1e-12) is what catches a tap summed twice or not at all. float32: a warp lane adds
    # ~3e4 taps in sequence over a million positions, ~1e-5 relative rounding error.
    assert_close(stat, want, RTOL[dtype] if dtype == torch.float64 or path == "entries" else 1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fisher_average_more_entries_than_one_launch(device, dtype):
    """Three launches' worth of statistics (on CUDA), of lengths up to 20x a block's threads: first
    uses, empty counts, NaN drops in every launch, gradient sides scaled."""
    n = 2 * AVERAGE_ENTRIES + 45
    lengths = [1 + (37 * i) % 300 for i in range(n)]
    lengths[200] = 5000
    g = gen(32)
    factors = [0.05 + rand(g, k, dtype=dtype, device=device) for k in lengths]
    stats = [rand(g, k + 1, dtype=dtype, device=device) for k in lengths]
    for i, (factor, stat) in enumerate(zip(factors, stats)):
        if i % 5 == 1:
            factor.fill_(-1.0)  # never updated: starts from ones
        stat[-1] = float(i % 4)  # count 0 every fourth entry: not folded
    nan_entries = (3, AVERAGE_ENTRIES + 22, 2 * AVERAGE_ENTRIES + 34)  # one per launch, counts > 0
    for i in nan_entries:
        stats[i][lengths[i] // 2] = float("nan")
    grad_side = [i % 3 == 0 for i in range(n)]
    grad_scale = torch.tensor(4.0, device=device)
    skipped = torch.tensor(1.0, device=device)
    before = copy.deepcopy(factors)
    want_f, want_s, want_skipped = copy.deepcopy((factors, stats, skipped))
    ref.fisher_average_(want_f, want_s, want_skipped, 0.8, grad_side, grad_scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU kernel warns about the dropped statistics
        ops.fisher_average_(factors, stats, skipped, 0.8, grad_side, grad_scale)
    assert skipped.item() == want_skipped.item() == 1.0 + len(nan_entries)
    for i, (got, want, was) in enumerate(zip(factors, want_f, before)):
        if i % 4 == 0 or i in nan_entries:
            assert_unchanged(got, was)
        else:
            assert not torch.equal(got, was), i
        assert_close(got, want, RTOL[dtype])
    for got in stats:
        assert torch.count_nonzero(got) == 0


# ----------------------------------------------------------------------------------- errors
def step_args():
    g = gen(13)
    return dict(
        params=[randn(g, 4, 3), randn(g, 5), randn(g, 2, 6)],
        grads=[randn(g, 4, 3), randn(g, 5), randn(g, 2, 6)],
        exp_avgs=[randn(g, 4, 3), randn(g, 5), randn(g, 2, 6)],
        steps=[torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)],
        fisher_S=[rand(g, 4), torch.empty(0), rand(g, 2)],
        fisher_H=[rand(g, 4), torch.empty(0), rand(g, 6)],
        h_offsets=[1, 0, 0], lr=torch.tensor(1e-2), beta=torch.tensor(0.9, dtype=torch.float64),
        weight_decay=torch.tensor(0.1, dtype=torch.float64), damping=torch.tensor(1e-3, dtype=torch.float64),
        decoupled=False, grad_scale=torch.tensor(2.0), found_inf=torch.tensor(0.0))


def sumsq_args():
    g = gen(14)
    return dict(stat=stat_like(g, 7, torch.float32, "cpu"), x=randn(g, 4, 5), start_dim=1, end_dim=2,
                append_one=True, step=torch.tensor(2.0), interval=1)


def conv_args():
    g = gen(15)
    return dict(stat=stat_like(g, 20, torch.float32, "cpu"), x=randn(g, 2, 4, 6, 6), kernel_size=[3, 3],
                stride=[1, 1], padding=[1, 1, 1, 1], dilation=[1, 1], groups=2, append_one=True)


def norm_input_args():
    g = gen(16)
    return dict(stat=stat_like(g, 3, torch.float32, "cpu"), x=randn(g, 3, 4, 5))


def norm_grad_args():
    g = gen(17)
    return dict(stat=stat_like(g, 6, torch.float32, "cpu"), g=randn(g, 3, 4, 5), start_dim=2, end_dim=3)


def average_args():
    g = gen(18)
    return dict(factors=[rand(g, 3), rand(g, 4)], stats=[rand(g, 4), rand(g, 5)], skipped=torch.tensor(0.0),
                gamma=torch.tensor(0.8, dtype=torch.float64), grad_side=[False, True], grad_scale=torch.tensor(2.0),
                found_inf=torch.tensor(0.0))


def put(key, index=None, value=None, fn=None):
    """An edit of valid arguments: args[key] (or args[key][index]) = value, or = fn(old)."""
    def edit(args):
        old = args[key] if index is None else args[key][index]
        new = fn(old) if fn is not None else value
        if index is None:
            args[key] = new
        else:
            args[key] = list(args[key])
            args[key][index] = new
    return edit


# (id, op, valid arguments, edit, exception, message, also rejected by the C++ op with the same)
ERRORS = [
    ("grads-length", "adafisher_step_", step_args, put("grads", fn=lambda v: v[:2]), ValueError,
     r"grads has 2 entries but params has 3", True),
    ("h_offsets-length", "adafisher_step_", step_args, put("h_offsets", fn=lambda v: v[:2]), ValueError,
     r"h_offsets has 2 entries but params has 3", True),
    ("params-dtype", "adafisher_step_", step_args,
     put("params", fn=lambda v: [t.long() for t in v]), TypeError, r"params\[0\] has dtype", True),
    ("beta", "adafisher_step_", step_args, put("beta", value=torch.tensor(1.0, dtype=torch.float64)), ValueError, r"beta must be in \[0, 1\)", True),
    ("damping", "adafisher_step_", step_args, put("damping", value=torch.tensor(0.0, dtype=torch.float64)), ValueError, r"damping must be > 0", True),
    ("weight_decay", "adafisher_step_", step_args, put("weight_decay", value=torch.tensor(-0.1, dtype=torch.float64)), ValueError,
     r"weight_decay must be >= 0", True),
    ("lr-float", "adafisher_step_", step_args, put("lr", value=0.01), TypeError, r"lr must be a Tensor", False),
    ("lr-shape", "adafisher_step_", step_args, put("lr", value=torch.tensor([0.01])), ValueError,
     r"lr must be a 0-dim tensor", True),
    ("lr-dtype", "adafisher_step_", step_args, put("lr", value=torch.tensor(0.01, dtype=torch.float64)),
     TypeError, r"lr has dtype", True),
    ("grad_scale-dtype", "adafisher_step_", step_args,
     put("grad_scale", value=torch.tensor(2.0, dtype=torch.float64)), TypeError, r"grad_scale has dtype", True),
    ("found_inf-shape", "adafisher_step_", step_args, put("found_inf", value=torch.zeros(1)), ValueError,
     r"found_inf must be a 0-dim tensor", True),
    ("params-bucket", "adafisher_step_", step_args, put("params", 2, fn=lambda t: t.double()), ValueError,
     r"params\[2\] is .*a bucket is one device and one dtype", True),
    ("params-noncontig", "adafisher_step_", step_args, put("params", 2, fn=lambda t: t.t().contiguous().t()),
     ValueError, r"params\[2\] must be contiguous", True),
    ("grads-shape", "adafisher_step_", step_args, put("grads", 2, fn=lambda t: t.reshape(6, 2)), ValueError,
     r"grads\[2\] must be a contiguous", True),
    ("exp_avgs-dtype", "adafisher_step_", step_args, put("exp_avgs", 2, fn=lambda t: t.double()), ValueError,
     r"exp_avgs\[2\] must be a contiguous", True),
    ("steps-dtype", "adafisher_step_", step_args, put("steps", 2, value=torch.tensor(3.0, dtype=torch.float64)),
     TypeError, r"steps\[2\] has dtype", True),
    ("steps-shape", "adafisher_step_", step_args, put("steps", 2, value=torch.tensor([3.0])), ValueError,
     r"steps\[2\] must be a 0-dim tensor", True),
    ("factors-half-empty", "adafisher_step_", step_args, put("fisher_H", 2, value=torch.empty(0)), ValueError,
     r"fisher_S\[2\] and fisher_H\[2\] must both be empty", True),
    ("fisher_S-2d", "adafisher_step_", step_args, put("fisher_S", 2, fn=lambda t: t[:, None]), ValueError,
     r"fisher_S\[2\] must be a contiguous 1-D", True),
    ("fisher_H-dtype", "adafisher_step_", step_args, put("fisher_H", 2, fn=lambda t: t.double()), ValueError,
     r"fisher_H\[2\] must be a contiguous 1-D", True),
    ("fisher_S-rows", "adafisher_step_", step_args, put("fisher_S", 2, value=torch.rand(5)), ValueError,
     r"params\[2\] has 12 elements, not a multiple of len\(fisher_S\[2\]\) = 5", True),
    ("h_offsets-past-end", "adafisher_step_", step_args, put("h_offsets", 2, value=1), ValueError,
     r"h_offsets\[2\] = 1 with 6 columns does not fit fisher_H\[2\] of length 6", True),
    ("h_offsets-negative", "adafisher_step_", step_args, put("h_offsets", 2, value=-1), ValueError,
     r"h_offsets\[2\] = -1 with 6 columns does not fit", True),
    ("sumsq-dims", "sumsq_stats_", sumsq_args, put("end_dim", value=3), ValueError,
     r"sumsq_stats_: need 0 <= start_dim < end_dim <= ndim, got 1, 3 for ndim 2", True),
    ("sumsq-stat-dtype", "sumsq_stats_", sumsq_args, put("stat", fn=lambda t: t.double()), TypeError,
     r"stat has dtype .*, expected .* for input dtype", True),
    ("sumsq-stat-2d", "sumsq_stats_", sumsq_args, put("stat", fn=lambda t: t[:, None]), ValueError,
     r"stat must be a contiguous 1-D tensor", True),
    ("sumsq-stat-length", "sumsq_stats_", sumsq_args, put("stat", fn=lambda t: t[:6]), ValueError,
     r"stat has 6 elements, expected 7 \(statistics plus a count\)", True),
    ("sumsq-input-dtype", "sumsq_stats_", sumsq_args, put("x", fn=lambda t: t.long()), TypeError,
     r"input dtype .* is not a floating type cafin supports", True),
    ("sumsq-empty", "sumsq_stats_", sumsq_args, put("x", value=torch.empty(0, 5)), ValueError,
     r"sumsq_stats_: the input is empty", True),
    ("sumsq-not-tensor", "sumsq_stats_", sumsq_args, put("stat", value=[0.0] * 7), TypeError,
     r"stat and the input must be Tensors", False),
    ("step-dtype", "sumsq_stats_", sumsq_args, put("step", value=torch.tensor(2, dtype=torch.int64)), TypeError,
     r"step has dtype", True),
    ("step-shape", "sumsq_stats_", sumsq_args, put("step", value=torch.tensor([2.0])), ValueError,
     r"step must be a 0-dim tensor", True),
    ("interval", "sumsq_stats_", sumsq_args, put("interval", value=0), ValueError,
     r"interval must be an int >= 1, got 0", True),
    ("conv-input-3d", "conv2d_input_stats_", conv_args, put("x", fn=lambda t: t[0]), ValueError,
     r"conv2d_input_stats_: input must be \[B, C, H, W\]", True),
    ("conv-padding-2", "conv2d_input_stats_", conv_args, put("padding", value=[1, 1]), ValueError,
     r"kernel_size, stride, dilation take 2 ints and padding 4", True),
    ("conv-stride-0", "conv2d_input_stats_", conv_args, put("stride", value=[1, 0]), ValueError,
     r"kernel_size, stride, dilation must be >= 1 and padding >= 0", True),
    ("conv-padding-negative", "conv2d_input_stats_", conv_args, put("padding", value=[1, 1, -1, 1]),
     ValueError, r"must be >= 1 and padding >= 0", True),
    ("conv-groups", "conv2d_input_stats_", conv_args, put("groups", value=3), ValueError,
     r"4 input channels do not split into 3 groups", True),
    ("conv-empty-output", "conv2d_input_stats_", conv_args,
     put("x", value=torch.rand(2, 4, 0, 3)), ValueError, r"gives an empty output", True),
    ("conv-stat-length", "conv2d_input_stats_", conv_args, put("append_one", value=False), ValueError,
     r"stat has 20 elements, expected 19", True),
    ("norm-input-1d", "norm_input_stats_", norm_input_args, put("x", value=torch.rand(5)), ValueError,
     r"norm_input_stats_: input must have at least 2 dims and elements", True),
    ("norm-input-stat-length", "norm_input_stats_", norm_input_args, put("stat", value=torch.zeros(4)),
     ValueError, r"stat has 4 elements, expected 3", True),
    ("norm-grad-dims", "norm_grad_stats_", norm_grad_args, put("end_dim", value=4), ValueError,
     r"norm_grad_stats_: need 0 <= start_dim < end_dim <= ndim", True),
    ("norm-grad-stat-length", "norm_grad_stats_", norm_grad_args, put("start_dim", value=1), ValueError,
     r"stat has 6 elements, expected 21", True),
    ("norm-grad-empty", "norm_grad_stats_", norm_grad_args, put("g", value=torch.empty(0, 4, 5)), ValueError,
     r"norm_grad_stats_: the gradient is empty", True),
    ("average-lengths", "fisher_average_", average_args, put("grad_side", value=[False]), ValueError,
     r"factors, stats and grad_side must have one entry each, got 2, 2, 1", True),
    ("average-gamma", "fisher_average_", average_args, put("gamma", value=torch.tensor(0.0, dtype=torch.float64)), ValueError,
     r"gamma must be in \(0, 10\]", True),
    ("average-skipped-dtype", "fisher_average_", average_args,
     put("skipped", value=torch.tensor(0.0, dtype=torch.float64)), TypeError, r"skipped has dtype", True),
    ("average-skipped-shape", "fisher_average_", average_args, put("skipped", value=torch.zeros(1)),
     ValueError, r"skipped must be a 0-dim tensor", True),
    ("average-grad_scale-shape", "fisher_average_", average_args, put("grad_scale", value=torch.ones(1)),
     ValueError, r"grad_scale must be a 0-dim tensor", True),
    ("average-found_inf-dtype", "fisher_average_", average_args,
     put("found_inf", value=torch.tensor(0, dtype=torch.int32)), TypeError, r"found_inf has dtype", True),
    ("average-factor-dtype", "fisher_average_", average_args, put("factors", 1, fn=lambda t: t.half()),
     TypeError, r"factors\[1\] and stats\[1\] must share a float32/float64 dtype", True),
    ("average-stat-dtype", "fisher_average_", average_args, put("stats", 1, fn=lambda t: t.double()),
     TypeError, r"factors\[1\] and stats\[1\] must share a float32/float64 dtype", True),
    ("average-factor-2d", "fisher_average_", average_args, put("factors", 1, fn=lambda t: t[:, None]),
     ValueError, r"factors\[1\] and stats\[1\] must be contiguous 1-D tensors", True),
    ("average-stat-length", "fisher_average_", average_args, put("stats", 1, fn=lambda t: t[:4]), ValueError,
     r"stats\[1\] must hold len\(factors\[1\]\) \+ 1 = 5 entries, got 4", True),
    ("average-factor-empty", "fisher_average_", average_args, put("factors", 1, value=torch.empty(0)),
     ValueError, r"stats\[1\] must hold len\(factors\[1\]\) \+ 1 = 1 entries, got 5", True),
]


@pytest.mark.parametrize("case", ERRORS, ids=lambda c: c[0])
def test_argument_errors(case):
    """The wrapper raises the documented error; the C++ op, called directly, raises the same and
    writes nothing (earlier list entries included) and bumps no version counter."""
    _, name, make, edit, exc, match, in_cpp = case
    args = make()
    edit(args)
    with pytest.raises(exc, match=match):
        getattr(ops, name)(**args)
    if not in_cpp:
        return
    before = [(t, t.clone(), t._version) for t in tensors_in(args)]
    with pytest.raises(exc, match=match):
        getattr(torch.ops.cafin, name)(**args)
    for t, was, version in before:
        assert_unchanged(t, was)
        assert t._version == version


def test_update_rejects_bad_last_entry_writing_nothing():
    """The kernel's checks run before any write: a bucket whose last grad has the wrong shape
    leaves the (valid) earlier parameters and moments bit-identical."""
    args = update_bucket("cpu", torch.float32, seed=19)
    args["grads"][-1] = args["grads"][-1].reshape(-1)
    before = copy.deepcopy(args)
    with pytest.raises(ValueError, match=rf"grads\[{len(args['params']) - 1}\] must be a contiguous"):
        torch.ops.cafin.adafisher_step_(**args)
    for got, was in zip(args["params"] + args["exp_avgs"], before["params"] + before["exp_avgs"]):
        assert_unchanged(got, was)


# ----------------------------------------------------------------------------------- autograd
def every_op_call(device, requires_grad):
    """One valid call of every op, (name, kwargs, names of the mutated arguments)."""
    g = gen(20)
    step = step_args()
    step = {k: ([t.to(device) for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)
                else v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in step.items()}
    calls = [("adafisher_step_", step, ("params", "exp_avgs"))]
    for name, stat, rest in stat_calls(device, g):
        calls.append((name, dict(stat=stat, rest=rest), ("stat",)))
    average = {k: ([t.to(device) for t in v] if isinstance(v, list) and isinstance(v[0], torch.Tensor)
                   else v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in average_args().items()}
    average["stats"][0][-1] = 1.0
    calls.append(("fisher_average_", average, ("factors", "stats", "skipped")))
    if requires_grad:
        for _, kwargs, _ in calls:
            for t in tensors_in(kwargs.get("rest", ())) + kwargs.get("params", []) + kwargs.get("factors", []):
                if t.is_floating_point() and t.is_leaf:
                    t.requires_grad_(True)
    return calls


def call(name, kwargs):
    if "rest" in kwargs:
        return getattr(ops, name)(kwargs["stat"], *kwargs["rest"])
    return getattr(ops, name)(**kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_version_counters_bumped(device):
    for name, kwargs, mutated in every_op_call(device, requires_grad=False):
        written = [t for key in mutated for t in (kwargs[key] if isinstance(kwargs[key], list) else [kwargs[key]])]
        read = [t for t in tensors_in(kwargs) + tensors_in(kwargs.get("rest", ()))
                if all(t is not w for w in written)]
        versions = [t._version for t in written + read]
        call(name, kwargs)
        for t, v in zip(written, versions):
            assert t._version > v, (name, "written tensor not bumped")
        for t, v in zip(read, versions[len(written):]):
            assert t._version == v, (name, "read-only tensor bumped")


@pytest.mark.parametrize("device", DEVICES)
def test_no_graph_no_warning_with_grad_mode_on(device):
    """Tensors that require grad, grad mode on: no autograd error or warning, and nothing the ops
    wrote has a grad_fn or starts requiring grad."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.is_grad_enabled()
        for name, kwargs, mutated in every_op_call(device, requires_grad=True):
            if name == "sumsq_stats_":  # a non-leaf input, as a hook sees activations
                kwargs["rest"] = (kwargs["rest"][0] * 2,) + kwargs["rest"][1:]
            call(name, kwargs)
            for key in mutated:
                for t in kwargs[key] if isinstance(kwargs[key], list) else [kwargs[key]]:
                    assert t.grad_fn is None, name
                    if key == "stat":
                        assert not t.requires_grad, name


# ----------------------------------------------------------------------------------- registry
def registered_ops() -> list[str]:
    """The names of the cafin ops, read from the dispatcher: the schemas of csrc/ops.cpp are the
    one list of ops, and everything below is checked against it."""
    return sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("cafin::"))


def test_every_op_has_faces_fake_autograd_kernel_and_opcheck_test():
    """Each op defined in csrc/ops.cpp has a Python face in cafin.ops and a twin in
    cafin.reference, a fake implementation (torch.compile), the below-autograd kernel (ops.cpp
    registers it for every schema it defines) and an opcheck test (it is named in a test file
    that runs torch's opcheck)."""
    from torch._library.simple_registry import singleton

    names = registered_ops()
    assert len(names) >= 18, names
    opcheck_sources = [p.read_text() for p in Path(__file__).parent.glob("test_*.py")
                       if "opcheck" in p.read_text()]
    for name in names:
        qualname = f"cafin::{name}"
        assert callable(getattr(ops, name, None)), f"{name}: no Python face in cafin.ops"
        assert callable(getattr(ref, name, None)), f"{name}: no twin in cafin.reference"
        assert singleton.find(qualname).fake_impl.kernel is not None, f"{name}: no fake implementation"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd"), \
            f"{name}: no Autograd kernel"
        assert any(name in text for text in opcheck_sources), f"{name}: no opcheck test"


# ----------------------------------------------------------------------------------- opcheck
def opcheck_samples(device):
    """Small samples of every op (tensors that can require grad do, so the autograd registration
    check runs), covering optional arguments given and omitted."""
    samples = []
    for name, kwargs, _ in every_op_call(device, requires_grad=True):
        op = getattr(torch.ops.cafin, name).default
        if "rest" in kwargs:
            samples.append((op, (kwargs["stat"], *kwargs["rest"]), {}))
            samples.append((op, (kwargs["stat"].clone(), *kwargs["rest"]),
                            dict(step=torch.tensor(4.0, device=device), interval=2)))
        else:
            samples.append((op, (), kwargs))
    bare = every_op_call(device, requires_grad=True)[0][1]
    bare.update(grad_scale=None, found_inf=None, decoupled=True)
    samples.append((torch.ops.cafin.adafisher_step_.default, (), bare))
    return samples


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args, kwargs in opcheck_samples(device):
        torch.library.opcheck(op, args, kwargs)


class TestOps:
    """One small test per op, compared with the reference. generate_opcheck_tests (below) runs
    each of them again under schema, autograd-registration, fake-tensor and AOT-dispatch checks
    of every cafin op call they make; the exhaustive numerics live in the module-level tests."""

    @pytest.mark.parametrize("device", DEVICES)
    def test_adafisher_step_(self, device):
        specs = [((7, 5), 7, 6, 0, 1.0, False), ((7,), 7, 6, 5, 1.0, True), ((3,), 0, 0, 0, 2.0, False)]
        args = update_bucket(device, torch.float32, seed=21, specs=specs, scaled=True)
        args["params"][0].requires_grad_(True)
        want = run_update(ref.adafisher_step_, {k: v for k, v in args.items()})
        ops.adafisher_step_(**args)
        for got, expected in zip(args["params"] + args["exp_avgs"], want[0] + want[1]):
            assert_close(got, expected, RTOL[torch.float32])

    @pytest.mark.parametrize("device", DEVICES)
    def test_sumsq_stats_(self, device):
        g = gen(22)
        x = randn(g, 3, 4, 5, device=device).requires_grad_(True)
        stat = stat_like(g, 5 + 1 + 1, torch.float32, device)
        want = reference_stat(ref.sumsq_stats_, stat, x.detach(), 2, 3, True)
        ops.sumsq_stats_(stat, x, 2, 3, True, step=torch.tensor(6.0, device=device), interval=3)
        assert_close(stat, want, RTOL[torch.float32])

    @pytest.mark.parametrize("device", DEVICES)
    def test_conv2d_input_stats_(self, device):
        g = gen(23)
        x = randn(g, 2, 4, 6, 5, device=device).requires_grad_(True)
        geometry = ([3, 2], [2, 1], [1, 0, 1, 1], [1, 2], 2, True)
        stat = stat_like(g, 2 * 6 + 2, torch.float32, device)
        want = reference_stat(ref.conv2d_input_stats_, stat, x.detach(), *geometry)
        ops.conv2d_input_stats_(stat, x, *geometry)
        assert_close(stat, want, RTOL[torch.float32])

    @pytest.mark.parametrize("device", DEVICES)
    def test_norm_input_stats_(self, device):
        g = gen(24)
        x = randn(g, 3, 4, 2, 3, device=device).requires_grad_(True)
        stat = stat_like(g, 3, torch.float32, device)
        want = reference_stat(ref.norm_input_stats_, stat, x.detach())
        ops.norm_input_stats_(stat, x)
        assert_close(stat, want, RTOL[torch.float32])

    @pytest.mark.parametrize("device", DEVICES)
    def test_norm_grad_stats_(self, device):
        g = gen(25)
        grad = randn(g, 3, 4, 2, 3, device=device)
        stat = stat_like(g, 7, torch.float32, device)
        want = reference_stat(ref.norm_grad_stats_, stat, grad, 2, 4)
        ops.norm_grad_stats_(stat, grad, 2, 4, step=torch.tensor(0.0, device=device), interval=7)
        assert_close(stat, want, RTOL[torch.float32])

    @pytest.mark.parametrize("device", DEVICES)
    def test_norm_grad_stats_workspace(self, device):
        g = gen(27)
        grad = randn(g, 3, 4, 2, 3, device=device)
        stat = stat_like(g, 5, torch.float32, device)
        workspace = torch.zeros(ops.statistics_workspace_numel(4), device=device)
        want = reference_stat(ref.norm_grad_stats_, stat, grad, 1, 2)
        ops.norm_grad_stats_(stat, grad, 1, 2, workspace=workspace)
        assert_close(stat, want, RTOL[torch.float32])

    @pytest.mark.parametrize("device", DEVICES)
    def test_fisher_average_(self, device):
        factors, stats, grad_side = average_case(device, torch.float32, seed=26)
        skipped = torch.tensor(0.0, device=device)
        want_f, want_s, want_skipped = copy.deepcopy((factors, stats, skipped))
        scale = torch.tensor(2.0, device=device)
        ref.fisher_average_(want_f, want_s, want_skipped, 0.8, grad_side, scale)
        ops.fisher_average_(factors, stats, skipped, 0.8, grad_side, scale)
        for got, want in zip(factors + stats + [skipped], want_f + want_s + [want_skipped]):
            assert_close(got, want, RTOL[torch.float32])


generate_opcheck_tests(
    TestOps, ["cafin"], failures_dict_path=str(Path(__file__).with_name("failures_dict.json")),
    additional_decorators={},
    test_utils=["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"])
