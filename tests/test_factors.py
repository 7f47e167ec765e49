"""Dense Kronecker statistics (cafin.factors) against an explicit unfold written here by index
arithmetic, in float64, on awkward convolutions; and the rows against autograd's own weight
gradients (dW_q = g_q^T abar_q), which pins the patch order and the grouping independently."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cafin import factors

D = torch.float64


def explicit_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """[groups, B*oh*ow, C/g*kh*kw] by slicing the padded input tap by tap."""
    if x.dim() == 3:
        x = x.unsqueeze(0)
    kh, kw = conv.kernel_size
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    if conv.padding == "same":
        pads = []
        for d, k in ((dh, kh), (dw, kw)):
            t = d * (k - 1)
            pads.append((t // 2, t - t // 2))
    elif conv.padding == "valid":
        pads = [(0, 0), (0, 0)]
    else:
        pads = [(conv.padding[0],) * 2, (conv.padding[1],) * 2]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, [pads[1][0], pads[1][1], pads[0][0], pads[0][1]], mode=mode)
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    taps = torch.empty(x.shape[0], x.shape[1], kh, kw, oh, ow, dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            taps[:, :, i, j] = xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh,
                                  j * dw: j * dw + sw * (ow - 1) + 1: sw]
    g = conv.groups
    cg = x.shape[1] // g
    out = []
    for q in range(g):
        block = taps[:, q * cg:(q + 1) * cg]  # [B, cg, kh, kw, oh, ow]
        out.append(block.permute(0, 4, 5, 1, 2, 3).reshape(-1, cg * kh * kw))
    return torch.stack(out)


def with_ones(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    if not bias:
        return rows
    return torch.cat([rows, torch.ones(*rows.shape[:-1], 1, dtype=rows.dtype)], dim=-1)


CONVS = [
    dict(in_channels=3, out_channels=5, kernel_size=3, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=(3, 2), stride=(2, 1), padding=(2, 0), bias=False),
    dict(in_channels=6, out_channels=4, kernel_size=3, dilation=2, groups=2, padding=2),
    dict(in_channels=4, out_channels=4, kernel_size=3, groups=4, stride=2),  # depthwise
    dict(in_channels=3, out_channels=2, kernel_size=4, padding="same", dilation=(1, 2)),  # asymmetric
    dict(in_channels=3, out_channels=3, kernel_size=3, padding="valid", stride=3),
    dict(in_channels=2, out_channels=3, kernel_size=3, padding=1, padding_mode="reflect"),
    dict(in_channels=2, out_channels=4, kernel_size=(2, 3), padding=(1, 2), padding_mode="circular", groups=2),
    dict(in_channels=2, out_channels=3, kernel_size=3, padding=1, padding_mode="replicate", stride=2),
]


@pytest.mark.parametrize("spec", CONVS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_conv2d_rows_and_covariances(spec):
    torch.manual_seed(0)
    conv = nn.Conv2d(**spec).to(D)
    x = torch.randn(3, spec["in_channels"], 9, 8, dtype=D)
    x = x.transpose(2, 3).contiguous().transpose(2, 3)  # non-contiguous layout
    bias = conv.bias is not None
    expected = explicit_patches(conv, x)
    torch.testing.assert_close(factors.input_rows(conv, x), expected, rtol=0, atol=0)
    abar = with_ones(expected, bias)
    cov = abar.transpose(1, 2) @ abar
    # tiny chunks: every sample its own unfold
    got = factors.input_covariance(conv, x, scale=0.5, chunk_bytes=1)
    torch.testing.assert_close(got, 0.5 * cov, rtol=1e-13, atol=1e-13)
    # accumulate into an existing buffer
    out = torch.randn_like(cov)
    before = out.clone()
    factors.input_covariance(conv, x, out=out, accumulate=True)
    torch.testing.assert_close(out, before + cov, rtol=1e-13, atol=1e-12)
    # the weight gradient autograd computes is sum_n g abar^T, per group
    y = conv(x.requires_grad_())
    go = torch.randn_like(y)
    y.backward(go)
    g_rows = factors.grad_rows(conv, go)
    dW = g_rows.transpose(1, 2) @ abar
    torch.testing.assert_close(factors.grad_matrix(conv, conv.weight.grad, conv.bias.grad if bias else None),
                               dW, rtol=1e-12, atol=1e-12)
    gcov = factors.grad_covariance(conv, go, scale=2.0)
    torch.testing.assert_close(gcov, 2.0 * g_rows.transpose(1, 2) @ g_rows, rtol=1e-13, atol=1e-12)
    assert factors.factor_sizes(conv) == (conv.groups, expected.shape[2] + bias, spec["out_channels"] // conv.groups)


def test_conv2d_unbatched_input():
    conv = nn.Conv2d(2, 3, 3, padding=1).to(D)
    x = torch.randn(2, 5, 6, dtype=D)
    torch.testing.assert_close(factors.input_covariance(conv, x),
                               factors.input_covariance(conv, x.unsqueeze(0)), rtol=0, atol=0)
    y = conv(x)
    torch.testing.assert_close(factors.grad_covariance(conv, torch.ones_like(y)),
                               factors.grad_covariance(conv, torch.ones(1, *y.shape, dtype=D)))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7,), (2, 3, 5)])
def test_linear_any_leading_dims(bias, shape):
    torch.manual_seed(1)
    lin = nn.Linear(6, 4, bias=bias).to(D)
    x = torch.randn(*shape, 6, dtype=D)
    rows = x.reshape(-1, 6)
    abar = with_ones(rows, bias)
    torch.testing.assert_close(factors.input_covariance(lin, x, scale=1 / 3)[0],
                               abar.T @ abar / 3, rtol=1e-13, atol=1e-13)
    g = torch.randn(*shape, 4, dtype=D)
    torch.testing.assert_close(factors.grad_covariance(lin, g)[0], g.reshape(-1, 4).T @ g.reshape(-1, 4),
                               rtol=1e-13, atol=1e-13)
    y = lin(x.requires_grad_())
    y.backward(g)
    dW = factors.grad_rows(lin, g).transpose(1, 2) @ abar.unsqueeze(0)
    torch.testing.assert_close(factors.grad_matrix(lin, lin.weight.grad, lin.bias.grad if bias else None), dW)


def test_kfac_pytorch_normalisation():
    """kfac-pytorch's convention: rows (with the ones) / L, second moment over N = B*L rows."""
    torch.manual_seed(2)
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1).to(D)
    x = torch.randn(5, 3, 7, 7, dtype=D)
    abar = with_ones(explicit_patches(conv, x), True)[0]
    y = conv(x)
    L = y.shape[2] * y.shape[3]
    n = abar.shape[0]
    a = abar / L
    torch.testing.assert_close(factors.kfac_input_factor(conv, x)[0], a.T @ a / n, rtol=1e-13, atol=1e-15)
    go = torch.randn_like(y)
    gr = go.permute(0, 2, 3, 1).reshape(-1, 4) / L
    torch.testing.assert_close(factors.kfac_grad_factor(conv, go)[0], gr.T @ gr / n, rtol=1e-13, atol=1e-15)
    lin = nn.Linear(3, 2).to(D)
    xl = torch.randn(4, 5, 3, dtype=D)
    al = with_ones(xl.reshape(-1, 3), True)
    torch.testing.assert_close(factors.kfac_input_factor(lin, xl)[0], al.T @ al / 20, rtol=1e-13, atol=1e-15)


def test_write_grad_matrix_round_trip():
    conv = nn.Conv2d(4, 6, 3, groups=2).to(D)
    w, b = torch.randn_like(conv.weight), torch.randn(6, dtype=D)
    m = factors.grad_matrix(conv, w, b)
    w2, b2 = torch.zeros_like(w), torch.zeros_like(b)
    factors.write_grad_matrix(conv, m, w2, b2)
    assert torch.equal(w, w2) and torch.equal(b, b2)


def test_low_precision_input_accumulates_in_out_dtype():
    conv = nn.Conv2d(3, 2, 3, padding=1)
    x = torch.randn(2, 3, 6, 6).to(torch.bfloat16)
    got = factors.input_covariance(conv, x, dtype=torch.float32)
    ref = factors.input_covariance(conv, x.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
