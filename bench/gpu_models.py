"""`python -m bench.gpu_models --out FILE.json`: every member on two models as users build them,
eager and with the whole training step captured in a CUDA graph, against AdamW(fused).

The models: a torchvision ResNet-18 with the CIFAR stem (3x3 stride-1 first convolution, no
max-pool; 32 x 32 inputs, 10 classes, batch 128) and a HuggingFace GPT-2 built from a GPT2Config
(GPT2LMHeadModel, 6 layers x 512, 8 heads, vocabulary 8192, 256 positions, tied embedding, dropout
off so that two runs see the same numbers; batch 16 x 256; nothing is downloaded). The members:
AdaFisher, AdaFisherW, KFACPreconditioner + SGD, TwoLevelKFAC + SGD, SINGD diagonal and dense,
DyKAF; AdamW(fused=True) is the baseline. Curvature every 10 steps, K-FAC's (and two-level's)
inverses every 20.

Per model and member, two runs from the same initial weights on the same batches:
- eager: `warmup` steps, then `steps` timed iterations (zero_grad, forward, backward, step), each
  between two CUDA events (on the CPU, the wall clock);
- captured: the same `warmup` steps eagerly on a side stream (as torch.cuda.graph asks), one
  iteration (forward, backward, step; the gradients allocated in the graph's pool) captured with
  torch.cuda.graph, then `steps` replays on the same batches copied into the static inputs.

K-FAC's eigendecompositions cannot be captured (torch.linalg.eigh checks its result on the host):
after the warm-up both runs set `decompose_in_step = False` and call `decompose()` outside the
step, after each iteration k with k % inverse_every == 0, so that the two runs are the same
program and their difference is the capture's alone. Two-level K-FAC is captured the same way as
the others; where it refuses, its row keeps the refusal's message. The timed steps span at least
two curvature intervals (by default k = 3 .. 22: curvature at 10 and 20, an inverse at 20).

Each row: the median eager and captured iteration (ms) and the median of their curvature
iterations, each over AdamW(fused)'s median eager iteration; the largest relative parameter
difference between the captured and the eager run after the last step (per parameter
max|captured - eager| / max|eager|, the largest over parameters); whether every parameter, every
loss and every state tensor of both runs is finite. A member that fails is a row with its error;
the table goes on. The JSON is rewritten after every row, so a run cut short keeps what it did.

`--tiny` shrinks models, batches and intervals for a smoke test; on the CPU the captured run goes
through tests/capture.py (a CPU stand-in for capture and replay) when it is there, else the row
says capture needs CUDA. `--print FILE.json` renders a table written before.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASELINE = "AdamW(fused)"
MEMBERS = (BASELINE, "AdaFisher", "AdaFisherW", "KFACPreconditioner+SGD", "TwoLevelKFAC+SGD",
           "SINGD(diagonal)", "SINGD(dense)", "DyKAF")
# Run after every other row, in this order, on every model: a capture that fails (two-level's
# eigendecompositions sync; DyKAF's refresh is a torch.cond) could leave the process's CUDA state
# unusable, and the rows after it would be lost.
RUN_LAST = ("DyKAF", "TwoLevelKFAC+SGD")
# May refuse capture: a refusal with its message is an answer, not a failure.
MAY_REFUSE_CAPTURE = ("TwoLevelKFAC+SGD",)
MODELS = ("resnet18", "gpt2")


@dataclass
class Config:
    device: torch.device
    tiny: bool = False
    curvature_every: int = 10
    inverse_every: int = 20
    warmup: int = 3
    steps: int = 20
    tolerance: float = 1e-3
    budget_s: float | None = None
    models: tuple[str, ...] = MODELS
    members: tuple[str, ...] = MEMBERS
    seed: int = 0


# ------------------------------------------------------------------------------------ models

@dataclass
class ModelSpec:
    name: str
    description: str
    build: Callable[[], nn.Module]  # on the CPU, seeded by the caller
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]  # on the CPU
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class Missing(Exception):
    """A model whose package is not installed: its rows say so."""


def _missing(package: str, exc: ImportError, rows: str) -> str:
    if exc.name == package:
        return f"{package} is not installed; pip install {package} for the {rows} rows"
    return f"{package} cannot be imported ({type(exc).__name__}: {exc}), so there are no {rows} rows"


def resnet18_spec(tiny: bool) -> ModelSpec:
    try:
        import torchvision
    except ImportError as exc:
        raise Missing(_missing("torchvision", exc, "ResNet-18")) from None
    batch, side = (8, 16) if tiny else (128, 32)
    blocks = [1, 1, 1, 1] if tiny else [2, 2, 2, 2]

    def build():
        from torchvision.models.resnet import BasicBlock, ResNet
        model = ResNet(BasicBlock, blocks, num_classes=10)  # blocks [2, 2, 2, 2]: resnet18()
        # The CIFAR stem users put on it for 32 x 32 images.
        model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model

    def make_batch(g):
        return torch.randn(batch, 3, side, side, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def loss(model, x, y):
        return F.cross_entropy(model(x), y)

    return ModelSpec("resnet18", f"torchvision {torchvision.__version__} ResNet{'(1,1,1,1)' if tiny else '-18'}"
                     f", CIFAR stem, batch {batch} x 3 x {side} x {side}", build, make_batch, loss)


def gpt2_spec(tiny: bool) -> ModelSpec:
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise Missing(_missing("transformers", exc, "GPT-2")) from None
    if tiny:
        layers, dim, heads, vocab, context, batch = 2, 32, 2, 101, 16, 4
    else:
        layers, dim, heads, vocab, context, batch = 6, 512, 8, 8192, 256, 16
    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab,
                        n_positions=context, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True)

    def build():
        return GPT2LMHeadModel(config)

    def make_batch(g):
        ids = torch.randint(0, vocab, (batch, context + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def loss(model, x, y):
        # Called as users call it. (With use_cache=False, transformers reads position ids on the
        # host to look for packed sequences, except while a CUDA stream captures.)
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return ModelSpec("gpt2", f"transformers {transformers.__version__} GPT2LMHeadModel {layers} x {dim}, "
                     f"vocab {vocab}, tied, batch {batch} x {context}", build, make_batch, loss)


SPECS = {"resnet18": resnet18_spec, "gpt2": gpt2_spec}


# ------------------------------------------------------------------------------------ members

class Recipe:
    """A member on a model as a training loop drives it: `zero_grad`, `before_forward` (two-level's
    statistics flag), `step` (after backward), `prepare_capture` (called in both runs once the
    warm-up is done) and `outside(k)` (eager work after iteration k, outside any graph)."""

    def __init__(self, objects: list, step: Callable[[], None], zero_grad: Callable[[], None],
                 before_forward: Callable[[], None] = lambda: None,
                 prepare_capture: Callable[[], None] = lambda: None,
                 outside: Callable[[int], None] = lambda k: None):
        self.objects, self.step, self.zero_grad = objects, step, zero_grad
        self.before_forward, self.prepare_capture, self.outside = before_forward, prepare_capture, outside


def _sgd(params, lr: float, device: torch.device, **kw) -> torch.optim.SGD:
    from .measure import adamw_fused_supported
    return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=adamw_fused_supported(device), **kw)


def _optimizer(opt) -> Recipe:
    return Recipe([opt], opt.step, lambda: opt.zero_grad(set_to_none=True))


def twolevel_modules(model: nn.Module) -> nn.Module:
    """What two-level K-FAC is built on: the largest modules that hold no Embedding and share no
    parameter with one (two-level refuses an Embedding, whose input factor would be vocabulary x
    vocabulary); on the GPT-2, its blocks and final LayerNorm, the tied head being the embedding's
    weight. SGD still updates every parameter."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return model
    shared = {id(p) for m in embeddings for p in m.parameters()}
    kept: list[nn.Module] = []

    def visit(module):
        holds = any(isinstance(m, nn.Embedding) for m in module.modules())
        touches = any(id(p) in shared for p in module.parameters())
        if not holds and not touches:
            kept.append(module)
            return
        if isinstance(module, nn.Embedding):
            return
        for child in module.children():
            visit(child)

    visit(model)
    return nn.ModuleList(kept)


def build_member(name: str, model: nn.Module, cfg: Config, captured: bool) -> Recipe:
    import cafin
    from .measure import adamw_fused_supported
    c, inv, dev = cfg.curvature_every, cfg.inverse_every, cfg.device
    if name == BASELINE:
        fused = adamw_fused_supported(dev)
        # A captured AdamW must keep its step count on the device (capturable).
        return _optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused,
                                            foreach=None if fused else True, capturable=captured))
    if name == "AdaFisher":
        return _optimizer(cafin.AdaFisher(model, lr=1e-3, TCov=c))
    if name == "AdaFisherW":
        return _optimizer(cafin.AdaFisherW(model, lr=1e-3, TCov=c, weight_decay=1e-2))
    if name.startswith("SINGD"):
        structure = name[name.index("(") + 1:-1]
        return _optimizer(cafin.SINGD(model, params=model.parameters(), lr=1e-3, T=c,
                                      structures=(structure, structure), warn_unsupported=False))
    if name == "DyKAF":
        return _optimizer(cafin.DyKAF(model.parameters(), lr=3e-3, precondition_frequency=c))
    if name == "KFACPreconditioner+SGD":
        # kfac-pytorch's CIFAR-10 example settings (bench/members/kfac.py).
        pre = cafin.KFACPreconditioner(model, factor_update_steps=c, inv_update_steps=inv,
                                       damping=3e-3, kl_clip=1e-3, lr=0.1)
        opt = _sgd(model.parameters(), 0.1, dev, weight_decay=5e-4)

        def prepare():
            pre.decompose_in_step = False

        def outside(k):
            if k % inv == 0:
                pre.decompose()

        def step():
            pre.step()
            opt.step()
        return Recipe([pre, opt], step, lambda: opt.zero_grad(set_to_none=True),
                      prepare_capture=prepare, outside=outside)
    if name == "TwoLevelKFAC+SGD":
        # The published clipping and damping 1e-2 (bench/members/twolevel.py); statistics taken
        # while update_stats is set, as its published training loops do.
        pre = cafin.TwoLevelKFAC(twolevel_modules(model), damping=1e-2, T_cov=c, T_inv=inv,
                                 constraint_norm=True)
        opt = _sgd(model.parameters(), 0.05, dev)

        def step():
            pre.step(update_params=True)
            pre.update_stats = False
            opt.step()

        def before():
            pre.update_stats = True
        return Recipe([pre, opt], step, lambda: opt.zero_grad(set_to_none=True), before_forward=before)
    raise ValueError(f"unknown member {name!r}; choose from {', '.join(MEMBERS)}")


# ------------------------------------------------------------------------------------ runs

class Clock:
    """Per-iteration times: CUDA events on a GPU (read after the run), the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, began) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((began, end))
        else:
            self.marks.append((time.perf_counter() - began) * 1e3)

    def ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return list(self.marks)


@dataclass
class RunResult:
    times_ms: list[float]  # the timed iterations k = warmup .. warmup + steps - 1
    params: list[torch.Tensor]
    losses: list[torch.Tensor]
    finite: bool
    not_finite: list[str] = field(default_factory=list)


def _iteration(spec: ModelSpec, model, recipe: Recipe, x, y) -> torch.Tensor:
    recipe.before_forward()
    loss = spec.loss(model, x, y)
    loss.backward()
    recipe.step()
    return loss.detach()


def _state_tensors(objects) -> list[tuple[str, torch.Tensor]]:
    out = []
    for obj in objects:
        try:
            sd = obj.state_dict()
        except Exception as exc:  # noqa: BLE001  (reported, not fatal)
            out.append((f"{type(obj).__name__}.state_dict() raised {type(exc).__name__}: {exc}", None))
            continue
        stack = [(type(obj).__name__, sd)]
        while stack:
            where, value = stack.pop()
            if isinstance(value, torch.Tensor):
                out.append((where, value))
            elif isinstance(value, dict):
                stack += [(f"{where}.{k}", v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return out


def _finish(model, recipe: Recipe, times, losses) -> RunResult:
    params = [p.detach().clone() for p in model.parameters()]
    bad = []
    for (name, p) in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            bad.append(f"parameter {name}")
    for i, loss in enumerate(losses):
        if not bool(torch.isfinite(loss).all()):
            bad.append(f"loss of timed step {i}")
            break
    for where, t in _state_tensors(recipe.objects):
        if t is None:
            bad.append(where)
        elif (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            bad.append(f"state {where}")
    return RunResult(times, params, losses, not bad, bad[:5])


def eager_run(spec: ModelSpec, base: nn.Module, name: str, cfg: Config, batches) -> RunResult:
    model = copy.deepcopy(base).to(cfg.device)
    recipe = build_member(name, model, cfg, captured=False)
    clock, losses = Clock(cfg.device), []
    for k, (x, y) in enumerate(batches):
        if k == cfg.warmup:
            recipe.prepare_capture()
        began = clock.start() if k >= cfg.warmup else None
        recipe.zero_grad()
        loss = _iteration(spec, model, recipe, x, y)
        if k >= cfg.warmup:
            recipe.outside(k)
            clock.stop(began)
            losses.append(loss)
    return _finish(model, recipe, clock.ms(), losses)


def _cpu_graph():
    """tests/capture.py's Graph (the CPU stand-in for capture and replay), or None."""
    tests = os.path.join(ROOT, "tests")
    if not os.path.isfile(os.path.join(tests, "capture.py")):
        return None
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import capture
    return capture.Graph


def capture_route(device: torch.device) -> str | None:
    """How this device captures, or None."""
    if device.type == "cuda":
        return "torch.cuda.graph"
    if device.type == "cpu" and _cpu_graph() is not None:
        return "tests/capture.py (CPU stand-in)"
    return None


def captured_run(spec: ModelSpec, base: nn.Module, name: str, cfg: Config, batches) -> RunResult:
    dev = cfg.device
    model = copy.deepcopy(base).to(dev)
    recipe = build_member(name, model, cfg, captured=True)
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    cuda = dev.type == "cuda"
    if cuda:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        context = torch.cuda.stream(side)
    else:
        context = _nullcontext()
    with context:
        for x, y in batches[:cfg.warmup]:
            static_x.copy_(x)
            static_y.copy_(y)
            recipe.zero_grad()
            _iteration(spec, model, recipe, static_x, static_y)
    if cuda:
        torch.cuda.current_stream(dev).wait_stream(side)
    recipe.prepare_capture()
    recipe.zero_grad()  # the captured backward allocates the gradients in the graph's pool
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = _iteration(spec, model, recipe, static_x, static_y)
    else:
        graph = _cpu_graph()()
        with graph.capture():
            static_loss = _iteration(spec, model, recipe, static_x, static_y)
    clock, losses = Clock(dev), []
    for k in range(cfg.warmup, len(batches)):
        x, y = batches[k]
        began = clock.start()
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        recipe.outside(k)
        clock.stop(began)
        losses.append(static_loss.clone())
    result = _finish(model, recipe, clock.ms(), losses)
    del graph
    return result


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _message(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and message, and the one it was raised while handling (a failed
    capture's end often hides the op that broke it), each cut to `limit` characters."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen and len(parts) < 3:
        seen.add(id(exc))
        text = " ".join(str(exc).split())
        parts.append(f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _max_relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over parameters of max|a - b| / max|b| (NaN where a difference is NaN)."""
    worst = 0.0
    for p, q in zip(a, b):
        if not q.numel():
            continue
        diff = float((p.double() - q.double()).abs().max())
        scale = float(q.double().abs().max())
        value = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        if math.isnan(value):
            return math.nan
        worst = max(worst, value)
    return worst


def _empty_row(model: str, member: str) -> dict:
    return {"model": model, "member": member, "status": "not run", "error": None,
            "eager_ms": None, "eager_curvature_ms": None, "captured_ms": None,
            "captured_curvature_ms": None, "eager_vs_adamw": None, "captured_vs_adamw": None,
            "captured_vs_eager_max_rel_error": None, "finite": None, "finite_eager": None,
            "finite_captured": None, "not_finite": [], "captured_via": None,
            "capture_error": None, "timed_steps": 0, "seconds": 0.0, "problem": None}


def run_row(spec: ModelSpec, base, name: str, cfg: Config, batches) -> dict:
    row = _empty_row(spec.name, name)
    began = time.perf_counter()
    curvature = [i for i, k in enumerate(range(cfg.warmup, len(batches))) if k % cfg.curvature_every == 0]
    try:
        eager = eager_run(spec, base, name, cfg, batches)
    except Exception as exc:  # noqa: BLE001  (one member's failure is its row)
        row.update(status="error", error=_message(exc), traceback=traceback.format_exc(limit=-8))
        row["seconds"] = time.perf_counter() - began
        return row
    row.update(status="ok", eager_ms=_median(eager.times_ms), timed_steps=len(eager.times_ms),
               eager_curvature_ms=_median([eager.times_ms[i] for i in curvature]),
               finite_eager=eager.finite, not_finite=[f"eager: {w}" for w in eager.not_finite])
    route = capture_route(cfg.device)
    row["captured_via"] = route
    if route is None:
        row["capture_error"] = (f"capture needs CUDA (device {cfg.device.type}; tests/capture.py, "
                                "the CPU stand-in, is not there)")
    else:
        _release(cfg.device)
        try:
            cap = captured_run(spec, base, name, cfg, batches)
        except Exception as exc:  # noqa: BLE001
            row["capture_error"] = _message(exc)
            row["capture_traceback"] = traceback.format_exc(limit=-8)
        else:
            row.update(captured_ms=_median(cap.times_ms),
                       captured_curvature_ms=_median([cap.times_ms[i] for i in curvature]),
                       finite_captured=cap.finite,
                       captured_vs_eager_max_rel_error=_max_relative_difference(cap.params, eager.params))
            row["not_finite"] += [f"captured: {w}" for w in cap.not_finite]
    finite = [f for f in (row["finite_eager"], row["finite_captured"]) if f is not None]
    row["finite"] = all(finite)
    row["seconds"] = time.perf_counter() - began
    return row


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cuda_usable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    try:
        torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize(device)
        return None
    except Exception as exc:  # noqa: BLE001
        return _message(exc)


def problems(row: dict, cfg_tolerance: float, capture_possible: bool) -> str | None:
    """What is wrong with a row, or None."""
    if row["status"] == "not run":
        return None
    if row["status"] == "error":
        return f"error: {row['error']}"
    if row["finite"] is False:
        return "not finite: " + "; ".join(row["not_finite"])
    if capture_possible and row["capture_error"] and row["member"] not in MAY_REFUSE_CAPTURE:
        return f"capture failed: {row['capture_error']}"
    err = row["captured_vs_eager_max_rel_error"]
    if err is not None and not err <= cfg_tolerance:
        return f"captured differs from eager: {err:.3g} > {cfg_tolerance:g}"
    return None


def _ratios(rows: list[dict]) -> None:
    base = next((r for r in rows if r["member"] == BASELINE and r["eager_ms"]), None)
    for r in rows:
        if base is None:
            continue
        if r["eager_ms"] is not None:
            r["eager_vs_adamw"] = r["eager_ms"] / base["eager_ms"]
        if r["captured_ms"] is not None:
            r["captured_vs_adamw"] = r["captured_ms"] / base["eager_ms"]


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan" / "inf": JSON has neither
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def environment(device: torch.device) -> dict:
    import cafin
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "cuda_kernels_built": bool(cafin.cuda_kernels_built()), "python": sys.version.split()[0]}
    for package in ("transformers", "torchvision"):
        try:
            env[package] = __import__(package).__version__
        except ImportError:
            env[package] = None
    return env


def run_table(cfg: Config, out: str | None = None, log=print) -> dict:
    began = time.perf_counter()
    route = capture_route(cfg.device)
    table = {"environment": environment(cfg.device),
             "config": {"device": str(cfg.device), "tiny": cfg.tiny,
                        "curvature_every": cfg.curvature_every, "inverse_every": cfg.inverse_every,
                        "warmup": cfg.warmup, "steps": cfg.steps, "tolerance": cfg.tolerance,
                        "budget_s": cfg.budget_s, "capture": route},
             "models": [], "rows": [], "summary": {}}
    plans = []  # (spec or error, model name)
    for model in cfg.models:
        try:
            spec = SPECS[model](cfg.tiny)
            table["models"].append({"model": model, "description": spec.description, "error": None})
            plans.append((model, spec, None))
        except Missing as exc:
            table["models"].append({"model": model, "description": None, "error": str(exc)})
            plans.append((model, None, str(exc)))
    # Rows in table order; run in an order that keeps the risky captures last.
    rows = {(m, n): _empty_row(m, n) for m, _, _ in plans for n in cfg.members}
    table["rows"] = list(rows.values())
    rank = {n: RUN_LAST.index(n) + 1 if n in RUN_LAST else 0 for n in cfg.members}
    order = [(m, spec, err, n) for r in sorted(set(rank.values())) for m, spec, err in plans
             for n in cfg.members if rank[n] == r]
    prepared: dict[str, tuple] = {}
    broken = None
    for model, spec, err, name in order:
        row = rows[(model, name)]
        if err is not None:
            row.update(status="not run", error=err)
            continue
        if broken:
            row.update(status="error", error=f"not run: the CUDA context failed after an earlier row ({broken})")
            continue
        if cfg.budget_s is not None and time.perf_counter() - began > cfg.budget_s:
            row.update(status="not run", error=f"not run: the time budget ({cfg.budget_s:g} s) is spent")
            continue
        if model not in prepared:
            try:
                torch.manual_seed(cfg.seed)
                base = spec.build().train()  # the initial weights, kept on the CPU for every run
                g = torch.Generator().manual_seed(cfg.seed + 1)
                batches = [tuple(t.to(cfg.device) for t in spec.batch(g))
                           for _ in range(cfg.warmup + cfg.steps)]
                prepared[model] = (base, batches, None)
            except Exception as exc:  # noqa: BLE001
                prepared[model] = (None, None, f"building the model raised {_message(exc)}")
        base, batches, build_error = prepared[model]
        if build_error:
            row.update(status="error", error=build_error)
            continue
        log(f"{model}: {name} ...")
        row.update(run_row(spec, base, name, cfg, batches))
        _release(cfg.device)
        broken = _cuda_usable(cfg.device)
        _ratios([r for r in table["rows"] if r["model"] == model])
        for r in table["rows"]:
            r["problem"] = problems(r, cfg.tolerance, route is not None)
        log(format_row(row))
        table["summary"] = summarise(table, time.perf_counter() - began)
        if out:
            write(table, out)
    table["summary"] = summarise(table, time.perf_counter() - began)
    if out:
        write(table, out)
    return table


def summarise(table: dict, elapsed: float) -> dict:
    rows = table["rows"]
    return {"rows": len(rows), "ok": sum(r["status"] == "ok" and not r["problem"] for r in rows),
            "problems": sum(bool(r["problem"]) for r in rows),
            "not_run": sum(r["status"] == "not run" for r in rows), "elapsed_s": elapsed}


def write(table: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_json_safe(table), f, indent=1)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ text

def _num(v, fmt: str) -> str:
    width = int("".join(ch for ch in fmt.split(".")[0] if ch.isdigit()) or 0)
    if v is None:
        return "-".rjust(width)
    if isinstance(v, str):  # "nan" / "inf" read back from JSON
        return v.rjust(width)
    return format(v, fmt)


def format_row(r: dict) -> str:
    note = r.get("problem") or ""
    if not note and r["status"] != "ok":
        note = r["error"] or r["status"]
    elif not note and r["capture_error"]:
        note = "capture: " + r["capture_error"]
    fin = {True: "yes", False: "NO", None: "-"}[r["finite"]]
    return (f"{r['member']:<23}{_num(r['eager_ms'], '9.2f')} {_num(r['eager_vs_adamw'], '6.2f')}"
            f" {_num(r['captured_ms'], '9.2f')} {_num(r['captured_vs_adamw'], '6.2f')}"
            f" {_num(r['captured_vs_eager_max_rel_error'], '9.1e')} {fin:>4}  {note}")


def render(table: dict, width: int = 160) -> str:
    cfg = table["config"]
    lines = [f"every member, eager and captured ({cfg['capture'] or 'no capture here'}) on {cfg['device']}",
             f"curvature every {cfg['curvature_every']}, inverses every {cfg['inverse_every']}; "
             f"{cfg['steps']} timed steps after {cfg['warmup']} warm-up; medians",
             f"x: over {BASELINE}'s eager iteration; capt.err: captured vs eager parameters, max relative"]
    for m in table["models"]:
        lines.append(f"[{m['model']}] {m['description'] or m['error']}")
        lines.append(f"{'member':<23}{'eager ms':>9} {'x':>6} {'capt. ms':>9} {'x':>6} {'capt.err':>9} "
                     f"{'fin.':>4}  note")
        for r in table["rows"]:
            if r["model"] == m["model"]:
                lines.append(format_row(r)[:width])
    s = table.get("summary") or {}
    lines.append(f"table: {s.get('rows', 0)} rows, {s.get('ok', 0)} ok, {s.get('problems', 0)} problems, "
                 f"{s.get('not_run', 0)} not run, {s.get('elapsed_s', 0):.0f} s")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.gpu_models",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="FILE.json", help="write the table as JSON (after every row)")
    p.add_argument("--print", dest="print_file", metavar="FILE.json",
                   help="print the table of a JSON written before, and nothing else")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--tiny", action="store_true",
                   help="small models and batches, curvature every 2, inverses every 4, 6 timed "
                        "steps (a smoke test; on the CPU a few seconds a member)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list out of {', '.join(MODELS)}")
    p.add_argument("--members", default=None,
                   help=f"comma list out of {', '.join(MEMBERS)} (default all; {BASELINE} always runs)")
    p.add_argument("--curvature-every", type=int, default=None, help="default 10 (--tiny: 2)")
    p.add_argument("--inverse-every", type=int, default=None, help="default 20 (--tiny: 4)")
    p.add_argument("--warmup", type=int, default=3, help="eager steps before timing and capture")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps after the warm-up (default 20, --tiny: 6)")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="the largest captured-vs-eager relative parameter difference that passes")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no row after this many seconds (the rest say so)")
    args = p.parse_args(argv)
    if args.print_file:
        return args
    args.models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        p.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")
    if args.members:
        chosen = [m.strip() for m in args.members.split(",") if m.strip()]
        unknown = [m for m in chosen if m not in MEMBERS]
        if unknown:
            p.error(f"--members: unknown {', '.join(unknown)}; choose from {', '.join(MEMBERS)}")
        args.members = tuple(m for m in MEMBERS if m in chosen or m == BASELINE)
    else:
        args.members = MEMBERS
    args.curvature_every = args.curvature_every or (2 if args.tiny else 10)
    args.inverse_every = args.inverse_every or (4 if args.tiny else 20)
    args.steps = args.steps or (6 if args.tiny else 20)
    for flag in ("curvature_every", "inverse_every", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (a capture needs eager steps before it)")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.print_file:
        with open(args.print_file) as f:
            print(render(json.load(f)))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {device}: CUDA is not available in this torch build", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = Config(device=device, tiny=args.tiny, curvature_every=args.curvature_every,
                 inverse_every=args.inverse_every, warmup=args.warmup, steps=args.steps,
                 tolerance=args.tolerance, budget_s=args.budget_s, models=args.models,
                 members=args.members)
    table = run_table(cfg, args.out, log=lambda s: print(s, flush=True))
    print(render(table))
    return 1 if table["summary"]["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
