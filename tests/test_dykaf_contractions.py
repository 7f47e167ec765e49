"""cafin.DyKAF plans no contraction while it steps: no torch.einsum of three or more operands (where
opt_einsum is installed torch searches a contraction path for each such call, every step; where
it is not, it contracts left to right, g (x) g first) and no call into opt_einsum's path search, in
any step, the first (the 4-D start's power iterations) included, on every kind of parameter and
path. The 4-D factor step and the projections are fixed sequences of GEMMs instead
(cafin.maths.dykaf: `unfoldings`, `_split_sweep`, `_rotate`), which equal the contractions they
replace: checked here against torch.einsum, in float64 to rounding."""
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import cafin
from cafin.maths import dykaf as dykaf_maths

# The contractions of the 4-D factor step, C_i = sum g g prod_(t != i) F_t: mode i of the first g
# is the row, of the second the column; F_t's first index meets the first g.
SPLIT_RULES = ("ijkl,sabc,ja,kb,lc->is", "ijkl,asbc,ia,kb,lc->js",
               "ijkl,absc,ia,jb,lc->ks", "ijkl,abcs,ia,jb,kc->ls")


class Contractions(TorchFunctionMode):
    """Records every torch.einsum call as (equation, number of operands)."""

    def __init__(self):
        super().__init__()
        self.einsums = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.einsum:
            listed = len(args) == 2 and isinstance(args[1], (list, tuple))  # einsum(eq, [ops])
            self.einsums.append((args[0], len(args[1]) if listed else len(args) - 1))
        return func(*args, **(kwargs or {}))


class Net(nn.Module):
    """Every kind: conv kernels (kron4d, a 1x1 one too), matrices (kron2d, two of one shape,
    which the batched path stacks), a 3-D tensor and biases (ema, with bases under
    precondition_1d)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.pointwise = nn.Conv2d(5, 4, 1, bias=False)
        self.mix = nn.Parameter(torch.randn(2, 3, 4) * 0.1)
        self.fc1 = nn.Linear(4 * 3 * 4, 6)
        self.fc2 = nn.Linear(6, 6)
        self.fc3 = nn.Linear(6, 6)

    def forward(self, x):
        h = torch.relu(self.pointwise(torch.relu(self.conv(x))))  # [B, 4, 3, 4]
        h = (h * self.mix.sum(0)).flatten(1)
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(h)))))


@pytest.mark.parametrize("path", ["eager", "batched", "gated"])
@pytest.mark.parametrize("published_bugs", [False, True])
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_steps_plan_no_contraction(backend, published_bugs, path, monkeypatch):
    searches = []
    planner = torch.backends.opt_einsum.get_opt_einsum()
    if planner is not None:  # count the path searches themselves too
        search = planner.contract_path
        monkeypatch.setattr(planner, "contract_path",
                            lambda *a, **k: searches.append(a[0]) or search(*a, **k))
    torch.manual_seed(0)
    model = Net().double()
    opt = cafin.DyKAF(model.parameters(), precondition_frequency=2, precondition_1d=True,
                      backend=backend, published_bugs=published_bugs)
    if path == "batched":
        opt._batch_on_cpu = True  # the GPU's stacked GEMMs and batched split
    gen = torch.Generator().manual_seed(1)
    kinds = set()
    for t in range(4):  # the start, then steps with and without a refresh
        model.zero_grad()
        x = torch.randn(2, 3, 3, 4, generator=gen, dtype=torch.float64)
        model(x).square().mean().backward()
        with Contractions() as seen:
            opt.step()
        kinds |= {st["kind"] for st in opt.state.values()}
        many = [e for e in seen.einsums if e[1] > 2]
        assert not many, f"step {t} contracts {len(many)} einsums of 3+ operands: {many[:4]}"
        assert not searches, f"step {t} searched {len(searches)} contraction paths: {searches[:4]}"
        if path == "gated" and t == 0:
            opt._steps.device_gated = True  # as a compiled or captured step leaves it
    assert kinds == {"kron4d", "kron2d", "ema"}
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("shape", [(5, 4, 3, 2), (3, 6, 1, 1), (1, 2, 3, 4)])
def test_split_sweep_equals_the_contractions(shape):
    """Each mode's term, with factors that are not symmetric (so that every index's side
    counts) and that change between modes (each term sees the modes updated before it)."""
    gen = torch.Generator().manual_seed(sum(shape))
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    factors = [torch.randn(d, d, generator=gen, dtype=torch.float64) for d in shape]
    expected, current = [], list(factors)
    for i in range(4):
        expected.append(torch.einsum(SPLIT_RULES[i], g, g,
                                     *[current[t] for t in range(4) if t != i]))
        current[i] = current[i] * 0.5 + 1
    got = {}

    def step(i, C):
        got[i] = C
        factors[i] = factors[i] * 0.5 + 1

    dykaf_maths._split_sweep(dykaf_maths.unfoldings(g), factors, step)
    for i in range(4):
        scale = expected[i].abs().max().item()
        torch.testing.assert_close(got[i], expected[i], rtol=1e-13, atol=1e-13 * scale)


@pytest.mark.parametrize("shape", [(4, 3, 2, 5), (6,), (3, 1, 4), (2, 3, 2, 1, 2)])
def test_rotations_equal_tensordot(shape):
    """project / project_back against the mode-by-mode tensordot, some modes without a basis,
    one basis column-major (as LAPACK leaves a refreshed one)."""
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    bases = [torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
             if k % 3 != 1 else None for k, d in enumerate(shape)]
    bases[0] = bases[0].T.contiguous().T
    for back in (False, True):
        expected = x
        for Q in bases:
            expected = (expected.movedim(0, -1) if Q is None
                        else torch.tensordot(expected, Q, dims=[[0], [1 if back else 0]]))
        got = (dykaf_maths.project_back if back else dykaf_maths.project)(x, bases)
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
