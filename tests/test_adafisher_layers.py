"""AdaFisher's curvature for the layers of a transformer and of 1-D/3-D convolutions: nn.Embedding,
transformers' Conv1D (a Linear with its weight stored [in, out]), nn.Conv1d and nn.Conv3d.

Each layer's raw statistics, as the hooks accumulate them on one forward/backward pass, against a
float64 oracle computed the naive way (an explicit one-hot input; explicit patches, one output
position of one sample at a time), with the output gradient fixed by the loss sum(out * R) = R.
Then the update reads the right factor on each axis, both backends agree, tied weights are
preconditioned by one layer, and a transformers GPT-2 gets curvature for every weight matrix.
"""
from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cafin
from cafin import AdaFisher, AdaFisherW
from devices import CUDA, CUDA_SKIP
from stand_ins import Conv1D as _Conv1D

BACKENDS = ["fused", "reference"]
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(seed: int, *shape, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed), dtype=torch.float64).to(dtype)


def assert_close(actual, expected, rtol, label=""):
    """Every element within rtol * max|expected| of the expected value."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, (label, a.shape, e.shape)
    atol = rtol * max(e.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{label}: {m}")


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout."""
    out = t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() > 1 else torch.stack([t, t], -1)[..., 0]
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


def Conv1D(nf: int, nx: int):
    return _Conv1D(nf, nx, weight_scale=0.2)


# ------------------------------------------------------------------------------------ oracles
def conv_padding_pairs(m) -> list[tuple[int, int]]:
    """(before, after) per spatial dim, as the convolution pads."""
    if m.padding == "valid":
        return [(0, 0)] * len(m.kernel_size)
    if m.padding == "same":
        totals = [d * (k - 1) for d, k in zip(m.dilation, m.kernel_size)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in m.padding]


def conv_oracle(m, x, g):
    """h[(c, taps)] = sum over samples, groups and output positions of the squared patch entry,
    / (B * positions * D), bias entry G/D; s[o] = sum of g^2 over samples and positions / (B *
    positions). Patches are cut one at a time from the explicitly padded input."""
    spatial = len(m.kernel_size)
    x, g = x.double(), g.double()
    if x.dim() == spatial + 1:
        x, g = x.unsqueeze(0), g.unsqueeze(0)
    pads = [p for pair in reversed(conv_padding_pairs(m)) for p in pair]
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    xp = F.pad(x, pads, mode=mode)
    conv = {1: F.conv1d, 3: F.conv3d}[spatial]
    again = conv(xp, m.weight.double(), None if m.bias is None else m.bias.double(), m.stride, 0,
                 m.dilation, m.groups)
    assert again.shape == g.shape, "the oracle's padding is the convolution's"
    batch, channels = xp.shape[:2]
    cg = channels // m.groups
    d = cg * math.prod(m.kernel_size)
    outs = g.shape[2:]
    acc = torch.zeros(d, dtype=torch.float64)
    for b, group in itertools.product(range(batch), range(m.groups)):
        for pos in itertools.product(*(range(n) for n in outs)):
            window = tuple(slice(p * s, p * s + dl * (k - 1) + 1, dl)
                           for p, s, dl, k in zip(pos, m.stride, m.dilation, m.kernel_size))
            patch = xp[(b, slice(group * cg, (group + 1) * cg)) + window].reshape(-1)
            assert patch.numel() == d
            acc += patch * patch
    positions = math.prod(outs)
    h = acc / (batch * positions * d)
    if m.bias is not None:
        h = torch.cat([h, h.new_tensor([m.groups / d])])
    s = (g * g).sum(dim=[0] + list(range(2, g.dim()))) / (batch * positions)
    return h, s


def embedding_oracle(m, idx, g):
    """A Linear without bias on the explicit one-hot input (divided by its token's count with
    scale_grad_by_freq)."""
    onehot = F.one_hot(idx.reshape(-1).long(), m.num_embeddings).double()
    if m.scale_grad_by_freq:
        onehot = onehot / onehot.sum(dim=0).clamp_min(1)
    h = (onehot * onehot).sum(dim=0) / onehot.shape[0]
    gv = g.double().reshape(-1, m.embedding_dim)
    return h, (gv * gv).sum(dim=0) / gv.shape[0]


def transposed_linear_oracle(m, x, g):
    xv = x.double().reshape(-1, m.nx)
    h = torch.cat([(xv * xv).sum(dim=0) / xv.shape[0], xv.new_ones(1)])
    gv = g.double().reshape(-1, m.nf)
    return h, (gv * gv).sum(dim=0) / gv.shape[0]


def one_pass_statistics(module, x, backend, seed=0):
    """stat_H and stat_S (sums, last entry the count) after one forward/backward of a curvature
    step with loss sum(out * R), and R (the output gradient)."""
    opt = AdaFisher(module, TCov=1, backend=backend)
    out = module(x)
    r = randn(seed, *out.shape, dtype=out.dtype)
    (out * r).sum().backward()
    state = opt.state[module.weight]
    return state["stat_H"], state["stat_S"], r


def check_one_pass(module, x, oracle, dtype, backend):
    module = module.to(dtype)
    if x.is_floating_point():
        x = x.to(dtype)
    stat_h, stat_s, r = one_pass_statistics(module, x, backend)
    assert stat_h[-1] == 1 and stat_s[-1] == 1
    h, s = oracle(module, x, r)
    assert_close(stat_h[:-1], h, RTOL[dtype], "H")
    assert_close(stat_s[:-1], s, RTOL[dtype], "S")


# ------------------------------------------------------------------------------- Conv1d, Conv3d
def _conv1d_cases():
    x = lambda *shape: randn(1, *shape)  # noqa: E731
    return {
        "plain": (lambda: nn.Conv1d(3, 5, 3), x(2, 3, 11)),
        "odd_no_bias": (lambda: nn.Conv1d(3, 5, 1, bias=False), x(3, 3, 7)),
        "stride_dilation_groups": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=3, dilation=2, groups=2,
                                                     bias=False), x(2, 4, 13)),
        "depthwise": (lambda: nn.Conv1d(3, 3, 5, padding=2, groups=3), x(2, 3, 9)),
        "same_even_kernel": (lambda: nn.Conv1d(3, 4, 4, padding="same", dilation=2), x(2, 3, 10)),
        "valid": (lambda: nn.Conv1d(3, 4, 3, padding="valid"), x(2, 3, 8)),
        "reflect": (lambda: nn.Conv1d(3, 5, 3, padding=2, padding_mode="reflect"), x(2, 3, 9)),
        "replicate_stride": (lambda: nn.Conv1d(3, 5, 3, stride=3, padding=1, padding_mode="replicate"),
                             x(2, 3, 10)),
        "circular_same": (lambda: nn.Conv1d(2, 3, 4, padding="same", padding_mode="circular"), x(2, 2, 7)),
        "unbatched": (lambda: nn.Conv1d(3, 4, 3, padding=1), x(3, 9)),
        "noncontiguous": (lambda: nn.Conv1d(3, 4, 2, stride=2), noncontiguous(x(2, 3, 9))),
    }


def _conv3d_cases():
    x = lambda *shape: randn(2, *shape)  # noqa: E731
    return {
        "plain": (lambda: nn.Conv3d(2, 3, 3), x(2, 2, 5, 6, 7)),
        "mixed_geometry_groups": (lambda: nn.Conv3d(4, 6, (2, 3, 1), stride=(2, 1, 2), padding=(1, 0, 1),
                                                    dilation=(2, 1, 1), groups=2, bias=False), x(2, 4, 7, 5, 6)),
        "depth_stride_over_kernel": (lambda: nn.Conv3d(2, 3, (1, 2, 2), stride=(3, 1, 1)), x(2, 2, 8, 4, 5)),
        "same_even_kernel": (lambda: nn.Conv3d(2, 3, (2, 3, 4), padding="same", dilation=(2, 1, 1)),
                             x(2, 2, 5, 4, 6)),
        "valid": (lambda: nn.Conv3d(2, 3, 2, padding="valid"), x(1, 2, 3, 4, 5)),
        "reflect": (lambda: nn.Conv3d(2, 3, 3, padding=(1, 2, 1), padding_mode="reflect"), x(2, 2, 4, 5, 5)),
        "replicate": (lambda: nn.Conv3d(2, 4, 3, padding=1, stride=2, padding_mode="replicate", groups=2),
                      x(2, 2, 5, 5, 6)),
        "circular": (lambda: nn.Conv3d(2, 3, (3, 1, 2), padding=(1, 0, 1), padding_mode="circular"),
                     x(2, 2, 4, 3, 5)),
        "unbatched": (lambda: nn.Conv3d(2, 3, 2, padding=1), x(2, 3, 4, 5)),
        "noncontiguous": (lambda: nn.Conv3d(3, 2, 2), noncontiguous(x(2, 3, 4, 5, 3))),
    }


CONV_CASES = {f"conv1d-{k}": v for k, v in _conv1d_cases().items()}
CONV_CASES.update({f"conv3d-{k}": v for k, v in _conv3d_cases().items()})


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_statistics_match_oracle(case, dtype, backend):
    make, x = CONV_CASES[case]
    torch.manual_seed(0)
    check_one_pass(make(), x, conv_oracle, dtype, backend)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_statistics_fused_equal_reference(case, dtype):
    make, x = CONV_CASES[case]
    torch.manual_seed(0)
    module = make().to(dtype)
    (h_ref, s_ref, _), (h, s, _) = (one_pass_statistics(copy.deepcopy(module), x.to(dtype), backend)
                                    for backend in ("reference", "fused"))
    assert_close(h, h_ref, RTOL[dtype], "H")
    assert_close(s, s_ref, RTOL[dtype], "S")


# ------------------------------------------------------------------------------------ Embedding
def _tokens(seed, *shape, vocab=11, dtype=torch.int64):
    return torch.randint(0, vocab, shape, generator=gen(seed)).to(dtype)


EMBEDDING_CASES = {
    "plain": (lambda: nn.Embedding(11, 6), _tokens(3, 4, 7)),
    "odd_dim_rare_tokens": (lambda: nn.Embedding(11, 5), _tokens(4, 3, 2, vocab=4)),
    "padding_idx": (lambda: nn.Embedding(11, 6, padding_idx=2), _tokens(5, 4, 7, vocab=4)),
    "scale_grad_by_freq": (lambda: nn.Embedding(11, 6, scale_grad_by_freq=True), _tokens(6, 5, 6, vocab=5)),
    "max_norm": (lambda: nn.Embedding(11, 6, max_norm=0.5), _tokens(7, 4, 7)),
    "unbatched": (lambda: nn.Embedding(11, 6), _tokens(8, 9)),
    "int32_noncontiguous": (lambda: nn.Embedding(11, 6), noncontiguous(_tokens(9, 5, 4, dtype=torch.int32))),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(EMBEDDING_CASES))
def test_embedding_statistics_match_oracle(case, dtype, backend):
    make, idx = EMBEDDING_CASES[case]
    torch.manual_seed(0)
    check_one_pass(make(), idx, embedding_oracle, dtype, backend)


def test_embedding_padding_row_counts_as_a_token():
    """The documented convention: padding positions count in H (their row's entry is the padding
    token's frequency) and in S; the padding row's gradient is zero."""
    emb = nn.Embedding(5, 3, padding_idx=0).double()
    idx = torch.tensor([[0, 0, 0, 1], [0, 2, 2, 0]])
    stat_h, _, _ = one_pass_statistics(emb, idx, "fused")
    assert_close(stat_h[:-1], torch.tensor([5, 1, 2, 0, 0], dtype=torch.float64) / 8, 1e-15)
    assert (emb.weight.grad[0] == 0).all() and (emb.weight.grad[1] != 0).all()


@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW], ids=lambda c: c.__name__)
def test_max_norm_embedding_trains_equal_between_backends(cls):
    """max_norm renormalises the looked-up rows in place before each forward; the statistics and
    the update are those of a plain Embedding, the same on both backends."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Embedding(11, 6, max_norm=0.8), nn.Linear(6, 11)).double()
    batches = [(_tokens(300 + k, 3, 5), _tokens(400 + k, 3, 5)) for k in range(4)]
    runs = []
    for backend in ("reference", "fused"):
        model = copy.deepcopy(base)
        opt = cls(model, lr=1e-3, TCov=1, weight_decay=1e-2, backend=backend)
        losses = _train(model, opt, batches)
        runs.append((model, opt, losses))
    (ref_model, _, ref_losses), (model, opt, losses) = runs
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_close(p, q, 1e-12, name)
    state = opt.state[model[0].weight]
    assert (state["fisher_H"] > 0).all() and (state["fisher_S"] > 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_embedding_refused_at_construction(backend):
    model = nn.Sequential(nn.Linear(3, 3))
    model.add_module("tokens", nn.Embedding(7, 3, sparse=True))
    with pytest.raises(ValueError, match=r"layer 'tokens' \(Embedding\): sparse=True"):
        AdaFisher(model, backend=backend)
    opt = AdaFisher(model, params=list(model[0].parameters()), backend=backend)  # frozen: no matter
    assert opt.state[model[0].weight]["fisher_S"].shape == (3,)
    with pytest.raises(ValueError, match="sparse=True"):
        opt.add_param_group({"params": [model.tokens.weight]})
    assert len(opt._curvature) == 1 and opt._hooks is not None  # nothing changed


def test_embedding_stats_op_arguments():
    stat = torch.zeros(6)
    with pytest.raises(TypeError, match="indices must be int64 or int32"):
        cafin.ops.embedding_input_stats_(stat, torch.zeros(3))
    with pytest.raises(ValueError, match="indices are empty"):
        cafin.ops.embedding_input_stats_(stat, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="stat must be"):
        cafin.ops.embedding_input_stats_(torch.zeros(6, dtype=torch.int64), torch.zeros(3, dtype=torch.long))
    assert (stat == 0).all()


# ------------------------------------------------------------------------- transformers Conv1D
def test_transposed_linear_recognised_by_its_contract():
    """A class named Conv1D with nx, nf and a [nx, nf] weight, its subclasses and FSDP2's
    generated subclass; not torch's Conv1d, nor a Conv1D of another shape contract."""
    from cafin.core.views import is_transposed_linear

    class Sub(_Conv1D):
        pass

    class FSDPConv1D(_Conv1D):  # fully_shard's generated class is named so
        pass

    assert all(is_transposed_linear(m) for m in (_Conv1D(3, 4), Sub(3, 4), FSDPConv1D(3, 4)))
    odd = Conv1D(3, 4)
    odd.nx = 5
    assert not is_transposed_linear(odd)
    assert not is_transposed_linear(nn.Conv1d(3, 4, 1)) and not is_transposed_linear(nn.Linear(3, 4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4), (4,)], ids=str)
def test_transposed_linear_statistics_match_oracle(shape, dtype, backend):
    torch.manual_seed(0)
    check_one_pass(Conv1D(3, 4), randn(11, *shape), transposed_linear_oracle, dtype, backend)


# ------------------------------------------------------------------------- the update's factors
@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW], ids=lambda c: c.__name__)
@pytest.mark.parametrize("backend", BACKENDS)
def test_update_reads_each_axis_factor(backend, cls):
    """After one step, each parameter moved by lr * g / F~ with F~ built from the stored factors
    on the right axes: Embedding [V, dim] = H[v] S[d], Conv1D weight [in, out] = H[i] S[o] and
    bias [out] = S[o] H[in], Conv1d/Conv3d weight [out, D] = S[o] H[c]."""
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(emb=nn.Embedding(7, 4), proj=Conv1D(5, 4), c1=nn.Conv1d(5, 3, 2),
                               c3=nn.Conv3d(3, 2, (2, 1, 1)))).double()

    def loss():
        h = model["proj"](model["emb"](_tokens(1, 2, 6, vocab=7)))  # [2, 6, 5]
        h = model["c1"](h.transpose(1, 2))  # [2, 3, 5]
        return model["c3"](h.reshape(2, 3, 5, 1, 1)).square().sum()

    lr, damping = 1e-3, 1e-3
    opt = cls(model, lr=lr, Lambda=damping, TCov=1, backend=backend)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()

    def factors(module):
        state = opt.state[module.weight]
        S, H = state["fisher_S"], state["fisher_H"]
        assert (S > 0).all() and (H > 0).all()
        return S, H

    S, H = factors(model["emb"])
    expected = {"emb.weight": H[:, None] * S[None, :]}
    S, H = factors(model["proj"])
    expected.update({"proj.weight": H[:4, None] * S[None, :], "proj.bias": S * H[4]})
    for name in ("c1", "c3"):
        S, H = factors(model[name])
        w = model[name].weight
        d = w[0].numel()
        expected.update({f"{name}.weight": (S[:, None] * H[None, :d]).view(w.shape), f"{name}.bias": S * H[d]})
    for name, p in model.named_parameters():
        f_tilde = expected[name] + damping
        assert_close(p.detach(), before[name] - lr * grads[name] / f_tilde, 1e-12, name)


# ------------------------------------------------------------------------------ whole training
class Mixed(nn.Module):
    """Embedding (padding_idx, tied with the output Linear) -> Conv1d -> Conv1D -> Conv3d ->
    Linear -> the tied output Linear."""

    def __init__(self, vocab=13):
        super().__init__()
        self.emb = nn.Embedding(vocab, 6, padding_idx=0)
        self.conv1 = nn.Conv1d(6, 8, 3, padding=1, groups=2)
        self.proj = Conv1D(5, 8)
        self.conv3 = nn.Conv3d(1, 2, (3, 3, 1), padding=(1, 1, 0), padding_mode="reflect")
        self.mix = nn.Linear(10, 6)
        self.head = nn.Linear(6, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        b, t = idx.shape
        h = self.conv1(self.emb(idx).transpose(1, 2))  # [B, 8, T]
        h = torch.tanh(self.proj(h.transpose(1, 2).contiguous()))  # [B, T, 5]
        h = self.conv3(h.reshape(b, 1, t, 5, 1))  # [B, 2, T, 5, 1]
        h = self.mix(h.permute(0, 2, 1, 3, 4).reshape(b, t, 10))
        return self.head(h)


def _batches(n, vocab=13):
    return [(_tokens(100 + k, 3, 7, vocab=vocab), _tokens(200 + k, 3, 7, vocab=vocab)) for k in range(n)]


def _train(model, opt, batches):
    losses = []
    for idx, target in batches:
        opt.zero_grad()
        out = model(idx)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW], ids=lambda c: c.__name__)
def test_training_equal_between_backends(cls, dtype):
    torch.manual_seed(0)
    base = Mixed().to(dtype)
    batches = _batches(5)
    runs = []
    for backend in ("reference", "fused"):
        model = copy.deepcopy(base)
        opt = cls(model, lr=1e-3, TCov=2, weight_decay=1e-2, backend=backend)
        _train(model, opt, batches)
        runs.append((model, opt))
    (ref_model, ref_opt), (model, opt) = runs
    moved = max((p - q).abs().max().item() for p, q in zip(ref_model.parameters(), base.parameters()))
    assert moved > 1e-4
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_close(p, q, RTOL[dtype], name)
        for key, value in ref_opt.state[q].items():
            assert_close(opt.state[p][key], value, RTOL[dtype], f"{name}.{key}")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason=CUDA_SKIP)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_training_equals_cpu(backend):
    """The new layers' statistics and the per-axis update on CUDA, float64, against the CPU."""
    torch.manual_seed(0)
    base = Mixed().double()
    batches = _batches(5)
    runs = []
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(base).to(device)
        opt = AdaFisherW(model, lr=1e-3, TCov=2, weight_decay=1e-2, backend=backend)
        _train(model, opt, [(x.to(device), y.to(device)) for x, y in batches])
        runs.append((model, opt))
    (cpu_model, cpu_opt), (model, opt) = runs
    for (name, p), q in zip(model.named_parameters(), cpu_model.parameters()):
        assert_close(p.cpu(), q, 1e-9, name)
        for key, value in cpu_opt.state[q].items():
            assert_close(opt.state[p][key].cpu(), value, 1e-9, f"{name}.{key}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_embedding_trains_with_one_layers_factors(backend):
    torch.manual_seed(0)
    model = Mixed()
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend=backend)
    names = [layer.name for layer in opt._curvature]
    assert names == ["emb", "conv1", "proj", "conv3", "mix"]  # head owns nothing: its weight is emb's
    tied = model.emb.weight
    assert model.head.weight is tied
    assert [layer.name for layer in opt._curvature if any(p is tied for p in layer.params.values())] == ["emb"]
    assert opt._owner[tied][0].name == "emb"
    batches = _batches(1) * 8
    losses = _train(model, opt, batches)
    assert losses[-1] < 0.9 * losses[0], losses
    state = opt.state[tied]
    assert state["fisher_H"].shape == (13,) and state["fisher_S"].shape == (6,)
    assert (state["fisher_H"] > 0).all() and (state["fisher_S"] > 0).all()


# ----------------------------------------------------------------------------- transformers GPT-2
@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW], ids=lambda c: c.__name__)
def test_transformers_gpt2_gets_curvature_everywhere(cls):
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra")
    from transformers.pytorch_utils import Conv1D as HFConv1D

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    opt = cls(model, lr=1e-3, TCov=1)
    layers = {layer.name: layer for layer in opt._curvature}
    wte = model.transformer.wte
    assert model.lm_head.weight is wte.weight
    assert "lm_head" not in layers and opt._owner[wte.weight][0] is layers["transformer.wte"]
    projections = [f"transformer.h.{i}.{name}" for i in range(2)
                   for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    modules = dict(model.named_modules())
    for name in projections:
        assert isinstance(modules[name], HFConv1D) and name in layers, name
    idx = torch.randint(0, 101, (4, 16), generator=gen(0))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    for name in projections + ["transformer.wte"]:
        module = modules[name]
        state = opt.state[module.weight]
        rows_side, cols_side = module.weight.shape  # Conv1D [in, out], Embedding [vocab, dim]
        extra = 1 if getattr(module, "bias", None) is not None else 0
        assert state["fisher_H"].shape == (rows_side + extra,), name
        assert state["fisher_S"].shape == (cols_side,), name
        assert (state["fisher_H"] > 0).all() and (state["fisher_S"] > 0).all(), name


# ------------------------------------------------------------------------------------ FSDP2
def test_fsdp_shards_transposed_parameters_as_ddp(tmp_path):
    """Under fully_shard a rank holds rows [start, stop) of each weight: for an Embedding and a
    Conv1D those rows read H, not S. Two CPU/gloo ranks train the same model under DDP and FSDP2
    (uneven shards) to the same parameters."""
    from pathlib import Path

    import two_ranks
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    worker = Path(__file__).with_name("fsdp_layers_worker.py")
    failure = two_ranks.launch(lambda rank: [worker, tmp_path], tmp_path, 2)
    assert failure is None, failure
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        moved = max((p - q).abs().max().item() for p, q in zip(result["ddp"], result["initial"]))
        assert moved > 1e-4
        for i, (p, q) in enumerate(zip(result["fsdp"], result["ddp"])):
            assert_close(p, q, 1e-10, f"rank {rank} parameter {i}")


# ------------------------------------------------------------------------------ torch.compile
def test_compiled_model_and_step_equal_eager():
    """torch.compile traces the new layers' statistics hooks (the Conv3d depth taps, the Embedding
    counts) and the step (the per-axis factor views) without a graph break, and trains as eager."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = Mixed()
    data = _batches(5)
    trained = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = copy.deepcopy(base)
        opt = AdaFisher(model, lr=1e-3, TCov=2)
        net = torch.compile(model) if compiled else model
        step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
        for idx, target in data:
            opt.zero_grad()
            out = net(idx)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)).backward()
            with torch.no_grad():
                step()
        trained.append(model)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the model, the step
    torch._dynamo.reset()
    for p, q in zip(trained[1].parameters(), trained[0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
