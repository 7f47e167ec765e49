"""`python -m bench fsdp-bytes`: the gradient bytes K-FAC and SINGD move per step under FSDP2.

Each world size is one torch.multiprocessing launch of CPU/gloo ranks (one thread each). Every
rank shards the bench's GPT and MLP (bench/models.py) with `fully_shard` (each leaf module with
parameters, then the root) and trains a few steps with K-FAC (COMM_OPT and MEM_OPT) and SINGD
(dense). Per rank, on the last step, it reports the bytes of the gradients that step() moves:

- owner scheme (what the members do): each layer's gradient rows to its owner and the
  preconditioned rows back, two all_to_alls; received = the bytes that arrive from other ranks;
- all-gather (what they did, and still do where no owner can be chosen): the same gradients
  gathered on every rank by `cafin.core.distribution.sharding.gather_rows`, run beside the owner scheme on the same
  gradients and counted, its result unused;
- full gradients held: the elements of whole gradients a rank holds at once (its owned layers'
  under the owner scheme; every gathered layer's under the all-gather).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from .models import batch_for, gpt, loss_for, mlp

MODELS = {"gpt": (lambda: gpt(), 16), "mlp": (lambda: mlp(), 128)}
MEMBERS = ("kfac-comm_opt", "kfac-mem_opt", "singd-dense")


def _count(counter: dict) -> None:
    """Add the bytes every all_to_all_single / all_gather_into_tensor receives from the other
    ranks to counter[name] while counter['on']."""
    import torch.distributed as dist
    for name in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, __original=original, __name=name, **kwargs):
            if counter["on"]:
                out, sent = args[0], args[1]
                if __name == "all_to_all_single":
                    mine = args[2][dist.get_rank(kwargs.get("group"))]
                else:
                    mine = sent.numel()
                counter[counter["into"]] += (out.numel() - mine) * out.element_size()
            return __original(*args, **kwargs)
        setattr(dist, name, wrapper)


def _beside(counter: dict):
    """Wrap gather_to_owners: also run the all-gather on the same gradients (counted apart) and
    count the full gradients each way holds."""
    import cafin.core.distribution.sharding as sharding
    original = sharding.gather_to_owners

    def both(tensors, owners):
        counter["into"] = "all_gather"
        sharding.gather_rows(tensors)
        counter["into"] = "owner"
        out = original(tensors, owners)
        counter["held_all_gather"] += sum(t.numel() * t.element_size() for t in tensors)
        counter["held_owner"] += sum(t.numel() * t.element_size() for t in out if t is not None)
        return out
    return both


def _make(member: str, model, world: int):
    import cafin
    if member.startswith("kfac"):
        kw = {} if member.endswith("comm_opt") else dict(grad_worker_fraction=1 / world)
        pre = cafin.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, **kw)
        return [pre, torch.optim.SGD(model.parameters(), lr=1e-3)]
    return [cafin.SINGD(model, params=model.parameters(), lr=1e-3, T=1, structures=("dense", "dense"),
                        warn_unsupported=False)]


def _shard(model):
    from torch.distributed.fsdp import fully_shard
    tied = (getattr(model, "tok", None), getattr(model, "head", None))  # one parameter: one group
    for module in model.modules():
        if module is not model and module not in tied and next(module.children(), None) is None \
                and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module)
    fully_shard(model)  # the rest (the GPT's tied embedding and head, its positions) at the root
    return model


def _rank(rank: int, world: int, outdir: str, steps: int) -> None:
    import torch.distributed as dist
    import cafin.optim.kfac.distribution as kfac_module
    import cafin.optim.singd.distribution as singd_module
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(outdir, "rendezvous"),
                            rank=rank, world_size=world)
    counter: dict = {"on": False, "into": "owner"}
    _count(counter)
    both = _beside(counter)
    kfac_module.gather_to_owners = singd_module.gather_to_owners = both
    rows = []
    for model_name, (make, global_batch) in MODELS.items():
        for member in MEMBERS:
            torch.manual_seed(0)
            model = _shard(make())
            objs = _make(member, model, world)
            gen = torch.Generator().manual_seed(1)
            for step in range(steps):
                x, y = batch_for(model_name, model, global_batch, generator=gen)
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
                model.zero_grad(set_to_none=True)
                loss_for(model_name, model(x), y).backward()
                for key in ("owner", "all_gather", "held_owner", "held_all_gather"):
                    counter[key] = 0
                counter["on"] = step == steps - 1
                for o in objs:
                    o.step()
                counter["on"] = False
            rows.append(dict(model=model_name, member=member, world=world, rank=rank,
                             owner=counter["owner"], all_gather=counter["all_gather"],
                             held_owner=counter["held_owner"], held_all_gather=counter["held_all_gather"]))
    torch.save(rows, os.path.join(outdir, f"rows_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, steps: int) -> list[dict]:
    import torch.multiprocessing as mp
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_rank, args=(world, outdir, steps), nprocs=world, join=True)
        return [row for r in range(world) for row in torch.load(os.path.join(outdir, f"rows_rank{r}.pt"))]


def render(rows: list[dict]) -> str:
    head = (f"{'model':5} {'member':14} {'W':>2} {'rank':>4} {'owner recv':>12} {'all-gather recv':>16} "
            f"{'ratio':>6} {'full grads held: owner':>23} {'all-gather':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r["owner"] / r["all_gather"] if r["all_gather"] else float("nan")
        lines.append(f"{r['model']:5} {r['member']:14} {r['world']:2d} {r['rank']:4d} {r['owner']:12,d} "
                     f"{r['all_gather']:16,d} {ratio:6.2f} {r['held_owner']:23,d} {r['held_all_gather']:11,d}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench fsdp-bytes", description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2", help="comma-separated world sizes (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="steps; the last one is counted")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    rows = [row for w in args.worlds.split(",") for row in launch(int(w), args.steps)]
    print("bytes received from the other ranks per step, per rank (float32 gradients)")
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
