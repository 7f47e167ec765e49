"""HSDP (a replicate x shard mesh) and DCP checkpoints that load at another world size.

Four CPU/gloo launches of tests/hsdp_worker.py (float64 unless said; the model of
tests/fsdp_worker.py, whose 7-, 3- and 1-row layers shard unevenly):
1. 2 ranks, FSDP: every member trains a few steps and saves a DCP checkpoint;
2. 4 ranks: every member, float64 and float32, trains under HSDP on a 2 x 2 mesh and under DDP on
   the same per-rank batches (the HSDP run saves a checkpoint on the way); then a 4-rank FSDP run
   loads launch 1's checkpoint (2 -> 4);
3. 2 ranks load launch 2's HSDP checkpoint (4 -> 2) and, beside it, 1 rank loads launch 1's
   (2 -> 1).
The tests assert that HSDP trains as DDP (parameters, factors, the collectives and their groups;
the groups of an HSDP mesh sliced from a bigger one),
that the state a resharded run loads is the saved one bit for bit (and what happens to each
rank's own entries), and that its next step equals the step of a DDP run that loaded the same
checkpoint.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import fsdp_worker as W
import two_ranks
from test_fsdp import ALL_GATHER, COARSE, EVERY, FACTORS, GATHER, OWNERS, TCOV, owner_exchange, rel

WORKER = Path(__file__).with_name("hsdp_worker.py")
TOL = {"float64": 1e-10, "float32": 1e-5}
CASES = [pytest.param(m, d, id=f"{m}-{d}") for m in W.MEMBERS for d in W.DTYPES]
HOPS = [(2, 4), (4, 2), (2, 1)]
RESHARD = [pytest.param(m, a, b, id=f"{m}-{a}to{b}") for m in W.MEMBERS for a, b in HOPS]

_LAUNCH: dict = {}


def _launch(outdir: Path, world: int, load: str, save: str, hsdp: str) -> str | None:
    logs = outdir / f"w{world}-load{load}"  # hsdp_worker meets there too
    logs.mkdir()
    return two_ranks.launch(lambda rank: [WORKER, outdir, load, save, hsdp], logs, world)


def outdir(tmp_path_factory) -> Path:
    if "out" not in _LAUNCH:
        out = tmp_path_factory.mktemp("hsdp")
        start = time.monotonic()
        failures = [_launch(out, 2, "", "2", ""), _launch(out, 4, "2", "", "hsdp")]
        with ThreadPoolExecutor(2) as pool:  # independent: 4 -> 2 and 2 -> 1
            failures += list(pool.map(lambda args: _launch(out, *args), [(2, "4", "", ""), (1, "2", "", "")]))
        _LAUNCH["out"], _LAUNCH["failure"] = out, "\n".join(f for f in failures if f)
        print(f"\n[hsdp and resharding: 4 launches in {time.monotonic() - start:.1f} s]")
    return _LAUNCH["out"]


def load(tmp_path_factory, name: str, world: int) -> list[dict]:
    out = outdir(tmp_path_factory)
    results = []
    for rank in range(world):
        path = out / f"{name}_rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no {name}\n{_LAUNCH['failure']}")
        r = torch.load(path, weights_only=False)
        if isinstance(r, dict) and r.get("error"):
            pytest.fail(f"rank {rank} failed in {name}:\n{r['error']}\n{_LAUNCH['failure']}")
        results.append(r)
    return results


# ------------------------------------------------------------------------------ HSDP
@pytest.mark.parametrize("member, dtype", CASES)
def test_hsdp_trains_as_ddp(member, dtype, tmp_path_factory):
    """Against DDP whose communication hook sums the gradients in HSDP's order (within the shard
    pairs, then across the replicas): float32 then compares cafin, not the rounding of the sum."""
    initial = [p.detach() for p in W.make_model(W.DTYPES[dtype]).parameters()]
    for rank, r in enumerate(load(tmp_path_factory, f"{member}-{dtype}-hsdp", 4)):
        assert set(r["placements"]) == {"(Replicate(), Shard(dim=0))"}
        assert len(r["hsdp"]) == len(r["ddp"]) == len(initial)
        for i, (h, d, p0) in enumerate(zip(r["hsdp"], r["ddp"], initial)):
            assert h.shape == d.shape == p0.shape
            assert rel(d, p0) > 1e-6, f"parameter {i} did not move: the comparison would be empty"
            assert rel(h, d) <= TOL[dtype], f"rank {rank}, parameter {i}: {rel(h, d):.3g}"


@pytest.mark.parametrize("member", list(W.MEMBERS))
def test_hsdp_float64_equals_ddp_in_its_own_reduction_order(member, tmp_path_factory):
    """The reference above sums the gradients in HSDP's order; plain DDP sums the four ranks'
    in its own, which changes the last bits only: float64 stays within 1e-10 (DyKAF 1e-9: its
    factor split divides by its factors' norms and its refreshes re-orthogonalise the bases, so
    those last bits grow over the steps; measured 1.1e-10)."""
    tol = 1e-9 if member == "DyKAF" else TOL["float64"]
    for rank, r in enumerate(load(tmp_path_factory, f"{member}-float64-hsdp", 4)):
        for i, (h, d) in enumerate(zip(r["hsdp"], r["ddp_plain"])):
            assert rel(h, d) <= tol, f"rank {rank}, parameter {i}: {rel(h, d):.3g}"


@pytest.mark.parametrize("member, dtype", [c for c in CASES if c.values[0] != "DyKAF"])
def test_hsdp_factors_equal_ddp(member, dtype, tmp_path_factory):
    """Statistics are averaged over all four ranks (every rank's batch), as under DDP."""
    for rank, r in enumerate(load(tmp_path_factory, f"{member}-{dtype}-hsdp", 4)):
        assert len(r["hsdp_factors"]) == len(r["ddp_factors"]) > 0
        for i, (h, d) in enumerate(zip(r["hsdp_factors"], r["ddp_factors"])):
            assert h.shape == d.shape
            assert rel(h, d) <= TOL[dtype], f"rank {rank}, factor {i}: {rel(h, d):.3g}"


# K-FAC's KAISA groups on 4 ranks: COMM_OPT shares over the world, grad_worker_fraction 0.5
# (HYBRID_OPT) within groups of 2; K-FAC decomposes every 2 steps. Two-level shares its owners'
# decompositions over the 4 ranks on its inverse steps (every 2).
KAISA_GROUP = {"KFAC": 4, "KFAC-mem": 2, "TwoLevel-nicolaides": 4, "TwoLevel-residual": 4}
# The gradient owners within each shard group (shard index): K-FAC's at the shard coordinate of
# each layer's inverse worker on 4 ranks (the Linear(48, 7) on rank 0, Conv2d on 1, Linear(7, 3)
# on 2, Linear(3, 1) on 3; HYBRID_OPT's columns {0, 2} and {1, 3} meet every shard group there);
# SINGD's by cost over the 2 shard ranks, as under FSDP.
HSDP_OWNERS = {**OWNERS, "KFAC": {"4": 0, "0": 1, "7": 0, "9": 1},
               "KFAC-mem": {"4": 0, "0": 1, "7": 1, "9": 1}}


@pytest.mark.parametrize("member, dtype", CASES)
def test_hsdp_communication_per_step(member, dtype, tmp_path_factory):
    """The factor average over the whole world (4 ranks); the gradients to their owners and back
    (or the gradient gather) within the shard group (2 ranks: the same shards, so the same
    elements, as FSDP on 2 ranks)."""
    tcov = TCOV.get(member, W.TCOV)
    for rank, r in enumerate(load(tmp_path_factory, f"{member}-{dtype}-hsdp", 4)):
        assert r["owners"] == HSDP_OWNERS.get(member), f"rank {rank}"
        assert len(r["calls"]) == W.STEPS
        shared_by_step = []
        for k, calls in enumerate(r["calls"]):
            # K-FAC's KAISA exchanges (second-order data on inverse steps; HYBRID_OPT also the
            # preconditioned gradients on every step) go over its own groups
            shared = sorted(c for c in calls if c[0] in ("broadcast", "all_gather"))
            calls = [c for c in calls if c[0] not in ("broadcast", "all_gather")]
            if member in KAISA_GROUP:
                assert all(c[3] == KAISA_GROUP[member] for c in shared), f"step {k}: {shared}"
                assert bool(shared) == (k % 2 == 0), f"step {k}: {shared}"
            else:
                assert not shared, f"step {k}: {shared}"
            shared_by_step.append(shared)
            expected = []
            if member in FACTORS and k % tcov == 0:
                expected.append(("all_reduce", FACTORS[member], dtype, 4))
            if member in COARSE and k % tcov == 0:
                expected.append(("all_reduce", COARSE[member], dtype, 4))
            if member in EVERY:
                expected.append(("all_reduce", EVERY[member], dtype, 4))
            if member in GATHER:
                expected.append(("all_gather_single", GATHER[member], dtype, 2))
            if member in HSDP_OWNERS:  # to the owners and back, within the shard group
                expected += [("all_to_all_single", sent, dtype, 2)
                             for sent, _ in owner_exchange(HSDP_OWNERS[member], rank % 2)]
            if member in HSDP_OWNERS and member.startswith("KFAC"):  # the KL clip's sum
                expected.append(("all_reduce", 1, dtype, 2))
            assert sorted(calls) == sorted(expected), f"step {k}: {calls}"
        # the same exchanges on every inverse step, and on every other step
        assert shared_by_step[0::2] == [shared_by_step[0]] * len(shared_by_step[0::2])
        assert shared_by_step[1::2] == [shared_by_step[1]] * len(shared_by_step[1::2])


def test_hsdp_mem_opt_gathers_every_gradient(tmp_path_factory):
    """K-FAC with MEM_OPT on the 2 x 2 mesh: each layer's only gradient worker is in one shard
    group, so the other has no owner for it; every rank all-gathers the sharded gradients within
    its shard group (as before the owner scheme) and trains as DDP."""
    for rank, r in enumerate(load(tmp_path_factory, "KFAC-memopt-float64-hsdp", 4)):
        assert r["owners"] is None
        for i, (h, d) in enumerate(zip(r["hsdp"], r["ddp"])):
            assert rel(h, d) <= TOL["float64"], f"rank {rank}, parameter {i}: {rel(h, d):.3g}"
        for k, calls in enumerate(r["calls"]):
            assert ("all_gather_single", ALL_GATHER, "float64", 2) in calls, f"step {k}"
            assert not [c for c in calls if c[0] == "all_to_all_single"], f"step {k}: {calls}"


# ------------------------------------------------------------------------------ resharding
def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("member, saved_world, world", RESHARD)
def test_resharded_checkpoint_loads_the_saved_state(member, saved_world, world, tmp_path_factory):
    saved = load(tmp_path_factory, f"{member}-save{saved_world}", saved_world)
    loaded = load(tmp_path_factory, f"{member}-load{saved_world}to{world}", world)
    shared = saved[0]["shared"]
    assert any(k.startswith("optim.") for k in shared), "no optimizer state: the comparison would be empty"
    for rank, r in enumerate(loaded):
        assert sorted(r["loaded"]) == sorted(shared), f"rank {rank}"
        for key, value in shared.items():
            assert _same(r["loaded"][key], value), f"rank {rank}: {key}"
        own = r["loaded_own"]
        # BatchNorm buffers (each rank's own under FSDP2): DCP writes a plain tensor once, one
        # saved rank's copy (DCP picks the rank per tensor), and every rank loads that copy.
        buffers = [k for k in own if k.startswith("buffer.")]
        assert buffers
        for key in buffers:
            assert any(torch.equal(own[key], s["own"][key]) for s in saved), f"rank {rank}: {key}"
            assert torch.equal(own[key], loaded[0]["loaded_own"][key]), f"rank {rank}: {key}"
        differ = [k for k in buffers if "running" in k and not torch.equal(saved[0]["own"][k], saved[-1]["own"][k])]
        assert differ, "the saved ranks' running statistics are equal: the check would be empty"
        # two-level's per-sample statistics: rank r reads saved rank r mod W's
        stats = [k for k in own if k.startswith("pre.")]
        assert bool(stats) == member.startswith("TwoLevel")
        for key in stats:
            assert torch.equal(own[key], saved[rank % saved_world]["own"][key]), f"rank {rank}: {key}"


@pytest.mark.parametrize("member, saved_world, world", RESHARD)
def test_step_after_resharding_equals_ddp(member, saved_world, world, tmp_path_factory):
    """The next step of the resharded FSDP run equals that of a DDP run of the same world size
    that loaded the same checkpoint."""
    for rank, r in enumerate(load(tmp_path_factory, f"{member}-load{saved_world}to{world}", world)):
        params = [v for k, v in r["loaded"].items() if k.startswith("param.")]
        assert len(r["stepped"]) == len(r["reference"]) == len(params)
        for i, (s, d, p0) in enumerate(zip(r["stepped"], r["reference"], params)):
            assert rel(d, p0) > 1e-8, f"parameter {i} did not move: the comparison would be empty"
            assert rel(s, d) <= TOL["float64"], f"rank {rank}, parameter {i}: {rel(s, d):.3g}"


def test_hsdp_mesh_that_does_not_span_the_world(tmp_path_factory):
    """The (1 x 2) replicate x shard slice of a (2, 1, 2) mesh: statistics are averaged over the
    slice's ranks only, rows split over its shard dimension."""
    for rank, r in enumerate(load(tmp_path_factory, "submesh", 4)):
        assert r["group"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert set(r["placements"]) == {"(Replicate(), Shard(dim=0))"}
        # Conv2d weight and bias (3 rows), ..., Linear(48, 7) weight (7 rows), ..., Linear(3, 1)
        first = rank % 2 == 0
        assert r["rows"][0] == ((0, 2) if first else (2, 3))
        assert r["rows"][4] == ((0, 4) if first else (4, 7))
        assert r["rows"][-1] == ((0, 1) if first else (1, 1))
