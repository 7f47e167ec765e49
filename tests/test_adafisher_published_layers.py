"""AdaFisher's `published_layers=True`: the published code's layer set (Linear, Conv2d,
BatchNorm2d, LayerNorm), for its numbers on models with an Embedding.

On a tied language model (an Embedding whose weight is the output Linear's, Linear and LayerNorm
layers between) and on an untied one with a Conv1d, cafin runs side by side with tests/oracle.py,
a float64 transcription of the published algorithm, several steps with curvature steps among
them: with the switch, parameters, momenta and factors equal the oracle's published layer set
(the Embedding's weight, tied or not, and the Conv1d's with F~ = 1); without it they equal the
oracle's default layer set and are far from the published one. Then the switch's validation and
its checkpoints.
"""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cafin import AdaFisher, AdaFisherW
from oracle import Oracle

OPTIMIZERS = [pytest.param(AdaFisher, id="AdaFisher"), pytest.param(AdaFisherW, id="AdaFisherW")]
BACKENDS = ["fused", "reference"]
TCOV = 2
STEPS = 3 * TCOV + 1  # curvature steps at k = 0, 2, 4, 6
HP = dict(lr=1e-3, beta=0.9, Lambda=1e-3, gamma=0.8, weight_decay=0.05, TCov=TCOV)
# max|a - b| / max|b| per tensor: float64 runs the same sums in another order; float32 as
# tests/test_adafisher.py bounds a float32 model against the float64 oracle.
TOL = {torch.float64: 1e-11, torch.float32: 1e-5}
VOCAB = 13


class TiedLM(nn.Module):
    """Embedding -> Linear -> GELU -> LayerNorm -> Linear -> decoder tied to the Embedding."""

    def __init__(self, vocab=VOCAB, dim=6, hidden=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lin1 = nn.Linear(dim, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.lin2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.lin2(self.ln(F.gelu(self.lin1(self.emb(idx))))))


class UntiedConvLM(nn.Module):
    """Embedding -> Conv1d over the sequence -> LayerNorm -> untied decoder (with bias)."""

    def __init__(self, vocab=VOCAB, dim=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, 7, 3, padding=1)
        self.ln = nn.LayerNorm(7)
        self.head = nn.Linear(7, vocab)

    def forward(self, idx):
        x = self.conv(self.emb(idx).transpose(1, 2)).transpose(1, 2)
        return self.head(F.gelu(self.ln(x)))


MODELS = {"tied": TiedLM, "untied_conv1d": UntiedConvLM}
# The layers each switch gives curvature (by name): the tied decoder is the Embedding's weight,
# so with the published set it takes none; the Conv1d has none there either.
LAYERS = {("tied", False): ["emb", "lin1", "ln", "lin2"], ("tied", True): ["lin1", "ln", "lin2"],
          ("untied_conv1d", False): ["emb", "conv", "ln", "head"],
          ("untied_conv1d", True): ["ln", "head"]}


# The models whose default layer set the oracle takes too (its default set has no Conv1d, which
# tests/test_adafisher_layers.py checks against an oracle of its own): on the others the default
# is only checked to differ from the published numbers.
ORACLE_DEFAULT = {"tied"}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def batches(seed: int, n: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (3, 7), generator=g), torch.randint(0, VOCAB, (3, 7), generator=g))
            for _ in range(n)]


def loss_of(model, idx, target):
    out = model(idx)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def train(model, opt, data):
    for idx, target in data:
        opt.zero_grad()
        loss_of(model, idx, target).backward()
        opt.step()


def oracle_run(base, cls, published_layers, data):
    ref = copy.deepcopy(base).double()
    orc = Oracle(ref, decoupled=cls is AdaFisherW, published_layers=published_layers, **HP)
    for idx, target in data:
        orc.step(lambda: loss_of(ref, idx, target))
    return ref, orc


def worst_difference(model, opt, ref, orc, layers_of):
    """The largest rel over parameters, momenta and factors against the oracle's."""
    refp = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        q = refp[name]
        worst = max(worst, rel(p, q), rel(opt.state[p]["exp_avg"], orc.state[q]["exp_avg"]))
        assert int(opt.state[p]["step"]) == orc.state[q]["step"], name
    refm = dict(ref.named_modules())
    for layer in layers_of(opt):
        factors = orc.factors[refm[layer.name]]
        state = opt.state[layer.anchor]
        worst = max(worst, rel(state["fisher_S"], factors["S"]), rel(state["fisher_H"], factors["H"]))
    return worst


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_published_layers_give_the_published_numbers(model_name, cls, backend, dtype):
    torch.manual_seed(11)
    base = MODELS[model_name]()
    data = batches(5)
    initial = {n: p.detach().clone().double() for n, p in base.named_parameters()}
    published_ref, published_orc = oracle_run(base, cls, True, data)
    default_ref, default_orc = oracle_run(base, cls, False, data) if model_name in ORACLE_DEFAULT \
        else (published_ref, None)
    tol = TOL[dtype]
    # The run must move the parameters far beyond the tolerance, and the two layer sets must
    # give clearly different numbers, or the comparisons below would prove nothing.
    moved = max(rel(q, initial[n]) for n, q in published_ref.named_parameters())
    assert moved > 1e3 * tol, moved
    if default_orc is not None:
        apart = max(rel(q, dict(default_ref.named_parameters())[n]) for n, q in published_ref.named_parameters())
        assert apart > 1e3 * tol, apart

    def layers_of(opt):
        return opt._curvature

    for published_layers, (ref, orc) in ((True, (published_ref, published_orc)),
                                         (False, (default_ref, default_orc))):
        model = copy.deepcopy(base).to(dtype)
        opt = cls(model, backend=backend, published_layers=published_layers, **HP)
        assert [layer.name for layer in opt._curvature] == LAYERS[model_name, published_layers]
        if not published_layers and model_name not in ORACLE_DEFAULT:
            train(model, opt, data)
            theirs = dict(published_ref.named_parameters())
            assert max(rel(p, theirs[n]) for n, p in model.named_parameters()) > 1e3 * tol
            continue
        # the oracle took statistics of the same layers
        assert sorted(LAYERS[model_name, published_layers]) == \
            sorted(n for n, m in ref.named_modules() if m in orc.factors)
        train(model, opt, data)
        worst = worst_difference(model, opt, ref, orc, layers_of)
        assert worst <= tol, (published_layers, worst)
        if published_layers and default_orc is not None:  # the other set's numbers are not these
            other = {n: q for n, q in default_ref.named_parameters()}
            assert max(rel(p, other[n]) for n, p in model.named_parameters()) > 1e3 * tol


def test_embedding_weight_steps_without_curvature():
    """With the published set the Embedding's weight (tied to the decoder) moves as Adam's
    first moment alone, F~ = 1: one step from zero momentum is -lr * g (bias-corrected)."""
    torch.manual_seed(2)
    model = TiedLM().double()
    opt = AdaFisherW(model, lr=0.1, published_layers=True, TCov=1)
    idx, target = batches(3, 1)[0]
    before = model.emb.weight.detach().clone()
    loss_of(model, idx, target).backward()
    grad = model.emb.weight.grad.clone()
    opt.step()
    torch.testing.assert_close(model.emb.weight.detach(), before - 0.1 * grad, rtol=1e-13, atol=1e-15)
    assert model.emb.weight not in opt._owner


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("value", ["True", 1, 0, None, torch.tensor(True)])
def test_bad_published_layers_refused(cls, value):
    model = TiedLM()
    with pytest.raises(TypeError, match=r"published_layers must be a bool .* got"):
        cls(model, published_layers=value)
    # nothing was hooked
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_sparse_embedding_still_refused_with_published_layers():
    """Sparse gradients do not go through the dense update, curvature or not."""
    model = nn.Sequential(nn.Embedding(7, 3, sparse=True), nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"layer '0' \(Embedding\): sparse=True"):
        AdaFisher(model, published_layers=True)


def _trained(published_layers, model_cls=TiedLM, steps=3):
    torch.manual_seed(4)
    model = model_cls().double()
    opt = AdaFisher(model, published_layers=published_layers, **HP)
    train(model, opt, batches(6, steps))
    return model, opt


def _saved(opt):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("saved_with", [True, False])
def test_checkpoint_of_the_other_layer_set_refused(saved_with):
    _, saver = _trained(saved_with)
    sd = _saved(saver)
    assert all(g["curvature"]["published_layers"] is saved_with for g in sd["param_groups"])
    model, opt = _trained(not saved_with)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"saved with published_layers={saved_with}, this optimizer "
                                         rf"has published_layers={not saved_with}"):
        opt.load_state_dict(sd)
    after = opt.state_dict()  # nothing half-loaded
    for index, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][index][key], value), (index, key)
    assert after["param_groups"][0]["curvature"] == before["param_groups"][0]["curvature"]


def test_checkpoint_resumes_bit_identically_with_published_layers():
    torch.manual_seed(8)
    base = TiedLM().double()
    data = batches(9, 6)
    straight = copy.deepcopy(base)
    train(straight, AdaFisher(straight, published_layers=True, **HP), data)
    first = copy.deepcopy(base)
    opt = AdaFisher(first, published_layers=True, **HP)
    train(first, opt, data[:3])
    sd = _saved(opt)
    resumed = copy.deepcopy(first)
    opt2 = AdaFisher(resumed, published_layers=True, **HP)
    opt2.load_state_dict(sd)
    train(resumed, opt2, data[3:])
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(p, q), name


def test_checkpoint_loads_across_where_the_layer_sets_agree():
    """On a model with only published layer types both settings give the same layers, so the
    factors fit: the load warns that the constructor's setting wins, as for TCov and gamma."""
    def mlp():
        return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3)).double()

    torch.manual_seed(1)
    model = mlp()
    opt = AdaFisher(model, published_layers=True, **HP)
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    sd = _saved(opt)
    other = AdaFisher(copy.deepcopy(model), **HP)
    with pytest.warns(UserWarning, match=r"published_layers=True; this optimizer keeps its own "
                                         r"published_layers=False"):
        other.load_state_dict(sd)
    assert torch.equal(other.state[next(other.model.parameters())]["fisher_S"],
                       opt.state[next(model.parameters())]["fisher_S"])


def test_checkpoint_without_the_setting_loads_as_the_default():
    """A checkpoint written before the switch existed holds the default layer set."""
    _, saver = _trained(False)
    sd = _saved(saver)
    for group in sd["param_groups"]:
        del group["curvature"]["published_layers"]
    _, opt = _trained(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(sd)
    _, published = _trained(True)
    with pytest.raises(ValueError, match="saved with published_layers=False"):
        published.load_state_dict(sd)
