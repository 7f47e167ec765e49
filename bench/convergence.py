"""`python -m bench convergence`: does AdaFisher train a real network, and do the fused kernels
train it the same way the reference does?

A small CNN (Conv2d, BatchNorm2d, ReLU, max-pooling, Linear) on scikit-learn's bundled handwritten
digits (1797 8x8 images, no download), a fixed stratified 75/25 split, inputs standardised with the
training set's mean and std. Each optimizer trains the same model from the same initialisation on
the same batches for each seed (the seed sets the initialisation and the batch order; the split
never changes), with a constant learning rate:

  AdaFisher (fused / reference)  lr 1e-3, beta 0.9, Lambda 1e-3, gamma 0.8, TCov 5, wd 0
  AdaFisherW                     the same, decoupled weight decay 1e-2
  Adam                           lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0
  AdamW                          lr 1e-3, betas (0.9, 0.999), eps 1e-8, decoupled wd 1e-2
  SGD                            lr 0.05, momentum 0.9, wd 0

The rest of the family, each with its published recommended usage (bench/members/):

  K-FAC + SGD       kfac-pytorch's CIFAR-10 example: factor_update_steps 1, inv_update_steps 10,
                    damping 3e-3, kl_clip 1e-3, SGD momentum 0.9, wd 5e-4, lr 0.1 at batch 128
                    scaled linearly to this batch (0.025 at 32; the kl_clip uses the same lr);
                    the example's warm-up and step decays (100+ epochs) are dropped: constant lr
  two-level K-FAC   the autoencoder task's settings (damping 0.1, T_cov = T_inv = 10, alpha 0.95,
                    constraint_norm with clipping 1e-2), SGD momentum 0.9 at K-FAC's lr; rows:
                    the same K-FAC with the coarse correction off, and nicolaides (default), and
                    spectral, residual, tselepidis, nicolaides/residual + krylov (--optimizers
                    two-level)
  SINGD             singd's defaults (lr 1e-3, momentum 0.9, damping 1e-3, alpha1 0.5, T 10,
                    lr_cov 1e-2): dense, diagonal, IKFAC (kfac_like=True), dense with bf16 K, C
  DyKAF             the published usage: lr 3e-3, betas (0.95, 0.95), init "eps", wd 0.01,
                    precondition_frequency 10
  SOAP (heavyball)  heavyball.SOAP's defaults, eager (heavyball's compile switched off: inductor
                    would compile for minutes on 2 cores); only when heavyball imports

The peers a user would compare with (--optimizers peers): SOAP above, and

  Muon + AdamW      torch.optim.Muon as its documentation prescribes (bench/peers.py, MuonAdamW):
                    lr 0.02, momentum 0.95, nesterov, ns_steps 5, wd 0.1 on the hidden filter
                    conv2 (flattened to 32 x 144; the stem conv1 and the classifier fc are the
                    input and output layers, which go to AdamW), AdamW with the AdamW row's
                    settings on everything else

A run whose loss turns NaN stops there and is reported as diverged (DyKAF's published usage
does on this CNN at batch 32, after its first refresh; the published TensorDyKAF computes the same
numbers and diverges at the same step; at batch 64 both train).

AdaFisher and Adam use their published defaults (AdaFisher's lr 1e-3 with Lambda 1e-3 behaves like
SGD-momentum with an effective step lr/Lambda = 1 on the (1-beta)-EMA momentum, i.e. PyTorch SGD at
lr 0.1, momentum 0.9, once the factors settle); SGD uses a common value for a small BN network.
Nothing was tuned on this data. TCov is 5 (the published default of 100 would update the curvature
only a few times in the whole run), so curvature statistics are taken every 5 batches.

Reported per optimizer (mean +- std over seeds): test accuracy after epochs 1, 3 and the last;
steps to 95 % test accuracy (the test set is evaluated every `--eval-every` steps, default 5, and
at the end of every epoch); the median wall time of a training step (zero_grad, forward, backward,
optimizer step; first 10 steps excluded) and of its optimizer.step() alone, on 1 thread by default.

Fused vs reference (AdaFisher, same seed and batches), three numbers:
- independent runs, FP32: the parameter difference at the end, per seed. Two runs start apart by
  one rounding (~1e-7) and stay that close until a ReLU input within ~1e-7 of zero changes sign
  in one run and not the other; after that they follow different trajectories (1e-2 and more);
- lockstep, FP32 (seed 0): both backends take every step from the same state; every parameter
  and optimizer-state tensor is compared after the step, then re-synced: the kernels' own error;
- independent runs, float64 (seed 0): no near-ties flip at 1e-16, so the runs stay together.

`--task autoencoder` runs the two-level K-FAC paper's autoencoder experiment instead
(bench/autoencoder.py); `--task text` a byte-level GPT on the Python standard library's sources,
every member against AdamW (bench/text_task.py). Flags of this task (cnn, the default): --epochs N, --seeds N, --quick (1 seed, 3 epochs), --batch-size, --eval-every, --tcov,
--threads, --optimizers NAME,... (name prefixes or families: adafisher, kfac, singd, dykaf,
peers, baselines), --plot PATH (PNG, one column per family), --json PATH.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import cafin

from .members import kfac as kfac_member
from .members import twolevel as twolevel_member
from .peers import MUON_TEXT, muon_adamw, muon_routes, soap, soap_available

TARGET_ACCURACY = 0.95
DEFAULT_EPOCHS = 10
DEFAULT_SEEDS = 3
DEFAULT_BATCH_SIZE = 32
DEFAULT_EVAL_EVERY = 5
DEFAULT_TCOV = 5
WARMUP_STEPS = 10  # excluded from the step-time median
SPLIT_SEED = 0
TEST_FRACTION = 0.25


# ----------------------------------------------------------------------------------- data
@dataclass
class Digits:
    x_train: torch.Tensor  # [N, 1, 8, 8] float32, standardised
    y_train: torch.Tensor  # [N] int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    mean: float
    std: float


def load_data(test_fraction: float = TEST_FRACTION, split_seed: int = SPLIT_SEED) -> Digits:
    """The digits, split once (stratified, fixed seed), standardised with the training set's
    scalar mean and std (one value for all pixels, so the images keep their spatial structure)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("bench convergence needs scikit-learn: pip install -e .[bench]") from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=test_fraction, stratify=digits.target,
        random_state=split_seed)
    idx_train, idx_test = torch.tensor(idx_train), torch.tensor(idx_test)
    mean, std = x[idx_train].mean().item(), x[idx_train].std().item()
    standardise = lambda t: ((t - mean) / std).contiguous()  # noqa: E731
    return Digits(standardise(x[idx_train]), y[idx_train], standardise(x[idx_test]), y[idx_test],
                  mean, std)


# ----------------------------------------------------------------------------------- model
class DigitsCNN(nn.Module):
    """conv3x3(1->16)-BN-ReLU-maxpool -> conv3x3(16->32)-BN-ReLU-maxpool -> Linear(128->10);
    about 6k parameters."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 2 * 2, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)  # 16 x 4 x 4
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # 32 x 2 x 2
        return self.fc(torch.flatten(x, 1))


def make_model(seed: int) -> DigitsCNN:
    torch.manual_seed(seed)
    return DigitsCNN()


# ----------------------------------------------------------------------------------- optimizers
FAMILIES = {  # family key (also an --optimizers name) -> plot panel title
    "adafisher": "AdaFisher", "kfac": "K-FAC and two-level K-FAC", "singd": "SINGD and IKFAC",
    "dykaf": "DyKAF and SOAP", "peers": "peers: Muon and SOAP", "baselines": "baselines"}


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    hyperparameters: str
    build: Callable[[nn.Module], torch.optim.Optimizer] = field(repr=False)
    backend: str | None = None  # for the cafin optimizers
    family: str = "baselines"  # a key of FAMILIES
    default: bool = True  # in a run without --optimizers
    peer: bool = False  # a published optimizer a user would compare with (--optimizers peers)


def fused_available() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("cafin::adafisher_step_", "CPU")


def adafisher_spec(backend: str, tcov: int = DEFAULT_TCOV, decoupled: bool = False,
                   **overrides) -> OptimizerSpec:
    """AdaFisher (or AdaFisherW, weight decay 1e-2) with the bench's hyperparameters on one
    backend; `overrides` change hyperparameters (used to check that the tests notice a change)."""
    cls = cafin.AdaFisherW if decoupled else cafin.AdaFisher
    kwargs = dict(lr=1e-3, beta=0.9, Lambda=1e-3, gamma=0.8, TCov=tcov,
                  weight_decay=1e-2 if decoupled else 0.0)
    kwargs.update(overrides)
    text = f"lr 1e-3, β 0.9, Λ 1e-3, γ 0.8, TCov {tcov}"
    if decoupled:
        text += ", wd 1e-2 (decoupled)"
    if overrides:
        text += ", " + ", ".join(f"{k} {v}" for k, v in overrides.items())
    return OptimizerSpec(f"{cls.__name__} ({backend})", text,
                         lambda m: cls(m, backend=backend, **kwargs), backend)


def optimizer_specs(tcov: int = DEFAULT_TCOV,
                    batch_size: int = DEFAULT_BATCH_SIZE) -> list[OptimizerSpec]:
    """Every optimizer of the comparison, with the hyperparameters stated in the module docstring.
    AdaFisherW runs on the fused backend when it is built, otherwise on the reference one; so do
    the other cafin members. SOAP is listed only when heavyball imports."""
    backend = "fused" if fused_available() else "reference"
    specs = [
        dataclasses.replace(adafisher_spec("fused", tcov), family="adafisher"),
        dataclasses.replace(adafisher_spec("reference", tcov), family="adafisher"),
        dataclasses.replace(adafisher_spec(backend, tcov, decoupled=True), family="adafisher"),
    ]
    specs += family_specs(backend, batch_size)
    specs += [
        OptimizerSpec("Adam", "lr 1e-3, β (0.9, 0.999), eps 1e-8",
                      lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)),
        OptimizerSpec("AdamW", "lr 1e-3, β (0.9, 0.999), eps 1e-8, wd 1e-2",
                      lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=1e-2)),
        OptimizerSpec("SGD", "lr 0.05, momentum 0.9",
                      lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)),
    ]
    return specs


def muon_spec() -> OptimizerSpec:
    """torch.optim.Muon on the CNN's hidden filter (conv2, flattened to 32 x 144: the stem conv1
    and the classifier fc go to AdamW, as Muon's documentation prescribes) and AdamW with the
    AdamW row's settings on everything else."""
    routes = muon_routes(DigitsCNN())
    on_muon = ", ".join(n for n, r in routes.items() if r == "muon")
    return OptimizerSpec(
        "Muon + AdamW (torch)", f"{MUON_TEXT} on {on_muon} (flattened); AdamW lr 1e-3, "
        "β (0.9, 0.999), wd 1e-2 on the rest",
        lambda m: muon_adamw(m, dict(lr=1e-3, weight_decay=1e-2)), None, "peers", peer=True)


# Two-level K-FAC on the CNN: the settings of the autoencoder task (bench/autoencoder.py),
# whose damping 0.1 and clipping keep it stable; SGD momentum 0.9 at the K-FAC row's lr.
TWOLEVEL_CNN = dict(damping=0.1, T_cov=10, T_inv=10, alpha=0.95, constraint_norm=True,
                    clipping=1e-2)


def family_specs(backend: str, batch_size: int = DEFAULT_BATCH_SIZE) -> list[OptimizerSpec]:
    """K-FAC, two-level K-FAC, SINGD, IKFAC, DyKAF and heavyball's SOAP, each with its published
    recommended usage (see the module docstring). Non-default rows (the other coarse spaces)
    run when --optimizers names them ('two-level' picks every two-level row)."""
    kfac_lr = kfac_member.lr_for(batch_size)
    specs = [OptimizerSpec(
        f"K-FAC + SGD ({backend})",
        f"kfac-pytorch CIFAR example: factor/inv update 1/10 steps, damping 3e-3, kl_clip 1e-3; "
        f"SGD lr {kfac_lr:g} (0.1 at batch 128, scaled to batch {batch_size}), momentum 0.9, "
        f"wd 5e-4", lambda m: kfac_member.sgd(m, kfac_lr, 1, 10, backend), backend, "kfac")]
    tl_text = (f"damping 0.1, T_cov = T_inv = 10, alpha 0.95, constraint_norm, clipping 1e-2; "
               f"SGD lr {kfac_lr:g}, momentum 0.9")
    spaces: list[tuple[str | None, bool]] = [(None, False)]
    spaces += [(c, False) for c in twolevel_member.COARSE_SPACES]
    spaces += [(c, True) for c in twolevel_member.KRYLOV_SPACES]
    for coarse, krylov in spaces:
        specs.append(OptimizerSpec(
            twolevel_member.label(coarse, krylov), tl_text,
            lambda m, c=coarse, k=krylov: twolevel_member.sgd(m, kfac_lr, c, k, backend=backend,
                                                              **TWOLEVEL_CNN),
            backend, "kfac", default=(coarse in (None, "nicolaides") and not krylov)))
    singd_text = ("singd defaults: lr 1e-3, momentum 0.9, damping 1e-3, alpha1 0.5, T 10, "
                  "lr_cov 1e-2")
    for label, kwargs, text in (
            ("SINGD dense", {}, ""),
            ("SINGD diagonal", dict(structures=("diagonal", "diagonal")), ", diagonal K and C"),
            ("IKFAC", dict(kfac_like=True), ", kfac_like (alpha1 0)"),
            ("SINGD dense, bf16 factors",
             dict(preconditioner_dtype=(torch.bfloat16, torch.bfloat16)), ", K and C in bf16")):
        specs.append(OptimizerSpec(
            f"{label} ({backend})", singd_text + text,
            lambda m, kw=kwargs: _singd(m, backend, kw), backend, "singd"))
    specs.append(OptimizerSpec(
        f"DyKAF ({backend})", "lr 3e-3, betas (0.95, 0.95), init eps, wd 0.01, "
        "precondition_frequency 10 (the published usage)",
        lambda m: cafin.DyKAF(m.parameters(), lr=3e-3, betas=(0.95, 0.95), init="eps",
                              backend=backend), backend, "dykaf"))
    if soap_available()[0]:
        specs.append(OptimizerSpec(
            "SOAP (heavyball)", "heavyball defaults: lr 3e-3, betas (0.9, 0.95), shampoo_beta "
            "0.95, wd 0.01, precondition_frequency 2; eager (heavyball's compile off)",
            lambda m: soap(m.parameters(), eager=True), None, "dykaf", peer=True))
    specs.append(muon_spec())
    return specs


def _singd(model: nn.Module, backend: str, kwargs: dict):
    import warnings
    with warnings.catch_warnings():  # kfac_like=True warns that it sets alpha1 to 0, as singd does
        warnings.simplefilter("ignore")
        return cafin.SINGD(model, warn_unsupported=False, backend=backend, **kwargs)


def select(specs: Sequence[OptimizerSpec], names: str | None) -> list[OptimizerSpec]:
    """Filter by comma-separated, case-insensitive prefixes of the names ('adafisher (f', 'sgd',
    'two-level') or family keys ('kfac', 'singd', 'dykaf', 'adafisher', 'peers', 'baselines';
    'peers' is Muon and SOAP). No names: the default rows."""
    if not names:
        return [s for s in specs if s.default]
    wanted = [n.strip().lower() for n in names.split(",") if n.strip()]

    def matches(spec: OptimizerSpec, w: str) -> bool:
        return spec.name.lower().startswith(w) or spec.family == w or (w == "peers" and spec.peer)

    chosen = [s for s in specs if any(matches(s, w) for w in wanted)]
    unknown = [w for w in wanted if not any(matches(s, w) for s in specs)]
    if unknown:
        raise SystemExit(f"unknown optimizer(s) {unknown}; choose from "
                         f"{[s.name for s in specs]} or a family {list(FAMILIES)}")
    return chosen


# ----------------------------------------------------------------------------------- training
@dataclass
class RunResult:
    optimizer: str
    seed: int
    steps_per_epoch: int
    epoch_accuracy: list[float]  # test accuracy after each epoch
    eval_steps: list[int]  # the steps at which the test set was evaluated (0 = before training)
    eval_accuracy: list[float]
    train_loss: list[float]  # mini-batch loss of every step
    step_ms: list[float]  # wall time of every training step (zero_grad, forward, backward, step)
    opt_ms: list[float]  # of which optimizer.step()
    cpu_ms: list[float]  # CPU time of this thread for the training step (robust to a busy machine)
    steps_to_target: int | None  # first evaluated step with test accuracy >= TARGET_ACCURACY
    final_parameters: dict[str, torch.Tensor] = field(repr=False)
    diverged_at: int | None = None  # the first step whose loss was not finite (training stopped)

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms[WARMUP_STEPS:] or self.step_ms)

    @property
    def median_opt_ms(self) -> float:
        return statistics.median(self.opt_ms[WARMUP_STEPS:] or self.opt_ms)

    @property
    def median_cpu_ms(self) -> float:
        return statistics.median(self.cpu_ms[WARMUP_STEPS:] or self.cpu_ms)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    correct = (model(x).argmax(1) == y).sum().item()
    model.train(was_training)
    return correct / len(y)


def batches(n: int, batch_size: int, seed: int, epochs: int):
    """(epoch, index in epoch, sample indices) of every step: a fresh permutation per epoch from a
    generator seeded with `seed`, so every optimizer sees the same batches; the last incomplete
    batch of each epoch is dropped (every step has the same batch size)."""
    order = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=order)
        for b in range(n // batch_size):
            yield epoch, b, perm[b * batch_size:(b + 1) * batch_size]


def train(spec: OptimizerSpec, data: Digits, seed: int, epochs: int,
          batch_size: int = DEFAULT_BATCH_SIZE, eval_every: int | None = DEFAULT_EVAL_EVERY,
          dtype: torch.dtype = torch.float32) -> RunResult:
    """Train a fresh DigitsCNN (initialised from `seed`) with one optimizer on `batches(...)`,
    evaluating the test set every `eval_every` steps (None: never) and at the end of every epoch."""
    model = make_model(seed).to(dtype)
    optimizer = spec.build(model)
    x_train, x_test = data.x_train.to(dtype), data.x_test.to(dtype)
    steps_per_epoch = len(data.y_train) // batch_size
    step = 0
    eval_steps, eval_accuracy = [0], [evaluate(model, x_test, data.y_test)]
    epoch_accuracy, train_loss, step_ms, opt_ms, cpu_ms = [], [], [], [], []
    model.train()
    diverged_at, broken_accuracy = None, math.nan
    for _, b, idx in batches(len(data.y_train), batch_size, seed, epochs):
        step += 1
        last_in_epoch = b == steps_per_epoch - 1
        due = (eval_every and step % eval_every == 0) or last_in_epoch
        if diverged_at is not None:  # the curves keep their length; the model stays where it broke
            train_loss.append(math.nan)
            if due:
                eval_steps.append(step)
                eval_accuracy.append(broken_accuracy)
            if last_in_epoch:
                epoch_accuracy.append(eval_accuracy[-1])
            continue
        xb, yb = x_train[idx], data.y_train[idx]
        start, start_cpu = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        before_step = time.perf_counter()
        optimizer.step()
        end, end_cpu = time.perf_counter(), time.thread_time()
        step_ms.append((end - start) * 1e3)
        cpu_ms.append((end_cpu - start_cpu) * 1e3)
        opt_ms.append((end - before_step) * 1e3)
        train_loss.append(loss.item())
        if not math.isfinite(train_loss[-1]):
            diverged_at = step
            broken_accuracy = evaluate(model, x_test, data.y_test)  # what it scores from here on
        if due:
            eval_steps.append(step)
            eval_accuracy.append(evaluate(model, x_test, data.y_test))
        if last_in_epoch:
            epoch_accuracy.append(eval_accuracy[-1])
    if hasattr(optimizer, "remove_hooks"):
        optimizer.remove_hooks()
    reached = [s for s, a in zip(eval_steps, eval_accuracy) if a >= TARGET_ACCURACY]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return RunResult(spec.name, seed, steps_per_epoch, epoch_accuracy, eval_steps, eval_accuracy,
                     train_loss, step_ms, opt_ms, cpu_ms, reached[0] if reached else None, params,
                     diverged_at)


def parameter_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """max_abs: the largest |a - b| over all parameters. max_rel: the largest, over parameter
    tensors, of max|a - b| / max|b| (relative to each tensor's scale, so that entries near zero
    do not blow it up)."""
    max_abs, max_rel, worst = 0.0, 0.0, None
    for name, tb in b.items():
        d = (a[name].double() - tb.double()).abs().max().item()
        rel = d / max(tb.double().abs().max().item(), 1e-30)
        max_abs = max(max_abs, d)
        if rel >= max_rel:
            max_rel, worst = rel, name
    return {"max_abs": max_abs, "max_rel": max_rel, "worst_tensor": worst}


def lockstep(spec_a: OptimizerSpec, spec_b: OptimizerSpec, data: Digits, seed: int,
             epochs: int, batch_size: int = DEFAULT_BATCH_SIZE,
             dtype: torch.dtype = torch.float32) -> dict:
    """Per-step agreement of optimizer a with optimizer b, free of trajectory divergence.

    Two copies of the model take every step from the same state: the same parameters, buffers and
    optimizer state, hence bit-identical forward passes and gradients. After each step every
    parameter and every optimizer state tensor of a is compared with b's, then a is reset to b's
    values, so one step's rounding never grows into a different trajectory.

    Returns maxima over all steps: param_rel = max over tensors of max|θa - θb| / max|θb| (with
    where it happened); state_rel = per state key, max over tensors of max|a - b| / max|b|.
    """
    model_a, model_b = make_model(seed).to(dtype), make_model(seed).to(dtype)
    opt_a, opt_b = spec_a.build(model_a), spec_b.build(model_b)
    names = [n for n, _ in model_b.named_parameters()]
    params_a, params_b = list(model_a.parameters()), list(model_b.parameters())
    x_train = data.x_train.to(dtype)
    param_rel, where = 0.0, None
    state_rel: dict[str, float] = {}
    steps = 0
    model_a.train()
    model_b.train()
    for _, _, idx in batches(len(data.y_train), batch_size, seed, epochs):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_train[idx]), data.y_train[idx]).backward()
            opt.step()
        steps += 1
        with torch.no_grad():
            for name, pa, pb in zip(names, params_a, params_b):
                diff = (pa.double() - pb.double()).abs().max().item()
                scale = pb.double().abs().max().item()
                if diff / max(scale, 1e-30) > param_rel:
                    param_rel = diff / max(scale, 1e-30)
                    where = {"step": steps, "tensor": name, "max_abs_diff": diff,
                             "max_abs_param": scale}
                sa, sb = opt_a.state[pa], opt_b.state[pb]
                if set(sa) != set(sb):
                    raise AssertionError(f"{name}: state keys differ, {sorted(sa)} vs {sorted(sb)}")
                for key, tb in sb.items():
                    ta = sa[key]
                    if tb.numel():
                        d = (ta.double() - tb.double()).abs().max().item()
                        rel = d / max(tb.double().abs().max().item(), 1e-30)
                        state_rel[key] = max(state_rel.get(key, 0.0), rel)
                    ta.copy_(tb)
            model_a.load_state_dict(model_b.state_dict())  # parameters and BN buffers
    for opt in (opt_a, opt_b):
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
    return {"param_rel": param_rel, "worst_param": where, "state_rel": state_rel, "steps": steps,
            "seed": seed, "epochs": epochs, "dtype": str(dtype).replace("torch.", "")}


# ----------------------------------------------------------------------------------- summary
def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    values = list(values)
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def report_epochs(epochs: int) -> list[int]:
    """Epochs whose accuracy the table shows: 1, 3 and the last (those that exist)."""
    return sorted({e for e in (1, 3, epochs) if 1 <= e <= epochs})


def summarise(spec: OptimizerSpec, runs: list[RunResult], epochs: int) -> dict:
    acc = {}
    for e in report_epochs(epochs):
        m, s = _mean_std(r.epoch_accuracy[e - 1] for r in runs)
        acc[str(e)] = {"mean": m, "std": s}
    reached = [r.steps_to_target for r in runs if r.steps_to_target is not None]
    m, s = _mean_std(reached)
    return {
        "optimizer": spec.name, "hyperparameters": spec.hyperparameters, "backend": spec.backend,
        "accuracy_after_epoch": acc,
        "final_accuracy_per_seed": [r.epoch_accuracy[-1] for r in runs],
        "steps_to_target": {"mean": m if reached else None, "std": s if reached else None,
                            "reached": len(reached), "runs": len(runs),
                            "per_seed": [r.steps_to_target for r in runs]},
        "diverged_at": [r.diverged_at for r in runs],
        "family": spec.family, "peer": spec.peer,
        "step_ms_median": statistics.median(r.median_step_ms for r in runs),
        "opt_step_ms_median": statistics.median(r.median_opt_ms for r in runs),
        "cpu_step_ms_median": statistics.median(r.median_cpu_ms for r in runs),
        "step_ms_median_per_seed": [r.median_step_ms for r in runs],
        "step_ms_mean_per_seed": [statistics.fmean(r.step_ms[WARMUP_STEPS:] or r.step_ms)
                                  for r in runs],
    }


def run_benchmark(epochs: int = DEFAULT_EPOCHS, seeds: int = DEFAULT_SEEDS,
                  batch_size: int = DEFAULT_BATCH_SIZE, eval_every: int = DEFAULT_EVAL_EVERY,
                  tcov: int = DEFAULT_TCOV, optimizers: str | None = None, threads: int = 1,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Every selected optimizer x every seed, then the fused-vs-reference agreement. Returns the
    JSON-ready results plus, under the key 'runs', the RunResult objects (`to_json` drops them).
    `threads` sets torch's intra-op threads for the run (restored afterwards)."""
    data = load_data()
    if not 1 <= batch_size <= len(data.y_train):
        raise SystemExit(f"batch size must be in [1, {len(data.y_train)}], got {batch_size}")
    specs = select(optimizer_specs(tcov, batch_size), optimizers)
    notes = []
    soap_ok, why_no_soap = soap_available()
    if not soap_ok and (not optimizers or any(w.strip().lower() in ("dykaf", "soap", "peers")
                                              for w in optimizers.split(","))):
        notes.append(f"no SOAP rows: {why_no_soap}")
    if not fused_available():
        dropped = [s.name for s in specs if s.backend == "fused"]
        specs = [s for s in specs if s.backend != "fused"]
        if dropped:
            notes.append(f"fused kernels are not built: skipped {', '.join(dropped)}")
    if not specs:
        raise SystemExit("no optimizer left to run (" + "; ".join(notes) + ")")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if progress:
            progress("warm-up")
        # One throwaway epoch first: the first evaluation and the first steps of a process pay
        # one-off costs (oneDNN primitives, allocator) that would land on the first optimizer.
        train(specs[0], data, 0, 1, batch_size, eval_every)
        runs: dict[str, list[RunResult]] = {s.name: [] for s in specs}
        wall: dict[str, float] = {s.name: 0.0 for s in specs}
        for seed in range(seeds):  # seed-major, so that load drift spreads over all optimizers
            for spec in specs:
                if progress:
                    progress(f"{spec.name}, seed {seed}")
                start = time.perf_counter()
                runs[spec.name].append(train(spec, data, seed, epochs, batch_size, eval_every))
                wall[spec.name] += time.perf_counter() - start
        fused = runs.get(adafisher_spec("fused").name)
        ref = runs.get(adafisher_spec("reference").name)
        agreement = None
        if fused and ref:
            if progress:
                progress("fused vs reference in lockstep, seed 0")
            per_seed = [dict(seed=a.seed, **parameter_difference(a.final_parameters,
                                                                 b.final_parameters))
                        for a, b in zip(fused, ref)]
            agreement = {
                "independent_runs": {"per_seed": per_seed,
                                     "max_abs": max(d["max_abs"] for d in per_seed),
                                     "max_rel": max(d["max_rel"] for d in per_seed)},
                "lockstep": lockstep(adafisher_spec("fused", tcov),
                                     adafisher_spec("reference", tcov), data, 0, epochs, batch_size),
            }
            if progress:
                progress("fused vs reference in float64, seed 0")
            f64 = [train(adafisher_spec(b, tcov), data, 0, epochs, batch_size, None,
                         dtype=torch.float64) for b in ("fused", "reference")]
            agreement["float64_independent_runs"] = dict(
                seed=0, **parameter_difference(f64[0].final_parameters, f64[1].final_parameters))
    finally:
        torch.set_num_threads(previous_threads)
    steps_per_epoch = len(data.y_train) // batch_size
    return {
        "config": {
            "dataset": "sklearn.datasets.load_digits (8x8, 10 classes)",
            "train_size": len(data.y_train), "test_size": len(data.y_test),
            "split": f"stratified, test fraction {TEST_FRACTION}, random_state {SPLIT_SEED}",
            "standardisation": f"(x - {data.mean:.4f}) / {data.std:.4f}: the training set's "
                               "scalar mean and std",
            "model": "conv3x3(1->16, no bias)-BN-ReLU-maxpool2, conv3x3(16->32, no bias)-BN-ReLU-"
                     "maxpool2, Linear(128->10)",
            "parameters": sum(p.numel() for p in DigitsCNN().parameters()),
            "epochs": epochs, "seeds": list(range(seeds)), "batch_size": batch_size,
            "steps_per_epoch": steps_per_epoch, "total_steps": steps_per_epoch * epochs,
            "eval_every_steps": eval_every, "target_accuracy": TARGET_ACCURACY,
            "tcov": tcov, "lr_schedule": "constant", "loss": "cross-entropy",
            "step_time": f"median wall time of zero_grad+forward+backward+step, first "
                         f"{WARMUP_STEPS} steps of each run excluded; median over seeds "
                         "(cpu_step_ms: the same in the training thread's CPU time)",
            "torch": torch.__version__, "threads": threads,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "fused_available": fused_available(),
        },
        "notes": notes,
        "optimizers": [dict(summarise(s, runs[s.name], epochs), wall_s=wall[s.name])
                       for s in specs],
        "fused_vs_reference": agreement,
        "curves": {name: [{"seed": r.seed, "eval_steps": r.eval_steps,
                           "test_accuracy": _rounded(r.eval_accuracy),
                           "train_loss": _rounded(r.train_loss),
                           "epoch_accuracy": _rounded(r.epoch_accuracy)}
                          for r in rs] for name, rs in runs.items()},
        "runs": runs,
    }


def _rounded(values: Sequence[float]) -> list[float]:
    return [float(f"{v:.6g}") for v in values]


def to_json(results: dict) -> dict:
    return {k: v for k, v in results.items() if k != "runs"}


# ----------------------------------------------------------------------------------- output
def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _pct(mean: float, std: float) -> str:
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


def render(results: dict):
    """The rich table of results."""
    from rich.table import Table
    cfg = results["config"]
    epochs = report_epochs(cfg["epochs"])
    table = Table(title=f"Convergence on sklearn digits ({cfg['train_size']} train / "
                        f"{cfg['test_size']} test), DigitsCNN {cfg['parameters']} params, "
                        f"{_plural(len(cfg['seeds']), 'seed')}, {_plural(cfg['epochs'], 'epoch')} × "
                        f"{cfg['steps_per_epoch']} steps of batch {cfg['batch_size']}")
    table.add_column("optimizer", no_wrap=True)
    for e in epochs:
        table.add_column(f"test acc % after epoch {e}", justify="right")
    table.add_column(f"steps to {100 * cfg['target_accuracy']:.0f} % test acc", justify="right")
    table.add_column("ms / step", justify="right")
    table.add_column("of which step()", justify="right")
    table.add_column("CPU ms / step", justify="right")
    family = None
    for row in results["optimizers"]:
        if family is not None and row.get("family") != family:
            table.add_section()
        family = row.get("family")
        cells = [row["optimizer"]]
        cells += [_pct(row["accuracy_after_epoch"][str(e)]["mean"],
                       row["accuracy_after_epoch"][str(e)]["std"]) for e in epochs]
        st = row["steps_to_target"]
        diverged = [d for d in row.get("diverged_at", []) if d is not None]
        if st["reached"] == 0 and diverged:
            cells.append(f"diverged ({len(diverged)}/{st['runs']}, NaN loss at step "
                         f"{min(diverged)}{'' if len(diverged) == 1 else '+'})")
        elif st["reached"] == 0:
            cells.append(f"not reached (0/{st['runs']})")
        else:
            text = f"{st['mean']:.0f} ± {st['std']:.0f}"
            if st["reached"] < st["runs"]:
                text += f" ({st['reached']}/{st['runs']} seeds"
                text += f"; {len(diverged)} diverged)" if diverged else ")"
            cells.append(text)
        cells += [f"{row['step_ms_median']:.2f}", f"{row['opt_step_ms_median']:.2f}",
                  f"{row['cpu_step_ms_median']:.2f}"]
        table.add_row(*cells)
    table.caption = (
        f"Mean ± std over seeds. Test accuracy evaluated every {cfg['eval_every_steps']} steps and "
        f"at each epoch end (steps to target = first evaluation at or above it). ms / step: median "
        f"wall time of zero_grad+forward+backward+step() after {WARMUP_STEPS} warm-up steps, "
        f"median over seeds; CPU ms: the same in this thread's CPU time, which a busy machine "
        f"inflates less; torch {cfg['torch']}, {_plural(cfg['threads'], 'thread')}, {cfg['machine']}.")
    return table


def hyperparameter_text(results: dict) -> str:
    width = max(len(r["optimizer"]) for r in results["optimizers"])
    lines = [f"  {r['optimizer']:<{width}}  {r['hyperparameters']}" for r in results["optimizers"]]
    return "Hyperparameters (constant learning rate, no schedule):\n" + "\n".join(lines)


def agreement_text(results: dict) -> str:
    a = results["fused_vs_reference"]
    if a is None:
        return "AdaFisher fused vs reference: not measured (needs both AdaFisher backends)"
    ind, lock, f64 = a["independent_runs"], a["lockstep"], a["float64_independent_runs"]
    seeds = "; ".join(f"seed {d['seed']}: {d['max_abs']:.1e} abs, {d['max_rel']:.1e} rel"
                      for d in ind["per_seed"])
    state = ", ".join(f"{k} {v:.1e}" for k, v in lock["state_rel"].items())
    return (
        f"AdaFisher fused vs reference, FP32, same seed and batches, parameters after "
        f"{results['config']['total_steps']} steps: max |Δθ| {ind['max_abs']:.2e}, max relative "
        f"{ind['max_rel']:.2e} (per tensor max|Δθ|/max|θ|; {seeds}).\n"
        f"Lockstep (seed 0, both take every step from the same state, compared then re-synced): "
        f"max relative parameter difference {lock['param_rel']:.1e}, optimizer state {state}, "
        f"over {lock['steps']} steps.\n"
        f"Independent runs start apart by FP32 rounding (~1e-7), which stays that small until a "
        f"ReLU input within ~1e-7 of 0 changes sign in one run and not the other; after that the "
        f"runs follow different trajectories. The lockstep numbers are the kernels' own error. "
        f"In float64 (seed 0) the independent runs end {f64['max_abs']:.1e} abs, "
        f"{f64['max_rel']:.1e} rel apart.")


def plot(results: dict, path: str) -> None:
    """Test accuracy (top) and train loss (bottom) against step, mean over seeds (shaded: min-max
    over seeds), one column per family; the baselines (Adam, AdamW, SGD) in grey in every column."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install -e .[bench]") from e
    import numpy as np
    cfg = results["config"]
    rows = results["optimizers"]
    families = [f for f in FAMILIES if f != "baselines" and any(r["family"] == f for r in rows)]
    baselines = [r["optimizer"] for r in rows if r["family"] == "baselines"]
    if not families:
        families = ["baselines"]
        baselines = []
    ncol = len(families)
    fig, axes = plt.subplots(2, ncol, figsize=(max(4.6 * ncol + 1, 11), 8.5), squeeze=False,
                             sharex=True)
    window = 10
    kernel = np.ones(window) / window
    colors = plt.get_cmap("tab10")
    greys = ["0.35", "0.6", "0.8"]
    spe = cfg["steps_per_epoch"]

    def draw(ax_acc, ax_loss, name, style, band_color):
        curves = results["curves"][name]
        # a diverged seed would drag the mean to chance and the loss to NaN: the curves average
        # the seeds that did not diverge, and the label counts the others
        ok = [c for c in curves if all(math.isfinite(v) for v in c["train_loss"])]
        if ok and len(ok) < len(curves):
            name = f"{name} ({len(curves) - len(ok)}/{len(curves)} diverged)"
            curves = ok
        steps = np.array(curves[0]["eval_steps"])
        acc = 100 * np.array([c["test_accuracy"] for c in curves])
        ax_acc.plot(steps, acc.mean(0), label=name, **style)
        loss = np.array([c["train_loss"] for c in curves])
        smooth = np.array([np.convolve(row, kernel, mode="valid") for row in loss])
        x = np.arange(window, loss.shape[1] + 1)
        ax_loss.plot(x, smooth.mean(0), label=name, **style)
        if len(curves) > 1 and band_color is not None:
            ax_acc.fill_between(steps, acc.min(0), acc.max(0), color=band_color, alpha=0.1, lw=0)
            ax_loss.fill_between(x, smooth.min(0), smooth.max(0), color=band_color, alpha=0.1,
                                 lw=0)

    for col, family in enumerate(families):
        ax_acc, ax_loss = axes[0][col], axes[1][col]
        for j, name in enumerate(baselines):
            draw(ax_acc, ax_loss, name, dict(color=greys[j % 3], lw=1.0, ls=(0, (2, 2))), None)
        # the peers' column holds every peer (SOAP also stays beside DyKAF in its own column)
        members = [r["optimizer"] for r in rows
                   if r["family"] == family or (family == "peers" and r.get("peer"))]
        for i, name in enumerate(members):
            dashed = "reference" in name or "bf16" in name or name.startswith("AdaFisherW")
            style = dict(color=colors(i), lw=1.6, ls=(0, (5, 3)) if dashed else "-")
            draw(ax_acc, ax_loss, name, style, colors(i))
        for ax in (ax_acc, ax_loss):
            for e in range(1, cfg["epochs"] + 1):
                ax.axvline(e * spe, color="0.9", lw=0.6, zorder=0)
            ax.set_xlim(0, cfg["total_steps"])
            ax.grid(alpha=0.25)
        ax_acc.axhline(100 * cfg["target_accuracy"], color="k", lw=0.8, ls=":")
        ax_acc.set_ylim(80, 100)
        ax_acc.set_title(FAMILIES[family])
        ax_acc.legend(loc="lower right", fontsize=7.5)
        ax_loss.set_yscale("log")
        ax_loss.set_xlabel(f"step ({spe} per epoch)")
    axes[0][0].set_ylabel(f"test accuracy % (every {cfg['eval_every_steps']} steps; from 80 %)")
    axes[1][0].set_ylabel(f"train loss (mini-batch, moving average of {window})")
    band = ", band = min-max over seeds" if len(cfg["seeds"]) > 1 else ""
    grey = f"; grey dashed: {', '.join(baselines)}" if baselines else ""
    fig.suptitle(f"DigitsCNN ({cfg['parameters']} params) on sklearn digits, batch "
                 f"{cfg['batch_size']}, constant lr\nmean over "
                 f"{_plural(len(cfg['seeds']), 'seed')}{band}{grey}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str]) -> int:
    task = argparse.ArgumentParser(add_help=False)
    task.add_argument("--task", choices=("cnn", "autoencoder", "text"), default="cnn")
    known, rest = task.parse_known_args(argv)
    if known.task == "text":
        from .text_task import main as text_main
        return text_main(rest)
    if known.task == "autoencoder":
        from .autoencoder import main as autoencoder_main
        return autoencoder_main(rest)
    argv = rest
    parser = argparse.ArgumentParser(
        prog="python -m bench convergence",
        description="Train a small CNN on scikit-learn's digits with the family (AdaFisher fused "
                    "and reference, AdaFisherW, K-FAC, two-level K-FAC, SINGD, IKFAC, DyKAF), "
                    "the peers torch.optim.Muon (+ AdamW) and heavyball's SOAP (when installed), "
                    "Adam, AdamW and SGD; report test accuracy, "
                    "steps to 95 %, step time and AdaFisher's fused-vs-reference difference. "
                    "--task autoencoder: the two-level K-FAC paper's autoencoder experiment "
                    "(its own flags: --task autoencoder --help).")
    parser.add_argument("--task", choices=("cnn", "autoencoder", "text"), default="cnn",
                        help="cnn (default): this task; autoencoder: bench/autoencoder.py; text: a "
                             "byte-level GPT on the Python stdlib (bench/text_task.py)")
    parser.add_argument("--epochs", type=int, default=None, help=f"default {DEFAULT_EPOCHS}")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"number of seeds, 0..N-1 (default {DEFAULT_SEEDS})")
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 3 epochs (an explicit --epochs/--seeds wins)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY,
                        help=f"evaluate the test set every N steps and at each epoch end "
                             f"(default {DEFAULT_EVAL_EVERY})")
    parser.add_argument("--tcov", type=int, default=DEFAULT_TCOV,
                        help=f"AdaFisher curvature interval in steps (default {DEFAULT_TCOV})")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: this model is too small to gain "
                             "from more, and one thread times more steadily)")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated name prefixes, e.g. 'adafisher,sgd' (default: all)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of the curves")
    parser.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    args = parser.parse_args(argv)
    epochs = args.epochs if args.epochs is not None else (3 if args.quick else DEFAULT_EPOCHS)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else DEFAULT_SEEDS)
    for flag, value in (("--epochs", epochs), ("--seeds", seeds), ("--batch-size", args.batch_size),
                        ("--eval-every", args.eval_every), ("--tcov", args.tcov),
                        ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.plot:  # fail before training, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e .[bench]")
    from rich.console import Console
    console = Console()
    start = time.perf_counter()
    with console.status("training") as status:
        results = run_benchmark(epochs, seeds, args.batch_size, args.eval_every, args.tcov,
                                args.optimizers, args.threads,
                                progress=lambda s: status.update(f"training: {s}"))
    results["config"]["wall_s"] = time.perf_counter() - start
    for note in results["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    console.print(render(results))
    console.print(hyperparameter_text(results))
    console.print(agreement_text(results))
    walls = ", ".join(f"{r['optimizer']} {r['wall_s']:.0f} s" for r in results["optimizers"])
    console.print(f"Wall time {results['config']['wall_s']:.0f} s; training runs: {walls}; the rest "
                  "is loading, warm-up and the agreement checks.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(to_json(results), f, indent=1, ensure_ascii=False)
        console.print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        console.print(f"wrote {args.plot}")
    return 0
