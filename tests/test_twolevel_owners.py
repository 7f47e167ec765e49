"""TwoLevelKFAC's decompositions shared out over the ranks: two CPU/gloo ranks (one launch running
every case) against one process on the whole batch.
- float64, each rank its half of the batch, the mean gradient: both ranks' parameters equal, and
  equal one process's within 1e-10, for every coarse space, Krylov on and off, colocated factors
  and the memory strategy, the coarse correction off, and with the sharing turned off;
- each rank makes exactly the decompositions the assignment gives it (its factors' eigh on
  inverse steps, the coarse inverse on every coarse step if it owns it), and the two ranks' shares
  are every matrix once;
- the collectives of every step are counted: the all_reduces of the data-parallel averages as
  before, plus one all_gather of the decompositions on inverse steps (padded to the larger share;
  the coarse inverse inside it when F_c is known before the decompositions: nicolaides and
  tpselepedis without Krylov vectors) and one of the coarse inverse otherwise;
- a decomposition that fails on its owner, with no previous basis, raises on both ranks.
"""
from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cafin
from cafin.factors import factor_sizes

import two_ranks

STEPS = 5  # T_cov = 1, T_inv = 2: decompositions at steps 0, 2, 4, the coarse matrix at every step
BATCH = 12  # the whole batch; each rank takes its half
HP = dict(damping=0.01, alpha=0.9, T_cov=1, T_inv=2)
CASES = {
    "nicolaides": dict(),
    "nicolaides-krylov": dict(krylov=True),
    # its vector is the eigenvector of each factor's smallest eigenvalue: a batch of 64 keeps that
    # eigenvalue simple (12 samples leave the 49-wide A 37 equal ones, and the vector undefined)
    "spectral": dict(coarse_space="spectral", batch=64),
    "residual": dict(coarse_space="residual"),
    "residual-krylov": dict(coarse_space="residual", krylov=True),
    "tpselepedis": dict(coarse_space="tpselepedis"),
    "nicolaides-colocated-memory": dict(colocate_factors=True, assignment_strategy="memory"),
    "none": dict(coarse_space="none"),
    "not-distributed": dict(distribute_decompositions=False),
    "nicolaides-float32": dict(dtype=torch.float32),
}
# F_c known before the decompositions: its inverse travels with them
RIDES = ("nicolaides", "tpselepedis", "nicolaides-colocated-memory", "nicolaides-float32")


def make_model(dtype=torch.float64) -> nn.Sequential:
    """Conv2d, Linear with and without bias; factor sizes (A, G): (19, 3), (49, 10), (10, 5), (6, 4)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(48, 10), nn.Tanh(),
                         nn.Linear(10, 5, bias=False), nn.Tanh(), nn.Linear(5, 4)).to(dtype)


SIZES = [factor_sizes(m)[1:] for m in make_model() if isinstance(m, (nn.Linear, nn.Conv2d))]


def batch(step: int, dtype=torch.float64, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 2, 4, 4, generator=g).to(dtype), torch.randint(0, 4, (size,), generator=g)


def split(case: dict) -> tuple[torch.dtype, int, dict]:
    """(dtype, whole batch size, TwoLevelKFAC's keyword arguments) of a case."""
    kw = dict(case)
    return kw.pop("dtype", torch.float64), kw.pop("batch", BATCH), kw


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(model, opt, batches, world, on_step=lambda: None, reduce=lambda model: None):
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        sgd.zero_grad()
        opt.update_stats = True
        F.cross_entropy(model(x), y).backward()
        reduce(model)
        opt.step(update_params=True)
        on_step()
        sgd.step()


# ------------------------------------------------------------------------------ the ranks
def _worker(outdir: str) -> None:
    rank, world = two_ranks.join(outdir)
    import torch.distributed as dist
    import cafin.maths.twolevel as maths
    decomposed: list[tuple[str, int]] = []
    eigh, inverse = maths.factor_eigh, maths.coarse_inverse
    fail = [None]  # a factor size whose eigh fails

    def counted_eigh(m):
        decomposed.append(("eigh", m.shape[-1]))
        return None if m.shape[-1] == fail[0] else eigh(m)

    def counted_inverse(f):
        decomposed.append(("inverse", f.shape[-1]))
        return inverse(f)
    maths.factor_eigh, maths.coarse_inverse = counted_eigh, counted_inverse
    two_ranks.count_collectives(("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor"))

    def mean_gradient(model):  # what DDP computes, not counted
        two_ranks.COUNTING[0] = False
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        two_ranks.COUNTING[0] = True

    for name, case in {**CASES, "failure": dict()}.items():
        out: dict = {"error": None, "calls": [], "decomposed": []}
        fail[0] = 49 if name == "failure" else None
        dtype, size, kw = split(case)
        try:
            model = make_model(dtype)
            opt = cafin.TwoLevelKFAC(model, **HP, **kw)
            out["assignment"], out["coarse_worker"] = opt.assignment, opt.coarse_worker

            def on_step():
                out["calls"].append(list(two_ranks.CALLS))
                out["decomposed"].append(sorted(decomposed))
                two_ranks.CALLS.clear()
                decomposed.clear()
            two_ranks.CALLS.clear()
            decomposed.clear()
            batches = [tuple(t.chunk(world)[rank] for t in batch(s, dtype, size)) for s in range(STEPS)]
            train(model, opt, batches, world, on_step, mean_gradient)
            out["params"] = flat(model)
        except Exception:
            out["error"] = traceback.format_exc()
        torch.save(out, os.path.join(outdir, f"{name}_rank{rank}.pt"))
        if out["error"] and name != "failure":
            break
    two_ranks.leave()


_LAUNCH: dict = {}


def results(name: str, tmp_path_factory) -> list[dict]:
    if "out" not in _LAUNCH:
        outdir = tmp_path_factory.mktemp("twolevel_owners")
        _LAUNCH["failure"] = two_ranks.launch(lambda rank: [__file__, "--worker", outdir], outdir, 2)
        _LAUNCH["out"] = outdir
    out = []
    for rank in range(2):
        path = _LAUNCH["out"] / f"{name}_rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote nothing for {name}: {_LAUNCH['failure']}")
        out.append(torch.load(path, weights_only=False))
    return out


def one_process(case: dict) -> tuple[torch.Tensor, list]:
    """The whole batch in one process; the decompositions it makes per step."""
    import cafin.maths.twolevel as maths
    dtype, size, kw = split(case)
    model = make_model(dtype)
    opt = cafin.TwoLevelKFAC(model, **HP, **kw)
    assert opt.assignment is None and opt.coarse_worker is None
    made, per_step = [], []
    eigh, inverse = maths.factor_eigh, maths.coarse_inverse
    try:
        maths.factor_eigh = lambda m: made.append(("eigh", m.shape[-1])) or eigh(m)
        maths.coarse_inverse = lambda f: made.append(("inverse", f.shape[-1])) or inverse(f)
        train(model, opt, [batch(s, dtype, size) for s in range(STEPS)], 1,
              lambda: (per_step.append(sorted(made)), made.clear()))
    finally:
        maths.factor_eigh, maths.coarse_inverse = eigh, inverse
    return flat(model), per_step


def coarse_size(case: dict) -> int:
    return 0 if case.get("coarse_space") == "none" else len(SIZES) * (2 if case.get("krylov") else 1)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process_and_split_the_decompositions(name, tmp_path_factory):
    case = CASES[name]
    ranks = results(name, tmp_path_factory)
    for r in ranks:
        assert r["error"] is None, r["error"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])  # every rank steps the same
    dtype = split(case)[0]
    want, per_step = one_process(case)
    start = flat(make_model(dtype))
    err = ((ranks[0]["params"] - want).abs().max() / (want - start).abs().max()).item()
    assert err <= (1e-10 if dtype == torch.float64 else 1e-4), err

    n = coarse_size(case)
    everything = sorted([("eigh", d) for pair in SIZES for d in pair] + ([("inverse", n)] if n else []))
    assert per_step[0] == everything  # one process: every matrix, once
    if name == "not-distributed":  # every rank makes every decomposition, as one process does
        assert all(r["assignment"] is None and r["decomposed"] == per_step for r in ranks)
        return
    assignment, owner = ranks[0]["assignment"], ranks[0]["coarse_worker"]
    assert ranks[1]["assignment"] == assignment and ranks[1]["coarse_worker"] == owner
    assert (owner is None) == (n == 0)
    owners = list(assignment.values())
    if case.get("colocate_factors"):
        assert all(o["A"] == o["G"] for o in owners)
    shares = []
    for rank, r in enumerate(ranks):
        share = sorted(("eigh", d) for pair, o in zip(SIZES, owners) for d, f in zip(pair, "AG") if o[f] == rank)
        inverse = [("inverse", n)] if owner == rank else []
        assert share, f"rank {rank} decomposes nothing"
        for step in range(STEPS):
            assert r["decomposed"][step] == sorted(share + inverse if step % 2 == 0 else inverse), (rank, step)
        shares.append(r["decomposed"][0])
    assert sorted(shares[0] + shares[1]) == everything  # every matrix once


def expected_gathers(case: dict, name: str, ranks: list[dict], step: int) -> list[int]:
    """The elements each all_gather of a step sends (the payload of the larger share: a factor's
    eigenvalues, eigenvectors and flag; the coarse inverse)."""
    n = coarse_size(case)
    assignment, owner = ranks[0]["assignment"], ranks[0]["coarse_worker"]
    gathers = []
    if step % 2 == 0:
        share = [sum(d + d * d + 1 for pair, o in zip(SIZES, assignment.values()) for d, f in zip(pair, "AG")
                     if o[f] == rank) + (n * n if name in RIDES and owner == rank else 0) for rank in range(2)]
        gathers.append(max(share))
    if n and not (step % 2 == 0 and name in RIDES):
        gathers.append(n * n)
    return gathers


@pytest.mark.parametrize("name", list(CASES))
def test_collectives_per_step(name, tmp_path_factory):
    """The data-parallel all_reduces as without sharing (nicolaides, tpselepedis: one; the spaces
    whose vectors read the new bases: a second for F_c; residual: one more for its Fisher
    product), and the all_gathers of the decompositions."""
    case = CASES[name]
    dtype = str(split(case)[0]).replace("torch.", "")
    space = case.get("coarse_space", "nicolaides")
    reduces = 1 + (space in ("spectral", "residual") or case.get("krylov", False)) + (space == "residual")
    if space == "none":
        reduces = 1
    for r in results(name, tmp_path_factory):
        assert r["error"] is None, r["error"]
        for step, calls in enumerate(r["calls"]):
            assert all(c[2] == dtype for c in calls), calls
            assert sum(c[0] == "all_reduce" for c in calls) == reduces, (step, calls)
            gathers = [c[1] for c in calls if c[0] != "all_reduce"]
            assert all(c[0] in ("all_reduce", "all_gather") for c in calls), calls
            want = [] if name == "not-distributed" else expected_gathers(case, name, results(name, tmp_path_factory),
                                                                         step)
            assert gathers == want, (step, calls)


def test_assignment_balances_by_cost(tmp_path_factory):
    """The Linear(48, 10)'s A (49^3) outweighs every other factor together: it is rank 0's whole
    share, everything else is rank 1's (the coarse inverse too); colocated and by memory
    (d^2), that layer's two factors are rank 0's."""
    ranks = results("nicolaides", tmp_path_factory)
    assert [r["decomposed"][0] for r in ranks] == [[("eigh", 49)], sorted(
        [("eigh", d) for pair in SIZES for d in pair if d != 49] + [("inverse", 4)])]
    ranks = results("nicolaides-colocated-memory", tmp_path_factory)
    assert ranks[0]["decomposed"][0] == [("eigh", 10), ("eigh", 49)]


def test_a_failure_on_the_owner_raises_on_every_rank(tmp_path_factory):
    for r in results("failure", tmp_path_factory):
        assert r["error"] is not None and "RuntimeError" in r["error"], r["error"]
        assert "layer '3'" in r["error"] and "failed on rank 0 (its owner)" in r["error"], r["error"]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])


# ------------------------------------------------------------------------------ one process
def test_one_process_has_no_assignment_and_the_same_numbers_with_the_options():
    base, _ = one_process(dict())
    for kw in (dict(distribute_decompositions=False), dict(colocate_factors=True, assignment_strategy="memory")):
        assert torch.equal(one_process(kw)[0], base)


@pytest.mark.parametrize("kw, error, match", [
    (dict(distribute_decompositions=1), TypeError, "distribute_decompositions must be a bool"),
    (dict(colocate_factors="yes"), TypeError, "colocate_factors must be a bool"),
    (dict(assignment_strategy="fast"), ValueError, "assignment_strategy must be one of"),
])
def test_bad_distribution_arguments_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        cafin.TwoLevelKFAC(make_model(), **kw)
