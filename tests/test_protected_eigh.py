"""cafin.maths.eigh.protected_eigh: the one protected eigendecomposition the members share, its
policy (attempts, finiteness, errors) given as arguments."""
import pytest
import torch

from cafin.maths.eigh import protected_eigh


def _spd(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n + 3, generator=g, dtype=torch.float64)
    return (a @ a.T / (n + 3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_first_attempt_is_plain_eigh(dtype):
    m = _spd(7, dtype)
    d, q = protected_eigh(m, [(dtype, 0.0), (torch.float64, 0.0)])
    d0, q0 = torch.linalg.eigh(m)
    assert d.dtype == dtype and torch.equal(d, d0) and torch.equal(q, q0)


def test_a_failed_attempt_is_retried_in_the_next_dtype(monkeypatch):
    calls, eigh = [], torch.linalg.eigh

    def failing_in_float32(m):
        calls.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("stand-in failure")
        return eigh(m)

    monkeypatch.setattr(torch.linalg, "eigh", failing_in_float32)
    m = _spd(5, torch.float32)
    d, q = protected_eigh(m, [(torch.float32, 0.0), (torch.float64, 0.0)])
    assert calls == [torch.float32, torch.float64] and d.dtype == torch.float64
    torch.testing.assert_close(q @ torch.diag(d) @ q.T, m.double(), rtol=0, atol=1e-6)


def test_every_attempt_failing_gives_none():
    nan = torch.full((4, 4), float("nan"), dtype=torch.float64)
    assert protected_eigh(nan, [(torch.float32, 0.0), (torch.float64, 1e-10)]) is None


def test_finite_rejects_an_inf_or_nan_result():
    m = torch.tensor([[1.0, float("inf")], [float("inf"), 1.0]], dtype=torch.float64)
    assert protected_eigh(m, [(torch.float64, 0.0)], finite=True) is None
    d, _ = protected_eigh(m, [(torch.float64, 0.0)])  # not asked: eigh's own answer
    assert not torch.isfinite(d).all()


def test_jitter_is_added_on_the_diagonal_in_the_attempt_dtype():
    m = _spd(6, torch.float64, seed=3)
    d, _ = protected_eigh(m, [(torch.float64, 0.25)])
    torch.testing.assert_close(d, torch.linalg.eigh(m)[0] + 0.25, rtol=0, atol=1e-12)


def test_a_repeated_attempt_is_not_run_twice(monkeypatch):
    calls, eigh = [], torch.linalg.eigh

    def failing(m):
        calls.append(m.dtype)
        raise torch.linalg.LinAlgError("stand-in failure")

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    assert protected_eigh(_spd(3, torch.float64), [(torch.float64, 0.0), (torch.float64, 0.0)]) is None
    assert calls == [torch.float64]


def test_only_the_named_errors_are_caught(monkeypatch):
    def broken(m):
        raise RuntimeError("not a decomposition failure")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.raises(RuntimeError, match="not a decomposition failure"):
        protected_eigh(_spd(3, torch.float64), [(torch.float64, 0.0)])
    assert protected_eigh(_spd(3, torch.float64), [(torch.float64, 0.0)], errors=(RuntimeError,)) is None


def test_a_stack_of_factors():
    m = torch.stack([_spd(4, torch.float64, s) for s in range(3)])
    d, q = protected_eigh(m, [(torch.float64, 0.0)])
    assert d.shape == (3, 4) and q.shape == (3, 4, 4)
    torch.testing.assert_close(q @ torch.diag_embed(d) @ q.transpose(-1, -2), m)
