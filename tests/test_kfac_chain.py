"""K-FAC's eager fused step runs its eigenbasis products through kept, row-aligned buffers
(cafin.maths.kfac.eigen_precondition_into, batched; the op kfac_eigen_products_, per layer on
the CPU): the same numbers as the plain products, and nothing allocated per step."""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cafin
import cafin.optim.kfac.preconditioning as kfac_module
from cafin.maths import kfac as kfac_maths
from stand_ins import Conv1D

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.measure import PreconditionedSGD  # noqa: E402


def _orthogonal(b, n, dtype, gen):
    return torch.linalg.qr(torch.randn(b, n, n, dtype=torch.float64, generator=gen))[0].to(dtype)


@pytest.mark.parametrize("shape", [(1, 5, 7), (3, 9, 1), (2, 17, 33)])
def test_aligned_empty(shape):
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = kfac_maths.aligned_empty(shape, dtype=dtype, device="cpu")
        assert t.shape == shape and t.dtype == dtype and t.stride(-1) == 1
        assert t.stride(-2) * t.element_size() % kfac_maths.ALIGN_BYTES == 0
        assert t.stride(-2) >= shape[-1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4, 6), (3, 7, 13), (2, 10, 1), (1, 1, 5)])
@pytest.mark.parametrize("diagonal", [False, True])
def test_into_matches_plain_products(dtype, shape, diagonal):
    gen = torch.Generator().manual_seed(sum(shape))
    groups, d_g, d_a = shape
    qg = _orthogonal(groups, d_g, dtype, gen)
    qa = None if diagonal else _orthogonal(groups, d_a, dtype, gen)
    dgda = torch.rand(groups, d_g, d_a, dtype=torch.float64, generator=gen).to(dtype) + 0.5
    grad = torch.randn(groups, d_g, d_a, dtype=torch.float64, generator=gen).to(dtype)
    # float64 oracle of the products
    g64 = grad.double()
    v = qg.double().mT @ g64
    if qa is not None:
        v = v @ qa.double()
    v = qg.double() @ (v * dgda.double())
    oracle = v if qa is None else v @ qa.double().mT
    want = kfac_maths.eigen_precondition(grad, qa, qg, dgda=dgda)
    aligned = lambda: kfac_maths.aligned_empty(shape, dtype=dtype, device="cpu")  # noqa: E731
    buf = aligned().copy_(grad)
    out = torch.empty(shape, dtype=dtype)
    got = kfac_maths.eigen_precondition_into(buf, qa, qg, dgda, aligned(), out)
    assert got is out
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), oracle, rtol=tol, atol=tol)
    torch.testing.assert_close(got, want, rtol=4 * torch.finfo(dtype).eps, atol=0)
    # contiguous operands and an output of another dtype: the same numbers, cast
    out16 = torch.empty(shape, dtype=torch.bfloat16)
    kfac_maths.eigen_precondition_into(grad.clone(), qa, qg, dgda, torch.empty(shape, dtype=dtype), out16)
    assert torch.equal(out16, got.to(torch.bfloat16))


def _entry(shape, dtype, diagonal, gen, *, stacked=True, with_source=False):
    """One entry of kfac_eigen_products_ (grad, work, source, qa, qg, dgda) with random operands,
    and the float64 oracle of its result (the products as they are, in float64). qg is given as
    a transposed view (any strides are read), grad row-aligned."""
    groups, d_g, d_a = shape
    qg = _orthogonal(groups, d_g, dtype, gen).mT.contiguous().mT
    qa = None if diagonal else _orthogonal(groups, d_a, dtype, gen)
    dgda = torch.rand(groups, d_g, d_a, dtype=torch.float64, generator=gen).to(dtype) + 0.5
    g = torch.randn(groups, d_g, d_a, dtype=torch.float64, generator=gen).to(dtype)
    v = qg.double().mT @ g.double()
    if qa is not None:
        v = v @ qa.double()
    v = qg.double() @ (v * dgda.double())
    oracle = v if qa is None else v @ qa.double().mT
    work = torch.zeros((groups, d_g, d_a) if diagonal else (groups, d_a, d_g), dtype=dtype)
    grad = kfac_maths.aligned_empty(shape, dtype=dtype, device="cpu")
    source = None
    if with_source:
        source = g
        grad.fill_(math.nan)  # not read: every product writes before it is read
    else:
        grad.copy_(g)
    entry = [grad, work, source, qa, qg, dgda]
    if not stacked:
        entry = [None if t is None else t[0] for t in entry]
        oracle = oracle[0]
    return entry, oracle


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_eigen_products_match_plain_products(dtype, threads):
    """kfac_eigen_products_ (each product a multiplication by an eigenbasis on the right, the
    entries shared out over the threads on the CPU) gives the plain products' numbers, and the
    reference op's, on matrices and stacks of awkward sizes, with Q_A or diagonal, reading the
    gradient or another source (left as it is)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(1, 4, 6), (3, 7, 13), (2, 10, 1), (1, 1, 5), (1, 17, 129), (2, 33, 9)]
    entries, oracles, sources = [], [], []
    for k, shape in enumerate(shapes):
        for diagonal in (False, True):
            entry, oracle = _entry(shape, dtype, diagonal, gen, stacked=k % 2 == 0, with_source=k % 3 == 1)
            entries.append(entry)
            oracles.append(oracle)
            sources.append(None if entry[2] is None else entry[2].clone())
    args = [list(column) for column in zip(*entries)]
    want = [g.clone() if s is None else torch.empty_like(g) for g, s in zip(args[0], args[2])]
    cafin.reference.kfac_eigen_products_(want, [w.clone() for w in args[1]], *args[2:])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        cafin.ops.kfac_eigen_products_(*args)
    finally:
        torch.set_num_threads(before)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    eps = torch.finfo(dtype).eps
    for got, oracle, expected, source, kept in zip(args[0], oracles, want, args[2], sources):
        torch.testing.assert_close(got.double(), oracle, rtol=tol, atol=tol)
        torch.testing.assert_close(got, expected, rtol=16 * eps, atol=16 * eps * expected.abs().max().item())
        if source is not None:
            assert torch.equal(source, kept)


@pytest.mark.parametrize("index, edit, message", [
    (1, lambda e: e.__setitem__(4, e[4][:, :-1]), r"qg\[1\] has shape"),
    (0, lambda e: e.__setitem__(1, e[1].mT), r"works\[0\] has shape"),
    (1, lambda e: e.__setitem__(5, e[5].double()), r"dgda\[1\] has dtype"),
    (0, lambda e: e.__setitem__(3, e[3][0]), r"qa\[0\] has 2 dims"),
    (1, lambda e: e.__setitem__(2, e[2][:, 1:]), r"sources\[1\] has shape"),
    (0, lambda e: (e.__setitem__(3, None), e.__setitem__(1, e[0])), r"works\[0\] must be a tensor of its own"),
    (1, lambda e: e.__setitem__(0, e[0].half()), r"grads\[1\] has dtype"),
])
def test_eigen_products_bad_arguments(index, edit, message):
    """A bad entry is named, and nothing is written, the entries before it included."""
    gen = torch.Generator().manual_seed(3)
    entries = [_entry((2, 5, 7), torch.float32, False, gen, with_source=k == 1)[0] for k in range(2)]
    edit(entries[index])
    args = [list(column) for column in zip(*entries)]
    before = [t.clone() for t in args[0] + args[1]]
    with pytest.raises(RuntimeError, match=message):
        cafin.ops.kfac_eigen_products_(*args)
    for t, b in zip(args[0] + args[1], before):
        torch.testing.assert_close(t, b, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="works has 1 entries but grads has 2"):
        cafin.ops.kfac_eigen_products_(args[0], args[1][:1], *args[2:])


class _Net(nn.Module):
    """An Embedding (diagonal A), two Linear layers of one shape (a stack), one with and one
    without bias of odd widths (alone)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 9, bias=False)
        self.d = nn.Linear(9, 5)

    def forward(self, idx):
        h = self.emb(idx).mean(1)
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(h)))))))


def _fused(model, inv_dtype, chained=True):
    """The fused K-FAC of these tests; chained False: the plain products of `_precondition`."""
    pre = cafin.KFACPreconditioner(model, damping=1e-2, inv_dtype=inv_dtype, backend="fused")
    if not chained:
        pre._chained = lambda: False
    return pre


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_step_through_buffers_matches_plain_products(dtype):
    torch.manual_seed(0)
    base = _Net().to(dtype)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 11, (8, 3), generator=gen), torch.randint(0, 5, (8,), generator=gen))
               for _ in range(4)]
    grads = {}
    for chained in (True, False):
        model = copy.deepcopy(base)
        pre = _fused(model, dtype, chained)
        assert [len(members) for members, _ in pre._stacks] == [2]
        got = _mixed_steps(model, pre, batches)
        if chained:
            kept = {k: [t.data_ptr() for t in v.tensors()] for k, v in pre._chains.items()}
            assert set(kept) == {("a", "b"), ("emb",), ("c",), ("d",)}
            pre.step()  # the buffers are kept from step to step
            assert {k: [t.data_ptr() for t in v.tensors()] for k, v in pre._chains.items()} == kept
        grads[chained] = got
    eps = torch.finfo(dtype).eps  # equal up to float rounding (BLAS may block tiny products apart)
    for step_new, step_old in zip(grads[True], grads[False]):
        for new, old in zip(step_new, step_old):
            torch.testing.assert_close(new, old, rtol=16 * eps, atol=16 * eps * old.abs().max().item())


def test_eigenbases_are_row_aligned():
    pre = cafin.KFACPreconditioner(_Net(), backend="fused")
    for layer in pre.layers:
        for key in ("qa", "qg"):
            q = pre._state[layer.name].second.get(key)
            if q is not None:
                assert q.stride(-2) * q.element_size() % kfac_maths.ALIGN_BYTES == 0, (layer.name, key)
                assert torch.equal(q, torch.eye(q.shape[-1]).expand_as(q))  # the identity until decomposed


class _Mixed(nn.Module):
    """An Embedding (transposed weight, diagonal A), two Linear layers of one shape (a stack),
    a Conv1D with bias (transposed weight and a bias), a Conv1D without, both of one shape (a
    stack mixing them with nothing else), a grouped Conv1d (stacks over groups) and a Linear of
    odd widths without bias."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(480, 8)  # 480 rows: no padding, and a gradient past 60 x 60
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.p = Conv1D(9, 8)
        self.q = Conv1D(9, 9, bias=False)
        self.conv = nn.Conv1d(9, 6, kernel_size=3, groups=3, padding=1)
        self.head = nn.Linear(6, 5, bias=False)

    def forward(self, idx):
        h = torch.tanh(self.b(torch.tanh(self.a(self.emb(idx)))))
        h = torch.tanh(self.q(torch.tanh(self.p(h))))
        h = torch.tanh(self.conv(h.transpose(1, 2))).mean(2)
        return self.head(h)


def _mixed_steps(model, pre, batches):
    got = []
    for x, y in batches:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        got.append([p.grad.clone() for p in model.parameters()])
    return got


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("per_layer", [True, False])
def test_step_forms_match_plain_products(monkeypatch, dtype, per_layer):
    """Both forms of the chained products (per layer, each a right multiplication, the CPU's;
    batched over a stack, other devices') give the plain products' gradients on layers with and
    without bias, transposed weights, grouped convolutions and stacks; the per-layer form keeps
    a transposed weight's preconditioned gradient transposed, as the weight."""
    torch.manual_seed(0)
    base = _Mixed().to(dtype)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 480, (6, 4), generator=gen), torch.randint(0, 5, (6,), generator=gen))
               for _ in range(4)]
    plain_model = copy.deepcopy(base)
    plain = _fused(plain_model, dtype, chained=False)
    want = _mixed_steps(plain_model, plain, batches)
    monkeypatch.setattr(kfac_module, "_per_layer_products", lambda device: per_layer)
    model = copy.deepcopy(base)
    pre = _fused(model, dtype)
    assert sorted(len(members) for members, _ in pre._stacks) == [2, 2]
    got = _mixed_steps(model, pre, batches)
    assert set(pre._chains) == {("emb",), ("a", "b"), ("p", "q"), ("conv",), ("head",)}
    assert all(chain.per_layer == per_layer for chain in pre._chains.values())
    if per_layer:
        for key in (("emb",), ("p", "q")):
            for piece in pre._chains[key].pieces:
                assert not piece.is_contiguous() and piece.mT.is_contiguous()
        for key in (("a", "b"), ("conv",), ("head",)):  # written from the row-aligned buffer as it lies
            chain = pre._chains[key]
            for piece in chain.pieces:
                assert piece.untyped_storage().data_ptr() == chain.grad.untyped_storage().data_ptr()
                assert kfac_maths.rows_equally_spaced(piece)
    eps = torch.finfo(dtype).eps
    for step_new, step_old in zip(got, want):
        for new, old in zip(step_new, step_old):
            torch.testing.assert_close(new, old, rtol=16 * eps, atol=16 * eps * old.abs().max().item())


def test_gradients_of_another_dtype_than_the_decomposition_get_outputs_of_their_own():
    """float32 gradients with float64 decompositions: each layer's preconditioned gradient is
    cast into an output of the gradients' dtype, and the step gives the plain products' numbers."""
    torch.manual_seed(0)
    base = _Mixed()
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 480, (6, 4), generator=gen), torch.randint(0, 5, (6,), generator=gen))
               for _ in range(3)]
    got = {}
    for chained in (False, True):
        model = copy.deepcopy(base)
        pre = _fused(model, torch.float64, chained)
        got[chained] = _mixed_steps(model, pre, batches)
    assert len(pre._chains) == 5
    for chain in pre._chains.values():
        assert chain.grad.dtype == torch.float64
        assert all(piece.dtype == torch.float32 for piece in chain.pieces)
    for step_new, step_old in zip(got[True], got[False]):
        for new, old in zip(step_new, step_old):
            torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-6 * old.abs().max().item())


def _allocated_bytes(fn) -> int:
    """Bytes allocated on the CPU while fn() runs (frees not subtracted)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_eager_cpu_step_allocates_nothing(dtype):
    """On the CPU, an eager fused step that decomposes nothing allocates nothing: the products,
    the copies and the gradient writes (transposed weights included) go through kept buffers."""
    torch.manual_seed(0)
    model = _Mixed().to(dtype)
    pre = cafin.KFACPreconditioner(model, damping=1e-2, inv_dtype=dtype, backend="fused",
                                   factor_update_steps=10**9, inv_update_steps=10**9)
    x, y = torch.randint(0, 480, (6, 4)), torch.randint(0, 5, (6,))
    F.cross_entropy(model(x), y).backward()
    pre.step()  # decomposes (step 0), makes the buffers
    saved = [p.grad.clone() for p in model.parameters()]
    pre.step()
    for p, g in zip(model.parameters(), saved):
        p.grad.copy_(g)
    assert _allocated_bytes(pre.step) == 0


def test_bench_restore_keeps_its_buffers():
    """The bench's restore (PreconditionedSGD(restore_grads=True)) copies the gradients into
    buffers it keeps and back after each step; another set of gradients gets new buffers."""
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]

    class Pre:
        def step(self):
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(2)

    step = PreconditionedSGD(Pre(), torch.optim.SGD(params, lr=0.5), restore_grads=True)
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    step.step()
    kept = [t.data_ptr() for t in step._saved]
    step.step()
    assert [t.data_ptr() for t in step._saved] == kept
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in params)
    assert torch.equal(params[0].detach(), torch.full((3,), 1.0 - 2 * 0.5 * 6.0))
    params[1].grad = None  # another set of gradients: buffers made for it
    step.step()
    assert len(step._saved) == 1 and torch.equal(params[0].grad, torch.full((3,), 3.0))
    params[1].grad = torch.full((2, 2), 5.0)
    step.step()
    assert len(step._saved) == 2 and torch.equal(params[1].grad, torch.full((2, 2), 5.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_clip_sum_over_rows_of_every_width(dtype):
    """The CPU kernel's clip sum runs in eight lanes per row with a tail: rows of widths around
    and past the lanes, with and without bias, give the reference's clipped gradients."""
    from cafin import ops, reference
    gen = torch.Generator().manual_seed(7)
    ws, bs, vs = [], [], []
    for rows, cols, bias in [(3, 1, False), (2, 8, False), (4, 9, True), (1, 17, True), (5, 130, True),
                             (2, 16, True)]:
        ws.append(torch.randn(rows, cols - bias, dtype=torch.float64, generator=gen).to(dtype))
        bs.append(torch.randn(rows, dtype=torch.float64, generator=gen).to(dtype) if bias else
                  torch.empty(0, dtype=dtype))
        vs.append(torch.randn(1, rows, cols, dtype=torch.float64, generator=gen).to(dtype))
    lr = torch.tensor(0.5, dtype=torch.float64)
    vg = sum((v[0, :, :w.shape[1]].double() * w.double()).sum()
             + (v[0, :, -1].double() * b.double()).sum() if b.numel() else
             (v[0].double() * w.double()).sum() for w, b, v in zip(ws, bs, vs))
    kl = torch.tensor(0.01, dtype=torch.float64) * abs(vg.item()) * lr.item() ** 2  # nu = 0.1
    want = ([w.clone() for w in ws], [b.clone() for b in bs])
    reference.kfac_precondition_apply_(*want, vs, lr, kl)
    ops.kfac_precondition_apply_(ws, bs, vs, lr, kl)
    eps = torch.finfo(dtype).eps
    for got, ref, v in zip(ws, want[0], vs):
        torch.testing.assert_close(got, ref, rtol=4 * eps, atol=0)
        torch.testing.assert_close(got.double(), 0.1 * v[0, :, :got.shape[1]].double(), rtol=4 * eps, atol=0)
    for got, ref in zip(bs, want[1]):
        torch.testing.assert_close(got, ref, rtol=4 * eps, atol=0)
