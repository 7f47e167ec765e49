"""DyKAF's process_group: the eigenbasis refreshes shared over two CPU/gloo ranks (one launch runs
every case) against one process that refreshes everything itself:
- the parameters after every step, refresh steps included, equal one process's within 1e-10
  (float64) and the two ranks' are bit-identical, for matrices (both sides, and one side kept
  under max_precond_dim), 1-D tensors with and without a factor, a conv kernel (4-mode split)
  and a merged one (merge_dims), the rank-one and the full second moment, fused and reference;
- each rank refreshes its share of the bases, the owners those of the greedy rule by cost (d^3
  per basis), the two shares every basis once; the same for the first step's
  eigendecompositions, made by their owners only (no rank decomposes a basis it does not own);
- one all_gather per (device, dtype) on a refresh step (its elements: the larger share's bases
  and orders) and on the first step (bases and a flag each), none on the other steps;
- state_dict is the same on both ranks and one process's; loaded into a fresh optimizer with
  process_group it steps on as one process does;
- under FSDP2 (fully_shard) the sharing gives the numbers of no sharing;
- a bad process_group is refused before anything is built.
"""
from __future__ import annotations

import copy
import os
import sys
import traceback

import pytest
import torch
from torch import nn

import cafin
from cafin.core.distribution.kaisa import greedy_assignment

import two_ranks

STEPS = 6  # the first builds the state; refreshes at steps 2 and 4 (precondition_frequency 2)
MORE = 3  # after the checkpoint round trip: a refresh at step 6
FREQ = 2
# (shape, group): group 0 the defaults, 1 merge_dims with precondition_1d, 2 one-sided matrices
SHAPES = [((5, 6), 0), ((5,), 0), ((3, 2, 3, 3), 0), ((7, 4), 0), ((4, 3, 2, 2), 1), ((6,), 1),
          ((4, 12), 2)]
GROUPS = [dict(), dict(merge_dims=True, precondition_1d=True, max_precond_dim=12), dict(max_precond_dim=8)]
CASES = {
    "float64-fused": dict(dtype=torch.float64, dtypes={}, options=dict()),
    "float64-reference-full-moment": dict(dtype=torch.float64, dtypes={},
                                          options=dict(backend="reference", adam_rank_one=False)),
    # a float64 matrix among float32 ones: two dtypes, two exchanges per refresh step
    "float32-mixed": dict(dtype=torch.float32, dtypes={3: torch.float64}, options=dict()),
}


def make_params(case: dict) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype_of(case, i)).requires_grad_()
            for i, (shape, _) in enumerate(SHAPES)]


def dtype_of(case: dict, i: int) -> torch.dtype:
    return case["dtypes"].get(i, case["dtype"])


def make_optimizer(params, case: dict, process_group=None):
    groups = [dict(params=[p for p, (_, k) in zip(params, SHAPES) if k == j], **GROUPS[j])
              for j in range(len(GROUPS))]
    return cafin.DyKAF(groups, lr=0.05, precondition_frequency=FREQ, weight_decay=0.01,
                       process_group=process_group, **case["options"])


def set_grads(params, step: int) -> None:
    """The same gradients on every rank (what DDP's average leaves)."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def factor_modes(opt, params) -> dict[int, tuple[int, int]]:
    """id of each factor -> (parameter index, mode)."""
    return {id(f): (i, k) for i, p in enumerate(params) for k, f in enumerate(opt.state[p].get("factors", []))
            if f is not None}


# ------------------------------------------------------------------------------ the ranks
def _worker(outdir: str) -> None:
    rank, world = two_ranks.join(outdir)
    import torch.distributed as dist
    import cafin.maths.dykaf as dykaf_maths
    refreshed: list = []  # the factors this rank refreshed in the current step
    decomposed: list = []  # the factors this rank eigendecomposed (first steps) in the current step
    original, original_eigenbasis = dykaf_maths.refresh_basis, dykaf_maths.eigenbasis

    def counted(factor, basis):
        refreshed.append(id(factor))
        return original(factor, basis)

    def counted_eigenbasis(factor):
        decomposed.append(id(factor))
        return original_eigenbasis(factor)
    dykaf_maths.refresh_basis = counted
    dykaf_maths.eigenbasis = counted_eigenbasis
    two_ranks.count_collectives(("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor",
                                 "all_gather_single"))
    world_group = dist.group.WORLD
    for name, case in CASES.items():
        out: dict = {"error": None}
        try:
            params = make_params(case)
            opt = make_optimizer(params, case, world_group)
            out["params"], out["refreshed"], out["decomposed"], out["calls"] = [], [], [], []
            for step in range(STEPS + MORE):
                if step == STEPS:  # a checkpoint round trip into a fresh optimizer, then on
                    out["state_dict"] = copy.deepcopy(opt.state_dict())
                    opt = make_optimizer(params, case, world_group)
                    opt.load_state_dict(out["state_dict"])
                set_grads(params, step)
                refreshed.clear()
                decomposed.clear()
                two_ranks.CALLS.clear()
                opt.step()
                modes = factor_modes(opt, params)
                out["refreshed"].append(sorted(modes[f] for f in refreshed))
                out["decomposed"].append(sorted(modes[f] for f in decomposed))
                out["calls"].append(list(two_ranks.CALLS))
                out["params"].append(snapshot(params))
        except Exception:
            out["error"] = traceback.format_exc()
        torch.save(out, os.path.join(outdir, f"{name}_rank{rank}.pt"))

    out = {"error": None}  # a first eigendecomposition that fails on its owner
    try:
        import warnings
        case = CASES["float64-fused"]
        params = make_params(case)
        opt = make_optimizer(params, case, world_group)

        def failing(factor):
            if factor.shape[0] == 7:  # the (7, 4) matrix's left factor
                raise torch.linalg.LinAlgError("made to fail")
            return original_eigenbasis(factor)
        dykaf_maths.eigenbasis = failing
        out["started"] = []
        for step in range(2):
            set_grads(params, step)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            out["started"].append(["step" in opt.state[p] for p in params])
            out.setdefault("warnings", [str(w.message) for w in caught])
            dykaf_maths.eigenbasis = counted_eigenbasis
        out["dropped"] = opt.skipped_factor_updates
    except Exception:
        out["error"] = traceback.format_exc()
    dykaf_maths.eigenbasis = counted_eigenbasis
    torch.save(out, os.path.join(outdir, f"drop_rank{rank}.pt"))

    out = {"error": None}  # FSDP2: sharing against no sharing, both sharded
    try:
        from torch.distributed.fsdp import fully_shard
        runs = {}
        for key, group in (("none", None), ("world", world_group)):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
            fully_shard(model[0])
            fully_shard(model[2])
            fully_shard(model)
            opt = cafin.DyKAF(model.parameters(), lr=0.05, precondition_frequency=FREQ, process_group=group)
            counts = []
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(10 * step + rank)
                x = torch.randn(4, 6, generator=gen, dtype=torch.float64)
                model.zero_grad()
                model(x).square().mean().backward()
                refreshed.clear()
                opt.step()
                counts.append(len(refreshed))
            runs[key] = dict(params=two_ranks.full_params(model), refreshed=counts)
        out["fsdp"] = runs
    except Exception:
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(outdir, f"fsdp_rank{rank}.pt"))

    errors = {}  # bad arguments, with torch.distributed up
    for key, bad in (("type", lambda: "world"), ("member", lambda: dist.new_group([0]))):
        group = bad()  # every rank makes every group
        try:
            cafin.DyKAF([torch.zeros(2, 2, requires_grad=True)], process_group=group)
            errors[key] = None
        except (TypeError, ValueError) as e:
            errors[key] = (type(e).__name__, str(e))
    torch.save(errors, os.path.join(outdir, f"errors_rank{rank}.pt"))
    two_ranks.leave()


_LAUNCH: list = []


def results(name: str, tmp_path_factory) -> list:
    if not _LAUNCH:
        outdir = tmp_path_factory.mktemp("dykaf_owners")
        failure = two_ranks.launch(lambda rank: [__file__, "--worker", outdir], outdir, 2)
        _LAUNCH.append((outdir, failure))
    outdir, failure = _LAUNCH[0]
    out = []
    for rank in range(2):
        path = outdir / f"{name}_rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote nothing for {name}: {failure}")
        r = torch.load(path, weights_only=False)
        assert not isinstance(r, dict) or r.get("error") is None, r["error"]
        out.append(r)
    return out


_ONE: dict = {}


def one_process(case: dict):
    """One process (cached per case), no sharing: every parameter refreshed here; the parameters after every step, the state
    dict after STEPS, and the factor modes (param index -> its modes' sizes)."""
    key = id(case)
    if key in _ONE:
        return _ONE[key]
    params = make_params(case)
    opt = make_optimizer(params, case)
    history, sd = [], None
    for step in range(STEPS + MORE):
        if step == STEPS:
            sd = copy.deepcopy(opt.state_dict())  # its tensors are the live state's
        set_grads(params, step)
        opt.step()
        history.append(snapshot(params))
    dims = {i: [f.shape[0] for f in opt.state[p]["factors"] if f is not None] for i, p in enumerate(params)}
    modes = {i: [k for k, f in enumerate(opt.state[p]["factors"]) if f is not None] for i, p in enumerate(params)}
    _ONE[key] = history, sd, dims, modes
    return _ONE[key]


def owners(dims, modes) -> dict[tuple[int, int], int]:
    """(parameter index, mode) -> its owner: the greedy rule, each basis weighed d^3."""
    work = {(i, k): {"refresh": float(d ** 3)} for i in dims for k, d in zip(modes[i], dims[i])}
    return {m: a["refresh"] for m, a in greedy_assignment(work, [[0, 1]], 2, colocate=False).items()}


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process(name, tmp_path_factory):
    ranks = results(name, tmp_path_factory)
    want, _, _, _ = one_process(CASES[name])
    tol = 1e-10 if name.startswith("float64") else 1e-6
    for step in range(STEPS + MORE):
        for a, b in zip(ranks[0]["params"][step], ranks[1]["params"][step]):
            assert torch.equal(a, b), step  # the ranks stay bit-identical
        for i, (got, w) in enumerate(zip(ranks[0]["params"][step], want[step])):
            assert got.dtype == w.dtype
            assert close(got, w) <= tol, (step, i, close(got, w))
        if step >= 1:  # the updates moved the weights: a test that can fail
            assert any(not torch.equal(a, b) for a, b in zip(want[step], want[step - 1]))


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_refreshes_its_share(name, tmp_path_factory):
    ranks = results(name, tmp_path_factory)
    _, _, dims, modes = one_process(CASES[name])
    every = sorted((i, k) for i, ks in modes.items() for k in ks)
    owner = owners(dims, modes)
    assert set(owner.values()) == {0, 1}
    # the most expensive basis (the merged conv kernel's 12 x 12) alone on rank 0, the rest on 1
    assert [m for m, r in owner.items() if r == 0] == [(4, 0)]
    for step in range(STEPS + MORE):
        due = step >= 1 and step % FREQ == 0
        shares = [r["refreshed"][step] for r in ranks]
        if not due:
            assert shares == [[], []], step
            continue
        assert sorted(shares[0] + shares[1]) == every  # every factor once
        for rank, share in enumerate(shares):
            assert share == sorted(m for m in every if owner[m] == rank), (step, rank)


@pytest.mark.parametrize("name", list(CASES))
def test_first_eigendecompositions_run_on_their_owners_only(name, tmp_path_factory):
    """The first step decomposes every basis once over the two ranks, each on its owner (the
    rule of the refreshes); the fresh optimizer after the checkpoint decomposes nothing."""
    ranks = results(name, tmp_path_factory)
    _, _, dims, modes = one_process(CASES[name])
    every = sorted((i, k) for i, ks in modes.items() for k in ks)
    owner = owners(dims, modes)
    first = [r["decomposed"][0] for r in ranks]
    assert sorted(first[0] + first[1]) == every
    for rank, share in enumerate(first):
        assert share == sorted(m for m in every if owner[m] == rank), rank
    for step in range(1, STEPS + MORE):
        assert [r["decomposed"][step] for r in ranks] == [[], []], step


@pytest.mark.parametrize("name", list(CASES))
def test_one_exchange_per_dtype_on_refresh_steps(name, tmp_path_factory):
    ranks = results(name, tmp_path_factory)
    _, _, dims, modes = one_process(CASES[name])
    case = CASES[name]
    owner = owners(dims, modes)
    expected = {"refresh": [], "first": []}  # per dtype, the larger share's elements
    for dtype in dict.fromkeys(dtype_of(case, i) for i in sorted(dims) if dims[i]):
        # a refresh sends each basis, d^2, with its order, d; a first step each basis and a flag
        for key, extra in (("refresh", lambda d: d), ("first", lambda d: 1)):
            shares = [sum(d * d + extra(d) for i in dims for k, d in zip(modes[i], dims[i])
                          if owner[i, k] == r and dtype_of(case, i) == dtype)
                      for r in range(2)]
            expected[key].append(("all_gather", max(shares), str(dtype).replace("torch.", "")))
    for r in ranks:
        for step in range(STEPS + MORE):
            due = step >= 1 and step % FREQ == 0
            want = expected["refresh"] if due else expected["first"] if step == 0 else []
            assert r["calls"][step] == want, (step, r["calls"][step])
    assert len(expected["refresh"]) == (2 if name == "float32-mixed" else 1)


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_is_every_ranks_and_one_process(name, tmp_path_factory):
    ranks = results(name, tmp_path_factory)
    _, want, _, _ = one_process(CASES[name])
    tol = 1e-10 if name.startswith("float64") else 1e-6
    a, b = ranks[0]["state_dict"], ranks[1]["state_dict"]
    assert a["param_groups"] == b["param_groups"] == want["param_groups"]
    assert a["state"].keys() == b["state"].keys() == want["state"].keys()
    for index in want["state"]:
        for key, w in want["state"][index].items():
            x, y = a["state"][index][key], b["state"][index][key]
            for xs, ys, ws in zip(*(v if isinstance(v, list) else [v] for v in (x, y, w))):
                if isinstance(ws, torch.Tensor):
                    assert torch.equal(xs, ys), (index, key)
                    assert close(xs, ws) <= tol, (index, key)
                else:
                    assert xs == ys == ws, (index, key)
    # the bases were refreshed (steps 2 and 4) on one rank and copied: both sides have them all
    assert any(any(q is not None for q in st["bases"]) for st in a["state"].values())


def test_failed_first_eigendecomposition_drops_the_gradient_on_every_rank(tmp_path_factory):
    """An eigendecomposition that fails on its owner (the 7 x 7 factor's: rank 1's) drops that
    parameter's first gradient on both ranks, with the warning; the others start; the next
    step starts it."""
    ranks = results("drop", tmp_path_factory)
    for r in ranks:
        assert r["started"][0] == [i != 3 for i in range(len(SHAPES))]
        assert r["started"][1] == [True] * len(SHAPES)
        assert r["dropped"] == 1
        assert any("(7, 4)" in w and "eigendecomposition failed" in w for w in r["warnings"]), r["warnings"]


def test_fsdp2_sharing_gives_the_numbers_of_no_sharing(tmp_path_factory):
    ranks = results("fsdp", tmp_path_factory)
    for r in ranks:
        for got, want in zip(r["fsdp"]["world"]["params"], r["fsdp"]["none"]["params"]):
            assert close(got, want) <= 1e-10
    for step in range(STEPS):
        alone = [r["fsdp"]["none"]["refreshed"][step] for r in ranks]
        shared = [r["fsdp"]["world"]["refreshed"][step] for r in ranks]
        assert alone[0] == alone[1]  # without sharing each rank refreshes everything
        assert sum(shared) == alone[0] and (alone[0] == 0 or min(shared) > 0), step
    assert max(ranks[0]["fsdp"]["none"]["refreshed"]) == 4  # two matrices, two modes each


def test_bad_process_group_is_refused(tmp_path_factory):
    results("float64-fused", tmp_path_factory)
    outdir, _ = _LAUNCH[0]
    for rank in range(2):
        errors = torch.load(outdir / f"errors_rank{rank}.pt")
        assert errors["type"][0] == "TypeError" and "process_group" in errors["type"][1]
        if rank == 1:  # a group of rank 0 only
            assert errors["member"][0] == "ValueError" and "process_group" in errors["member"][1]
        else:
            assert errors["member"] is None


def test_process_group_without_torch_distributed_is_refused():
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="process_group.*not initialised"):
        cafin.DyKAF([torch.zeros(2, 2, requires_grad=True)], process_group=object())


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])
