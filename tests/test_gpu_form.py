"""The GPU's form of every member's step, run on the CPU (float64). On a GPU the members stack
same-shaped work into batched calls (`Route.batched_products`: K-FAC's decompositions and
eigenbasis products, DyKAF's rotations and factor split); on a CPU they run one layer at a time.
Without a GPU, these tests are what runs the GPU's code paths:

- eagerly, the GPU's form equals the CPU's form, step by step, over three curvature intervals;
- captured with the stand-in of tests/capture.py and replayed, the GPU's form equals its own eager
  run (as tests/test_capture_contract.py checks for the CPU's form).

The model repeats its hidden layer, so that factors and weights of one shape are stacked.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from capture import CASES as CAPTURE_CASES
from cafin.core.route import Route

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WARMUP = 2


def _float64(case):
    """K-FAC decomposes a float32 copy and keeps the result in float32 unless told: here float64
    both, so that the two forms agree to float64 rounding. (In float32 the factors' nearly equal
    eigenvalues let MKL's eigh turn the eigenvectors of a matrix by 0.9 when it sits at another
    offset in a stack.)"""
    if case.member != "KFACPreconditioner":
        return case
    return dataclasses.replace(case, kwargs=lambda i, k=case.kwargs: {
        **k(i), "inv_dtype": torch.float64, "decompose_dtype": torch.float64})


CASES = [_float64(c) for c in CAPTURE_CASES]
CAPTURED = [c for c in CASES if not c.refused]


def repeated_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 7),
                         nn.Tanh(), nn.Linear(7, 3)).double()


def batches(n, seed=1, batch=6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


@pytest.fixture
def gpu_form(monkeypatch):
    """Within the test, every device batches same-shaped products as a GPU does."""
    monkeypatch.setattr(Route, "batched_products", staticmethod(lambda device: True))


def _params(run):
    return [p.detach().clone() for p in run.model.parameters()]


def _eager(case, interval, data):
    out = []
    case.eager(repeated_mlp(), interval, data, WARMUP, on_step=lambda k, run: out.append(_params(run)))
    return out


def test_the_fixture_switches_the_form(monkeypatch):
    """The test below compares two forms, not one form twice."""
    assert not Route.batched_products(torch.device("cpu"))
    monkeypatch.setattr(Route, "batched_products", staticmethod(lambda device: True))
    assert Route.batched_products(torch.device("cpu"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gpu_form_equals_cpu_form_eagerly(case, monkeypatch):
    interval = 2
    data = batches(WARMUP + 3 * interval + 1)
    cpu = _eager(case, interval, data)
    monkeypatch.setattr(Route, "batched_products", staticmethod(lambda device: True))
    gpu = _eager(case, interval, data)
    for k, (a, b) in enumerate(zip(gpu, cpu)):
        for i, (p, q) in enumerate(zip(a, b)):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12,
                                       msg=lambda m, k=k, i=i: f"{case.id} step {k} parameter {i}: {m}")


@pytest.mark.parametrize("case", CAPTURED, ids=[c.id for c in CAPTURED])
def test_gpu_form_captured_replays_like_eager(case, gpu_form):
    interval = 2
    steps = WARMUP + 3 * interval + 1
    data = batches(steps)
    eager = _eager(case, interval, data)

    def check(k, run):
        for i, (p, q) in enumerate(zip(run.model.parameters(), eager[k])):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12,
                                       msg=lambda m, i=i: f"{case.id} step {k} parameter {i}: {m}")

    case.replayed(repeated_mlp(), interval, data, WARMUP, on_step=check)
