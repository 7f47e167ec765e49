"""One rank of the 2-process CPU/gloo FSDP2 runs of tests/test_fsdp.py.

Started by tests/two_ranks.py's `launch` as `python tests/fsdp_worker.py OUTDIR`; the ranks meet
through a file in OUTDIR. For every member and dtype (MEMBERS x DTYPES) it trains the same
model twice on the same per-rank batches, once under DDP and once with `fully_shard` on every
layer and on the root, and records: the full parameters of both runs, the collectives each
`step()` made under FSDP (name, elements, dtype), a checkpoint round trip through
torch.distributed.checkpoint (save after CKPT_AT steps, run on; a fresh model and optimizer load
the checkpoint and run the same steps: the local shards must be bit-identical). Results go to
`{case}_rank{r}.pt`.

Started again as `python tests/fsdp_worker.py OUTDIR --one` on one rank, it loads each member's
float64 checkpoint of the 2-rank run with the recipe of docs/distributed.md (K-FAC and two-level
K-FAC with their helpers; their state dicts as plain templates too, which must be refused) and
takes the next step on both ranks' batches, accumulated: `{case}_one.pt`.
"""
from __future__ import annotations

import os
import sys
import tempfile
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import two_ranks
from two_ranks import CALLS, COUNTING, RECEIVED

WORLD = 2
BATCH = 6  # per rank
STEPS = 5  # curvature steps at k = 0, 2, 4
CKPT_AT = 3  # the DCP checkpoint is taken after this many steps, then STEPS - CKPT_AT more
TCOV = 2
DTYPES = {"float64": torch.float64, "float32": torch.float32}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "all_gather_object",
               "broadcast", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "barrier")


def make_model(dtype: torch.dtype, seed: int = 0) -> nn.Sequential:
    """Conv2d, BatchNorm2d, LayerNorm and Linear layers; dim 0 of 7, 3 and 1 rows shard unevenly
    over 2 ranks (4 + 3, 2 + 1, 1 + an empty shard)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
            nn.Linear(3 * 4 * 4, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(),
            nn.Linear(3, 1)).to(dtype)


def rank_batch(step: int, rank: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1000 + 100 * step + rank)
    return (torch.randn(BATCH, 2, 4, 4, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(BATCH, 1, generator=gen, dtype=torch.float64).to(dtype))


# ------------------------------------------------------------------------------ members
class Member:
    """How one member is built and stepped: `make(model, net)` returns the objects whose
    `step()` runs after backward, in order (a preconditioner, then its torch optimizer)."""

    def __init__(self, name, make, optimizer_index=0, full_state=False, preconditioner="kfac"):
        self.name, self.make = name, make
        self.optimizer_index = optimizer_index  # which object DCP's optimizer state dict takes
        # with optimizer_index 1, how objs[0] is checkpointed: "kfac" (its state_dict, loaded
        # into kfac_checkpoint_template) or "twolevel" (cafin.optim.twolevel.twolevel_checkpoint)
        self.preconditioner = preconditioner
        # Full-size state, the same on every rank (DyKAF): not sharded, no DTensor in it.
        self.full_state = full_state


def _adafisher(cls_name, backend="fused"):
    def make(model, net):
        import cafin
        return [getattr(cafin, cls_name)(net, lr=1e-2, TCov=TCOV, weight_decay=0.01, backend=backend)]
    return make


def _kfac(model, net, **kaisa):
    import cafin
    pre = cafin.KFACPreconditioner(net, factor_update_steps=1, inv_update_steps=2, damping=0.01,
                                   lr=0.1, kl_clip=0.01, inv_dtype=model[0].weight.dtype,
                                   decompose_dtype=torch.float64, **kaisa)
    return [pre, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]


def _twolevel(coarse_space):
    def make(model, net):
        import cafin
        pre = cafin.TwoLevelKFAC(net, damping=0.01, T_cov=TCOV, T_inv=TCOV, coarse_space=coarse_space,
                                 constraint_norm=True, clipping=1e-3)
        pre.update_stats = True  # statistics on every pass; step() uses those of T_cov steps
        return [pre, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    return make


def _dykaf(model, net):
    import cafin
    return [cafin.DyKAF(model.parameters(), lr=1e-2, precondition_frequency=2, weight_decay=0.01)]


def _singd(structures):
    def make(model, net):
        import cafin
        return [cafin.SINGD(net, params=model.parameters(), lr=1e-2, T=TCOV, structures=structures,
                            weight_decay=0.01,
                            warn_unsupported=False)]
    return make


MEMBERS = {
    "AdaFisher": Member("AdaFisher", _adafisher("AdaFisher")),
    "AdaFisherW": Member("AdaFisherW", _adafisher("AdaFisherW")),
    "AdaFisher-reference": Member("AdaFisher-reference", _adafisher("AdaFisher", "reference")),
    "KFAC": Member("KFAC", _kfac, optimizer_index=1),
    # KAISA's MEM_OPT: each layer decomposed and preconditioned on one rank, its gradient shared
    "KFAC-mem": Member("KFAC-mem", lambda model, net: _kfac(model, net, grad_worker_fraction=0.5),
                       optimizer_index=1),
    "DyKAF": Member("DyKAF", _dykaf, full_state=True),
    "SINGD-dense": Member("SINGD-dense", _singd(("dense", "dense"))),
    "SINGD-diagonal": Member("SINGD-diagonal", _singd(("diagonal", "diagonal"))),
    "SINGD-toeplitz": Member("SINGD-toeplitz", _singd(("triltoeplitz", "diagonal"))),
    "TwoLevel-nicolaides": Member("TwoLevel-nicolaides", _twolevel("nicolaides"), optimizer_index=1,
                                  preconditioner="twolevel"),
    "TwoLevel-residual": Member("TwoLevel-residual", _twolevel("residual"), optimizer_index=1,
                                preconditioner="twolevel"),
}


def _shard_dim1(model):
    """AdaFisher on a model sharded on dim 1 (fully_shard's shard_placement_fn): not FSDP2's
    default layout, not supported."""
    import cafin
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    model = make_model(torch.float64)
    fully_shard(model[4], shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    fully_shard(model)
    return cafin.AdaFisher(model)


def _twolevel_partly_sharded(model):
    """TwoLevelKFAC on a model of which only one layer is sharded: the others' gradients would
    be each rank's own."""
    import cafin
    from torch.distributed.fsdp import fully_shard
    model = make_model(torch.float64)
    fully_shard(model[4])
    return cafin.TwoLevelKFAC(model)


# Members (or layouts) that cannot train a sharded model: constructing them must fail clearly.
REFUSED = {"AdaFisher-Shard1": _shard_dim1, "TwoLevelKFAC-partly-sharded": _twolevel_partly_sharded}


def factors(objs) -> list[torch.Tensor]:
    """The curvature factors of a hook-based member (replicated: every rank holds them whole)."""
    import cafin
    o = objs[0]
    if isinstance(o, cafin.AdaFisher):
        return [o.state[l.anchor][k].clone() for l in o._curvature for k in ("fisher_S", "fisher_H")]
    if isinstance(o, cafin.KFACPreconditioner):
        return [t.clone() for st in o._state.values() for t in (st.A, st.G)]
    if isinstance(o, cafin.SINGD):
        return [v.clone() for l in o._curvature for k, v in o.state[l.anchor].items()
                if k.startswith(("K.", "C."))]
    if isinstance(o, cafin.TwoLevelKFAC):
        return [o.state[g["params"][0]][k].clone() for g in o.param_groups for k in ("xxt", "ggt")] \
            + [o.f_coarse.clone()]
    return []


def gradient_owners(objs, model) -> dict[str, int] | None:
    """The rank (shard index) that owns each layer's gradient under FSDP2, for the members that
    send gradients to owners (K-FAC, SINGD); None for the others."""
    import cafin
    o = objs[0]
    if isinstance(o, cafin.KFACPreconditioner):
        return dict(o._owners) if o._owners else None
    if isinstance(o, cafin.SINGD) and o._owned_now:  # some layer went to its owner
        return o._gradient_owners(model[0].weight)
    return None


# ------------------------------------------------------------------------------ training
def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    for m in model:
        if any(True for _ in m.parameters()):
            fully_shard(m)
    fully_shard(model)
    return model


def train(net, objs, steps, rank, dtype, record=None, received=None):
    for k in steps:
        for o in objs:
            if hasattr(o, "zero_grad"):
                o.zero_grad(set_to_none=True)
        net.zero_grad(set_to_none=True)
        x, y = rank_batch(k, rank, dtype)
        F.mse_loss(net(x), y).backward()
        COUNTING[0] = record is not None
        CALLS.clear()
        RECEIVED.clear()
        for o in objs:
            o.step()
        COUNTING[0] = False
        if record is not None:
            record.append(list(CALLS))
        if received is not None:
            received.append(list(RECEIVED))


def local_params(model) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def dcp_save(model, objs, member, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    opt = objs[member.optimizer_index]
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if member.optimizer_index and member.preconditioner == "twolevel":
        from cafin.optim.twolevel import twolevel_checkpoint
        sd.update(twolevel_checkpoint(objs[0]))
    elif member.optimizer_index:  # a preconditioner's factors (replicated) go into the same checkpoint
        sd["preconditioner"] = objs[0].state_dict()
    dcp.save(sd, checkpoint_id=path)


def dcp_load(model, objs, member, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    opt = objs[member.optimizer_index]
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    kfac = member.optimizer_index and member.preconditioner == "kfac"
    if kfac:
        from cafin.optim.kfac import kfac_checkpoint_template
        sd["preconditioner"] = kfac_checkpoint_template(objs[0])
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    if kfac:
        objs[0].load_state_dict(sd["preconditioner"])
    elif member.optimizer_index:
        from cafin.optim.twolevel import twolevel_load
        twolevel_load(objs[0], path)


def run_case(member: Member, dtype: torch.dtype, rank: int, outdir: str, group) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    result: dict = {}
    # DDP: the reference.
    model = make_model(dtype)
    net = DDP(model)
    objs = member.make(model, net)
    train(net, objs, range(STEPS), rank, dtype)
    result["ddp"] = two_ranks.full_params(model)
    result["ddp_factors"] = factors(objs)
    # FSDP2 from the start to the end, counting the collectives of every step.
    model = shard(make_model(dtype))
    objs = member.make(model, model)
    calls: list = []
    received: list = []
    train(model, objs, range(CKPT_AT), rank, dtype, calls, received)
    path = tempfile.mkdtemp(dir=outdir) if rank == 0 else None
    box = [path]
    dist.broadcast_object_list(box, src=0, group=group)
    dcp_save(model, objs, member, box[0])
    result["checkpoint"] = box[0]
    train(model, objs, [CKPT_AT], rank, dtype, calls, received)
    result["next"] = two_ranks.full_params(model)  # the uninterrupted step after the checkpoint
    train(model, objs, range(CKPT_AT + 1, STEPS), rank, dtype, calls, received)
    result["fsdp"] = two_ranks.full_params(model)
    result["fsdp_factors"] = factors(objs)
    result["fsdp_local"] = local_params(model)
    result["calls"] = calls
    result["received"] = received
    result["owners"] = gradient_owners(objs, model)
    # A fresh model and optimizer resume from the checkpoint.
    model = shard(make_model(dtype, seed=5))
    objs = member.make(model, model)
    dcp_load(model, objs, member, box[0])
    train(model, objs, range(CKPT_AT, STEPS), rank, dtype)
    result["resumed_local"] = local_params(model)
    return result


def plain_template_load(model, objs, member, path) -> None:
    """The recipe of docs/distributed.md with a preconditioner's own state dict as the template
    (K-FAC: `state_dict()`; two-level K-FAC: through get/set_optimizer_state_dict, as a torch
    optimizer), which their helpers replace."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    pre = objs[0]
    if member.preconditioner == "kfac":
        sd = {"preconditioner": pre.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        pre.load_state_dict(sd["preconditioner"])
    else:
        sd = {"twolevel": get_optimizer_state_dict(model, pre)}
        dcp.load(sd, checkpoint_id=path)
        set_optimizer_state_dict(model, pre, sd["twolevel"])


def resume_on_one_rank(outdir: str) -> None:
    """Each member's float64 checkpoint of the 2-rank run, loaded on this one rank (see the
    module's docstring)."""
    dtype = torch.float64
    for name, member in MEMBERS.items():
        case = f"{name}-float64"
        saved = torch.load(os.path.join(outdir, f"{case}_rank0.pt"), weights_only=False)
        result: dict = {"error": None}
        try:
            model = shard(make_model(dtype, seed=5))
            objs = member.make(model, model)
            dcp_load(model, objs, member, saved["checkpoint"])
            for o in objs:
                if hasattr(o, "zero_grad"):
                    o.zero_grad(set_to_none=True)
            for rank in range(WORLD):  # both ranks' batches: the gradient the 2 ranks averaged
                x, y = rank_batch(CKPT_AT, rank, dtype)
                (F.mse_loss(model(x), y) / WORLD).backward()
            for o in objs:
                o.step()
            result["next"] = two_ranks.full_params(model)
            if member.optimizer_index:
                model = shard(make_model(dtype, seed=5))
                objs = member.make(model, model)
                try:
                    plain_template_load(model, objs, member, saved["checkpoint"])
                    result["plain"] = None
                except BaseException as e:  # DCP's CheckpointException is a BaseException
                    result["plain"] = (type(e).__name__, str(e))
        except BaseException:
            result["error"] = traceback.format_exc()
        torch.save(result, os.path.join(outdir, f"{case}_one.pt"))


def main() -> None:
    outdir = sys.argv[1]
    if sys.argv[2:3] == ["--one"]:
        two_ranks.join(os.path.join(outdir, "one"))
        resume_on_one_rank(outdir)
        two_ranks.leave()
        return
    only = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else list(MEMBERS)
    rank, world = two_ranks.join(outdir)
    assert world == WORLD
    import torch.distributed as dist
    two_ranks.count_collectives(COLLECTIVES)
    COUNTING[0] = False
    group = dist.group.WORLD
    for name in only:
        for dname, dtype in DTYPES.items():
            case = f"{name}-{dname}"
            try:
                result = run_case(MEMBERS[name], dtype, rank, outdir, group)
                result["error"] = None
            except Exception:
                result = {"error": traceback.format_exc()}
                torch.save(result, os.path.join(outdir, f"{case}_rank{rank}.pt"))
                sys.stderr.write(result["error"])
                sys.stderr.flush()
                os._exit(3)
            torch.save(result, os.path.join(outdir, f"{case}_rank{rank}.pt"))
    refused = {}
    for name, make in REFUSED.items():
        try:
            make(shard(make_model(torch.float64)))
            refused[name] = None
        except Exception as e:
            refused[name] = (type(e).__name__, str(e))
    torch.save(refused, os.path.join(outdir, f"refused_rank{rank}.pt"))
    two_ranks.leave()


if __name__ == "__main__":
    main()
