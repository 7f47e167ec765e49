"""FSDP2 (`fully_shard`): every member trains a sharded model as it trains under DDP.

One launch of two CPU/gloo processes (tests/fsdp_worker.py) runs every member in float64 and
float32 on a model of Conv2d, BatchNorm2d, LayerNorm and Linear layers whose dim 0 shards
unevenly (7 rows: 4 + 3; 3 rows: 2 + 1; 1 row: 1 + an empty shard), and the tests assert on what
it wrote:
- the FSDP2 run's full parameters equal the DDP run's on the same per-rank batches (float64 within
  1e-10 relative, float32 within 1e-5), after the parameters moved;
- the collectives of each step() under FSDP2: exactly the member's documented ones (the factor
  average, one all_reduce per curvature update; for members that multiply whole gradient
  matrices, the gradients to their owners and the rows back, one all_to_all each per step (K-FAC,
  SINGD), or one all_gather per step (the others); K-FAC's shared decompositions, one all_gather
  per inverse step), with the element counts of docs/distributed.md;
- under the owner scheme, the elements each rank receives: the other rank's rows of the layers it
  owns, and its own rows of the others' (no rank receives a gradient it does not own);
- a torch.distributed.checkpoint round trip (get/set_optimizer_state_dict, dcp.save/load) resumes
  bit-identically on each rank's shard;
- the float64 checkpoint of the 2-rank run, loaded on one rank (a second launch) with the recipe
  of docs/distributed.md, gives the step the 2 ranks took after it (on both ranks' batches), and
  K-FAC's and two-level K-FAC's own state dicts, as plain templates, are refused.
"""
from __future__ import annotations

import time
from pathlib import Path

import math

import pytest
import torch

import fsdp_worker as W
import two_ranks

WORKER = Path(__file__).with_name("fsdp_worker.py")
TOL = {"float64": 1e-10, "float32": 1e-5}
CASES = [pytest.param(m, d, id=f"{m}-{d}") for m in W.MEMBERS for d in W.DTYPES]

# Elements each rank sends per step under FSDP2 (the test model, 2 ranks): the factor average
# (all_reduce of every factor, on curvature updates) and the gradient gather (all_gather of each
# rank's padded shard of every preconditioned layer's gradient, every step).
# AdaFisher: len(S) + len(H) per layer: Conv2d 3 + 19, BatchNorm2d 3 + 2, Linear(48, 7) 7 + 49,
# LayerNorm 7 + 2, Linear(7, 3) 3 + 8, Linear(3, 1) 1 + 4.
ADAFISHER = (3 + 19) + (3 + 2) + (7 + 49) + (7 + 2) + (3 + 8) + (1 + 4)
FACTORS = {"AdaFisher": ADAFISHER, "AdaFisherW": ADAFISHER, "AdaFisher-reference": ADAFISHER}
GATHER = {}
# K-FAC, factors A and G of conv (19^2, 3^2), Linear(48, 7) (49^2, 7^2), Linear(7, 3) (8^2, 3^2),
# Linear(3, 1) (4^2, 1^2); padded gradient shards: 2*(18+1) + 4*(48+1) + 2*(7+1) + 1*(3+1).
FACTORS["KFAC"] = 19**2 + 3**2 + 49**2 + 7**2 + 8**2 + 3**2 + 4**2 + 1
ALL_GATHER = 2 * 19 + 4 * 49 + 2 * 8 + 1 * 4
# DyKAF: no factor average (every rank computes the same factors from the same full gradients);
# the gather holds every parameter's gradient, BatchNorm2d's and LayerNorm's too.
GATHER["DyKAF"] = ALL_GATHER + 2 * 2 + 2 * 4
# SINGD: the H terms are averaged on its T steps (dense: d_K^2 + d_C^2 per layer, as K-FAC's
# factors; diagonal and Toeplitz: d_K + d_C); the structures that multiply whole gradient
# matrices send them to owners every step as K-FAC does, the diagonal one reads its own rows and
# moves no gradient.
FACTORS["SINGD-dense"] = FACTORS["KFAC"]
FACTORS["SINGD-diagonal"] = FACTORS["SINGD-toeplitz"] = (19 + 3) + (49 + 7) + (8 + 3) + (4 + 1)
# TwoLevelKFAC: the factors as K-FAC's; the nicolaides coarse matrix (4 layers: 4 x 4) rides
# in the factors' all_reduce (its coarse vectors are ones), the residual one needs the averaged
# factors' inverse first, so it is a second all_reduce on curvature steps, and the residual
# vectors read the Fisher product of the whole batch every step: one all_reduce of every
# layer's [d_out, d_in + 1] block, 3 * 19 + 7 * 49 + 3 * 8 + 1 * 4. Both gather as K-FAC does.
FACTORS["TwoLevel-nicolaides"] = FACTORS["KFAC"] + 4 * 4
FACTORS["TwoLevel-residual"] = FACTORS["KFAC"]
COARSE = {"TwoLevel-residual": 4 * 4}  # a second all_reduce on curvature steps
EVERY = {"TwoLevel-residual": 3 * 19 + 7 * 49 + 3 * 8 + 1 * 4}  # an all_reduce every step
GATHER["TwoLevel-nicolaides"] = GATHER["TwoLevel-residual"] = ALL_GATHER
TCOV = {"KFAC": 1}  # factor updates every step; the others every W.TCOV steps
# K-FAC (KAISA, COMM_OPT): on its inverse steps (every 2nd) each rank decomposes its share and one
# all_gather shares the results (eigenbases, 1/(d_G d_A^T + damping), two flags per layer), padded
# to the larger share: the Linear(48, 7) on rank 0 (49^2 + 7^2 + 7 * 49 + 2), the rest on rank 1.
SECOND_ORDER = {"KFAC": (2, 49**2 + 7**2 + 7 * 49 + 2)}
# MEM_OPT: the Linear(48, 7) on one rank, the other layers on the other; every layer is sharded,
# so its owner (its only gradient worker) sends the preconditioned rows back and no preconditioned
# gradient is all-gathered; on inverse steps one all_gather of the decomposed flags (float32, one
# per layer, padded to the larger share: 3).
FACTORS["KFAC-mem"] = FACTORS["KFAC"]
TCOV["KFAC-mem"] = 1
FLAGS = {"KFAC-mem": (2, 3)}

# The owner scheme (K-FAC, SINGD's non-diagonal structures): each layer's gradient goes to one
# owner rank and the rows come back, one all_to_all each way per step. The owners: K-FAC's KAISA
# inverse workers (by decomposition cost: the Linear(48, 7) alone on one rank), SINGD's by the
# cost of the natural gradient (the same split).
OWNERS = {"KFAC": {"4": 0, "0": 1, "7": 1, "9": 1}, "KFAC-mem": {"4": 1, "0": 0, "7": 0, "9": 0},
          "SINGD-dense": {"4": 0, "0": 1, "7": 1, "9": 1}, "SINGD-toeplitz": {"4": 0, "0": 1, "7": 1, "9": 1}}
# the gradient shapes of the layers (Sequential index) that the owner scheme moves
SHAPES = {"0": [(3, 2, 3, 3), (3,)], "4": [(7, 48), (7,)], "7": [(3, 7), (3,)], "9": [(1, 3), (1,)]}


def own_numel(shape, rank: int) -> int:
    """Elements of a gradient of `shape` in the shard of `rank` (torch.chunk rows over W.WORLD)."""
    from cafin.core.distribution.sharding import shard_rows
    start, stop = shard_rows(shape[0], W.WORLD, rank)
    return (stop - start) * math.prod(shape[1:])


def owner_exchange(owners: dict[str, int], rank: int) -> list[tuple[int, int]]:
    """(elements sent, elements received from the other rank) of `rank`'s two all_to_alls: its
    rows of every gradient to their owners, then the owned gradients' rows back."""
    shapes = [(s, owner) for name, owner in owners.items() for s in SHAPES[name]]
    to_owners = (sum(own_numel(s, rank) for s, _ in shapes),
                 sum(math.prod(s) - own_numel(s, rank) for s, owner in shapes if owner == rank))
    back = (sum(math.prod(s) for s, owner in shapes if owner == rank),
            sum(own_numel(s, rank) for s, owner in shapes if owner != rank))
    return [to_owners, back]
# TwoLevelKFAC: each factor's eigendecomposition and the coarse inverse on one owner rank (the
# Linear(48, 7)'s A, 49^3, outweighs the rest: rank 0's alone); on its inverse steps (its curvature
# steps) one all_gather padded to that share (eigenvalues, eigenvectors, a flag: 49 + 49^2 + 1),
# the nicolaides coarse inverse inside it; the residual one is known after it only: a second.
OWNED = {"TwoLevel-nicolaides": [49 + 49**2 + 1], "TwoLevel-residual": [49 + 49**2 + 1, 4 * 4]}


_LAUNCH: dict = {}


def results(member: str, dtype: str, tmp_path_factory) -> list[dict]:
    if "out" not in _LAUNCH:
        outdir = tmp_path_factory.mktemp("fsdp")
        start = time.monotonic()
        _LAUNCH["failure"] = two_ranks.launch(lambda rank: [WORKER, outdir], outdir, W.WORLD)
        _LAUNCH["out"] = outdir
        print(f"\n[fsdp: 2 ranks in {time.monotonic() - start:.1f} s]")
    outdir, failure = _LAUNCH["out"], _LAUNCH["failure"]
    out = []
    for rank in range(W.WORLD):
        path = outdir / f"{member}-{dtype}_rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no result for {member}-{dtype}\n{failure}")
        r = torch.load(path, weights_only=False)
        if r.get("error"):
            pytest.fail(f"rank {rank} failed in {member}-{dtype}:\n{r['error']}\n{failure}")
        out.append(r)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


@pytest.mark.parametrize("member, dtype", CASES)
def test_fully_shard_trains_as_ddp(member, dtype, tmp_path_factory):
    initial = [p.detach() for p in W.make_model(W.DTYPES[dtype]).parameters()]
    for rank, r in enumerate(results(member, dtype, tmp_path_factory)):
        assert len(r["fsdp"]) == len(r["ddp"]) == len(initial)
        for i, (f, d, p0) in enumerate(zip(r["fsdp"], r["ddp"], initial)):
            assert f.shape == d.shape == p0.shape
            assert rel(d, p0) > 1e-6, f"parameter {i} did not move: the comparison would be empty"
            assert rel(f, d) <= TOL[dtype], f"rank {rank}, parameter {i}: {rel(f, d):.3g}"


@pytest.mark.parametrize("member, dtype", [c for c in CASES if c.values[0] != "DyKAF"])
def test_factors_equal_ddp(member, dtype, tmp_path_factory):
    """The hooks see the unsharded module call: each rank's statistics, and the averaged factors,
    are DDP's."""
    for rank, r in enumerate(results(member, dtype, tmp_path_factory)):
        assert len(r["fsdp_factors"]) == len(r["ddp_factors"]) > 0
        for i, (f, d) in enumerate(zip(r["fsdp_factors"], r["ddp_factors"])):
            assert f.shape == d.shape
            assert rel(f, d) <= TOL[dtype], f"rank {rank}, factor {i}: {rel(f, d):.3g}"


@pytest.mark.parametrize("member, dtype", CASES)
def test_communication_per_step(member, dtype, tmp_path_factory):
    """Inside step(): the factor average on curvature steps, the gradients to their owners and
    back (or the gradient gather) every step (and the two-level coarse spaces' own all_reduces,
    as under DDP)."""
    tcov = TCOV.get(member, W.TCOV)
    for rank, r in enumerate(results(member, dtype, tmp_path_factory)):
        assert len(r["calls"]) == W.STEPS
        for k, calls in enumerate(r["calls"]):
            expected = []
            if member in FACTORS and k % tcov == 0:
                expected.append(("all_reduce", FACTORS[member], dtype))
            if member in COARSE and k % tcov == 0:
                expected.append(("all_reduce", COARSE[member], dtype))
            if member in EVERY:
                expected.append(("all_reduce", EVERY[member], dtype))
            if member in GATHER:
                expected.append(("all_gather_single", GATHER[member], dtype))
            if member in OWNERS:
                exchange = owner_exchange(OWNERS[member], rank)
                expected += [("all_to_all_single", sent, dtype) for sent, _ in exchange]
            if member in OWNERS and member.startswith("KFAC"):  # the KL clip's sum over the owners
                expected.append(("all_reduce", 1, dtype))
            if member in SECOND_ORDER and k % SECOND_ORDER[member][0] == 0:
                expected.append(("all_gather", SECOND_ORDER[member][1], dtype))
            if member in OWNED and k % tcov == 0:
                expected += [("all_gather", n, dtype) for n in OWNED[member]]
            if member in FLAGS and k % FLAGS[member][0] == 0:
                expected.append(("all_gather", FLAGS[member][1], "float32"))
            assert sorted(calls) == sorted(expected), f"rank {rank}, step {k}: {calls}"


@pytest.mark.parametrize("member", list(OWNERS))
def test_owners_receive_only_the_gradients_they_own(member, tmp_path_factory):
    """Each layer has one owner, and both ranks own some; each step a rank receives the other
    rank's rows of the gradients it owns and its own rows of the others', no full gradient of a
    layer it does not own, and fewer elements than the all-gather of every padded shard."""
    for rank, r in enumerate(results(member, "float64", tmp_path_factory)):
        assert r["owners"] == OWNERS[member], f"rank {rank}"
        assert set(r["owners"].values()) == set(range(W.WORLD))
        exchange = owner_exchange(r["owners"], rank)
        for k, received in enumerate(r["received"]):
            moved = [n for name, n, _ in received if name == "all_to_all_single"]
            assert moved == [got for _, got in exchange], f"rank {rank}, step {k}: {received}"
            # the all_gathers left are KAISA's second-order data and flags, never a gradient
            assert not [c for c in received if c[0] in ("all_gather_single", "all_gather_into_tensor")]
            assert sum(moved) < (W.WORLD - 1) * ALL_GATHER, f"rank {rank}, step {k}"


@pytest.mark.parametrize("member, dtype", CASES)
def test_dcp_checkpoint_resumes_bit_identically(member, dtype, tmp_path_factory):
    for rank, r in enumerate(results(member, dtype, tmp_path_factory)):
        for i, (a, b) in enumerate(zip(r["fsdp_local"], r["resumed_local"])):
            assert torch.equal(a, b), f"rank {rank}, parameter {i} (local shard)"
        if rank == 1:  # the empty shard of Linear(3, 1) is on rank 1
            assert r["fsdp_local"][-2].numel() == 0


_ONE: dict = {}


def resumed_on_one_rank(member: str, tmp_path_factory) -> dict:
    """What tests/fsdp_worker.py --one wrote for `member` (one launch of one rank, after the
    2-rank launch)."""
    results(member, "float64", tmp_path_factory)
    if "failure" not in _ONE:
        logs = _LAUNCH["out"] / "one"
        logs.mkdir()
        _ONE["failure"] = two_ranks.launch(lambda rank: [WORKER, _LAUNCH["out"], "--one"], logs, 1)
    path = _LAUNCH["out"] / f"{member}-float64_one.pt"
    if not path.exists():
        pytest.fail(f"the 1-rank run wrote nothing for {member}\n{_ONE['failure']}")
    r = torch.load(path, weights_only=False)
    if r["error"]:
        pytest.fail(f"the 1-rank run failed in {member}:\n{r['error']}")
    return r


# Two-level K-FAC's residual coarse space reads each rank's per-sample statistics until the next
# T_cov step; one rank loads rank 0's (docs/distributed.md, resharding; tests/test_hsdp.py).
PER_RANK_STATISTICS = {"TwoLevel-residual"}


@pytest.mark.parametrize("member", [m for m in W.MEMBERS if m not in PER_RANK_STATISTICS])
def test_dcp_checkpoint_of_two_ranks_resumes_on_one_with_the_recipe(member, tmp_path_factory):
    """DyKAF resumed its state from the checkpoint, not from scratch (a fresh state took no step
    there: 0.33 off)."""
    uninterrupted = results(member, "float64", tmp_path_factory)[0]["next"]
    resumed = resumed_on_one_rank(member, tmp_path_factory)["next"]
    initial = [p.detach() for p in W.make_model(torch.float64, seed=5).parameters()]
    for i, (a, b, p0) in enumerate(zip(resumed, uninterrupted, initial)):
        assert rel(b, p0) > 1e-3  # the checkpoint's parameters are not the fresh model's
        assert rel(a, b) <= 1e-10, f"parameter {i}: {rel(a, b):.3g}"


@pytest.mark.parametrize("member", [m for m, w in W.MEMBERS.items() if w.optimizer_index])
def test_preconditioner_state_dict_as_dcp_template_is_refused(member, tmp_path_factory):
    """K-FAC's and two-level K-FAC's state dicts of a fresh preconditioner are no template for
    dcp.load: refused (DCP's error for K-FAC's None factors; two-level names its helpers), never
    loaded as a fresh state."""
    kind, message = resumed_on_one_rank(member, tmp_path_factory)["plain"]
    if member.startswith("KFAC"):
        assert "expected BytesStorageMetadata" in message, message
    else:
        assert kind == "RuntimeError" and "cafin.optim.twolevel.twolevel_checkpoint" in message, message


@pytest.mark.parametrize("member", list(W.REFUSED))
def test_members_that_cannot_shard_refuse_at_construction(member, tmp_path_factory):
    results(next(iter(W.MEMBERS)), "float64", tmp_path_factory)  # the launch
    for rank in range(W.WORLD):
        refused = torch.load(_LAUNCH["out"] / f"refused_rank{rank}.pt", weights_only=False)
        assert refused[member] is not None, f"{member} was constructed on a sharded model"
        kind, message = refused[member]
        assert kind == "ValueError" and ("FSDP2" in message or "1-D mesh" in message), refused[member]


_SEQUENCE_WORKER = r'''
import os, sys, torch
import torch.nn.functional as F
import cafin
import two_ranks
from test_singd_layers import sequence_model, sequence_batch
rank, _ = two_ranks.join(sys.argv[1])
results = {}
for fraction in (1.0, 0.5):
    for wrap in ("fsdp", "ddp"):
        model = sequence_model()
        net = two_ranks.wrap(model, wrap)
        pre = cafin.KFACPreconditioner(net, damping=0.01, lr=0.1, kl_clip=0.01, inv_dtype=torch.float64,
                                       decompose_dtype=torch.float64, grad_worker_fraction=fraction)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for k in range(3):
            x, y = sequence_batch(k)
            opt.zero_grad()
            F.mse_loss(net(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
            pre.step()
            opt.step()
        results[(fraction, wrap)] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                                     for p in model.parameters()]
        results[(fraction, wrap, "owners")] = pre._owners
        del opt, pre, net, model
if rank == 0:
    torch.save(results, os.path.join(sys.argv[1], "out.pt"))
two_ranks.leave()
'''


def test_kfac_owners_precondition_embedding_and_conv1d_rows_as_ddp(tmp_path):
    """K-FAC's owner scheme on layers whose sharded rows are not the gradient matrix's rows: an
    Embedding (7 rows, the input side) and a Conv1D (weight [input, output]) beside a Linear,
    COMM_OPT and MEM_OPT, float64: FSDP2 equals DDP within 1e-10, and both ranks own layers."""
    script = tmp_path / "worker.py"
    script.write_text(_SEQUENCE_WORKER)
    failure = two_ranks.launch(lambda rank: [script, tmp_path], tmp_path)
    assert failure is None, failure
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    from test_singd_layers import sequence_model
    initial = [p.detach() for p in sequence_model().parameters()]
    for fraction in (1.0, 0.5):
        assert all(rel(d, p0) > 1e-6 for d, p0 in zip(results[(fraction, "ddp")], initial))
        owners = results[(fraction, "fsdp", "owners")]
        assert sorted(owners) == ["0", "1", "3"] and set(owners.values()) == {0, 1}, owners
        assert results[(fraction, "ddp", "owners")] is None
        for i, (f, d) in enumerate(zip(results[(fraction, "fsdp")], results[(fraction, "ddp")])):
            assert rel(f, d) <= 1e-10, (fraction, i, rel(f, d))
