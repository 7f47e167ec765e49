"""K-FAC's eager fused step runs its eigenbasis products through kept, row-aligned buffers
(cafin.maths.kfac.eigen_precondition_into): the same numbers as the plain products."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cafin
from cafin.maths import kfac as kfac_maths


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
        pre = cafin.KFACPreconditioner(model, damping=1e-2, inv_dtype=dtype, backend="fused")
        if not chained:
            pre._chained = lambda: False  # the plain products of `_precondition`
        assert [len(members) for members, _ in pre._stacks] == [2]
        got = []
        for x, y in batches:
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            got.append([p.grad.clone() for p in model.parameters()])
        if chained:
            kept = {k: [t.data_ptr() for t in v] for k, v in pre._chains.items()}
            assert set(kept) == {("a", "b"), ("emb",), ("c",), ("d",)}
            pre.step()  # the buffers are kept from step to step
            assert {k: [t.data_ptr() for t in v] for k, v in pre._chains.items()} == kept
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
