"""KAISA for KFACPreconditioner: the assignment of factors to inverse workers (kfac-pytorch's greedy
rule), and two CPU/gloo ranks (one launch running every case) against one process:
- float64, each rank its half of the batch: the parameters equal one process's, which takes the two
  halves as two accumulated passes (the mean of the ranks' statistics) and the mean gradient,
  within 1e-10, for COMM_OPT and MEM_OPT (HYBRID_OPT is MEM_OPT at two ranks), eigen and inverse,
  symmetry_aware on and off, bucket caps, both assignment strategies;
- each rank decomposes exactly the factors the assignment gives it, and the two ranks' shares
  are every factor once;
- the collectives of every step are counted: one all_reduce per factor bucket on factor steps,
  one all_gather of second-order data on inverse steps (COMM_OPT), one all_gather of
  preconditioned gradients per step (MEM_OPT), with their element counts.
A four-rank launch checks HYBRID_OPT the same way, and the broadcasts that replace a padded
all_gather when the shares are uneven.
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
from cafin.core.distribution.kaisa import KaisaAssignment, factor_costs, greedy_assignment, receiver_rows, worker_columns

import two_ranks

STEPS = 5  # inverse steps at 0, 2, 4
BATCH = 12  # the whole batch; each rank takes its share
HP = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, kl_clip=0.01, lr=0.1,
          inv_dtype=torch.float64, decompose_dtype=torch.float64)
CASES = {
    "comm-eigen": dict(),
    "mem-eigen": dict(grad_worker_fraction="mem"),
    "comm-inverse": dict(compute_method="inverse"),
    "mem-inverse": dict(grad_worker_fraction="mem", compute_method="inverse"),
    "comm-eigen-symmetric": dict(symmetry_aware=True),
    "mem-inverse-symmetric": dict(grad_worker_fraction="mem", compute_method="inverse", symmetry_aware=True),
    "comm-split-factors": dict(colocate_factors=False, compute_eigenvalue_outer_product=False),
    "comm-cap0": dict(allreduce_bucket_cap_mb=0),
    "mem-memory-cap": dict(grad_worker_fraction="mem", assignment_strategy="memory",
                           allreduce_bucket_cap_mb=0.02),
}
# An Embedding (its A diagonal, no basis) beside a Linear: the second-order data it shares.
EMBEDDING_CASES = {"embedding-comm-eigen": dict(), "embedding-mem-eigen": dict(grad_worker_fraction="mem"),
                   "embedding-comm-inverse-symmetric": dict(compute_method="inverse", symmetry_aware=True),
                   "embedding-comm-split-factors": dict(colocate_factors=False,
                                                        compute_eigenvalue_outer_product=False)}
FOUR_RANK_CASES = {"hybrid-eigen": dict(grad_worker_fraction=0.5),
                   "hybrid-inverse-symmetric": dict(grad_worker_fraction=0.5, compute_method="inverse",
                                                    symmetry_aware=True),
                   "comm-eigen": dict(), "mem-eigen": dict(grad_worker_fraction="mem")}


def make_model() -> nn.Sequential:
    """Conv2d, Linear with and without bias; factor sizes 19, 3, 49, 10, 10, 5, 6, 4."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 10), nn.Tanh(),
                         nn.Linear(10, 5, bias=False), nn.ReLU(), nn.Linear(5, 4)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 2, 4, 4, generator=g, dtype=torch.float64), torch.randint(0, 4, (BATCH,), generator=g)


def make_embedding_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 6), nn.Flatten(), nn.Linear(18, 4)).double()


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, 11, (BATCH, 3), generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def model_and_batch(name: str):
    return (make_embedding_model, token_batch) if name.startswith("embedding") else (make_model, batch)


def options(case: dict, world: int) -> dict:
    kw = {**HP, **case}
    if kw.get("grad_worker_fraction") == "mem":
        kw["grad_worker_fraction"] = 1.0 / world
    return kw


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ------------------------------------------------------------------------------ the assignment
def test_grid_is_kfac_pytorchs():
    assert worker_columns(8, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert receiver_rows(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert worker_columns(4, 4) == [[0, 1, 2, 3]] and receiver_rows(4, 4) == [[0], [1], [2], [3]]
    assert worker_columns(4, 1) == [[0], [1], [2], [3]] and receiver_rows(4, 1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="multiple"):
        worker_columns(6, 4)


def test_greedy_assignment_balances_by_cost():
    work = {"l1": {"A": 10.0, "G": 1.0}, "l2": {"A": 6.0, "G": 2.0}, "l3": {"A": 3.0, "G": 3.0},
            "l4": {"A": 1.0, "G": 1.0}}
    # colocated, one column of two: l1 (11) -> 0, l2 (8) -> 1, l3 (6) -> 1, l4 (2) -> 0
    got = greedy_assignment(work, [[0, 1]], 2, colocate=True)
    assert got == {"l1": {"A": 0, "G": 0}, "l2": {"A": 1, "G": 1}, "l3": {"A": 1, "G": 1},
                   "l4": {"A": 0, "G": 0}}
    # factors apart: l1.A -> 0 (10), l1.G -> 1 (1), l2.A -> 1 (7), l2.G -> 1 (9), l3.G -> 1? no:
    # loads 10 / 9 after l2; l3's G then A (equal cost: "G" first) -> 1 (12), then 0 (13)
    got = greedy_assignment(work, [[0, 1]], 2, colocate=False)
    assert got["l1"] == {"A": 0, "G": 1} and got["l2"] == {"A": 1, "G": 1}
    assert got["l3"] == {"G": 1, "A": 0}
    # columns of one rank (MEM_OPT): the layer's column is its rank
    got = greedy_assignment(work, [[0], [1], [2]], 3, colocate=False)
    assert [got[n]["A"] for n in work] == [0, 1, 2, 2] and all(f["A"] == f["G"] for f in got.values())


@pytest.mark.parametrize("world,grad_workers,expected", [(4, 1, [3, 2, 1, 0, 1, 0]), (4, 2, [0, 1, 2, 3, 2, 3]),
                                                         (8, 2, [3, 1, 0, 2, 4, 6])])
def test_assignment_is_kfac_pytorchs_where_loads_tie(world, grad_workers, expected):
    """kfac-pytorch 0.4.2's KAISAAssignment gave these inverse workers (run side by side from its
    source); it hands the columns to the greedy rule in a set's order, which decides ties."""
    work = {f"l{i}": {"A": c, "G": c / 2} for i, c in enumerate([8.0, 8.0, 1.0, 1.0, 1.0, 1.0])}
    for rank in range(world):
        a = KaisaAssignment(work, rank=rank, world=world, grad_worker_fraction=grad_workers / world,
                            colocate_factors=True)
        assert [a.inv_worker(name, "A") for name in work] == expected
        assert [a.inv_worker(name, "G") for name in work] == expected


def test_costs_follow_the_strategy():
    sizes = {"a": (1, 10, 2), "b": (2, 3, 4)}
    assert factor_costs(sizes, "compute") == {"a": {"A": 1000.0, "G": 8.0}, "b": {"A": 54.0, "G": 128.0}}
    assert factor_costs(sizes, "memory") == {"a": {"A": 100.0, "G": 4.0}, "b": {"A": 18.0, "G": 32.0}}


@pytest.mark.parametrize("world,fraction", [(1, 1.0), (2, 1.0), (2, 0.5), (4, 1.0), (4, 0.5), (4, 0.25),
                                            (8, 0.25)])
def test_every_factor_has_one_inverse_worker_in_its_layers_column(world, fraction):
    model = make_model()
    pre = cafin.KFACPreconditioner(model)
    sizes = {layer.name: cafin.factors.factor_sizes(layer.module) for layer in pre.layers}
    work = factor_costs(sizes, "compute")
    views = [KaisaAssignment(work, rank=r, world=world, grad_worker_fraction=fraction, colocate_factors=True)
             for r in range(world)]
    grad_workers = max(1, round(world * fraction))
    for name in work:
        workers = [r for r in range(world) if views[r].is_grad_worker(name)]
        assert len(workers) == grad_workers
        for factor in "AG":
            inv = {v.inv_worker(name, factor) for v in views}
            assert len(inv) == 1 and inv.pop() in workers  # the same on every rank
        # the row of every rank holds exactly one gradient worker of the layer
        for v in views:
            assert len([r for r in v.my_row if r in workers]) == 1
    assert views[0].broadcast_inverses() == (grad_workers > 1)
    assert views[0].broadcast_gradients() == (grad_workers < world)


def test_one_process_is_unchanged_by_the_options():
    """One process: every option gives today's numbers, bit for bit."""
    def run(**kw):
        model = make_model()
        pre = cafin.KFACPreconditioner(model, **{**HP, **kw})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            opt.zero_grad()
            F.cross_entropy(model(batch(step)[0]), batch(step)[1]).backward()
            pre.step()
            opt.step()
        return flat(model)
    base = run()
    for kw in (dict(grad_worker_fraction=0.5), dict(symmetry_aware=True, allreduce_bucket_cap_mb=0),
               dict(assignment_strategy="memory")):
        assert torch.equal(run(**kw), base), kw


# ------------------------------------------------------------------------------ the ranks
def _worker(outdir: str, cases: str) -> None:
    rank, world = two_ranks.join(outdir)
    import torch.distributed as dist
    import cafin.maths.kfac as kfac_maths
    decomposed: list[int] = []
    for fname in ("eigen_decompose", "damped_inverse"):  # record each factor decomposed (its size)
        original = getattr(kfac_maths, fname)

        def counted(factor, *args, __original=original, **kwargs):
            decomposed.extend([factor.shape[-1]] * factor.shape[0])
            return __original(factor, *args, **kwargs)
        setattr(kfac_maths, fname, counted)
    two_ranks.count_collectives(("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor",
                                 "all_reduce_coalesced", "reduce_scatter", "all_to_all"))
    table = {**CASES, **EMBEDDING_CASES} if cases == "two" else FOUR_RANK_CASES
    for name, case in table.items():
        out: dict = {"error": None}
        build, batch_of = model_and_batch(name)
        try:
            model = build()
            pre = cafin.KFACPreconditioner(model, **options(case, world))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            out["assignment"] = {layer.name: {f: pre.assignment.inv_worker(layer.name, f) for f in "AG"}
                                 for layer in pre.layers}
            out["grad_worker"] = {layer.name: pre.assignment.is_grad_worker(layer.name) for layer in pre.layers}
            out["calls"], out["decomposed"] = [], []
            for step in range(STEPS):
                x, y = batch_of(step)
                opt.zero_grad()
                F.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
                two_ranks.COUNTING[0] = False
                for p in model.parameters():  # what DDP computes: the mean gradient
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
                two_ranks.COUNTING[0] = True
                two_ranks.CALLS.clear()
                decomposed.clear()
                pre.step()
                out["calls"].append(list(two_ranks.CALLS))
                out["decomposed"].append(sorted(decomposed))
                opt.step()
            out["params"] = flat(model)
            out["memory"] = pre.memory_usage()
        except Exception:
            out["error"] = traceback.format_exc()
        torch.save(out, os.path.join(outdir, f"{name}_rank{rank}.pt"))
        if out["error"]:
            break
    two_ranks.leave()


_LAUNCHES: dict = {}


def results(world: int, name: str, tmp_path_factory) -> list[dict]:
    if world not in _LAUNCHES:
        outdir = tmp_path_factory.mktemp(f"kaisa{world}")
        failure = two_ranks.launch(lambda rank: [__file__, "--worker", outdir, "two" if world == 2 else "four"],
                                   outdir, world)
        _LAUNCHES[world] = (outdir, failure)
    outdir, failure = _LAUNCHES[world]
    out = []
    for rank in range(world):
        path = outdir / f"{name}_rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote nothing for {name}: {failure}")
        r = torch.load(path, weights_only=False)
        assert r["error"] is None, r["error"]
        out.append(r)
    return out


def one_process(case: dict, world: int, name: str = "") -> torch.Tensor:
    """The whole batch in one process: the ranks' shares as accumulated passes, the mean gradient."""
    build, batch_of = model_and_batch(name)
    model = build()
    kw = options(case, 1)
    kw["grad_worker_fraction"] = 1.0
    pre = cafin.KFACPreconditioner(model, accumulation_steps=world, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch_of(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(world), y.chunk(world)):
            F.cross_entropy(model(xs), ys).backward()  # unscaled: G is each rank's
        for p in model.parameters():
            p.grad.div_(world)
        pre.step()
        opt.step()
    return flat(model)


def equal_to_one_process(world, name, case, tmp_path_factory) -> list[dict]:
    ranks = results(world, name, tmp_path_factory)
    start = flat(model_and_batch(name)[0]())
    for r in ranks[1:]:
        assert torch.equal(r["params"], ranks[0]["params"])  # every rank steps the same
    want = one_process(case, world, name)
    err = ((ranks[0]["params"] - want).abs().max() / (want - start).abs().max()).item()
    assert err <= 1e-10, err
    return ranks


def check_case(world, name, case, tmp_path_factory):
    ranks = equal_to_one_process(world, name, case, tmp_path_factory)

    # each rank decomposes its share on inverse steps (0, 2, 4), nothing otherwise
    sizes = {name: (cafin.factors.factor_sizes(m)[1:]) for name, m in make_model().named_modules()
             if isinstance(m, (nn.Linear, nn.Conv2d))}
    assignment = ranks[0]["assignment"]
    for rank, r in enumerate(ranks):
        assert r["assignment"] == assignment
        share = sorted(d for layer, (d_a, d_g) in sizes.items() for d, f in ((d_a, "A"), (d_g, "G"))
                       if assignment[layer][f] == rank)
        for step in range(STEPS):
            assert r["decomposed"][step] == (share if step % 2 == 0 else []), (rank, step)
    union = sorted(d for r in ranks for d in r["decomposed"][0])
    assert union == sorted(d for pair in sizes.values() for d in pair)
    if world == 2:  # four ranks: four layers, one of them most of the cost, leave a rank idle
        assert all(r["decomposed"][0] for r in ranks), "a rank with no share"
    return ranks, sizes


def expected_calls(kw, world, sizes, ranks, rank, step):
    """The collectives of one step on `rank`: [(name, elements sent)]."""
    symmetric = kw.get("symmetry_aware", False)
    cap = kw.get("allreduce_bucket_cap_mb", 25.0) * 1e6
    calls, bucket, used = [], 0, 0
    for d_a, d_g in sizes.values():  # the factor buckets, in layer order, A then G
        for d in (d_a, d_g):
            n = d * (d + 1) // 2 if symmetric else d * d
            if bucket and (used + n) * 8 > cap:
                calls.append(("all_reduce", bucket))
                bucket = used = 0
            bucket += n
            used += n
    calls.append(("all_reduce", bucket))
    fraction = kw.get("grad_worker_fraction", 1.0)
    grad_workers = max(1, round(world * fraction))
    r = ranks[rank]
    mine = [layer for layer in sizes if r["grad_worker"][layer]]
    if step % 2 == 0 and grad_workers > 1:  # second-order data, padded to the longest member's
        calls.append(("all_gather", None))
    if step % 2 == 0 and grad_workers < world:  # whether each layer is decomposed
        calls.append(("all_gather", None))
    if grad_workers < world:  # preconditioned gradients
        calls.append(("all_gather", None))
    return calls, mine


CASE_IDS = list(CASES)


@pytest.mark.parametrize("name", CASE_IDS)
def test_two_ranks_equal_one_process_and_split_the_work(name, tmp_path_factory):
    case = CASES[name]
    ranks, sizes = check_case(2, name, case, tmp_path_factory)
    kw = options(case, 2)
    for rank, r in enumerate(ranks):
        for step in range(STEPS):
            calls, mine = expected_calls(kw, 2, sizes, ranks, rank, step)
            got = r["calls"][step]
            assert [c[0] for c in got] == [c[0] for c in calls], (step, got)
            assert [c[1] for c in got if c[0] == "all_reduce"] == [c[1] for c in calls if c[0] == "all_reduce"]
            assert all(c[2] == "float64" for c in got if c[0] == "all_reduce")
    fraction = kw.get("grad_worker_fraction", 1.0)
    if fraction < 1:  # MEM_OPT: each rank holds the second-order data of its own layers only
        full = cafin.KFACPreconditioner(make_model(), **options(case, 1)).memory_usage()
        held = [r["memory"]["a_inverses"] + r["memory"]["g_inverses"] for r in ranks]
        assert sum(held) == full["a_inverses"] + full["g_inverses"] and min(held) > 0


def test_comm_opt_shares_second_order_data_in_one_padded_all_gather(tmp_path_factory):
    ranks = results(2, "comm-eigen", tmp_path_factory)
    sizes = {name: (cafin.factors.factor_sizes(m)[1:]) for name, m in make_model().named_modules()
             if isinstance(m, (nn.Linear, nn.Conv2d))}
    groups = {name: cafin.factors.factor_sizes(m)[0] for name, m in make_model().named_modules()
              if isinstance(m, (nn.Linear, nn.Conv2d))}
    # eigen with the outer product: Q_A, Q_G, 1/(d_G d_A^T + damping) and two flags per layer
    per_rank = [sum(groups[n] * (d_a * d_a + d_g * d_g + d_g * d_a) + 2 for n, (d_a, d_g) in sizes.items()
                    if ranks[0]["assignment"][n]["A"] == rank) for rank in range(2)]
    for r in ranks:
        gathers = [c for c in r["calls"][0] if c[0] == "all_gather"]
        assert gathers == [("all_gather", max(per_rank), "float64")]


@pytest.mark.parametrize("name", ["hybrid-eigen", "hybrid-inverse-symmetric"])
def test_hybrid_on_four_ranks_equals_one_process(name, tmp_path_factory):
    ranks, sizes = check_case(4, name, FOUR_RANK_CASES[name], tmp_path_factory)
    for rank, r in enumerate(ranks):
        # columns {0, 2} and {1, 3}: a layer's two gradient workers
        assert sum(r["grad_worker"].values()) < len(sizes)
        for step in range(STEPS):
            kinds = [c[0] for c in r["calls"][step]]
            assert kinds == ["all_reduce"] + (["all_gather"] * 3 if step % 2 == 0 else ["all_gather"]), kinds


@pytest.mark.parametrize("name", ["comm-eigen", "mem-eigen"])
def test_uneven_shares_on_four_ranks_are_broadcast(name, tmp_path_factory):
    """Four ranks, four layers, one of them most of the cost: each rank decomposes one layer,
    and a padded all_gather would more than double what is received, so each rank's share goes
    by one broadcast (four) instead."""
    ranks, sizes = check_case(4, name, FOUR_RANK_CASES[name], tmp_path_factory)
    for r in ranks:
        assert sum(r["grad_worker"].values()) == (len(sizes) if name == "comm-eigen" else 1)
        for step in range(STEPS):
            kinds = [c[0] for c in r["calls"][step]]
            if name == "comm-eigen":  # the factors, then the decompositions of the four ranks
                assert kinds == ["all_reduce"] + (["broadcast"] * 4 if step % 2 == 0 else []), kinds
            else:  # the factors, the flags (even: one all_gather), the gradients of the four ranks
                assert kinds == ["all_reduce"] + (["all_gather"] if step % 2 == 0 else []) + ["broadcast"] * 4


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2], sys.argv[3])


@pytest.mark.parametrize("symmetric", [False, True])
def test_factor_allreduce_sends_a_diagonal_factor_whole(symmetric, monkeypatch):
    """An Embedding's A is kept as its diagonal [groups, n]: it travels whole beside the square
    factors (their upper triangles with symmetry_aware) and comes back in place."""
    import torch.distributed as dist
    from cafin.core.distribution.kaisa import allreduce_factors
    sent = []

    def all_reduce(flat, group=None):  # a world of two ranks holding the same factors
        sent.append(flat.numel())
        flat.mul_(2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    g = torch.Generator().manual_seed(0)
    square = torch.randn(1, 4, 4, generator=g, dtype=torch.float64)
    square = square + square.transpose(1, 2)
    diagonal = torch.rand(1, 7, generator=g, dtype=torch.float64)
    before = [square.clone(), diagonal.clone()]
    calls = allreduce_factors([square, diagonal], None, 2, cap_bytes=25e6, symmetric=symmetric)
    assert calls == 1 and sent == [(10 if symmetric else 16) + 7]
    assert torch.equal(square, before[0]) and torch.equal(diagonal, before[1])


@pytest.mark.parametrize("name", list(EMBEDDING_CASES))
def test_an_embedding_shares_its_diagonal_factor(name, tmp_path_factory):
    """Two ranks equal one process with an Embedding, whose A is a diagonal without a basis."""
    equal_to_one_process(2, name, EMBEDDING_CASES[name], tmp_path_factory)
