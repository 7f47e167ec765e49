"""Optimizer-level tests of AdaFisher / AdaFisherW.

cafin (float32 model) runs side by side with tests/oracle.py (an independent float64 transcription
of the AdaFisher algorithm, on a float64 deep copy of the model) on fresh random data each step.
Agreement measure, per parameter / state tensor: rel(a, b) = max|a - b| / max|b|, with a the cafin
tensor (upcast to float64) and b the oracle's; asserted <= 1e-5 for parameters and factors.
The same measure, <= 1e-5, for the raw statistics (cafin's accumulators between backward and
step) and the factors; <= 1e-4 for the momenta. Every side-by-side run also asserts that the
parameters moved well beyond the tolerance, so the comparison is not dominated by the (shared)
initial values.
"""
from __future__ import annotations

import copy
import io
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cafin import AdaFisher, AdaFisherW
from bench.models import gpt, mlp, resnet18
from oracle import Oracle

BACKENDS = ["reference", "fused"]
OPTIMIZERS = [pytest.param(AdaFisher, id="AdaFisher"), pytest.param(AdaFisherW, id="AdaFisherW")]

TCOV = 2
STEPS = 3 * TCOV + 1  # curvature steps at k = 0, TCov, 2 TCov, 3 TCov
HP = dict(lr=1e-3, beta=0.9, Lambda=1e-3, weight_decay=0.05, gamma=0.8)
TOL = 1e-5
AGREEMENT: dict[str, float] = {}  # test id -> worst parameter rel. difference (printed with -s)


# ----------------------------------------------------------------------------------- helpers
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def to64(batch):
    return tuple(t.double() if t.is_floating_point() else t for t in batch)


def mse_to_random(out: torch.Tensor, seed: int) -> torch.Tensor:
    target = torch.randn(out.shape, generator=gen(seed)).to(out.dtype)
    return ((out - target) ** 2).mean()


def make_opt(cls, model, backend, **kw):
    hp = dict(HP, TCov=TCOV)
    hp.update(kw)
    return cls(model, backend=backend, **hp)


def make_oracle(cls, ref, groups=None, **kw):
    hp = dict(HP, TCov=TCOV)
    hp.update(kw)
    return Oracle(ref, groups, decoupled=cls is AdaFisherW, **hp)


def train_step(model, opt, loss_fn, batch):
    opt.zero_grad()
    loss = loss_fn(model, *batch)
    loss.backward()
    opt.step()
    return loss


def anchor_state(opt, orc, module, ref_module):
    """cafin's factor state of `module`: in the state of the first of its parameters that the
    module owns (the oracle says which), per cafin's documented state layout."""
    owners = orc.owners()
    for role in ("weight", "bias"):
        q = ref_module._parameters.get(role)
        if q is not None and owners.get(id(q)) == (ref_module, role):
            return opt.state[module._parameters[role]]
    return None


def agreement(model, ref, opt, orc, *, moved=True, label=""):
    """Compare parameters, momenta, step counts and factors; return the worst parameter rel."""
    refp = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        q = refp[name]
        r = rel(p, q)
        worst = max(worst, r)
        assert r <= TOL, f"{label}: parameter {name}: rel diff {r:.3g} > {TOL}"
        if q in orc.state:
            st = opt.state[p]
            assert int(st["step"].item()) == orc.state[q]["step"], f"{name}: step count"
            rm = rel(st["exp_avg"], orc.state[q]["exp_avg"])
            assert rm <= 1e-4, f"{label}: exp_avg of {name}: rel diff {rm:.3g}"
        else:
            assert p not in opt.state or float(opt.state[p]["step"]) == 0, f"{name} stepped"
    refm = dict(ref.named_modules())
    for name, m in model.named_modules():
        r_m = refm[name]
        if r_m not in orc.factors:
            continue
        st = anchor_state(opt, orc, m, r_m)
        assert st is not None, f"{label}: no factor state for module {name}"
        for key, skey in (("S", "fisher_S"), ("H", "fisher_H")):
            want = orc.factors[r_m].get(key)
            got = st[skey]
            if want is None:
                assert bool((got == -1).all()), f"{name}.{key} updated, the oracle's was not"
                continue
            r = rel(got, want)
            assert r <= TOL, f"{label}: factor {key} of {name}: rel diff {r:.3g}\n{got}\n{want}"
    if moved:  # the comparison above must not be dominated by the shared initial values
        init = getattr(ref, "_initial", None)
        if init is not None:
            motion = max(rel(refp[n], init[n]) for n in init if refp[n].requires_grad)
            assert motion > 100 * TOL, f"{label}: parameters barely moved ({motion:.3g})"
    return worst


def raw_statistics_agree(model, ref, opt, orc, label):
    """Between backward and step, cafin's accumulators (documented layout: sums of raw statistics,
    the last entry counting contributions) hold this step's raw statistics: compare them with the
    oracle's, before any normalisation can hide a wrong constant. Returns the disagreements."""
    errors = []
    refm = dict(ref.named_modules())
    for name, m in model.named_modules():
        r_m = refm[name]
        if r_m not in orc.last_raw:
            continue
        st = anchor_state(opt, orc, m, r_m)
        for want, skey in zip(orc.last_raw[r_m], ("stat_H", "stat_S")):
            if want is None:
                continue
            stat = st[skey]
            if float(stat[-1]) != 1.0:
                errors.append(f"{label} k={orc.k - 1}: {name}.{skey} counts {float(stat[-1])} "
                              "passes, expected 1 (statistics not taken)")
                continue
            r = rel(stat[:-1], want)
            if r > TOL:
                errors.append(f"{label} k={orc.k - 1}: raw {skey} of {name}: rel diff {r:.3g}\n"
                              f"{stat[:-1]}\n{want}")
    return errors


def side_by_side(make_model, batch_fn, loss_fn, opt_cls, backend, *, steps=STEPS, groups=None,
                 label="", check=True, **kw):
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model).double()
    ref._initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    if groups is None:
        opt = make_opt(opt_cls, model, backend, **kw)
        orc = make_oracle(opt_cls, ref, **kw)
    else:
        opt = make_opt(opt_cls, model, backend, params=groups(model), **kw)
        orc = make_oracle(opt_cls, ref, groups(ref), **kw)
    raw_errors = orc.raw_errors = []
    for k in range(steps):
        batch = batch_fn(k)
        b64 = to64(batch)
        orc.step(lambda: loss_fn(ref, *b64))
        opt.zero_grad()
        loss_fn(model, *batch).backward()
        raw_errors += raw_statistics_agree(model, ref, opt, orc, label)
        if check and raw_errors:
            pytest.fail(raw_errors[0])
        opt.step()
    if check:
        worst = agreement(model, ref, opt, orc, label=label)
        AGREEMENT[label] = worst
        print(f"\n{label}: max rel diff (params) {worst:.3g}")
    return model, ref, opt, orc


# ------------------------------------------------------------------- 1. layers, options, models
class MyLinear(nn.Linear):  # subclasses count (isinstance, not class names)
    pass


class SharedLinear(nn.Module):
    """Two Linear modules sharing one weight (distinct biases): the weight takes the first's
    curvature, the second module still preconditions its own bias."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class SometimesBranch(nn.Module):
    """The branch runs only on batches of 4: not on the first curvature step (k = 0, batch 3), so
    between k = 1 and the next curvature step its parameters have an owner whose hooks never ran
    (F~ = 1)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 5)
        self.branch = nn.Linear(5, 5)

    def forward(self, x):
        y = torch.tanh(self.trunk(x))
        return self.branch(y) if x.shape[0] == 4 else y


def _sometimes_batch(k):
    return torch.randn(3 + k % 2, 6, generator=gen(100 + k)), torch.tensor(7000 + k)


def partially_frozen():
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    m[0].weight.requires_grad_(False)  # the module still preconditions its bias
    return m


def _layer(module_fn, in_shape, shift=0.0):
    """A case: the layer followed by tanh, MSE to a random target, fresh input each step."""
    def make():
        return nn.Sequential(module_fn(), nn.Tanh())

    def batch(k):
        return (torch.randn(in_shape, generator=gen(100 + k)) + shift, torch.tensor(7000 + k))

    return make, batch


def _loss(model, x, seed):
    return mse_to_random(model(x), int(seed))


C4 = (2, 4, 7, 6)  # [B, C_in, H, W], non-square on purpose
LAYER_CASES = {
    "linear": _layer(lambda: nn.Linear(6, 5), (4, 6)),
    "linear_nobias": _layer(lambda: nn.Linear(6, 5, bias=False), (4, 6)),
    "linear_1d_input": _layer(lambda: nn.Linear(6, 5), (6,)),
    "linear_3d_input": _layer(lambda: nn.Linear(6, 5), (2, 3, 6)),
    "linear_4d_input": _layer(lambda: nn.Linear(6, 5), (2, 3, 2, 6)),
    "linear_subclass": _layer(lambda: MyLinear(6, 5), (4, 6)),
    "linear_shared_weight": (SharedLinear, _layer(None, (4, 6))[1]),
    "linear_partially_frozen": (partially_frozen, _layer(None, (4, 6))[1]),
    "linear_hooks_not_run_at_first_curvature_step": (SometimesBranch, _sometimes_batch),
    # in-place activations right after the layer; with a bias and a 3-D input, or a
    # 1-D input, Linear returns a view, and so does Conv2d on an unbatched input
    "linear_inplace_relu": _layer(lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True)), (4, 6)),
    "linear_3d_inplace_relu": _layer(lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True)), (2, 3, 6)),
    "linear_1d_inplace_relu": _layer(lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True)), (6,)),
    "conv": _layer(lambda: nn.Conv2d(4, 5, 3, padding=1), C4),
    "conv_stride2_nobias": _layer(lambda: nn.Conv2d(4, 5, 3, stride=2, bias=False), C4),
    "conv_rect_stride_pad": _layer(lambda: nn.Conv2d(4, 5, (3, 2), stride=(2, 1), padding=(1, 0)), C4),
    "conv_unbatched": _layer(lambda: nn.Conv2d(4, 5, 3, padding=1), C4[1:]),
    "conv_unbatched_inplace_relu": _layer(
        lambda: nn.Sequential(nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(inplace=True)), C4[1:]),
    "conv_inplace_relu": _layer(lambda: nn.Sequential(nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(inplace=True)), C4),
    "conv_1x1_stride2": _layer(lambda: nn.Conv2d(4, 5, 1, stride=2), C4),
    "conv_same_even_kernel": _layer(lambda: nn.Conv2d(4, 5, (4, 2), padding="same"), C4),
    "conv_same_dilated": _layer(lambda: nn.Conv2d(4, 5, 3, padding="same", dilation=2), C4),
    "conv_valid": _layer(lambda: nn.Conv2d(4, 5, (2, 3), padding="valid"), C4),
    "conv_dilation": _layer(lambda: nn.Conv2d(4, 5, 3, dilation=(2, 1), padding=(1, 2), stride=(2, 1)), C4),
    "conv_reflect": _layer(lambda: nn.Conv2d(4, 5, 3, padding=1, padding_mode="reflect"), C4),
    "conv_replicate": _layer(lambda: nn.Conv2d(4, 5, 3, padding=(2, 1), padding_mode="replicate"), C4),
    "conv_circular_stride": _layer(
        lambda: nn.Conv2d(4, 5, 3, padding=(1, 2), stride=(1, 2), padding_mode="circular"), C4),
    "conv_same_reflect_even": _layer(
        lambda: nn.Conv2d(4, 5, (3, 4), padding="same", padding_mode="reflect", bias=False), C4),
    "conv_groups": _layer(lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), C4),
    "conv_depthwise_dilated": _layer(lambda: nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4), C4),
    "batchnorm2d": _layer(lambda: nn.BatchNorm2d(4), (3, 4, 5, 5), shift=0.5),
    "layernorm_BC": _layer(lambda: nn.LayerNorm(6), (4, 6), shift=0.3),
    "layernorm_BTC": _layer(lambda: nn.LayerNorm(6), (3, 5, 6)),
    "layernorm_nobias": _layer(lambda: nn.LayerNorm(6, bias=False), (3, 5, 6)),
    "layernorm_multi_dim": _layer(lambda: nn.LayerNorm((3, 4)), (2, 5, 3, 4)),
    "layernorm_TC": _layer(lambda: nn.LayerNorm((5, 6)), (3, 5, 6)),
}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_matches_oracle(case, opt_cls, backend):
    make, batch = LAYER_CASES[case]
    side_by_side(make, batch, _loss, opt_cls, backend, label=f"{case}-{opt_cls.__name__}-{backend}")


def _resnet():
    return resnet18(num_classes=5, width=4, blocks=(1, 1))


def _gpt():
    return gpt(vocab=50, dim=16, depth=2, heads=2, context=8)


def _mlp():
    return mlp(sizes=(12, 16, 10))


def _ce(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


MODEL_CASES = {
    "resnet": (_resnet, lambda k: (torch.randn(4, 3, 8, 8, generator=gen(k)),
                                   torch.randint(0, 5, (4,), generator=gen(50 + k)))),
    "gpt": (_gpt, lambda k: _tokens(k)),
    "mlp": (_mlp, lambda k: (torch.randn(8, 12, generator=gen(k)),
                             torch.randint(0, 10, (8,), generator=gen(50 + k)))),
}


def _tokens(k, batch=3, context=8, vocab=50):
    idx = torch.randint(0, vocab, (batch, context + 1), generator=gen(k))
    return idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_matches_oracle(case, opt_cls, backend):
    make, batch = MODEL_CASES[case]
    side_by_side(make, batch, _ce, opt_cls, backend, label=f"{case}-{opt_cls.__name__}-{backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_inf_statistic_is_dropped_with_a_warning(backend):
    """+inf in a raw statistic drops it as NaN does (float64 model so the oracle overflows the
    same way: (1e200)^2 = inf): a RuntimeWarning, the count, and the factor keeps its value
    (the published code maps +inf to 1 and rescales every other entry by it)."""
    def make():
        return nn.Linear(4, 3)

    def batch(k):
        x = torch.randn(5, 4, generator=gen(k)).double()
        if k == TCOV:
            x[0, 1] = 1e200
        return (x,)

    def loss(model, x):
        return torch.tanh(model(x)).sum()

    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    opt = make_opt(AdaFisher, model, backend)
    orc = make_oracle(AdaFisher, ref)
    for k in range(TCOV + 1):
        b = batch(k)
        if k == TCOV:
            H = opt.state[model.weight]["fisher_H"].clone()
            assert bool((H > 0).all())  # updated at k = 0
            with pytest.warns(RuntimeWarning, match="NaN or inf"):
                train_step(model, opt, loss, b)
            assert torch.equal(opt.state[model.weight]["fisher_H"], H)
        else:
            train_step(model, opt, loss, b)
        orc.step(lambda: loss(ref, *b))
        if k == TCOV:
            assert math.isinf(orc.last_raw[ref][0][1].item())  # the path is exercised
    assert opt.skipped_factor_updates == 1 and orc.skipped == 1  # fisher_H; fisher_S is finite
    agreement(model, ref, opt, orc, moved=False, label="inf")
    assert torch.isfinite(model.weight).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_forward_takes_no_statistics(backend):
    """An evaluation pass under torch.no_grad() on a curvature step leaves the factors alone."""
    torch.manual_seed(0)
    model = _small()
    ref = copy.deepcopy(model).double()
    opt = make_opt(AdaFisher, model, backend)
    orc = make_oracle(AdaFisher, ref)
    for k in range(STEPS):
        with torch.no_grad():
            model(torch.randn(5, 5, generator=gen(600 + k)) * 3)
        batch = _small_batch(k)
        train_step(model, opt, _ce, batch)
        b64 = to64(batch)
        orc.step(lambda: _ce(ref, *b64))
    agreement(model, ref, opt, orc, label="no_grad eval passes")


# ------------------------------------------- 2. tied decoder, frozen layer, in-place activation
class TiedNet(nn.Module):
    """Embedding -> Linear -> ReLU(inplace) -> frozen Linear -> LayerNorm -> Linear(tied to the
    Embedding, with a bias: the trailing parameter the published walk never trains). The tied
    weight takes the curvature of its first supported module, the Embedding."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, dim)
        self.act = nn.ReLU(inplace=True)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.ln = nn.LayerNorm(dim)
        self.dec = nn.Linear(dim, vocab)
        self.dec.weight = self.emb.weight

    def forward(self, idx):
        x = self.act(self.fc1(self.emb(idx)))
        return self.dec(self.ln(self.frozen(x)))


def _tied_batch(k):
    idx = torch.randint(0, 11, (4, 6), generator=gen(k))
    return idx, torch.randint(0, 11, (4, 6), generator=gen(900 + k))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_tied_frozen_inplace(opt_cls, backend):
    torch.manual_seed(0)
    probe = TiedNet()
    before = {n: p.detach().clone() for n, p in probe.named_parameters()}
    label = f"tied-{opt_cls.__name__}-{backend}"
    model, ref, opt, orc = side_by_side(TiedNet, _tied_batch, _ce, opt_cls, backend, label=label,
                                        check=False)
    assert model.dec.weight is model.emb.weight
    params = dict(model.named_parameters())
    assert "dec.weight" not in params  # tied: one parameter
    for name, p in params.items():
        if name.startswith("frozen."):
            assert torch.equal(p, before[name]), f"frozen {name} changed"
            assert p not in opt.state or float(opt.state[p]["step"]) == 0
        else:
            assert not torch.equal(p, before[name]), f"trainable {name} never moved"
            assert int(opt.state[p]["step"]) == STEPS, f"{name} stepped {opt.state[p]['step']} times"
    # the trailing parameters (the published bug) and the tied weight got real curvature
    assert (params["dec.bias"] - before["dec.bias"]).abs().max() > 1e-3
    owners = orc.owners()
    assert owners[id(ref.emb.weight)] == (ref.emb, "weight")  # the embedding's factors, not F~ = 1
    assert owners[id(ref.dec.bias)] == (ref.dec, "bias")
    if orc.raw_errors:  # statistics despite ReLU(inplace=True)
        pytest.fail(f"{len(orc.raw_errors)} raw-statistics disagreements, first: {orc.raw_errors[0]}")
    print(f"\n{label}: max rel diff (params) {agreement(model, ref, opt, orc, label=label):.3g}")


# ------------------------------------------------------------------ 3. torch.optim conventions
def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.LayerNorm(7), nn.Linear(7, 3))


def _small_batch(k):
    return torch.randn(6, 5, generator=gen(k)), torch.randint(0, 3, (6,), generator=gen(300 + k))


def test_is_a_torch_optimizer():
    model = _small()
    opt = AdaFisher(model, backend="reference")
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(AdaFisherW(model, backend="reference"), torch.optim.Optimizer)
    for group in opt.param_groups:
        assert isinstance(group["lr"], torch.Tensor) and group["lr"].dim() == 0
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(1))
    train_step(model, opt, _ce, _small_batch(0))
    assert calls == [1]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    model = _small()
    opt = AdaFisher(model, backend="reference")
    _ce(model, *_small_batch(0)).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_closure_under_no_grad(backend):
    a, b = _small(), _small()
    oa = make_opt(AdaFisherW, a, backend)
    ob = make_opt(AdaFisherW, b, backend)
    for k in range(TCOV + 2):
        batch = _small_batch(k)
        train_step(a, oa, _ce, batch)
        seen = []

        def closure():
            assert torch.is_grad_enabled()
            ob.zero_grad()
            loss = _ce(b, *batch)
            loss.backward()
            seen.append(loss)
            return loss

        with torch.no_grad():
            returned = ob.step(closure)
        assert len(seen) == 1 and returned is seen[0]
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(a.parameters(), b.parameters()):
        for key in oa.state[p]:
            assert torch.equal(oa.state[p][key], ob.state[q][key]), key
    assert (ob.state[b[0].weight]["fisher_S"] >= 0).all()  # the closure's passes took statistics


def _decay_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos"]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "pos")]
    return [{"params": decay},
            {"params": rest, "lr": 3e-3, "beta": 0.8, "weight_decay": 0.0, "Lambda": 2e-3}]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_param_groups_match_oracle(opt_cls, backend):
    model, ref, opt, orc = side_by_side(_gpt, MODEL_CASES["gpt"][1], _ce, opt_cls, backend,
                                        groups=_decay_groups, label=f"groups-{opt_cls.__name__}-{backend}")
    assert len(opt.param_groups) == 2
    assert opt.param_groups[1]["beta"] == 0.8 and opt.param_groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("when", [0, TCOV + 1])
def test_add_param_group_matches_oracle(when, backend):
    """The second layer joins the optimizer before the first step or mid-run (it is hooked then)."""
    torch.manual_seed(0)
    model = _small()
    ref = copy.deepcopy(model).double()
    opt = make_opt(AdaFisher, model, backend, params=list(model[0].parameters()) + list(model[2].parameters()))
    orc = make_oracle(AdaFisher, ref, [{"params": list(ref[0].parameters()) + list(ref[2].parameters())}])
    for k in range(STEPS):
        if k == when:
            opt.add_param_group({"params": list(model[3].parameters()), "lr": 5e-4, "beta": 0.7})
            orc.add_group({"params": list(ref[3].parameters()), "lr": 5e-4, "beta": 0.7})
            assert isinstance(opt.param_groups[-1]["lr"], torch.Tensor)
        batch = _small_batch(k)
        train_step(model, opt, _ce, batch)
        b64 = to64(batch)
        orc.step(lambda: _ce(ref, *b64))
    agreement(model, ref, opt, orc, moved=False, label="add_param_group")
    assert int(opt.state[model[3].weight]["step"]) == STEPS - when
    assert (opt.state[model[3].weight]["fisher_S"] >= 0).all()  # hooked after being added


def test_rejected_add_param_group_leaves_optimizer_unchanged():
    """torch.optim convention: add_param_group validates before it adds anything."""
    model = _small()
    opt = AdaFisher(model, params=list(model[0].parameters()), backend="reference")
    for bad, match in (({"params": [nn.Parameter(torch.zeros(3))]}, "not a parameter of the model"),
                       ({"params": list(model[3].parameters()), "beta": 1.5}, "beta")):
        with pytest.raises(ValueError, match=match):
            opt.add_param_group(bad)
        assert len(opt.param_groups) == 1, "a rejected group was left in opt.param_groups"
    train_step(model, opt, _ce, _small_batch(0))  # still usable


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_schedulers(name, backend):
    model = _small()
    ref = copy.deepcopy(model).double()
    opt = make_opt(AdaFisherW, model, backend)
    orc = make_oracle(AdaFisherW, ref)
    lr_tensor = opt.param_groups[0]["lr"]
    # the expected schedule, from the same scheduler driving a plain SGD
    dummy = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=HP["lr"])
    sched, dsched = SCHEDULERS[name](opt), SCHEDULERS[name](dummy)
    used = []
    for k in range(STEPS):
        lr = dummy.param_groups[0]["lr"]
        used.append(lr)
        assert opt.param_groups[0]["lr"] is lr_tensor and lr_tensor.dim() == 0
        assert float(lr_tensor) == pytest.approx(lr, rel=1e-6)
        orc.groups[0]["lr"] = lr
        batch = _small_batch(k)
        train_step(model, opt, _ce, batch)
        b64 = to64(batch)
        orc.step(lambda: _ce(ref, *b64))
        dummy.step()
        if name == "ReduceLROnPlateau":
            sched.step(1.0)
            dsched.step(1.0)
        else:
            sched.step()
            dsched.step()
    assert len(set(used)) >= 3, used  # the schedule really changed the lr
    agreement(model, ref, opt, orc, moved=False, label=f"sched-{name}")


# checkpoints
def _ckpt_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                         nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def _ckpt_batch(k):
    return torch.randn(4, 3, 5, 5, generator=gen(k)), torch.randint(0, 3, (4,), generator=gen(70 + k))


def _run(model, opt, ks):
    for k in ks:
        train_step(model, opt, _ce, _ckpt_batch(k))


def assert_same(a, b, path="sd"):
    """Deep, bit-exact equality of nested containers of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, path
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(
            a.nan_to_num(0), b.nan_to_num(0)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("at", [TCOV, TCOV + 1], ids=["at_curvature_step", "between_curvature_steps"])
@pytest.mark.parametrize("fresh, opt_cls", [(True, AdaFisherW), (False, AdaFisher)],
                         ids=["fresh_objects-AdaFisherW", "same_objects-AdaFisher"])
def test_checkpoint_resume_is_bit_identical(fresh, opt_cls, at, backend):
    full = _ckpt_model()
    opt_full = make_opt(opt_cls, full, backend)
    _run(full, opt_full, range(STEPS))

    model = _ckpt_model()
    opt = make_opt(opt_cls, model, backend)
    _run(model, opt, range(at))
    sd = opt.state_dict()
    assert sd["param_groups"][0]["curvature"]["k"] == at
    anchor = sd["state"][0]
    assert {"step", "exp_avg", "fisher_S", "fisher_H"} <= set(anchor)  # factors, moments, counters
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": sd}, buf)
    if fresh:
        model = _ckpt_model(seed=123)  # different initial values, overwritten by the checkpoint
        opt = make_opt(opt_cls, model, backend)
    else:
        _run(model, opt, range(at, STEPS))  # run on, then rewind this very object
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    _run(model, opt, range(at, STEPS))

    for (n, p), q in zip(model.named_parameters(), full.parameters()):
        assert torch.equal(p, q), f"{n} differs after resuming"
    for b1, b2 in zip(model.buffers(), full.buffers()):
        assert torch.equal(b1, b2)
    assert_same(opt.state_dict(), opt_full.state_dict())


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_before_first_step_round_trips(backend):
    model = _ckpt_model()
    opt = make_opt(AdaFisher, model, backend)
    sd = copy.deepcopy(opt.state_dict())
    other = make_opt(AdaFisher, _ckpt_model(seed=5), backend)
    other.load_state_dict(sd)
    assert_same(other.state_dict(), sd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_state_dict_leaves_argument_unchanged(backend):
    src_model = _ckpt_model()
    src = make_opt(AdaFisherW, src_model, backend)
    _run(src_model, src, range(TCOV + 1))
    sd = src.state_dict()
    before = copy.deepcopy(sd)
    model = _ckpt_model(seed=9)
    opt = make_opt(AdaFisherW, model, backend)
    opt.load_state_dict(sd)
    assert_same(sd, before)
    theirs = {id(t) for t in _tensors(sd)} | {t.untyped_storage().data_ptr() for t in _tensors(sd)}
    for t in _tensors(opt.state_dict()):
        assert id(t) not in theirs and t.untyped_storage().data_ptr() not in theirs, \
            "the optimizer's state aliases the loaded checkpoint"
    _run(model, opt, range(TCOV + 1, STEPS))  # training on must not write into the argument
    assert_same(sd, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_remove_hooks_stops_statistics(backend):
    model = _small()
    opt = make_opt(AdaFisher, model, backend)
    train_step(model, opt, _ce, _small_batch(0))
    factors = {id(p): {k: v.clone() for k, v in st.items() if k.startswith(("fisher", "stat"))}
               for p, st in opt.state.items()}
    assert any(factors.values())
    opt.remove_hooks()
    for m in model.modules():
        assert not m._forward_hooks
    w0 = model[0].weight.detach().clone()
    for k in range(1, 2 * TCOV + 2):  # passes curvature steps TCov and 2 TCov
        train_step(model, opt, _ce, _small_batch(k))
    for p, st in opt.state.items():
        for key, value in factors[id(p)].items():
            assert torch.equal(st[key], value), f"{key} changed after remove_hooks()"
    assert not torch.equal(model[0].weight, w0)  # the optimizer still steps


# ------------------------------------------------------------------------------------ 4. errors
@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1e-3), r"\blr\b"),
    (dict(lr=float("nan")), r"\blr\b"),
    (dict(beta=1.0), r"\bbeta\b"),
    (dict(beta=1.5), r"\bbeta\b"),
    (dict(beta=-0.1), r"\bbeta\b"),
    (dict(Lambda=0.0), r"\bLambda\b"),
    (dict(Lambda=-1e-3), r"\bLambda\b"),
    (dict(weight_decay=-0.1), r"\bweight_decay\b"),
    (dict(gamma=0.0), r"\bgamma\b"),
    (dict(gamma=-0.8), r"\bgamma\b"),
    (dict(gamma=float("nan")), r"\bgamma\b"),
    (dict(TCov=0), r"\bTCov\b"),
    (dict(TCov=-3), r"\bTCov\b"),
    (dict(TCov=2.5), r"\bTCov\b"),
    (dict(TCov=10.0), r"\bTCov\b"),  # the published LM script passes a float
    (dict(TCov="10"), r"\bTCov\b"),
    (dict(backend="cuda"), r"\bbackend\b"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_hyperparameter_out_of_range(opt_cls, kwargs, match):
    kw = dict(backend="reference")
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        opt_cls(_small(), **kw)


def test_group_hyperparameter_out_of_range():
    model = _small()
    with pytest.raises(ValueError, match=r"\bweight_decay\b"):
        AdaFisher(model, params=[{"params": model.parameters(), "weight_decay": -1.0}], backend="reference")
    with pytest.raises(ValueError, match=r"\bLambda\b"):
        AdaFisher(model, params=[{"params": list(model[0].parameters())},
                                 {"params": list(model[3].parameters()), "Lambda": 0.0}], backend="reference")


def test_param_not_in_model():
    model = _small()
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        AdaFisher(model, params=list(model.parameters()) + [stranger], backend="reference")
    with pytest.raises(ValueError, match="not a parameter of the model"):
        AdaFisher(model, params=[{"params": model.parameters()}, {"params": [stranger]}],
                  backend="reference")


class Unsupported(nn.Module):
    """Parameters only in unsupported layers (EmbeddingBag, ConvTranspose1d; a LayerNorm without
    affine has none)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.conv = nn.ConvTranspose1d(4, 3, 2, padding=1)
        self.norm = nn.LayerNorm(3, elementwise_affine=False)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, idx):
        tokens = self.emb(idx.reshape(-1, 1)).view(*idx.shape, -1)  # a bag per token
        x = self.conv(tokens.transpose(1, 2)).transpose(1, 2)
        return self.frozen(self.norm(x)) * self.scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_no_supported_module_is_momentum_sgd(opt_cls, backend):
    torch.manual_seed(0)
    model = Unsupported()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = make_opt(opt_cls, model, backend)
    user = [w for w in caught if issubclass(w.category, UserWarning)]
    assert len(user) == 1, [str(w.message) for w in user]
    assert re.search(r"supported", str(user[0].message))
    lr, beta, wd = HP["lr"], HP["beta"], HP["weight_decay"]
    params = [p for p in model.parameters() if p.requires_grad]
    initial = [p.detach().double().clone() for p in params]
    frozen = model.frozen.weight.detach().clone()
    theta = [t.clone() for t in initial]
    m = [torch.zeros_like(t) for t in theta]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(STEPS):
            idx = torch.randint(0, 10, (3, 5), generator=gen(k))
            target = torch.randint(0, 3, (3, 4), generator=gen(40 + k))
            train_step(model, opt, _ce, (idx, target))
            t = k + 1
            for i, p in enumerate(params):
                g = p.grad.double()
                if opt_cls is AdaFisherW:  # theta -= lr * (m / (1 - beta^t) + wd * theta)
                    m[i] = beta * m[i] + (1 - beta) * g
                    theta[i] = theta[i] - lr * (m[i] / (1 - beta ** t) + wd * theta[i])
                else:  # theta -= lr / (1 - beta^t) * m, with m over g + wd * theta
                    m[i] = beta * m[i] + (1 - beta) * (g + wd * theta[i])
                    theta[i] = theta[i] - lr / (1 - beta ** t) * m[i]
    assert not [w for w in caught if issubclass(w.category, UserWarning)]
    for p, t, t0 in zip(params, theta, initial):
        assert rel(p, t) <= 1e-6
        assert rel(p.double() - t0, t - t0) <= 1e-3  # the displacement itself, not just the value
        assert (t - t0).abs().max() > 1e-4
    assert torch.equal(model.frozen.weight, frozen)


def _trained(model_fn, steps=2, backend="reference"):
    model = model_fn()
    opt = make_opt(AdaFisher, model, backend)
    for k in range(steps):
        x = torch.randn(4, 12, generator=gen(k))
        y = torch.randint(0, 10, (4,), generator=gen(20 + k))
        train_step(model, opt, _ce, (x, y))
    return model, opt


class EmbedHead(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, 12)  # unsupported
        self.fc = nn.Linear(12, 10)

    def forward(self, x):  # x is float here: the embedding is only carried along
        return self.fc(x) + 0 * self.emb.weight.sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mine_fn, other_fn, match", [
    (lambda: mlp(sizes=(12, 16, 10)), lambda: mlp(sizes=(12, 20, 10)), "different model"),
    (lambda: mlp(sizes=(12, 16, 10)), lambda: mlp(sizes=(12, 16, 8, 10)), "parameters"),
    (lambda: EmbedHead(vocab=7), lambda: EmbedHead(vocab=9), "shape"),
], ids=["other_sizes_same_param_count", "other_param_count", "same_layout_other_unsupported_shape"])
def test_foreign_checkpoint_rejected_and_nothing_loaded(mine_fn, other_fn, match, backend):
    torch.manual_seed(0)
    mine, opt = _trained(mine_fn, backend=backend)
    _, foreign = _trained(other_fn, backend=backend)
    before = copy.deepcopy(opt.state_dict())
    live = {id(p): dict(st) for p, st in opt.state.items()}
    lrs = [g["lr"] for g in opt.param_groups]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(foreign.state_dict())
    assert_same(opt.state_dict(), before)
    for p, st in opt.state.items():  # the very same tensors, untouched
        assert set(st) == set(live[id(p)]) and all(st[k] is v for k, v in live[id(p)].items())
    assert all(g["lr"] is lr for g, lr in zip(opt.param_groups, lrs))
    # and it trains on exactly as an optimizer that never saw the bad checkpoint
    torch.manual_seed(0)
    twin_model, twin = _trained(mine_fn, backend=backend)
    x, y = torch.randn(4, 12, generator=gen(99)), torch.randint(0, 10, (4,), generator=gen(98))
    train_step(mine, opt, _ce, (x, y))
    train_step(twin_model, twin, _ce, (x, y))
    for p, q in zip(mine.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------------ 5. NaN
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_statistic_never_reaches_a_factor(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = make_opt(AdaFisher, model, backend)

    def batch(k, poison=False):
        x = torch.randn(4, 6, generator=gen(k))
        if poison:
            x[0, 0] = float("nan")
        return x, torch.tensor(500 + k)

    for k in range(TCOV):
        train_step(model, opt, _loss, batch(k))
    assert opt.skipped_factor_updates == 0
    anchors = [opt.state[model[0].weight], opt.state[model[2].weight]]
    keep = [{k: st[k].clone() for k in ("fisher_S", "fisher_H")} for st in anchors]
    params = [p.detach().clone() for p in model.parameters()]
    # k = TCov, a curvature step: NaN in the input puts NaN in all four statistics
    opt.zero_grad()
    loss = _loss(model, *batch(TCOV, poison=True))
    loss.backward()
    assert torch.isnan(loss)
    opt.zero_grad(set_to_none=True)  # keep the parameters finite: only the factors are at stake
    opt.step()
    for st, kept in zip(anchors, keep):
        for key, value in kept.items():
            assert torch.equal(st[key], value), f"{key} changed by a NaN statistic"
    assert opt.skipped_factor_updates == 4
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    for k in range(TCOV + 1, 2 * TCOV + 1):  # the next curvature step updates them again
        train_step(model, opt, _loss, batch(k))
    for st, kept in zip(anchors, keep):
        for key, value in kept.items():
            assert torch.isfinite(st[key]).all() and not torch.equal(st[key], value)
    assert opt.skipped_factor_updates == 4


# ----------------------------------------------------------------------------------- kept between steps
def _one_step(model, opt):
    opt.zero_grad()
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()


def test_a_bad_value_written_in_place_between_steps_is_refused_before_any_write():
    """The step keeps what it checked; a hyperparameter tensor written in place (a new version)
    is checked again, and the step refuses it with nothing written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = AdaFisher(model, lr=torch.tensor(1e-2), TCov=1)
    _one_step(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"].fill_(-1.0)
    opt.zero_grad()
    model(torch.randn(4, 6)).square().sum().backward()
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.param_groups[0]["lr"].fill_(1e-2)
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_an_edited_parameter_list_is_followed():
    """A group's parameter list edited between steps (a parameter dropped) is what the next
    step updates: the dropped parameter stays as it is, the others move."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = AdaFisher(model, lr=1e-2, TCov=1)
    _one_step(model, opt)
    dropped = opt.param_groups[0]["params"].pop()
    kept = dropped.detach().clone()
    others = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    _one_step(model, opt)
    assert torch.equal(dropped, kept)
    assert all(not torch.equal(p, b) for p, b in zip(opt.param_groups[0]["params"], others))


def test_a_loaded_checkpoint_is_stepped_from_its_own_state():
    """After load_state_dict (new state tensors) the step reads and writes the loaded ones: two
    optimizers loaded from one checkpoint take the same step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = AdaFisher(model, lr=1e-2, TCov=1)
    _one_step(model, opt)
    twin = copy.deepcopy(model)
    twin_opt = AdaFisher(twin, lr=1e-2, TCov=1)
    _one_step(twin, twin_opt)  # its kept step tensors must give way to the loaded state
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(opt.state_dict())
    x = torch.randn(4, 6)
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], twin_opt.state[q]["exp_avg"])


def test_an_eager_fused_step_allocates_nothing():
    """After the first steps (state built, step tensors kept), an eager fused AdaFisher step
    writes in place: no tensor is allocated (the bench's "0 B" row, here on a small model)."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = AdaFisher(model, lr=1e-3, TCov=10**9)
    opt.step()
    opt.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    allocated = [(e.name, e.cpu_memory_usage) for e in prof.events()
                 if e.name.startswith("aten::empty") and e.cpu_memory_usage > 0]
    assert not allocated, allocated


# ------------------------------------------------------------- what a step keeps, and what drops it
# A step keeps what it checked (hyperparameter tensors, gradients it saw before, the op's lists);
# each thing that can change between steps must be seen at the next step.
def _linear_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _kept_gradients(model, opt, steps=2):
    """Gradients set once and stepped on `steps` times (zero_grad(set_to_none=False) keeps the
    same tensors): the later steps take the kept path."""
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(3))).square().sum().backward()
    for _ in range(steps):
        opt.step()


def _written(model, opt):
    """All a step may write: the parameters and the optimizer's state."""
    return [p.detach().clone() for p in model.parameters()] + [
        t.detach().clone() for s in opt.state.values() for t in s.values()]


def _unchanged(before, after):
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("how", ["new tensor", "new memory"])
def test_a_gradient_of_another_dtype_after_kept_steps_is_refused_before_any_write(how):
    model = _linear_model()
    opt = AdaFisher(model, lr=1e-2, TCov=1)
    _kept_gradients(model, opt)
    p = model[2].weight
    if how == "new tensor":
        p.grad_dtype = None
        p.grad = p.grad.double()
    else:  # the same gradient object, given float64 memory
        p.grad.data = p.grad.data.double()
    before = _written(model, opt)
    with pytest.raises(ValueError, match=r"param group 0, parameter of shape \(3, 5\).*float64"):
        opt.step()
    assert _unchanged(before, _written(model, opt))


@pytest.mark.parametrize("how", ["resize_", "t_"])
def test_a_gradient_reshaped_in_place_after_kept_steps_is_refused_before_any_write(how):
    """In place, the gradient keeps its memory and changes shape: seen before the step counts
    are written."""
    model = _linear_model()
    opt = AdaFisher(model, lr=1e-2, TCov=1)
    _kept_gradients(model, opt)
    g = model[2].weight.grad
    with torch.no_grad():
        g.resize_(15) if how == "resize_" else g.t_()
    before = _written(model, opt)
    with pytest.raises(ValueError, match=r"param group 0, parameter of shape \(3, 5\)"):
        opt.step()
    assert _unchanged(before, _written(model, opt))


def test_a_model_moved_to_channels_last_after_kept_steps_is_refused_before_any_write():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    opt = AdaFisher(model, lr=1e-2, TCov=1)
    model(torch.randn(2, 3, 6, 6)).square().sum().backward()
    opt.step()
    opt.step()
    model.to(memory_format=torch.channels_last)  # `.data =` on the weight and its gradient
    before = _written(model, opt)
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    assert _unchanged(before, _written(model, opt))


@pytest.mark.parametrize("name, bad", [("lr", -1.0), ("beta", 1.0), ("Lambda", math.nan),
                                       ("weight_decay", math.inf)])
def test_a_setting_written_out_of_range_after_kept_steps_is_refused_before_any_write(name, bad):
    model = _linear_model()
    opt = AdaFisher(model, lr=1e-2, TCov=1)
    _kept_gradients(model, opt)
    opt.param_groups[0][name].fill_(bad)
    before = _written(model, opt)
    with pytest.raises(ValueError, match=name):
        opt.step()
    assert _unchanged(before, _written(model, opt))


@pytest.mark.parametrize("replace", ["number", "tensor"])
def test_a_setting_replaced_after_kept_steps_is_read(replace):
    """A group's lr and Lambda replaced by a number or another tensor step as a write in place
    into the kept tensors does (the op's settings are not kept past the objects they came from)."""
    models = [_linear_model(), _linear_model()]
    opts = [AdaFisher(m, lr=1e-2, TCov=1) for m in models]
    for m, o in zip(models, opts):
        _kept_gradients(m, o)
    for name, value in (("lr", 0.5), ("Lambda", 0.25)):
        opts[0].param_groups[0][name].fill_(value)
        opts[1].param_groups[0][name] = value if replace == "number" else torch.tensor(value)
    for o in opts:
        o.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    opts[1].param_groups[0]["lr"] = -1.0  # and the new value is checked
    with pytest.raises(ValueError, match="lr"):
        opts[1].step()


def test_a_param_group_added_after_kept_steps_is_checked_and_stepped():
    model = _linear_model()
    opt = AdaFisher(model, lr=1e-2, TCov=1, params=model[0].parameters())
    _kept_gradients(model, opt)
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.5})
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.param_groups[1]["lr"].fill_(math.nan)
    before = _written(model, opt)
    with pytest.raises(ValueError, match="param group 1: lr"):
        opt.step()
    assert _unchanged(before, _written(model, opt))


def test_a_checkpoint_loaded_after_kept_steps_is_stepped_with_its_settings():
    models = [_linear_model(), _linear_model()]
    opts = [AdaFisher(models[0], lr=1e-2, Lambda=0.1, TCov=1),
            AdaFisher(models[1], lr=0.5, Lambda=1e-3, TCov=1)]
    for m, o in zip(models, opts):
        _kept_gradients(m, o)
    models[1].load_state_dict(models[0].state_dict())
    opts[1].load_state_dict(opts[0].state_dict())
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        q.grad.copy_(p.grad)
    for o in opts:
        o.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


def test_a_dropped_gradient_is_freed():
    """The step remembers the gradients it checked weakly: zero_grad(set_to_none=True) frees them."""
    import gc
    import weakref
    model = _linear_model()
    opt = AdaFisher(model, lr=1e-2, TCov=1)
    _kept_gradients(model, opt)
    grads = [weakref.ref(p.grad) for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(g() is None for g in grads)
