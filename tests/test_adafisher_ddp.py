"""Distributed training and gradient accumulation of AdaFisher / AdaFisherW.

Distributed: two CPU processes on the gloo backend (tests/dist_worker.py, started with
subprocess by tests/two_ranks.py, meeting through a file, every exit bounded).
One launch per backend runs every case (4 ways of wiring data parallelism x 2 optimizers) and
writes what it saw; the tests below assert on it:
- parameters and factors bit-identical on both ranks after 3*TCov+1 steps and after more;
- exactly one collective per curvature step, an all_reduce over one flat float32 buffer holding
  every factor, none on other steps, none in the forward/backward hooks;
- equal within FP32 tolerance to a single-process float64 oracle that runs each rank's batch
  separately, normalises each rank's statistics, averages the normalised statistics over the
  ranks and folds that average into the factors (the factors of the previous update
  are the same on every rank, so the mean of the ranks' folds is the fold of the mean);
- a checkpoint saved on rank 0 resumes in this (non-distributed) process and continues exactly
  as the distributed run continues (both then see the same batch on every rank);
- DDP with `no_sync()` micro-batches;
- ranks that disagree on the model fail with a ValueError on every rank.

Which model to give the optimizer under DDP: both `AdaFisher(ddp_model)` and
`AdaFisher(ddp_model.module)` train identically (the hooks sit on the inner modules either way);
only the `.module` form writes checkpoints that a non-DDP (single-process) optimizer loads, see
test_checkpoint_from_rank0_resumes_in_one_process[ddp-*].

Gradient accumulation (single process): statistics="per_step" folds the mean of the micro-batch
raw statistics once per step; statistics="per_pass" folds every pass (as published).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import cafin
from cafin import AdaFisher, AdaFisherW

import dist_worker as W
import two_ranks
from oracle import (SUPPORTED, Oracle, adafisher_update, normalise, raw_statistics,
                    takes_statistics)

BACKENDS = ["reference", "fused"]
OPTIMIZERS = [pytest.param(AdaFisher, id="AdaFisher"), pytest.param(AdaFisherW, id="AdaFisherW")]
CASES = [pytest.param(wrap, opt, id=f"{wrap}-{opt}") for wrap in W.WRAPS for opt in W.OPTIMIZERS]
TOL = 1e-5  # float32 cafin against a float64 oracle, max|a - b| / max|b|
WORKER = Path(__file__).with_name("dist_worker.py")



def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


# ------------------------------------------------------------------------------ launching
_LAUNCHES: dict[tuple[str, str], tuple[Path, str | None]] = {}


def launched(scenario: str, backend: str, tmp_path_factory) -> tuple[Path, str | None]:
    """One launch per (scenario, backend) per session, shared by the tests that read it."""
    key = (scenario, backend)
    if key not in _LAUNCHES:
        outdir = tmp_path_factory.mktemp(f"dist-{scenario}-{backend}")
        start = time.monotonic()
        failure = two_ranks.launch(lambda rank: [WORKER, scenario, backend, outdir], outdir, W.WORLD)
        print(f"\n[{scenario}/{backend}: 2 ranks in {time.monotonic() - start:.1f} s]")
        _LAUNCHES[key] = (outdir, failure)
    return _LAUNCHES[key]


def results(scenario, backend, case, tmp_path_factory) -> list[dict]:
    outdir, failure = launched(scenario, backend, tmp_path_factory)
    out, problems = [], []
    for rank in range(W.WORLD):
        path = outdir / f"{case}_rank{rank}.pt"
        if not path.exists():
            problems.append(f"rank {rank} wrote no result for {case}")
            continue
        r = torch.load(path, weights_only=False)
        if r.get("error"):  # a rank stops at its first error; its peer then fails too
            problems.append(f"rank {rank} failed in {case}:\n{r['error']}")
        out.append(r)
    if problems:
        pytest.fail("\n".join(problems) + (f"\nthe launch: {failure}" if failure else ""))
    return out


# ------------------------------------------------------------------------------ the oracle
def distributed_oracle(opt_name: str, n_micro: int, steps: int = W.STEPS):
    """Single process, float64: per step, each rank's batch is run separately (as n_micro
    micro-batches with the loss scaled by 1/n_micro); each rank's statistics are the mean of its
    micro-batches' raw statistics, min-max normalised; the factors fold the mean over the ranks of
    those normalised statistics, F <- 0.1*gamma*F + 0.01*gamma*mean_r(z_hat_r); the gradient is
    the mean over the ranks (what DDP or the user's all-reduce computes)."""
    model = W.make_model(seed=0).double()
    hp = W.HP
    decoupled = opt_name == "AdaFisherW"
    oracle = Oracle(model, decoupled=decoupled, TCov=W.TCOV, **hp)  # for owners/preconditioner
    owner = oracle.owners()
    modules = [m for m in model.modules() if isinstance(m, SUPPORTED)]
    params = list(model.parameters())
    state = {id(p): {"step": 0, "exp_avg": torch.zeros_like(p)} for p in params}
    for k in range(steps):
        curvature = k % W.TCOV == 0
        grad_sum = [torch.zeros_like(p) for p in params]
        z_hat_sum: dict[tuple[nn.Module, str], torch.Tensor] = {}
        for rank in range(W.WORLD):
            raw: dict[tuple[nn.Module, str], list[torch.Tensor]] = {}
            for x, y in W.micro_batches(W.rank_batch(k, rank), n_micro):
                captured = []

                def hook(mod, inputs, output):
                    if takes_statistics(mod, inputs[0]):
                        captured.append((mod, inputs[0].detach(), output))
                    return output.clone()  # an in-place op downstream must not touch `output`

                handles = [m.register_forward_hook(hook) for m in modules] if curvature else []
                try:
                    loss = W.loss_of(model(x.double()), y.double(), n_micro)
                finally:
                    for h in handles:
                        h.remove()
                outs = [o for _, _, o in captured]
                grads = torch.autograd.grad(loss, params + outs)
                for acc, g in zip(grad_sum, grads[:len(params)]):
                    acc += g
                for (m, xin, out), g in zip(captured, grads[len(params):]):
                    h, s = raw_statistics(m, xin, g.detach(), out.detach())
                    raw.setdefault((m, "H"), []).append(h)
                    raw.setdefault((m, "S"), []).append(s)
            for key, zs in raw.items():
                z_hat = normalise(torch.stack(zs).mean(dim=0))
                z_hat_sum[key] = z_hat_sum.get(key, 0) + z_hat
        for (m, side), total in z_hat_sum.items():
            slot = oracle.factors.setdefault(m, {})
            base = slot.get(side, torch.ones_like(total))
            slot[side] = 0.1 * hp["gamma"] * base + 0.01 * hp["gamma"] * total / W.WORLD
        with torch.no_grad():
            for p, g_sum in zip(params, grad_sum):
                g = g_sum / W.WORLD
                st = state[id(p)]
                f_tilde = oracle.preconditioner(p, owner, hp["Lambda"])
                adafisher_update(p, g, st, f_tilde, hp["lr"], hp["beta"], hp["weight_decay"],
                                 decoupled)
    factors = {}
    for name, m in W.anchors(model):
        factors[f"{name}.S"] = oracle.factors[m]["S"]
        factors[f"{name}.H"] = oracle.factors[m]["H"]
    return [p.detach() for p in model.parameters()], factors


_ORACLE: dict[tuple[str, int], tuple] = {}


def oracle_for(opt_name: str, n_micro: int):
    key = (opt_name, n_micro)
    if key not in _ORACLE:
        _ORACLE[key] = distributed_oracle(opt_name, n_micro)
    return _ORACLE[key]


# ------------------------------------------------------------------------------ distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrap, opt_name", CASES)
def test_ranks_stay_bit_identical(wrap, opt_name, backend, tmp_path_factory):
    r0, r1 = results("train", backend, f"{wrap}-{opt_name}", tmp_path_factory)
    for key in ("params", "continued"):
        for i, (a, b) in enumerate(zip(r0[key], r1[key])):
            assert torch.equal(a, b), f"{key}: parameter {i} differs between the ranks"
    for name in r0["factors"]:
        assert torch.equal(r0["factors"][name], r1["factors"][name]), f"factor {name} differs"
    moved = max(rel(a, b) for a, b in zip(r0["params"], r0["initial"]))
    assert moved > 1e-3, "the parameters barely moved: the comparison would prove little"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrap, opt_name", CASES)
def test_one_flat_all_reduce_per_curvature_step(wrap, opt_name, backend, tmp_path_factory):
    for rank, r in enumerate(results("train", backend, f"{wrap}-{opt_name}", tmp_path_factory)):
        # Construction: the layout check, one all_gather_object.
        assert [c[0] for c in r["construct"]] == ["all_gather_object"], r["construct"]
        # The statistics hooks make no collective (DDP's own gradient all-reduce is in C++).
        assert all(calls == [] for calls in r["fwd_bwd"]), r["fwd_bwd"]
        expected_numel = r["flat_numel"]  # every S and H of every supported layer
        for k, calls in enumerate(r["step"]):
            if k % W.TCOV == 0:
                assert calls == [("all_reduce", expected_numel, "float32")], \
                    f"rank {rank}, step {k}: {calls}"
            else:
                assert calls == [], f"rank {rank}, step {k} (no curvature update): {calls}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrap, opt_name", CASES)
def test_matches_single_process_average_of_rank_statistics(wrap, opt_name, backend,
                                                           tmp_path_factory):
    r0, _ = results("train", backend, f"{wrap}-{opt_name}", tmp_path_factory)
    params, factors = oracle_for(opt_name, W.WRAPS[wrap])
    worst = {}
    for name, f in factors.items():
        worst[name] = rel(r0["factors"][name], f)
    for i, (p, q) in enumerate(zip(r0["params"], params)):
        worst[f"param{i}"] = rel(p, q)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"differences from the single-process oracle above {TOL}: {bad}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_name", W.OPTIMIZERS)
def test_ddp_module_and_inner_module_train_identically(opt_name, backend, tmp_path_factory):
    """AdaFisher(ddp) and AdaFisher(ddp.module): same hooks, same numbers, bit for bit."""
    (a, _), (b, _) = (results("train", backend, f"{w}-{opt_name}", tmp_path_factory)
                      for w in ("ddp", "ddp_module"))
    for key in ("params", "continued"):
        for p, q in zip(a[key], b[key]):
            assert torch.equal(p, q)


def _train_one_process(model, opt, steps, n_micro):
    for k in steps:
        opt.zero_grad(set_to_none=True)
        for x, y in W.micro_batches(W.rank_batch(k, None), n_micro):
            W.loss_of(model(x), y, n_micro).backward()
        opt.step()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrap, opt_name", CASES)
@pytest.mark.parametrize("where", ["no_process_group", "world_size_1_group"])
def test_checkpoint_from_rank0_resumes_in_one_process(where, wrap, opt_name, backend,
                                                      tmp_path_factory, one_thread):
    """Rank 0 saved {model, optimizer} state dicts after STEPS steps (state_dict() on rank 0
    only: it makes no collective). A fresh plain model and optimizer load them, alone, and take
    the CONTINUE steps the ranks took (on the batch both ranks used): the parameters equal
    rank 0's bit for bit. Alone means here, in this process, without torch.distributed; or on
    rank 0 in a process group of world size 1 (process_group=, see dist_worker.resume_alone).
    The [ddp-*] cases (optimizer built on the DDP wrapper) fail until cafin drops the "module."
    prefix of DDP from its layer names (the checkpoint's layout check compares them)."""
    case = f"{wrap}-{opt_name}"
    r0, _ = results("train", backend, case, tmp_path_factory)
    if where == "world_size_1_group":
        resumed = r0["resumed_solo"]
        if isinstance(resumed, str):
            pytest.fail(f"resuming on rank 0 alone failed:\n{resumed}")
        for i, (p, q) in enumerate(zip(resumed, r0["continued"])):
            assert torch.equal(p, q), f"parameter {i}: resumed run differs from the distributed one"
        return
    outdir, _ = launched("train", backend, tmp_path_factory)
    ckpt = torch.load(outdir / f"{case}_ckpt.pt", weights_only=True)
    assert ckpt["opt"]["param_groups"][0]["curvature"]["k"] == W.STEPS
    model = W.make_model(seed=7)  # overwritten by the checkpoint
    model.load_state_dict(ckpt["model"])
    opt = getattr(cafin, opt_name)(model, TCov=W.TCOV, backend=backend, **W.HP)
    opt.load_state_dict(ckpt["opt"])
    _train_one_process(model, opt, range(W.STEPS, W.STEPS + W.CONTINUE), W.WRAPS[wrap])
    for i, (p, q) in enumerate(zip(model.parameters(), r0["continued"])):
        assert torch.equal(p, q), f"parameter {i}: resumed run differs from the distributed one"


@pytest.mark.parametrize("case", ["hidden_size", "extra_layer", "frozen_layer"])
def test_ranks_that_disagree_fail_on_every_rank(case, tmp_path_factory):
    """Rank 1's model differs (a layer size, an extra layer, a frozen layer): constructing the
    optimizer raises a ValueError naming the disagreement on both ranks, within the launch
    timeout, and leaves the process group usable."""
    outdir, failure = launched("mismatch", "reference", tmp_path_factory)
    assert failure is None, failure
    for rank in range(W.WORLD):
        r = torch.load(outdir / f"{case}_rank{rank}.pt", weights_only=False)
        assert r["error_type"] == "ValueError", (rank, r)
        assert "ranks disagree" in r["message"], r["message"]
        assert r["group_works"]


# ------------------------------------------------------------------------ gradient accumulation
def conv_linear_model(seed=0) -> nn.Sequential:
    """Per-sample statistics only (no batch-coupled norm layers)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                             nn.Linear(3 * 5 * 5, 8), nn.Tanh(), nn.Linear(8, 3))


def _factors(opt, model):
    return W.factors_of(opt, model)


class _Tap:
    """Records, per pass, each supported module's input and the gradient of its output: the
    tensors cafin's own hooks see."""

    def __init__(self, model):
        self.passes: list[dict] = []
        self.handles = []
        for name, m in W.anchors(model):
            self.handles.append(m.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(mod, inputs, output):
            if not torch.is_grad_enabled():
                return
            entry = {"module": mod, "x": inputs[0].detach().clone()}
            self.passes[-1][name] = entry
            output.register_hook(lambda g: entry.__setitem__("g", g.detach().clone()))
        return hook

    def new_pass(self):
        self.passes.append({})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("statistics", ["per_step", "per_pass"])
@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_accumulated_factors_follow_the_documented_fold(n_micro, statistics, backend):
    """TCov = 2, three steps of n_micro micro-batches (loss / n_micro), every supported layer type.
    per_step: at a curvature step, F <- fold(F, normalise(mean over the micro-batches of the raw
    statistics)), once. per_pass: F <- fold(F, normalise(raw of that pass)) after every pass, so
    n_micro folds per curvature step. No fold on the step in between."""
    tcov, gamma = 2, W.HP["gamma"]
    model = W.make_model(seed=0)
    opt = AdaFisher(model, TCov=tcov, backend=backend, statistics=statistics, **W.HP)
    tap = _Tap(model)
    expected: dict[str, torch.Tensor] = {}

    def fold(key, z):
        base = expected.get(key, torch.ones_like(z))
        expected[key] = 0.1 * gamma * base + 0.01 * gamma * normalise(z)

    for k in range(3):
        opt.zero_grad(set_to_none=True)
        tap.passes.clear()
        for x, y in W.micro_batches(W.rank_batch(k, 0), n_micro):
            tap.new_pass()
            W.loss_of(model(x), y, n_micro).backward()
        opt.step()
        if k % tcov:
            continue
        raws = []  # per pass: {"name.H": h, "name.S": s}, in float64 from the tapped tensors
        for tapped in tap.passes:
            raw = {}
            for name, e in tapped.items():
                h, s = raw_statistics(e["module"], e["x"].double(), e["g"].double())
                raw[f"{name}.H"], raw[f"{name}.S"] = h, s
            raws.append(raw)
        for key in raws[0]:
            if statistics == "per_step":
                fold(key, torch.stack([r[key] for r in raws]).mean(dim=0))
            else:
                for r in raws:
                    fold(key, r[key])
        got = _factors(opt, model)
        bad = {key: rel(got[key], v) for key, v in expected.items() if not rel(got[key], v) <= TOL}
        assert not bad, f"step {k}: factors differ from the documented fold: {bad}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("n_micro", [2, 4])
def test_accumulation_matches_one_batch(n_micro, opt_cls, backend):
    """With statistics="per_step", n_micro equal micro-batches of B/n_micro and the loss (a mean
    over the micro-batch) scaled by 1/n_micro, a model of Linear and Conv2d layers gets the factors
    and the parameters of one batch of B, within FP32 tolerance, at every step:
    - H: each micro-batch's h is a mean of x^2 over its rows; the mean of equal-size means is the
      mean over the batch;
    - S: the gradient of each output row is (1/n_micro)*(n_micro/B)*dl/dy = (1/B)*dl/dy, as in
      the batch of B, and s is a mean of g^2 over the rows: the same argument;
    - the accumulated gradient is the batch gradient, so the update is the same.
    Not covered, because it is not true: the BatchNorm2d/LayerNorm statistics (squares of sums
    over the batch, and 1/B^2 terms) depend on the micro-batch size; and without the 1/n_micro
    loss scaling S is n_micro^2 larger, which min-max normalisation undoes only up to its 1e-6
    epsilon, while the update itself (not scale-invariant) differs by n_micro."""
    tcov = 2
    runs = []
    for micro in (1, n_micro):
        model = conv_linear_model()
        opt = opt_cls(model, TCov=tcov, backend=backend, **W.HP)
        history = []
        for k in range(3 * tcov + 1):
            _train_one_process(model, opt, [k], micro)
            history.append((_factors(opt, model), [p.detach().clone() for p in model.parameters()]))
        runs.append(history)
    for k, ((f1, p1), (fk, pk)) in enumerate(zip(*runs)):
        for name in f1:
            assert rel(fk[name], f1[name]) <= TOL, (k, name, rel(fk[name], f1[name]))
        for i, (a, b) in enumerate(zip(pk, p1)):
            assert rel(a, b) <= TOL, (k, i, rel(a, b))
    initial = [p.detach() for p in conv_linear_model().parameters()]
    assert max(rel(a, b) for a, b in zip(runs[0][-1][1], initial)) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_one_pass_per_step_per_pass_equals_per_step(opt_cls, backend):
    """Without accumulation the two modes are the same optimizer (the published one)."""
    runs = []
    for statistics in ("per_step", "per_pass"):
        model = W.make_model(seed=0)
        opt = opt_cls(model, TCov=2, backend=backend, statistics=statistics, **W.HP)
        _train_one_process(model, opt, range(7), 1)
        runs.append(([p.detach() for p in model.parameters()], _factors(opt, model)))
    (pa, fa), (pb, fb) = runs
    for name in fa:
        assert rel(fb[name], fa[name]) <= 1e-6, name
    for a, b in zip(pb, pa):
        assert rel(a, b) <= 1e-6
