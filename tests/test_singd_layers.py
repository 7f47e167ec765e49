"""cafin.SINGD on the layers a transformer has beyond singd's Linear and Conv2d: transformers'
Conv1D, Conv1d, Conv3d and Embedding.

singd itself has no numbers for these layers, so each is checked against an equivalent model made
of layers whose SINGD numbers are tested elsewhere (tests/test_singd.py): Conv1D against Linear
with the transposed weight, Conv1d with kernel 1 against Linear over channels, Conv1d against
Conv2d with unit height, Conv3d against Linear on explicit patches (cut by torch's own
convolution with an identity kernel) and against Conv2d with unit depth, Embedding against Linear
on explicit one-hot inputs with a diagonal input structure. float64 first, then float32, and fused
against reference.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cafin
from stand_ins import Conv1D

STEPS = 4
SETTINGS = dict(lr=0.05, lr_cov=0.1, T=1, damping=1e-3, momentum=0.9)
SUMMED = dict(lr=1e-3, lr_cov=1e-3)  # a summed loss (loss_average None): larger curvature


# ------------------------------------------------------------------------------ helpers
class Transposed(nn.Module):
    """Runs a module on channels-last input: [B, C, L] -> module([B, L, C]) -> [B, O, L]."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x.transpose(1, 2)).transpose(1, 2)


class Unsqueezed(nn.Module):
    """A unit dim inserted before the spatial dims and removed after: Conv1d as Conv2d with
    height 1, Conv2d as Conv3d with depth 1."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x.unsqueeze(2)).squeeze(2)


def identity_patches(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[B, locations, C * prod(kernel)] cut by torch's own convolution with the geometry of
    `conv` (stride, padding, its mode, dilation) and an identity kernel: output channel c * P + j
    is input channel c at kernel position j, the order of `weight[o].flatten()`."""
    C, P = conv.in_channels, conv.weight[0, 0].numel()
    cls = type(conv)
    eye = cls(C, C * P, conv.kernel_size, stride=conv.stride, padding=conv.padding,
              dilation=conv.dilation, groups=C, bias=False, padding_mode=conv.padding_mode)
    with torch.no_grad():
        eye.weight.zero_()
        eye.weight.view(C, P, P).copy_(torch.eye(P).expand(C, P, P))
    eye = eye.to(x.dtype)
    return eye(x).flatten(2).transpose(1, 2)


class PatchLinear(nn.Module):
    """A ConvNd (groups 1) as a Linear on its explicit patches."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.geometry = [conv]  # kept out of the module tree: not a layer of this model
        self.linear = nn.Linear(conv.weight[0].numel(), conv.out_channels, bias=conv.bias is not None)
        with torch.no_grad():
            self.linear.weight.copy_(conv.weight.reshape(conv.out_channels, -1))
            if conv.bias is not None:
                self.linear.bias.copy_(conv.bias)

    def forward(self, x):
        conv = self.geometry[0]
        with torch.no_grad():
            shape = conv(x).shape  # the output locations
        y = self.linear(identity_patches(conv, x))  # [B, L, O]
        return y.transpose(1, 2).reshape(shape)


class OneHot(nn.Module):
    """Indices -> one-hot rows, padding_idx -> the zero row."""

    def __init__(self, V: int, padding_idx: int | None = None):
        super().__init__()
        self.V, self.padding_idx = V, padding_idx
        self.register_buffer("like", torch.zeros(()))  # follows the model's dtype

    def forward(self, x):
        h = F.one_hot(x, self.V).to(self.like.dtype)
        if self.padding_idx is not None:
            h[..., self.padding_idx] = 0.0
        return h


def singd(model, groups=None, backend="fused", **kw):
    settings = {**SETTINGS, **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if groups is None:
            return cafin.SINGD(model, backend=backend, **settings)
        params = [dict(params=list(m.parameters()), **g) for m, g in groups]
        return cafin.SINGD(model, params, backend=backend, **settings)


def train(model, opt, batches, loss_fn):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def mse(reduction):
    return lambda out, y: F.mse_loss(out, y, reduction=reduction)


def reduction(loss_average):
    return "sum" if loss_average is None else "mean"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def moved(opt, layer_index=0):
    """How far a layer's K and C have moved from the identity (the curvature was used)."""
    layer = opt._curvature[layer_index]
    out = []
    for kind, key in zip(opt._kinds(layer), ("K", "C")):
        m = kind.dense(opt._parts(layer, key))
        out.append((m - torch.eye(m.shape[0], dtype=m.dtype)).abs().max().item())
    return min(out)


def batches(shape, out_shape, n=STEPS, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype),
             torch.randn(*out_shape, generator=gen, dtype=torch.float64).to(dtype)) for _ in range(n)]


# ------------------------------------------------------------------------------ Conv1D
def conv1d_pair(bias):
    torch.manual_seed(0)
    a = nn.Sequential(Conv1D(40, 7, bias=bias), nn.Tanh(), Conv1D(3, 40, bias=True))
    b = nn.Sequential(nn.Linear(7, 40, bias=bias), nn.Tanh(), nn.Linear(40, 3))
    with torch.no_grad():
        for ca, lb in ((a[0], b[0]), (a[2], b[2])):
            lb.weight.copy_(ca.weight.T)
            if ca.bias is not None:
                lb.bias.copy_(ca.bias)
    return a.double(), b.double()


@pytest.mark.parametrize("structures", [("dense", "dense"), ("diagonal", "hierarchical15_15"),
                                        ("block30diagonal", "triltoeplitz"),
                                        ("diagonal", "diagonal")])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kfac_approx,loss_average", [("expand", "batch"), ("reduce", "batch"),
                                                      ("expand", "batch+sequence"), ("expand", None)])
def test_transformers_conv1d_equals_linear_with_transposed_weight(structures, bias, kfac_approx,
                                                                  loss_average):
    a, b = conv1d_pair(bias)
    data = batches((4, 5, 7), (4, 5, 3))
    kw = dict(structures=structures, kfac_approx=kfac_approx, loss_average=loss_average,
              **({} if loss_average else SUMMED))
    oa, ob = singd(a, **kw), singd(b, **kw)
    assert [type(layer.module).__name__ for layer in oa._curvature] == ["Conv1D", "Conv1D"]
    assert oa.dims(a[0]) == ob.dims(b[0]) == (7 + bias, 40)
    loss = mse(reduction(loss_average))
    la, lb = train(a, oa, data, loss), train(b, ob, data, loss)
    assert la == pytest.approx(lb, rel=1e-12)
    for ca, lb_ in ((a[0], b[0]), (a[2], b[2])):
        assert rel(ca.weight.T, lb_.weight) < 1e-12
        if ca.bias is not None:
            assert rel(ca.bias, lb_.bias) < 1e-12
    for la_, lb_ in zip(oa._curvature, ob._curvature):
        for key in ("K", "C"):
            for pa, pb in zip(oa._parts(la_, key), ob._parts(lb_, key)):
                assert rel(pa, pb) < 1e-12
    assert moved(oa) > 1e-3


def test_conv1d_recognised_by_its_shape_contract_also_under_fsdp_class_swap():
    from cafin.core.views import is_transposed_linear

    class Mixin:
        pass

    conv = Conv1D(4, 3)
    assert is_transposed_linear(conv)
    swapped = copy.deepcopy(conv)
    swapped.__class__ = type("FSDPConv1D", (Mixin, Conv1D), {})  # what fully_shard does
    assert is_transposed_linear(swapped)
    other = copy.deepcopy(conv)
    other.__class__ = type("Projection", (nn.Module,), {"forward": Conv1D.forward})
    assert not is_transposed_linear(other)
    wrong = Conv1D(4, 3)
    wrong.nx = 5  # the weight is not [nx, nf]
    assert not is_transposed_linear(wrong)
    assert not is_transposed_linear(nn.Linear(3, 4))


def test_transformers_conv1d_float32_close_to_float64():
    a64, _ = conv1d_pair(True)
    a32 = copy.deepcopy(a64).float()
    data = batches((4, 5, 7), (4, 5, 3))
    o64, o32 = singd(a64, structures=("dense", "diagonal")), singd(a32, structures=("dense", "diagonal"))
    train(a64, o64, data, mse("mean"))
    train(a32, o32, [(x.float(), y.float()) for x, y in data], mse("mean"))
    for p, q in zip(a64.parameters(), a32.parameters()):
        assert rel(q, p) < 1e-5


# ------------------------------------------------------------------------------ Conv1d
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kfac_approx,loss_average", [("expand", "batch"), ("reduce", "batch"),
                                                      ("expand", "batch+sequence")])
def test_conv1d_kernel_one_equals_linear_over_channels(bias, kfac_approx, loss_average):
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv1d(5, 9, 1, bias=bias), nn.Tanh(), nn.Conv1d(9, 3, 1)).double()
    lin = nn.Sequential(Transposed(nn.Linear(5, 9, bias=bias)), nn.Tanh(),
                        Transposed(nn.Linear(9, 3))).double()
    with torch.no_grad():
        for c, t in ((conv[0], lin[0]), (conv[2], lin[2])):
            t.module.weight.copy_(c.weight[:, :, 0])
            if c.bias is not None:
                t.module.bias.copy_(c.bias)
    data = batches((3, 5, 11), (3, 3, 11))
    kw = dict(structures=("dense", "dense"), kfac_approx=kfac_approx, loss_average=loss_average)
    oc, ol = singd(conv, **kw), singd(lin, **kw)
    train(conv, oc, data, mse("mean"))
    train(lin, ol, data, mse("mean"))
    for c, t in ((conv[0], lin[0]), (conv[2], lin[2])):
        assert rel(c.weight[:, :, 0], t.module.weight) < 1e-12
        if c.bias is not None:
            assert rel(c.bias, t.module.bias) < 1e-12
    assert moved(oc) > 1e-3


# (in, out, kernel, stride, padding, dilation, groups, padding_mode), length
CONV1D_CASES = [
    ((4, 6, 3, 1, 1, 1, 1, "zeros"), 9),
    ((4, 6, 3, 2, 2, 2, 2, "zeros"), 13),
    ((4, 6, 4, 1, "same", 1, 1, "zeros"), 10),  # 'same' with an odd total: asymmetric
    ((4, 6, 3, 1, "same", 2, 2, "reflect"), 10),
    ((4, 4, 2, 3, "valid", 1, 4, "zeros"), 11),
    ((4, 6, 3, 1, 2, 1, 1, "circular"), 7),
    ((4, 6, 3, 2, 1, 1, 2, "replicate"), 8),
]


def conv1d_as_conv2d(spec, bias):
    cin, cout, k, s, p, d, g, mode = spec
    torch.manual_seed(0)
    c1 = nn.Conv1d(cin, cout, k, stride=s, padding=p, dilation=d, groups=g, bias=bias,
                   padding_mode=mode)
    p2 = p if isinstance(p, str) else (0, p)
    c2 = nn.Conv2d(cin, cout, (1, k), stride=(1, s), padding=p2, dilation=(1, d), groups=g,
                   bias=bias, padding_mode=mode)
    with torch.no_grad():
        c2.weight.copy_(c1.weight.unsqueeze(2))
        if bias:
            c2.bias.copy_(c1.bias)
    return c1, c2


@pytest.mark.parametrize("spec,length", CONV1D_CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_conv1d_equals_conv2d_with_unit_height(spec, length, bias, kfac_approx):
    c1, c2 = conv1d_as_conv2d(spec, bias)
    with torch.no_grad():
        out = c1(torch.zeros(1, spec[0], length)).shape
    head = nn.Linear(out[1] * out[2], 3)
    m1 = nn.Sequential(c1, nn.Tanh(), nn.Flatten(), head).double()
    m2 = nn.Sequential(Unsqueezed(c2), nn.Tanh(), nn.Flatten(), copy.deepcopy(head)).double()
    data = batches((3, spec[0], length), (3, 3))
    kw = dict(structures=("hierarchical15_15", "dense"), kfac_approx=kfac_approx)
    o1, o2 = singd(m1, **kw), singd(m2, **kw)
    train(m1, o1, data, mse("mean"))
    train(m2, o2, data, mse("mean"))
    assert rel(c1.weight, c2.weight.squeeze(2)) < 1e-12
    if bias:
        assert rel(c1.bias, c2.bias) < 1e-12
    assert rel(m1[3].weight, m2[3].weight) < 1e-12
    assert moved(o1) > 1e-3


def test_conv1d_unbatched_equals_a_batch_of_one():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv1d(3, 5, 3, padding=1), nn.Tanh(), nn.Conv1d(5, 2, 2)).double()
    u = copy.deepcopy(m)
    data = batches((1, 3, 8), (1, 2, 7))
    ob, ou = singd(m), singd(u)
    train(m, ob, data, mse("mean"))
    train(u, ou, [(x[0], y[0]) for x, y in data], mse("mean"))
    for p, q in zip(m.parameters(), u.parameters()):
        assert rel(q, p) < 1e-12


# ------------------------------------------------------------------------------ Conv3d
CONV3D_CASES = [  # (in, out, kernel, stride, padding, dilation, padding_mode), input size
    ((3, 4, 2, 1, 0, 1, "zeros"), (4, 5, 3)),
    ((3, 4, (3, 1, 2), (2, 1, 1), (1, 0, 1), (1, 1, 2), "zeros"), (5, 3, 6)),
    ((2, 3, (2, 3, 2), 1, "same", 1, "zeros"), (3, 4, 4)),  # odd totals: asymmetric
    ((2, 3, 3, 1, 1, (1, 2, 1), "reflect"), (4, 5, 3)),
    ((2, 3, 2, 2, 1, 1, "circular"), (4, 4, 5)),
    ((2, 3, 2, 1, "valid", 1, "replicate"), (3, 3, 4)),
]


@pytest.mark.parametrize("spec,size", CONV3D_CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kfac_approx,loss_average", [("expand", "batch"), ("reduce", "batch"),
                                                      ("expand", "batch+sequence")])
def test_conv3d_equals_linear_on_explicit_patches(spec, size, bias, kfac_approx, loss_average):
    cin, cout, k, s, p, d, mode = spec
    torch.manual_seed(0)
    conv = nn.Conv3d(cin, cout, k, stride=s, padding=p, dilation=d, bias=bias,
                     padding_mode=mode).double()
    patch = PatchLinear(conv).double()
    with torch.no_grad():
        out = conv(torch.zeros(1, cin, *size, dtype=torch.float64)).shape
    head = nn.Linear(out[1:].numel(), 2).double()
    mc = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), head)
    mp = nn.Sequential(patch, nn.Tanh(), nn.Flatten(), copy.deepcopy(head))
    # The patch model's geometry is a frozen copy (its weight is not trained there).
    patch.geometry = [copy.deepcopy(conv).requires_grad_(False)]
    data = batches((2, cin, *size), (2, 2))
    kw = dict(structures=("dense", "triutoeplitz"), kfac_approx=kfac_approx,
              loss_average=loss_average)
    oc, op = singd(mc, **kw), singd(mp, **kw)
    train(mc, oc, data, mse("mean"))
    train(mp, op, data, mse("mean"))
    assert rel(conv.weight.reshape(cout, -1), patch.linear.weight) < 1e-12
    if bias:
        assert rel(conv.bias, patch.linear.bias) < 1e-12
    assert rel(mc[3].weight, mp[3].weight) < 1e-12
    assert moved(oc) > 1e-3


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_conv3d_equals_conv2d_with_unit_depth(groups, bias):
    torch.manual_seed(0)
    c2 = nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=groups, bias=bias)
    c3 = nn.Conv3d(4, 6, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), groups=groups, bias=bias)
    with torch.no_grad():
        c3.weight.copy_(c2.weight.unsqueeze(2))
        if bias:
            c3.bias.copy_(c2.bias)
    head = nn.Linear(6 * 4 * 3, 2)
    m2 = nn.Sequential(c2, nn.Tanh(), nn.Flatten(), head).double()
    m3 = nn.Sequential(Unsqueezed(c3), nn.Tanh(), nn.Flatten(), copy.deepcopy(head)).double()
    data = batches((3, 4, 7, 6), (3, 2))
    o2, o3 = singd(m2), singd(m3)
    train(m2, o2, data, mse("mean"))
    train(m3, o3, data, mse("mean"))
    assert rel(c3.weight.squeeze(2), c2.weight) < 1e-12
    assert rel(m3[3].weight, m2[3].weight) < 1e-12
    assert moved(o3) > 1e-3


# ------------------------------------------------------------------------------ Embedding
V, D = 13, 6


def embedding_pair(padding_idx):
    torch.manual_seed(0)
    emb = nn.Embedding(V, D, padding_idx=padding_idx)
    lin = nn.Linear(V, D, bias=False)
    with torch.no_grad():
        lin.weight.copy_(emb.weight.T)
    head = nn.Linear(D, 3)
    me = nn.Sequential(emb, nn.Tanh(), head).double()
    ml = nn.Sequential(OneHot(V, padding_idx), lin, nn.Tanh(), copy.deepcopy(head)).double()
    return me, ml


def index_batches(shape, n=STEPS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    # Token V - 1 never appears: its row's curvature is the damping alone.
    return [(torch.randint(0, V - 1, shape, generator=gen),
             torch.randn(*shape, 3, generator=gen, dtype=torch.float64)) for _ in range(n)]


@pytest.mark.parametrize("structures", [("dense", "dense"), ("hierarchical15_15", "diagonal"),
                                        ("diagonal", "triltoeplitz"), ("diagonal", "diagonal")])
@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("kfac_approx,loss_average", [("expand", "batch"), ("reduce", "batch"),
                                                      ("expand", "batch+sequence"), ("reduce", None)])
@pytest.mark.parametrize("shape", [(4, 7), (9,)])
def test_embedding_equals_linear_on_one_hot_inputs(structures, padding_idx, kfac_approx,
                                                    loss_average, shape):
    me, ml = embedding_pair(padding_idx)
    with torch.no_grad():
        ml[1].weight.copy_(me[0].weight.T)  # the padding row is zero in both
    kw = dict(kfac_approx=kfac_approx, loss_average=loss_average,
              **({} if loss_average else SUMMED))
    # The Embedding's K is diagonal whatever `structures` says; the Linear is told so.
    oe = singd(me, [(me[0], dict(structures=structures)), (me[2], dict(structures=structures))], **kw)
    ol = singd(ml, [(ml[1], dict(structures=("diagonal", structures[1]))),
                    (ml[3], dict(structures=structures))], **kw)
    layer = oe._curvature[0]
    assert oe.dims(me[0]) == (V, D)
    assert oe._parts(layer, "K")[0].shape == (V,)  # diagonal over the vocabulary
    data = index_batches(shape)
    loss = mse(reduction(loss_average))
    le, ll = train(me, oe, data, loss), train(ml, ol, data, loss)
    assert le == pytest.approx(ll, rel=1e-12)
    assert rel(me[0].weight, ml[1].weight.T) < 1e-12
    assert rel(me[2].weight, ml[3].weight) < 1e-12
    for key in ("K", "C"):
        for pe, pl in zip(oe._parts(layer, key), ol._parts(ol._curvature[0], key)):
            assert rel(pe, pl) < 1e-12
    if padding_idx is not None:  # never trained: its gradient is zero, K scales rows alone
        assert torch.equal(me[0].weight[padding_idx], torch.zeros(D, dtype=torch.float64))
    assert moved(oe) > 1e-3


def test_embedding_float32_close_to_float64():
    me64, _ = embedding_pair(None)
    me32 = copy.deepcopy(me64).float()
    data = index_batches((4, 7))
    o64, o32 = singd(me64), singd(me32)
    train(me64, o64, data, mse("mean"))
    train(me32, o32, [(x, y.float()) for x, y in data], mse("mean"))
    for p, q in zip(me64.parameters(), me32.parameters()):
        assert rel(q, p) < 1e-5


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_embedding_int32_indices_equal_int64(kfac_approx):
    runs = []
    for dtype in (torch.int64, torch.int32):
        me, _ = embedding_pair(1)
        opt = singd(me, kfac_approx=kfac_approx)
        train(me, opt, [(x.to(dtype), y) for x, y in index_batches((4, 7))], mse("mean"))
        runs.append(me)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.equal(p, q)


@pytest.mark.parametrize("option,value", [("max_norm", 1.0), ("sparse", True),
                                          ("scale_grad_by_freq", True)])
def test_embedding_options_refused_at_construction(option, value):
    model = nn.Sequential(nn.Linear(3, 3), nn.Embedding(V, D, **{option: value}))
    with pytest.raises(ValueError, match=rf"'1'.*{option}"):
        cafin.SINGD(model)
    assert all(not m._forward_hooks for m in model.modules())  # nothing was hooked
    frozen = nn.Sequential(nn.Linear(3, 3), nn.Embedding(V, D, **{option: value}))
    cafin.SINGD(frozen, list(frozen[0].parameters()))  # not trained: not refused


class TiedLM(nn.Module):
    """An embedding and an output Linear that shares its weight (GPT-2's lm_head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.hidden = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(self.embed(x))))


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_tied_embedding_trains_and_is_updated_once(backend):
    torch.manual_seed(0)
    model = TiedLM().double()
    opt = singd(model, backend=backend, structures=("dense", "dense"), momentum=0.0, lr=0.1)
    names = [layer.name for layer in opt._curvature]
    assert names == ["embed", "hidden"]  # the first module that holds the weight owns it
    layer = opt._curvature[0]
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (6, 5), generator=gen)
    y = torch.randint(0, V, (6, 5), generator=gen)
    losses = []
    for _ in range(5):
        before = model.embed.weight.detach().clone()
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        # One natural gradient of the whole gradient (embedding and head parts), applied once:
        # K K^T grad C C^T with the factors this step wrote.
        k, c = opt._parts(layer, "K")[0], opt._parts(layer, "C")[0]
        nat = (k * k)[:, None] * (model.embed.weight.grad @ c @ c.T)
        assert rel((before - model.embed.weight) / 0.1, nat) < 1e-12
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------------ backends, dtypes
def mixed_model():
    torch.manual_seed(0)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, 4, padding_idx=0)
            self.conv1 = nn.Conv1d(4, 5, 3, padding="same", groups=1)
            self.proj = Conv1D(6, 5)
            self.conv3 = nn.Conv3d(1, 2, (2, 2, 2), padding=1, padding_mode="reflect")
            self.head = nn.Linear(6 + 2 * 7 * 3 * 3, 3)

        def forward(self, x):
            h = self.embed(x)  # [B, T, 4]
            h = torch.tanh(self.conv1(h.transpose(1, 2))).transpose(1, 2)  # [B, T, 5]
            h = torch.tanh(self.proj(h))  # [B, T, 6]
            v = torch.tanh(self.conv3(h[:, None, :, :4].reshape(h.shape[0], 1, h.shape[1], 2, 2)))
            return self.head(torch.cat([h.mean(1), v.flatten(1)], 1))

    return Mixed()


@pytest.mark.parametrize("structures", [("dense", "dense"), ("diagonal", "diagonal"),
                                        ("hierarchical15_15", "block30diagonal")])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_equals_reference_on_every_new_layer(structures, dtype, tol):
    base = mixed_model().to(dtype)
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, V, (3, 6), generator=gen), torch.randn(3, 3, generator=gen).to(dtype))
            ] * STEPS  # one batch: the loss must fall
    runs = []
    for backend in ("fused", "reference"):
        m = copy.deepcopy(base)
        opt = singd(m, backend=backend, structures=structures)
        assert [type(layer.module).__name__ for layer in opt._curvature] == [
            "Embedding", "Conv1d", "Conv1D", "Conv3d", "Linear"]
        losses = train(m, opt, data, mse("mean"))
        runs.append((m, losses))
    (mf, lf), (mr, lr_) = runs
    assert lf[-1] < lf[0]
    for p, q in zip(mf.parameters(), mr.parameters()):
        assert rel(p, q) < tol


@pytest.mark.parametrize("compiled", ["model", "step"])
def test_compiled_model_or_step_equals_eager_on_every_new_layer(compiled):
    base = mixed_model().double()
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, V, (3, 6), generator=gen), torch.randn(3, 3, generator=gen).double())
            for _ in range(3)]
    runs = []
    for compile_it in (False, True):
        m = copy.deepcopy(base)
        opt = singd(m, T=2)
        net = torch.compile(m, backend="aot_eager") if compile_it and compiled == "model" else m
        step = torch.compile(opt.step, fullgraph=True, backend="aot_eager") \
            if compile_it and compiled == "step" else opt.step
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            step()
        runs.append(m)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert rel(q, p) < 1e-12


def test_state_dict_round_trip_with_new_layers():
    model = mixed_model().double()
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, V, (3, 6), generator=gen), torch.randn(3, 3, generator=gen).double())
            for _ in range(4)]
    straight = copy.deepcopy(model)
    train(straight, singd(straight), data, mse("mean"))
    opt = singd(model)
    train(model, opt, data[:2], mse("mean"))
    state = copy.deepcopy(opt.state_dict())
    resumed = copy.deepcopy(model)
    opt2 = singd(resumed)
    opt2.load_state_dict(state)
    train(resumed, opt2, data[2:], mse("mean"))
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------ two ranks
TWO_RANK_STRUCTURES = [("dense", "dense"), ("diagonal", "diagonal"), ("diagonal", "triltoeplitz")]


def sequence_model():
    """Embedding (7 rows: shards of 4 + 3), Conv1D (5 rows: 3 + 2), Linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(7, 4), Conv1D(5, 4), nn.Tanh(), nn.Linear(5, 2)).double()


def sequence_batch(step):
    gen = torch.Generator().manual_seed(50 + step)
    return (torch.randint(0, 7, (8, 3), generator=gen),
            torch.randn(8, 3, 2, generator=gen, dtype=torch.float64))


_WORKER = r'''
import os, sys, torch
import torch.nn.functional as F
import cafin
import two_ranks
from test_singd_layers import TWO_RANK_STRUCTURES, SETTINGS, sequence_model, sequence_batch
rank, _ = two_ranks.join(sys.argv[1])
results = {}
for structures in TWO_RANK_STRUCTURES:
    for wrap in ("fsdp", "ddp", "plain"):
        model = sequence_model()
        net = two_ranks.wrap(model, wrap)
        opt = cafin.SINGD(net, list(model.parameters()), structures=structures, **SETTINGS)
        for k in range(3):
            x, y = sequence_batch(k)
            opt.zero_grad()
            F.mse_loss(net(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
            opt.step()
        results[(structures, wrap)] = [(p.full_tensor() if hasattr(p, "full_tensor") else p)
                                       .detach().clone() for p in model.parameters()]
        del opt, net, model
if rank == 0:
    torch.save(results, os.path.join(sys.argv[1], "out.pt"))
two_ranks.leave()
'''


def test_two_ranks_fsdp_ddp_and_plain_equal_one_process_on_the_whole_batch(tmp_path):
    """Embedding and Conv1D (weights stored [input side, output side]) on two gloo ranks, each with
    half of every batch, sharded by FSDP2, wrapped by DDP or plain (singd's averaging): the
    one-process full-batch run."""
    import two_ranks
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    failure = two_ranks.launch(lambda rank: [script, tmp_path], tmp_path)
    assert failure is None, failure
    results = torch.load(tmp_path / "out.pt")
    for structures in TWO_RANK_STRUCTURES:
        model = sequence_model()
        opt = cafin.SINGD(model, structures=structures, **SETTINGS)
        for k in range(3):
            x, y = sequence_batch(k)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        assert moved(opt) > 1e-3
        for wrap in ("fsdp", "ddp", "plain"):
            for p, q in zip(model.parameters(), results[(structures, wrap)]):
                assert rel(q, p.detach()) < 1e-11, (structures, wrap)


# ------------------------------------------------------------------------------ GPT-2
@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_gpt2_gets_curvature_for_every_weight_matrix_and_trains(kfac_approx):
    transformers = pytest.importorskip(
        "transformers", reason="the GPT-2 check needs the optional transformers package")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = cafin.SINGD(model, list(model.parameters()), lr=0.02, T=1, lr_cov=0.01,
                          kfac_approx=kfac_approx)
    by_name = {layer.name: layer for layer in opt._curvature}
    matrices = [name for name, module in model.named_modules()
                if type(module).__name__ == "Conv1D"]
    assert len(matrices) == 8
    assert set(by_name) == set(matrices) | {"transformer.wte", "transformer.wpe"}
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: wte owns it
    for name in matrices:
        module = by_name[name].module
        state = opt.state[module.weight]
        nx, nf = module.weight.shape
        assert state["K.0"].shape == (nx + 1, nx + 1) and state["C.0"].shape == (nf, nf)
    wte = opt.state[model.transformer.wte.weight]
    assert wte["K.0"].shape == (101,) and wte["C.0"].shape == (32, 32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (4, 16), generator=gen)
    before = model.transformer.wte.weight.detach().clone()
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert not torch.equal(before, model.transformer.wte.weight)
    for name in matrices + ["transformer.wte"]:
        layer = by_name[name]
        k = opt._parts(layer, "K")[0]
        eye = torch.ones_like(k) if k.dim() == 1 else torch.eye(k.shape[0])
        assert not torch.equal(k, eye), name  # its curvature was taken and used
