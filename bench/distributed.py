"""`python -m bench distributed`: K-FAC's KAISA strategies and DyKAF's refresh owners on 1 and 2
CPU/gloo ranks.

Each world size is one torch.multiprocessing launch (one thread per rank; the ranks meet through a
file). Every rank trains the bench's models (bench/models.py: the GPT; the MLP at its default
sizes and a deeper one) with KFACPreconditioner, decomposing at every step (inv_update_steps=1),
each rank on its share of a fixed global batch, with the gradients averaged as DDP does. Per
model and strategy it reports, per rank:

- decompose_cpu_s: the CPU time of this rank's decompositions in one inverse step
  (`_decompose`, the median over the timed steps; `time.thread_time`, so ranks that share cores
  with other processes are still measured by the work they do), and decompose_s, its wall time;
  the row's ratio is the slowest rank's against one rank's;
- step_cpu_s, step_s: the whole training step (forward, backward, the gradient average, K-FAC's
  step, SGD), CPU and wall time (the wall time includes waiting for the other rank);
- kfac_bytes: the bytes K-FAC's step hands to collectives per step on this rank (factor
  all-reduce, shared decompositions, shared preconditioned gradients; the gradient average is
  not K-FAC's and is not counted);
- matrices: the factors this rank decomposes per inverse step.

Strategies at 2 ranks: COMM_OPT (grad_worker_fraction 1, factors of a layer together), COMM_OPT
with colocate_factors=False (each factor placed alone; needs compute_eigenvalue_outer_product
False), MEM_OPT (grad_worker_fraction 1/2). One rank runs the default options: its decompositions
are the same work for every strategy.

DyKAF (member "dykaf") trains the same models with its eigenbases refreshed at every step
(precondition_frequency=1): one rank without process_group, two ranks with process_group=WORLD
(each basis refreshed by its owner rank, then shared). Its rows hold refresh_cpu_s / refresh_s
(`cafin.maths.dykaf.refresh_basis`, this rank's refreshes of one step, medians after a warm-up
step), step_cpu_s / step_s, opt_cpu_s (DyKAF's whole step), bytes (what the step hands to
collectives on this rank), matrices (the bases this rank refreshes per step) and factors (the
bases of the model).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from .gloo_ranks import (FULL_MODELS, TINY_MODELS, against_one_rank, count_bytes, forward_backward, medians, render,
                         timed_calls)

STRATEGIES = {
    "comm_opt": dict(),
    "comm_opt_split": dict(colocate_factors=False, compute_eigenvalue_outer_product=False),
    "mem_opt": dict(grad_worker_fraction=0.5),
}
def _timed_decompositions(spent: list):
    """K-FAC's factor decompositions (cafin.maths.kfac's eigen decomposition and damped inverse)."""
    import cafin.maths.kfac as kfac_maths
    return timed_calls(kfac_maths, ("eigen_decompose", "damped_inverse"), spent, count_stacks=True)


def _timed_refreshes(spent: list):
    """DyKAF's basis refreshes (cafin.maths.dykaf.refresh_basis)."""
    import cafin.maths.dykaf as dykaf_maths
    return timed_calls(dykaf_maths, ("refresh_basis",), spent)


def _dykaf_rows(rank: int, world: int, models: dict, steps: int, counter: list) -> list[dict]:
    """DyKAF with a refresh at every step on every model: one row per model for this rank."""
    import torch.distributed as dist
    import cafin
    rows = []
    for model_name, (make, global_batch) in models.items():
        torch.manual_seed(0)
        model = make()
        opt = cafin.DyKAF(model.parameters(), lr=1e-3, precondition_frequency=1,
                          process_group=dist.group.WORLD if world > 1 else None)
        gen = torch.Generator().manual_seed(1)
        refresh_times, step_times, opt_times, sent = [], [], [], []
        spent = [0.0, 0.0, 0]
        matrices = 0
        for step in range(steps + 2):  # the first step builds the state, the second is a warm-up
            start, cpu = forward_backward(model_name.split("-")[0], model, opt, gen, global_batch, world, rank)
            counter[0], counter[1] = 0, True
            spent[:] = [0.0, 0.0, 0]
            opt_cpu = time.thread_time()
            with _timed_refreshes(spent):
                opt.step()
            opt_times.append(time.thread_time() - opt_cpu)
            counter[1] = False
            step_times.append((time.perf_counter() - start, time.thread_time() - cpu))
            if step >= 2:
                refresh_times.append((spent[0], spent[1]))
                sent.append(counter[0])
                matrices = spent[2]
        bases = sum(1 for st in opt.state.values() for f in st.get("factors", []) if f is not None)
        rows.append(dict(member="dykaf", model=model_name, strategy="owners" if world > 1 else "one_rank",
                         world=world, rank=rank,
                         **medians("refresh", refresh_times), **medians("step", step_times[2:]),
                         opt_cpu_s=statistics.median(opt_times[2:]),
                         bytes=sent[-1], matrices=matrices, factors=bases))
    return rows


def _rank(rank: int, world: int, outdir: str, tiny: bool, steps: int, members: tuple = ("kfac", "dykaf")) -> None:
    import torch.distributed as dist
    import cafin
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(outdir, "rendezvous"),
                            rank=rank, world_size=world)
    counter = [0, False]
    count_bytes(counter)
    models = TINY_MODELS if tiny else FULL_MODELS
    strategies = {} if "kfac" not in members else STRATEGIES if world > 1 else {"one_rank": {}}
    rows = []
    for model_name, (make, global_batch) in models.items():
        for strategy, kw in strategies.items():
            torch.manual_seed(0)
            model = make()
            pre = cafin.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, **kw)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            decompose_times: list[tuple[float, float]] = []
            spent = [0.0, 0.0, 0]  # this step's decompositions: seconds, CPU seconds, matrices
            matrices = 0
            gen = torch.Generator().manual_seed(1)
            step_times, kfac_bytes = [], []
            for step in range(steps + 1):  # the first step is a warm-up
                start, cpu = forward_backward(model_name.split("-")[0], model, opt, gen, global_batch, world, rank)
                counter[0], counter[1] = 0, True
                spent[:] = [0.0, 0.0, 0]
                with _timed_decompositions(spent):
                    pre.step()
                counter[1] = False
                if spent[2]:
                    decompose_times.append((spent[0], spent[1]))
                    matrices = spent[2]
                kfac_bytes.append(counter[0])
                opt.step()
                step_times.append((time.perf_counter() - start, time.thread_time() - cpu))
            rows.append(dict(member="kfac", model=model_name, strategy=strategy, world=world, rank=rank,
                             **medians("decompose", decompose_times[1:]), **medians("step", step_times[1:]),
                             kfac_bytes=kfac_bytes[-1], matrices=matrices,
                             factors=sum(1 if cafin.factors.diagonal_input(layer.module) else 2
                                         for layer in pre.layers)))
    if "dykaf" in members:
        rows += _dykaf_rows(rank, world, models, steps, counter)
    torch.save(rows, os.path.join(outdir, f"rows_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, tiny: bool, steps: int, members: tuple = ("kfac", "dykaf")) -> list[dict]:
    """Run `world` ranks with torch.multiprocessing; every rank's rows."""
    import torch.multiprocessing as mp
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_rank, args=(world, outdir, tiny, steps, members), nprocs=world, join=True)
        return [row for r in range(world) for row in torch.load(os.path.join(outdir, f"rows_rank{r}.pt"))]


def summarise(one: list[dict], two: list[dict]) -> list[dict]:
    """K-FAC per model and strategy at two ranks against one rank (`against_one_rank`)."""
    base = {r["model"]: r for r in one if r["member"] == "kfac"}
    two = [r for r in two if r["member"] == "kfac"]
    return [dict(model=model, strategy=strategy,
                 **against_one_rank(base[model], [r for r in two if (r["model"], r["strategy"]) == (model, strategy)],
                                    "decompose", "kfac_bytes", "factors"))
            for model in dict.fromkeys(r["model"] for r in two)
            for strategy in dict.fromkeys(r["strategy"] for r in two)]


def summarise_dykaf(one: list[dict], two: list[dict]) -> list[dict]:
    """DyKAF per model at two ranks (owners) against one rank, with its optimizer step's times."""
    base = {r["model"]: r for r in one if r["member"] == "dykaf"}
    two = [r for r in two if r["member"] == "dykaf"]
    out = []
    for model in dict.fromkeys(r["model"] for r in two):
        rows = [r for r in two if r["model"] == model]
        out.append(dict(model=model, strategy="owners",
                        **against_one_rank(base[model], rows, "refresh", "bytes", "factors"),
                        opt_1rank_cpu_s=base[model]["opt_cpu_s"], opt_cpu_s=max(r["opt_cpu_s"] for r in rows)))
    return out


DYKAF_OPT = (("opt 1", 7, lambda s: f"{s['opt_1rank_cpu_s'] * 1e3:5.0f}ms"),
             ("opt @2", 7, lambda s: f"{s['opt_cpu_s'] * 1e3:5.0f}ms"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench distributed", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="timed inverse steps after one warm-up")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a test of the phase)")
    parser.add_argument("--json", default=None, help="write the rows and the summary here")
    parser.add_argument("--member", choices=("all", "kfac", "dykaf", "twolevel"), default="all",
                        help="K-FAC's strategies, DyKAF's refresh owners, two-level K-FAC's owner ranks "
                             "(bench/distributed_twolevel.py), or all three")
    parser.add_argument("--predict", action="store_true",
                        help="print the cost model's predictions for ResNet-50 and GPT-2 small at 8, 64 "
                             "and 512 ranks (bench/kaisa_model.py) instead")
    args = parser.parse_args(argv)
    if args.predict:
        from .kaisa_model import measure_c, render as render_model
        print(render_model(measure_c()))
        return 0
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    start = time.monotonic()
    members = ("kfac", "dykaf", "twolevel") if args.member == "all" else (args.member,)
    launched = tuple(m for m in members if m != "twolevel")
    one = launch(1, args.tiny, args.steps, launched) if launched else []
    two = launch(2, args.tiny, args.steps, launched) if launched else []
    summary = summarise(one, two) if "kfac" in members else []
    dykaf = summarise_dykaf(one, two) if "dykaf" in members else []
    if summary:
        print(f"K-FAC KAISA, CPU gloo, one thread per rank, inv_update_steps=1, {args.steps} timed steps "
              f"(medians of CPU time, ms; 'decomp/rank' per rank at 2 ranks; ratio: the slowest rank's "
              f"against one rank's, CPU time, then wall time)")
        print(render(summary, "decompose", "kfac_bytes", "factors"))
    if dykaf:
        print(f"DyKAF refresh owners (process_group=WORLD at 2 ranks), CPU gloo, one thread per rank, "
              f"precondition_frequency=1, {args.steps} timed steps (medians of CPU time, ms; 'refresh/rank' "
              f"per rank at 2 ranks; ratio: the slowest rank's against one rank's, CPU time, then wall "
              f"time; opt: DyKAF's step)")
        print(render(dykaf, "refresh", "bytes", "factors", DYKAF_OPT))
    twolevel = {}
    if "twolevel" in members:
        from .distributed_twolevel import run
        rows, twolevel_summary, table = run(args.tiny, args.steps)
        twolevel = {"rows": rows, "summary": twolevel_summary}
        print(table)
    print(f"[{time.monotonic() - start:.0f} s]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": one + two, "summary": summary, "dykaf": dykaf, "twolevel": twolevel}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
