"""Every reading path of the fused statistics kernels against the reference: strided views
(channels_last, slices, transposes, expanded inputs), partial sums folded over many batch entries,
tiles split over threads, Conv2d planes large and small, windows that exclude few or many taps,
overflowed squares, and bf16/fp16 inputs. tests/test_ops.py holds the per-op basics and opcheck."""
from __future__ import annotations

import copy

import pytest
import torch

from cafin import ops
from cafin import reference as ref

from devices import DEVICES
from test_ops import RTOL, assert_close, gen, rand, randn, reference_stat, stat_like

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as x, stored as `kind`."""
    if kind == "contiguous":
        return x
    if kind == "channels_last":
        out = x.contiguous(memory_format=torch.channels_last)
    elif kind == "channel_slice":  # every other channel of a bigger tensor: planes apart
        big = torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:], dtype=x.dtype, device=x.device)
        big[:, ::2] = x
        out = big[:, ::2]
    elif kind == "batch_slice":  # every other batch entry
        big = torch.zeros(2 * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
        big[::2] = x
        out = big[::2]
    elif kind == "transposed":  # no view of the kernels covers it: read from a copy
        out = x.transpose(0, -1).contiguous().transpose(0, -1)
    elif kind == "expanded":  # zero batch stride: one entry repeated
        out = x[:1].expand(x.shape)
        x.copy_(out)
    else:
        raise ValueError(kind)
    assert torch.equal(out, x)
    return out


LAYOUTS = ["contiguous", "channels_last", "channel_slice", "batch_slice", "transposed", "expanded"]


def scaled_randn(g, *shape, dtype, device="cpu"):
    return randn(g, *shape, dtype=dtype, device=device) * (300 if dtype == torch.float16 else 1)


# (id, shape): big planes (differences of row/column sums), small planes (direct sums), batches
# that are not a multiple of the 8-entry blocks and more than the 16 terms of a partial sum,
# blocks beyond one tile of 32K positions (several tiles, threads).
CONV_SHAPES = [
    ("plane-33x35-batch19", (19, 3, 33, 35)),
    ("plane-8x8-batch3", (3, 5, 8, 8)),
    ("plane-4x4-batch17", (17, 6, 4, 4)),
    ("plane-1x9", (5, 2, 1, 9)),
    ("tiles", (3, 40, 30, 31)),
]

# (id, kernel, stride, padding [t, b, l, r], dilation, groups)
CONV_GEOMETRIES = [
    ("3x3-s1-p1", (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    ("3x3-s2-p1", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1),
    ("5x3-s3x2-asym", (5, 3), (3, 2), (2, 0, 1, 3), (1, 1), 1),
    ("3x3-dil3-pad3-groups", (3, 3), (1, 2), (3, 3, 3, 3), (3, 2), "all"),
    ("valid-big-kernel", (7, 6), (1, 1), (0, 0, 0, 0), (1, 1), 1),
    ("big-padding", (3, 3), (1, 1), (6, 5, 4, 7), (1, 1), 1),
    ("1x1-s2", (1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1),
]


def fits(shape, kernel, padding, dilation, stride):
    oh = (shape[2] + padding[0] + padding[1] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (shape[3] + padding[2] + padding[3] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    return oh >= 1 and ow >= 1


CONV_PATHS = [pytest.param(s, c, id=f"{s[0]}-{c[0]}") for s in CONV_SHAPES for c in CONV_GEOMETRIES
              if fits(s[1], c[1], c[3], c[4], c[2])]


@pytest.mark.parametrize("shape,geometry", CONV_PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_conv2d_input_paths(dtype, shape, geometry):
    _, shape = shape
    _, kernel, stride, padding, dilation, groups = geometry
    groups = shape[1] if groups == "all" else groups
    g = gen(21)
    x = randn(g, *shape, dtype=dtype)
    d = shape[1] // groups * kernel[0] * kernel[1]
    stat = stat_like(g, d + 2, ops.state_dtype(dtype), "cpu")
    args = (list(kernel), list(stride), list(padding), list(dilation), groups, True)
    want = reference_stat(ref.conv2d_input_stats_, stat, x, *args)
    ops.conv2d_input_stats_(stat, x, *args)
    assert_close(stat, want, RTOL[stat.dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv2d_input_layouts(device, dtype, kind):
    g = gen(22)
    for shape in [(18, 6, 11, 9), (5, 4, 3, 5)]:
        x = layout(scaled_randn(g, *shape, dtype=dtype, device=device), kind)
        stat = stat_like(g, shape[1] // 2 * 3 * 3 + 2, ops.state_dtype(dtype), device)
        args = ([3, 3], [2, 1], [1, 2, 0, 1], [1, 2], 2, True)
        want = reference_stat(ref.conv2d_input_stats_, stat, x, *args)
        ops.conv2d_input_stats_(stat, x, *args)
        assert_close(stat, want, RTOL[stat.dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plane", [(12, 12), (3, 3)], ids=["differences", "direct"])
def test_conv2d_input_overflowed_squares(device, plane):
    """A bf16 value whose square overflows float32 gives +inf where the reference does, never NaN
    from a difference of sums."""
    g = gen(23)
    x = randn(g, 2, 3, *plane, dtype=torch.bfloat16, device=device)
    x[1, 2, 1, 1] = 1e30
    stat = stat_like(g, 3 * 9 + 1, torch.float32, device)
    args = ([3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1, False)
    want = stat.clone()
    ref.conv2d_input_stats_(want, x, *args)
    ops.conv2d_input_stats_(stat, x, *args)
    assert torch.isinf(want).any() and not torch.isnan(stat).any()
    assert torch.equal(torch.isinf(stat), torch.isinf(want))
    finite = torch.isfinite(want)
    assert_close(stat[finite], want[finite], RTOL[torch.float32])


# (id, shape, start_dim, end_dim): channels innermost, runs shorter than 64 (read as blocks), runs
# folded every few rows (81 = 5 vectors + 1), long runs (a fold per 16 vectors), blocks past a tile.
CHANNEL_CASES = [
    ("linear-rows-37", (37, 29), 1, 2),
    ("linear-3d", (5, 41, 19), 2, 3),
    ("conv-grad-short-runs", (19, 7, 3, 5), 1, 2),
    ("conv-grad-mid-runs", (11, 13, 9, 9), 1, 2),
    ("conv-grad-long-runs", (3, 5, 33, 40), 1, 2),
    ("conv-grad-tiles", (9, 70, 23, 24), 1, 2),
    ("layernorm-dims", (3, 4, 6, 5), 2, 4),
]


CHANNEL_PATHS = [pytest.param(c, k, id=f"{c[0]}-{k}") for c in CHANNEL_CASES for k in LAYOUTS
                 if len(c[1]) == 4 or k not in ("channels_last", "channel_slice")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,kind", CHANNEL_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channel_statistics_layouts(device, dtype, case, kind):
    _, shape, start, end = case
    g = gen(24)
    x = layout(scaled_randn(g, *shape, dtype=dtype, device=device), kind)
    channels = torch.Size(shape[start:end]).numel()
    state = ops.state_dtype(dtype)

    stat = stat_like(g, channels + 2, state, device)
    want = reference_stat(ref.sumsq_stats_, stat, x, start, end, True)
    ops.sumsq_stats_(stat, x, start, end, True)
    assert_close(stat, want, RTOL[state])

    y = x + 0.5 if kind != "expanded" else x  # sums well away from zero
    stat = stat_like(g, channels + 1, state, device)
    want = reference_stat(ref.norm_grad_stats_, stat, y, start, end)
    ops.norm_grad_stats_(stat, y, start, end)
    assert_close(stat, want, RTOL[state])

    stat = stat_like(g, 3, state, device)
    want = reference_stat(ref.norm_input_stats_, stat, y)
    ops.norm_input_stats_(stat, y)
    assert_close(stat, want, RTOL[state])


# (id, shape, layout) of inputs big enough that two threads split each reading path: long runs
# (32x32 maps), runs folded every row (16x16) and every few rows (8x8), blocks of positions (4x4),
# channels innermost (channels_last), rows of a Linear, Conv2d planes large and small.
THREAD_INPUTS = [
    ("maps-32x32", (24, 40, 32, 32), "contiguous"),
    ("maps-16x16", (32, 64, 16, 16), "contiguous"),
    ("maps-8x8", (32, 128, 8, 8), "contiguous"),
    ("maps-4x4", (32, 256, 4, 4), "contiguous"),
    ("channels-last-8x8", (32, 128, 8, 8), "channels_last"),
    ("batch-slice-16x16", (32, 48, 16, 16), "batch_slice"),
]


def _every_statistic(x: torch.Tensor) -> torch.Tensor:
    """Every statistic op on x (and the Conv2d input statistic of two geometries), concatenated."""
    state = ops.state_dtype(x.dtype)
    channels = x.shape[1]
    out = []
    for stride in (1, 2):
        stat = torch.zeros(channels * 9 + 2, dtype=state)
        ops.conv2d_input_stats_(stat, x, [3, 3], [stride, stride], [1, 1, 1, 1], [1, 1], 1, True)
        out.append(stat)
    stat = torch.zeros(channels + 1, dtype=state)
    ops.sumsq_stats_(stat, x, 1, 2, False)
    out.append(stat)
    stat = torch.zeros(channels + 1, dtype=state)
    ops.norm_grad_stats_(stat, x + 0.5, 1, 2)
    out.append(stat)
    stat = torch.zeros(3, dtype=state)
    ops.norm_input_stats_(stat, x + 0.5)
    out.append(stat)
    rows = x.reshape(-1, x.shape[-1] * x.shape[-2])  # a Linear's [N, features]
    stat = torch.zeros(rows.shape[1] + 2, dtype=state)
    ops.sumsq_stats_(stat, rows, 1, 2, True)
    out.append(stat)
    return torch.cat(out)


def _at_thread_counts(fn, counts):
    threads = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", THREAD_INPUTS, ids=[c[0] for c in THREAD_INPUTS])
def test_statistics_repeat_bit_for_bit_and_agree_across_thread_counts(case, dtype):
    """Threads split the reductions in chunks fixed by the sizes and the thread count, never by
    scheduling: at one thread count a result repeats bit for bit; across thread counts only the
    summation order changes, within the tolerances against the float64 reference."""
    _, shape, kind = case
    x = layout(randn(gen(25), *shape, dtype=dtype), kind)
    one, two, one_again, two_again = _at_thread_counts(lambda: _every_statistic(x), (1, 2, 1, 2))
    assert torch.equal(one, one_again)
    assert torch.equal(two, two_again)
    assert_close(two, one, RTOL[dtype])
    assert not torch.equal(one, torch.zeros_like(one))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fisher_average_same_at_every_thread_count(dtype):
    """fisher_average_ folds each statistic whole on one thread, the statistics split over threads
    by their lengths: the factors are bit for bit the same at 1 and 2 threads, NaN drops (one in
    each half) and empty counts included."""
    g = gen(26)
    lengths = [1 + (97 * i) % 4000 for i in range(60)]
    factors = [0.05 + rand(g, k, dtype=dtype) for k in lengths]
    stats = [rand(g, k + 1, dtype=dtype) for k in lengths]
    for i, (factor, stat) in enumerate(zip(factors, stats)):
        if i % 5 == 1:
            factor.fill_(-1.0)
        stat[-1] = float(i % 4)
    for i in (6, 55):
        stats[i][lengths[i] // 2] = float("nan")
    grad_side = [i % 3 == 0 for i in range(len(lengths))]

    def fold():
        f, st = copy.deepcopy((factors, stats))
        skipped = torch.zeros(())
        ops.fisher_average_(f, st, skipped, 0.8, grad_side, torch.tensor(4.0))
        return torch.cat(f), skipped

    (one, one_skipped), (two, two_skipped) = _at_thread_counts(fold, (1, 2))
    want_f, want_s, want_skipped = copy.deepcopy((factors, stats, torch.zeros(())))
    ref.fisher_average_(want_f, want_s, want_skipped, 0.8, grad_side, torch.tensor(4.0))
    assert torch.equal(one, two)
    assert one_skipped.item() == two_skipped.item() == want_skipped.item() == 2.0
    assert_close(one, torch.cat(want_f), RTOL[dtype])
