"""cafin.KFACPreconditioner against an independent K-FAC oracle written here from the maths and
kfac-pytorch 0.4.2's conventions (docs/kfac.md), step for step with torch SGD, in float64 (tight)
and float32; the constructor contract; what cafin adds (dilation, groups, 'same', padding modes,
in-place activations, modules whose forward never runs, no host sync, checkpoints); the fused
ops against the reference ones, with opcheck; torch.compile of the step.

kfac-pytorch itself is not installable from the package registry, so it is not run here; the
side-by-side numbers against it are recorded in docs/kfac.md.
"""
from __future__ import annotations

import copy
import enum
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.testing._internal.optests import generate_opcheck_tests

import cafin
from cafin import ops
from cafin import reference as ref

import two_ranks
from devices import DEVICES


# ------------------------------------------------------------------------------- the oracle
def patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """[groups, B*oh*ow, C/g*kh*kw] patch rows, sliced tap by tap from the padded input."""
    kh, kw = conv.kernel_size
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    if conv.padding == "same":
        pads = [(d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for d, k in ((dh, kh), (dw, kw))]
    elif conv.padding == "valid":
        pads = [(0, 0), (0, 0)]
    else:
        pads = [(conv.padding[0],) * 2, (conv.padding[1],) * 2]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, [pads[1][0], pads[1][1], pads[0][0], pads[0][1]], mode=mode)
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    taps = torch.stack([torch.stack([xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh,
                                        j * dw: j * dw + sw * (ow - 1) + 1: sw]
                                     for j in range(kw)], 2) for i in range(kh)], 2)
    cg = x.shape[1] // conv.groups  # taps: [B, C, kh, kw, oh, ow]
    return torch.stack([taps[:, q * cg:(q + 1) * cg].permute(0, 4, 5, 1, 2, 3).reshape(-1, cg * kh * kw)
                        for q in range(conv.groups)])


class Oracle:
    """K-FAC by the book, kfac-pytorch's conventions: A = sum abar abar^T / (L^2 N) over the
    N = B*L rows (abar = [patch; 1]), G = sum g g^T / (L^2 N) with g = grad_output rows, each
    symmetrised; micro-batches averaged; EMA from I on steps k % factor == 0; on k % inv == 0
    eigh (or (F + damping I)^-1) on a `decompose` copy, eigenvalues clamped at 0; V = Q_G[(Q_G^T
    dW Q_A) / (dg da^T + damping)] Q_A^T; nu = min(1, sqrt(kl / |lr^2 sum <V, dW>|))."""

    def __init__(self, model, *, factor_update_steps=1, inv_update_steps=1, damping=1e-3,
                 factor_decay=0.95, kl_clip=1e-3, lr=0.1, compute_method="eigen",
                 compute_eigenvalue_outer_product=True, inv_dtype=torch.float32,
                 decompose_dtype=torch.float32, **_):
        self.hp = dict(f=factor_update_steps, i=inv_update_steps, damping=damping,
                       decay=factor_decay, kl=kl_clip, lr=lr)
        self.method, self.prediv = compute_method, compute_eigenvalue_outer_product
        self.inv_dtype, self.decompose = inv_dtype, decompose_dtype
        self.layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        self.k = 0
        self.A, self.G, self.batch, self.second = {}, {}, {}, {}
        for m in self.layers:
            m.register_forward_hook(self._forward)

    def value(self, name):
        v = self.hp[name]
        return v(self.k) if callable(v) else v

    def _forward(self, m, inputs, out):
        if not torch.is_grad_enabled() or self.k % self.value("f"):
            return
        x = inputs[0].detach()
        if isinstance(m, nn.Linear):
            rows, L = x.reshape(1, -1, x.shape[-1]), 1
        else:
            rows, L = patches(m, x), out.shape[2] * out.shape[3]
        if m.bias is not None:
            rows = torch.cat([rows, torch.ones(*rows.shape[:2], 1, dtype=rows.dtype)], 2)
        rows = rows / L
        A = rows.transpose(1, 2) @ rows / rows.shape[1]
        self.batch.setdefault(m, []).append([(A + A.transpose(1, 2)) / 2, None])
        out.register_hook(lambda g, m=m: self._backward(m, g))

    def _backward(self, m, g):
        if isinstance(m, nn.Linear):
            rows, L = g.reshape(1, -1, g.shape[-1]), 1
        else:
            L = g.shape[2] * g.shape[3]
            rows = g.permute(0, 2, 3, 1).reshape(-1, m.groups, g.shape[1] // m.groups).transpose(0, 1)
        rows = rows / L
        G = rows.transpose(1, 2) @ rows / rows.shape[1]
        self.batch[m][-1][1] = (G + G.transpose(1, 2)) / 2

    @torch.no_grad()
    def step(self):
        decay, damping = self.value("decay"), self.value("damping")
        for m, pairs in self.batch.items():
            A = sum(p[0] for p in pairs) / len(pairs)
            G = sum(p[1] for p in pairs) / len(pairs)
            eye = lambda n, like: torch.eye(n, dtype=like.dtype).expand_as(like)  # noqa: E731
            self.A[m] = decay * self.A.get(m, eye(A.shape[-1], A)) + (1 - decay) * A
            self.G[m] = decay * self.G.get(m, eye(G.shape[-1], G)) + (1 - decay) * G
        self.batch = {}
        if self.k % self.value("i") == 0:
            for m in self.A:
                if self.method == "eigen":
                    da, qa = torch.linalg.eigh(self.A[m].to(self.decompose))
                    dg, qg = torch.linalg.eigh(self.G[m].to(self.decompose))
                    da, dg = da.to(self.inv_dtype).clamp(min=0), dg.to(self.inv_dtype).clamp(min=0)
                    qa, qg = qa.to(self.inv_dtype), qg.to(self.inv_dtype)
                    outer = dg.unsqueeze(-1) * da.unsqueeze(-2)
                    self.second[m] = (qa, qg, 1 / (outer + damping) if self.prediv else (da, dg))
                else:
                    inv = lambda F_: torch.linalg.inv(  # noqa: E731
                        (F_ + damping * torch.eye(F_.shape[-1], dtype=F_.dtype)).to(self.decompose))
                    self.second[m] = (inv(self.A[m]).to(self.inv_dtype), inv(self.G[m]).to(self.inv_dtype))
        vs, vg = {}, 0.0
        for m in self.layers:
            if m not in self.second or m.weight.grad is None:
                continue
            groups = m.groups if isinstance(m, nn.Conv2d) else 1
            gw = m.weight.grad.reshape(groups, m.weight.shape[0] // groups, -1)
            dW = gw if m.bias is None else torch.cat([gw, m.bias.grad.reshape(groups, -1, 1)], 2)
            work = dW.to(self.inv_dtype)
            if self.method == "eigen":
                qa, qg, s = self.second[m]
                v1 = qg.transpose(1, 2) @ work @ qa
                v2 = v1 * s if self.prediv else v1 / (s[1].unsqueeze(-1) * s[0].unsqueeze(-2) + damping)
                V = qg @ v2 @ qa.transpose(1, 2)
            else:
                a_inv, g_inv = self.second[m]
                V = g_inv @ work @ a_inv
            V = V.to(dW.dtype)
            vs[m] = V
            vg += (V * dW).sum().item() * self.value("lr") ** 2
        kl = self.value("kl")
        nu = 1.0 if kl is None or vg == 0 else min(1.0, math.sqrt(kl / abs(vg)))
        for m, V in vs.items():
            d = m.weight.grad.numel() // (V.shape[0] * V.shape[1])
            m.weight.grad.copy_((nu * V[:, :, :d]).reshape(m.weight.shape))
            if m.bias is not None:
                m.bias.grad.copy_((nu * V[:, :, d]).reshape(m.bias.shape))
        self.k += 1


# ------------------------------------------------------------------------------- models
def mlp():
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 9, bias=False), nn.ReLU(), nn.Linear(9, 4))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, stride=2, padding=1, bias=False),
                         nn.ReLU(), nn.Flatten(), nn.Linear(5 * 4 * 4, 10), nn.Tanh(), nn.Linear(10, 4))


def odd_cnn(inplace=False):
    """What kfac-pytorch gets wrong or cannot run: dilation, groups, 'same', padding modes."""
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, dilation=2, padding=2, groups=2), nn.ReLU(inplace=inplace),
        nn.Conv2d(6, 6, 3, groups=6, stride=2, padding=1, padding_mode="reflect"), nn.ReLU(inplace=inplace),
        nn.Conv2d(6, 4, (2, 3), padding="same", dilation=(2, 1), padding_mode="circular"), nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding="valid", bias=False), nn.Flatten(), nn.Linear(4 * 2 * 2, 5), nn.ReLU(inplace=inplace),
        nn.Linear(5, 3))


def deep():
    """Layers of equal shapes: their preconditioning runs stacked (one batched chain)."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def stacked_mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


MODELS = {"mlp": (mlp, (6, 5, 7), 4), "stacked_mlp": (stacked_mlp, (6, 6), 3), "cnn": (cnn, (6, 3, 8, 8), 4), "odd_cnn": (odd_cnn, (5, 4, 8, 8), 3),
          "deep": (deep, (5, 3, 6, 6), 3)}


def data(kind, dtype, steps, acc=1, seed=1):
    _, shape, classes = MODELS[kind]
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(*shape, generator=g).to(dtype), torch.randint(0, classes, (shape[0],), generator=g))
             for _ in range(acc)] for _ in range(steps)]


def loss_of(model, x, y):
    out = model(x)
    return F.cross_entropy(out.mean(1) if out.dim() == 3 else out, y)


def train(make_pre, model, batches, step=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    pre = make_pre(model)
    step = step or pre.step
    for batch in batches:
        opt.zero_grad()
        for x, y in batch:
            (loss_of(model, x, y) / len(batch)).backward()
        step()
        opt.step()
    return model, pre


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def rel_error(a_model, b_model, start):
    moved = (flat(a_model) - start).abs().max()
    return ((flat(a_model) - flat(b_model)).abs().max() / moved).item()


def base_model(kind, dtype, **kw):
    torch.manual_seed(0)
    return MODELS[kind][0](**kw).to(dtype)


CONFIGS = {
    "eigen": dict(),
    "inverse": dict(compute_method="inverse"),
    "eigen_no_outer": dict(compute_eigenvalue_outer_product=False, kl_clip=None),
    "intervals": dict(factor_update_steps=2, inv_update_steps=3),
    "intervals_inverse": dict(factor_update_steps=2, inv_update_steps=4, compute_method="inverse", kl_clip=None),
    "kl_clip_active": dict(kl_clip=1e-5, lr=1.0),
    "accumulation": dict(accumulation_steps=2),
    "accumulation_at_step": dict(accumulation_steps=3, update_factors_in_hook=False, factor_update_steps=2),
    "callables": dict(damping=lambda k: 1e-2 / (k + 1), lr=lambda k: 0.1 + 0.01 * k,
                      factor_decay=lambda k: 0.9 if k < 2 else 0.95),
}


# Every config on the two kfac-pytorch-style models with the fused backend in float64; the other
# models, float32 and the reference backend (which shares everything but the three ops) on
# subsets, to keep the suite short.
CASES = [(k, c, "f64", "fused") for k in ("mlp", "cnn") for c in CONFIGS] + \
        [("odd_cnn", c, "f64", "fused") for c in ("eigen", "inverse", "eigen_no_outer", "kl_clip_active",
                                                 "accumulation")] + \
        [("deep", c, "f64", "fused") for c in ("eigen", "inverse", "eigen_no_outer", "intervals")] + \
        [("deep", "eigen", "f32", "fused")] + \
        [(k, c, "f32", "fused") for k in ("mlp", "cnn") for c in ("eigen", "inverse", "kl_clip_active")] + \
        [("odd_cnn", c, "f32", "fused") for c in ("eigen", "accumulation")] + \
        [("cnn", c, "f64", "reference") for c in ("eigen", "inverse", "eigen_no_outer", "kl_clip_active",
                                                   "intervals", "accumulation_at_step")]


@pytest.mark.filterwarnings("ignore:It is suggested")
@pytest.mark.parametrize("kind, config, dtype, backend", CASES)
def test_matches_oracle(kind, config, dtype, backend):
    dtype = torch.float64 if dtype == "f64" else torch.float32
    kw = dict(CONFIGS[config])
    if dtype == torch.float64:
        kw.update(inv_dtype=torch.float64, decompose_dtype=torch.float64)
    steps = 5
    batches = data(kind, dtype, steps, acc=kw.get("accumulation_steps", 1))
    base = base_model(kind, dtype)
    ours, pre = train(lambda m: cafin.KFACPreconditioner(m, backend=backend, **kw), copy.deepcopy(base), batches)
    theirs, _ = train(lambda m: Oracle(m, **kw), copy.deepcopy(base), batches)
    assert pre.steps == steps
    err = rel_error(theirs, ours, flat(base))
    assert err <= (1e-10 if dtype == torch.float64 else 1e-4), err


def test_kl_clip_really_clips():
    """The KL config above must actually scale: nu < 1 changes the step."""
    batches = data("mlp", torch.float64, 2)
    base = base_model("mlp", torch.float64)
    a, _ = train(lambda m: cafin.KFACPreconditioner(m, kl_clip=1e-5, lr=1.0), copy.deepcopy(base), batches)
    b, _ = train(lambda m: cafin.KFACPreconditioner(m, kl_clip=None), copy.deepcopy(base), batches)
    assert rel_error(b, a, flat(base)) > 1e-3


def test_inplace_activations_same_as_out_of_place():
    batches = data("odd_cnn", torch.float64, 3)
    base = base_model("odd_cnn", torch.float64)
    inplace = base_model("odd_cnn", torch.float64, inplace=True)
    inplace.load_state_dict(base.state_dict())
    kw = dict(inv_dtype=torch.float64, decompose_dtype=torch.float64)
    a, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), copy.deepcopy(base), batches)
    b, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), inplace, batches)
    assert rel_error(a, b, flat(base)) <= 1e-12


# ------------------------------------------------------------------------------- contract
def test_constructor_signature_is_kfac_pytorchs():
    import inspect
    sig = inspect.signature(cafin.KFACPreconditioner)
    expected = dict(factor_update_steps=1, inv_update_steps=1, damping=0.001, factor_decay=0.95, kl_clip=0.001,
                    lr=0.1, accumulation_steps=1, allreduce_bucket_cap_mb=25.0, colocate_factors=True,
                    compute_eigenvalue_outer_product=True, symmetry_aware=False, grad_scaler=None,
                    factor_dtype=None, inv_dtype=torch.float32, skip_layers=None, update_factors_in_hook=True,
                    backend="fused")
    for name, default in expected.items():
        assert sig.parameters[name].default == default, name
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    from cafin.optim.kfac import AssignmentStrategy, ComputeMethod, DistributedStrategy
    assert sig.parameters["compute_method"].default is ComputeMethod.EIGEN
    assert sig.parameters["assignment_strategy"].default is AssignmentStrategy.COMPUTE
    assert sig.parameters["grad_worker_fraction"].default is DistributedStrategy.COMM_OPT
    assert (ComputeMethod.EIGEN.value, ComputeMethod.INVERSE.value) == (1, 2)
    assert (DistributedStrategy.COMM_OPT.value, DistributedStrategy.MEM_OPT.value,
            DistributedStrategy.HYBRID_OPT.value) == (1, 2, 3)


def test_compute_method_spellings():
    from cafin.optim.kfac import ComputeMethod

    class Foreign(enum.Enum):  # kfac-pytorch's enum, as a user would pass it
        EIGEN = 1
        INVERSE = 2
    for value, want in [("eigen", ComputeMethod.EIGEN), ("INVERSE", ComputeMethod.INVERSE),
                        (ComputeMethod.INVERSE, ComputeMethod.INVERSE), (Foreign.INVERSE, ComputeMethod.INVERSE)]:
        assert cafin.KFACPreconditioner(mlp(), compute_method=value).compute_method is want
    with pytest.raises(ValueError, match="compute_method"):
        cafin.KFACPreconditioner(mlp(), compute_method="cholesky")


def test_grad_worker_fraction_takes_the_strategy_names():
    """As compute_method and assignment_strategy do: a DistributedStrategy's name in any case
    (one process: COMM_OPT is fraction 1, MEM_OPT 1/world = 1, HYBRID_OPT 0.5); another string
    is refused with the valid names."""
    from cafin.optim.kfac import DistributedStrategy
    for value, fraction, strategy in [("COMM_OPT", 1.0, "COMM_OPT"), ("comm_opt", 1.0, "COMM_OPT"),
                                      ("Mem_Opt", 1.0, "MEM_OPT"), ("hybrid_opt", 0.5, "HYBRID_OPT"),
                                      (DistributedStrategy.HYBRID_OPT, 0.5, "HYBRID_OPT")]:
        pre = cafin.KFACPreconditioner(mlp(), grad_worker_fraction=value)
        assert pre.grad_worker_fraction == fraction
        assert pre.distributed_strategy is DistributedStrategy[strategy]
    with pytest.raises(ValueError, match=r"grad_worker_fraction .*COMM_OPT.*MEM_OPT.*HYBRID_OPT.*'fastest'"):
        cafin.KFACPreconditioner(mlp(), grad_worker_fraction="fastest")


@pytest.mark.parametrize("kwargs, match", [
    (dict(damping=0.0), "damping"), (dict(factor_decay=1.5), "factor_decay"), (dict(kl_clip=0.0), "kl_clip"),
    (dict(lr=-1.0), "lr"), (dict(accumulation_steps=0), "accumulation_steps"),
    (dict(factor_update_steps=0), "factor_update_steps"), (dict(inv_update_steps=1.5), "inv_update_steps"),
    (dict(colocate_factors=False), "colocate_factors"), (dict(allreduce_bucket_cap_mb=-1), "allreduce"),
    (dict(grad_worker_fraction=2.0), "grad_worker_fraction"), (dict(backend="cuda"), "backend"),
    (dict(assignment_strategy="fastest"), "assignment_strategy"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cafin.KFACPreconditioner(mlp(), **kwargs)


def test_hyperparameter_setters_check_and_take_effect():
    pre = cafin.KFACPreconditioner(mlp())
    pre.damping = 0.01
    pre.kl_clip = None
    assert pre.damping == 0.01 and pre.kl_clip is None
    assert pre._tensors[torch.device("cpu")]["damping"].item() == 0.01
    with pytest.raises(ValueError, match="damping"):
        pre.damping = -1.0
    with pytest.raises(ValueError, match="factor_decay"):
        pre.factor_decay = 0.0
    assert pre.damping == 0.01
    sizes = pre.memory_usage()
    assert sizes["total"] == sum(v for k, v in sizes.items() if k != "total") > 0


def test_distributed_options_accepted():
    pre = cafin.KFACPreconditioner(mlp(), grad_worker_fraction=0.5, colocate_factors=False,
                                   compute_eigenvalue_outer_product=False, assignment_strategy="memory",
                                   symmetry_aware=True, allreduce_bucket_cap_mb=0)
    from cafin.optim.kfac import DistributedStrategy
    # one process: kfac-pytorch's rule makes 0.5 of 1 worker MEM_OPT
    assert pre.grad_worker_fraction == 0.5 and pre.distributed_strategy is DistributedStrategy.MEM_OPT
    with pytest.warns(UserWarning, match="multiple"):
        cafin.KFACPreconditioner(mlp(), factor_update_steps=3, inv_update_steps=4)


def test_registration_and_skip_layers():
    class Sub(nn.Linear):
        pass
    model = nn.Sequential(nn.Linear(3, 4), nn.Conv2d(1, 1, 1), Sub(4, 4), nn.LayerNorm(4), nn.Embedding(5, 4),
                          nn.Linear(4, 2))
    model[5].weight.requires_grad_(False)  # a frozen parameter: not registered (kfac-pytorch's rule)
    names = [layer.name for layer in cafin.KFACPreconditioner(model).layers]
    assert names == ["0", "1", "2", "4"]
    names = [layer.name for layer in cafin.KFACPreconditioner(model, skip_layers=["Conv2d", "^0$"]).layers]
    assert names == ["2", "4"]
    assert [layer.name for layer in cafin.KFACPreconditioner(model, skip_layers=["Sub"]).layers] == ["0", "1", "4"]


def test_eval_mode_and_no_grad_take_no_statistics():
    model = mlp().double()
    pre = cafin.KFACPreconditioner(model)
    x = torch.randn(4, 7, dtype=torch.float64)
    model.eval()
    model(x).sum().backward()
    model.train()
    with torch.no_grad():
        model(x)
    assert all(not st.seen and st.count_A.item() == 0 for st in pre._state.values())


def test_forward_never_runs_leaves_gradient_alone():
    """MultiheadAttention's out_proj is a Linear whose forward never runs (kfac-pytorch's first
    step fails on it): its gradient is left to the optimizer as it is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Unflatten(1, (2, 4)))
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    head = nn.Linear(4, 3)
    x = torch.randn(5, 6)
    pre = cafin.KFACPreconditioner(nn.ModuleList([model, mha, head]))
    assert "1.out_proj" in [layer.name for layer in pre.layers]
    h = model(x)
    out = head(mha(h, h, h)[0].mean(1))
    out.square().sum().backward()
    before = mha.out_proj.weight.grad.clone(), mha.out_proj.bias.grad.clone(), head.weight.grad.clone()
    pre.step()
    assert torch.equal(mha.out_proj.weight.grad, before[0]) and torch.equal(mha.out_proj.bias.grad, before[1])
    assert not torch.equal(head.weight.grad, before[2])


def test_unused_layer_this_step():
    """b is stacked with a (equal shapes); when b is unused a is preconditioned alone, the same."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)}).double()
    pre = cafin.KFACPreconditioner(model, kl_clip=None, inv_update_steps=10, inv_dtype=torch.float64)
    assert len(pre._stacks) == 1
    x = torch.randn(4, 3, dtype=torch.float64)
    model["b"](model["a"](x)).sum().backward()
    pre.step()
    model.zero_grad(set_to_none=True)
    model["a"](x).square().sum().backward()  # b unused: grad None
    raw = model["a"].weight.grad.clone()
    st = pre._state["a"]
    want = (st.second["qg"] @ ((st.second["qg"].mT @ torch.cat([raw, model["a"].bias.grad[:, None]], 1) @
                                st.second["qa"]) * st.second["dgda"]) @ st.second["qa"].mT)[0, :, :3]
    pre.step()
    assert model["b"].weight.grad is None
    torch.testing.assert_close(model["a"].weight.grad, want, rtol=1e-12, atol=1e-12)


def test_no_host_sync_in_step(monkeypatch):
    model = cnn()
    pre = cafin.KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2)
    for i in range(3):
        model.zero_grad()
        x, y = data("cnn", torch.float32, 1, seed=i)[0][0]
        loss_of(model, x, y).backward()

        def refuse(*a, **k):
            raise AssertionError("host sync in step()")
        with monkeypatch.context() as mp:
            for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
                mp.setattr(torch.Tensor, name, refuse)
            # The one read step() makes by design: the warning of dropped statistics reads the
            # counters of CPU layers only (no sync; on CUDA it reads nothing).
            mp.setattr(pre, "_report_skipped", lambda: None)
            pre.step()


# ------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_state_dict_round_trip(method):
    kw = dict(compute_method=method, factor_update_steps=2, inv_update_steps=3, inv_dtype=torch.float64,
              decompose_dtype=torch.float64)
    batches = data("odd_cnn", torch.float64, 7)
    base = base_model("odd_cnn", torch.float64)
    full, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), copy.deepcopy(base), batches)
    # 4 steps, checkpoint, a fresh preconditioner (and SGD state) continues
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    pre = cafin.KFACPreconditioner(model, **kw)

    def run(pre, opt, model, batches):
        for batch in batches:
            opt.zero_grad()
            for x, y in batch:
                loss_of(model, x, y).backward()
            pre.step()
            opt.step()
    run(pre, opt, model, batches[:4])
    sd, osd = pre.state_dict(), copy.deepcopy(opt.state_dict())
    assert sd["steps"] == 4 and set(sd["layers"]["0"]) == {"A", "G"}
    assert sd["layers"]["8"]["A"].shape == (17, 17)  # ungrouped: kfac-pytorch's [d, d]
    saved = copy.deepcopy(sd)
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    opt2.load_state_dict(osd)
    pre2 = cafin.KFACPreconditioner(model2, **kw)
    pre2.load_state_dict(sd)
    for k, layer in sd["layers"].items():
        for key in ("A", "G"):
            assert torch.equal(layer[key], saved["layers"][k][key])  # argument untouched
    run(pre2, opt2, model2, batches[4:])
    # the inverse at step 4 is recomputed from the loaded factors, as kfac-pytorch does; the
    # trajectory is that of a run whose decomposition happened at step 4
    run(pre, opt, model, batches[4:])
    assert pre2.steps == 7
    assert rel_error(model, model2, flat(base)) <= 1e-10 or method == "eigen"
    with pytest.raises(ValueError, match="layers"):
        pre2.load_state_dict({"steps": 1, "layers": {"nope": {"A": None, "G": None}}})
    bad = copy.deepcopy(sd)
    bad["layers"]["0"]["A"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        pre2.load_state_dict(bad)
    assert pre2.steps == 7  # a rejected checkpoint changes nothing


def test_state_dict_continues_exactly_with_decompositions():
    """Loading factors then decomposing at a step that decomposes anyway: same trajectory."""
    kw = dict(inv_dtype=torch.float64, decompose_dtype=torch.float64)
    batches = data("cnn", torch.float64, 6)
    base = base_model("cnn", torch.float64)
    full, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), copy.deepcopy(base), batches)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    pre = cafin.KFACPreconditioner(model, **kw)
    for i, batch in enumerate(batches):
        if i == 3:
            sd = pre.state_dict()
            pre.remove_hooks()
            del pre
            pre = cafin.KFACPreconditioner(model, **kw)
            pre.load_state_dict(sd)
        opt.zero_grad()
        loss_of(model, *batch[0]).backward()
        pre.step()
        opt.step()
    assert rel_error(full, model, flat(base)) <= 1e-12


# ------------------------------------------------------------------------------- ops
def _ema_args(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, 5, 5), (3, 2, 2), (2, 7, 7)]
    fs = [torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for s in shapes]
    ss = [torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for s in shapes]
    cs = [torch.tensor(c, dtype=dtype, device=device) for c in (2.0, 0.0, 1.0)]
    return fs, ss, cs


def _apply_args(device, dtype, seed, bias=(True, False, True)):
    g = torch.Generator().manual_seed(seed)
    ws, bs, vs = [], [], []
    for i, (groups, rows, cols, b) in enumerate([(1, 4, 6, bias[0]), (2, 3, 5, bias[1]), (3, 1, 2, bias[2])]):
        ws.append(torch.randn(groups * rows, cols - b, generator=g, dtype=torch.float64).to(device=device, dtype=dtype))
        bs.append(torch.randn(groups * rows, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
                  if b else torch.empty(0, dtype=dtype, device=device))
        vs.append(torch.randn(groups, rows, cols, generator=g, dtype=torch.float64).to(device=device, dtype=dtype))
    return ws, bs, vs


def _clone(xs):
    return [x.clone() for x in xs]


def _drops(ss, cs, step, interval) -> int:
    """The statistics a fold drops: taken (count > 0, due) but not finite."""
    due = step is None or float(step) % interval == 0
    return sum(1 for s, c in zip(ss, cs) if due and float(c) > 0 and not torch.isfinite(s).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ops_match_reference(device, dtype):
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    decay = torch.tensor(0.9, dtype=torch.float64, device=device)
    for step, interval, poison in [(None, 1, False), (torch.tensor(4.0, device=device), 2, False),
                                   (torch.tensor(3.0, device=device), 2, False), (None, 1, True)]:
        fs, ss, cs = _ema_args(device, dtype, 3)
        if poison:  # an overflowing GradScaler step: that statistic is dropped
            ss[2][1, 3, 4] = float("inf")
            ss[0][0, 1, 1] = float("nan")
        want = (_clone(fs), _clone(ss), _clone(cs))
        expected = _drops(ss, cs, step, interval)
        dropped = [torch.tensor(1.0, device=device) for _ in range(2)]
        ref.kfac_factor_ema_(*want, decay, step, interval, dropped[0])
        ops.kfac_factor_ema_(fs, ss, cs, decay, step, interval, dropped[1])
        for a, b in zip(fs + ss + cs, want[0] + want[1] + want[2]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert [d.item() for d in dropped] == [1.0 + expected] * 2
        if poison:
            assert expected == 2
            assert torch.equal(fs[0], _ema_args(device, dtype, 3)[0][0]) and torch.isfinite(fs[2]).all()
    g = torch.Generator().manual_seed(5)
    v = [torch.randn(2, 3, 4, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)]
    dg = [torch.rand(2, 3, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)]
    da = [torch.rand(2, 4, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)]
    damping = torch.tensor(1e-3, dtype=torch.float64, device=device)
    want = _clone(v)
    ref.kfac_eigen_scale_(want, dg, da, damping)
    ops.kfac_eigen_scale_(v, dg, da, damping)
    torch.testing.assert_close(v[0], want[0], rtol=tol, atol=tol)
    lr = torch.tensor(0.3, dtype=torch.float64, device=device)
    for kl in (None, torch.tensor(1e-3, dtype=torch.float64, device=device),
               torch.tensor(1e6, dtype=torch.float64, device=device)):
        ws, bs, vs = _apply_args(device, dtype, 7)
        want = (_clone(ws), _clone(bs))
        ref.kfac_precondition_apply_(*want, vs, lr, kl)
        ops.kfac_precondition_apply_(ws, bs, vs, lr, kl)
        for a, b in zip(ws + bs, want[0] + want[1]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _padded(v: torch.Tensor, extra: int) -> torch.Tensor:
    """v's values in a view whose rows are `extra` elements apart more than contiguous ones
    (as in row-aligned storage), the padding filled with NaN so that a read of it shows."""
    groups, rows, cols = v.shape
    store = torch.full((groups, rows, cols + extra), math.nan, dtype=v.dtype, device=v.device)
    return store[..., :cols].copy_(v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_apply_with_shift_abs_terms_and_padded_rows_matches_reference(device, dtype):
    """Two-level K-FAC's write: a per-entry shift, the clip sum over each tensor's |term|, and
    preconditioned gradients read from row-aligned storage, against the reference, with the
    clip on (binding and not), off, and NaN; and the clip factor checked against a sum taken
    here."""
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    lr = torch.tensor(1.0, dtype=torch.float64, device=device)
    for seed, bias in [(11, (True, False, True)), (12, (False, False, False)), (13, (True, True, True))]:
        ws, bs, vs = _apply_args(device, dtype, seed, bias)
        shift = torch.randn(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device, dtype)
        terms = []
        for w, b, v, s in zip(ws, bs, vs, shift):
            flat = (v + s).reshape(-1, v.shape[2]).double()
            terms.append((flat[:, :w.shape[1]] * w.double()).sum() if b.numel() else (flat * w.double().reshape(flat.shape)).sum())
            if b.numel():
                terms.append((flat[:, -1] * b.double()).sum())
        norm = sum(t.abs() for t in terms).item()
        assert norm > abs(sum(terms).item()) * (1 + 1e-9)  # the terms' signs differ: abs_terms matters
        for kl in (None, 0.01 * norm, 1e6 * norm, math.nan):
            kl_t = None if kl is None else torch.tensor(kl, dtype=torch.float64, device=device)
            for extra in (0, 3):
                got = (_clone(ws), _clone(bs))
                want = (_clone(ws), _clone(bs))
                ref.kfac_precondition_apply_(*want, vs, lr, kl_t, shift, True)
                ops.kfac_precondition_apply_(*got, [_padded(v, extra) for v in vs], lr, kl_t, shift, True)
                for a, b in zip(got[0] + got[1], want[0] + want[1]):
                    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            if kl == 0.01 * norm:  # nu = 0.1: every gradient is 0.1 (v + shift)
                for w, v, s, b in zip(got[0], vs, shift, got[1]):
                    flat = (v + s).reshape(-1, v.shape[2])
                    torch.testing.assert_close(w.reshape(-1), (0.1 * flat[:, :w.shape[1]]).reshape(-1),
                                               rtol=tol, atol=tol)
                    if b.numel():
                        torch.testing.assert_close(b, 0.1 * flat[:, -1], rtol=tol, atol=tol)
        # without abs_terms and without a shift, a padded precond gives the contiguous one's numbers
        kl_t = torch.tensor(1e-3, dtype=torch.float64, device=device)
        got, want = (_clone(ws), _clone(bs)), (_clone(ws), _clone(bs))
        ops.kfac_precondition_apply_(*got, [_padded(v, 5) for v in vs], lr, kl_t)
        ops.kfac_precondition_apply_(*want, vs, lr, kl_t)
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_apply_over_more_entries_than_a_launch_holds(device, dtype):
    """The write over 250 entries (more than one CUDA launch's table of 30, and than one
    launch of the per-entry clip terms, 240), with and without a bias column, padded rows, one
    entry longer than a launch's blocks cover (320 chunks of 65536 on CUDA) and one empty:
    against the reference, with the clip binding, with shift and abs_terms, and without a clip."""
    g = torch.Generator().manual_seed(14)
    big = (2, 2050, 5200) if device == "cuda" else (2, 50, 70)
    shapes = [(1 + i % 2, 1 + (7 * i) % 9, 2 + (5 * i) % 11) for i in range(248)] + [big, (1, 0, 3)]
    ws, bs, vs = [], [], []
    for i, (groups, rows, cols) in enumerate(shapes):
        bias = i % 3 != 1
        mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
        ws.append(mk(groups * rows, cols - bias))
        bs.append(mk(groups * rows) if bias else torch.empty(0, dtype=dtype, device=device))
        vs.append(mk(groups, rows, cols))
    shift = torch.randn(len(shapes), generator=g, dtype=torch.float64).to(device, dtype)
    lr = torch.tensor(0.5, dtype=torch.float64, device=device)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-4, atol=1e-5)
    for kl, sh, abs_terms in ((1e-3, None, False), (1e-3, shift, True), (None, shift, True)):
        kl_t = None if kl is None else torch.tensor(kl, dtype=torch.float64, device=device)
        got, want = (_clone(ws), _clone(bs)), (_clone(ws), _clone(bs))
        ref.kfac_precondition_apply_(*want, vs, lr, kl_t, sh, abs_terms)
        ops.kfac_precondition_apply_(*got, [_padded(v, 2) for v in vs], lr, kl_t, sh, abs_terms)
        for i, (a, b) in enumerate(zip(got[0] + got[1], want[0] + want[1])):
            torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"tensor {i}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_factor_ema_over_more_factors_than_a_launch_holds(device):
    """The fold over 90 factors of two dtypes (more than one CUDA launch's table of 40), one
    longer than a launch's blocks cover (320 chunks of 65536 on CUDA, its mirrors in other
    blocks' chunks), statistics with inf or NaN in some (dropped), a zero count (not folded),
    device-gated due and not due: against the reference; every statistic and count emptied."""
    g = torch.Generator().manual_seed(15)
    big = (1, 4600, 4600) if device == "cuda" else (2, 60, 60)
    shapes = [(1 + i % 3, 1 + (7 * i) % 13, 1 + (7 * i) % 13) for i in range(89)] + [big]
    dtypes = [torch.float64 if i % 2 else torch.float32 for i in range(len(shapes))]
    decay = torch.tensor(0.9, dtype=torch.float64, device=device)
    for step in (None, torch.tensor(4.0, device=device), torch.tensor(3.0, device=device)):
        mk = lambda s, d: torch.randn(s, generator=g, dtype=torch.float64).to(device, d)  # noqa: E731
        fs = [mk(s, d) for s, d in zip(shapes, dtypes)]
        ss = [mk(s, d) for s, d in zip(shapes, dtypes)]
        cs = [torch.tensor(float(i % 4), dtype=d, device=device) for i, d in enumerate(dtypes)]
        ss[3].view(-1)[0] = float("inf")
        ss[len(ss) - 1].view(-1)[-1] = float("nan")
        want = (_clone(fs), _clone(ss), _clone(cs))
        expected = _drops(ss, cs, step, 2)
        dropped = torch.zeros((), device=device)
        ref.kfac_factor_ema_(*want, decay, step, 2)
        ops.kfac_factor_ema_(fs, ss, cs, decay, step, 2, dropped)
        for i, (a, b) in enumerate(zip(fs + ss + cs, want[0] + want[1] + want[2])):
            tol = 1e-12 if a.dtype == torch.float64 else 1e-5
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, i=i: f"tensor {i}: {m}")
        assert all(not s.any() for s in ss) and all(c == 0 for c in cs)
        assert dropped.item() == expected == (0 if step is not None and step.item() == 3.0 else 2)


def test_factor_ema_rejects_a_bad_dropped_counter_writing_nothing():
    decay = torch.tensor(0.9, dtype=torch.float64)
    for bad, exc in [(torch.zeros((), dtype=torch.float64), TypeError), (torch.zeros(1), ValueError)]:
        fs, ss, cs = _ema_args("cpu", torch.float32, 4)
        before = _clone(fs + ss + cs)
        with pytest.raises(exc, match="dropped"):
            ops.kfac_factor_ema_(fs, ss, cs, decay, None, 1, bad)
        with pytest.raises(exc, match="dropped"):  # the kernel's own check
            torch.ops.cafin.kfac_factor_ema_(fs, ss, cs, decay, None, 1, bad)
        for a, b in zip(fs + ss + cs, before):
            assert torch.equal(a, b)
        assert not bad.any()


def test_apply_rejects_bad_shift_and_layouts():
    ws, bs, vs = _apply_args("cpu", torch.float32, 0)
    lr = torch.tensor(0.1, dtype=torch.float64)
    for shift, exc, match in [(torch.zeros(2), ValueError, "shift must be a 1-dim tensor of 3"),
                              (torch.zeros(3, 1), ValueError, "shift must be a 1-dim tensor of 3"),
                              (torch.zeros(3, dtype=torch.float64), TypeError, "shift has dtype")]:
        with pytest.raises(exc, match=match):
            ops.kfac_precondition_apply_(ws, bs, vs, lr, None, shift)
        with pytest.raises(exc, match=match):  # the kernel's own check
            torch.ops.cafin.kfac_precondition_apply_(ws, bs, vs, lr, None, shift, False)
    with pytest.raises(TypeError, match="abs_terms"):
        ops.kfac_precondition_apply_(ws, bs, vs, lr, None, None, 1)
    before = _clone(ws)
    columns = [v.mT.contiguous().mT for v in vs]  # column-major rows: not one stride apart
    with pytest.raises(ValueError, match=r"precond\[0\] must have contiguous, equally spaced rows"):
        ops.kfac_precondition_apply_(ws, bs, columns, lr)
    uneven = torch.randn(2, 6, 8)[:, :3, :5]  # groups not rows * row stride apart
    with pytest.raises(ValueError, match=r"precond\[1\] must have contiguous, equally spaced rows"):
        ops.kfac_precondition_apply_(ws, bs, [vs[0], uneven, vs[2]], lr)
    assert all(torch.equal(a, b) for a, b in zip(ws, before))  # nothing written


def test_zero_dot_product_means_no_scaling():
    ws, bs, vs = _apply_args("cpu", torch.float64, 1)
    vs = [torch.zeros_like(v) for v in vs]
    vs[0][0, 0, 0] = 1.0
    ws[0].zero_()  # <V, grad> = 0
    ops.kfac_precondition_apply_(ws, bs, vs, torch.tensor(1.0, dtype=torch.float64),
                                 torch.tensor(1e-9, dtype=torch.float64))
    assert ws[0][0, 0].item() == 1.0


def test_ops_reject_bad_arguments():
    fs, ss, cs = _ema_args("cpu", torch.float32, 0)
    decay = torch.tensor(0.9, dtype=torch.float64)
    with pytest.raises(ValueError, match="stats"):
        ops.kfac_factor_ema_(fs, ss[:2], cs, decay)
    with pytest.raises(ValueError, match="shape"):
        ops.kfac_factor_ema_(fs, [ss[1], ss[0], ss[2]], cs, decay)
    ws, bs, vs = _apply_args("cpu", torch.float32, 0)
    with pytest.raises(ValueError, match="precond"):
        ops.kfac_precondition_apply_(ws, bs, [vs[1], vs[0], vs[2]], decay)
    with pytest.raises(TypeError, match="dtype"):
        ops.kfac_precondition_apply_(ws, bs, [v.double() for v in vs], decay)


class TestKFACOps:
    """Small calls of every K-FAC op for generate_opcheck_tests (schema, autograd registration,
    fake tensor, AOT dispatch)."""

    def test_kfac_factor_ema_(self):
        fs, ss, cs = _ema_args("cpu", torch.float32, 1)
        ops.kfac_factor_ema_(fs, ss, cs, torch.tensor(0.95, dtype=torch.float64), torch.tensor(2.0), 2)

    def test_kfac_factor_ema_dropped(self):
        fs, ss, cs = _ema_args("cpu", torch.float32, 2)
        ss[1][0, 0, 0] = float("inf")  # count 0: nothing to fold, nothing dropped
        ss[2][1, 0, 0] = float("nan")
        dropped = torch.zeros(())
        ops.kfac_factor_ema_(fs, ss, cs, torch.tensor(0.95, dtype=torch.float64), None, 1, dropped)
        assert dropped.item() == 1.0

    def test_kfac_eigen_scale_(self):
        ops.kfac_eigen_scale_([torch.randn(2, 3, 4)], [torch.rand(2, 3)], [torch.rand(2, 4)],
                              torch.tensor(1e-3, dtype=torch.float64))

    def test_kfac_precondition_apply_(self):
        ws, bs, vs = _apply_args("cpu", torch.float32, 2)
        ws[0].requires_grad_(False)
        ops.kfac_precondition_apply_(ws, bs, vs, torch.tensor(0.1, dtype=torch.float64),
                                     torch.tensor(1e-3, dtype=torch.float64))

    def test_kfac_precondition_apply_shift_abs_terms(self):
        ws, bs, vs = _apply_args("cpu", torch.float32, 3)
        ops.kfac_precondition_apply_(ws, bs, [_padded(v, 2) for v in vs], torch.tensor(1.0, dtype=torch.float64),
                                     torch.tensor(1e-3, dtype=torch.float64), torch.randn(3), True)

    def test_kfac_eigen_products_(self):
        ops.kfac_eigen_products_(*_products_args(False))


def _products_args(requires_grad: bool):
    """kfac_eigen_products_'s arguments: a stack with Q_A reading its own gradient, a matrix with
    a diagonal A reading another source."""
    def q(n, *lead):
        return torch.linalg.qr(torch.randn(*lead, n, n))[0].requires_grad_(requires_grad)
    grads = [torch.randn(2, 3, 4), torch.empty(5, 6)]
    works = [torch.empty(2, 4, 3), torch.empty(5, 6)]
    sources = [None, torch.randn(5, 6, requires_grad=requires_grad)]
    return grads, works, sources, [q(4, 2), None], [q(3, 2), q(5)], [torch.rand(2, 3, 4), torch.rand(5, 6)]


def test_opcheck_with_inputs_that_require_grad():
    """opcheck's autograd-registration check runs only when an input requires grad: the
    read-only inputs do here (the ops are non-differentiable by declaration)."""
    fs, ss, cs = _ema_args("cpu", torch.float32, 4)
    decay = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.cafin.kfac_factor_ema_.default, (fs, ss, cs, decay, torch.tensor(2.0), 2))
    dg, da = torch.rand(2, 3, requires_grad=True), torch.rand(2, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.cafin.kfac_eigen_scale_.default,
                          ([torch.randn(2, 3, 4)], [dg], [da], torch.tensor(1e-3, dtype=torch.float64)))
    ws, bs, vs = _apply_args("cpu", torch.float32, 3)
    vs = [v.requires_grad_() for v in vs]
    torch.library.opcheck(torch.ops.cafin.kfac_precondition_apply_.default,
                          (ws, bs, vs, torch.tensor(0.1, dtype=torch.float64), None))
    torch.library.opcheck(torch.ops.cafin.kfac_eigen_products_.default, _products_args(True))


generate_opcheck_tests(
    TestKFACOps, ["cafin"], failures_dict_path=str(Path(__file__).with_name("failures_dict.json")),
    additional_decorators={},
    test_utils=["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"])


# ------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_compiled_step_equals_eager_with_a_graph_per_phase(method, fresh_dynamo):
    """torch.compile(pre.step, fullgraph=True) decides from the host's step count: one graph per
    phase of the two intervals (factors every 2 steps, decompositions every 3: four phases, met by
    k = 6), and no graph more over the next six steps while lr and damping change every step."""
    kw = dict(compute_method=method, factor_update_steps=2, inv_update_steps=3, kl_clip=1e-4)
    kind = "stacked_mlp"  # two layers of equal shapes: the stacked chain is compiled too
    batches = data(kind, torch.float32, 13)
    base = base_model(kind, torch.float32)
    graphs_after = {}

    def run(compiled):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        pre = cafin.KFACPreconditioner(model, **kw)
        step = torch.compile(pre.step, fullgraph=True) if compiled else pre.step
        for i, batch in enumerate(batches):
            opt.zero_grad()
            loss_of(model, *batch[0]).backward()
            if i == 0:
                pre.step()  # the first step eagerly: layers become live, state exists
            else:
                step()
            opt.step()
            pre.lr = 0.1 / (i + 1)  # changes every step: a tensor, no recompile
            pre.damping = 1e-3 * (i + 1)
            graphs_after[i] = counters["stats"]["unique_graphs"]
        return model, pre
    eager, _ = run(False)
    compiled, pre = run(True)
    assert not pre._steps.device_gated and pre.steps == 13
    assert rel_error(eager, compiled, flat(base)) <= 1e-4
    assert graphs_after[6] <= 1 + 4, graphs_after
    assert graphs_after[12] == graphs_after[6], graphs_after
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_compiled_step_that_is_not_due_does_no_curvature_work(method, fresh_dynamo, one_thread):
    """A compiled iteration on a step that is neither a factor nor an inverse step does the FLOPs
    of the eager one and no decomposition (no statistics, folds or decompositions launched and
    discarded); a due one does both."""
    from bench.proxies import profiled
    decomposition = "aten::_linalg_eigh" if method == "eigen" else "aten::linalg_inv_ex"
    kw = dict(compute_method=method, factor_update_steps=3, inv_update_steps=3)
    batches = data("mlp", torch.float32, 8)
    base = base_model("mlp", torch.float32)
    flops = {}
    for compiled in (False, True):
        model = copy.deepcopy(base)
        pre = cafin.KFACPreconditioner(model, **kw)
        step = torch.compile(pre.step, fullgraph=True, backend="aot_eager") if compiled else pre.step
        for k, batch in enumerate(batches):
            def iteration():
                model.zero_grad()
                loss_of(model, *batch[0]).backward()
                step()
            if k in (6, 7):  # due, not due: phases whose graphs k = 3 and 4 made
                graphs = counters["stats"]["unique_graphs"]
                flops[(compiled, k)] = profiled(iteration)
                assert counters["stats"]["unique_graphs"] == graphs  # a compile is no step's work
            else:
                iteration()
    assert flops[(True, 7)].flops <= 1.05 * flops[(False, 7)].flops, flops
    assert flops[(True, 6)].flops > flops[(True, 7)].flops, flops
    assert flops[(True, 7)].ops[decomposition] == 0 < flops[(True, 6)].ops[decomposition]


# ------------------------------------------------------------------------------- precision, scaler
def test_grad_scaler_unscales_the_gradient_statistics():
    """A scaled backward, unscale_, step: the same as the unscaled run (power-of-two scale:
    exact), as kfac-pytorch's grad_scaler argument does."""
    kw = dict(inv_dtype=torch.float64, decompose_dtype=torch.float64)
    batches = data("cnn", torch.float64, 4)
    base = base_model("cnn", torch.float64)
    plain, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), copy.deepcopy(base), batches)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10 ** 6)
    pre = cafin.KFACPreconditioner(model, grad_scaler=scaler, **kw)
    for batch in batches:
        opt.zero_grad()
        scaler.scale(loss_of(model, *batch[0])).backward()
        scaler.unscale_(opt)
        pre.step()
        scaler.step(opt)
        scaler.update()
    assert rel_error(plain, model, flat(base)) <= 1e-12
    # a callable returning the scale works the same way
    model2 = copy.deepcopy(base)
    scaled, _ = train(lambda m: cafin.KFACPreconditioner(m, grad_scaler=lambda: 1.0, **kw), model2, batches)
    assert rel_error(plain, scaled, flat(base)) <= 1e-12


def test_overflowing_scaled_step_leaves_the_factors_finite():
    """kfac-pytorch folds an overflow step's inf gradient statistics into G for good; cafin drops
    them (the step the GradScaler skips does not reach the factors)."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    pre = cafin.KFACPreconditioner(model, grad_scaler=scaler)
    x, y = data("cnn", torch.float32, 1)[0][0]
    opt.zero_grad()
    scaler.scale(loss_of(model, x, y) * 4).backward()
    scaler.unscale_(opt)
    with pytest.warns(RuntimeWarning, match="4 factor statistic"):
        pre.step()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0 ** 127  # it was an overflow step
    assert pre.skipped_factor_updates == 4  # every layer's G
    for st in pre._state.values():
        assert torch.isfinite(st.A).all() and torch.isfinite(st.G).all()
        assert torch.equal(st.G, torch.eye(st.G.shape[-1]).expand_as(st.G))  # dropped
        assert not torch.equal(st.A, torch.eye(st.A.shape[-1]).expand_as(st.A))  # inputs are fine


def _factors(pre):
    return [t.clone() for st in pre._state.values() for t in (st.A, st.G)]


@pytest.mark.parametrize("in_hook", [True, False], ids=["fold_in_hook", "fold_at_step"])
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_non_finite_statistic_is_dropped_counted_and_warned(backend, in_hook):
    """A pass whose output gradients are NaN (finite inputs): every layer's G statistic is
    dropped, counted on the device and reported by the step as a RuntimeWarning; G keeps its
    value, A folds as usual, and the next clean step folds and warns of nothing new."""
    torch.manual_seed(0)
    model = mlp().double()
    pre = cafin.KFACPreconditioner(model, backend=backend, update_factors_in_hook=in_hook)
    x, y = data("mlp", torch.float64, 1)[0][0]
    layers = len(pre.layers)

    def pass_and_step(scale):
        model.zero_grad(set_to_none=True)
        (loss_of(model, x, y) * scale).backward()
        pre.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pass_and_step(1.0)
    assert pre.skipped_factor_updates == 0
    before = _factors(pre)
    with pytest.warns(RuntimeWarning, match=rf"KFACPreconditioner: {layers} factor statistic\(s\) held inf/NaN"):
        pass_and_step(math.nan)
    assert pre.skipped_factor_updates == layers
    after = _factors(pre)
    for A0, G0, A1, G1 in zip(before[0::2], before[1::2], after[0::2], after[1::2]):
        assert torch.equal(G1, G0)  # dropped
        assert torch.isfinite(A1).all() and not torch.equal(A1, A0)  # its inputs were finite
    for st in pre._state.values():
        assert not st.stat_G.any() and not st.count_G.any()  # emptied, never stored
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pass_and_step(1.0)
    assert pre.skipped_factor_updates == layers
    for G1, G2 in zip(after[1::2], _factors(pre)[1::2]):
        assert torch.isfinite(G2).all() and not torch.equal(G2, G1)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_compiled_model_and_step_keep_a_graph_per_phase(fresh_dynamo):
    """The statistics hooks traced into a compiled model decide from the host count too (a
    bool per interval, not the count: a model's int attributes are constants to Dynamo): the
    model's and the step's graphs are bounded by their phases, and training equals eager."""
    kw = dict(factor_update_steps=2, inv_update_steps=2)
    batches = data("mlp", torch.float64, 7)
    base = base_model("mlp", torch.float64)
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        pre = cafin.KFACPreconditioner(model, inv_dtype=torch.float64, **kw)
        net = torch.compile(model, backend="eager") if compiled else model
        step = torch.compile(pre.step, backend="eager", fullgraph=True) if compiled else pre.step
        for k, batch in enumerate(batches):
            opt.zero_grad()
            loss_of(net, *batch[0]).backward()
            (pre.step if k == 0 else step)()
            opt.step()
            if compiled and k == 3:  # each phase seen, by the model and by the step
                seen = counters["stats"]["unique_graphs"]
                assert seen <= 2 * (1 + 2), dict(counters["stats"])
        runs.append(model)
    assert counters["stats"]["unique_graphs"] == seen, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert rel_error(runs[0], runs[1], flat(base)) <= 1e-10


def test_compiled_step_counts_dropped_statistics_on_due_steps(fresh_dynamo):
    """A compiled step counts the statistics it drops, only on the steps that fold
    (factor_update_steps=2), in one graph per phase."""
    batches = data("stacked_mlp", torch.float32, 5)
    model = base_model("stacked_mlp", torch.float32)
    pre = cafin.KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2)
    step = torch.compile(pre.step, fullgraph=True)
    expected = []
    for i, batch in enumerate(batches):
        model.zero_grad(set_to_none=True)
        bad = i in (2, 3)  # k = 2 folds, k = 3 does not
        (loss_of(model, *batch[0]) * (math.nan if bad else 1.0)).backward()
        (pre.step if i == 0 else step)()
        expected.append(len(pre.layers) if i >= 2 else 0)
        assert pre.skipped_factor_updates == expected[-1], i
    assert all(torch.isfinite(f).all() for f in _factors(pre))
    assert counters["stats"]["unique_graphs"] <= 1 + 2, dict(counters["stats"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_float64_model_counts_its_passes(backend, fresh_dynamo):
    """torch.compile(model) of a float64 model: the forward hooks' pass counts survive the
    compiled forward (a 0-dim float64 counter's in-place add was dropped by AOTAutograd, so A
    was never folded), and training matches the eager model, with gradient accumulation."""
    kw = dict(accumulation_steps=2, inv_dtype=torch.float64, decompose_dtype=torch.float64)
    batches = data("mlp", torch.float64, 3, acc=2)
    base = base_model("mlp", torch.float64)
    eager, eager_pre = train(lambda m: cafin.KFACPreconditioner(m, **kw), copy.deepcopy(base), batches)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    pre = cafin.KFACPreconditioner(model, **kw)
    compiled = torch.compile(model, backend=backend)
    for i, batch in enumerate(batches):
        opt.zero_grad()
        for j, (x, y) in enumerate(batch):
            (loss_of(compiled, x, y) / len(batch)).backward()
            if i == 0:
                assert all(st.count_A.item() == j + 1 == st.count_G.item() for st in pre._state.values())
        pre.step()
        opt.step()
    for a, b in zip(_factors(eager_pre), _factors(pre)):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    assert rel_error(eager, model, flat(base)) <= 1e-10


def test_bfloat16_model_with_float32_factors():
    batches = data("cnn", torch.float32, 3)
    base = base_model("cnn", torch.float32)
    ref32, _ = train(lambda m: cafin.KFACPreconditioner(m), copy.deepcopy(base), batches)
    bf = copy.deepcopy(base).to(torch.bfloat16)
    bf_batches = [[(x.to(torch.bfloat16), y) for x, y in b] for b in batches]
    bf, pre = train(lambda m: cafin.KFACPreconditioner(m, factor_dtype=torch.float32), bf, bf_batches)
    assert all(st.A.dtype == torch.float32 for st in pre._state.values())
    assert torch.isfinite(flat(bf).float()).all()
    # bf16 rounds the parameters themselves: compare the direction of the whole move
    move32, move16 = flat(ref32) - flat(base), flat(bf).float() - flat(base)
    assert F.cosine_similarity(move32, move16, dim=0) > 0.98


def test_decompose_outside_the_step():
    """decompose_in_step=False with decompose() on the inverse interval (the CUDA-graph recipe)
    equals the default run."""
    kw = dict(inv_update_steps=2, inv_dtype=torch.float64, decompose_dtype=torch.float64)
    batches = data("mlp", torch.float64, 5)
    base = base_model("mlp", torch.float64)
    plain, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), copy.deepcopy(base), batches)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    pre = cafin.KFACPreconditioner(model, **kw)
    pre.decompose_in_step = False
    for i, batch in enumerate(batches):
        opt.zero_grad()
        loss_of(model, *batch[0]).backward()
        if i % 2 == 0:
            pre._update_factors()  # what step() does first, so decompose() sees this step's factors
            pre.decompose()
        pre.step()
        opt.step()
    assert rel_error(plain, model, flat(base)) <= 1e-12


# ------------------------------------------------------------------------------- reduced precision
class _GemmDtypes(TorchDispatchMode):
    """The dtypes of every GEMM (mm, bmm, baddbmm, addmm, cafin's eigenbasis products op) run
    while active: (op name, operand dtypes)."""

    GEMMS = {"mm", "bmm", "baddbmm", "addmm", "kfac_eigen_products"}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")  # baddbmm_ is baddbmm
        if name in self.GEMMS:
            flat_args = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            self.seen.append((name, {t.dtype for t in flat_args if isinstance(t, torch.Tensor)}))
        return func(*args, **(kwargs or {}))


def _precision_errors(option: dict, steps=6):
    from bench.kfac_precision import lockstep_errors
    """Each registered layer's largest relative error ||V - V_32|| / ||V_32|| of its
    preconditioned gradient (weight and bias) against a float32 preconditioner's over `steps`
    steps, the option's model kept on the float32 run's weights (same gradients: only the
    option's rounding differs); and the preconditioner with the option."""
    kw = dict(inv_update_steps=2, damping=3e-3)
    base = base_model("deep", torch.float32)
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_pre = cafin.KFACPreconditioner(ref_model, **kw)
    pre = cafin.KFACPreconditioner(model, **kw, **option)
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    batches = [batch[0] for batch in data("deep", torch.float32, steps)]
    return lockstep_errors((ref_model, ref_pre), (model, pre), batches, opt, loss=loss_of), pre


# Measured on this model (CPU, torch 2.13), the largest layer error: 1.4e-2 with inv_dtype
# bfloat16, 1.1e-2 with factor_dtype bfloat16 and with both, 2.1e-3 with inv_dtype float16;
# float64 against float32 2e-6 (docs/kfac.md "Reduced precision" has the larger models). The
# ceilings hold those with a 3.5-5x margin; the floors, far above float32's own error, fail if
# the reduced dtype is not really used.
@pytest.mark.parametrize("option, low, high", [
    (dict(inv_dtype=torch.bfloat16), 1e-3, 0.05),
    (dict(factor_dtype=torch.bfloat16), 1e-3, 0.05),
    (dict(factor_dtype=torch.bfloat16, inv_dtype=torch.bfloat16), 1e-3, 0.05),
    (dict(inv_dtype=torch.float16), 1e-4, 0.01),
])
def test_reduced_precision_preconditioned_gradients_within_measured_bounds(option, low, high):
    worst, pre = _precision_errors(option)
    assert low < max(worst.values()) < high, worst
    inv = option.get("inv_dtype", torch.float32)
    fac = option.get("factor_dtype", torch.float32)
    for st in pre._state.values():
        assert {t.dtype for t in st.second.values()} == {inv}
        assert {st.A.dtype, st.G.dtype, st.stat_A.dtype, st.stat_G.dtype} == {fac}


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_gemms_run_in_bfloat16(device):
    """With factor_dtype and inv_dtype bfloat16, the statistics GEMMs of the forward and
    backward and every eigenbasis product of the step are bfloat16 GEMMs (the GPU's bfloat16
    rate), none upcast to float32. Float32 runs them in float32 (the check can fail)."""
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        model = deep().to(device)
        pre = cafin.KFACPreconditioner(model, inv_update_steps=2, factor_dtype=dtype, inv_dtype=dtype)
        batches = [[t.to(device) for t in b[0]] for b in data("deep", torch.float32, 4)]
        for x, y in batches[:3]:  # decomposed, buffers made; the next step is not due
            model.zero_grad()
            loss_of(model, x, y).backward()
            pre.step()
        model.zero_grad()
        with _GemmDtypes() as passes:
            loss_of(model, *batches[3]).backward()
        with _GemmDtypes() as step:
            pre.step()
        stats = [s for s in passes.seen if s[0] == "baddbmm"]  # the model's own GEMMs are addmm, mm
        assert stats and all(dts == {dtype} for _, dts in stats), stats
        assert step.seen and all(dts == {dtype} for _, dts in step.seen), step.seen


def test_unsupported_precisions_are_refused_at_construction():
    """factor_dtype and inv_dtype take float64, float32, bfloat16 and float16, decompose_dtype
    float32 and float64 (what eigh and inv_ex run in); anything else (float8 has no GEMMs) is
    refused at construction, naming the argument."""
    for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        pre = cafin.KFACPreconditioner(mlp(), factor_dtype=dt, inv_dtype=dt)
        assert pre._state["0"].A.dtype == dt and pre._state["0"].second["qg"].dtype == dt
    for kw, name in [(dict(inv_dtype=torch.float8_e4m3fn), "inv_dtype"),
                     (dict(inv_dtype="bfloat16"), "inv_dtype"),
                     (dict(factor_dtype=torch.float8_e5m2), "factor_dtype"),
                     (dict(factor_dtype=torch.int8), "factor_dtype"),
                     (dict(decompose_dtype=torch.bfloat16), "decompose_dtype")]:
        with pytest.raises(TypeError, match=f"{name} must be .*float32.*, got"):
            cafin.KFACPreconditioner(mlp(), **kw)


# ------------------------------------------------------------------------------- compatibility arguments
def test_compat_arguments_live_in_one_module():
    import dataclasses
    from cafin.optim import kfac
    from cafin.optim.kfac import compat as kfac_compat
    for name in ("ComputeMethod", "AssignmentStrategy", "DistributedStrategy"):
        assert getattr(kfac, name) is getattr(kfac_compat, name)
    opts = kfac_compat.kaisa_options(
        allreduce_bucket_cap_mb=10, assignment_strategy="memory", colocate_factors=True,
        grad_worker_fraction=kfac_compat.DistributedStrategy.HYBRID_OPT, symmetry_aware=False,
        compute_method=kfac_compat.ComputeMethod.EIGEN, compute_eigenvalue_outer_product=True)
    assert (opts.allreduce_bucket_cap_mb, opts.assignment_strategy, opts.grad_worker_fraction) == \
        (10.0, kfac_compat.AssignmentStrategy.MEMORY, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.symmetry_aware = True
    pre = cafin.KFACPreconditioner(mlp(), assignment_strategy="memory", allreduce_bucket_cap_mb=5)
    assert pre.assignment_strategy is kfac_compat.AssignmentStrategy.MEMORY and pre.allreduce_bucket_cap_mb == 5.0
    for kwargs, match in [(dict(symmetry_aware="no"), "symmetry_aware"), (dict(colocate_factors=1), "colocate_factors"),
                          (dict(allreduce_bucket_cap_mb="25"), "allreduce_bucket_cap_mb"),
                          (dict(allreduce_bucket_cap_mb=float("nan")), "allreduce_bucket_cap_mb")]:
        with pytest.raises((TypeError, ValueError), match=match):
            cafin.KFACPreconditioner(mlp(), **kwargs)


# ------------------------------------------------------------------------------- LambdaParamScheduler
def _precond_snapshot(pre):
    """Everything a rejected call must leave alone: counters, intervals, values, every tensor."""
    tensors = [t.clone() for st in pre._state.values()
               for t in (st.A, st.G, st.stat_A, st.stat_G, st.count_A, st.count_G, *st.second.values())]
    tensors += [t.clone() for ts in pre._tensors.values() for t in ts.values()]
    return (pre.steps, pre._factor_update_steps, pre._inv_update_steps, dict(pre._values),
            [st.seen for st in pre._state.values()], tensors)


def _same_snapshot(a, b):
    assert a[:5] == b[:5]
    assert len(a[5]) == len(b[5]) and all(torch.equal(x, y) for x, y in zip(a[5], b[5]))


def _same_state_dict(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key == "layers":
            assert a[key].keys() == b[key].keys()
            for name in a[key]:
                for f in ("A", "G"):
                    x, y = a[key][name][f], b[key][name][f]
                    assert (x is None and y is None) or torch.equal(x, y), (name, f)
        else:
            assert a[key] == b[key], key


def test_lambda_param_scheduler_hand_computed():
    assert cafin.LambdaParamScheduler is cafin.optim.LambdaParamScheduler and "LambdaParamScheduler" in cafin.__all__
    pre = cafin.KFACPreconditioner(mlp(), factor_update_steps=2, inv_update_steps=4, damping=0.01, factor_decay=0.9,
                                   kl_clip=1e-3, lr=0.1)
    sched = cafin.LambdaParamScheduler(
        pre, factor_update_steps_lambda=lambda k: 2 if k == 1 else 1, inv_update_steps_lambda=lambda k: 1.5,
        damping_lambda=lambda k: 0.5, factor_decay_lambda=lambda k: 1.0 if k < 2 else 1.05,
        kl_clip_lambda=lambda k: 10.0, lr_lambda=lambda k: 0.1 * (k + 1))
    want = {0: (2, 6, 0.005, 0.9, 1e-2, 0.01), 1: (4, 9, 0.0025, 0.9, 1e-1, 0.002),
            2: (4, 13, 0.00125, 0.945, 1.0, 0.0006)}
    for k in range(3):
        sched.step(k)
        got = (pre.factor_update_steps, pre.inv_update_steps, pre.damping, pre.factor_decay, pre.kl_clip, pre.lr)
        assert got[:2] == want[k][:2] and got[2:] == pytest.approx(want[k][2:], rel=1e-12), (k, got)
    ts = pre._tensors[torch.device("cpu")]
    assert ts["damping"].item() == pytest.approx(0.00125, rel=1e-12)
    assert ts["lr"].item() == pytest.approx(6e-4, rel=1e-12)
    # without a step given, the lambdas see the preconditioner's step count
    model = mlp().double()
    pre = cafin.KFACPreconditioner(model, damping=0.01)
    seen = []
    sched = cafin.LambdaParamScheduler(pre, damping_lambda=lambda k: seen.append(k) or 0.5)
    for x, y in (b[0] for b in data("mlp", torch.float64, 2)):
        model.zero_grad()
        loss_of(model, x, y).backward()
        pre.step()
        sched.step()
    assert seen == [1, 2] and pre.damping == pytest.approx(0.0025, rel=1e-12)


def test_lambda_param_scheduler_refuses_callables_and_clipping_off():
    with pytest.raises(ValueError, match="damping"):
        cafin.LambdaParamScheduler(cafin.KFACPreconditioner(mlp(), damping=lambda k: 1e-3), damping_lambda=lambda k: 1)
    with pytest.raises(ValueError, match="inv_update_steps"):
        cafin.LambdaParamScheduler(cafin.KFACPreconditioner(mlp(), inv_update_steps=lambda k: 2),
                                   inv_update_steps_lambda=lambda k: 1)
    with pytest.raises(ValueError, match="kl_clip"):
        cafin.LambdaParamScheduler(cafin.KFACPreconditioner(mlp(), kl_clip=None), kl_clip_lambda=lambda k: 1)
    with pytest.raises(TypeError, match="lr_lambda"):
        cafin.LambdaParamScheduler(cafin.KFACPreconditioner(mlp()), lr_lambda=0.5)


@pytest.mark.parametrize("bad, match", [
    (dict(damping_lambda=lambda k: -1.0), "damping"), (dict(factor_decay_lambda=lambda k: 2.0), "factor_decay"),
    (dict(factor_decay_lambda=lambda k: 0.0), "factor_decay"),
    (dict(factor_update_steps_lambda=lambda k: 0), "factor_update_steps"),
    (dict(inv_update_steps_lambda=lambda k: 0.1), "inv_update_steps"),
    (dict(kl_clip_lambda=lambda k: float("inf")), "kl_clip"), (dict(lr_lambda=lambda k: "2"), "lr"),
    (dict(damping_lambda=lambda k: True), "damping"),
])
def test_lambda_param_scheduler_bad_value_changes_nothing(bad, match):
    """A good lambda is evaluated first (the intervals come first): nothing is written until
    every new value is checked."""
    pre = cafin.KFACPreconditioner(mlp(), factor_update_steps=2, inv_update_steps=4)
    good = dict(lr_lambda=lambda k: 0.5) if "factor_update_steps_lambda" in bad else \
        dict(factor_update_steps_lambda=lambda k: 2)
    sched = cafin.LambdaParamScheduler(pre, **good, **bad)
    before = _precond_snapshot(pre)
    with pytest.raises((ValueError, TypeError), match=match):
        sched.step(3)
    _same_snapshot(before, _precond_snapshot(pre))


# ------------------------------------------------------------------------------- checkpoint validation
def _trained_cnn_preconditioner(steps=3, **kw):
    model = base_model("cnn", torch.float64)
    pre = cafin.KFACPreconditioner(model, inv_dtype=torch.float64, decompose_dtype=torch.float64, **kw)
    for batch in data("cnn", torch.float64, steps):
        model.zero_grad()
        loss_of(model, *batch[0]).backward()
        pre.step()
    return model, pre


def _poison(sd, what):
    sd = copy.deepcopy(sd)
    if isinstance(what, dict):
        sd.update(what)
    elif what == "nan_factor":
        sd["layers"]["5"]["G"][1, 1] = float("nan")
    elif what == "inf_factor":
        sd["layers"]["0"]["A"][0, 0] = float("inf")
    elif what == "int_factor":
        sd["layers"]["0"]["A"] = sd["layers"]["0"]["A"].long()
    elif what == "list_factor":
        sd["layers"]["0"]["A"] = sd["layers"]["0"]["A"].tolist()
    return sd


@pytest.mark.parametrize("what, match", [
    (dict(damping=-1.0), "damping"), (dict(factor_update_steps=0), "factor_update_steps"),
    (dict(inv_update_steps="3"), "inv_update_steps"), (dict(steps=-2), "steps"), (dict(steps="4"), "steps"),
    (dict(steps=2.5), "steps"), (dict(lr=float("nan")), "lr"), (dict(factor_decay=True), "factor_decay"),
    ("nan_factor", "non-finite"), ("inf_factor", "non-finite"), ("int_factor", "floating"), ("list_factor", "tensor"),
])
def test_rejected_load_changes_nothing(what, match):
    _, src = _trained_cnn_preconditioner(factor_update_steps=1, inv_update_steps=1)
    good = src.state_dict()
    model, pre = _trained_cnn_preconditioner(steps=2, factor_update_steps=2, inv_update_steps=2, damping=0.01)
    before, snap = pre.state_dict(), _precond_snapshot(pre)
    for compute_inverses in (True, False):
        with pytest.raises((ValueError, TypeError), match=match):
            pre.load_state_dict(_poison(good, what), compute_inverses=compute_inverses)
        _same_state_dict(before, pre.state_dict())
        _same_snapshot(snap, _precond_snapshot(pre))
    # the good checkpoint, through torch.save / torch.load(weights_only=True), loads and trains finitely
    import io
    buf = io.BytesIO()
    torch.save(good, buf)
    buf.seek(0)
    pre.load_state_dict(torch.load(buf, weights_only=True))
    _same_state_dict(good, pre.state_dict())
    model.zero_grad()
    loss_of(model, *data("cnn", torch.float64, 1, seed=9)[0][0]).backward()
    pre.step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------------------- copies
def test_deepcopy_is_hooked_to_the_copied_model_and_trains_identically():
    kw = dict(inv_update_steps=2, damping=lambda k: 1e-3 * (k + 1), kl_clip=1e-4, inv_dtype=torch.float64,
              decompose_dtype=torch.float64)
    batches = data("cnn", torch.float64, 5)
    base = base_model("cnn", torch.float64)
    plain, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), copy.deepcopy(base), batches)

    def run(pre, opt, model, part):
        for batch in part:
            opt.zero_grad()
            loss_of(model, *batch[0]).backward()
            pre.step()
            opt.step()

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    pre = cafin.KFACPreconditioner(model, **kw)
    run(pre, opt, model, batches[:2])
    alone = copy.deepcopy(pre)  # copies the model with it
    assert alone.model is not model
    assert [layer.module for layer in alone.layers] == [alone.model[i] for i in (0, 2, 5, 7)]
    both = copy.deepcopy({"model": model, "pre": pre})  # one memo: the copy uses the model's copy
    assert both["pre"].model is both["model"]
    assert [layer.module for layer in both["pre"].layers] == [both["model"][i] for i in (0, 2, 5, 7)]
    runs = [(pre, opt, model)]
    for copy_pre, copy_model in ((alone, alone.model), (both["pre"], both["model"])):
        copy_opt = torch.optim.SGD(copy_model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        copy_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        runs.append((copy_pre, copy_opt, copy_model))
    for args in runs:
        run(*args, batches[2:])
    for _, _, m in runs:
        assert torch.equal(flat(m), flat(plain))
    assert pre.steps == alone.steps == both["pre"].steps == 5


# ------------------------------------------------------------------------------- callables checked at the step
@pytest.mark.parametrize("kw, match", [
    (dict(damping=lambda k: 1e-3 if k < 2 else -1.0), "damping"),
    (dict(factor_decay=lambda k: 0.95 if k < 2 else 2.0), "factor_decay"),
    (dict(inv_update_steps=lambda k: 1 if k < 2 else 0), "inv_update_steps"),
    (dict(factor_update_steps=lambda k: 1 if k < 2 else 0), "factor_update_steps"),
    (dict(lr=lambda k: 0.1 if k < 2 else float("nan")), "lr"),
    (dict(kl_clip=lambda k: 1e-3 if k < 2 else "big"), "kl_clip"),
    (dict(inv_update_steps=lambda k: 1 if k < 2 else 1.5), "inv_update_steps"),
])
@pytest.mark.parametrize("in_hook", [True, False])
def test_bad_callable_value_raises_before_any_write(kw, match, in_hook):
    model = base_model("mlp", torch.float64)
    pre = cafin.KFACPreconditioner(model, update_factors_in_hook=in_hook, **kw)
    batches = data("mlp", torch.float64, 3)
    for batch in batches[:2]:
        model.zero_grad()
        loss_of(model, *batch[0]).backward()
        pre.step()
    before = _precond_snapshot(pre)  # a bad value may already stop the forward's hooks
    grads = None
    with pytest.raises((ValueError, TypeError), match=match):
        model.zero_grad()
        loss_of(model, *batches[2][0]).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        before = _precond_snapshot(pre)  # this pass's statistics are in: the step writes nothing
        pre.step()
    _same_snapshot(before, _precond_snapshot(pre))
    if grads is not None:
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_skip_layers_string_is_one_pattern():
    model = nn.ModuleDict({"enc": nn.Linear(3, 3), "dec": nn.Linear(3, 3)})
    assert [layer.name for layer in cafin.KFACPreconditioner(model, skip_layers="enc").layers] == ["dec"]
    assert [layer.name for layer in cafin.KFACPreconditioner(model, skip_layers=["enc"]).layers] == ["dec"]
    with pytest.raises(TypeError, match="skip_layers"):
        cafin.KFACPreconditioner(model, skip_layers=["enc", 3])
    with pytest.raises(ValueError, match="skip_layers"):
        cafin.KFACPreconditioner(model, skip_layers="(")


class Mixed(nn.Module):
    """A float64 layer feeding a float32 one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 6).double()
        self.b = nn.Linear(6, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.double())).float())


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_mixed_dtype_layers_with_kl_clip(backend):
    """The clip factor is one reduction over the float64 and the float32 layer."""
    kw = dict(kl_clip=1e-5, lr=1.0, inv_update_steps=2)
    batches = data("mlp", torch.float32, 4)
    torch.manual_seed(0)
    base = Mixed()
    ours, _ = train(lambda m: cafin.KFACPreconditioner(m, backend=backend, **kw), copy.deepcopy(base), batches)
    theirs, _ = train(lambda m: Oracle(m, **kw), copy.deepcopy(base), batches)
    unclipped, _ = train(lambda m: cafin.KFACPreconditioner(m, backend=backend, **{**kw, "kl_clip": None}),
                         copy.deepcopy(base), batches)
    start = torch.cat([p.detach().double().reshape(-1) for p in base.parameters()])
    as64 = lambda m: torch.cat([p.detach().double().reshape(-1) for p in m.parameters()])  # noqa: E731
    moved = (as64(theirs) - start).abs().max()
    assert ((as64(ours) - as64(theirs)).abs().max() / moved).item() <= 1e-4
    assert ((as64(unclipped) - as64(theirs)).abs().max() / moved).item() > 1e-2  # clipping was active


def test_reference_kl_clip_callable_returning_none_agrees_with_fused():
    """kfac-pytorch turns clipping off with a callable returning None: both backends, no NaN."""
    kw = dict(inv_dtype=torch.float64, decompose_dtype=torch.float64, kl_clip=1e-5, lr=1.0)
    batches = data("cnn", torch.float64, 3)
    base = base_model("cnn", torch.float64)
    off, _ = train(lambda m: cafin.KFACPreconditioner(m, **{**kw, "kl_clip": None}), copy.deepcopy(base), batches)
    for backend in ("fused", "reference"):
        got, _ = train(lambda m: cafin.KFACPreconditioner(m, backend=backend, **{**kw, "kl_clip": lambda k: None}),
                       copy.deepcopy(base), batches)
        assert torch.isfinite(flat(got)).all(), backend
        assert rel_error(off, got, flat(base)) <= 1e-12, backend
    ws, bs, vs = _apply_args("cpu", torch.float64, 4)
    want = (_clone(ws), _clone(bs))
    nan = torch.tensor(math.nan, dtype=torch.float64)
    ref.kfac_precondition_apply_(*want, vs, torch.tensor(1.0, dtype=torch.float64), nan)
    ops.kfac_precondition_apply_(ws, bs, vs, torch.tensor(1.0, dtype=torch.float64), nan)
    for a, b in zip(ws + bs, want[0] + want[1]):
        assert torch.equal(a, b)


def test_backend_is_chosen_at_construction(monkeypatch):
    """fused runs the kernels for float32/float64 whatever the gradients' layout (channels_last
    goes through a contiguous copy) and never switches to the reference ops per call; a bfloat16
    model's ops are the reference ones, decided at construction."""
    kw = dict(inv_dtype=torch.float64, decompose_dtype=torch.float64)
    batches = data("cnn", torch.float64, 3)
    base = base_model("cnn", torch.float64)
    plain, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), copy.deepcopy(base), batches)
    calls = []
    for name in ("kfac_precondition_apply_", "kfac_factor_ema_", "kfac_eigen_scale_"):
        original = getattr(cafin.reference, name)
        monkeypatch.setattr(cafin.reference, name,
                            lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    last = copy.deepcopy(base).to(memory_format=torch.channels_last)
    last_batches = [[(x.to(memory_format=torch.channels_last), y) for x, y in b] for b in batches]
    last, _ = train(lambda m: cafin.KFACPreconditioner(m, **kw), last, last_batches)
    assert not last[0].weight.is_contiguous()  # the layout really was channels_last
    assert calls == []
    assert rel_error(plain, last, flat(base)) <= 1e-12
    bf = base_model("cnn", torch.float32).to(torch.bfloat16)
    pre = cafin.KFACPreconditioner(bf, factor_dtype=torch.float32)
    cpu = torch.device("cpu")
    assert pre._impls[(cpu, torch.bfloat16)] is cafin.reference and pre._impls[(cpu, torch.float32)] is ops
    x, y = data("cnn", torch.float32, 1)[0][0]
    loss_of(bf, x.to(torch.bfloat16), y).backward()
    pre.step()
    assert calls == ["kfac_precondition_apply_"]  # the bf16 gradients: reference, as decided


# ------------------------------------------------------------------------------- distributed
DIST_STEPS = 3


def rank_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (5,), generator=g)


def _dist_worker(outdir: str) -> None:
    """One of two gloo ranks: DDP over cnn() in float64, K-FAC with kfac-pytorch's KAISA options."""
    import os
    rank, _ = two_ranks.join(outdir)
    model = base_model("cnn", torch.float64)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    pre = cafin.KFACPreconditioner(ddp, inv_dtype=torch.float64, decompose_dtype=torch.float64,
                                   grad_worker_fraction=0.5, factor_update_steps=1, inv_update_steps=2)
    for step in range(DIST_STEPS):
        opt.zero_grad()
        loss_of(ddp, *rank_batch(step, rank)).backward()
        pre.step()
        opt.step()
    torch.save({"params": flat(model), "state": pre.state_dict()}, os.path.join(outdir, f"rank{rank}.pt"))
    del ddp, opt, pre
    two_ranks.leave()


def test_ddp_two_ranks_equal_the_rank_averaged_oracle(tmp_path):
    """Two gloo processes under DDP: identical on both ranks, and equal to one process that takes
    each rank's statistics separately and averages them (kfac-pytorch averages each factor over
    the ranks after its update; cafin averages every factor once per factor step, in one
    collective: the same numbers, because the previous factors are equal on every rank)."""
    failure = two_ranks.launch(lambda rank: [__file__, "--dist-worker", tmp_path], tmp_path)
    assert failure is None, failure
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert torch.equal(r0["params"], r1["params"])
    for name, layer in r0["state"]["layers"].items():
        assert torch.equal(layer["A"], r1["state"]["layers"][name]["A"])
    model = base_model("cnn", torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    oracle = Oracle(model, inv_update_steps=2, inv_dtype=torch.float64, decompose_dtype=torch.float64)
    for step in range(DIST_STEPS):
        opt.zero_grad()
        for rank in range(2):  # each rank's batch at full scale: its own G
            loss_of(model, *rank_batch(step, rank)).backward()
        for p in model.parameters():
            p.grad.div_(2)  # DDP's average
        oracle.step()
        opt.step()
    err = ((r0["params"] - flat(model)).abs().max() / (flat(model) - flat(base_model("cnn", torch.float64))).abs().max())
    assert err <= 1e-10, err.item()


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["--dist-worker"]:
        _dist_worker(sys.argv[2])


def test_failed_eigendecomposition_retries_in_float64_then_keeps_the_previous_one(monkeypatch):
    """eigh failing in decompose_dtype is retried in float64 (the result equals asking for
    float64); failing in both, every layer keeps its previous decompositions, with a warning."""
    torch.manual_seed(0)
    data = [(torch.randn(8, 5), torch.randint(0, 3, (8,))) for _ in range(3)]

    def run(fail, decompose_dtype=torch.float32):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        pre = cafin.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1,
                                       decompose_dtype=decompose_dtype)
        eigh = torch.linalg.eigh
        for i, (x, y) in enumerate(data):
            def failing(a, *args, **kwargs):
                if a.dtype in fail(i):
                    raise torch.linalg.LinAlgError("forced")
                return eigh(a, *args, **kwargs)
            monkeypatch.setattr(torch.linalg, "eigh", failing)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            seconds = [{k: v.clone() for k, v in pre._state[layer.name].second.items()} for layer in pre.layers]
            pre.step()
            monkeypatch.setattr(torch.linalg, "eigh", eigh)
        return pre, seconds

    retried, _ = run(lambda i: {torch.float32} if i == 2 else set())
    wanted, _ = run(lambda i: set(), decompose_dtype=torch.float64)
    for layer in wanted.layers:
        for key, value in wanted._state[layer.name].second.items():
            assert torch.equal(retried._state[layer.name].second[key], value), key
    with pytest.warns(cafin.core.EigendecompositionWarning, match="float64"):
        kept, before = run(lambda i: {torch.float32, torch.float64} if i == 2 else set())
    for layer, saved in zip(kept.layers, before):
        for key, value in saved.items():
            assert torch.equal(kept._state[layer.name].second[key], value), key


def test_side_by_side_tool_runs(monkeypatch, capsys):
    """tools/kfac_side_by_side.py (the kfac-pytorch comparison of docs/kfac.md) runs end to end:
    with cafin standing in for kfac-pytorch every error is 0."""
    import importlib.util
    import sys
    import types
    spec = importlib.util.spec_from_file_location(
        "kfac_side_by_side", Path(__file__).resolve().parents[1] / "tools" / "kfac_side_by_side.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    stand_in = types.ModuleType("kfac")
    stand_in.preconditioner = types.SimpleNamespace(KFACPreconditioner=cafin.KFACPreconditioner)
    monkeypatch.setitem(sys.modules, "kfac", stand_in)
    monkeypatch.setitem(sys.modules, "kfac.preconditioner", stand_in.preconditioner)
    monkeypatch.setattr(tool, "MODELS", {"MLP": tool.MODELS["MLP"]})
    monkeypatch.setattr(tool, "CONFIGS", dict(list(tool.CONFIGS.items())[:1]))
    monkeypatch.setattr(tool, "STEPS", 2)
    tool.main()
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| MLP |") and row.count("0.0e+00") == 2, row
