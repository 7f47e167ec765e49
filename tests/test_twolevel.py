"""cafin.TwoLevelKFAC against an independent float64 oracle written from the maths: per-sample
gradients by one backward per sample, the dense empirical Fisher, K-FAC factors from an explicit
unfold, inverses by linear solves (not eigendecompositions), the coarse matrix as
(1/B) sum_n (R g_n)(R g_n)^T."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cafin

import two_ranks
import stand_ins

DAMP, ALPHA = 1e-2, 0.9
C1 = 1.0 / (1.0 + 1e-8)  # the published ones vector after its inf-norm normalisation


def mlp(bias, dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 4), nn.Tanh(),
                         nn.Linear(4, 3, bias=bias)).to(dtype)


def cnn(bias, dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=bias), nn.Tanh(),
                         nn.Conv2d(3, 2, 3, stride=2, bias=bias), nn.Tanh(), nn.Flatten(),
                         nn.Linear(2 * 2 * 2, 3, bias=bias)).to(dtype)


class Mean(nn.Module):
    def forward(self, x):
        return x.mean(1)


def seq(bias, dtype=torch.float64):
    """Linear layers on [B, 2, 3, 5] (6 locations), on [B, 6, 7] (6) and on [B, 4] (1)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Flatten(1, 2), nn.Linear(7, 4), nn.Tanh(),
                         Mean(), nn.Linear(4, 3, bias=bias)).to(dtype)


NETS = {"mlp": mlp, "cnn": cnn, "seq": seq}
INPUTS = {"mlp": (5,), "cnn": (2, 6, 6), "seq": (2, 3, 5)}


def batch(kind, B, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, *INPUTS[kind], generator=g)
    return x.to(dtype), torch.randint(0, 3, (B,), generator=g)


# ------------------------------------------------------------------ oracle
def layers_of(net):
    return [m for m in net.modules() if type(m) in (nn.Linear, nn.Conv2d)]


def gmat(m, w, b):
    w = w.reshape(w.shape[0], -1)
    return w if b is None else torch.cat([w, b.reshape(-1, 1)], 1)


def oracle_statistics(net, x, t):
    """Rows, output gradients x B, per-sample gradient matrices, batch gradient, per layer."""
    mods = layers_of(net)
    ins, outs = {}, {}
    def keep(m, i, o):
        ins[m], outs[m] = i[0], o
    hs = [m.register_forward_hook(keep) for m in mods]
    out = net(x)
    for h in hs:
        h.remove()
    B = x.shape[0]
    loss = F.cross_entropy(out, t)
    gys = torch.autograd.grad(loss * B, [outs[m] for m in mods], retain_graph=True)
    per_sample = []
    for n in range(B):
        ln = F.cross_entropy(out[n:n + 1], t[n:n + 1])
        gs = torch.autograd.grad(ln, [p for m in mods for p in ([m.weight] + ([m.bias] if m.bias is not None else []))],
                                 retain_graph=True)
        it, mats = iter(gs), []
        for m in mods:
            w = next(it)
            mats.append(gmat(m, w, next(it) if m.bias is not None else None))
        per_sample.append(mats)
    stats = []
    for li, m in enumerate(mods):
        a, gy = ins[m].detach(), gys[li]
        if isinstance(m, nn.Conv2d):
            u = F.unfold(a, m.kernel_size, padding=m.padding, stride=m.stride)  # [B, d, T]
            rows = u.transpose(1, 2).reshape(-1, u.shape[1])
            T = gy.shape[2] * gy.shape[3]
            gy = gy.permute(0, 2, 3, 1).reshape(-1, gy.shape[1])
        else:  # [B, T..., d]: T locations per sample
            rows = a.reshape(-1, a.shape[-1])
            T = rows.shape[0] // B
            gy = gy.reshape(-1, gy.shape[-1])
        if m.bias is not None:
            rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
        stats.append(dict(rows=rows, gy=gy, T=T, G=torch.stack([ps[li] for ps in per_sample]),
                          conv=isinstance(m, nn.Conv2d)))
    grads = [s["G"].mean(0) for s in stats]
    return stats, grads


class Oracle:
    def __init__(self, coarse, krylov):
        self.coarse, self.krylov = coarse, krylov
        self.k, self.A, self.Gf, self.Fc = 0, None, None, None

    def step(self, net, x, t):
        stats, grads = oracle_statistics(net, x, t)
        B = x.shape[0]
        rho = None if self.k == 0 else min(1 - 1 / self.k, ALPHA)
        ema = (lambda old, new: new) if rho is None else (lambda old, new: rho * old + (1 - rho) * new)
        A = [s["rows"].t() @ s["rows"] / s["rows"].shape[0] for s in stats]
        G = [s["gy"].t() @ s["gy"] / s["gy"].shape[0] for s in stats]
        self.A = A if self.A is None else [ema(o, n) for o, n in zip(self.A, A)]
        self.Gf = G if self.Gf is None else [ema(o, n) for o, n in zip(self.Gf, G)]
        Ad = [a + DAMP * torch.eye(a.shape[0], dtype=a.dtype) for a in self.A]
        Gd = [g + DAMP * torch.eye(g.shape[0], dtype=g.dtype) for g in self.Gf]

        def minv(i, v):
            return torch.linalg.solve(Gd[i], torch.linalg.solve(Ad[i], v.t()).t())

        P = [minv(i, g) / s["T"] for i, (s, g) in enumerate(zip(stats, grads))]
        if self.coarse == "none":  # the first level alone
            self.k += 1
            return P
        # dense empirical Fisher times the K-FAC direction, by per-sample inner products
        proj = sum((s["G"] * p).sum((1, 2)) for s, p in zip(stats, P))
        FP = [(s["G"] * proj.view(-1, 1, 1)).sum(0) / B for s in stats]
        res = [g - fp - DAMP * p for g, fp, p in zip(grads, FP, P)]
        vecs = []
        for i, (g, r) in enumerate(zip(grads, res)):
            if self.krylov:
                r1 = torch.ones_like(g) if self.coarse == "nicolaides" else minv(i, r)
                vs = [r1, minv(i, r1)]
            elif self.coarse in ("nicolaides", "tpselepedis"):
                vs = [torch.ones_like(g)]
            elif self.coarse == "residual":
                vs = [minv(i, r)]
            else:
                qa = torch.linalg.eigh(Ad[i])[1][:, 0]
                qg = torch.linalg.eigh(Gd[i])[1][:, 0]
                vs = [torch.outer(qg, qa)]
            vecs.append([v / (v.abs().max() + 1e-8) for v in vs])
        flat = [(s, v) for s, vs in zip(stats, vecs) for v in vs]
        if self.coarse == "tpselepedis":
            n = len(stats)
            Fc = torch.zeros(n, n, dtype=x.dtype)

            def at(s, key, T):  # the published nearest interpolation to T locations per sample
                picked = s[key].reshape(B, s["T"], -1)[:, torch.arange(T) * s["T"] // T]
                return picked.reshape(B * T, -1)
            for i in range(n):
                for j in range(n):
                    T = min(stats[i]["T"], stats[j]["T"])
                    N = B * T
                    Aij = at(stats[i], "rows", T).t() @ at(stats[j], "rows", T) / N
                    Gij = at(stats[i], "gy", T).t() @ at(stats[j], "gy", T) / N
                    Fc[i, j] = C1 * C1 * Aij.sum() * Gij.sum()
        else:
            U = torch.stack([(s["G"] * v).sum((1, 2)) for s, v in flat], 1)  # [B, n_c]
            Fc = U.t() @ U / B
        Fc = Fc + torch.diag(torch.tensor([DAMP * v.numel() for _, v in flat], dtype=x.dtype))
        self.Fc = Fc if self.Fc is None else ema(self.Fc, Fc)
        rhs = torch.stack([(v * g).sum() for (s, v), g in zip(flat, [g for g, vs in zip(grads, vecs) for _ in vs])])
        y = torch.linalg.solve(self.Fc, rhs)
        out, i = [], 0
        for p, vs in zip(P, vecs):
            for v in vs:
                p = p + y[i] * v
                i += 1
            out.append(p)
        self.k += 1
        return out


def run_ours(opt, net, x, t):
    opt.zero_grad()
    opt.update_stats = True
    F.cross_entropy(net(x), t).backward()
    opt.step(update_params=True)
    return [gmat(m, m.weight.grad, None if m.bias is None else m.bias.grad).clone() for m in layers_of(net)]


def rel(a, b):
    return max(float((u - v).norm() / v.norm()) for u, v in zip(a, b))


CASES = [("nicolaides", False), ("spectral", False), ("residual", False), ("tpselepedis", False),
         ("nicolaides", True), ("residual", True)]


ORACLE_CASES = [(k, b, c, kr) for k in ("mlp", "cnn", "seq") for b in (True, False)
                for c, kr in [*CASES, ("none", False)]]


@pytest.mark.parametrize("kind,bias,coarse,krylov", ORACLE_CASES,
                         ids=[f"{k}-{'bias' if b else 'nobias'}-{c}{'+krylov' if kr else ''}"
                              for k, b, c, kr in ORACLE_CASES])
def test_matches_oracle_float64(kind, bias, coarse, krylov):
    net = NETS[kind](bias)
    ref_net = copy.deepcopy(net)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, alpha=ALPHA, coarse_space=coarse, krylov=krylov)
    orc = Oracle(coarse, krylov)
    for s in range(2):
        x, t = batch(kind, 16, s)
        ours = run_ours(opt, net, x, t)
        want = orc.step(ref_net, x, t)
        assert rel(ours, want) <= 1e-8, (s, rel(ours, want))
        with torch.no_grad():  # same parameter move on both, so the next step sees new weights
            for p, q in zip(net.parameters(), ref_net.parameters()):
                p.sub_(0.05 * p.grad)
                q.copy_(p)


def test_float32_close_to_float64_oracle():
    net = cnn(True, torch.float32)
    ref_net = cnn(True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, alpha=ALPHA, coarse_space="nicolaides")
    orc = Oracle("nicolaides", False)
    x, t = batch("cnn", 24, 0)
    ours = run_ours(opt, net, x.float(), t)
    want = orc.step(ref_net, x, t)
    assert rel([o.double() for o in ours], want) <= 1e-4


@pytest.mark.parametrize("kind", ["cnn", "seq"])
@pytest.mark.parametrize("bugs", [False, True])
@pytest.mark.parametrize("coarse,krylov", [("nicolaides", False), ("spectral", False), ("residual", True)])
def test_cheap_assembly_equals_pairwise(coarse, krylov, bugs, kind):
    fs = []
    for backend in ("fused", "reference"):
        net = NETS[kind](True)
        opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=2, T_inv=3, coarse_space=coarse, krylov=krylov,
                                 backend=backend, published_bugs=bugs)
        gs = []
        for s in range(3):
            gs.append(run_ours(opt, net, *batch(kind, 8, s)))
        fs.append((opt.f_coarse.clone(), gs))
    assert torch.allclose(fs[0][0], fs[1][0], rtol=1e-10, atol=1e-12)
    assert rel(fs[0][1][-1], fs[1][1][-1]) <= 1e-9


@pytest.mark.parametrize("kind", ["cnn", "seq"])
@pytest.mark.parametrize("coarse,krylov", [("nicolaides", False), ("residual", True)])
def test_reference_pairwise_assembly_equals_the_cheap_one(coarse, krylov, kind):
    """cafin.maths.twolevel.coarse_matrix_pairwise (the published way, the bench's baseline) against
    the optimizer's cheap assembly, on the stored statistics of a Conv2d and a sequence network."""
    net = NETS[kind](True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, coarse_space=coarse, krylov=krylov)
    x, t = batch(kind, 8, 0)
    run_ours(opt, net, x, t)
    states = [opt.state[g["params"][0]] for g in opt.param_groups]
    raws = [torch.randn_like(s["Q_g"][:, :1] * s["Q_x"][:1]) for s in states]
    vectors = [opt._coarse_vectors(s, r, r) for s, r in zip(states, raws)]
    flat = [v for vs in vectors for v in vs]
    per = [s for s, vs in zip(states, vectors) for _ in vs]
    want = cafin.maths.twolevel.coarse_matrix_pairwise([s["x"] for s in per], [s["gy"] for s in per],
                                                  [s["num_locations"] for s in per], flat, opt.batch_size,
                                                  DAMP, symmetric=not krylov)
    assert torch.allclose(opt.coarse_matrix(vectors), want, rtol=1e-10, atol=1e-12)


def test_published_bugs_switch_changes_only_what_it_should():
    def grads(kind, coarse, bugs, bias=True):
        net = (mlp if kind == "mlp" else cnn)(bias)
        opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, coarse_space=coarse, published_bugs=bugs)
        return run_ours(opt, net, *batch(kind, 16, 0))
    # ones vectors on an MLP: no bug applies
    assert rel(grads("mlp", "nicolaides", True), grads("mlp", "nicolaides", False)) < 1e-12
    # Conv2d pairing of per-sample weights changes the coarse matrix
    assert rel(grads("cnn", "nicolaides", True), grads("cnn", "nicolaides", False)) > 1e-6
    # the spectral vector's Kronecker order, and the bias-layout of the right-hand side
    assert rel(grads("mlp", "spectral", True, bias=False), grads("mlp", "spectral", False, bias=False)) > 1e-6
    assert rel(grads("mlp", "residual", True), grads("mlp", "residual", False)) > 1e-6


def test_constraint_norm_scales_to_the_published_norm():
    net = mlp(True)
    plain = copy.deepcopy(net)
    x, t = batch("mlp", 16, 0)
    a = run_ours(cafin.TwoLevelKFAC(plain, damping=DAMP, T_cov=1, T_inv=1), plain, x, t)
    b = run_ours(cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, constraint_norm=True, clipping=1e-4),
                 net, x, t)
    _, raw = oracle_statistics(mlp(True), x, t)
    norm = sum(float((f[:, :-1] * g[:, :-1]).sum().abs() + (f[:, -1] * g[:, -1]).sum().abs()) for f, g in zip(a, raw))
    scale = min(math.sqrt(1e-4 / norm), 1.0)
    assert scale < 1
    assert rel(b, [f * scale for f in a]) < 1e-12


def test_true_fisher_loop_and_state_dict_round_trip():
    def loop(opt, net, sgd, s):
        x, t = batch("cnn", 12, s)
        sgd.zero_grad()
        out = net(x)
        loss = F.cross_entropy(out, t)
        opt.update_stats = True
        of = net(x[:8])
        ys = torch.multinomial(torch.softmax(of.detach(), 1), 1, generator=torch.Generator().manual_seed(s)).squeeze(1)
        F.cross_entropy(of, ys).backward(retain_graph=True)
        opt.step(update_params=False)
        sgd.zero_grad()
        opt.update_stats = False
        loss.backward()
        opt.step(update_params=True)
        sgd.step()

    net = cnn(True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=2, T_inv=2, coarse_space="residual")
    sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for s in range(3):
        loop(opt, net, sgd, s)
    assert opt.batch_size == 8  # published: overwritten by each collection
    net2 = copy.deepcopy(net)
    opt2 = cafin.TwoLevelKFAC(net2, damping=DAMP, T_cov=2, T_inv=2, coarse_space="residual")
    sgd2 = torch.optim.SGD(net2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    sgd2.load_state_dict(copy.deepcopy(sgd.state_dict()))  # torch shares the buffers otherwise
    for s in range(3, 6):
        loop(opt, net, sgd, s)
        loop(opt2, net2, sgd2, s)
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q)


def test_arguments():
    net = mlp(True)
    with pytest.raises(ValueError, match="coarse_space"):
        cafin.TwoLevelKFAC(net, coarse_space="geneo")
    with pytest.raises(ValueError, match="krylov"):
        cafin.TwoLevelKFAC(net, coarse_space="spectral", krylov=True)
    with pytest.raises(ValueError, match="krylov"):
        cafin.TwoLevelKFAC(net, coarse_space="tselepidis", krylov=True)
    with pytest.raises(ValueError, match="krylov"):
        cafin.TwoLevelKFAC(net, coarse_space="none", krylov=True)
    assert cafin.TwoLevelKFAC(net, coarse_space="tselepidis").coarse_space == "tpselepedis"
    with pytest.raises(ValueError, match="damping"):
        cafin.TwoLevelKFAC(net, damping=-1.0)
    with pytest.raises(ValueError, match="T_cov"):
        cafin.TwoLevelKFAC(net, T_cov=0)
    with pytest.raises(ValueError, match="backend"):
        cafin.TwoLevelKFAC(net, backend="cuda")
    with pytest.raises(ValueError, match="groups"):
        cafin.TwoLevelKFAC(nn.Conv2d(4, 4, 3, groups=2))
    opt = cafin.TwoLevelKFAC(net)
    x, t = batch("mlp", 4, 0)
    F.cross_entropy(net(x), t).backward()  # update_stats not set: nothing stored
    before = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="no Kronecker factors"):
        opt.step()
    assert all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))
    # subclasses are not registered (published: exact class names)

    class MyLinear(nn.Linear):
        pass
    sub = nn.Sequential(MyLinear(3, 3), nn.Linear(3, 2))
    assert cafin.TwoLevelKFAC(sub).num_layer == 1


# ------------------------------------------------------------------ transformers' Conv1D, GPT-2
class Conv1D(stand_ins.Conv1D):
    def __init__(self, nf, nx, bias=True):
        super().__init__(nf, nx, bias, weight_scale=1.0, bias_scale=1.0)

    def forward(self, x):
        # x @ weight + bias, rounded exactly as the Linear it is compared with rounds it (the
        # method amplifies a forward's rounding differences: they would hide what is tested)
        return F.linear(x, self.weight.t().contiguous(), self.bias)


def transposed(net):
    """The network with every Linear replaced by a Conv1D holding its transposed weight."""
    net = copy.deepcopy(net)
    for i, m in enumerate(net):
        if isinstance(m, nn.Linear):
            c = Conv1D(m.out_features, m.in_features, bias=m.bias is not None).to(m.weight.dtype)
            with torch.no_grad():
                c.weight.copy_(m.weight.t())
                if m.bias is not None:
                    c.bias.copy_(m.bias)
            net[i] = c
    return net


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("coarse,krylov", CASES, ids=[f"{c}{'+krylov' if k else ''}" for c, k in CASES])
def test_conv1d_equals_a_linear_with_the_transposed_weight(coarse, krylov, bias):
    nets = [seq(bias)]
    nets.append(transposed(nets[0]))
    assert [type(m).__name__ for m in nets[1] if hasattr(m, "weight")] == ["Conv1D"] * 3
    opts = [cafin.TwoLevelKFAC(n, damping=DAMP, T_cov=1, T_inv=2, coarse_space=coarse, krylov=krylov,
                               constraint_norm=True, clipping=1.0) for n in nets]
    sgds = [torch.optim.SGD(n.parameters(), lr=0.05, momentum=0.9) for n in nets]
    for s in range(3):
        x, t = batch("seq", 8, s)
        for net, opt, sgd in zip(nets, opts, sgds):
            sgd.zero_grad()
            opt.update_stats = True
            F.cross_entropy(net(x), t).backward()
            opt.step(update_params=True)
        lin = [m for m in nets[0] if isinstance(m, nn.Linear)]
        con = [m for m in nets[1] if isinstance(m, Conv1D)]
        assert rel([c.weight.grad.t() for c in con], [m.weight.grad for m in lin]) <= 1e-12
        if bias:
            assert rel([c.bias.grad for c in con], [m.bias.grad for m in lin]) <= 1e-12
        for sgd in sgds:
            sgd.step()
    for a, b in zip(opts[0].param_groups, opts[1].param_groups):
        assert (a["layer_type"], b["layer_type"]) == ("Linear", "Conv1D")
    # the state has the Linear's layout, and a checkpoint of it loads back
    opts[1].load_state_dict(copy.deepcopy(opts[1].state_dict()))


def test_linear_input_needs_a_batch_dim():
    net = nn.Sequential(nn.Linear(4, 3)).double()
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1)
    opt.update_stats = True
    net(torch.randn(4, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match="layer '0': Linear input must be \\[batch, ..., features\\]"):
        opt.step()
    assert not opt.state[net[0].weight]


def test_embeddings_are_refused_with_what_to_do_instead():
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 3))
    with pytest.raises(ValueError, match="layer '0'.*Embedding.*freeze it.*submodules without it"):
        cafin.TwoLevelKFAC(model)
    assert cafin.TwoLevelKFAC(model[1:]).num_layer == 1  # the optimizer steps the embedding itself
    model[0].requires_grad_(False)
    assert cafin.TwoLevelKFAC(model).num_layer == 1


def gpt2(transformers):
    torch.manual_seed(8)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def train_gpt2(model, pre, params, steps=5):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    x = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        pre.update_stats = True
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        pre.step(update_params=True)
        opt.step()
        losses.append(loss.item())
    return losses


def test_gpt2_every_conv1d_gets_curvature_and_the_model_trains():
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra")
    model = gpt2(transformers)
    with pytest.raises(ValueError, match="layer 'transformer.wte'.*Embedding"):
        cafin.TwoLevelKFAC(model)
    # the embeddings frozen: lm_head, tied to wte, is frozen with it
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    assert model.lm_head.weight is model.transformer.wte.weight and not model.lm_head.weight.requires_grad
    pre = cafin.TwoLevelKFAC(model, damping=0.1, T_cov=1, T_inv=1, constraint_norm=True)
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    assert len(conv1d) == 8 and {layer.name for layer in pre._layers} == conv1d  # c_attn, c_proj, c_fc
    params = [p for p in model.parameters() if p.requires_grad]
    losses = train_gpt2(model, pre, params)
    assert losses[-1] < losses[0], losses
    for group, layer in zip(pre.param_groups, pre._layers):
        st = pre.state[group["params"][0]]
        assert group["layer_type"] == "Conv1D" and st["num_locations"] == 16
        nx, nf = layer.module.weight.shape
        assert st["xxt"].shape == (nx + 1, nx + 1) and st["ggt"].shape == (nf, nf)
        assert all(bool(torch.isfinite(st[k]).all()) for k in ("xxt", "ggt", "Q_x", "Q_g"))
    assert torch.isfinite(pre.f_coarse).all() and pre.f_coarse.shape == (8, 8)


def test_gpt2_blocks_alone_leave_the_embeddings_to_the_torch_optimizer():
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra")
    model = gpt2(transformers)
    wte = model.transformer.wte.weight.detach().clone()
    pre = cafin.TwoLevelKFAC(model.transformer.h, damping=0.1, T_cov=1, T_inv=1, constraint_norm=True)
    assert pre.num_layer == 8
    losses = train_gpt2(model, pre, model.parameters())
    assert losses[-1] < losses[0], losses
    assert not torch.equal(model.transformer.wte.weight, wte)


# ------------------------------------------------------------------ compile
def _state_tensors(opt):
    tensors = {f"{i}/{key}": t for i, st in enumerate(opt.state.values()) for key, t in st.items()
               if isinstance(t, torch.Tensor)}
    return {**tensors, "f_coarse": opt.f_coarse, "f_coarse_inv": opt.f_coarse_inv}


@pytest.mark.parametrize("kind", ["mlp", "conv1d"])
def test_compiled_step_equals_eager_with_a_graph_per_phase(kind, fresh_dynamo):
    """torch.compile(step, fullgraph=True) after one eager step, the host deciding the intervals:
    T_cov = 2 and T_inv = 3 give four phases, all met by k = 6, and one graph each (plus the first
    graph, made while k was still a constant); the next six steps add none while damping,
    clipping and alpha change every step (0-dim tensors). A NaN batch on a T_cov step is dropped
    on the device as the eager step drops it. The compiled steps write every state tensor in
    place, with no graph break. The following SGD step is compiled too, with a tensor lr. On an
    MLP and on Conv1D layers over sequences."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    from cafin.optim.twolevel import NonFiniteStatisticsWarning
    NAN_STEP = 4
    make = (lambda: mlp(True)) if kind == "mlp" else (lambda: transposed(seq(True)))
    graphs_after = {}
    sgd_graphs = CompileCounterWithBackend("eager")

    def run(compiled):
        net = make()
        opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=2, T_inv=3, alpha=ALPHA, coarse_space="residual",
                                 constraint_norm=True, clipping=1e-3)
        sgd = torch.optim.SGD(net.parameters(), lr=torch.tensor(0.05, dtype=torch.float64), momentum=0.9)
        counter = CompileCounterWithBackend("eager")
        step = torch.compile(opt.step, fullgraph=True, backend=counter) if compiled else opt.step
        # torch.optim breaks its own graph around the step body on purpose: not fullgraph
        sgd_step = torch.compile(sgd.step, backend=sgd_graphs) if compiled else sgd.step
        storage = None
        for i in range(13):
            x, t = batch("mlp" if kind == "mlp" else "seq", 16, i)
            if i == NAN_STEP:  # a T_cov step on a NaN batch: its statistics are dropped
                x[2, 1] = math.nan
            sgd.zero_grad()
            opt.update_stats = True
            F.cross_entropy(net(x), t).backward()
            if i == NAN_STEP and not compiled:
                with pytest.warns(NonFiniteStatisticsWarning):
                    opt.step()
            else:
                (opt.step if i == 0 else step)()
            if i == 0:
                storage = {name: t.data_ptr() for name, t in _state_tensors(opt).items()}
            if i != NAN_STEP:  # its directions are NaN: the step is skipped, as a GradScaler would
                (sgd.step if i == 0 else sgd_step)()
            opt.damping = DAMP * (1 + 0.1 * i)
            opt.clipping = 1e-3 * (1 + 0.2 * i)
            opt.alpha = ALPHA - 0.01 * i  # rho = alpha from k = 10 on
            sgd.param_groups[0]["lr"].fill_(0.05 / (i + 1))
            graphs_after[i] = counter.frame_count
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), opt, storage

    eager, _, _ = run(False)
    compiled, opt, storage = run(True)
    assert not opt._steps.device_gated and opt._iteration_counter == 13
    assert all(torch.isfinite(t).all() for t in _state_tensors(opt).values())
    moved = [name for name, t in _state_tensors(opt).items() if t.data_ptr() != storage[name]]
    assert not moved, moved
    start = torch.cat([p.detach().reshape(-1) for p in make().parameters()])
    assert float((compiled - eager).norm() / (eager - start).norm()) <= 1e-10
    assert graphs_after[6] <= 1 + 4, graphs_after
    assert graphs_after[12] == graphs_after[6], graphs_after
    assert sgd_graphs.frame_count == 1  # the SGD body: its tensor lr changes, no recompile
    assert all("User-inserted graph break" in k for k in counters["graph_break"]), dict(counters["graph_break"])


@pytest.mark.parametrize("kind,coarse", [("mlp", "nicolaides"), ("cnn", "residual")])
def test_compiled_step_that_is_not_due_does_no_curvature_work(kind, coarse, fresh_dynamo, one_thread):
    """A compiled iteration on a step that is neither a T_cov nor a T_inv step does the FLOPs of
    the eager one (no statistics, folds, decompositions or coarse matrix launched, nothing
    committed with torch.where), and a due one does more, its eigendecompositions included.
    The same k of two identical runs, the compiled one's graphs made by earlier steps."""
    from torch._dynamo.utils import counters
    from bench.proxies import profiled
    flops = {}
    for compiled in (False, True):
        net = NETS[kind](True)
        opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=3, T_inv=3, coarse_space=coarse)
        step = torch.compile(opt.step, fullgraph=True, backend="aot_eager") if compiled else opt.step
        for k in range(8):
            x, t = batch(kind, 8, k)

            def iteration():
                net.zero_grad()
                opt.update_stats = True
                F.cross_entropy(net(x), t).backward()
                (opt.step if k == 0 else step)()
            if k in (6, 7):  # due, not due: phases whose graphs k = 3 and 4 made
                graphs = counters["stats"]["unique_graphs"]
                flops[(compiled, k)] = profiled(iteration)
                assert counters["stats"]["unique_graphs"] == graphs  # a compile is no step's work
            else:
                iteration()
    due, not_due = flops[(True, 6)], flops[(True, 7)]
    assert not_due.flops <= 1.05 * flops[(False, 7)].flops, flops
    assert due.flops > 1.3 * not_due.flops, flops
    for op in ("aten::_linalg_eigh", "aten::linalg_inv_ex", "aten::where"):
        assert not_due.ops[op] == 0 < due.ops[op], (op, flops)


def test_hyperparameters_are_checked_and_reach_the_step():
    net = mlp(True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP)
    with pytest.raises(ValueError, match="damping"):
        opt.damping = -1.0
    with pytest.raises(ValueError, match="alpha"):
        opt.alpha = 2.0
    assert opt.damping == DAMP
    opt.damping = torch.tensor(0.5)
    assert opt.damping == 0.5 and float(opt._tensors[torch.device("cpu")]["damping"]) == 0.5
    a = run_ours(opt, net, *batch("mlp", 8, 0))
    net2 = mlp(True)
    b = run_ours(cafin.TwoLevelKFAC(net2, damping=0.5), net2, *batch("mlp", 8, 0))
    assert rel(a, b) == 0



# ------------------------------------------------------------------ checkpoints
def sd_equal(a, b) -> bool:
    """Nested checkpoint equality, tensors bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(sd_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(sd_equal(u, v) for u, v in zip(a, b))
    return type(a) is type(b) and a == b


def trained(coarse="nicolaides", steps=2, seed=0, **kw):
    net = mlp(True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, alpha=ALPHA, coarse_space=coarse, **kw)
    for s in range(steps):
        run_ours(opt, net, *batch("mlp", 8, seed + s))
    return net, opt


def corrupted(sd):
    """(name the error must mention, a copy of sd with one bad entry)."""
    def edit(fn):
        bad = copy.deepcopy(sd)
        fn(bad)
        return bad
    x_state = sd["state"][0]
    yield "f_coarse", edit(lambda d: d["twolevel"].update(f_coarse=torch.eye(4, dtype=torch.float64)))
    yield "f_coarse_inv", edit(lambda d: d["twolevel"].update(f_coarse_inv=None))
    yield "f_coarse", edit(lambda d: d["twolevel"]["f_coarse"].fill_(math.nan))
    yield "Q_x", edit(lambda d: d["state"][0]["Q_x"].fill_(math.nan))
    yield "L_g", edit(lambda d: d["state"][2]["L_g"].fill_(math.inf))
    yield "xxt", edit(lambda d: d["state"][0].update(xxt=torch.eye(5, dtype=torch.float64)))
    yield "ggt", edit(lambda d: d["state"][0].update(ggt=d["state"][0]["ggt"].long()))
    yield "x", edit(lambda d: d["state"][0].update(x=x_state["x"][:3]))
    yield "Q_g", edit(lambda d: d["state"][4].pop("Q_g"))
    yield "num_locations", edit(lambda d: d["state"][0].update(num_locations=0))
    yield "num_locations", edit(lambda d: d["state"][0].update(num_locations=2.0))
    yield "iteration_counter", edit(lambda d: d["twolevel"].pop("iteration_counter"))
    yield "iteration_counter", edit(lambda d: d["twolevel"].update(iteration_counter=-1))
    yield "iteration_counter", edit(lambda d: d["twolevel"].update(iteration_counter=True))
    yield "batch_size", edit(lambda d: d["twolevel"].update(batch_size=0))
    yield "damping", edit(lambda d: d["twolevel"].update(damping=0.0))
    yield "alpha", edit(lambda d: d["twolevel"].update(alpha=math.nan))
    yield "clipping", edit(lambda d: d["twolevel"].update(clipping="1e-2"))
    yield "twolevel", edit(lambda d: d.pop("twolevel"))
    yield "layer_type", edit(lambda d: d["param_groups"][0].update(layer_type="Conv2d"))
    yield "param", edit(lambda d: d["state"].update({1: d["state"][0]}))
    yield "state", edit(lambda d: d["state"].pop(2))


def test_load_state_dict_validates_everything_before_replacing_anything():
    _, src = trained(steps=2, seed=0)
    sd = src.state_dict()
    _, opt = trained(steps=1, seed=5)
    before = copy.deepcopy(opt.state_dict())
    for name, bad in corrupted(sd):
        with pytest.raises((ValueError, TypeError), match=name):
            opt.load_state_dict(bad)
        assert sd_equal(opt.state_dict(), before), name
    opt.load_state_dict(sd)  # the good one still loads
    assert sd_equal(opt.state_dict(), sd)


def test_state_dict_resumes_bit_identically_through_torch_save():
    import io
    net, opt = trained("residual", steps=3, seed=0)
    opt.damping = 0.02  # a schedule's value: the checkpoint carries it
    opt.alpha = 0.8
    buf = io.BytesIO()
    torch.save({"net": net.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    net2 = mlp(True)
    net2.load_state_dict(saved["net"])
    opt2 = cafin.TwoLevelKFAC(net2, damping=DAMP, T_cov=1, T_inv=1, alpha=ALPHA, coarse_space="residual")
    opt2.load_state_dict(saved["opt"])
    assert opt2.damping == 0.02 and opt2.alpha == 0.8
    for s in range(3, 6):
        for o, n in ((opt, net), (opt2, net2)):
            run_ours(o, n, *batch("mlp", 8, s))
            with torch.no_grad():
                for p in n.parameters():
                    p.sub_(0.05 * p.grad)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), net2.parameters()))
    assert sd_equal(opt.state_dict(), opt2.state_dict())


# ------------------------------------------------------------------ odd models
def test_frozen_layers_are_skipped_and_half_frozen_ones_refused():
    net = mlp(True)
    for p in net[0].parameters():
        p.requires_grad_(False)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1)
    assert opt.num_layer == 2 and [g["params"][0] for g in opt.param_groups] == [net[2].weight, net[4].weight]
    for s in range(2):
        opt.zero_grad()
        opt.update_stats = True
        F.cross_entropy(net(batch("mlp", 8, s)[0]), batch("mlp", 8, s)[1]).backward()
        opt.step()
    assert net[0].weight.grad is None and torch.isfinite(net[2].weight.grad).all()
    assert opt.f_coarse.shape == (2, 2)
    half = mlp(True)
    half[2].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"layer '2'.*bias.*frozen"):
        cafin.TwoLevelKFAC(half)
    half = mlp(True)
    half[4].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"layer '4'.*weight.*frozen"):
        cafin.TwoLevelKFAC(half)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_keeps_its_curvature_in_float32(dtype):
    # damping 0.1: the directions amplify the half-precision gradients' rounding by up to the
    # factors' condition number (~1 / damping)
    net, ref = mlp(True, dtype), mlp(True, torch.float32)
    opt = cafin.TwoLevelKFAC(net, damping=0.1, T_cov=1, T_inv=1, coarse_space="residual")
    ref_opt = cafin.TwoLevelKFAC(ref, damping=0.1, T_cov=1, T_inv=1, coarse_space="residual")
    for s in range(3):
        x, t = batch("mlp", 16, s)
        ours = run_ours(opt, net, x.to(dtype), t)
        want = run_ours(ref_opt, ref, x.float(), t)
        assert all(g.dtype == dtype for g in ours)
        assert rel([g.float() for g in ours], want) < 0.1, s
    st = opt.state[net[0].weight]
    assert all(st[k].dtype == torch.float32 for k in ("x", "gy", "xxt", "ggt", "L_x", "Q_x", "L_g", "Q_g"))
    assert opt.f_coarse.dtype == torch.float32


def test_damping_must_be_positive():
    net = mlp(True)
    with pytest.raises(ValueError, match="damping"):
        cafin.TwoLevelKFAC(net, damping=0.0)
    opt = cafin.TwoLevelKFAC(net)
    with pytest.raises(ValueError, match="damping"):
        opt.damping = 0
    assert opt.damping == 1e-3


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 6).double(), nn.Linear(6, 6).double(), nn.Linear(6, 3).double()
        self.use_b = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b(h)) if self.use_b else h)


def test_an_unused_layer_is_named_and_nothing_changes():
    net = Branches()
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1)
    run_ours(opt, net, *batch("mlp", 8, 0))
    before = copy.deepcopy(opt.state_dict())
    net.use_b = False
    opt.zero_grad(set_to_none=True)
    opt.update_stats = True
    x, t = batch("mlp", 8, 1)
    F.cross_entropy(net(x), t).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match=r"layer 'b'.*(no gradient|not called)"):
        opt.step()
    assert sd_equal(opt.state_dict(), before)
    assert all((g is None and p.grad is None) or torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))
    # with a stale gradient left on it (zero_grad(set_to_none=False)), the statistics name it
    net.use_b = True
    opt.zero_grad(set_to_none=False)
    F.cross_entropy(net(x), t).backward()
    opt.step()
    net.use_b = False
    opt.update_stats = True
    F.cross_entropy(net(x), t).backward()
    with pytest.raises(RuntimeError, match=r"layer 'b'.*not called"):
        opt.step()


def test_a_layer_called_off_the_loss_is_named_and_a_validation_forward_is_not():
    """A layer the training forward calls but whose output does not reach the loss is named at
    the step; a validation forward (autograd on, its result discarded) after backward is not
    such a layer: the step goes on, as without it."""
    net = Branches()
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1)
    x, t = batch("mlp", 8, 0)
    opt.update_stats = True
    h = torch.tanh(net.a(x))
    net.b(h)  # called, its output discarded
    F.cross_entropy(net.c(h), t).backward()
    with pytest.raises(RuntimeError, match=r"layer 'b' got no output gradient"):
        opt.step(update_params=False)  # statistics only: b's missing gradient is not checked
    twin = copy.deepcopy(net)
    twin_opt = cafin.TwoLevelKFAC(twin, damping=DAMP, T_cov=1, T_inv=1)
    want = run_ours(twin_opt, twin, x, t)
    opt.zero_grad()
    F.cross_entropy(net(x), t).backward()
    net(batch("mlp", 5, 1)[0])  # the validation forward
    opt.step(update_params=True)
    got = [gmat(m, m.weight.grad, m.bias.grad) for m in layers_of(net)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# ------------------------------------------------------------------ a layer called twice
class Twice(nn.Module):
    """`shared` is called twice in one forward (on the input and on its own output)."""
    def __init__(self, bias=True):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(5, 5, bias=bias).double()
        self.head = nn.Linear(5, 3).double()

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


def per_sample_grads(net, x, t):
    out = []
    for n in range(x.shape[0]):
        net.zero_grad()
        F.cross_entropy(net(x[n:n + 1]), t[n:n + 1]).backward()
        out.append([gmat(m, m.weight.grad, None if m.bias is None else m.bias.grad).clone()
                    for m in (net.shared, net.head)])
    return [torch.stack(g) for g in zip(*out)]  # per layer [B, d_out, d_in + 1]


@pytest.mark.parametrize("bias", [True, False])
def test_a_layer_called_twice_pairs_each_input_with_its_own_gradient(bias):
    net = Twice(bias)
    x, t = batch("mlp", 8, 0)
    want = per_sample_grads(copy.deepcopy(net), x, t)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, coarse_space="nicolaides")
    run_ours(opt, net, x, t)
    for g, w in zip(opt.param_groups, want):
        st = opt.state[g["params"][0]]
        T = st["num_locations"]
        G = (st["gy"].reshape(8, T, -1).transpose(1, 2) @ st["x"].reshape(8, T, -1))
        assert torch.allclose(G, w, rtol=1e-10, atol=1e-12)
    assert opt.state[net.shared.weight]["num_locations"] == 2
    U = torch.stack([w.sum((1, 2)) * C1 for w in want], 1)
    fc = U.t() @ U / 8 + torch.diag(torch.tensor([DAMP * w[0].numel() for w in want], dtype=torch.float64))
    assert torch.allclose(opt.f_coarse, fc, rtol=1e-10, atol=1e-12)


def test_gradient_accumulation_keeps_the_last_backward_pass():
    net = mlp(True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1)
    opt.update_stats = True
    (x1, t1), (x2, t2) = batch("mlp", 8, 0), batch("mlp", 8, 1)
    for _ in range(3):
        F.cross_entropy(net(x1), t1).backward()
    F.cross_entropy(net(x2), t2).backward()
    assert len(opt._pending[id(opt._layers[0])]["calls"]) == 1  # earlier passes are not held
    opt.step()
    st = opt.state[net[0].weight]
    assert st["num_locations"] == 1 and torch.equal(st["x"][:, :-1], x2)
    # two forward passes, then their losses backpropagated one after the other
    opt.zero_grad()
    losses = [F.cross_entropy(net(x), t) for x, t in ((x1, t1), (x2, t2))]
    for loss in losses:
        loss.backward()
    opt.step()
    assert torch.equal(opt.state[net[0].weight]["x"][:, :-1], x2)
    # a forward whose output is never backpropagated takes no part either
    opt.zero_grad()
    net(x1)
    F.cross_entropy(net(x2), t2).backward()
    opt.step()
    assert torch.equal(opt.state[net[0].weight]["x"][:, :-1], x2)


# ------------------------------------------------------------------ non-finite statistics
@pytest.mark.parametrize("coarse", ["nicolaides", "residual"])
def test_a_nonfinite_batch_is_dropped_with_a_warning(coarse):
    from cafin.optim.twolevel import NonFiniteStatisticsWarning
    net = mlp(True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, alpha=ALPHA, coarse_space=coarse)
    run_ours(opt, net, *batch("mlp", 8, 0))
    keys = ("x", "gy", "xxt", "ggt", "L_x", "Q_x", "L_g", "Q_g")
    kept = [{k: opt.state[g["params"][0]][k].clone() for k in keys} for g in opt.param_groups]
    x, t = batch("mlp", 8, 1)
    x[3, 2] = math.nan
    with pytest.warns(NonFiniteStatisticsWarning, match="dropped"):
        run_ours(opt, net, x, t)
    assert opt.dropped_statistics >= 1 and opt.skipped_factor_updates == opt.dropped_statistics
    for g, old in zip(opt.param_groups, kept):
        assert all(torch.equal(opt.state[g["params"][0]][k], old[k]) for k in keys)
    assert torch.isfinite(opt.f_coarse).all() and torch.isfinite(opt.f_coarse_inv).all()
    for s in range(2, 4):  # later clean steps work
        assert all(torch.isfinite(g).all() for g in run_ours(opt, net, *batch("mlp", 8, s)))
    # on step 0 nothing exists yet: the gradients are left as they are and the step is not counted
    net2 = mlp(True)
    opt2 = cafin.TwoLevelKFAC(net2, damping=DAMP, T_cov=1, T_inv=1, coarse_space=coarse)
    x[3, 2] = math.inf
    with pytest.warns(NonFiniteStatisticsWarning):
        run_ours(opt2, net2, x, t)
    assert opt2._iteration_counter == 0 and opt2.dropped_statistics == 1
    assert not any(opt2.state.values()) and opt2.f_coarse is None
    net3 = mlp(True)
    a = run_ours(opt2, net2, *batch("mlp", 8, 2))
    b = run_ours(cafin.TwoLevelKFAC(net3, damping=DAMP, T_cov=1, T_inv=1, coarse_space=coarse), net3,
                 *batch("mlp", 8, 2))
    assert rel(a, b) == 0


def test_a_failed_eigendecomposition_retries_in_float64_then_keeps_the_basis(monkeypatch):
    from cafin.optim.twolevel import EigendecompositionWarning
    eigh = torch.linalg.eigh
    calls = []

    def flaky(a, *args, **kw):  # float32 fails; float64 too when `calls` says so
        calls.append(a.dtype)
        if a.dtype == torch.float32 or fail64:
            raise torch.linalg.LinAlgError("forced")
        return eigh(a, *args, **kw)

    net = mlp(True, torch.float32)
    ref = copy.deepcopy(net)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1)
    ref_opt = cafin.TwoLevelKFAC(ref, damping=DAMP, T_cov=1, T_inv=1)
    x, t = batch("mlp", 8, 0)
    fail64 = False
    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    run_ours(opt, net, x.float(), t)
    assert torch.float64 in calls
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    run_ours(ref_opt, ref, x.float(), t)
    for g, h in zip(opt.param_groups, ref_opt.param_groups):
        s, r = opt.state[g["params"][0]], ref_opt.state[h["params"][0]]
        assert s["Q_x"].dtype == torch.float32
        # float64 is more precise: the same basis up to the signs of its columns
        assert torch.allclose(s["L_x"], r["L_x"], rtol=1e-4, atol=1e-6)
        assert torch.allclose((s["Q_g"] * r["Q_g"]).sum(0).abs(), torch.ones(s["Q_g"].shape[0]), atol=1e-3)
    kept = [opt.state[g["params"][0]]["Q_x"].clone() for g in opt.param_groups]
    fail64 = True
    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    with pytest.warns(EigendecompositionWarning, match="previous"):
        run_ours(opt, net, *(lambda b: (b[0].float(), b[1]))(batch("mlp", 8, 1)))
    assert all(torch.equal(opt.state[g["params"][0]]["Q_x"], q) for g, q in zip(opt.param_groups, kept))
    # with no basis to keep (step 0) the step raises, naming the layer, and leaves nothing behind
    net4 = mlp(True, torch.float32)
    opt4 = cafin.TwoLevelKFAC(net4, damping=DAMP, T_cov=1, T_inv=1)
    with pytest.raises(RuntimeError, match="layer '0'"):
        run_ours(opt4, net4, x.float(), t)
    assert not any(opt4.state.values()) and opt4.f_coarse is None and opt4._iteration_counter == 0


# ------------------------------------------------------------------ data parallel
DIST_CASES = ("nicolaides", "residual", "tpselepedis")
DIST_STEPS, DIST_B = 3, 6


def dist_batch(step, rank):
    x, t = batch("cnn", 2 * DIST_B, 1000 + step)
    return x[rank * DIST_B:(rank + 1) * DIST_B], t[rank * DIST_B:(rank + 1) * DIST_B]


def dist_train(coarse, net, batches, on_step=lambda: None):
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=2, alpha=ALPHA, coarse_space=coarse)
    sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for x, t in batches:
        sgd.zero_grad()
        opt.update_stats = True
        F.cross_entropy(net(x), t).backward()
        opt.step(update_params=True)
        on_step()
        sgd.step()
    return opt


def _dist_worker(outdir: str) -> None:
    """One of two gloo ranks: DDP over cnn() in float64, each coarse space of DIST_CASES, the
    all_reduce calls of each step counted."""
    import os
    rank, _ = two_ranks.join(outdir)
    two_ranks.count_collectives(["all_reduce"])
    out = {}
    for coarse in DIST_CASES:
        model = cnn(True)
        ddp = nn.parallel.DistributedDataParallel(model)
        per_step = []

        def on_step():
            per_step.append(len(two_ranks.CALLS))
            two_ranks.CALLS.clear()
        two_ranks.CALLS.clear()
        opt = dist_train(coarse, ddp, [dist_batch(s, rank) for s in range(DIST_STEPS)], on_step)
        out[coarse] = {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                       "f_coarse": opt.f_coarse.clone(), "collectives": per_step}
        del ddp, opt
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    two_ranks.leave()


def test_ddp_two_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    """Two gloo processes under DDP, each with half of every batch: identical on both ranks and
    equal (float64, 1e-10) to one process on the whole batch. The factors and the coarse matrix
    are averaged in one collective per step for the ones-vector spaces (nicolaides,
    tpselepedis, whose two factor sums are averaged apart); the residual space needs the
    averaged factors for its vectors and the whole batch's Fisher product: three."""
    failure = two_ranks.launch(lambda rank: [__file__, "--dist-worker", tmp_path], tmp_path)
    assert failure is None, failure
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for coarse in DIST_CASES:
        assert torch.equal(r0[coarse]["params"], r1[coarse]["params"]), coarse
        assert torch.equal(r0[coarse]["f_coarse"], r1[coarse]["f_coarse"]), coarse
        want = 3 if coarse == "residual" else 1
        assert r0[coarse]["collectives"] == [want] * DIST_STEPS, (coarse, r0[coarse]["collectives"])
        net = cnn(True)
        whole = [tuple(torch.cat(z) for z in zip(dist_batch(s, 0), dist_batch(s, 1))) for s in range(DIST_STEPS)]
        opt = dist_train(coarse, net, whole)
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        start = torch.cat([p.detach().reshape(-1) for p in cnn(True).parameters()])
        assert float((r0[coarse]["params"] - flat).norm() / (flat - start).norm()) <= 1e-10, coarse
        assert float((r0[coarse]["f_coarse"] - opt.f_coarse).norm() / opt.f_coarse.norm()) <= 1e-10, coarse


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["--dist-worker"]:
        _dist_worker(sys.argv[2])


def test_fsdp_sequence_and_conv1d_layers_equal_ddp(tmp_path):
    """FSDP2 (uneven shards, a Conv1D whose rows are on the input side) against DDP: two gloo
    processes train a Linear on [B, T, D], a Conv1D on [B, T, D] and a Linear head on [B, D] to
    the same parameters (float64, 1e-10), nicolaides and residual."""
    from pathlib import Path
    worker = Path(__file__).with_name("fsdp_twolevel_seq_worker.py")
    failure = two_ranks.launch(lambda rank: [worker, tmp_path], tmp_path, 2)
    assert failure is None, failure
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for coarse in ("nicolaides", "residual"):
            ddp, fsdp = result[f"ddp-{coarse}"], result[f"fsdp-{coarse}"]
            assert max(float((p - q).abs().max()) for p, q in zip(ddp, result["initial"])) > 1e-3
            assert rel(fsdp, ddp) <= 1e-10, (rank, coarse, rel(fsdp, ddp))


@pytest.mark.parametrize("coarse", ["nicolaides", "spectral"])
def test_kept_scalings_and_vectors_follow_every_decomposition_and_load(coarse):
    """The eager step keeps each layer's eigenvalue scaling, nicolaides' constant vectors, its
    products' buffers and its gradient matrices between steps: with decompositions every other
    step and a checkpoint loaded midway, it equals, bit for bit, the same run with all four
    dropped before every step."""
    net = NETS["cnn"](True)
    nets = (net, copy.deepcopy(net))
    opts = [cafin.TwoLevelKFAC(n, damping=DAMP, T_cov=1, T_inv=2, alpha=ALPHA, coarse_space=coarse,
                               constraint_norm=True) for n in nets]
    saved = None
    for s in range(6):
        x, t = batch("cnn", 16, s)
        opts[1]._scalings.clear()
        opts[1]._constant_vectors.clear()
        opts[1]._buffers.clear()
        opts[1]._raw_buffers.clear()
        got = [run_ours(opt, n, x, t) for opt, n in zip(opts, nets)]
        assert all(torch.equal(a, b) for a, b in zip(*got)), s
        assert opts[0]._scalings and opts[0]._buffers and opts[0]._raw_buffers  # kept, not rebuilt
        with torch.no_grad():
            for n in nets:
                for p in n.parameters():
                    p.sub_(0.05 * p.grad)
        if s == 2:
            saved = [copy.deepcopy(opt.state_dict()) for opt in opts]
        if s == 4:  # back to step 3's factors: the kept scaling must not outlive them
            for opt, sd in zip(opts, saved):
                opt.load_state_dict(sd)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_not_due_step_copies_the_gradients_in_one_op_and_allocates_no_matrix(kind):
    """An eager step that is not due (k >= 1, T_cov = T_inv = 100) moves every weight and bias
    into its kept gradient matrix with one `_foreach_copy_` (no concatenation per layer) and
    allocates nothing the size of a gradient: only the few float64 scalars of the coarse
    right-hand side (at most 16 per layer)."""
    import bench.proxies as proxies
    net = NETS[kind](True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=100, T_inv=100, alpha=ALPHA)
    x, t = batch(kind, 8, 0)
    run_ours(opt, net, x, t)  # k = 0: statistics and decompositions
    run_ours(opt, net, x, t)  # k = 1: the kept matrices made
    opt.zero_grad()
    F.cross_entropy(net(x), t).backward()
    names: dict[str, int] = {}

    class Names(proxies.OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            names[name] = names.get(name, 0) + 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    with Names():
        opt.step(update_params=True)  # k = 2
    assert "cat" not in names and names.get("_foreach_copy_") == 1, names
    layers = sum(p.dim() > 1 for p in net.parameters())
    assert proxies.allocated(lambda: opt.step(update_params=True)) <= 16 * 8 * layers  # k = 3
