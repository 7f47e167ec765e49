"""cafin.SINGD against an independent float64 oracle written from the maths
(arXiv 2312.05705, singd 0.0.5's conventions), and fused against reference.

The oracle keeps every factor as a dense matrix and each structure as a projection written the
most direct way (an entry mask with the tangent-space factor 2 on the folded blocks of the
hierarchical structure; Toeplitz coefficients from the diagonals one by one). It imports nothing
from cafin. Side-by-side numbers against the singd package itself are in docs/singd.md (CI does
not have singd).
"""
from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.optests import generate_opcheck_tests

import cafin
from cafin.optim.singd import structures as S

import two_ranks
from devices import DEVICES

STRUCTS = ["dense", "diagonal", "block30diagonal", "hierarchical15_15", "triltoeplitz", "triutoeplitz"]


# ------------------------------------------------------------------------------ oracle: structures
def pattern(name: str, d: int) -> torch.Tensor:
    """Pi(M) = W * M for the entrywise structures: W holds 0, 1 or the factor 2 of the entries a
    symmetric M's lower part folds onto."""
    W = torch.zeros(d, d, dtype=torch.float64)
    if name == "dense":
        W[:] = 1
    elif name == "diagonal":
        W.fill_diagonal_(1)
    elif name == "block30diagonal":
        for s in range(0, d, 30):
            W[s:s + 30, s:s + 30] = 1
    elif name == "hierarchical15_15":
        k1 = min(d, 15)
        k2 = min(max(d - 15, 0), 15)
        mid = d - k1 - k2
        W[:k1, :k1] = 1
        W[:k1, k1:] = 2
        for i in range(k1, k1 + mid):
            W[i, i] = 1
        W[k1 + mid:, k1:k1 + mid] = 2
        W[k1 + mid:, k1 + mid:] = 1
    return W


def project(name: str, M: torch.Tensor) -> torch.Tensor:
    d = M.shape[0]
    if name in ("triltoeplitz", "triutoeplitz"):
        out = torch.zeros_like(M)
        for k in range(d):
            c = torch.diagonal(M, k).sum() / d if k == 0 else \
                (torch.diagonal(M, k).sum() + torch.diagonal(M, -k).sum()) / (d - k)
            torch.diagonal(out, -k if name == "triltoeplitz" else k).fill_(c)
        return out
    return pattern(name, d).to(M) * M


def tr(K: torch.Tensor, name: str, singd_blocks: bool) -> torch.Tensor:
    """What singd multiplies by where K^T is meant (K itself for its block-diagonal)."""
    return K if (name == "block30diagonal" and singd_blocks) else K.T


# ------------------------------------------------------------------------------ oracle: rows
def oracle_rows(m: nn.Module, x: torch.Tensor, g: torch.Tensor, la, approx):
    if isinstance(m, nn.Conv2d):
        G = m.groups
        x = x.reshape(x.shape[0], G, -1, *x.shape[2:]).mean(1)
        pad = m.padding if not isinstance(m.padding, str) else (0, 0)
        cols = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=pad, stride=m.stride)
        a = cols.transpose(1, 2).reshape(-1, cols.shape[1]) if approx == "expand" else cols.mean(2)
        gg = g.flatten(2).transpose(1, 2)
    else:
        xs = x.reshape(x.shape[0], -1, x.shape[-1])
        a = xs.reshape(-1, xs.shape[-1]) if approx == "expand" else xs.mean(1)
        gg = g.reshape(g.shape[0], -1, g.shape[-1])
    if m.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
    a = a / math.sqrt(a.shape[0])
    terms = 1 if la is None else gg.shape[0] * (gg.shape[1] if la == "batch+sequence" else 1)
    grows = gg.reshape(-1, gg.shape[-1]) if approx == "expand" else gg.sum(1)
    return a, grows * math.sqrt(terms)


class Oracle:
    """SINGD with dense factors, one layer at a time, from the formulas of §5.2-§5.4."""

    def __init__(self, model, lr=1e-3, momentum=0.9, damping=1e-3, alpha1=0.5, weight_decay=0.0,
                 T=10, loss_average="batch", lr_cov=1e-2, structures=("dense", "dense"),
                 kfac_approx="expand", kfac_like=False, normalize_lr_cov=False, singd_blocks=True,
                 groups=None):
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        base = dict(lr=lr, momentum=momentum, damping=damping, alpha1=0.0 if kfac_like else alpha1,
                    weight_decay=weight_decay, T=T, loss_average=loss_average, lr_cov=lr_cov,
                    structures=structures, kfac_approx=kfac_approx, kfac_like=kfac_like,
                    normalize_lr_cov=normalize_lr_cov)
        self.hp = {m: dict(base, **((groups or {}).get(i, {}))) for i, m in enumerate(self.layers)}
        self.singd_blocks = singd_blocks
        self.k = 0
        self.f = {}
        for m in self.layers:
            dk = m.weight[0].numel() + (m.bias is not None)
            dc = m.weight.shape[0]
            self.f[m] = dict(K=torch.eye(dk, dtype=torch.float64), C=torch.eye(dc, dtype=torch.float64),
                             mK=torch.zeros(dk, dk, dtype=torch.float64),
                             mC=torch.zeros(dc, dc, dtype=torch.float64))
        self.buf = {}

    def step(self, loss_fn):
        io = {}
        hooks = [m.register_forward_hook(lambda m, i, o: io.__setitem__(m, (i[0].detach(), o)))
                 for m in self.layers]
        loss = loss_fn()
        for h in hooks:
            h.remove()
        outs = [io[m][1] for m in self.layers]
        params = [p for m in self.layers for p in m.parameters()]
        grads = torch.autograd.grad(loss, params + outs)
        pgrad = dict(zip(params, grads[:len(params)]))
        ograd = dict(zip(self.layers, grads[len(params):]))
        for m in self.layers:
            hp, f = self.hp[m], self.f[m]
            sk, sc = hp["structures"]
            tK = lambda K: tr(K, sk, self.singd_blocks)  # noqa: E731
            tC = lambda C: tr(C, sc, self.singd_blocks)  # noqa: E731
            if self.k % hp["T"] == 0:
                a, g = oracle_rows(m, io[m][0], ograd[m], hp["loss_average"], hp["kfac_approx"])
                K, C = f["K"], f["C"]
                HK = project(sk, tK(K) @ a.T @ a @ tK(K).T)
                HC = project(sc, tC(C) @ g.T @ g @ tC(C).T)
                KtK, CtC = project(sk, tK(K) @ tK(K).T), project(sc, tC(C) @ tC(C).T)
                at = lambda M: torch.diagonal(M).mean()  # noqa: E731
                s = 0.5 * ((1 - hp["alpha1"]) if hp["normalize_lr_cov"] else 1.0)
                IK, IC = torch.eye(K.shape[0], dtype=K.dtype), torch.eye(C.shape[0], dtype=C.dtype)
                if hp["kfac_like"]:
                    nK = s * (HK + hp["damping"] * KtK - IK)
                    nC = s * (HC + hp["damping"] * CtC - IC)
                else:
                    nK = s * (at(HC) * HK + hp["damping"] * at(CtC) * KtK - IK)
                    nC = s * (at(HK) * HC + hp["damping"] * at(KtK) * CtC - IC)
                nK = nK + hp["alpha1"] * f["mK"]
                nC = nC + hp["alpha1"] * f["mC"]
                f["mK"], f["mC"] = nK, nC
                lr_cov = hp["lr_cov"](self.k) if callable(hp["lr_cov"]) else hp["lr_cov"]
                bK, bC = lr_cov, lr_cov
                if hp["normalize_lr_cov"]:
                    # the largest stored entry: Pi's structure only (a diagonal stores d numbers)
                    store = lambda M, name: M[pattern(name, M.shape[0]) != 0] if name not in (  # noqa: E731
                        "triltoeplitz", "triutoeplitz") else M[:, 0] if name == "triltoeplitz" else M[0]
                    bK /= max(1.0, store(nK, sk).abs().max().item())
                    bC /= max(1.0, store(nC, sc).abs().max().item())
                f["K"] = K - bK * K @ nK
                f["C"] = C - bC * C @ nC
            gw = pgrad[m.weight].reshape(m.weight.shape[0], -1)
            gm = torch.cat([gw, pgrad[m.bias][:, None]], 1) if m.bias is not None else gw
            K, C = f["K"], f["C"]
            nat = C @ tC(C) @ gm @ tK(K).T @ K.T
            pieces = [nat[:, :-1], nat[:, -1]] if m.bias is not None else [nat]
            with torch.no_grad():
                for p, u in zip(m.parameters(), pieces):
                    u = u.reshape(p.shape) + hp["weight_decay"] * p
                    if hp["momentum"] != 0:
                        self.buf[p] = hp["momentum"] * self.buf.get(p, torch.zeros_like(p)) + u
                        u = self.buf[p]
                    p.sub_(hp["lr"] * u)
        self.k += 1


# ------------------------------------------------------------------------------ models and runs
def mlp():
    return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 5, bias=False), nn.Tanh(),
                         nn.Linear(5, 3))


def cnn():
    return nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(6, 6, 3, stride=2, groups=2, dilation=2, padding=2, bias=False),
                         nn.ReLU(), nn.Conv2d(6, 4, 2), nn.Flatten(), nn.Linear(64, 3))


def batch(kind, gen, dtype):
    shape = {"mlp": (8, 7), "seq": (4, 5, 7), "cnn": (5, 4, 9, 9)}[kind]
    out = {"mlp": (8, 3), "seq": (4, 5, 3), "cnn": (5, 3)}[kind]
    return (torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(*out, generator=gen, dtype=torch.float64).to(dtype))


def run_pair(kind, steps=5, dtype=torch.float64, backend="fused", oracle_kw=None, groups=None,
             cafin_kw=None, with_oracle=True, **kw):
    torch.manual_seed(0)
    m64 = (cnn() if kind == "cnn" else mlp()).double()
    m = copy.deepcopy(m64).to(dtype)
    red = "sum" if kw.get("loss_average", "batch") is None else "mean"
    oracle = Oracle(m64, groups=groups, **kw, **(oracle_kw or {}))
    if groups:
        layers = [x for x in m.modules() if isinstance(x, (nn.Linear, nn.Conv2d))]
        params = [dict(params=list(layer.parameters()), **groups.get(i, {})) for i, layer in enumerate(layers)]
    else:
        params = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = cafin.SINGD(m, params, backend=backend, **kw, **(cafin_kw or {}))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = batch(kind, gen, dtype)
        if with_oracle:
            oracle.step(lambda: F.mse_loss(m64(x.double()), y.double(), reduction=red))
        opt.zero_grad()
        F.mse_loss(m(x), y, reduction=red).backward()
        opt.step()
    return m64, m, opt


def rel_err(m64, m):
    return max(((p - q.double()).norm() / p.norm()).item() for p, q in zip(m64.parameters(), m.parameters()))


def moved(m64, kind):
    torch.manual_seed(0)
    m0 = (cnn() if kind == "cnn" else mlp()).double()
    return max(((p - q).norm() / q.norm()).item() for p, q in zip(m64.parameters(), m0.parameters()))


# ------------------------------------------------------------------------------ structures
@pytest.mark.parametrize("name", STRUCTS)
@pytest.mark.parametrize("exact", [False, True])
def test_structure_ops_match_dense(name, exact):
    cls = S.structure(name, exact)
    gen = torch.Generator().manual_seed(0)
    for d in (1, 7, 16, 31, 47, 62):
        M = torch.randn(d, d, generator=gen, dtype=torch.float64)
        M = M + M.T
        P = project(name, M)
        assert torch.allclose(cls.dense(cls.project(M)), P, atol=1e-12)
        # a group element far from symmetric: I + 0.3 Pi(M) + 0.2 Pi(N)^2 ...
        K = tuple(e + 0.1 * p for e, p in zip(cls.eye(d, torch.float64), cls.project(M)))
        N = torch.randn(d, d, generator=gen, dtype=torch.float64)
        K = cls.product(K, tuple(e + 0.1 * p for e, p in zip(cls.eye(d, torch.float64), cls.project(N + N.T))))
        Kd = cls.dense(K)
        if name not in ("triltoeplitz", "triutoeplitz"):  # the product stays in the structure
            assert (Kd[pattern(name, d) == 0] == 0).all()
        X = torch.randn(d, 6, generator=gen, dtype=torch.float64)
        tK = tr(Kd, name, not exact)
        assert torch.allclose(cls.matmul(K, X), Kd @ X, atol=1e-12)
        assert torch.allclose(cls.rmatmat(K, X), tK @ X, atol=1e-12)
        assert torch.allclose(cls.dense(cls.product(K, cls.project(M))), Kd @ P, atol=1e-12)
        assert torch.allclose(cls.dense(cls.inner(K, X)), project(name, tK @ X @ X.T @ tK.T), atol=1e-11)
        assert torch.allclose(cls.dense(cls.inner(K)), project(name, tK @ tK.T), atol=1e-12)
        assert torch.allclose(cls.dense(cls.mat_inner(X)), project(name, X @ X.T), atol=1e-11)
        assert torch.allclose(cls.average_trace(K), torch.diagonal(Kd).mean(), atol=1e-12)
        assert torch.equal(cls.dense(cls.eye(d, torch.float64)), torch.eye(d, dtype=torch.float64))
        assert [tuple(p.shape) for p in cls.eye(d)] == [tuple(s) for s in cls.shapes(d)]


# ------------------------------------------------------------------------------ optimizer vs oracle
CASES = [("mlp", dict(structures=(s, s), T=2, lr=0.05, lr_cov=0.05)) for s in STRUCTS] + [
    ("cnn", dict(structures=(s, s), T=2, lr=0.03, lr_cov=0.05)) for s in ("dense", "diagonal", "hierarchical15_15")
] + [
    ("seq", dict(loss_average="batch+sequence", kfac_approx="expand", T=2, lr=0.02, lr_cov=0.05)),
    ("seq", dict(loss_average=None, kfac_approx="reduce", T=2, lr=0.002, lr_cov=0.005)),
    ("cnn", dict(loss_average="batch+sequence", kfac_approx="reduce", T=2, lr=0.02, lr_cov=0.05)),
    ("cnn", dict(loss_average=None, kfac_approx="expand", T=3, lr=0.002, lr_cov=0.005)),
    ("cnn", dict(normalize_lr_cov=True, lr_cov=0.5, T=1, lr=0.02, structures=("dense", "diagonal"))),
    ("mlp", dict(normalize_lr_cov=True, lr_cov=0.5, T=1, lr=0.02, structures=("triutoeplitz", "block30diagonal"))),
    ("mlp", dict(kfac_like=True, alpha1=0.0, lr_cov=0.1, T=1, lr=0.02)),
    ("cnn", dict(kfac_like=True, alpha1=0.0, lr_cov=0.1, T=2, lr=0.02, structures=("hierarchical15_15", "diagonal"))),
    ("mlp", dict(weight_decay=0.1, momentum=0.0, alpha1=0.0, lr_cov=lambda k: 0.01 * (k + 1), T=1)),
]


@pytest.mark.parametrize("kind,kw", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_matches_oracle_float64(kind, kw):
    m64, m, _ = run_pair(kind, **kw)
    assert moved(m64, kind) > 1e-3  # the comparison is not between two untrained models
    assert rel_err(m64, m) < 1e-10


@pytest.mark.parametrize("kind,kw", [CASES[0], CASES[1], CASES[7], CASES[10]])
def test_float32_close_to_oracle(kind, kw):
    m64, m, _ = run_pair(kind, dtype=torch.float32, **kw)
    assert rel_err(m64, m) < 1e-4


FUSED_CASES = [CASES[i] for i in (0, 1, 2, 3, 4, 5, 8, 13, 14, 15, 17)]


@pytest.mark.parametrize("kind,kw", FUSED_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(FUSED_CASES)])
def test_fused_equals_reference(kind, kw):
    """The fused backend (preconditioner-update ops, diagonal step op, SGD epilogue op) against
    the per-layer plain-PyTorch backend: every structure, IKFAC, normalize_lr_cov, alpha1 = 0."""
    _, a, oa = run_pair(kind, backend="fused", with_oracle=False, **kw)
    _, b, ob = run_pair(kind, backend="reference", with_oracle=False, **kw)
    assert max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())) < 1e-12
    for p, q in zip(a.parameters(), b.parameters()):
        for key, v in oa.state[p].items():
            assert v.numel() == 0 or (v - ob.state[q][key]).abs().max().item() < 1e-12, key


@pytest.mark.parametrize("kind,kw", [CASES[1], CASES[3], CASES[8]])
def test_fused_equals_reference_float32(kind, kw):
    _, a, _ = run_pair(kind, dtype=torch.float32, backend="fused", with_oracle=False, **kw)
    _, b, _ = run_pair(kind, dtype=torch.float32, backend="reference", with_oracle=False, **kw)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_per_group_structures_and_hyperparameters():
    groups = {0: dict(structures=("diagonal", "dense"), lr=0.02), 1: dict(structures=("hierarchical15_15", "triltoeplitz"), T=1),
              2: dict(kfac_like=True, alpha1=0.0, damping=0.01)}
    m64, m, opt = run_pair("mlp", T=2, lr=0.05, lr_cov=0.05, groups=groups)
    assert rel_err(m64, m) < 1e-10
    assert opt.state[m[0].weight]["K.0"].shape == (8,)  # diagonal K of the first layer


def test_block30_exact_transposes():
    kw = dict(structures=("block30diagonal", "block30diagonal"), T=1, lr=0.05, lr_cov=0.2)
    m64, m, _ = run_pair("mlp", steps=4, oracle_kw=dict(singd_blocks=False),
                         cafin_kw=dict(exact_block_transposes=True), **kw)
    assert rel_err(m64, m) < 1e-10
    _, m_singd, _ = run_pair("mlp", steps=4, with_oracle=False, **kw)  # singd's transposes differ once K is not symmetric
    assert rel_err(m64, m_singd) > 1e-8


# ------------------------------------------------------------------------------ beyond singd
def test_inplace_activation_after_view_output():
    """Linear on 3-D input (its output is a view) followed by an in-place ReLU: singd's tensor
    hook never fires (KeyError at the step); cafin takes the statistics."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(7, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    b = copy.deepcopy(a)
    b[1] = nn.ReLU()
    oa = cafin.SINGD(a, T=1, lr=0.05, lr_cov=0.1)
    ob = cafin.SINGD(b, T=1, lr=0.05, lr_cov=0.1)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 5, 7, generator=gen, dtype=torch.float64)
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert (oa.state[a[0].weight]["K.0"] != torch.eye(8, dtype=torch.float64)).any()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_closure_and_clipping():
    torch.manual_seed(0)
    m = mlp().double()
    m2 = copy.deepcopy(m)
    o = cafin.SINGD(m, T=1, lr=0.05, lr_cov=0.1)
    o2 = cafin.SINGD(m2, T=1, lr=0.05, lr_cov=0.1)
    x, y = torch.randn(8, 7, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def closure():
        o.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        return loss

    for _ in range(2):
        loss = o.step(closure)
        assert isinstance(loss, torch.Tensor)
        o2.zero_grad()
        F.mse_loss(m2(x), y).backward()
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.1)
        o2.step()
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_unsupported_parameters():
    m = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2)).double()
    with pytest.warns(UserWarning, match="un-supported"):
        opt = cafin.SINGD(m)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for i in (0, 2) for p in m[i].parameters()}
    # passed explicitly, they are trained with the plain gradient (singd never updates them)
    del opt
    opt = cafin.SINGD(m, list(m.parameters()), lr=0.1, momentum=0.0)
    m(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    before = m[1].weight.detach().clone()
    opt.step()
    torch.testing.assert_close(m[1].weight, before - 0.1 * m[1].weight.grad)


def test_state_dict_round_trip():
    kw = dict(structures=("hierarchical15_15", "diagonal"), T=2, lr=0.05, lr_cov=0.05)
    torch.manual_seed(0)
    m = mlp().double()
    m2 = copy.deepcopy(m)
    o = cafin.SINGD(m, **kw)
    gen = torch.Generator().manual_seed(3)
    data = [batch("mlp", gen, torch.float64) for _ in range(6)]
    for i, (x, y) in enumerate(data):
        if i == 3:
            sd = o.state_dict()
            saved = copy.deepcopy(sd)
            m2.load_state_dict(m.state_dict())
            o2 = cafin.SINGD(m2, **kw)
            o2.load_state_dict(sd)
            assert str(sd) == str(saved)  # the argument is not modified
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    for x, y in data[3:]:
        o2.zero_grad()
        F.mse_loss(m2(x), y).backward()
        o2.step()
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_core_validation_leaves_nothing_half_done():
    """The family core's contract: a bad hyperparameter set between steps is rejected before the
    step writes anything; a rejected param group or checkpoint leaves the optimizer as it was;
    hyperparameters are 0-dim tensors; the checkpoint carries the curvature entry."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2), nn.Linear(2, 2)).double()
    o = cafin.SINGD(m, [{"params": list(m[0].parameters()) + list(m[2].parameters())}], T=1,
                    structures=("dense", "diagonal"), lr=0.05, lr_cov=0.1)
    group = o.param_groups[0]
    assert all(isinstance(group[k], torch.Tensor) and group[k].dim() == 0
               for k in ("lr", "momentum", "damping", "weight_decay", "lr_cov"))
    x = torch.randn(3, 4, dtype=torch.float64)
    m(x).square().sum().backward()
    o.step()
    snapshot = copy.deepcopy(o.state_dict())
    params = [p.detach().clone() for p in m.parameters()]
    group["momentum"] = -0.5
    with pytest.raises(ValueError, match="momentum"):
        o.step()
    group["momentum"] = 0.9
    group["structures"] = ("dense", "lowrank")
    with pytest.raises(ValueError, match="structure"):
        o.step()
    group["structures"] = ("dense", "diagonal")
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
    assert str(o.state_dict()["state"]) == str(snapshot["state"])
    with pytest.raises(ValueError, match="weight_decay"):
        o.add_param_group({"params": list(m[3].parameters()), "weight_decay": -1.0})
    with pytest.raises(ValueError, match="T"):
        o.add_param_group({"params": list(m[3].parameters()), "T": 0})
    assert len(o.param_groups) == 1 and m[3].weight not in o.state
    bad = copy.deepcopy(snapshot)
    key = next(k for k, v in bad["state"].items() if "K.0" in v)
    bad["state"][key]["K.0"] = torch.zeros(3, 3, dtype=torch.float64)  # the wrong shape
    with pytest.raises(ValueError, match="K.0"):
        o.load_state_dict(bad)
    assert str(o.state_dict()["state"]) == str(snapshot["state"])
    curvature = snapshot["param_groups"][0]["curvature"]  # in the groups: DCP keeps only those
    assert curvature["k"] == 1 and curvature["grad_scale_prev"] == 1.0
    o.add_param_group({"params": list(m[3].parameters()), "structures": ("diagonal", "dense")})
    assert o.state[m[3].weight]["K.0"].shape == (3,)
    m(x).square().sum().backward()
    o.step()


def test_bad_arguments():
    m = nn.Linear(3, 2)
    for kw, match in [(dict(lr=-1.0), "lr"), (dict(T=0), "T"), (dict(loss_average="mean"), "loss_average"),
                      (dict(kfac_approx="x"), "kfac_approx"), (dict(structures=("dense", "lowrank")), "structure"),
                      (dict(preconditioner_dtype=(torch.int32, None)), "preconditioner_dtype"),
                      (dict(backend="cuda"), "backend"), (dict(lr_cov="0.1"), "lr_cov")]:
        with pytest.raises((ValueError, TypeError), match=match):
            cafin.SINGD(m, **kw)
    with pytest.warns(UserWarning, match="alpha1"):
        opt = cafin.SINGD(m, kfac_like=True)
    assert opt.param_groups[0]["alpha1"] == 0.0
    n = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="different parameter groups"):
        cafin.SINGD(n, [{"params": [n.weight]}, {"params": [n.bias], "lr": 0.1}])


def test_ddp_wrapped_model(tmp_path):
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        m = mlp().double()
        m2 = copy.deepcopy(m)
        ddp = nn.parallel.DistributedDataParallel(m)
        o = cafin.SINGD(ddp, T=1, lr=0.05, lr_cov=0.1)
        o2 = cafin.SINGD(m2, T=1, lr=0.05, lr_cov=0.1)
        x, y = torch.randn(8, 7, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
        for _ in range(2):
            for model, opt in ((ddp, o), (m2, o2)):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        for p, q in zip(m.parameters(), m2.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
        # DDP's reducer holds the process group: release it before the group is destroyed (a
        # gloo group destroyed under a live reducer can hang joining its threads).
        del o, ddp
        import gc
        gc.collect()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ compile
def _two_group_model():
    """Two layers in two groups of different intervals, T = 2 (a callable lr_cov) and T = 3 (a
    tensor lr_cov): four phases (which groups are due), every one of them seen by step 6."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 17), nn.ReLU(), nn.Linear(17, 3)).double()


def _two_groups(m, structures):
    groups = [dict(params=list(m[0].parameters()), T=2, structures=structures[0],
                   lr_cov=lambda k: 0.05 / (1 + k)),
              # normalize_lr_cov: the inf-norms of the new momenta, taken by list ops
              dict(params=list(m[2].parameters()), T=3, structures=structures[1],
                   normalize_lr_cov=True)]
    return cafin.SINGD(m, groups, lr=0.05, lr_cov=0.05)


def _schedule(opt, sched, k):
    """lr by StepLR; the tensor lr_cov, momentum, weight decay and damping filled every step."""
    sched.step()
    opt.param_groups[1]["lr_cov"].fill_(0.05 * (k + 2) / 5)
    for group in opt.param_groups:
        group["momentum"].fill_(0.9 - 0.05 * k)
        group["weight_decay"].fill_(0.01 * k)
        group["damping"].fill_(1e-3 * (k + 1))


@pytest.mark.parametrize("structures", [(("dense", "dense"), ("hierarchical15_15", "diagonal")),
                                        (("diagonal", "diagonal"), ("triltoeplitz", "diagonal"))],
                         ids=["dense+hierarchical", "diagonal+toeplitz"])
def test_compiled_step_equals_eager_with_a_graph_per_phase(structures):
    """A compiled step decides from the host count: it equals the eager step (float64) under
    schedules of every tensor setting, builds at most one graph per phase besides the first
    step's, and none once every phase has been seen."""
    from torch._dynamo.utils import counters
    m, m2 = _two_group_model(), _two_group_model()
    o, o2 = _two_groups(m, structures), _two_groups(m2, structures)
    s1 = torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 1, gamma=0.9)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(o2.step, backend="eager", fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    for k in range(12):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(5, 3, generator=gen, dtype=torch.float64)
        for model, opt, st, sch in ((m, o, o.step, s1), (m2, o2, step, s2)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            st()
            _schedule(opt, sch, k)
        for p, q in zip(m.parameters(), m2.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14, msg=lambda s: f"step {k}: {s}")
        if k == 6:  # k = 0 (its own graph: k is still a constant) and each phase once
            seen = counters["stats"]["unique_graphs"]
            assert seen <= 1 + 4, dict(counters["stats"])
    assert counters["stats"]["unique_graphs"] == seen, dict(counters["stats"])
    assert not counters["graph_break"]
    assert not o2._steps.device_gated
    for layer in (m2[0], m2[2]):  # both groups updated their factors
        K = o2.state[layer.weight]["K.0"]
        assert not torch.equal(K, torch.eye(K.shape[0], dtype=K.dtype) if K.dim() == 2 else torch.ones_like(K))
    torch._dynamo.reset()


def test_compiled_model_and_step_keep_a_graph_per_phase():
    """The statistics hooks traced into a compiled model decide from the host count too: the
    model's graphs are bounded by its phases as the step's are, and training equals eager."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    m = mlp().double()
    m2 = copy.deepcopy(m)
    o, o2 = (cafin.SINGD(model, T=2, lr=0.05, lr_cov=0.1) for model in (m, m2))
    torch._dynamo.reset()
    counters.clear()
    net = torch.compile(m2, backend="eager")
    step = torch.compile(o2.step, backend="eager", fullgraph=True)
    gen = torch.Generator().manual_seed(6)
    for k in range(6):
        x, y = batch("mlp", gen, torch.float64)
        for model, opt, st in ((m, o, o.step), (net, o2, step)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            st()
        if k == 2:  # k = 0 and each phase once, for the model and for the step
            seen = counters["stats"]["unique_graphs"]
            assert seen <= 2 * (1 + 2), dict(counters["stats"])
    assert counters["stats"]["unique_graphs"] == seen, dict(counters["stats"])
    assert not counters["graph_break"]
    for p, q in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14)
    torch._dynamo.reset()


class _Graphs:
    """A torch.compile backend that keeps which of its graphs ran last and, when `count` is set,
    counts the FLOPs of that run (bench.proxies.count_flops: Dynamo runs no frame under a
    dispatch mode, so the count is taken inside the compiled call). The graphs run op by op
    (the eager backend): the ops a compiled step launches, cafin's in-place ops as they are
    (aot_eager wraps them in auto_functionalized, which the counter's mode cannot run)."""

    def __init__(self):
        self.last, self.count, self.flops = None, False, None

    def __call__(self, gm, example_inputs):
        def run(*args):
            self.last = gm
            if not self.count:
                return gm.forward(*args)
            from bench.proxies import count_flops
            out = []
            self.flops = count_flops(lambda: out.append(gm.forward(*args)))
            return out[0]
        return run


def _cafin_ops(gm) -> set[str]:
    return {str(n.target).split(".")[1] for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("cafin.")}


@pytest.mark.parametrize("structures", [("dense", "dense"), ("diagonal", "diagonal")])
def test_a_compiled_step_not_due_does_no_curvature_work(structures):
    """At T = 3, step 4 is not due: the compiled step there does at most 1.05x the FLOPs of the
    eager step 4, and its graph holds neither update op, which the graph of the due step 3 holds
    (the dense update's products would be 3x the not-due step's FLOPs; the diagonal one's are
    elementwise, seen only in the graph)."""
    def run(step_of):
        """Steps 0 to 3 by `step_of(opt)`, then step 4's passes; returns (opt, step)."""
        torch.manual_seed(0)
        m = mlp().double()
        o = cafin.SINGD(m, structures=structures, T=3, lr=0.05, lr_cov=0.1)
        step = step_of(o)
        gen = torch.Generator().manual_seed(5)
        for k in range(5):
            x, y = batch("mlp", gen, torch.float64)
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            if k < 4:
                step()
        return o, step

    from bench.proxies import count_flops  # torch's counter, plus the GEMMs inside cafin's ops
    o, step = run(lambda o: o.step)
    eager = count_flops(step)
    torch._dynamo.reset()
    graphs = _Graphs()
    ran = []  # the graph each step ran

    def compiled(o):
        inner = torch.compile(o.step, backend=graphs, fullgraph=True)

        def step():
            inner()
            ran.append(graphs.last)
        return step
    o, step = run(compiled)
    graphs.count = True
    step()
    assert graphs.flops <= 1.05 * eager, (graphs.flops, eager)
    assert {"singd_momentum_", "singd_factor_step_"} <= _cafin_ops(ran[3])
    assert not {"singd_momentum_", "singd_factor_step_"} & _cafin_ops(ran[4])
    assert ran[4] is ran[1] and ran[3] is not ran[1]  # steps 1 and 4 share the not-due graph
    assert not o._steps.device_gated
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ the fused op


def diag_case(device, dtype, momentum, seed=0):
    """Four parameters: a conv weight [6, 2, 3, 3] and its bias (K offset 18), a Linear weight
    [4, 5] without bias (factor entries away from 1), and a [3, 7] parameter without factors
    (empty K and C: the plain SGD epilogue the other structures' steps use)."""
    g = torch.Generator().manual_seed(seed)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g, dtype=torch.float64).to(dt).to(device)  # noqa: E731
    params = [r(6, 2, 3, 3), r(6), r(4, 5), r(3, 7)]
    K1, C1, K2, C2 = r(19, dt=work) * 0.5 + 1, r(6, dt=work) * 0.5 + 1, r(5, dt=work) + 1, r(4, dt=work) + 1
    none = torch.empty(0, dtype=work, device=device)  # the last parameter has no factors
    return dict(params=params, grads=[r(*p.shape) for p in params],
                momentum_buffers=[r(*p.shape) for p in params] if momentum else [],
                K=[K1, K1, K2, none], C=[C1, C1, C2, none], k_offsets=[0, 18, 0, 0],
                lr=torch.tensor(0.1, dtype=work, device=device),
                momentum=torch.tensor(momentum, dtype=work, device=device),
                weight_decay=torch.tensor(0.01, dtype=work, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("grad_scale", [None, 1.0, 8.0])
def test_diag_step_op_matches_reference_and_oracle(device, dtype, momentum, grad_scale):
    args = diag_case(device, dtype, momentum)
    want = copy.deepcopy(args)
    # the divisor is a 0-dim tensor of the op-math dtype on the device, read there (no host sync)
    scale = None if grad_scale is None else torch.tensor(grad_scale, dtype=args["lr"].dtype, device=device)
    cafin.reference.singd.singd_diag_step_(**want, grad_scale=scale)
    torch.ops.cafin.singd_diag_step_(**args, grad_scale=scale)
    grad_scale = 1.0 if grad_scale is None else grad_scale
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else \
        dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, exp in zip(args["params"] + args["momentum_buffers"], want["params"] + want["momentum_buffers"]):
        torch.testing.assert_close(got, exp, **tol)
    # the oracle: C C^T [G | g_b] K K^T as matrices, then SGD
    if dtype == torch.float64:
        a = diag_case(device, dtype, momentum)
        G = torch.cat([a["grads"][0].reshape(6, -1), a["grads"][1][:, None]], 1) / grad_scale
        nat = torch.diag(a["C"][0] ** 2) @ G @ torch.diag(a["K"][0] ** 2)
        u = nat[:, :-1].reshape(6, 2, 3, 3) + 0.01 * a["params"][0]
        if momentum:
            u = 0.9 * a["momentum_buffers"][0] + u
        torch.testing.assert_close(args["params"][0], a["params"][0] - 0.1 * u, rtol=1e-12, atol=1e-12)
        u = a["grads"][3] / grad_scale + 0.01 * a["params"][3]  # no factors: plain SGD
        if momentum:
            u = 0.9 * a["momentum_buffers"][3] + u
        torch.testing.assert_close(args["params"][3], a["params"][3] - 0.1 * u, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_diag_step_op_opcheck_and_errors(device):
    for momentum in (0.0, 0.9):
        args = diag_case(device, torch.float32, momentum)
        args["params"][0].requires_grad_(True)
        torch.library.opcheck(torch.ops.cafin.singd_diag_step_.default, (), args)
    args = diag_case(device, torch.float32, 0.9)
    before = [p.clone() for p in args["params"]]
    bad = dict(args, k_offsets=[0, 19, 0])  # the bias column past K's end: nothing is written
    with pytest.raises(ValueError, match="k_offset"):
        cafin.ops.singd_diag_step_(**bad)
    with pytest.raises(ValueError, match="momentum_buffers"):
        cafin.ops.singd_diag_step_(**dict(args, momentum_buffers=args["momentum_buffers"][:1]))
    with pytest.raises(TypeError, match="momentum"):  # a float would recompile under a schedule
        cafin.ops.singd_diag_step_(**dict(args, momentum=0.9))
    with pytest.raises(TypeError, match="weight_decay"):
        cafin.ops.singd_diag_step_(**dict(args, weight_decay=args["weight_decay"].double()))
    with pytest.raises(TypeError, match="dtype"):
        cafin.ops.singd_diag_step_(**dict(args, K=[k.double() for k in args["K"]]))
    with pytest.raises(TypeError, match="grad_scale"):  # a host float: a GradScaler's tensor would sync
        cafin.ops.singd_diag_step_(**dict(args, grad_scale=8.0))
    with pytest.raises(TypeError, match="grad_scale"):
        cafin.ops.singd_diag_step_(**dict(args, grad_scale=torch.tensor(8.0, dtype=torch.float64, device=device)))
    with pytest.raises(ValueError, match="grad_scale"):
        cafin.ops.singd_diag_step_(**dict(args, grad_scale=torch.ones(1, device=device)))
    for p, q in zip(args["params"], before):
        assert torch.equal(p, q)


def update_case(name, d, dtype, device, alpha1, seed=0):
    """One factor of structure `name` and size d with parts away from the identity, its momentum
    and curvature parts, the fused ops' arguments for it, and the unfused results to compare."""
    cls = S.structure(name)
    g = torch.Generator().manual_seed(seed)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    rnd = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64)  # noqa: E731
    K = tuple((e.double() + 0.2 * rnd(e)).to(dtype).to(device) for e in cls.eye(d))
    K = cls.product(K, K)  # a group element (Toeplitz stays lower-triangular Toeplitz)
    m_old = tuple((0.3 * rnd(t)).to(dtype).to(device) for t in K)
    H = cls.inner(K, torch.randn(d, 5, generator=g, dtype=torch.float64).to(dtype).to(device))
    c_h, c_d = torch.tensor(0.7, dtype=work, device=device), torch.tensor(0.03, dtype=work, device=device)
    beta = torch.tensor(0.05, dtype=work, device=device)
    return cls, K, m_old, H, c_h, c_d, beta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", STRUCTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha1", [0.0, 0.5])
def test_preconditioner_update_ops_match_unfused(device, name, dtype, alpha1):
    """singd_momentum_ then singd_factor_step_ (projection folds, momentum/trace combination,
    truncated exponential) equal the unfused structure maths (new_momentum, factor_step) and
    the ops' plain-PyTorch references; go=False writes nothing."""
    # bf16: the kernel rounds once (fp32 op-math), the unfused maths after every op, so both are
    # compared with the unfused maths in float64 on the same bf16 inputs, the kernel tighter.
    tols = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.5e-2, 6e-2)}[dtype]
    for d in (7, 47):
        cls, K, m_old, H, c_h, c_d, beta = update_case(name, d, dtype, device, alpha1)
        up = lambda ts: tuple(t.double() for t in ts)  # noqa: E731
        eye = cls.eye(d, torch.float64, device)
        want_m = cafin.maths.singd.new_momentum(cls, up(H), cls.inner(up(K)), eye, c_h.double(),
                                                    c_d.double(), 0.5, alpha1, up(m_old) if alpha1 else None)
        want_K = cafin.maths.singd.factor_step(cls, up(K), want_m, beta.double())
        raw, pi = cls.inner_parts(K)
        for impl, t in ((cafin.ops, tols[0]), (cafin.reference.singd, tols[1])):
            tol = dict(rtol=t, atol=t)
            for go in (True, False):
                m = [t.clone() for t in m_old] if alpha1 else [torch.full_like(t, float("nan")) for t in m_old]
                h, k = [t.clone() for t in H], [t.clone() for t in K]
                flag = torch.tensor(go, device=device)
                n = len(k)
                impl.singd_momentum_(m, h, list(raw), [c_h] * n, [c_d] * n, [flag] * n,
                                     list(cls.eye_kinds(d)), list(pi), [c_h.new_tensor(0.5)] * n,
                                     [c_h.new_tensor(alpha1)] * n)
                km, elementwise = cls.product_parts(tuple(k), tuple(m))
                impl.singd_factor_step_(k, list(km), [beta] * n, [flag] * n, list(elementwise))
                if not go:
                    assert all(torch.equal(a, b) for a, b in zip(k + h, K + H))
                    continue
                assert all((t == 0).all() for t in h)
                for got, exp in zip(m + k, want_m + want_K):
                    torch.testing.assert_close(got, exp.to(got.dtype), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_preconditioner_update_ops_errors_write_nothing(device):
    cls, K, m_old, H, c_h, c_d, beta = update_case("hierarchical15_15", 40, torch.float32, device, 0.5)
    raw, pi = cls.inner_parts(K)
    n, go = len(K), torch.tensor(True, device=device)
    m, h = [t.clone() for t in m_old], [t.clone() for t in H]
    args = [m, h, list(raw), [c_h] * n, [c_d] * n, [go] * n, list(cls.eye_kinds(40)), list(pi),
            [c_h.new_tensor(0.5)] * n, [c_h.new_tensor(0.5)] * n]
    for i, bad, match in [(2, list(raw[:-1]), "KtK"), (3, [c_h.double()] * n, "c_h"),
                          (5, [go.float()] * n, "go"), (2, [r.double() for r in raw], "dtype"),
                          (6, [5] * n, "eye"), (7, [3] * n, "pi"), (8, [0.5] * n, "scale"),
                          (9, [c_h.double()] * n, "alpha1"), (2, [r.T if r.dim() == 2 else r for r in raw], "shape|contiguous")]:
        with pytest.raises((ValueError, TypeError), match=match):
            cafin.ops.singd_momentum_(*(args[:i] + [bad] + args[i + 1:]))
    assert all(torch.equal(a, b) for a, b in zip(m + h, list(m_old) + list(H)))
    k = [t.clone() for t in K]
    with pytest.raises(ValueError, match="beta"):
        cafin.ops.singd_factor_step_(k, list(K), [beta] * (n - 1), [go] * n, [False] * n)
    with pytest.raises(ValueError, match="KM"):
        cafin.ops.singd_factor_step_(k, list(K[:-1]), [beta] * n, [go] * n, [False] * n)
    assert all(torch.equal(a, b) for a, b in zip(k, K))


class TestSingdOps:
    """Small calls of every SINGD op for generate_opcheck_tests (schema, autograd registration,
    fake tensor, AOT dispatch)."""

    def test_singd_diag_step_(self):
        args = diag_case("cpu", torch.float32, 0.9)
        args["params"][0].requires_grad_(False)
        cafin.ops.singd_diag_step_(**args)

    def test_singd_momentum_(self):
        cls, K, m_old, H, c_h, c_d, beta = update_case("hierarchical15_15", 33, torch.float32, "cpu", 0.5)
        raw, pi = cls.inner_parts(K)
        n = len(K)
        raw = [raw[0].detach().requires_grad_(True)] + list(raw[1:])  # the autograd check needs one
        cafin.ops.singd_momentum_([t.clone() for t in m_old], [t.clone() for t in H], list(raw),
                                  [c_h] * n, [c_d] * n, [torch.tensor(True)] * n,
                                  list(cls.eye_kinds(33)), list(pi), [c_h.new_tensor(0.5)] * n,
                                  [c_h.new_tensor(0.5)] * n)

    def test_singd_factor_step_(self):
        cls, K, m_old, H, c_h, c_d, beta = update_case("hierarchical15_15", 33, torch.float32, "cpu", 0.5)
        km, elementwise = cls.product_parts(K, m_old)
        n = len(K)
        km = [km[0].detach().requires_grad_(True)] + list(km[1:])
        cafin.ops.singd_factor_step_([t.clone() for t in K], list(km), [beta] * n,
                                     [torch.tensor(True)] * n, list(elementwise))


generate_opcheck_tests(
    TestSingdOps, ["cafin"], failures_dict_path=str(Path(__file__).with_name("failures_dict.json")),
    additional_decorators={},
    test_utils=["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"])


# ------------------------------------------------------------------------------ GradScaler
@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_equals_unscaled(clip):
    """Scaled gradients (the scale growing every 2 steps, so H_C's previous-scale bookkeeping
    matters) give the unscaled numbers; with unscale_ before the step (clipping) too."""
    torch.manual_seed(0)
    m = mlp().double()
    m2 = copy.deepcopy(m)
    kw = dict(T=1, lr=0.05, lr_cov=0.1, structures=("dense", "diagonal"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    o = cafin.SINGD(m, init_grad_scale=2.0 ** 8, grad_scaler=scaler if clip else None, **kw)
    o2 = cafin.SINGD(m2, **kw)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        x, y = batch("mlp", gen, torch.float64)
        o.zero_grad()
        scaler.scale(F.mse_loss(m(x), y)).backward()
        if clip:
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.2)
        scaler.step(o)
        scaler.update()
        o2.zero_grad()
        F.mse_loss(m2(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.2)
        o2.step()
    assert scaler.get_scale() > 2.0 ** 8
    for p, q in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_grad_scaler_inf_skips_step():
    torch.manual_seed(0)
    m = mlp().double()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    o = cafin.SINGD(m, T=1, init_grad_scale=2.0 ** 4)
    x, y = batch("mlp", torch.Generator().manual_seed(6), torch.float64)
    scaler.scale(F.mse_loss(m(x), y)).backward()
    m[0].weight.grad[0, 0] = float("inf")
    before = copy.deepcopy(m.state_dict())
    K = o.state[m[0].weight]["K.0"].clone()
    with pytest.warns(UserWarning, match="inf"):
        scaler.step(o)
    scaler.update()
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])
    assert torch.equal(o.state[m[0].weight]["K.0"], K)
    assert (o.state[m[0].weight]["H_K.0"] == 0).all()


def test_bf16_preconditioner_close_to_float32():
    """bf16 K, C (singd's preconditioner_dtype): finite, stored in bf16, within bf16 noise of the
    float32-factor run (singd's own bf16 run is as far: docs/singd.md)."""
    torch.manual_seed(0)
    m = mlp()
    m2 = copy.deepcopy(m)
    kw = dict(T=1, lr=0.05, lr_cov=0.05, structures=("dense", "hierarchical15_15"))
    o = cafin.SINGD(m, preconditioner_dtype=(torch.bfloat16, torch.bfloat16), **kw)
    o2 = cafin.SINGD(m2, **kw)
    gen = torch.Generator().manual_seed(7)
    for _ in range(8):
        x, y = batch("mlp", gen, torch.float32)
        for model, opt in ((m, o), (m2, o2)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert o.state[m[0].weight]["K.0"].dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in m.parameters())
    errs = [((p - q).norm() / q.norm()).item() for p, q in zip(m.parameters(), m2.parameters())]
    assert 0 < max(errs) < 3e-2


@pytest.mark.parametrize("structures", [("dense", "dense"), ("block30diagonal", "hierarchical15_15"),
                                        ("triutoeplitz", "diagonal"), ("dense", "hierarchical15_15")])
def test_cached_preconditioner_equals_uncached(structures):
    kw = dict(T=2, lr=0.05, lr_cov=0.1, structures=structures)
    _, a, opt = run_pair("mlp", steps=5, cafin_kw=dict(cache_preconditioner=True), with_oracle=False, **kw)
    _, b, _ = run_pair("mlp", steps=5, with_oracle=False, **kw)
    state = opt.state[a[0].weight]  # only dense factors are cached
    assert ("P_K" in state) == (structures[0] == "dense") and ("P_C" in state) == (structures[1] == "dense")
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-11, atol=1e-13)


# ------------------------------------------------------------------------------ two ranks
_WORKER = r'''
import os, sys, torch
from torch import nn
import torch.nn.functional as F
import cafin
import two_ranks
rank, _ = two_ranks.join(sys.argv[1])
results = {}
for wrap in ("ddp", "plain"):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).double()
    model = nn.parallel.DistributedDataParallel(m) if wrap == "ddp" else m
    opt = cafin.SINGD(model, T=1, lr=0.05, lr_cov=0.1, structures=("dense", "hierarchical15_15"))
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        x = torch.randn(8, 3, 6, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(8, 3, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        F.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
    results[wrap] = [p.detach().clone() for p in m.parameters()]
    del opt, model
if rank == 0:
    torch.save(results, os.path.join(sys.argv[1], "out.pt"))
two_ranks.leave()
'''


def test_two_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    """Two gloo ranks, each with half of every batch: the averaged H terms and gradients (DDP
    wrapper) or natural gradients (no wrapper, as singd) give the one-process full-batch run."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    failure = two_ranks.launch(lambda rank: [script, tmp_path], tmp_path)
    assert failure is None, failure
    results = torch.load(tmp_path / "out.pt")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).double()
    opt = cafin.SINGD(m, T=1, lr=0.05, lr_cov=0.1, structures=("dense", "hierarchical15_15"))
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        x = torch.randn(8, 3, 6, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(8, 3, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    for wrap in ("ddp", "plain"):
        for p, q in zip(m.parameters(), results[wrap]):
            torch.testing.assert_close(q, p.detach(), rtol=1e-11, atol=1e-13)


def test_deepcopy_trains_a_copy_of_the_model():
    torch.manual_seed(0)
    m = mlp().double()
    o = cafin.SINGD(m, T=2, lr=0.05, lr_cov=0.1, structures=("diagonal", "dense"))
    gen = torch.Generator().manual_seed(8)
    data = [batch("mlp", gen, torch.float64) for _ in range(5)]
    for i, (x, y) in enumerate(data):
        if i == 2:
            o2 = copy.deepcopy(o)
            m2 = o2.model
            assert m2 is not m
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    for x, y in data[2:]:
        o2.zero_grad()
        F.mse_loss(m2(x), y).backward()
        o2.step()
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------ contract: bad input
def assert_same(a, b, where="state_dict"):
    """Bit-identical nested checkpoints: tensors by torch.equal (and dtype), the rest by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def two_group_singd(m, **kw):
    groups = [{"params": list(m[0].parameters())},
              {"params": list(m[2].parameters()), "structures": ("diagonal", "triltoeplitz"),
               "preconditioner_dtype": (torch.float32, None), "T": 1}]
    return cafin.SINGD(m, groups, T=2, lr=0.05, lr_cov=0.1, **kw)


def train(opt, m, data, closure=False):
    for x, y in data:
        def loss_fn():
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            return loss
        if closure:
            opt.step(loss_fn)
        else:
            loss_fn()
            opt.step()


@pytest.mark.parametrize("key, value, match", [
    ("T", 0, "T"), ("T", 1.5, "T"), ("structures", ("dense", "lowrank"), "structure"),
    ("structures", ("diagonal", "dense"), "structures"), ("loss_average", "mean", "loss_average"),
    ("preconditioner_dtype", (torch.float32, None), "preconditioner_dtype"),
    ("preconditioner_dtype", (torch.int32, None), "preconditioner_dtype"),
    ("kfac_approx", "x", "kfac_approx"), ("alpha1", math.nan, "alpha1"), ("alpha1", -0.5, "alpha1"),
    ("lr_cov", math.nan, "lr_cov"), ("lr_cov", "0.1", "lr_cov"), ("kfac_like", "yes", "kfac_like"),
    ("kfac_like", True, "kfac_like"), ("normalize_lr_cov", 1, "normalize_lr_cov"),
    ("exact_block_transposes", "no", "exact_block_transposes"), ("lr", -1.0, "lr")])
def test_load_state_dict_validates_group_settings(key, value, match):
    """A checkpoint whose group settings the constructor would reject, or that do not fit the
    factors this optimizer built, is rejected before anything is replaced."""
    torch.manual_seed(0)
    m = mlp().double()
    o = two_group_singd(m)
    gen = torch.Generator().manual_seed(4)
    train(o, m, [batch("mlp", gen, torch.float64) for _ in range(3)])
    before = copy.deepcopy(o.state_dict())
    bad = copy.deepcopy(before)
    bad["param_groups"][0][key] = value
    with pytest.raises((ValueError, TypeError), match=match):
        o.load_state_dict(bad)
    assert_same(o.state_dict(), before)
    train(o, m, [batch("mlp", gen, torch.float64)])  # and it still steps


def test_load_state_dict_resumes_bit_identically_through_torch_save(tmp_path):
    torch.manual_seed(0)
    m = mlp().double()
    m2 = copy.deepcopy(m)
    o = two_group_singd(m, init_grad_scale=4.0)
    gen = torch.Generator().manual_seed(5)
    data = [batch("mlp", gen, torch.float64) for _ in range(7)]
    train(o, m, data[:3])
    torch.save(o.state_dict(), tmp_path / "opt.pt")
    m2.load_state_dict(m.state_dict())
    o2 = two_group_singd(m2, init_grad_scale=4.0)
    o2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert_same(o2.state_dict(), o.state_dict())
    train(o, m, data[3:])
    train(o2, m2, data[3:])
    assert_same(o2.state_dict(), o.state_dict())
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.nan, math.inf, "1", None, True])
def test_grad_scale_arguments(value):
    m = nn.Linear(3, 2).double()
    with pytest.raises((ValueError, TypeError), match="init_grad_scale"):
        cafin.SINGD(m, init_grad_scale=value)
    o = cafin.SINGD(m, T=1, init_grad_scale=2.0)
    o.set_current_grad_scale(2.0)
    with pytest.raises((ValueError, TypeError), match="grad_scale"):
        o.set_current_grad_scale(value)
    # the rejected call wrote nothing: the step divides by the scale set before it
    torch.manual_seed(0)
    m2 = copy.deepcopy(m)
    o2 = cafin.SINGD(m2, T=1, init_grad_scale=2.0)
    o2.set_current_grad_scale(2.0)
    x = torch.randn(4, 3, dtype=torch.float64)
    for opt, model in ((o, m), (o2, m2)):
        model(x).square().sum().backward()
        opt.step()
    assert torch.equal(m.weight, m2.weight)


@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf, "0.1", None, torch.tensor([0.1, 0.2])])
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_lr_cov_callable_bad_value_raises_before_any_write(value, backend):
    torch.manual_seed(0)
    m = mlp().double()
    calls = []

    def lr_cov(k):
        calls.append(k)
        return 0.1 if k < 2 else value

    o = cafin.SINGD(m, T=1, lr_cov=lr_cov, backend=backend, structures=("dense", "diagonal"))
    gen = torch.Generator().manual_seed(6)
    train(o, m, [batch("mlp", gen, torch.float64) for _ in range(2)])
    x, y = batch("mlp", gen, torch.float64)
    o.zero_grad()
    F.mse_loss(m(x), y).backward()
    before = copy.deepcopy(o.state_dict())
    params = [p.detach().clone() for p in m.parameters()]
    with pytest.raises((ValueError, TypeError), match="lr_cov"):
        o.step()
    assert_same(o.state_dict(), before)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
    assert calls[-1] == 2


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("T", [1, 2])
def test_failed_closure_leaves_no_statistics(backend, T):
    """A closure that raises after its backward pass: the statistics that pass added are taken
    back, so the next step equals one in a run that never had the failing closure."""
    torch.manual_seed(0)
    m = mlp().double()
    m2 = copy.deepcopy(m)
    kw = dict(T=T, lr=0.05, lr_cov=0.1, backend=backend, structures=("hierarchical15_15", "dense"))
    o, o2 = cafin.SINGD(m, **kw), cafin.SINGD(m2, **kw)
    gen = torch.Generator().manual_seed(7)
    data = [batch("mlp", gen, torch.float64) for _ in range(4)]
    x_bad, y_bad = batch("mlp", gen, torch.float64)

    def failing():
        o.zero_grad()
        F.mse_loss(m(x_bad), y_bad).backward()
        m(x_bad)  # a forward pass whose backward never runs
        raise RuntimeError("data loader failed")

    for i in range(len(data)):
        if i in (0, 2):
            before = copy.deepcopy(o.state_dict())
            with pytest.raises(RuntimeError, match="data loader"):
                o.step(failing)
            assert_same(o.state_dict(), before)
        train(o, m, data[i:i + 1], closure=True)
        train(o2, m2, data[i:i + 1], closure=True)
        assert_same(o.state_dict(), o2.state_dict())
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("key, value", [
    ("lr", -1.0), ("lr", math.nan), ("lr", torch.tensor(math.inf, dtype=torch.float64)),
    ("momentum", "0.9"), ("damping", "x"), ("weight_decay", math.inf), ("T", 0),
    ("lr_cov", -0.1), ("alpha1", math.nan), ("loss_average", "mean"),
    ("structures", ("diagonal", "dense")), ("preconditioner_dtype", (torch.float32, None)),
    ("kfac_like", "yes"), ("normalize_lr_cov", None)])
@pytest.mark.parametrize("closure", [False, True])
def test_bad_setting_between_steps_changes_nothing(key, value, closure):
    torch.manual_seed(0)
    m = mlp().double()
    m2 = copy.deepcopy(m)
    o, o2 = (cafin.SINGD(model, T=1, lr=0.05, lr_cov=0.1) for model in (m, m2))
    gen = torch.Generator().manual_seed(9)
    data = [batch("mlp", gen, torch.float64) for _ in range(3)]
    train(o, m, data[:1])
    train(o2, m2, data[:1])
    good = o.param_groups[0][key]
    o.param_groups[0][key] = value
    if not closure:  # the pass's statistics are the user's: they stay for the retried step
        o.zero_grad()
        if key in ("T", "loss_average", "structures", "preconditioner_dtype"):
            # read by the statistics hooks: the forward pass raises already
            with pytest.raises(ValueError, match=key):
                m(data[1][0])
            o.param_groups[0][key] = good
        F.mse_loss(m(data[1][0]), data[1][1]).backward()
        o.param_groups[0][key] = value
    before = copy.deepcopy(o.state_dict()["state"])
    params = [p.detach().clone() for p in m.parameters()]
    with pytest.raises((ValueError, TypeError), match=key):
        if closure:
            train(o, m, data[1:2], closure=True)
        else:
            o.step()
    assert_same(o.state_dict()["state"], before)
    assert o.state_dict()["param_groups"][0]["curvature"]["k"] == 1
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
    o.param_groups[0][key] = good
    if closure:
        train(o, m, data[1:], closure=True)
    else:
        o.step()
        train(o, m, data[2:])
    train(o2, m2, data[1:], closure=closure)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("structures", [("dense", "dense"), ("diagonal", "diagonal")])
def test_python_float_hyperparameters_between_steps(dtype, structures):
    torch.manual_seed(0)
    m = mlp().to(dtype)
    m2 = copy.deepcopy(m)
    o, o2 = (cafin.SINGD(model, T=1, lr=0.05, lr_cov=0.1, structures=structures) for model in (m, m2))
    gen = torch.Generator().manual_seed(10)
    data = [batch("mlp", gen, dtype) for _ in range(4)]
    train(o, m, data[:1])
    train(o2, m2, data[:1])
    start = m[0].weight.detach().clone()
    o.param_groups[0]["lr"] = 0.03
    o.param_groups[0]["weight_decay"] = 0.01
    o2.param_groups[0]["lr"].fill_(0.03)
    o2.param_groups[0]["weight_decay"].fill_(0.01)
    train(o, m, data[1:])
    train(o2, m2, data[1:])
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(m[0].weight, start)


def test_deepcopy_with_callable_lr_cov_trains_identically():
    torch.manual_seed(0)
    m = mlp().double()
    o = cafin.SINGD(m, T=1, lr=0.05, lr_cov=lambda k: 0.1 / (k + 1), structures=("dense", "triutoeplitz"))
    gen = torch.Generator().manual_seed(11)
    data = [batch("mlp", gen, torch.float64) for _ in range(4)]
    train(o, m, data[:2], closure=True)
    o2 = copy.deepcopy(o)
    m2 = o2.model
    train(o, m, data[2:], closure=True)
    train(o2, m2, data[2:], closure=True)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------ contract: NaN statistics
_FACTOR_KEYS = ("K.", "C.", "m_K.", "m_C.", "P_K", "P_C")


def _factors(opt, layer):
    return {k: v.clone() for k, v in opt.state[layer.weight].items() if k.startswith(_FACTOR_KEYS)}


def _accumulators(opt, layer):
    return [v for k, v in opt.state[layer.weight].items() if k.startswith(("H_K.", "H_C.", "H_count"))]


def _no_runtime_warning(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fn()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("T", [1, 2])
def test_non_finite_statistics_drop_the_update(device, backend, T):
    """At a preconditioner step whose statistics hold NaN (a pass on a NaN batch whose step was
    skipped, then a clean pass) every layer keeps K, C, m_K, m_C and the cached P, its
    accumulators are reset, the drop is counted (and on the CPU warned about); later clean
    updates work. An inf put in one layer's H_K drops that layer's update only."""
    torch.manual_seed(0)
    m = mlp().double().to(device)
    layers = [m[0], m[2], m[4]]
    o = cafin.SINGD(m, T=T, lr=0.05, lr_cov=0.1, backend=backend, cache_preconditioner=True,
                    structures=("dense", "hierarchical15_15"))
    gen = torch.Generator().manual_seed(3)
    data = [tuple(t.to(device) for t in batch("mlp", gen, torch.float64)) for _ in range(3 * T + 1)]

    def backward(x, y):
        o.zero_grad()
        F.mse_loss(m(x), y).backward()

    warns = (lambda n: pytest.warns(RuntimeWarning, match=f"SINGD: {n} preconditioner update")) \
        if device == "cpu" else (lambda n: warnings.catch_warnings())
    for k in range(T):  # the first update (step 0) and the plain steps after it
        _no_runtime_warning(lambda: (backward(*data[k]), o.step()))
    assert o.skipped_factor_updates == 0
    before = [_factors(o, layer) for layer in layers]
    x, y = data[T]
    backward(torch.full_like(x, math.nan), y)  # its step is skipped
    backward(x, y)
    with warns(3):
        o.step()
    assert o.skipped_factor_updates == 3
    for layer, saved in zip(layers, before):
        assert_same(_factors(o, layer), saved)
        assert all(bool((t == 0).all()) for t in _accumulators(o, layer))
    assert all(torch.isfinite(p).all() for p in m.parameters())

    for k in range(T + 1, 2 * T + 1):  # plain steps, then a clean update at step 2T
        _no_runtime_warning(lambda: (backward(*data[k]), o.step()))
    assert o.skipped_factor_updates == 3
    for layer, saved in zip(layers, before):
        now = _factors(o, layer)
        assert all(torch.isfinite(v).all() for v in now.values())
        assert not torch.equal(now["K.0"], saved["K.0"]) and not torch.equal(now["C.0"], saved["C.0"])

    for k in range(2 * T + 1, 3 * T):
        _no_runtime_warning(lambda: (backward(*data[k]), o.step()))
    before = [_factors(o, layer) for layer in layers]
    backward(*data[3 * T])
    o.state[m[2].weight]["H_K.0"][1, 2] = math.inf
    with warns(1):
        o.step()
    assert o.skipped_factor_updates == 4
    for layer, saved in zip(layers, before):
        now = _factors(o, layer)
        assert (layer is m[2]) == all(torch.equal(now[key], saved[key]) for key in saved)
        assert all(bool((t == 0).all()) for t in _accumulators(o, layer))
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_non_finite_statistics_drop_the_update_in_a_compiled_step(backend):
    """A compiled step drops and counts the NaN update as an eager one (the count stays on the
    device: a compiled step reads no tensor), and builds a graph per phase at most (T = 2: the
    first step's, the not-due and the due one)."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    m = mlp()
    o = cafin.SINGD(m, T=2, lr=0.05, lr_cov=0.1, backend=backend, structures=("dense", "diagonal"))
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(o.step, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(5)
    data = [batch("mlp", gen, torch.float32) for _ in range(5)]
    layers = [m[0], m[2], m[4]]
    for k, (x, y) in enumerate(data):
        if k == 2:
            before = [_factors(o, layer) for layer in layers]
            o.zero_grad()
            F.mse_loss(m(torch.full_like(x, math.nan)), y).backward()
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        step()
        if k == 2:
            assert o.skipped_factor_updates == 3
            for layer, saved in zip(layers, before):
                assert_same(_factors(o, layer), saved)
                assert all(bool((t == 0).all()) for t in _accumulators(o, layer))
    assert counters["stats"]["unique_graphs"] <= 3 and not counters["graph_break"]
    assert not o._steps.device_gated
    assert o.skipped_factor_updates == 3
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert not torch.equal(o.state[m[0].weight]["K.0"], before[0]["K.0"])  # step 4 updated


def _step_launches(layers: int, structures, due: bool, **kw) -> int:
    """The ops (bench.proxies.count_ops: each a kernel launch on a GPU) of one eager step of a
    stack of `layers` Linear layers, due (k = 2, T = 2) or not (k = 1)."""
    from bench.proxies import count_ops
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)])
    opt = cafin.SINGD(model, structures=structures, T=2, **kw)
    x = torch.randn(4, 6)
    for _ in range(2 if due else 1):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    return count_ops(opt.step).launches


# Ops per layer a step adds: a due diagonal layer's six reductions (the traces of H_K, H_C, K^T K,
# C^T C and the sums of H_K, H_C that test them for NaN/inf); a dense layer's four GEMMs of its
# factor update and four of its natural gradient besides (its [W | b] matrix is written with every
# other layer's by one copy). The scalar bookkeeping (trace factors, the due/commit test, drop
# counts, normalize_lr_cov's norms) runs on vectors over all of a bucket's layers; per layer it
# took another 13 to 25 ops.
@pytest.mark.parametrize("structure, due, per_layer", [
    ("diagonal", True, 6), ("dense", True, 14), ("dense", False, 4)])
@pytest.mark.parametrize("normalize", [False, True])
def test_a_step_launches_a_bounded_number_of_ops_per_layer(structure, due, per_layer, normalize):
    kw = dict(normalize_lr_cov=normalize, lr_cov=lambda k: 0.01)
    few, many = (_step_launches(n, (structure, structure), due, **kw) for n in (3, 11))
    assert (many - few) / 8 <= per_layer, (few, many)
