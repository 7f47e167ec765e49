"""`python -m bench convergence --task autoencoder`: the two-level K-FAC paper's experiment, small.

Koroko et al. (arXiv 2303.18083) compare K-FAC with two-level K-FAC (a coarse-space correction
that couples the layers again) on deep autoencoders, the classic K-FAC benchmark shape, and find
the correction "does not really improve the performance of KFAC". Here: a 64-128-64-16-64-128-64
tanh MLP autoencoder with a sigmoid output on scikit-learn's bundled digits (1797 8x8 images
scaled to [0, 1]), MSE loss, batches of 64 drawn with replacement from a generator seeded per run.

Methods (SGD momentum 0.9 steps after each preconditioner):
  K-FAC               TwoLevelKFAC's own K-FAC with the coarse correction off (the paper's
                      baseline: same factors, damping, schedule, clipping)
  two-level, <space>  cafin.TwoLevelKFAC, coarse_space nicolaides / spectral / residual /
                      tselepidis, and nicolaides / residual with krylov=True
  preconditioner      damping 0.1, T_cov = T_inv = 10, alpha 0.95, constraint_norm with clipping
                      1e-2, SGD lr 0.3 (with damping 1e-2 and no clipping K-FAC diverged at every
                      lr tried above 1e-3)
  SGD                 lr 0.5, momentum 0.9;  Adam  lr 3e-3 (a few values tried, no more)

Reported per method (mean +- std over seeds): the full-data loss at steps N/3 and N, the
training time per step (zero_grad, forward, backward, preconditioner, optimizer step; the
full-data loss evaluated after each step is not counted) and the loss against steps and against
that training time (the plot).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch
from torch import nn

from .members import twolevel as twolevel_member

SIZES = (64, 128, 64, 16, 64, 128, 64)
PRECONDITIONER = dict(damping=0.1, T_cov=10, T_inv=10, alpha=0.95, constraint_norm=True,
                      clipping=1e-2)
LR = {"SGD": 0.5, "Adam": 3e-3, "K-FAC": 0.3}
DEFAULT_STEPS = 300
DEFAULT_SEEDS = 3
DEFAULT_BATCH = 64


def methods() -> dict[str, tuple[str | None, bool] | None]:
    """name -> (coarse space or None for the correction off, krylov); None: a torch optimizer."""
    out: dict[str, tuple[str | None, bool] | None] = {"SGD": None, "Adam": None, "K-FAC": (None, False)}
    for c in twolevel_member.COARSE_SPACES:
        out[f"two-level {c}"] = (c, False)
    for c in twolevel_member.KRYLOV_SPACES:
        out[f"two-level {c} + krylov"] = (c, True)
    return out


def autoencoder() -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers, nn.Sigmoid())


def load_digits_01() -> torch.Tensor:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("bench convergence needs scikit-learn: pip install -e .[bench]") from e
    return torch.tensor(load_digits().data / 16.0, dtype=torch.float32)


def build(method: str, spec, net: nn.Module, backend: str):
    if method == "SGD":
        return torch.optim.SGD(net.parameters(), lr=LR["SGD"], momentum=0.9)
    if method == "Adam":
        return torch.optim.Adam(net.parameters(), lr=LR["Adam"])
    coarse, krylov = spec
    return twolevel_member.sgd(net, LR["K-FAC"], coarse, krylov, backend=backend, **PRECONDITIONER)


def run(method: str, spec, seed: int, data: torch.Tensor, steps: int, batch: int,
        backend: str) -> dict:
    """One training run: the full-data loss after every step and the training time so far."""
    torch.manual_seed(seed)
    net = autoencoder()
    opt = build(method, spec, net, backend)
    g = torch.Generator().manual_seed(seed)
    loss_fn = nn.functional.mse_loss
    losses, times, spent = [], [], 0.0
    for _ in range(steps):
        x = data[torch.randint(0, data.shape[0], (batch,), generator=g)]
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(net(x), x).backward()
        opt.step()
        spent += time.perf_counter() - start
        with torch.no_grad():
            losses.append(float(loss_fn(net(data), data)))
        times.append(spent)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return {"loss": losses, "time_s": times}


def _mean_std(values) -> tuple[float, float]:
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_experiment(steps: int = DEFAULT_STEPS, seeds: int = DEFAULT_SEEDS,
                   batch: int = DEFAULT_BATCH, threads: int = 1, names: str | None = None,
                   backend: str = "fused",
                   progress: Callable[[str], None] | None = None) -> dict:
    data = load_digits_01()
    table = methods()
    if names:
        wanted = [n.strip().lower() for n in names.split(",") if n.strip()]
        chosen = {m: s for m, s in table.items() if any(m.lower().startswith(w) for w in wanted)}
        if not chosen:
            raise SystemExit(f"no method matches {names!r}; choose from {list(table)}")
        table = chosen
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run("SGD", None, 0, data, 5, batch, backend)  # warm-up: first calls pay allocation
        all_runs: dict[str, list[dict]] = {m: [] for m in table}
        for seed in range(seeds):  # seed-major, so that load drift spreads over all methods
            for method, spec in table.items():
                if progress:
                    progress(f"{method}, seed {seed}")
                all_runs[method].append(run(method, spec, seed, data, steps, batch, backend))
        results = {}
        for method, runs in all_runs.items():
            mid = max(steps // 3, 1)
            at_mid = _mean_std(r["loss"][mid - 1] for r in runs)
            at_end = _mean_std(r["loss"][-1] for r in runs)
            ms = _mean_std(1e3 * r["time_s"][-1] / steps for r in runs)
            results[method] = {"loss_at_third": at_mid, "loss_at_end": at_end,
                               "ms_per_step": ms, "runs": runs}
    finally:
        torch.set_num_threads(previous)
    config = {"task": "autoencoder", "sizes": SIZES, "data": "sklearn digits / 16 (1797 x 64)",
              "loss": "MSE, full data after every step", "steps": steps, "seeds": seeds,
              "batch": batch, "threads": threads, "backend": backend,
              "preconditioner": PRECONDITIONER, "lr": LR, "torch": torch.__version__,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    return {"config": config, "methods": results}


def render(results: dict):
    from rich.table import Table
    cfg = results["config"]
    mid = max(cfg["steps"] // 3, 1)
    table = Table(title=f"Digits autoencoder {'-'.join(map(str, cfg['sizes']))}, batch "
                        f"{cfg['batch']}, {cfg['seeds']} seed(s): full-data train MSE")
    table.add_column("method", no_wrap=True)
    table.add_column(f"loss at step {mid}", justify="right")
    table.add_column(f"loss at step {cfg['steps']}", justify="right")
    table.add_column("vs K-FAC at the end", justify="right")
    table.add_column("ms / step", justify="right")
    kfac = results["methods"].get("K-FAC")
    for name, r in results["methods"].items():
        rel = ""
        if kfac is not None and name.startswith("two-level"):
            rel = f"{100 * (r['loss_at_end'][0] / kfac['loss_at_end'][0] - 1):+.1f} %"
        table.add_row(name, f"{r['loss_at_third'][0]:.4f} ± {r['loss_at_third'][1]:.4f}",
                      f"{r['loss_at_end'][0]:.4f} ± {r['loss_at_end'][1]:.4f}", rel,
                      f"{r['ms_per_step'][0]:.2f}")
    table.caption = (f"Mean ± std over seeds. ms / step: training time only (zero_grad, forward, "
                     f"backward, preconditioner, SGD/Adam), the full-data evaluation excluded; "
                     f"torch {cfg['torch']}, {cfg['threads']} thread(s), {cfg['machine']}.")
    return table


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    cfg = results["config"]
    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab10")
    for i, (name, r) in enumerate(results["methods"].items()):
        loss = np.array([run["loss"] for run in r["runs"]])
        t = np.array([run["time_s"] for run in r["runs"]]).mean(0)
        style = dict(color=colors(i % 10), lw=1.5,
                     ls="-" if not name.startswith("two-level") or "krylov" not in name
                     else (0, (5, 2)))
        steps = np.arange(1, loss.shape[1] + 1)
        ax_step.plot(steps, loss.mean(0), label=name, **style)
        ax_time.plot(t, loss.mean(0), label=name, **style)
        if loss.shape[0] > 1:
            ax_step.fill_between(steps, loss.min(0), loss.max(0), color=colors(i % 10),
                                 alpha=0.08, lw=0)
    for ax, label in ((ax_step, "step"), (ax_time, "training time, s (CPU; evaluation excluded)")):
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("train MSE (full data)")
        ax.grid(alpha=0.25)
    ax_step.legend(fontsize=8)
    band = "; band = min-max over seeds" if cfg["seeds"] > 1 else ""
    fig.suptitle(f"digits autoencoder {'-'.join(map(str, cfg['sizes']))}, batch {cfg['batch']}, "
                 f"mean of {cfg['seeds']} seed(s){band}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench convergence --task autoencoder",
        description="K-FAC vs two-level K-FAC (each coarse space) vs SGD and Adam on a deep MLP "
                    "autoencoder of the digits: the two-level paper's experiment, small.")
    parser.add_argument("--steps", type=int, default=None, help=f"default {DEFAULT_STEPS}")
    parser.add_argument("--seeds", type=int, default=None, help=f"default {DEFAULT_SEEDS}")
    parser.add_argument("--quick", action="store_true", help="1 seed, 60 steps")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--threads", type=int, default=1,
                        help="tiny matrices: more threads only contend (default 1)")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated method name prefixes, e.g. 'k-fac,two-level nic'")
    parser.add_argument("--backend", default="fused", choices=("fused", "reference"))
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of the curves")
    parser.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (60 if args.quick else DEFAULT_STEPS)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else DEFAULT_SEEDS)
    for flag, value in (("--steps", steps), ("--seeds", seeds), ("--batch-size", args.batch_size),
                        ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e .[bench]")
    from rich.console import Console
    console = Console()
    start = time.perf_counter()
    with console.status("training") as status:
        results = run_experiment(steps, seeds, args.batch_size, args.threads, args.optimizers,
                                 args.backend, lambda s: status.update(f"training: {s}"))
    results["config"]["wall_s"] = time.perf_counter() - start
    console.print(render(results))
    console.print(f"Wall time {results['config']['wall_s']:.0f} s.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        console.print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        console.print(f"wrote {args.plot}")
    return 0
