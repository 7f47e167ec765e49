"""DyKAF's fused ops on every device against the reference, float64 then float32, on sizes that
reach every path of the CUDA kernels: the factor split shares one matrix over many blocks once it
holds more than 2048 elements (up to 1024 blocks, so a 1500^2 matrix gives each block a long run),
and a stack of more than 65535 matrices wraps the grid's matrix index. On the CPU the same cases
check the CPU kernels and the tests themselves."""
import pytest
import torch

import cafin
from devices import DEVICES

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=2e-5, atol=1e-6)}

# Stacks of factor-split pairs: (batch, m, n) per entry of the op's lists.
SPLIT_CASES = {
    "one-block-each": [(2, 3, 4), (1, 5, 2)],
    "uneven-chunks": [(3, 70, 9), (2, 45, 51)],  # 4900 and 2025 / 2601 elements
    "most-chunks": [(2, 1500, 40)],  # 2.25M elements: every one of 1024 blocks runs ~2200
    "many-matrices": [(70_000, 1, 2)],
}


def _split_inputs(case, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    # Positive entries keep every inner product, so the Galerkin weight, away from zero.
    pos = lambda *s: (torch.rand(*s, generator=g, dtype=torch.float64) + 0.1).to(device, dtype)  # noqa: E731
    shapes = SPLIT_CASES[case]
    return dict(K=[pos(b, m, m) for b, m, _ in shapes], M=[pos(b, n, n) for b, _, n in shapes],
                L=[pos(b, m, m) for b, m, _ in shapes], R=[pos(b, n, n) for b, _, n in shapes],
                C=[pos(b, m, m) for b, m, _ in shapes], sigma=[pos(b) for b, _, _ in shapes])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_ops_equal_reference(device, dtype, case):
    for name in ("dykaf_split_normalize_", "dykaf_split_scale_"):
        fused, ref = _split_inputs(case, dtype, device, 3), _split_inputs(case, dtype, device, 3)
        for impl, x in ((cafin.ops, fused), (cafin.reference, ref)):
            if name == "dykaf_split_normalize_":
                impl.dykaf_split_normalize_(x["K"], x["M"], x["L"], x["R"], x["sigma"])
            else:
                impl.dykaf_split_scale_(x["K"], x["M"], x["L"], x["R"], x["C"], x["sigma"])
        for key in ("K", "M"):
            for got, want in zip(fused[key], ref[key]):
                torch.testing.assert_close(got, want, **TOL[dtype])
        for key in ("L", "R", "C", "sigma"):  # read only
            for got, want in zip(fused[key], _split_inputs(case, dtype, device, 3)[key]):
                assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_split_normalize_gives_unit_matrices(device):
    """Whatever the chunking, each matrix ends with Frobenius norm 1 and the direction of
    sigma L + K, and the matrices of a stack do not mix."""
    x = _split_inputs("most-chunks", torch.float64, device, 4)
    before = [s.reshape(-1, 1, 1) * l + k for k, l, s in zip(x["K"], x["L"], x["sigma"])]
    cafin.ops.dykaf_split_normalize_(x["K"], x["M"], x["L"], x["R"], x["sigma"])
    for k, want in zip(x["K"], before):
        norms = torch.linalg.vector_norm(k, dim=(-2, -1))
        torch.testing.assert_close(norms, torch.ones_like(norms), rtol=1e-13, atol=0)
        torch.testing.assert_close(k * torch.linalg.vector_norm(want, dim=(-2, -1), keepdim=True), want,
                                   rtol=1e-12, atol=0)


# The elementwise ops: (rows, columns) of each parameter matrix; a long one reaches a CUDA grid
# of many blocks with a grid-stride loop.
ELEMENTWISE_SHAPES = [(5, 7), (1, 3), (9, 2), (1031, 1200)]


def _elementwise_inputs(dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype)  # noqa: E731
    scalar = lambda v: torch.tensor(v, dtype=torch.float64, device=device)  # noqa: E731
    shapes = ELEMENTWISE_SHAPES
    return dict(gps=[mk(*s) for s in shapes], ls=[mk(s[0]).abs() + 0.1 for s in shapes],
                rs=[mk(s[1]).abs() + 0.1 for s in shapes], mps=[mk(*s) for s in shapes],
                vs=[mk(*s).abs() for s in shapes], params=[mk(*s) for s in shapes],
                beta2=scalar(0.93), step_size=scalar(0.03), lr=scalar(0.01), guard=scalar(1e-6),
                eps=scalar(1e-8), weight_decay=scalar(0.1))


def _elementwise_call(impl, name, x):
    if name == "dykaf_rank_one_":
        impl.dykaf_rank_one_(x["ls"], x["rs"], x["gps"], x["beta2"], x["guard"])
    elif name == "dykaf_precondition_":
        impl.dykaf_precondition_(x["mps"], x["ls"], x["rs"], x["guard"])
    elif name == "dykaf_adam_precondition_":
        impl.dykaf_adam_precondition_(x["mps"], x["vs"], x["gps"], x["beta2"], x["eps"])
    else:
        impl.dykaf_apply_(x["params"], x["mps"], x["step_size"], x["lr"], x["weight_decay"], True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["dykaf_rank_one_", "dykaf_precondition_", "dykaf_adam_precondition_",
                                  "dykaf_apply_"])
def test_elementwise_ops_equal_reference(device, dtype, name):
    fused, ref = _elementwise_inputs(dtype, device, 5), _elementwise_inputs(dtype, device, 5)
    _elementwise_call(cafin.ops, name, fused)
    _elementwise_call(cafin.reference, name, ref)
    # A long matrix's norms and sums round in another order on each side.
    tol = TOL[dtype] if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    for key in ("ls", "rs", "mps", "vs", "params"):
        for got, want in zip(fused[key], ref[key]):
            torch.testing.assert_close(got, want, **tol)
            assert torch.isfinite(got).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("normalize", [False, True])
def test_apply_with_one_step_size_per_parameter(device, dtype, normalize):
    """A vector of step sizes gives each parameter what a call with its own 0-dim step size
    gives it, bit for bit, fused and reference alike."""
    x = _elementwise_inputs(dtype, device, 6)
    sizes = torch.tensor([0.03, 0.011, 0.2, 0.007], dtype=torch.float64, device=device)
    assert sizes.numel() == len(x["params"])
    for impl in (cafin.ops, cafin.reference):
        together = [p.clone() for p in x["params"]]
        impl.dykaf_apply_(together, x["mps"], sizes, x["lr"], x["weight_decay"], normalize)
        for i, (p, u) in enumerate(zip(x["params"], x["mps"])):
            alone = p.clone()
            impl.dykaf_apply_([alone], [u], sizes[i].clone(), x["lr"], x["weight_decay"], normalize)
            assert torch.equal(together[i], alone), (impl.__name__, i)
    fused = [p.clone() for p in x["params"]]
    cafin.ops.dykaf_apply_(fused, x["mps"], sizes, x["lr"], x["weight_decay"], normalize)
    ref = [p.clone() for p in x["params"]]
    cafin.reference.dykaf_apply_(ref, x["mps"], sizes, x["lr"], x["weight_decay"], normalize)
    tol = TOL[dtype] if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    for got, want in zip(fused, ref):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("call", [cafin.ops.dykaf_apply_, torch.ops.cafin.dykaf_apply_],
                         ids=["face", "kernel"])
def test_apply_refuses_a_bad_step_size_vector_writing_nothing(call):
    x = _elementwise_inputs(torch.float32, "cpu", 7)
    before = [p.clone() for p in x["params"]]
    n = len(x["params"])
    bad = {"length": (torch.full((n - 1,), 0.1, dtype=torch.float64), ValueError, "one per parameter"),
           "dtype": (torch.full((n,), 0.1, dtype=torch.float32), TypeError, "float64"),
           "matrix": (torch.full((n, 1), 0.1, dtype=torch.float64), ValueError, "step_size"),
           "strided": (torch.full((2 * n,), 0.1, dtype=torch.float64)[::2], ValueError, "contiguous")}
    for name, (sizes, error, words) in bad.items():
        with pytest.raises(error, match=words):
            call(x["params"], x["mps"], sizes, x["lr"], x["weight_decay"], True)
        for p, q in zip(x["params"], before):
            assert torch.equal(p, q), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True])
def test_apply_over_many_tensors_of_mixed_dtypes(device, normalize):
    """More parameters than one CUDA launch's table holds (48), of three parameter dtypes (their
    updates float32 or float64), one of them longer than a launch's blocks cover (320 chunks of
    65536 on CUDA, so its chunks continue in the next launch), each with its own step size:
    fused equals the reference."""
    g = torch.Generator().manual_seed(8)
    big = 21_000_000 if device == "cuda" else 70_000
    sizes = [1 + (53 * i) % 4000 for i in range(60)] + [big]
    dtypes = [(torch.float32, torch.bfloat16, torch.float64)[i % 3] for i in range(len(sizes))]
    params = [torch.randn(n, generator=g, dtype=torch.float64).to(device, d) for n, d in zip(sizes, dtypes)]
    updates = [torch.randn(n, generator=g, dtype=torch.float64).to(
        device, torch.float64 if d == torch.float64 else torch.float32) for n, d in zip(sizes, dtypes)]
    steps = torch.rand(len(sizes), generator=g, dtype=torch.float64).to(device) * 0.1
    lr = torch.tensor(0.01, dtype=torch.float64, device=device)
    wd = torch.tensor(0.1, dtype=torch.float64, device=device)
    fused, ref = [p.clone() for p in params], [p.clone() for p in params]
    cafin.ops.dykaf_apply_(fused, updates, steps, lr, wd, normalize)
    cafin.reference.dykaf_apply_(ref, updates, steps, lr, wd, normalize)
    for i, (a, b, d) in enumerate(zip(fused, ref, dtypes)):
        tol = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=1e-5, atol=1e-6),
               torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}[d]
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"tensor {i}: {m}")
        assert not torch.equal(a, params[i]), i  # updated


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_preconditioners_over_many_matrices(device, dtype):
    """dykaf_precondition_ and dykaf_adam_precondition_ over more matrices than one CUDA launch's
    table holds, one longer than a launch's blocks cover: fused equals the reference."""
    g = torch.Generator().manual_seed(9)
    big = (4100, 5200) if device == "cuda" else (70, 1000)
    shapes = [(1 + (7 * i) % 40, 1 + (11 * i) % 50) for i in range(60)] + [big]
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype)  # noqa: E731
    scalar = lambda v: torch.tensor(v, dtype=torch.float64, device=device)  # noqa: E731
    mps = [mk(*s) for s in shapes]
    ls, rs = [mk(s[0]).abs() + 0.1 for s in shapes], [mk(s[1]).abs() + 0.1 for s in shapes]
    vs, gps = [mk(*s).abs() for s in shapes], [mk(*s) for s in shapes]
    tol = TOL[dtype] if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    a, b = [m.clone() for m in mps], [m.clone() for m in mps]
    cafin.ops.dykaf_precondition_(a, ls, rs, scalar(1e-6))
    cafin.reference.dykaf_precondition_(b, ls, rs, scalar(1e-6))
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, **tol, msg=lambda m, i=i: f"precondition {i}: {m}")
    a, b = [m.clone() for m in mps], [m.clone() for m in mps]
    va, vb = [v.clone() for v in vs], [v.clone() for v in vs]
    cafin.ops.dykaf_adam_precondition_(a, va, gps, scalar(0.95), scalar(1e-8))
    cafin.reference.dykaf_adam_precondition_(b, vb, gps, scalar(0.95), scalar(1e-8))
    for i, (x, y, u, w) in enumerate(zip(a, b, va, vb)):
        torch.testing.assert_close(x, y, **tol, msg=lambda m, i=i: f"adam mp {i}: {m}")
        torch.testing.assert_close(u, w, **tol, msg=lambda m, i=i: f"adam v {i}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_rank_one_over_many_matrices_of_two_dtypes(device):
    """dykaf_rank_one_ over more matrices than one CUDA launch's table holds (48), float32 and
    float64 in one call, one with more rows than the row grid (4096) and one wider than 32
    column tiles: fused equals the reference."""
    g = torch.Generator().manual_seed(10)
    shapes = [(1 + (7 * i) % 40, 1 + (11 * i) % 50) for i in range(60)] + [(5000, 7), (9, 1100)]
    dtypes = [torch.float32 if i % 2 else torch.float64 for i in range(len(shapes))]
    mk = lambda s, d: torch.randn(*s, generator=g, dtype=torch.float64).to(device, d)  # noqa: E731
    gps = [mk(s, d) for s, d in zip(shapes, dtypes)]
    ls = [mk((s[0],), d).abs() + 0.1 for s, d in zip(shapes, dtypes)]
    rs = [mk((s[1],), d).abs() + 0.1 for s, d in zip(shapes, dtypes)]
    beta2 = torch.tensor(0.93, dtype=torch.float64, device=device)
    guard = torch.tensor(1e-6, dtype=torch.float64, device=device)
    fused = ([l.clone() for l in ls], [r.clone() for r in rs])
    ref = ([l.clone() for l in ls], [r.clone() for r in rs])
    cafin.ops.dykaf_rank_one_(*fused, gps, beta2, guard)
    cafin.reference.dykaf_rank_one_(*ref, gps, beta2, guard)
    for side in (0, 1):
        for i, (a, b, d) in enumerate(zip(fused[side], ref[side], dtypes)):
            tol = TOL[d] if d == torch.float64 else dict(rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i, side=side: f"side {side} {i}: {m}")
