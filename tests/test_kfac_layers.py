"""K-FAC's layers beyond Linear and Conv2d: Embedding (diagonal A), transformers' `Conv1D` (a Linear
with a transposed weight), Conv1d and Conv3d, and the "reduce" approximation.

Every factor is checked against an oracle written here naively in float64 (explicit one-hot rows,
explicit per-sample patches sliced tap by tap, explicit per-sample means and sums), the rows
against autograd's own weight gradients, and the preconditioned gradient against a dense solve
with the explicit Kronecker product of the factors."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cafin
from cafin import factors
from stand_ins import Conv1D

D = torch.float64


# ------------------------------------------------------------------------------ oracles
def explicit_pads(conv) -> list[tuple[int, int]]:
    """(before, after) zero padding per spatial dim, torch's 'same' rule spelled out."""
    if conv.padding == "same":
        out = []
        for d, k in zip(conv.dilation, conv.kernel_size):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return out
    if conv.padding == "valid":
        return [(0, 0)] * len(conv.kernel_size)
    return [(p, p) for p in conv.padding]


def explicit_patches(conv, x: torch.Tensor) -> torch.Tensor:
    """[groups, B*L, C/g*prod(k)] of any Conv1d/2d/3d by slicing the padded input tap by tap;
    entry order (c, k_1, ..., k_n), row order (b, o_1, ..., o_n)."""
    n = len(conv.kernel_size)
    if x.dim() == n + 1:
        x = x.unsqueeze(0)
    pads = explicit_pads(conv)
    flat = [p for pair in reversed(pads) for p in pair]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, flat, mode=mode)
    outs = [(xp.shape[2 + i] - conv.dilation[i] * (k - 1) - 1) // conv.stride[i] + 1
            for i, k in enumerate(conv.kernel_size)]
    taps = torch.empty(x.shape[0], x.shape[1], *conv.kernel_size, *outs, dtype=x.dtype)
    for tap in itertools.product(*[range(k) for k in conv.kernel_size]):
        index = [slice(None), slice(None)]
        for i, t in enumerate(tap):
            start = t * conv.dilation[i]
            index.append(slice(start, start + conv.stride[i] * (outs[i] - 1) + 1, conv.stride[i]))
        taps[(slice(None), slice(None)) + tap] = xp[tuple(index)]
    g = conv.groups
    cg = x.shape[1] // g
    rows = []
    for q in range(g):
        block = taps[:, q * cg:(q + 1) * cg]  # [B, cg, k..., o...]
        perm = [0, *range(2 + n, 2 + 2 * n), 1, *range(2, 2 + n)]
        rows.append(block.permute(*perm).reshape(-1, cg * math.prod(conv.kernel_size)))
    return torch.stack(rows)


def explicit_grad_rows(conv, g: torch.Tensor) -> torch.Tensor:
    n = len(conv.kernel_size)
    if g.dim() == n + 1:
        g = g.unsqueeze(0)
    c = g.shape[1]
    rows = g.permute(0, *range(2, 2 + n), 1).reshape(-1, c)
    return torch.stack(rows.split(c // conv.groups, dim=1))


def with_ones(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    if not bias:
        return rows
    return torch.cat([rows, torch.ones(*rows.shape[:-1], 1, dtype=rows.dtype)], dim=-1)


def one_hot_rows(emb: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """[N, vocab] one-hot rows built entry by entry; padding_idx's column is zero (its row of the
    weight gets no gradient)."""
    idx = x.reshape(-1).tolist()
    rows = torch.zeros(len(idx), emb.num_embeddings, dtype=D)
    for n, i in enumerate(idx):
        if i != emb.padding_idx:
            rows[n, i] = 1.0
    return rows


def output_grad(module, x):
    """A random output gradient, and the layer's weight/bias gradients it gives."""
    module.zero_grad()
    y = module(x)
    g = torch.randn_like(y)
    y.backward(g)
    return g


# ------------------------------------------------------------------------------ Conv1d / Conv3d
CONV1D = [
    dict(in_channels=3, out_channels=5, kernel_size=3, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=2, stride=2, bias=False),
    dict(in_channels=6, out_channels=4, kernel_size=3, dilation=2, groups=2, padding="same"),
    dict(in_channels=3, out_channels=2, kernel_size=4, padding="same"),  # asymmetric: odd total
    dict(in_channels=4, out_channels=4, kernel_size=3, groups=4, stride=3, padding="valid"),
    dict(in_channels=2, out_channels=3, kernel_size=3, padding=2, padding_mode="reflect"),
    dict(in_channels=2, out_channels=4, kernel_size=3, padding=1, padding_mode="circular", groups=2),
    dict(in_channels=2, out_channels=3, kernel_size=2, padding=1, padding_mode="replicate", dilation=3),
]
CONV3D = [
    dict(in_channels=2, out_channels=3, kernel_size=3, padding=1),
    dict(in_channels=4, out_channels=2, kernel_size=(2, 3, 1), stride=(2, 1, 2), padding=(1, 0, 2), bias=False),
    dict(in_channels=4, out_channels=6, kernel_size=2, dilation=(1, 2, 1), groups=2, padding="same"),
    dict(in_channels=2, out_channels=2, kernel_size=(1, 2, 3), padding=(0, 1, 1), padding_mode="replicate"),
    dict(in_channels=3, out_channels=3, kernel_size=2, padding=1, padding_mode="circular", groups=3, stride=2),
    dict(in_channels=2, out_channels=2, kernel_size=3, padding="valid", padding_mode="reflect"),
]
CONV2D = dict(in_channels=4, out_channels=6, kernel_size=(2, 3), dilation=(2, 1), groups=2, padding=1, stride=(1, 2))
SPATIAL = {nn.Conv1d: (11,), nn.Conv2d: (7, 6), nn.Conv3d: (5, 6, 4)}
CASES = [(nn.Conv1d, s) for s in CONV1D] + [(nn.Conv3d, s) for s in CONV3D]


def _case_id(case):
    cls, spec = case
    return cls.__name__ + "-" + "-".join(f"{k}{v}" for k, v in spec.items())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("unbatched", [False, True])
def test_conv_rows_and_factors_against_explicit_patches(case, unbatched):
    cls, spec = case
    torch.manual_seed(0)
    conv = cls(**spec).to(D)
    shape = ((3,) if not unbatched else ()) + (spec["in_channels"],) + SPATIAL[cls]
    x = torch.randn(*reversed(shape), dtype=D).permute(*reversed(range(len(shape))))  # non-contiguous
    assert not x.is_contiguous()
    bias = conv.bias is not None
    patches = explicit_patches(conv, x)
    torch.testing.assert_close(factors.input_rows(conv, x), patches, rtol=0, atol=0)
    g = output_grad(conv, x)
    grows = explicit_grad_rows(conv, g)
    torch.testing.assert_close(factors.grad_rows(conv, g), grows, rtol=0, atol=0)
    # the rows are what autograd multiplies: dW_q = g_q^T abar_q
    abar = with_ones(patches, bias)
    dw = grows.transpose(1, 2) @ abar
    expected = factors.grad_matrix(conv, conv.weight.grad, conv.bias.grad if bias else None)
    torch.testing.assert_close(dw, expected, rtol=1e-12, atol=1e-12)
    # covariances, chunked down to one sample per unfold, accumulated onto a previous value
    cov = abar.transpose(1, 2) @ abar
    for chunk in (1, factors.CHUNK_BYTES):
        got = factors.input_covariance(conv, x, scale=0.5, chunk_bytes=chunk)
        torch.testing.assert_close(got, 0.5 * cov, rtol=1e-12, atol=1e-12)
    out = torch.ones_like(cov)
    factors.input_covariance(conv, x, out=out, accumulate=True, chunk_bytes=1)
    torch.testing.assert_close(out, cov + 1, rtol=1e-12, atol=1e-12)
    # kfac-pytorch's normalisation: sum / (L^2 N)
    n, L = patches.shape[1], factors.locations(conv, g)
    assert n == (1 if unbatched else 3) * L
    torch.testing.assert_close(factors.kfac_input_factor(conv, x), cov / (L * L * n), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(factors.kfac_grad_factor(conv, g),
                               grows.transpose(1, 2) @ grows / (L * L * n), rtol=1e-12, atol=1e-14)
    assert factors.factor_sizes(conv) == (conv.groups, abar.shape[2], grows.shape[2])


@pytest.mark.parametrize("cls", [nn.Conv1d, nn.Conv2d, nn.Conv3d])
def test_conv_reduce_against_per_sample_means_and_sums(cls):
    torch.manual_seed(1)
    spec = {nn.Conv1d: CONV1D[2], nn.Conv2d: CONV2D, nn.Conv3d: CONV3D[2]}[cls]
    conv = cls(**spec).to(D)
    B = 3
    x = torch.randn(B, spec["in_channels"], *SPATIAL[cls], dtype=D)
    g = output_grad(conv, x)
    patches = explicit_patches(conv, x)  # [groups, B*L, d]
    groups, n, d = patches.shape
    L = n // B
    mean = patches.reshape(groups, B, L, d).mean(2)
    abar = with_ones(mean, conv.bias is not None)
    A = abar.transpose(1, 2) @ abar / (L * L * B)  # the expand normaliser times L
    grows = explicit_grad_rows(conv, g)
    gsum = grows.reshape(groups, B, L, -1).sum(2)
    G = gsum.transpose(1, 2) @ gsum / (L * L * n)  # the expand normaliser
    torch.testing.assert_close(factors.kfac_input_factor(conv, x, "reduce"), A, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(factors.kfac_input_factor(conv, x, "reduce", chunk_bytes=1), A,
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(factors.kfac_grad_factor(conv, g, "reduce"), G, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------ Embedding
@pytest.mark.parametrize("padding_idx", [None, 0, -2])
@pytest.mark.parametrize("shape", [(4, 7), (9,), (2, 3, 5)], ids=["BT", "unbatched", "BxTxU"])
def test_embedding_factors_against_one_hot(padding_idx, shape):
    torch.manual_seed(0)
    emb = nn.Embedding(13, 6, padding_idx=padding_idx).to(D)
    x = torch.randint(0, 13, shape)
    if padding_idx is not None:
        x.view(-1)[::3] = emb.padding_idx  # padding tokens present
    if len(shape) == 2:
        x = x.t().contiguous().t()  # non-contiguous indices
    g = output_grad(emb, x)
    a = one_hot_rows(emb, x)
    n = a.shape[0]
    A = factors.kfac_input_factor(emb, x)
    assert A.shape == (1, 13)  # the diagonal only
    torch.testing.assert_close(torch.diag_embed(A), (a.t() @ a / n).unsqueeze(0), rtol=0, atol=1e-15)
    if padding_idx is not None:
        assert A[0, emb.padding_idx] == 0  # counted as a zero input: its weight row has no gradient
    rows = g.reshape(-1, 6)
    torch.testing.assert_close(factors.kfac_grad_factor(emb, g), (rows.t() @ rows / n).unsqueeze(0),
                               rtol=1e-12, atol=1e-14)
    # the weight gradient is (input side) x (gradient side): as a matrix [dim, vocab] = g^T a
    torch.testing.assert_close(factors.grad_matrix(emb, emb.weight.grad, None), (rows.t() @ a).unsqueeze(0),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(factors.input_rows(emb, x)[0], a, rtol=0, atol=0)
    # "reduce" leaves an Embedding expanded (its A would be a dense vocabulary-sized matrix)
    torch.testing.assert_close(factors.kfac_input_factor(emb, x, "reduce"), A, rtol=0, atol=0)
    torch.testing.assert_close(factors.kfac_grad_factor(emb, g, "reduce"), factors.kfac_grad_factor(emb, g),
                               rtol=0, atol=0)


@pytest.mark.parametrize("option", [dict(max_norm=1.0), dict(sparse=True), dict(scale_grad_by_freq=True)])
def test_embedding_options_refused_at_construction(option):
    model = nn.Sequential(nn.Embedding(10, 4, **option), nn.Linear(4, 2))
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"layer '0'.*{name}"):
        cafin.KFACPreconditioner(model)
    pre = cafin.KFACPreconditioner(model, skip_layers=["Embedding"])  # skipping it is the way out
    assert [layer.name for layer in pre.layers] == ["1"]


# ------------------------------------------------------------------------------ transformers' Conv1D
@pytest.mark.parametrize("shape", [(5, 3), (2, 4, 3), (3,)], ids=["BD", "BTD", "unbatched"])
def test_transposed_linear_is_a_linear(shape):
    torch.manual_seed(0)
    c = Conv1D(4, 3).to(D)
    lin = nn.Linear(3, 4).to(D)
    with torch.no_grad():
        lin.weight.copy_(c.weight.t())
        lin.bias.copy_(c.bias)
    x = torch.randn(*shape, dtype=D)
    g = torch.randn(*shape[:-1], 4, dtype=D)
    for m in (c, lin):
        m.zero_grad()
        m(x).backward(g)
    assert factors.supports(c) and factors.factor_sizes(c) == factors.factor_sizes(lin) == (1, 4, 4)
    for approx in ("expand", "reduce"):
        torch.testing.assert_close(factors.kfac_input_factor(c, x, approx), factors.kfac_input_factor(lin, x, approx),
                                   rtol=0, atol=0)
        torch.testing.assert_close(factors.kfac_grad_factor(c, g, approx), factors.kfac_grad_factor(lin, g, approx),
                                   rtol=0, atol=0)
    torch.testing.assert_close(factors.grad_matrix(c, c.weight.grad, c.bias.grad),
                               factors.grad_matrix(lin, lin.weight.grad, lin.bias.grad), rtol=1e-12, atol=1e-14)
    m = torch.randn(1, 4, 4, dtype=D)
    wg, bg = torch.empty_like(c.weight), torch.empty_like(c.bias)
    factors.write_grad_matrix(c, m, wg, bg)
    assert torch.equal(wg, m[0, :, :3].t()) and torch.equal(bg, m[0, :, 3])


# ------------------------------------------------------------------------------ reduce
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 4), (2, 3, 2, 4)], ids=["BTD", "BTUD"])
def test_linear_reduce_against_oracle(bias, shape):
    torch.manual_seed(2)
    lin = nn.Linear(4, 3, bias=bias).to(D)
    x = torch.randn(*shape, dtype=D)
    g = output_grad(lin, x)
    B, T = shape[0], math.prod(shape[1:-1])
    mean = with_ones(x.reshape(B, T, 4).mean(1), bias)
    total = g.reshape(B, T, 3).sum(1)
    A = mean.t() @ mean / B
    G = total.t() @ total / (B * T)
    torch.testing.assert_close(factors.kfac_input_factor(lin, x, "reduce")[0], A, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(factors.kfac_grad_factor(lin, g, "reduce")[0], G, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("module", [nn.Linear(4, 3), nn.Linear(4, 3, bias=False), Conv1D(3, 4)],
                         ids=["Linear", "Linear-nobias", "Conv1D"])
@pytest.mark.parametrize("shape", [(6, 4), (4,)], ids=["BD", "unbatched"])
def test_reduce_equals_expand_on_2d_inputs(module, shape):
    module = module.to(D)
    x = torch.randn(*shape, dtype=D)
    g = output_grad(module, x)
    for t, fn in ((x, factors.kfac_input_factor), (g, factors.kfac_grad_factor)):
        torch.testing.assert_close(fn(module, t, "reduce"), fn(module, t, "expand"), rtol=1e-14, atol=0)


def test_reduce_equals_expand_through_the_preconditioner_on_2d_inputs():
    grads = []
    for approx in ("expand", "reduce"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(D)
        pre = cafin.KFACPreconditioner(model, kfac_approx=approx, inv_dtype=D, decompose_dtype=D)
        for _ in range(2):
            model.zero_grad()
            model(torch.randn(7, 5, dtype=D)).square().sum().backward()
            pre.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert pre.kfac_approx == approx
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("value", ["sum", "Expand", None, 1])
def test_kfac_approx_checked(value):
    with pytest.raises(ValueError, match="kfac_approx"):
        cafin.KFACPreconditioner(nn.Linear(2, 2), kfac_approx=value)


# ------------------------------------------------------------------------------ preconditioned gradients
class Tiny(nn.Module):
    """Embedding -> Conv1D -> Conv1d -> Conv3d -> Linear, every new layer once."""

    def __init__(self, vocab=7, dim=4, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.proj = Conv1D(5, dim)
        self.conv1 = nn.Conv1d(5, 4, 3, padding="same", groups=1)
        self.conv3 = nn.Conv3d(2, 2, 2, padding=(1, 0, 0), bias=False)
        self.head = nn.Linear(12, 3)

    def forward(self, x):  # x [B, T=6] tokens
        h = torch.tanh(self.proj(self.emb(x)))  # [B, 6, 5]
        h = torch.tanh(self.conv1(h.transpose(1, 2)))  # [B, 4, 6]
        h = h.reshape(h.shape[0], 2, 2, 2, 3)  # [B, 2, D2, H2, W3]
        h = torch.tanh(self.conv3(h))  # [B, 2, 3, 1, 2]
        return self.head(h.flatten(1))


def oracle_factors(model: Tiny, x: torch.Tensor, approx: str = "expand"):
    """Every layer's (A, G) and gradient matrix from explicit rows, for one forward/backward with
    a fixed output gradient."""
    inputs, outputs = {}, {}
    hooks = []
    def keep(m, i, o, name):
        inputs[name] = i[0]
        o.register_hook(lambda g: outputs.__setitem__(name, g))

    for name, m in model.named_children():
        hooks.append(m.register_forward_hook(lambda m, i, o, name=name: keep(m, i, o, name)))
    model.zero_grad()
    out = model(x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=D).view_as(out))
    for h in hooks:
        h.remove()
    result = {}
    for name, m in model.named_children():
        a_in, g = inputs[name].detach(), outputs[name]
        if isinstance(m, nn.Embedding):
            a = one_hot_rows(m, a_in)
            A = a.t() @ a / a.shape[0]
            rows = g.reshape(-1, g.shape[-1])
            G = rows.t() @ rows / rows.shape[0]
            grad = m.weight.grad.t()
        elif isinstance(m, (nn.Linear, Conv1D)):
            bias = m.bias is not None
            if approx == "reduce" and a_in.dim() == 3:
                B, T = a_in.shape[:2]
                a = with_ones(a_in.mean(1), bias)
                A = a.t() @ a / B
                rows = g.sum(1)
                G = rows.t() @ rows / (B * T)
            else:
                a = with_ones(a_in.reshape(-1, a_in.shape[-1]), bias)
                A = a.t() @ a / a.shape[0]
                rows = g.reshape(-1, g.shape[-1])
                G = rows.t() @ rows / rows.shape[0]
            w = m.weight.grad if isinstance(m, nn.Linear) else m.weight.grad.t()
            grad = torch.cat([w, m.bias.grad[:, None]], 1) if bias else w
        else:
            bias = m.bias is not None
            p = explicit_patches(m, a_in)[0]
            gr = explicit_grad_rows(m, g)[0]
            n = p.shape[0]
            L = n // a_in.shape[0]
            if approx == "reduce":
                B = a_in.shape[0]
                a = with_ones(p.reshape(B, L, -1).mean(1), bias)
                A = a.t() @ a / (L * L * B)
                s = gr.reshape(B, L, -1).sum(1)
                G = s.t() @ s / (L * L * n)
            else:
                a = with_ones(p, bias)
                A = a.t() @ a / (L * L * n)
                G = gr.t() @ gr / (L * L * n)
            w = m.weight.grad.reshape(m.weight.shape[0], -1)
            grad = torch.cat([w, m.bias.grad[:, None]], 1) if bias else w
        result[name] = (A, G, grad.clone())
    return result


def kronecker_solve(A, G, grad, damping, method):
    """vec(V) = (A (x) G + damping I)^-1 vec(grad) ("eigen"), or ((A + damping I) (x) (G + damping I))^-1
    ("inverse"), with column-stacking vec (vec(G X A) = (A (x) G) vec(X) for symmetric A)."""
    eye_a, eye_g = torch.eye(A.shape[0], dtype=D), torch.eye(G.shape[0], dtype=D)
    if method == "eigen":
        K = torch.kron(A, G) + damping * torch.eye(A.shape[0] * G.shape[0], dtype=D)
    else:
        K = torch.kron(A + damping * eye_a, G + damping * eye_g)
    v = torch.linalg.solve(K, grad.t().reshape(-1))
    return v.reshape(grad.shape[1], grad.shape[0]).t()


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("prediv", [True, False])
def test_preconditioned_gradient_is_a_dense_kronecker_solve(method, approx, prediv):
    torch.manual_seed(3)
    model = Tiny(padding_idx=1).to(D)
    x = torch.randint(0, 7, (3, 6))
    x[0, :2] = 1  # padding tokens
    expected = oracle_factors(model, x, approx)
    decay, damping = 0.25, 0.03
    pre = cafin.KFACPreconditioner(model, factor_decay=decay, damping=damping, kl_clip=None, inv_dtype=D,
                                   decompose_dtype=D, compute_method=method, kfac_approx=approx,
                                   compute_eigenvalue_outer_product=prediv)
    assert [layer.name for layer in pre.layers] == ["emb", "proj", "conv1", "conv3", "head"]
    model.zero_grad()
    out = model(x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=D).view_as(out))
    pre.step()
    for name, m in model.named_children():
        A, G, grad = expected[name]
        st = pre._state[name]
        if name == "emb":
            torch.testing.assert_close(torch.diag(st.A[0]), decay * torch.eye(7, dtype=D) + (1 - decay) * A,
                                       rtol=1e-12, atol=1e-14)
        else:
            torch.testing.assert_close(st.A[0], decay * torch.eye(A.shape[0], dtype=D) + (1 - decay) * A,
                                       rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(st.G[0], decay * torch.eye(G.shape[0], dtype=D) + (1 - decay) * G,
                                   rtol=1e-12, atol=1e-14)
        A_f = decay * torch.eye(A.shape[0], dtype=D) + (1 - decay) * A
        G_f = decay * torch.eye(G.shape[0], dtype=D) + (1 - decay) * G
        v = kronecker_solve(A_f, G_f, grad, damping, method)
        got = factors.grad_matrix(m, m.weight.grad, m.bias.grad if getattr(m, "bias", None) is not None else None)
        torch.testing.assert_close(got[0], v, rtol=1e-9, atol=1e-12, msg=f"layer {name}")
    assert torch.all(model.emb.weight.grad[1] == 0)  # the padding row stays without gradient


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_fused_equals_reference(dtype, method):
    grads, states = [], []
    for backend in ("fused", "reference"):
        torch.manual_seed(4)
        model = Tiny(padding_idx=0).to(dtype)
        pre = cafin.KFACPreconditioner(model, backend=backend, compute_method=method, factor_decay=0.9,
                                       inv_dtype=dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randint(0, 7, (4, 6))).square().mean().backward()
            pre.step()
            opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        states.append(pre.state_dict())
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)
    for name in states[0]["layers"]:
        for key in ("A", "G"):
            torch.testing.assert_close(states[0]["layers"][name][key], states[1]["layers"][name][key], **tol)


def test_checkpoint_of_a_diagonal_factor():
    torch.manual_seed(5)
    model = Tiny().to(D)
    pre = cafin.KFACPreconditioner(model)
    model(torch.randint(0, 7, (2, 6))).sum().backward()
    pre.step()
    sd = pre.state_dict()
    assert sd["layers"]["emb"]["A"].shape == (7,)
    other = Tiny().to(D)
    pre2 = cafin.KFACPreconditioner(other)
    pre2.load_state_dict(sd)
    assert torch.equal(pre2._state["emb"].A, pre._state["emb"].A)
    bad = dict(sd, layers={**sd["layers"], "emb": {"A": torch.ones(7, 7, dtype=D), "G": sd["layers"]["emb"]["G"]}})
    with pytest.raises(ValueError, match="factor A of layer 'emb'"):
        pre2.load_state_dict(bad)


# ------------------------------------------------------------------------------ weight tying
class TiedLM(nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        return self.lm_head(torch.tanh(self.mid(self.wte(x))))


def test_tied_embedding_is_preconditioned_once_with_its_own_factors():
    torch.manual_seed(6)
    model = TiedLM().to(D)
    pre = cafin.KFACPreconditioner(model, kl_clip=None, factor_decay=0.5, damping=0.1, inv_dtype=D,
                                   decompose_dtype=D)
    assert [layer.name for layer in pre.layers] == ["wte", "mid"]  # the first owner takes it
    x = torch.randint(0, 11, (3, 5))
    model(x).square().mean().backward()
    grad = model.wte.weight.grad.clone()  # both uses' gradients summed by autograd
    pre.step()
    st = pre._state["wte"]
    A, G = st.A[0], st.G[0]
    v = kronecker_solve(torch.diag(A), G, grad.t(), 0.1, "eigen")
    torch.testing.assert_close(model.wte.weight.grad, v.t(), rtol=1e-9, atol=1e-12)


def test_tied_language_model_trains():
    torch.manual_seed(7)
    model = TiedLM(vocab=13, dim=8)
    pre = cafin.KFACPreconditioner(model, damping=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x = torch.randint(0, 13, (8, 6))
    y = torch.roll(x, 1, dims=1)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        pre.step()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


# ------------------------------------------------------------------------------ GPT-2
def test_gpt2_every_weight_matrix_and_the_embeddings_get_curvature_and_train():
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra")
    torch.manual_seed(8)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    pre = cafin.KFACPreconditioner(model, damping=0.01)
    names = {layer.name for layer in pre.layers}
    matrices = {n.rsplit(".", 1)[0] for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2}
    assert matrices == names  # every weight matrix (wte, wpe and every Conv1D), lm_head tied to wte
    assert "transformer.wte" in names and "lm_head" not in names
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randint(0, 101, (4, 16))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        pre.step()
        opt.step()
        losses.append(loss.item())
    for name in names:
        st = pre._state[name]
        assert st.seen and st.decomposed and torch.isfinite(st.A).all() and torch.isfinite(st.G).all()
    assert pre._state["transformer.wte"].A.shape == (1, 101)
    assert losses[-1] < losses[0], losses


# ------------------------------------------------------------------------------ two-level K-FAC
@pytest.mark.parametrize("layer", [nn.Embedding(5, 4), nn.Conv1d(4, 4, 1), nn.Conv3d(4, 4, 1)],
                         ids=["Embedding", "Conv1d", "Conv3d"])
def test_twolevel_refuses_the_layers_it_has_no_coarse_space_for(layer):
    model = nn.ModuleDict({"lin": nn.Linear(4, 4), "other": layer})
    with pytest.raises(ValueError, match="layer 'other'"):
        cafin.TwoLevelKFAC(model)
    layer.requires_grad_(False)  # frozen: not trained, not refused
    assert len(cafin.TwoLevelKFAC(model).param_groups) == 1


def test_twolevel_takes_conv1d():
    model = nn.ModuleDict({"lin": nn.Linear(4, 4), "proj": Conv1D(4, 4)})
    assert [g["layer_type"] for g in cafin.TwoLevelKFAC(model).param_groups] == ["Linear", "Conv1D"]


# ------------------------------------------------------------------------------ compiled step
@pytest.mark.parametrize("method", ["eigen"])
@pytest.mark.parametrize("decides", ["host", "device"])
def test_compiled_step_equals_eager(method, decides):
    """A compiled step with a diagonal factor in it trains as the eager step, both where the host
    count decides the folds and decompositions (torch.compile's way) and where the device does
    (a captured step's way, forced here under torch.compile)."""
    torch._dynamo.reset()
    torch.manual_seed(9)
    base = Tiny(padding_idx=0)
    batches = [torch.randint(0, 7, (4, 6)) for _ in range(5)]

    def run(compiled):
        model = Tiny(padding_idx=0)
        model.load_state_dict(base.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = cafin.KFACPreconditioner(model, compute_method=method, factor_update_steps=2, inv_update_steps=2,
                                       compute_eigenvalue_outer_product=method == "eigen")
        pre._steps.host_decides_compiled = decides == "host"
        step = torch.compile(pre.step, fullgraph=True) if compiled else pre.step
        for i, x in enumerate(batches):
            opt.zero_grad()
            model(x).square().mean().backward()
            (pre.step if i == 0 else step)()
            opt.step()
        return model, pre
    eager, _ = run(False)
    compiled, pre = run(True)
    torch._dynamo.reset()
    assert pre._steps.device_gated == (decides == "device")
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
