"""The one way the tests run several CPU processes on gloo: `launch` on the test's side, `join`
and `leave` on the worker's.

Why each piece is here (a hang costs the whole CI run, so every exit is bounded):
- ranks meet through a file in the test's tmp dir (no ports to collide) and talk over the
  loopback whatever the hostname resolves to;
- one thread per rank (2 ranks on 2 cores; also makes CPU reductions reproducible);
- gloo's own timeout bounds every collective; a stall outside one (a rank stuck at exit) is
  bounded by faulthandler, which writes every thread's stack to the rank's log and exits;
- output goes to files, not pipes: a rank blocked on a full pipe would stall the other rank;
- `leave` frees what holds the group (DDP reducers) and meets the other ranks before tearing gloo
  down: a rank that destroys its group while the other still sends can hang that rank's exit.
"""
from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

GLOO_TIMEOUT_S = 90
LAUNCH_TIMEOUT_S = 300
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def launch(argv, outdir: Path, world: int = 2, timeout: float = LAUNCH_TIMEOUT_S) -> str | None:
    """Run `python *argv(rank)` for every rank (env RANK, WORLD_SIZE, LAUNCH_TIMEOUT_S); None when
    every rank exited 0 in time, else what went wrong with the tail of each rank's log."""
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "LAUNCH_TIMEOUT_S": str(timeout),
           # the ranks import this checkout's cafin and the tests' helpers
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logs = [outdir / f"rank{rank}.log" for rank in range(world)]
    procs = []
    for rank in range(world):
        with open(logs[rank], "wb") as log:
            procs.append(subprocess.Popen([sys.executable, *map(str, argv(rank))], env={**env, "RANK": str(rank)},
                                          stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + timeout
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if not timed_out and all(c == 0 for c in codes):
        return None
    text = "\n".join(f"--- rank {r} (exit {c}) ---\n{logs[r].read_text(errors='replace')[-6000:]}"
                     for r, c in enumerate(codes))
    return ("timed out after %d s\n" % timeout if timed_out else "") + text


def join(outdir) -> tuple[int, int]:
    """In a worker started by `launch`: (rank, world) after joining the group that meets in
    `outdir`."""
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # before the launcher's kill: stacks of every thread in the log, then exit 1
    faulthandler.dump_traceback_later(float(os.environ["LAUNCH_TIMEOUT_S"]) - 20, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(str(outdir), "rendezvous"),
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    return rank, world


def leave() -> None:
    """Tear the group down together (see the module's note)."""
    import torch.distributed as dist
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


# (collective, elements this rank sends, dtype) of every call while COUNTING[0]
CALLS: list[tuple[str, int, str]] = []
# (collective, elements this rank receives from the other ranks, dtype) of every gather-like call
RECEIVED: list[tuple[str, int, str]] = []
COUNTING = [True]


def count_collectives(names) -> None:
    """Record each call of torch.distributed's `names` in CALLS (cafin calls them through the
    module, so patching the module sees every one)."""
    import torch
    import torch.distributed as dist
    for name in names:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, __original=original, __name=name, **kwargs):
            if COUNTING[0]:
                # all_gather(out, in) and all_gather_into_tensor(out, in): count what is sent
                sent = args[1:2] if __name in ("all_gather", "all_gather_into_tensor", "all_gather_single",
                                               "all_to_all_single") else args[:1]
                t = sent[0] if sent and isinstance(sent[0], torch.Tensor) else None
                CALLS.append((__name, -1, "") if t is None
                             else (__name, t.numel(), str(t.dtype).replace("torch.", "")))
                if __name.startswith(("all_gather", "all_to_all_single")) and t is not None:
                    RECEIVED.append((__name, _received(__name, args, kwargs), CALLS[-1][2]))
            return __original(*args, **kwargs)

        setattr(dist, name, wrapper)


def _received(name: str, args, kwargs) -> int:
    """Elements a gather-like call brings this rank from the other ranks (its own part left out)."""
    import torch.distributed as dist
    out, sent = args[0], args[1]
    if name == "all_gather":
        return sum(t.numel() for t in out) - sent.numel()
    if name != "all_to_all_single":
        return out.numel() - sent.numel()
    splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
    group = kwargs.get("group")
    if not splits:
        return out.numel() - out.numel() // dist.get_world_size(group)
    return out.numel() - splits[dist.get_rank(group)]


def full_params(model) -> list:
    """Copies of the model's whole parameters (an FSDP2 shard's DTensor gathered)."""
    from torch.distributed.tensor import DTensor
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def wrap(model, how: str):
    """The model as a rank trains it: "fsdp" (`fully_shard` on every child with parameters, then
    the root; the model itself, now sharded), "ddp" (DistributedDataParallel) or "plain"."""
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for m in model:
            if any(True for _ in m.parameters()):
                fully_shard(m)
        return fully_shard(model)
    if how == "ddp":
        import torch
        return torch.nn.parallel.DistributedDataParallel(model)
    return model
