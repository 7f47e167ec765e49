"""Every reading path of the fused statistics kernels against the reference: strided views
(channels_last, slices, transposes, expanded inputs), partial sums folded over many batch entries,
tiles split over threads, Conv2d planes large and small, windows that exclude few or many taps,
overflowed squares, and bf16/fp16 inputs. tests/test_ops.py holds the per-op basics and opcheck."""
from __future__ import annotations

import pytest
import torch

from cafin import ops
from cafin import reference as ref

from devices import DEVICES
from test_ops import RTOL, assert_close, gen, randn, reference_stat, stat_like

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


def test_thread_count_changes_only_rounding():
    """Threads split the work in chunks fixed by the sizes and the thread count: results agree
    across thread counts to rounding, and repeat bit for bit at one count."""
    g = gen(25)
    x = randn(g, 24, 48, 40, 40)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            stat = torch.zeros(48 * 9 + 1)
            ops.conv2d_input_stats_(stat, x, [3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1, False)
            grad = torch.zeros(49)
            ops.sumsq_stats_(grad, x, 1, 2, False)
            results.append(torch.cat([stat, grad]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[2])
    assert_close(results[1], results[0], RTOL[torch.float32])
