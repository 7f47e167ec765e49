"""cafin.DyKAF's CPU forms of the fused step: the per-matrix factor split (host scalars, thin-side
inner products, the long side's factor made in place) equals the published split and the batched one, in float64 to rounding and in
float32 to float32 rounding, on awkward shapes, with its scalars on the host (an eager step) or in
0-dim tensors (a compiled step); the optimizer takes it on a CPU and trains as the batched path
does."""
import copy

import pytest
import torch
from torch import nn

import cafin
from cafin.maths import dykaf as dykaf_maths


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def factors_and_gradient(m, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def sym(d):
        a = torch.randn(d, d, generator=gen, dtype=torch.float64)
        return (a @ a.T / d + 0.1 * torch.eye(d, dtype=torch.float64)).to(dtype)
    return sym(m), sym(n), torch.randn(m, n, generator=gen, dtype=torch.float64).to(dtype)


# direct (square-ish), wide (m much smaller: W = g g^T), tall (n much smaller: Z = g^T g), and
# the degenerate sides
SHAPES = [(6, 6), (30, 25), (4, 9), (3, 40), (9, 4), (40, 3), (1, 5), (5, 1), (1, 1)]


@pytest.mark.parametrize("host", [True, False], ids=["host", "tensor"])
@pytest.mark.parametrize("beta", [0.95, 0.5, 1.0])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_matrix_split_equals_the_published_split_float64(shape, beta, host):
    m, n = shape
    L, R, g = factors_and_gradient(m, n, torch.float64, m * 100 + n)
    u, v = dykaf_maths.proj_split(L, R, g, beta)
    keep = L.clone(), R.clone(), g.clone()
    U, V = dykaf_maths.proj_split_matrix_(L, R, g, beta, host=host)
    assert rel(U, u) <= 1e-13 and rel(V, v) <= 1e-13
    # the long side's new factor is written into the old one (tall: L, wide: R); g and the
    # other side are read only
    direct, wide, tall = m * n * (m + n), m * m * (n + 2 * m), n * n * (m + 2 * n)
    written = "R" if wide < min(direct, tall) else "L" if tall < direct else None
    assert (U is L) == (written == "L") and (V is R) == (written == "R")
    for name, now, before in (("L", L, keep[0]), ("R", R, keep[1]), ("g", g, keep[2])):
        if name != written:
            assert torch.equal(now, before), name


@pytest.mark.parametrize("host", [True, False], ids=["host", "tensor"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_matrix_split_equals_the_batched_split_at_beta_zero_float64(shape, host):
    """beta = 0 (the factors forgotten each step): the published split divides 0 by 0; the
    batched one and the per-matrix one agree."""
    m, n = shape
    L, R, g = factors_and_gradient(m, n, torch.float64, m + n)
    u, v = dykaf_maths.proj_split_batched(L[None], R[None], g[None], 0.0, cafin.ops)
    U, V = dykaf_maths.proj_split_matrix_(L.clone(), R.clone(), g, 0.0, host=host)
    assert rel(U, u[0]) <= 1e-13 and rel(V, v[0]) <= 1e-13


@pytest.mark.parametrize("host", [True, False], ids=["host", "tensor"])
@pytest.mark.parametrize("shape", [(512, 128), (128, 512), (96, 80), (1, 64), (64, 1)])
def test_matrix_split_float32_is_as_close_as_the_batched_split(shape, host):
    """In float32 both forms sit within float32 rounding of the float64 split (neither is
    further from it than 20x the other's error plus 1e-6)."""
    m, n = shape
    L, R, g = factors_and_gradient(m, n, torch.float32, m * n)
    u, v = dykaf_maths.proj_split_batched(L[None], R[None], g[None], 0.95, cafin.ops)
    U, V = dykaf_maths.proj_split_matrix_(L.clone(), R.clone(), g, 0.95, host=host)
    u64, v64 = dykaf_maths.proj_split(L.double(), R.double(), g.double(), 0.95)
    for mine, theirs, exact in ((U, u[0], u64), (V, v[0], v64)):
        assert rel(mine.double(), exact) <= 20 * rel(theirs.double(), exact) + 1e-6
        assert rel(mine.double(), exact) <= 1e-5


def deep():
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 9),
                         nn.Tanh(), nn.Linear(9, 30), nn.Tanh(), nn.Linear(30, 3))


def test_cpu_steps_equal_the_batched_steps(monkeypatch):
    """The fused optimizer on a CPU (each matrix by proj_split_matrix_) trains as the batched
    (GPU) form does: float64 to rounding, refreshes included. In float32 rounding differences
    grow step by step, as between the reference backend and the fused one, and a refresh can turn
    them into a different order of two near-equal eigenvalues (a 1e-4 change on this net): there
    the runs refresh only at their first step, and the CPU form stays as close to the batched
    one as the reference is."""
    torch.manual_seed(0)
    base = deep()
    kw = dict(lr=1e-2, eps=1e-4, init="eps")
    runs = {}
    for dtype, frequency in ((torch.float64, 3), (torch.float32, 100)):
        for name, backend, batched in (("cpu", "fused", False), ("batched", "fused", True),
                                       ("reference", "reference", False)):
            net = copy.deepcopy(base).to(dtype)
            opt = cafin.DyKAF(net.parameters(), **kw, precondition_frequency=frequency,
                              backend=backend)
            runs[name, dtype] = (net, opt, batched)
    calls = []
    split = dykaf_maths.proj_split_matrix_
    monkeypatch.setattr(dykaf_maths, "proj_split_matrix_",
                        lambda *a, **kw: calls.append(a[2].dtype) or split(*a, **kw))
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        x = torch.randn(16, 7, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=gen)
        for (name, dtype), (net, opt, batched) in runs.items():
            monkeypatch.setattr(cafin.DyKAF, "_batch_on_cpu", batched)
            opt.zero_grad()
            nn.functional.cross_entropy(net(x.to(dtype)), y).backward()
            opt.step()
    # 7 updates of 5 matrices per dtype, all per matrix; none in the other optimizers' steps
    assert len(calls) == 2 * 7 * 5

    def worst(a, b, dtype):
        return max(rel(p, q) for p, q in zip(runs[a, dtype][0].parameters(),
                                             runs[b, dtype][0].parameters()))
    assert worst("cpu", "batched", torch.float64) <= 1e-12
    assert worst("cpu", "batched", torch.float32) <= 3 * worst("reference", "batched", torch.float32)
    assert worst("cpu", "batched", torch.float32) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_reductions_equal_reference_on_long_rows(dtype):
    """The CPU kernels' inner products run in 16 lanes folded into double every 16384 terms:
    rows long enough for the lanes (17, 130) and for several folds (20000), against the plain
    PyTorch ops (the rank-one moment step, and the factor split's ops on 130 x 130 stacks)."""
    gen = torch.Generator().manual_seed(3)

    def mk(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    shapes = [(37, 130), (300, 17), (2, 20000)]
    gps = [mk(*s) for s in shapes]
    ls, rs = [mk(s[0]).abs() + 0.1 for s in shapes], [mk(s[1]).abs() + 0.1 for s in shapes]
    beta2 = torch.tensor(0.93, dtype=torch.float64)
    mine, theirs = ([x.clone() for x in ls], [x.clone() for x in rs]), (ls, rs)
    cafin.ops.dykaf_rank_one_(*mine, gps, beta2, 0.0)
    cafin.reference.dykaf_rank_one_(*theirs, gps, beta2, 0.0)
    for a, b in zip(mine[0] + mine[1], theirs[0] + theirs[1]):
        torch.testing.assert_close(a, b, **tol)

    def spd(b, d):
        a = mk(b, d, d)
        return a @ a.mT / d + torch.eye(d, dtype=dtype)
    Ks, Ms, Ls, Rs, Cs = spd(2, 130), spd(2, 20), spd(2, 130), spd(2, 20), spd(2, 130)
    sigma = mk(2).abs() + 0.5
    runs = []
    for impl in (cafin.ops, cafin.reference):
        K, M = Ks.clone(), Ms.clone()
        impl.dykaf_split_normalize_([K], [M], [Ls], [Rs], [sigma])
        impl.dykaf_split_scale_([K], [M], [Ls], [Rs], [Cs], [sigma])
        runs.append((K, M))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, **tol)


class _Dispatched(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op a step dispatches (views too: each costs the host a dispatch) and, of those, the
    host reads of a tensor's value."""

    def __init__(self):
        super().__init__()
        self.ops = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += func.__name__.split(".")[0] == "_local_scalar_dense"
        return func(*args, **(kwargs or {}))


def _not_due_step(kind: str, layers: int) -> _Dispatched:
    """The ops of the third eager step (not due, after a step that refreshed nothing) of a stack
    of 3x3 convs (4-D kernels: the 4-mode split, rotations of four modes) or of 6 x 6 Linears."""
    torch.manual_seed(0)
    if kind == "conv":
        model = nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(layers)])
        x = torch.randn(2, 4, 5, 5)
    else:
        model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)])
        x = torch.randn(4, 6)
    opt = cafin.DyKAF(model.parameters(), precondition_frequency=100)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        if _ == 2:
            with _Dispatched() as counted:
                opt.step()
            return counted
        opt.step()


# Per layer, a not-due step dispatches: for a conv kernel its GEMMs (12 rotating the gradient, the
# moment and the update through four modes, 12 of the 4-mode split) with about one view each (a
# GEMM result's transposed unfolding is one view), the split's two unfolding copies; the split's
# elementwise and scalar work runs in foreach ops over all the kernels (a kernel at a time, with
# a reshape and a transpose per GEMM, it took 113 ops). For a matrix (the CPU's per-matrix
# split) the GEMMs of the rotations and the split, and six inner products read on the host (a
# CPU tensor's read costs no sync; a GPU takes the batched split, which reads none); the average
# of the kept rotated moments runs over all matrices at once, with 1 - beta1 read once a step.
# Kernels and biases read nothing: a step reads at most 5 values besides the matrices' products
# (the scalars the ops check on a CPU, and 1 - beta1).
@pytest.mark.parametrize("kind, ops, reads", [("conv", 73, 0), ("linear", 43, 6)])
def test_a_not_due_step_dispatches_a_bounded_number_of_ops_per_layer(kind, ops, reads):
    few, many = _not_due_step(kind, 2), _not_due_step(kind, 6)
    assert (many.ops - few.ops) / 4 <= ops, (few.ops, many.ops)
    assert (many.reads - few.reads) / 4 <= reads, (few.reads, many.reads)
    assert few.reads - 2 * reads <= 5, few.reads
