"""One rank of the 2-process CPU/gloo runs of tests/test_adafisher_ddp.py.

Started by tests/two_ranks.py's `launch` as `python tests/dist_worker.py SCENARIO BACKEND OUTDIR`;
the ranks meet through a file in OUTDIR. Everything the test
asserts on is written to OUTDIR as `{case}_rank{r}.pt` (and `{case}_ckpt.pt`, saved by rank 0).

Scenarios:
- "train": for each way of hooking cafin into data-parallel training (WRAPS) and each optimizer:
  STEPS steps with different data on each rank, recording every collective cafin makes; a
  checkpoint saved on rank 0 only; then CONTINUE steps with the same data on both ranks (so that a
  single process can reproduce them bit for bit from the checkpoint).
- "mismatch": rank 1 builds a model that disagrees with rank 0's; constructing the optimizer must
  fail with a ValueError on every rank, and the process group must still work afterwards.

The model, data and hyperparameters are defined here and imported by the test, which runs the
single-process oracle and the resumes on the same definitions.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import two_ranks
from two_ranks import CALLS

TCOV = 2
STEPS = 3 * TCOV + 1  # curvature steps at k = 0, 2, 4, 6
CONTINUE = TCOV + 1   # after the checkpoint at k = STEPS: covers the curvature step k = 8
HP = dict(lr=1e-3, beta=0.9, Lambda=1e-3, weight_decay=0.05, gamma=0.8)
BATCH = 8  # per rank
WORLD = 2
# (name, how the optimizer sees the model, micro-batches per step)
#   ddp:           AdaFisher(ddp_model), one backward per step
#   ddp_module:    AdaFisher(ddp_model.module)
#   allreduce:     a plain model; the user all-reduces (averages) the gradients before step()
#   ddp_no_sync:   AdaFisher(ddp_model.module), 2 micro-batches, the first under ddp.no_sync()
WRAPS = {"ddp": 1, "ddp_module": 1, "allreduce": 1, "ddp_no_sync": 2}
OPTIMIZERS = ("AdaFisher", "AdaFisherW")
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "broadcast", "broadcast_object_list", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "barrier", "all_to_all")


def make_model(seed: int = 0, hidden: int = 8, extra_layer: bool = False) -> nn.Sequential:
    """Every supported layer type, an in-place activation, biases."""
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        layers = [nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(inplace=True),
                  nn.Flatten(), nn.Linear(3 * 5 * 5, hidden), nn.LayerNorm(hidden), nn.Tanh(),
                  nn.Linear(hidden, 3)]
        if extra_layer:
            layers.append(nn.Linear(3, 3))
        return nn.Sequential(*layers)


def rank_batch(step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `rank` at `step`; rank=None: the batch every rank uses after the checkpoint."""
    gen = torch.Generator().manual_seed(10_000 + 100 * step + (99 if rank is None else rank))
    x = torch.randn(BATCH, 2, 5, 5, generator=gen)
    y = torch.randn(BATCH, 3, generator=gen)
    return x, y


def micro_batches(batch, n: int):
    x, y = batch
    return list(zip(x.chunk(n), y.chunk(n)))


def loss_of(out: torch.Tensor, y: torch.Tensor, n_micro: int) -> torch.Tensor:
    return F.mse_loss(out, y) / n_micro


def anchors(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The supported modules, in order; each one's factors live in the state of its weight."""
    import cafin
    return [(n, m) for n, m in model.named_modules() if isinstance(m, tuple(cafin.supported_types()))]


def factors_of(opt, model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in anchors(model):
        state = opt.state[m.weight]
        out[f"{name}.S"] = state["fisher_S"].detach().clone()
        out[f"{name}.H"] = state["fisher_H"].detach().clone()
    return out


def train_step(net, opt, model, batch, n_micro, *, no_sync=False, allreduce=False, record=None):
    """One step as a user writes it; returns the collectives made inside opt.step()."""
    import torch.distributed as dist
    opt.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(micro_batches(batch, n_micro)):
        ctx = net.no_sync() if (no_sync and i < n_micro - 1) else contextlib.nullcontext()
        with ctx:
            loss_of(net(x), y, n_micro).backward()
    if record is not None:
        record["fwd_bwd"].append(list(CALLS))
    if allreduce:
        world = dist.get_world_size()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
    CALLS.clear()
    opt.step()
    if record is not None:
        record["step"].append(list(CALLS))
    CALLS.clear()


# ------------------------------------------------------------------------------ scenarios
def scenario_train(rank: int, backend: str, outdir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import cafin
    group = dist.new_group(list(range(WORLD)))  # the "allreduce" runs pass it explicitly
    solo = dist.new_group([0])  # world size 1: rank 0 resumes its checkpoint in it
    for wrap, n_micro in WRAPS.items():
        for opt_name in OPTIMIZERS:
            case = f"{wrap}-{opt_name}"
            result: dict = {"error": None, "fwd_bwd": [], "step": []}
            CALLS.clear()
            try:
                # DDP broadcasts rank 0's parameters: let rank 1 start elsewhere to show it.
                model = make_model(seed=0 if wrap == "allreduce" else rank)
                net = model if wrap == "allreduce" else DDP(model)
                result["initial"] = [p.detach().clone() for p in model.parameters()]
                cls = getattr(cafin, opt_name)
                opt = cls(net if wrap == "ddp" else model, TCov=TCOV, backend=backend,
                          process_group=group if wrap == "allreduce" else None, **HP)
                result["construct"] = list(CALLS)  # the layout check
                CALLS.clear()
                kw = dict(no_sync=wrap == "ddp_no_sync", allreduce=wrap == "allreduce")
                for k in range(STEPS):
                    train_step(net, opt, model, rank_batch(k, rank), n_micro, record=result, **kw)
                result["params"] = [p.detach().clone() for p in model.parameters()]
                result["factors"] = factors_of(opt, model)
                result["flat_numel"] = sum(v.numel() for v in result["factors"].values())
                if rank == 0:  # saved on rank 0 only: state_dict() must make no collective
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                               os.path.join(outdir, f"{case}_ckpt.pt"))
                dist.barrier()
                for k in range(STEPS, STEPS + CONTINUE):
                    train_step(net, opt, model, rank_batch(k, None), n_micro, **kw)
                result["continued"] = [p.detach().clone() for p in model.parameters()]
                if rank == 0:
                    result["resumed_solo"] = resume_alone(case, cls, backend, outdir, n_micro, solo)
            except Exception:
                result["error"] = traceback.format_exc()
                torch.save(result, os.path.join(outdir, f"{case}_rank{rank}.pt"))
                # The other rank may be waiting in a collective: leave, so that it fails fast
                # (its peer is gone) instead of waiting for the timeout, and report.
                sys.stderr.write(result["error"])
                sys.stderr.flush()
                os._exit(3)
            torch.save(result, os.path.join(outdir, f"{case}_rank{rank}.pt"))


def resume_alone(case, cls, backend, outdir, n_micro, solo_group):
    """Rank 0 alone (a process group of world size 1): a fresh plain model and optimizer load the
    checkpoint and take the CONTINUE steps; a failure is returned, not raised (it is local)."""
    try:
        ckpt = torch.load(os.path.join(outdir, f"{case}_ckpt.pt"), weights_only=True)
        model = make_model(seed=7)
        model.load_state_dict(ckpt["model"])
        opt = cls(model, TCov=TCOV, backend=backend, process_group=solo_group, **HP)
        opt.load_state_dict(ckpt["opt"])
        for k in range(STEPS, STEPS + CONTINUE):
            train_step(model, opt, model, rank_batch(k, None), n_micro)
        return [p.detach().clone() for p in model.parameters()]
    except Exception:
        return traceback.format_exc()


def scenario_mismatch(rank: int, backend: str, outdir: str) -> None:
    import torch.distributed as dist
    import cafin
    cases = {"hidden_size": dict(hidden=8 + rank), "extra_layer": dict(extra_layer=rank == 1),
             "frozen_layer": dict()}
    for case, kwargs in cases.items():
        model = make_model(**kwargs)
        if case == "frozen_layer" and rank == 1:
            model[0].requires_grad_(False)
        result = {"error_type": None, "message": None}
        try:
            cafin.AdaFisher(model, TCov=TCOV, backend=backend, **HP)
        except Exception as e:  # the expected ValueError, or whatever went wrong instead
            result["error_type"] = type(e).__name__
            result["message"] = str(e)
        # The group is still in step after the failure: a collective completes.
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        result["group_works"] = t.item() == 3.0
        torch.save(result, os.path.join(outdir, f"{case}_rank{rank}.pt"))


def main() -> None:
    scenario, backend, outdir = sys.argv[1:4]
    rank, world = two_ranks.join(outdir)
    assert world == WORLD
    two_ranks.count_collectives(COLLECTIVES)
    {"train": scenario_train, "mismatch": scenario_mismatch}[scenario](rank, backend, outdir)
    two_ranks.leave()


if __name__ == "__main__":
    main()
