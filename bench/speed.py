"""`python -m bench`: speed, memory and agreement of cafin's optimizers against AdamW, cafin's own
plain-PyTorch references and (given your copy of it) the published code.

Phases (one model per run, ratios within the run; docs/bench.md says how to read them):
- step: the optimizer step alone, on gradients and factors prepared by one real curvature step.
  Variants per optimizer: published (your copy of the published file, --published PATH),
  reference (cafin's plain-PyTorch reference: capturable, eager; not the published code's speed),
  reference-compiled, fused, fused-compiled, cuda-graph (CUDA only); and torch's AdamW (foreach,
  fused) as baselines. The floor is 20 bytes per parameter (read theta, g, m; write theta, m)
  over the copy bandwidth measured in this run.
- statistics (AdaFisher): the curvature work of one curvature step on activations and output
  gradients captured once, fused against the reference, with a per-op breakdown.
- agreement (AdaFisher): fused against reference over --steps training steps in float32.
- K-FAC's own rows (bench/kfac_phases.py, with the step and statistics phases): the
  preconditioner alone, a step that eigendecomposes, the factor statistics, kfac-pytorch when it
  is installed, and the amortised step at inv_update_steps=10 against AdamW and the reference.
- whole-step: zero_grad + forward + backward + step per training iteration, the curvature
  iteration amortised over a cycle of --tcov iterations (bench/whole_step.py): the overhead over
  AdamW that a training run pays.
reference-compiled is not in the default run (--variants adds it): inductor takes 1.5 to 3.5
minutes to compile the reference step of ResNet-18 on 2 cores with a cold cache.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
import warnings
from typing import Callable

import torch

from . import members as members_pkg
from . import published as published_mod
from . import report
from .floors import (EIGENBASIS_LAYERS, check_floors, eigenbasis_products, gemm_size, launch_cost,
                     member_floors)
from .measure import (DEFAULT_TCOV, FULL, QUICK, Context, Run, Skip, adamw_fused_supported,
                      capture_replay, copy_bandwidth, device_name, is_cuda, machine_threads, measure,
                      sgemm_rate)
from .members import VARIANTS, Member
from .peers import PEER_VARIANTS, step_rows as peer_step_rows
from .models import MODELS, batch_for, loss_for, relu_in_place
from .whole_step import run_phase as whole_step_phase

LR = 1e-3
TIMED_TCOV = 10**9  # k % TCov == 0 only at k = 0: the preparing step curves, every timed step does not
DEFAULT_BATCH = {"resnet18": 32, "gpt": 16, "mlp": 128}
BASELINES = ("adamw-foreach", "adamw-fused")
PRODUCTS_ALONE = "products-alone"  # a member's eigenbasis GEMMs and nothing else (bench/floors.py)
PHASES = ("step", "statistics", "agreement", "whole-step", "structures")
# Phases only an explicit --phases runs (SINGD's per-structure rows: minutes, compiles included).
OPT_IN_PHASES = ("structures",)
STEP_VARIANTS = VARIANTS + BASELINES + PEER_VARIANTS  # what --variants may name
FUSED_OPS = ("adafisher_step_", "sumsq_stats_", "conv2d_input_stats_", "norm_input_stats_",
             "norm_grad_stats_", "fisher_average_")
# Kineto (torch.profiler's backend, used here to count allocations) prints "profiler_start" and
# "profiler_stop" lines at its USDT severity, the highest it has: only a level above every
# severity (ENUM_COUNT = 6) quiets it. Its errors concern the profiler only.
KINETO_QUIET = "6"


def fused_kernels_missing(device: torch.device) -> list[str]:
    """The cafin ops with no kernel for this device type in the loaded extension."""
    import cafin  # noqa: F401  (registers the ops)
    key = "CUDA" if is_cuda(device) else "CPU"
    return [op for op in FUSED_OPS
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"cafin::{op}", key)]


# --------------------------------------------------------------------------------- the step
def step_variant(ctx: Context, member: Member, variant: str) -> Callable[[], object]:
    """The callable that runs one optimizer step of `variant` on a model copy whose gradients
    and factors one real curvature step prepared (objects it needs stay alive in its closure)."""
    model = copy.deepcopy(ctx.base)
    if variant == "published":
        relu_in_place(model, False)  # its full backward hooks cannot take in-place activations
        opt = member.published(ctx.published[member.name], model, TIMED_TCOV)
    else:
        backend = "reference" if variant.startswith("reference") else "fused"
        opt = member.build(model, backend, TIMED_TCOV)
    loss_for(ctx.run.model, model(ctx.x), ctx.y).backward()
    opt.step()  # k = 0: a curvature step; the factors are now real, every timed step is plain
    if variant.endswith("-compiled"):
        compiled = torch.compile(opt.step, fullgraph=True)

        def run_compiled():
            with torch.no_grad():
                compiled()
        return run_compiled
    if variant == "cuda-graph":
        return capture_replay(opt.step, ctx.run.device)
    return opt.step


def adamw_variant(ctx: Context, variant: str) -> Callable[[], object]:
    model = copy.deepcopy(ctx.base)
    loss_for(ctx.run.model, model(ctx.x), ctx.y).backward()
    kind = variant.split("-", 1)[1]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **{kind: True})
    return opt.step  # its first (warm-up) call creates the state


# --------------------------------------------------------------------------------- the run
def _step_phase(ctx: Context) -> None:
    run, progress = ctx.run, ctx.progress
    for member in ctx.members:
        for variant in member.variants():
            if variant not in ctx.selected(member):
                continue
            why = ctx.why_not(member, variant)
            if why:
                run.skipped.append(Skip(run.model, "step", variant, why, optimizer=member.name))
                continue
            measure(run, progress, "step", member.name, variant,
                    lambda m=member, v=variant: step_variant(ctx, m, v))
        layers = EIGENBASIS_LAYERS.get(member.name)
        if layers is not None and "fused" in ctx.selected(member) and not ctx.why_not(member, "fused"):
            # The member's GEMMs alone at its shapes: how far its step is from what this device's
            # GEMMs give, beside how far it is from the floor's 512^3 rate.
            measure(run, progress, "step", member.name, PRODUCTS_ALONE,
                    lambda f=layers: eigenbasis_products(f(ctx.base), run.device))
    for variant in BASELINES:
        if variant not in ctx.baselines:
            continue
        if variant == "adamw-fused" and not adamw_fused_supported(run.device):
            run.skipped.append(Skip(run.model, "step", variant, "this torch build has no fused "
                                    f"AdamW for {run.device.type}", optimizer="adamw"))
            continue
        measure(run, progress, "step", "adamw", variant, lambda v=variant: adamw_variant(ctx, v))
    peer_step_rows(ctx)  # torch's Muon and heavyball's SOAP (bench/peers.py)


def _member_floors(ctx: Context, progress) -> None:
    """The float32 GEMM rate of this device, and with it and the copy bandwidth each selected
    member's step floor (bench/floors.py) in run.floor["members"]; a member whose floor cannot be
    counted on this model (it refuses the model) gets a skip that says why."""
    run = ctx.run
    n = gemm_size(run.device)
    task = progress.add_task(f"floor      sgemm {n}^3, launch cost", total=1)
    rate, launch_s = sgemm_rate(n, run.device), launch_cost(run.device)
    progress.advance(task)
    floors, failed = member_floors(ctx.base, [m.name for m in ctx.members])
    run.floor.update(sgemm_gflop_s=rate / 1e9, sgemm_n=n, launch_us=launch_s * 1e6,
                     members=[f.to_json(rate, ctx.bandwidth, launch_s) for f in floors])
    for name, why in failed.items():
        run.skipped.append(Skip(run.model, "floor", "-", f"no step floor: {why}", optimizer=name))


def bench(run: Run, ctx_args: dict, console) -> None:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn)
    device, name = run.device, run.model
    torch.manual_seed(0)
    base = MODELS[name]().to(device)
    base.train()
    x, y = (t.to(device) for t in batch_for(name, base, run.batch_size,
                                            generator=torch.Generator().manual_seed(0)))
    missing = fused_kernels_missing(device)
    columns = (SpinnerColumn(), TextColumn("{task.description:<40}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        ctx = Context(run=run, progress=progress, base=base, x=x, y=y, fused_ok=not missing,
                      why_not_fused=f"no {device.type} kernel for cafin::{', '.join(missing)}",
                      **ctx_args)
        # The floor: copy a buffer pair with the step's working set (theta, g, m, and the write).
        task = progress.add_task("floor      copy bandwidth", total=1)
        params = sum(p.numel() for p in base.parameters() if p.requires_grad)
        numel = max(2 * params, 1 << 20)
        ctx.bandwidth = copy_bandwidth(numel, device)
        progress.advance(task)
        step_bytes = 20 * params
        run.floor = {"model": name, "copy_bandwidth_gb_s": ctx.bandwidth / 1e9,
                     "copy_buffer_bytes": 4 * numel, "parameters": params,
                     "bytes_per_step": step_bytes, "step_floor_ms": step_bytes / ctx.bandwidth * 1e3}
        _member_floors(ctx, progress)
        if "step" in ctx.phases:
            _step_phase(ctx)
            check_floors(run, PRODUCTS_ALONE)
        for member in ctx.members:
            if member.details is not None:
                member.details(ctx)
        if "whole-step" in ctx.phases:
            whole_step_phase(ctx)


def environment(device: torch.device, threads: int) -> dict:
    import cafin
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
            "device_name": device_name(device), "threads": threads,
            "cuda_kernels_built": bool(cafin.cuda_kernels_built()),
            "fused_kernels_for_device": not fused_kernels_missing(device),
            "load_average_1m": load}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None,
                        help="cpu or cuda[:i] (default: cuda when available, else cpu)")
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"default per model: {DEFAULT_BATCH}")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps of the agreement check (default 3, 2 with --quick)")
    parser.add_argument("--tcov", type=int, default=DEFAULT_TCOV,
                        help="the curvature interval over which the whole-step phase averages a "
                             f"training iteration (default {DEFAULT_TCOV}, the published TCov)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every core this process may use); on a "
                             "machine other processes share, 1 gives steadier ratios")
    parser.add_argument("--statistics-threads", default=None,
                        help="comma list of the thread counts at which AdaFisher's per-op "
                             "statistics breakdown is measured, interleaved, each against the "
                             "copy floor at that count (default on the CPU: 1 and --threads)")
    parser.add_argument("--quick", action="store_true",
                        help="short budgets (under a minute on 2 CPU cores)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", metavar="PATH",
                        help="write the results as Markdown tables (as in docs/bench.md)")
    parser.add_argument("--optimizers", default=None, metavar="NAME,...",
                        help="the members to bench (default: all of them): "
                             + ", ".join(members_pkg.registry()))
    parser.add_argument("--published", action="append", metavar="[NAME=]PATH",
                        help="your own copy of a member's published implementation, imported from "
                             "PATH and timed beside cafin (PATH alone: AdaFisher's AdaFisher.py); "
                             "cafin does not ship it")
    parser.add_argument("--phases", default=None,
                        help=f"comma list out of {', '.join(PHASES)} (default: all but "
                             f"{', '.join(OPT_IN_PHASES)}; structures: SINGD per structure "
                             "against singd, --model mlp or gpt)")
    parser.add_argument("--variants", default=None,
                        help="comma list of the variants to run (default: each optimizer's "
                             f"headline set) out of {', '.join(STEP_VARIANTS)}; 'reference' and "
                             "'fused' also select AdaFisher's statistics variants of those names")
    args = parser.parse_args(argv)
    if args.batch_size is not None and args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.tcov < 1:
        parser.error("--tcov must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.statistics_threads is not None:
        try:
            counts = [int(v) for v in args.statistics_threads.split(",") if v.strip()]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            parser.error(f"--statistics-threads: a comma list of thread counts >= 1, got "
                         f"{args.statistics_threads!r}")
        args.statistics_threads = sorted(set(counts))
    try:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        args.members = members_pkg.select(args.optimizers, args.model, torch.device(device).type)
        args.left_out = [m for m in members_pkg.registry().values()
                         if not args.optimizers and m not in args.members]
        args.published = published_mod.parse(args.published, members_pkg.registry())
    except ValueError as exc:
        parser.error(f"--optimizers: {exc}" if "unknown optimizer" in str(exc) else str(exc))
    chosen = {m.name for m in args.members}
    for name in args.published:
        if name not in chosen:
            parser.error(f"--published {name}: {name} is not among --optimizers")
    args.phases = (_comma_set(parser, "--phases", args.phases, set(PHASES))
                   or set(PHASES) - set(OPT_IN_PHASES))
    args.variants = _comma_set(parser, "--variants", args.variants,
                               set(STEP_VARIANTS) | {"agreement"})
    if args.variants and "agreement" in args.variants:  # the old spelling of --phases agreement
        args.variants.discard("agreement")
        args.phases.add("agreement")
    return args


def _comma_set(parser, flag: str, value: str | None, known: set[str]) -> set[str] | None:
    if not value:
        return None
    got = {v.strip() for v in value.split(",") if v.strip()}
    unknown = got - known
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join(sorted(known))}")
    return got


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)  # read when the profiler first starts
    from rich.console import Console

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if is_cuda(device) and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available in this torch build", file=sys.stderr)
        return 2
    loaded = {}
    for name, path in args.published.items():
        try:
            loaded[name] = published_mod.load(name, path, members_pkg.registry()[name])
        except published_mod.PublishedError as exc:
            print(exc, file=sys.stderr)
            return 2
    if is_cuda(device) and device.index is not None:
        torch.cuda.set_device(device)
    threads = args.threads or machine_threads()
    torch.set_num_threads(threads)
    # torch.optim's step wrapper opens a profiler region that dynamo notes it drops: noise here.
    for logger in ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch"):
        logging.getLogger(logger).addFilter(
            lambda record: "will be ignored" not in record.getMessage())
    # The published code's full backward hook on the first layer, whose input needs no gradient,
    # warns once per process that it fires on the output gradient: what it should do, so noise.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are "
                            "computed with respect to module outputs")

    chosen = {}
    for member in args.members:
        pool = set(member.variants())
        chosen[member.name] = pool & (args.variants if args.variants else set(member.default_variants))
    baselines = (args.variants & set(BASELINES)) if args.variants else set(BASELINES)

    # A log or a pipe gets the width the widest table needs whole (proxies.py does the same).
    console = Console(width=None if sys.stdout.isatty() else 160)
    began = time.perf_counter()
    run = Run(model=args.model, device=device,
              batch_size=args.batch_size or DEFAULT_BATCH[args.model],
              steps=args.steps or (2 if args.quick else 3), quick=args.quick,
              budget=QUICK if args.quick else FULL, tcov=args.tcov,
              optimizers=[m.name for m in args.members],
              published={k: os.path.abspath(v) for k, v in args.published.items()})
    env = environment(device, threads)
    console.print(report.header(env, run))
    if args.left_out:
        names = ",".join(m.name for m in args.left_out)
        console.print(f"not in the default {args.model} run on the CPU: "
                      f"{', '.join(m.label for m in args.left_out)} (their decompositions of this "
                      f"model's large factors take minutes here); run them with "
                      f"`python -m bench --model gpt --optimizers {names}` (or name them with "
                      f"--optimizers on this model)")
    bench(run, dict(members=args.members, published=loaded, chosen=chosen, baselines=baselines,
                    phases=args.phases, requested=set(args.variants or ()),
                    statistics_threads=args.statistics_threads), console)
    elapsed = time.perf_counter() - began
    if hasattr(os, "getloadavg"):
        env["load_average_1m_end"] = os.getloadavg()[0]
    targets = report.targets(run, args.members)
    report.print_all(console, run, env, targets, elapsed, args.members)
    if args.json:
        out = {"environment": env, "floor": run.floor,
               "results": [r.to_json() for r in run.results],
               "whole_step": run.whole_step,
               "whole_step_from_phases": run.whole_step_from_phases,
               "agreement": run.agreement,
               "statistics_breakdown": [{"model": run.model, "variant": "fused", **b}
                                        for b in run.breakdown],
               "targets": targets,
               "skipped": [s.to_json() for s in run.skipped],
               "config": {"model": run.model, "batch_size": run.batch_size, "steps": run.steps,
                          "quick": run.quick, "lr": LR, "tcov": run.tcov,
                          "optimizers": run.optimizers, "published": run.published,
                          "phases": sorted(args.phases), "elapsed_s": elapsed}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        console.print(f"JSON written to {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown(run, env, targets, elapsed, args.members))
        console.print(f"Markdown written to {args.markdown}")
    return 1 if any(s.error for s in run.skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
