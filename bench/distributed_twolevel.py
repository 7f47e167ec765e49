"""`python -m bench distributed --member twolevel`: two-level K-FAC's decompositions on owner ranks,
1 and 2 CPU/gloo ranks.

As the K-FAC phase (bench/distributed.py), one torch.multiprocessing launch per world size, one
thread per rank, a fixed global batch split over the ranks, the gradients averaged as DDP does.
TwoLevelKFAC (nicolaides, T_cov = T_inv = 1: every step is an inverse step) on the bench's GPT (its
transformer blocks: two-level refuses the trained token embedding, tied to the head, which then
takes its plain gradient), its MLP and a deeper MLP. Per model and strategy, per rank:

- decompose_cpu_s, decompose_s: CPU (`time.thread_time`) and wall time of this rank's
  decompositions in one step (cafin.maths.twolevel's factor_eigh and coarse_inverse), median
  over the timed steps;
- step_cpu_s, step_s: the whole training step;
- bytes: what two-level's step hands to collectives (the statistics' all_reduce and the
  shared decompositions; the gradient average is not its own);
- matrices: the matrices this rank decomposes per step (of 2 per layer + the coarse matrix).

Strategies at 2 ranks: "owners" (the default: each matrix on one owner rank, the results shared)
and "every_rank" (distribute_decompositions=False: every rank makes every decomposition).
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

from .gloo_ranks import (FULL_MODELS, TINY_MODELS, against_one_rank, count_bytes, forward_backward, medians,
                         render, timed_calls)

STRATEGIES = {"owners": dict(), "every_rank": dict(distribute_decompositions=False)}


def _timed_decompositions(spent: list):
    """Two-level's decompositions (cafin.maths.twolevel's factor_eigh and coarse_inverse)."""
    import cafin.maths.twolevel as maths
    return timed_calls(maths, ("factor_eigh", "coarse_inverse"), spent)


def _rank(rank: int, world: int, outdir: str, tiny: bool, steps: int) -> None:
    import torch.distributed as dist
    import cafin
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(outdir, "rendezvous"),
                            rank=rank, world_size=world)
    counter = [0, False]
    count_bytes(counter)
    rows = []
    for model_name, (make, global_batch) in (TINY_MODELS if tiny else FULL_MODELS).items():
        kind = model_name.split("-")[0]
        for strategy, kw in (STRATEGIES if world > 1 else {"one_rank": {}}).items():
            torch.manual_seed(0)
            model = make()
            pre = cafin.TwoLevelKFAC(model.blocks if kind == "gpt" else model, T_cov=1, T_inv=1, **kw)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            gen = torch.Generator().manual_seed(1)
            spent = [0.0, 0.0, 0]
            decompose, step_times, sent = [], [], []
            for _ in range(steps + 1):  # the first step is a warm-up
                pre.update_stats = True
                start, cpu = forward_backward(kind, model, opt, gen, global_batch, world, rank)
                counter[0], counter[1] = 0, True
                spent[:] = [0.0, 0.0, 0]
                with _timed_decompositions(spent):
                    pre.step(update_params=True)
                counter[1] = False
                decompose.append(tuple(spent))
                sent.append(counter[0])
                opt.step()
                step_times.append((time.perf_counter() - start, time.thread_time() - cpu))
            rows.append(dict(member="twolevel", model=model_name, strategy=strategy, world=world, rank=rank,
                             **medians("decompose", decompose[1:]), **medians("step", step_times[1:]),
                             bytes=sent[-1], matrices=decompose[-1][2], total_matrices=2 * pre.num_layer + 1))
    torch.save(rows, os.path.join(outdir, f"rows_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, tiny: bool, steps: int) -> list[dict]:
    """Run `world` ranks with torch.multiprocessing; every rank's rows."""
    import torch.multiprocessing as mp
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_rank, args=(world, outdir, tiny, steps), nprocs=world, join=True)
        return [row for r in range(world) for row in torch.load(os.path.join(outdir, f"rows_rank{r}.pt"))]


def summarise(one: list[dict], two: list[dict]) -> list[dict]:
    """Per model and strategy at two ranks against one rank (`against_one_rank`)."""
    base = {r["model"]: r for r in one}
    return [dict(member="twolevel", model=model, strategy=strategy,
                 **against_one_rank(base[model], [r for r in two if (r["model"], r["strategy"]) == (model, strategy)],
                                    "decompose", "bytes", "total_matrices"))
            for model, strategy in dict.fromkeys((r["model"], r["strategy"]) for r in two)]


def run(tiny: bool, steps: int) -> tuple[list[dict], list[dict], str]:
    """(rows, summary, the table) of one and two ranks."""
    one = launch(1, tiny, steps)
    two = launch(2, tiny, steps)
    summary = summarise(one, two)
    title = (f"two-level K-FAC's owner ranks, CPU gloo, one thread per rank, T_cov = T_inv = 1, {steps} timed "
             "steps (medians of CPU time, ms; 'decomp/rank' per rank at 2 ranks; ratio: the slowest rank's "
             "against one rank's, CPU time, then wall time)")
    return one + two, summary, title + "\n" + render(summary, "decompose", "bytes", "total_matrices")
