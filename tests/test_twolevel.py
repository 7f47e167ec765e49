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


def batch(kind, B, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 5, generator=g) if kind == "mlp" else torch.randn(B, 2, 6, 6, generator=g)
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
        else:
            rows, T = a, 1
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
            for i in range(n):
                for j in range(n):
                    N = stats[i]["rows"].shape[0]
                    Aij = stats[i]["rows"].t() @ stats[j]["rows"] / N
                    Gij = stats[i]["gy"].t() @ stats[j]["gy"] / N
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


# The oracle's tpselepedis has no interpolation between location counts: MLPs only here; Conv2d
# networks are checked against the published code (the README section "Two-level K-FAC").
ORACLE_CASES = [(k, b, c, kr) for k in ("mlp", "cnn") for b in (True, False) for c, kr in CASES
                if not (k == "cnn" and c == "tpselepedis")]


@pytest.mark.parametrize("kind,bias,coarse,krylov", ORACLE_CASES,
                         ids=[f"{k}-{'bias' if b else 'nobias'}-{c}{'+krylov' if kr else ''}"
                              for k, b, c, kr in ORACLE_CASES])
def test_matches_oracle_float64(kind, bias, coarse, krylov):
    net = (mlp if kind == "mlp" else cnn)(bias)
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


@pytest.mark.parametrize("bugs", [False, True])
@pytest.mark.parametrize("coarse,krylov", [("nicolaides", False), ("spectral", False), ("residual", True)])
def test_cheap_assembly_equals_pairwise(coarse, krylov, bugs):
    fs = []
    for backend in ("fused", "reference"):
        net = cnn(True)
        opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=2, T_inv=3, coarse_space=coarse, krylov=krylov,
                                 backend=backend, published_bugs=bugs)
        gs = []
        for s in range(3):
            gs.append(run_ours(opt, net, *batch("cnn", 8, s)))
        fs.append((opt.f_coarse.clone(), gs))
    assert torch.allclose(fs[0][0], fs[1][0], rtol=1e-10, atol=1e-12)
    assert rel(fs[0][1][-1], fs[1][1][-1]) <= 1e-9


@pytest.mark.parametrize("coarse,krylov", [("nicolaides", False), ("residual", True)])
def test_reference_pairwise_assembly_equals_the_cheap_one(coarse, krylov):
    """cafin.reference.coarse_matrix_pairwise (the published way, the bench's baseline) against
    the optimizer's cheap assembly, on the stored statistics of a Conv2d network."""
    net = cnn(True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=1, T_inv=1, coarse_space=coarse, krylov=krylov)
    x, t = batch("cnn", 8, 0)
    run_ours(opt, net, x, t)
    states = [opt.state[g["params"][0]] for g in opt.param_groups]
    raws = [torch.randn_like(s["Q_g"][:, :1] * s["Q_x"][:1]) for s in states]
    vectors = [opt._coarse_vectors(s, r, r) for s, r in zip(states, raws)]
    flat = [v for vs in vectors for v in vs]
    per = [s for s, vs in zip(states, vectors) for _ in vs]
    want = cafin.reference.coarse_matrix_pairwise([s["x"] for s in per], [s["gy"] for s in per],
                                                  [s["num_locations"] for s in per], flat, opt.batch_size,
                                                  DAMP, symmetric=not krylov)
    assert torch.allclose(opt._assemble(vectors), want, rtol=1e-10, atol=1e-12)


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


# ------------------------------------------------------------------ compile
def test_compiled_step_equals_eager_without_graph_breaks_or_recompiles():
    """torch.compile(step, fullgraph=True) after one eager step: T_cov/T_inv decided on the
    device (eigh and the coarse assembly in torch.cond branches), damping and clipping changed
    every step (0-dim tensors: no recompile), the following SGD step compiled too with a tensor lr
    (torch.optim breaks its own graph around the step body on purpose, so not fullgraph)."""
    from torch._dynamo.utils import counters

    def run(compiled):
        net = mlp(True)
        opt = cafin.TwoLevelKFAC(net, damping=DAMP, T_cov=2, T_inv=3, alpha=ALPHA, coarse_space="residual",
                                 constraint_norm=True, clipping=1e-3)
        sgd = torch.optim.SGD(net.parameters(), lr=torch.tensor(0.05, dtype=torch.float64), momentum=0.9)
        step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
        sgd_step = torch.compile(sgd.step) if compiled else sgd.step
        for i in range(6):
            x, t = batch("mlp", 16, i)
            sgd.zero_grad()
            opt.update_stats = True
            F.cross_entropy(net(x), t).backward()
            (opt.step if i == 0 else step)()
            (sgd.step if i == 0 else sgd_step)()
            opt.damping = DAMP * (1 + 0.1 * i)
            opt.clipping = 1e-3 * (1 + 0.2 * i)
            sgd.param_groups[0]["lr"].fill_(0.05 / (i + 1))
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), opt

    torch._dynamo.reset()
    counters.clear()
    try:
        eager, _ = run(False)
        compiled, opt = run(True)
        assert opt._steps.device_gated and opt._iteration_counter == 6
        start = torch.cat([p.detach().reshape(-1) for p in mlp(True).parameters()])
        assert float((compiled - eager).norm() / (eager - start).norm()) <= 1e-10
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # two-level step, SGD body
        assert all("User-inserted graph break" in k for k in counters["graph_break"]), dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()


def test_hyperparameters_are_checked_and_reach_the_step():
    net = mlp(True)
    opt = cafin.TwoLevelKFAC(net, damping=DAMP)
    with pytest.raises(ValueError, match="damping"):
        opt.damping = -1.0
    with pytest.raises(ValueError, match="alpha"):
        opt.alpha = 2.0
    assert opt.damping == DAMP
    opt.damping = torch.tensor(0.5)
    assert opt.damping == 0.5 and float(opt._hyper[torch.device("cpu")]["damping"]) == 0.5
    a = run_ours(opt, net, *batch("mlp", 8, 0))
    net2 = mlp(True)
    b = run_ours(cafin.TwoLevelKFAC(net2, damping=0.5), net2, *batch("mlp", 8, 0))
    assert rel(a, b) == 0


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
