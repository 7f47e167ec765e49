"""`python -m bench convergence --task text`: a small GPT trained byte-level on real text, every
member against AdamW with the same number of steps and the same wall-clock budget.

Data: the Python standard library's own source files (`sysconfig.get_paths()["stdlib"]`, the
`*.py` files directly in it, sorted by name), split once by file with a seeded shuffle
(`SPLIT_SEED`; a tenth of the files held out), each side the concatenation of its files' bytes
cut to a fixed length (`TRAIN_BYTES`, `HELDOUT_BYTES`), so that a run reads the same bytes on
every machine with the same Python. The held-out loss is the mean cross-entropy (nats per byte)
of `EVAL_WINDOWS` fixed windows spread evenly over the held-out bytes, every `--eval-every` steps.
Training batches are random windows drawn from the training bytes by a generator seeded with
`--seed` (every member sees the same batches).

Model: bench/models.py's GPT, GPT-2 style (token and position embeddings, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, a decoder tied to the token embedding), byte vocabulary 256;
by default 2 layers, width 128, 4 heads, context 128 (about 0.44M parameters). The members hook
its Linear layers (attention's qkv and output projections, the MLP, the tied decoder).

Members and their settings (constant lr, no schedule or clipping, nothing tuned on this task; a
few values were tried only to check that the defaults train at all):

  AdamW            lr 1e-3, betas (0.9, 0.99), weight decay 0.1: nanoGPT's small character-level
                   GPT settings (its warm-up and cosine decay dropped)
  AdaFisher        the digits task's settings (beta 0.9, Lambda 1e-3, gamma 0.8, TCov 5) with lr
                   1e-4, the best of 1e-3, 3e-4, 1e-4 in one 40-step check (batch 8, seed 0:
                   held-out loss 3.29, 3.23, 3.18)
  AdaFisherW       the same, decoupled weight decay 1e-2
  K-FAC + SGD      the digits task's K-FAC (kfac-pytorch's CIFAR example: damping 3e-3, kl_clip
                   1e-3, factors every step, eigendecompositions every 10; SGD momentum 0.9, wd
                   5e-4, lr 0.1 at batch 128 scaled to the batch)
  K-FAC + AdamW    the same preconditioner, then AdamW's row settings
  SINGD            singd's defaults (dense, momentum 0.9, damping 1e-3, alpha1 0.5, T 10, lr_cov
                   1e-2) with lr 1e-2: its default lr 1e-3 was at 4.75 after 10 steps of batch 16
                   where AdamW was at 3.89, and 1e-2 beat 3e-3 in the 40-step check (3.19, 3.42).
                   SINGD trains its Linear and Embedding layers; the rest (the LayerNorms)
                   takes AdamW's row settings
  DyKAF            the published usage (lr 3e-3, betas (0.95, 0.95), init "eps", wd 0.01,
                   precondition_frequency 10)
  two-level K-FAC  the digits task's settings, on the transformer blocks (it preconditions no
                   Embedding, and the head is the embedding's weight); SGD on every parameter

The peers a user would compare with (bench/peers.py), on the same batches and budget:

  Muon + AdamW     torch.optim.Muon as its documentation prescribes: lr 0.02, momentum 0.95,
                   nesterov, ns_steps 5, wd 0.1 on the blocks' Linear weights (attention's qkv and
                   output projections, the MLP); AdamW's row settings on the token embedding
                   (and so the tied head), the position table, the biases and the LayerNorms
  SOAP (heavyball) heavyball.SOAP's defaults (lr 3e-3, betas (0.9, 0.95), shampoo_beta 0.95, wd
                   0.01, precondition_frequency 2), eager; only when heavyball imports

Budgets: every member trains `--steps` steps; the wall-clock budget is AdamW's training time for
those steps (or `--budget` seconds), and a member that has not used it after `--steps` steps
trains on until it has (at most `MAX_STEP_FACTOR` times the steps). Training time counts
zero_grad, forward, backward and the step; the held-out evaluations are not counted. The table
gives the held-out loss after `--steps` steps and at the budget (after the step that uses it up:
a run is evaluated at that step too, and the table gives how many steps it took). A run whose training or held-out loss
is not finite stops there and is reported as diverged; a member that raises is reported with its
error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import cafin

from .measure import PreconditionedSGD
from .members import kfac as kfac_member
from .members import twolevel as twolevel_member
from .models import GPT
from .peers import MUON_TEXT, muon_adamw, soap, soap_available

SPLIT_SEED = 0
HELDOUT_FRACTION = 0.1
TRAIN_BYTES = 2 ** 21  # 2 MiB of the training files
HELDOUT_BYTES = 2 ** 17  # 128 KiB of the held-out files
EVAL_WINDOWS = 32
MAX_STEP_FACTOR = 4
DEFAULTS = dict(steps=400, batch_size=16, eval_every=20, layers=2, width=128, heads=4, context=128)
QUICK = dict(steps=60, batch_size=8, eval_every=10)


# ----------------------------------------------------------------------------------- data
@dataclass
class TextData:
    train: torch.Tensor  # [TRAIN_BYTES] int64 byte values
    heldout: torch.Tensor
    train_files: list[str]  # names relative to the stdlib directory
    heldout_files: list[str]
    root: str


def split_files(root: str | None = None, seed: int = SPLIT_SEED,
                fraction: float = HELDOUT_FRACTION) -> tuple[list[str], list[str]]:
    """The standard library's top-level *.py files, sorted, shuffled by a generator seeded with
    `seed` and split: (train, held-out), each sorted by name."""
    root = root or sysconfig.get_paths()["stdlib"]
    names = sorted(p.name for p in Path(root).glob("*.py") if p.is_file())
    if len(names) < 2:
        raise SystemExit(f"the text task needs Python source files in {root}; found {len(names)}")
    shuffled = names[:]
    random.Random(seed).shuffle(shuffled)
    held = max(1, round(fraction * len(names)))
    return sorted(shuffled[held:]), sorted(shuffled[:held])


def _bytes_of(root: str, names: Sequence[str], count: int, side: str) -> torch.Tensor:
    chunks, total = [], 0
    for name in names:
        if total >= count:
            break
        data = (Path(root) / name).read_bytes()
        chunks.append(data)
        total += len(data)
    if total < count:
        raise SystemExit(f"the {side} files in {root} hold {total} bytes; the text task reads {count}")
    data = b"".join(chunks)[:count]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def load_text(root: str | None = None, train_bytes: int = TRAIN_BYTES,
              heldout_bytes: int = HELDOUT_BYTES) -> TextData:
    """The first `train_bytes` bytes of the training files and the first `heldout_bytes` of the
    held-out files, each concatenated in name order."""
    root = root or sysconfig.get_paths()["stdlib"]
    train, held = split_files(root)
    return TextData(_bytes_of(root, train, train_bytes, "training"), _bytes_of(root, held, heldout_bytes, "held-out"),
                    train, held, root)


def random_batch(data: torch.Tensor, context: int, batch_size: int, generator: torch.Generator):
    """`batch_size` windows of `context + 1` bytes at random offsets: (inputs, next bytes)."""
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data: torch.Tensor, context: int, count: int = EVAL_WINDOWS):
    """`count` windows spread evenly over `data`: (inputs, next bytes)."""
    starts = torch.linspace(0, len(data) - context - 1, count).long()
    windows = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def make_model(seed: int, layers: int, width: int, heads: int, context: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab=256, dim=width, depth=layers, heads=heads, context=context)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------------- members
@dataclass(frozen=True)
class MemberSpec:
    name: str
    hyperparameters: str
    build: Callable[[nn.Module], object] = field(repr=False)  # -> zero_grad(), step()


class Chain:
    """Several optimizers stepped as one (SINGD on its layers, AdamW on the rest)."""

    def __init__(self, *optimizers) -> None:
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def remove_hooks(self) -> None:
        for opt in self.optimizers:
            if hasattr(opt, "remove_hooks"):
                opt.remove_hooks()


ADAMW = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
ADAFISHER = dict(lr=1e-4, beta=0.9, Lambda=1e-3, gamma=0.8, TCov=5)
SINGD = dict(lr=1e-2, momentum=0.9, damping=1e-3, alpha1=0.5, T=10, lr_cov=1e-2)
DYKAF = dict(lr=3e-3, betas=(0.95, 0.95), init="eps", weight_decay=0.01, precondition_frequency=10)
TWOLEVEL = dict(damping=0.1, T_cov=10, T_inv=10, alpha=0.95, constraint_norm=True, clipping=1e-2)


def _backend() -> str:
    return "fused" if torch._C._dispatch_has_kernel_for_dispatch_key("cafin::adafisher_step_", "CPU") else "reference"


def _kfac(model: nn.Module, follower: torch.optim.Optimizer, lr: float, backend: str) -> PreconditionedSGD:
    pre = cafin.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10, lr=lr, backend=backend,
                                   **kfac_member.PRECONDITIONER)
    return PreconditionedSGD(pre, follower)


def _singd(model: nn.Module, backend: str) -> Chain:
    singd = cafin.SINGD(model, warn_unsupported=False, backend=backend, **SINGD)
    mine = {p for group in singd.param_groups for p in group["params"]}
    rest = [p for p in model.parameters() if p.requires_grad and p not in mine]
    return Chain(singd, torch.optim.AdamW(rest, **ADAMW)) if rest else Chain(singd)


def member_specs(batch_size: int, backend: str | None = None) -> list[MemberSpec]:
    """Every member with the settings of the module docstring, AdamW first (its time sets the
    wall-clock budget)."""
    backend = backend or _backend()
    sgd_lr = kfac_member.lr_for(batch_size)
    adamw_text = "lr 1e-3, betas (0.9, 0.99), wd 0.1"
    ada_text = "lr 1e-4, β 0.9, Λ 1e-3, γ 0.8, TCov 5"
    return [
        MemberSpec("AdamW", adamw_text, lambda m: torch.optim.AdamW(m.parameters(), **ADAMW)),
        MemberSpec(f"AdaFisher ({backend})", ada_text,
                   lambda m: cafin.AdaFisher(m, backend=backend, **ADAFISHER)),
        MemberSpec(f"AdaFisherW ({backend})", ada_text + ", wd 1e-2 (decoupled)",
                   lambda m: cafin.AdaFisherW(m, backend=backend, weight_decay=1e-2, **ADAFISHER)),
        MemberSpec(f"K-FAC + SGD ({backend})",
                   f"damping 3e-3, kl_clip 1e-3, factors every step, inverses every 10; SGD lr {sgd_lr:g} "
                   "momentum 0.9 wd 5e-4",
                   lambda m: _kfac(m, torch.optim.SGD(m.parameters(), lr=sgd_lr, **kfac_member.SGD), sgd_lr,
                                   backend)),
        MemberSpec(f"K-FAC + AdamW ({backend})",
                   f"damping 3e-3, kl_clip 1e-3, factors every step, inverses every 10; AdamW {adamw_text}",
                   lambda m: _kfac(m, torch.optim.AdamW(m.parameters(), **ADAMW), ADAMW["lr"], backend)),
        MemberSpec(f"SINGD ({backend})",
                   "dense, lr 1e-2, momentum 0.9, damping 1e-3, α1 0.5, T 10, lr_cov 1e-2; AdamW on the "
                   "LayerNorms",
                   lambda m: _singd(m, backend)),
        MemberSpec(f"DyKAF ({backend})", "lr 3e-3, betas (0.95, 0.95), init eps, wd 0.01, "
                   "precondition_frequency 10",
                   lambda m: cafin.DyKAF(m.parameters(), backend=backend, **DYKAF)),
        MemberSpec("two-level K-FAC (nicolaides)", f"damping 0.1, T_cov = T_inv = 10, α 0.95, constraint_norm, "
                   f"clipping 1e-2; SGD lr {sgd_lr:g} momentum 0.9",
                   lambda m: twolevel_member.sgd(m, sgd_lr, "nicolaides", backend=backend, **TWOLEVEL)),
    ] + peer_specs()


def peer_specs() -> list[MemberSpec]:
    """torch's Muon (with AdamW's row settings on what Muon's documentation gives to AdamW) and
    heavyball's SOAP on its defaults, eager (when heavyball imports)."""
    specs = [MemberSpec("Muon + AdamW (torch)", f"{MUON_TEXT} on the blocks' Linear weights; AdamW "
                        "lr 1e-3, betas (0.9, 0.99), wd 0.1 on the rest",
                        lambda m: muon_adamw(m, ADAMW))]
    if soap_available()[0]:
        specs.append(MemberSpec("SOAP (heavyball)", "heavyball defaults: lr 3e-3, betas (0.9, 0.95), "
                                "shampoo_beta 0.95, wd 0.01, precondition_frequency 2; eager",
                                lambda m: soap(m.parameters(), eager=True)))
    return specs


def select(specs: Sequence[MemberSpec], names: str | None) -> list[MemberSpec]:
    """Comma-separated, case-insensitive name prefixes; None: every member."""
    if not names:
        return list(specs)
    wanted = [n.strip().lower() for n in names.split(",") if n.strip()]
    unknown = [w for w in wanted if not any(s.name.lower().startswith(w) for s in specs)]
    if unknown:
        raise SystemExit(f"unknown member(s) {unknown}; choose from {[s.name for s in specs]}")
    return [s for s in specs if any(s.name.lower().startswith(w) for w in wanted)]


# ----------------------------------------------------------------------------------- training
@dataclass
class Config:
    steps: int
    batch_size: int
    eval_every: int
    layers: int
    width: int
    heads: int
    context: int
    seed: int = 0
    budget_s: float | None = None  # None: AdamW's time for `steps`, or no budget without AdamW


def train(spec: MemberSpec, data: TextData, config: Config, budget_s: float | None = None) -> dict:
    """One run: the held-out loss at step 0 and every `eval_every` steps (and at `steps`, and when
    the run crosses `budget_s`), with the training time spent so far; the training loss of every
    step. Stops at the first non-finite loss (`diverged_at`) or error (`error`)."""
    model = make_model(config.seed, config.layers, config.width, config.heads, config.context)
    x_eval, y_eval = eval_windows(data.heldout, config.context)
    gen = torch.Generator().manual_seed(config.seed)
    run = {"member": spec.name, "hyperparameters": spec.hyperparameters, "eval_steps": [], "eval_time_s": [],
           "heldout_loss": [], "train_loss": [], "diverged_at": None, "diverged_time_s": None, "error": None,
           "steps": 0, "time_s": 0.0}

    def evaluate(step: int, spent: float) -> None:
        with torch.no_grad():
            model.eval()
            loss = lm_loss(model, x_eval, y_eval).item()
            model.train()
        run["eval_steps"].append(step)
        run["eval_time_s"].append(spent)
        run["heldout_loss"].append(loss)
        if not math.isfinite(loss) and run["diverged_at"] is None:
            run["diverged_at"], run["diverged_time_s"] = step, spent

    evaluate(0, 0.0)
    try:
        optimizer = spec.build(model)
    except (ValueError, TypeError, RuntimeError) as e:
        run["error"] = f"{type(e).__name__}: {e}"
        return run
    limit = config.steps if budget_s is None else MAX_STEP_FACTOR * config.steps
    step, spent = 0, 0.0
    while step < limit and (step < config.steps or (budget_s is not None and spent < budget_s)):
        x, y = random_batch(data.train, config.context, config.batch_size, gen)
        start = time.perf_counter()
        try:
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model, x, y)
            loss.backward()
            optimizer.step()
        except (ValueError, TypeError, RuntimeError) as e:
            run["error"] = f"{type(e).__name__} at step {step + 1}: {e}"
            break
        elapsed = time.perf_counter() - start
        crossed = budget_s is not None and spent < budget_s <= spent + elapsed
        spent += elapsed
        step += 1
        run["train_loss"].append(loss.item())
        if not math.isfinite(run["train_loss"][-1]):
            run["diverged_at"], run["diverged_time_s"] = step, spent
            break
        if step % config.eval_every == 0 or step == config.steps or crossed:
            evaluate(step, spent)
            if run["diverged_at"] is not None:
                break
    run["steps"], run["time_s"] = step, spent
    if hasattr(optimizer, "remove_hooks"):
        optimizer.remove_hooks()
    return run


def summarise(run: dict, steps: int, budget_s: float | None) -> dict:
    """The held-out loss after `steps` steps and at the budget (after the step that used it up),
    the steps that took, ms per step and a status."""
    def last(predicate):
        hits = [loss for s, t, loss in zip(run["eval_steps"], run["eval_time_s"], run["heldout_loss"])
                if predicate(s, t)]
        return hits[-1] if hits else None

    # a run that diverged (or failed) before a mark has no loss there
    at_steps = last(lambda s, t: s == steps) if run["steps"] >= steps else None
    at_budget = steps_to_budget = None
    if budget_s is not None and (run["diverged_at"] is None or run["diverged_time_s"] >= budget_s):
        reached = [(s, loss) for s, t, loss in zip(run["eval_steps"], run["eval_time_s"], run["heldout_loss"])
                   if t >= budget_s]
        if reached:
            steps_to_budget, at_budget = reached[0]
    if run["error"]:
        status = "refused" if run["steps"] == 0 else "failed"
        status += f" ({run['error'].split(':')[0]})"
    elif run["diverged_at"] is not None:
        status = f"diverged at step {run['diverged_at']}"
    else:
        status = "ok"
    return {"member": run["member"], "hyperparameters": run["hyperparameters"], "status": status,
            "error": run["error"],
            "heldout_loss_at_steps": at_steps, "heldout_loss_at_budget": at_budget,
            "steps_to_budget": steps_to_budget, "steps_done": run["steps"], "time_s": run["time_s"],
            "ms_per_step": 1e3 * run["time_s"] / run["steps"] if run["steps"] else None,
            "initial_heldout_loss": run["heldout_loss"][0]}


def run_task(config: Config, names: str | None = None, threads: int = 1, data: TextData | None = None,
             specs: Sequence[MemberSpec] | None = None,
             progress: Callable[[str], None] | None = None) -> dict:
    """Train every selected member (AdamW first: its time is the default budget) and collect the
    curves, the summary rows and the configuration."""
    data = data or load_text()
    specs = select(specs if specs is not None else member_specs(config.batch_size), names)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    runs, budget = [], config.budget_s
    try:
        for spec in specs:
            if progress:
                progress(spec.name)
            runs.append(train(spec, data, config, budget))
            if budget is None and spec.name == "AdamW" and runs[-1]["steps"] == config.steps:
                budget = runs[-1]["time_s"]
        # AdamW ran before the budget was known: it used exactly its budget
    finally:
        torch.set_num_threads(previous)
    parameters = sum(p.numel() for p in make_model(0, config.layers, config.width, config.heads,
                                                   config.context).parameters())
    return {
        "config": dict(dataclasses.asdict(config), budget_s=budget, task="text", parameters=parameters,
                       data=f"Python {platform.python_version()} stdlib top-level *.py: "
                            f"{len(data.train_files)} training files ({len(data.train)} bytes), "
                            f"{len(data.heldout_files)} held-out files ({len(data.heldout)} bytes)",
                       heldout_files=data.heldout_files, eval_windows=EVAL_WINDOWS, split_seed=SPLIT_SEED,
                       torch=torch.__version__, threads=threads,
                       machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                       loss="held-out cross-entropy, nats per byte"),
        "members": [summarise(r, config.steps, budget) for r in runs],
        "curves": runs,
    }


# ----------------------------------------------------------------------------------- output
def _loss(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def render(results: dict):
    """The rich table of the summary rows."""
    from rich.table import Table
    cfg = results["config"]
    budget = cfg["budget_s"]
    table = Table(title=f"Byte-level GPT ({cfg['layers']} layers, width {cfg['width']}, {cfg['heads']} heads, "
                        f"context {cfg['context']}, {cfg['parameters']} params) on the Python stdlib, "
                        f"batch {cfg['batch_size']}, seed {cfg['seed']}")
    table.add_column("member", no_wrap=True)
    table.add_column(f"held-out loss at step {cfg['steps']}", justify="right")
    table.add_column("held-out loss at the budget" if budget is None else
                     f"held-out loss at {budget:.1f} s", justify="right")
    table.add_column("steps to the budget", justify="right")
    table.add_column("ms / step", justify="right")
    table.add_column("status")
    for row in results["members"]:
        table.add_row(row["member"], _loss(row["heldout_loss_at_steps"]), _loss(row["heldout_loss_at_budget"]),
                      "-" if row["steps_to_budget"] is None else str(row["steps_to_budget"]),
                      "-" if row["ms_per_step"] is None else f"{row['ms_per_step']:.1f}", row["status"])
    table.caption = (f"Held-out loss: cross-entropy in nats per byte over {cfg['eval_windows']} fixed windows "
                     f"(ln 256 = 5.545 at the start); evaluated every {cfg['eval_every']} steps. Budget: "
                     f"{'none' if budget is None else f'{budget:.1f} s of training time (AdamW for the steps)'}; "
                     f"torch {cfg['torch']}, {cfg['threads']} thread(s), {cfg['machine']}.")
    return table


def hyperparameter_text(results: dict) -> str:
    width = max(len(r["member"]) for r in results["members"])
    return "Settings (constant lr):\n" + "\n".join(f"  {r['member']:<{width}}  {r['hyperparameters']}"
                                                   for r in results["members"])


def plot(results: dict, path: str) -> None:
    """Held-out loss against step (left) and against training time (right); a diverged run ends
    with a cross, the budget is a dotted line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfg = results["config"]
    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab10")
    for i, run in enumerate(results["curves"]):
        if len(run["eval_steps"]) < 2:
            continue  # refused or failed at its first step: in the table only
        finite = [(s, t, v) for s, t, v in zip(run["eval_steps"], run["eval_time_s"], run["heldout_loss"])
                  if math.isfinite(v)]
        steps, times, losses = zip(*finite)
        style = dict(color="0.3" if run["member"] == "AdamW" else colors(i % 10), lw=1.6,
                     ls=(0, (4, 2)) if run["member"] == "AdamW" else "-")
        label = run["member"] + (f" (diverged at step {run['diverged_at']})" if run["diverged_at"] else "")
        ax_step.plot(steps, losses, label=label, **style)
        ax_time.plot(times, losses, label=label, **style)
        if run["diverged_at"]:
            ax_step.plot(steps[-1], losses[-1], "x", color=style["color"], ms=9)
            ax_time.plot(times[-1], losses[-1], "x", color=style["color"], ms=9)
    if cfg["budget_s"] is not None:
        ax_time.axvline(cfg["budget_s"], color="k", lw=0.8, ls=":")
    ax_step.axvline(cfg["steps"], color="k", lw=0.8, ls=":")
    for ax, label in ((ax_step, "step"), (ax_time, "training time, s (evaluation excluded)")):
        ax.set_xlabel(label)
        ax.set_ylabel("held-out loss, nats / byte")
        ax.grid(alpha=0.25)
    # the same steps on the left, the same time on the right (runs that trained on to use up the
    # budget, or were slower, go past the edges)
    ax_step.set_xlim(0, cfg["steps"] * 1.05)
    ax_time.set_xlim(0, (cfg["budget_s"] or max(r["time_s"] for r in results["curves"])) * 1.5)
    ax_step.legend(fontsize=8)
    fig.suptitle(f"byte-level GPT ({cfg['layers']}x{cfg['width']}, context {cfg['context']}, "
                 f"{cfg['parameters']} params) on the Python stdlib, batch {cfg['batch_size']}, seed {cfg['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def to_json(results: dict) -> dict:
    """The results with every non-finite loss written as null (JSON has no NaN)."""
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value
    return clean(results)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench convergence --task text",
        description="A small byte-level GPT on the Python standard library's sources: every member against "
                    "AdamW with the same steps and the same wall-clock budget (held-out loss per step and per "
                    "second).")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['steps']} steps of batch {QUICK['batch_size']} (explicit flags win)")
    for name in ("steps", "batch_size", "eval_every", "layers", "width", "heads", "context"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"default {DEFAULTS[name]}" + (f", --quick {QUICK[name]}" if name in QUICK else ""))
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batches (default 0)")
    parser.add_argument("--budget", type=float, default=None,
                        help="wall-clock budget in seconds of training (default: AdamW's time for --steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--optimizers", default=None, help="comma-separated member name prefixes (default: all)")
    parser.add_argument("--train-bytes", type=int, default=TRAIN_BYTES, help=argparse.SUPPRESS)
    parser.add_argument("--heldout-bytes", type=int, default=HELDOUT_BYTES, help=argparse.SUPPRESS)
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of the curves")
    parser.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    args = parser.parse_args(argv)
    values = {name: getattr(args, name) if getattr(args, name) is not None else
              (QUICK.get(name, DEFAULTS[name]) if args.quick else DEFAULTS[name]) for name in DEFAULTS}
    for name, value in list(values.items()) + [("threads", args.threads)]:
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if values["width"] % values["heads"]:
        parser.error(f"--width ({values['width']}) must be divisible by --heads ({values['heads']})")
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget must be > 0, got {args.budget}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e .[bench]")
    config = Config(**values, seed=args.seed, budget_s=args.budget)
    from rich.console import Console
    console = Console()
    data = load_text(train_bytes=args.train_bytes, heldout_bytes=args.heldout_bytes)
    start = time.perf_counter()
    with console.status("training") as status:
        results = run_task(config, args.optimizers, args.threads, data,
                           progress=lambda s: status.update(f"training: {s}"))
    results["config"]["wall_s"] = time.perf_counter() - start
    console.print(render(results))
    soap_ok, why_no_soap = soap_available()
    if not soap_ok:
        console.print(f"[yellow]note:[/] no SOAP row: {why_no_soap}")
    for row in results["members"]:
        if row["error"]:
            console.print(f"[yellow]{row['member']}:[/] {row['error']}")
    console.print(hyperparameter_text(results))
    console.print(f"Data: {results['config']['data']}. Wall time {results['config']['wall_s']:.0f} s.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(to_json(results), f, indent=1, ensure_ascii=False)
        console.print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        console.print(f"wrote {args.plot}")
    return 0
