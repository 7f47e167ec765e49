"""One rank of tests/test_hsdp.py's CPU/gloo launches: HSDP (a 2 x 2 replicate x shard mesh) and
DCP checkpoints that load at another world size.

Started by tests/two_ranks.py's `launch` as `python tests/hsdp_worker.py OUTDIR LOAD SAVE HSDP`:
- HSDP "hsdp" (4 ranks): for every member and dtype, the same model trained under DDP and under
  `fully_shard(..., mesh=2x2 mesh)` on the same per-rank batches; records the full parameters,
  the factors and the collectives of every step() (name, elements, dtype, ranks of the group).
  Results: `{member}-{dtype}-hsdp_rank{r}.pt`; and the group and rows of an HSDP mesh that is a
  slice of a bigger mesh (`submesh_rank{r}.pt`).
- SAVE "W" without LOAD: every member (float64) trains CKPT_AT steps under FSDP and saves a DCP
  checkpoint to OUTDIR/ckpt{W}/{member}.
- LOAD "W" (and optionally SAVE "W'"): a fresh FSDP model and optimizer load that checkpoint at
  this launch's world size, record the loaded state (gathered), take one step, and a DDP run
  that loaded the same checkpoint takes the same step; then, with SAVE, the FSDP run saves again.
Every save records the saved state (gathered) and each rank's own entries (BatchNorm buffers,
two-level's per-sample statistics): `{member}-save{W}_rank{r}.pt`; every load
`{member}-load{W}to{W'}_rank{r}.pt`.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch
from torch import nn

import fsdp_worker as F
import two_ranks

DTYPE = torch.float64  # of the resharding runs
CKPT_AT = F.CKPT_AT  # steps before the first checkpoint
CALLS: list = []
COUNTING = [False]
# K-FAC with MEM_OPT on 4 ranks: each layer's one gradient worker sits in one shard group only
KFAC_MEMOPT = F.Member("KFAC-memopt", lambda model, net: F._kfac(model, net, grad_worker_fraction=0.25),
                       optimizer_index=1)


def count_collectives() -> None:
    """Record (name, elements sent, dtype, group size) of every collective while COUNTING[0]."""
    import torch.distributed as dist
    for name in F.COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, __original=original, __name=name, **kwargs):
            if COUNTING[0]:
                sent = args[1] if __name.startswith(("all_gather", "all_to_all_single")) else args[0]
                group = kwargs.get("group")
                CALLS.append((__name, sent.numel(), str(sent.dtype).replace("torch.", ""),
                              dist.get_world_size(group)))
            return __original(*args, **kwargs)

        setattr(dist, name, wrapper)


def hsdp_shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    for m in model:
        if any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(net, objs, steps, rank, dtype, record=None):
    for k in steps:
        COUNTING[0] = False
        for o in objs:
            if hasattr(o, "zero_grad"):
                o.zero_grad(set_to_none=True)
        net.zero_grad(set_to_none=True)
        x, y = F.rank_batch(k, rank, dtype)
        torch.nn.functional.mse_loss(net(x), y).backward()
        CALLS.clear()
        COUNTING[0] = record is not None
        for o in objs:
            o.step()
        COUNTING[0] = False
        if record is not None:
            record.append(list(CALLS))


def hsdp_order(mesh):
    """A DDP communication hook that sums the gradients in HSDP's order: within each shard
    group, then across the replicas (then / world, a power of two, exact). The mean is DDP's;
    only the rounding of the four-term sum changes, and with it the float32 comparison
    measures cafin rather than the reduction order (members that normalise tiny gradient
    entries or rotate eigenbases turn a last-bit difference into a visible one)."""
    import torch.distributed as dist
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")

    def hook(_, bucket):
        t = bucket.buffer()
        dist.all_reduce(t, group=shard)
        dist.all_reduce(t, group=replicate)
        t.div_(mesh.size())
        fut = torch.futures.Future()
        fut.set_result(t)
        return fut
    return hook


def hsdp_case(member, dtype, rank, outdir, world) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = F.make_model(dtype)
    net = DDP(model)
    net.register_comm_hook(None, hsdp_order(mesh))
    objs = member.make(model, net)
    train(net, objs, range(F.STEPS), rank, dtype)
    result = {"ddp": two_ranks.full_params(model), "ddp_factors": F.factors(objs)}
    if dtype == torch.float64:  # and DDP's own reduction order
        model = F.make_model(dtype)
        net = DDP(model)
        objs = member.make(model, net)
        train(net, objs, range(F.STEPS), rank, dtype)
        result["ddp_plain"] = two_ranks.full_params(model)
    model = hsdp_shard(F.make_model(dtype), mesh)
    objs = member.make(model, model)
    calls: list = []
    train(model, objs, range(CKPT_AT), rank, dtype, calls)
    if dtype == DTYPE:  # the checkpoint that a launch of another world size loads
        save(model, objs, member, outdir, str(world), rank, world)
    train(model, objs, range(CKPT_AT, F.STEPS), rank, dtype, calls)
    result.update(hsdp=two_ranks.full_params(model), hsdp_factors=F.factors(objs), calls=calls,
                  placements=[str(tuple(p.placements)) for p in model.parameters()],
                  owners=F.gradient_owners(objs, model))
    return result


def submesh_case(rank) -> dict:
    """An HSDP mesh that does not span the world: the (replicate, shard) = (1, 2) slice of a
    (2, 1, 2) mesh whose first dimension (e.g. pipeline stages) splits the 4 ranks in two.
    Statistics are averaged over the slice's 2 ranks, rows sharded over its shard dimension."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import cafin
    from cafin.core.distribution.sharding import check_sharded, rows
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("stage", "replicate", "shard"))
    model = hsdp_shard(F.make_model(DTYPE), mesh["replicate", "shard"])
    group = check_sharded(model.parameters(), "test")
    cafin.AdaFisher(model)  # builds (and compares the ranks' layouts over the group)
    return {"group": dist.get_process_group_ranks(group),
            "rows": [rows(p) for p in model.parameters()],
            "placements": [str(tuple(p.placements)) for p in model.parameters()]}


# ------------------------------------------------------------------------------ resharding
def _leaves(prefix, value, out: dict) -> None:
    if isinstance(value, dict):
        for k in sorted(value, key=str):
            _leaves(f"{prefix}.{k}", value[k], out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _leaves(f"{prefix}.{i}", v, out)
    elif isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone()
    else:
        out[prefix] = value


def full_state(model, objs, member) -> tuple[dict, dict]:
    """(what every rank holds alike, gathered: full parameters, the optimizer's state and the
    preconditioner's; this rank's own entries: BatchNorm buffers, two-level's statistics)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from cafin.optim.twolevel import twolevel_checkpoint
    shared: dict = {}
    for (name, _), p in zip(model.named_parameters(), two_ranks.full_params(model)):
        shared[f"param.{name}"] = p
    opt = objs[member.optimizer_index]
    if member.full_state:  # full-size state, the same on every rank
        _leaves("optim", opt.state_dict()["state"], shared)
    else:
        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        _leaves("optim", osd["state"], shared)
    own: dict = {f"buffer.{n}": b.detach().clone() for n, b in model.named_buffers()}
    if member.optimizer_index and member.preconditioner == "twolevel":
        sd = twolevel_checkpoint(objs[0])
        _leaves("pre", sd.pop("twolevel"), shared)
        (key, value), = sd.items()
        _leaves("pre", value, own)
    elif member.optimizer_index:
        _leaves("pre", objs[0].state_dict(), shared)
    return shared, own


def save(model, objs, member, outdir, tag, rank, world) -> None:
    path = os.path.join(outdir, f"ckpt{tag}", member.name)
    os.makedirs(path, exist_ok=True)
    F.dcp_save(model, objs, member, path)
    shared, own = full_state(model, objs, member)
    torch.save({"shared": shared, "own": own, "world": world},
               os.path.join(outdir, f"{member.name}-save{tag}_rank{rank}.pt"))


def reshard_case(member, rank, world, outdir, load, save_tag) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    if not load:
        model = F.shard(F.make_model(DTYPE))
        objs = member.make(model, model)
        train(model, objs, range(CKPT_AT), rank, DTYPE)
        save(model, objs, member, outdir, save_tag, rank, world)
        return
    path = os.path.join(outdir, f"ckpt{load}", member.name)
    model = F.shard(F.make_model(DTYPE, seed=5))
    objs = member.make(model, model)
    F.dcp_load(model, objs, member, path)
    shared, own = full_state(model, objs, member)
    train(model, objs, [CKPT_AT], rank, DTYPE)
    result = {"loaded": shared, "loaded_own": own, "stepped": two_ranks.full_params(model)}
    ref = F.make_model(DTYPE, seed=5)
    net = DDP(ref)
    ref_objs = member.make(ref, net)
    F.dcp_load(ref, ref_objs, member, path)
    train(net, ref_objs, [CKPT_AT], rank, DTYPE)
    result["reference"] = two_ranks.full_params(ref)
    torch.save(result, os.path.join(outdir, f"{member.name}-load{load}to{world}_rank{rank}.pt"))
    if save_tag:
        save(model, objs, member, outdir, save_tag, rank, world)


def main() -> None:
    outdir, load, save_tag, hsdp = sys.argv[1:5]
    members = sys.argv[5].split(",") if len(sys.argv) > 5 else list(F.MEMBERS)
    # each launch meets in its own folder (the test's log folder of that launch)
    rank, world = two_ranks.join(os.path.join(outdir, f"w{os.environ['WORLD_SIZE']}-load{load}"))
    import torch.distributed as dist
    count_collectives()
    jobs = [(f"{name}-{dname}-hsdp", lambda m=m, d=d: hsdp_case(m, d, rank, outdir, world))
            for name, m in F.MEMBERS.items() if name in members for dname, d in F.DTYPES.items()] if hsdp else []
    jobs += [("submesh", lambda: submesh_case(rank))] if hsdp else []
    if hsdp and "KFAC-mem" in members:  # MEM_OPT, where no shard group holds an owner of every layer
        jobs.append(("KFAC-memopt-float64-hsdp",
                     lambda: hsdp_case(KFAC_MEMOPT, torch.float64, rank, outdir, world)))
    jobs += [(f"{name}-reshard{load}to{world}", lambda m=m: reshard_case(m, rank, world, outdir, load, save_tag))
             for name, m in F.MEMBERS.items() if name in members] if (load or save_tag) else []
    for case, job in jobs:
        try:
            result = job()
        except Exception:
            error = traceback.format_exc()
            torch.save({"error": error}, os.path.join(outdir, f"{case}_rank{rank}.pt"))
            sys.stderr.write(error)
            sys.stderr.flush()
            os._exit(3)
        if result is not None:
            torch.save(result, os.path.join(outdir, f"{case}_rank{rank}.pt"))
    dist.barrier()
    two_ranks.leave()


if __name__ == "__main__":
    main()
