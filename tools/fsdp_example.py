"""Train a small model sharded with FSDP2 (`fully_shard`) with a cafin member, checkpoint it with
torch.distributed.checkpoint and resume; prints the loss and the bytes each rank sends inside
`step()`. Runs on CPU (gloo) or GPUs (nccl):

    torchrun --standalone --nproc_per_node=2 tools/fsdp_example.py --member adafisher
    torchrun --standalone --nproc_per_node=2 tools/fsdp_example.py --member kfac
    torchrun --standalone --nproc_per_node=2 tools/fsdp_example.py --member twolevel --coarse residual
    torchrun --standalone --nproc_per_node=4 tools/fsdp_example.py --member kfac --replicas 2   (HSDP, 2 x 2)
    (members: adafisher, adafisherw, kfac, twolevel, singd, singd-diagonal, dykaf)
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

import cafin
from cafin.optim.kfac import kfac_checkpoint_template
from cafin.optim.twolevel import twolevel_checkpoint, twolevel_load


def make_model(device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 33), nn.LayerNorm(33), nn.Tanh(),
                         nn.Linear(33, 10)).to(device)


def build(member: str, model: nn.Module, coarse: str = "nicolaides") -> list:
    """The objects stepped after backward; the last one is the torch optimizer DCP saves."""
    if member in ("adafisher", "adafisherw"):
        cls = cafin.AdaFisher if member == "adafisher" else cafin.AdaFisherW
        return [cls(model, lr=1e-3, TCov=5)]
    if member == "kfac":
        return [cafin.KFACPreconditioner(model, factor_update_steps=5, inv_update_steps=10),
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)]
    if member == "twolevel":
        pre = cafin.TwoLevelKFAC(model, damping=1e-2, T_cov=5, T_inv=10, coarse_space=coarse,
                                 constraint_norm=True, clipping=1e-2)
        pre.update_stats = True  # statistics on every pass; step() uses those of T_cov steps
        return [pre, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)]
    if member in ("singd", "singd-diagonal"):
        structures = ("diagonal", "diagonal") if member == "singd-diagonal" else ("dense", "dense")
        return [cafin.SINGD(model, params=model.parameters(), lr=0.01, T=5, structures=structures)]
    if member == "dykaf":
        return [cafin.DyKAF(model.parameters(), lr=3e-3, precondition_frequency=5)]
    raise SystemExit(f"unknown member {member!r}")


SENT = [0]


def count_sent_bytes() -> None:
    """Wrap the collectives cafin calls, to report what a rank sends inside step()."""
    for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_to_all_single"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, __original=original, __name=name, **kwargs):
            t = args[1] if __name.startswith(("all_gather", "all_to_all")) else args[0]
            own = args[3][dist.get_rank(kwargs.get("group"))] if __name == "all_to_all_single" else 0
            SENT[0] += (t.numel() - own) * t.element_size()  # all_to_all: what goes to other ranks
            return __original(*args, **kwargs)

        setattr(dist, name, wrapper)


def train(model, objs, steps, device, rank, first=0):
    losses = []
    for k in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 * k + rank)  # each rank its own batch
        x = torch.randn(16, 3, 8, 8, generator=gen).to(device)
        y = torch.randint(0, 10, (16,), generator=gen).to(device)
        for o in objs:
            if hasattr(o, "zero_grad"):
                o.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        before = SENT[0]
        for o in objs:
            o.step()
        losses.append((loss.item(), SENT[0] - before))
    return losses


def checkpoint_state(model, objs, fresh: bool) -> dict:
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, objs[-1])}
    if isinstance(objs[0], cafin.KFACPreconditioner):  # its factors, replicated on every rank
        sd["kfac"] = kfac_checkpoint_template(objs[0]) if fresh else objs[0].state_dict()
    if isinstance(objs[0], cafin.TwoLevelKFAC) and not fresh:  # read back by twolevel_load
        sd.update(twolevel_checkpoint(objs[0]))
    return sd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--member", default="adafisher")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--coarse", default="nicolaides", help="TwoLevelKFAC's coarse space")
    parser.add_argument("--replicas", type=int, default=1,
                        help="HSDP: a (replicas x world / replicas) replicate x shard mesh")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    count_sent_bytes()
    world = dist.get_world_size()
    if args.replicas < 1 or world % args.replicas:
        raise SystemExit(f"--replicas must divide the world size {world}, got {args.replicas}")
    mesh = None  # fully_shard's default: a 1-D mesh of every rank
    if args.replicas > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas),
                                mesh_dim_names=("replicate", "shard"))

    def sharded():
        model = make_model(device)
        for layer in model:  # every layer with parameters, then the root
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = sharded()
    objs = build(args.member, model, args.coarse)  # after fully_shard
    for k, (loss, sent) in enumerate(train(model, objs, args.steps, device, rank)):
        if rank == 0:
            print(f"step {k}: loss {loss:.4f}, step() sent {sent} bytes")
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(checkpoint_state(model, objs, fresh=False), checkpoint_id=path[0])
    after = train(model, objs, 3, device, rank, first=args.steps)

    # Resume: a fresh sharded model and optimizer load the checkpoint and take the same steps.
    model2 = sharded()
    objs2 = build(args.member, model2, args.coarse)
    sd = checkpoint_state(model2, objs2, fresh=True)
    dcp.load(sd, checkpoint_id=path[0])
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, objs2[-1], sd["optim"])
    if "kfac" in sd:
        objs2[0].load_state_dict(sd["kfac"])
    if isinstance(objs2[0], cafin.TwoLevelKFAC):  # its replicated state and this rank's statistics
        twolevel_load(objs2[0], path[0])
    resumed = train(model2, objs2, 3, device, rank, first=args.steps)
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(model.parameters(), model2.parameters()))
    same = torch.tensor([float(same)], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"after the checkpoint: losses {[round(l, 4) for l, _ in after]}, resumed "
              f"{[round(l, 4) for l, _ in resumed]}; parameters bit-identical on every rank: "
              f"{bool(same.item())}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
