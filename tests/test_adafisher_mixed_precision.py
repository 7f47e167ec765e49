"""Mixed precision: bf16/fp16 activations and parameters, torch.amp.GradScaler, unsupported dtypes.

Contracts under test (cafin/optim/adafisher.py, cafin/ops/adafisher.py):
- statistics of bf16/fp16 inputs accumulate in fp32 (never overflow in the input dtype); a square
  that overflows fp32 is +inf, and the fold drops that statistic (counted, the factor kept);
- moments, factors and statistics are fp32 for bf16/fp16 parameters; the update is computed in
  fp32 and rounded once when stored;
- torch.amp.GradScaler: `scaler.step` hands `grad_scale` / `found_inf` tensors to the step; the
  update unscales, the gradient statistics (taken from scaled gradients by the hooks) are divided
  by grad_scale^2, and an overflowed step changes nothing (parameters, moments, step counts,
  factors); the `scaler.unscale_(opt)` flow needs `grad_scaler=scaler`;
- unsupported parameter dtypes are rejected at construction with the dtype named.

Tolerances (each test says which it uses and why):
- bf16 autocast, fused vs reference: 2**-8 (one bf16 unit roundoff), relative to how far the
  parameters moved, and relative to max|.| for factors and moments; per step in lockstep (same
  activations, gradients and state for both, on every device), and over all steps of two
  free-running runs on the CPU, whose model backward is deterministic. The two backends differ only
  at fp32 level (the fused statistics sum in double), but under autocast such a difference can flip
  the bf16 rounding of a weight or an activation in a later forward pass, which perturbs what
  depends on it by up to one bf16 unit roundoff. Observed: <= 1e-4 (parameters), <= 3e-4 (factors).
- Statistics of bf16/fp16 inputs vs the fp32 reference on the same rounded values: 1e-5 relative
  (fp32 summation error); squaring in bf16 instead would be ~1e-3 off (checked as a control).
- GradScaler runs vs unscaled runs: 1e-6 relative (observed 0: scales are powers of two, so
  scaling and unscaling are exact).
- "Rounded once": exact bf16/fp16 equality with our own fp32 computation, except for elements whose
  fp32 value lies within 8 fp32 unit roundoffs (of the operands) of a rounding boundary, where
  fused multiply-adds in the kernel may legitimately round the other way.
"""
from __future__ import annotations

import functools
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cafin import AdaFisher, AdaFisherW, ops, reference
from bench.models import gpt, resnet18
from devices import DEVICES

BACKENDS = ["reference", "fused"]
IMPLS = [pytest.param(reference, id="reference"), pytest.param(ops, id="fused")]
OPTIMIZERS = [pytest.param(AdaFisher, id="AdaFisher"), pytest.param(AdaFisherW, id="AdaFisherW")]
STATISTICS = ["per_step", "per_pass"]

TCOV = 3
STEPS = 3 * TCOV + 1  # curvature steps at k = 0, TCov, 2 TCov, 3 TCov
HP = dict(lr=1e-3, beta=0.9, Lambda=1e-3, weight_decay=0.05, gamma=0.8, TCov=TCOV)
BF16_TOL = 2.0 ** -8
SCALER_TOL = 1e-6
STAT_TOL = 1e-5
INIT_SCALE = 2.0 ** 16
OBSERVED: dict[str, str] = {}  # printed with -s


# ----------------------------------------------------------------------------------- helpers
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def _resnet():
    return resnet18(num_classes=5, width=4, blocks=(1, 1))


# A vocabulary the batches nearly cover. The decoder is tied to the token embedding, whose factors
# precondition it: the row of a token absent from a curvature batch gets F~ at its floor (about
# Lambda) while the decoder still gives it a gradient; with many such rows (vocab 50 here) a bf16
# trajectory amplifies one-ulp differences between the backends past the bf16 bound below.
VOCAB = 12


def _gpt():
    return gpt(vocab=VOCAB, dim=16, depth=1, heads=2, context=8)


def _resnet_batch(k):
    return torch.randn(4, 3, 8, 8, generator=gen(k)), torch.randint(0, 5, (4,), generator=gen(50 + k))


def _gpt_batch(k):
    idx = torch.randint(0, VOCAB, (3, 9), generator=gen(k))
    return idx[:, :-1], idx[:, 1:]


MODELS = {"resnet": (_resnet, _resnet_batch), "gpt": (_gpt, _gpt_batch)}


def _ce(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def _fresh(case, dtype=None, device="cpu"):
    """The model (initialised on the CPU, then moved) and its batches on `device`."""
    make, batch = MODELS[case]
    torch.manual_seed(0)
    model = make().to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model, lambda k: tuple(t.to(device) for t in batch(k))


def _batch_as(batch, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() and dtype is not None else t for t in batch)


SUPPORTED = (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm, nn.Embedding)


def _owners(model, optimised):
    """param -> (anchor, h_offset), written from the ownership rule (first supported module in
    model.modules() order that holds a parameter claims it; its first claimed parameter anchors
    the factors), independently of cafin's layer registry."""
    owners = {}
    for m in model.modules():
        if not isinstance(m, SUPPORTED):
            continue
        if isinstance(m, nn.Linear):
            offsets = {"weight": 0, "bias": m.in_features}
        elif isinstance(m, nn.Embedding):  # weight [vocab, dim]: F~ = H[v] S[d]
            offsets = {"weight": 0}
        elif isinstance(m, nn.Conv2d):
            offsets = {"weight": 0, "bias": m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]}
        else:
            offsets = {"weight": 0, "bias": 1}
        claimed = [(getattr(m, n), off) for n, off in offsets.items()
                   if isinstance(getattr(m, n, None), nn.Parameter)
                   and getattr(m, n) in optimised and getattr(m, n) not in owners]
        for p, off in claimed:
            owners[p] = (claimed[0][0], off)
    return owners


def _anchors(model, opt):
    optimised = {p for g in opt.param_groups for p in g["params"]}
    return sorted({a for a, _ in _owners(model, optimised).values()}, key=id)


def _factors(model, opt):
    """[(name, fisher_S, fisher_H), ...] in model order."""
    out = []
    anchors = set(_anchors(model, opt))
    for name, p in model.named_parameters():
        if p in anchors:
            out.append((name, opt.state[p]["fisher_S"], opt.state[p]["fisher_H"]))
    return out


def _snapshot(model, opt):
    """Parameters and the optimizer's per-parameter state, cloned."""
    return {name: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for name, p in model.named_parameters()}


def _assert_state_fp32(model, opt, label):
    for name, p in model.named_parameters():
        for key, value in opt.state[p].items():
            assert value.dtype == torch.float32, f"{label}: {key} of {name} is {value.dtype}"


# ------------------------------------------------------------------- 1. bf16 autocast training
@functools.lru_cache(maxsize=None)
def _autocast_run(case, opt_cls, backend, device="cpu"):
    """STEPS steps of an fp32 model under torch.autocast(device, bfloat16); records the dtypes
    the statistics see (inputs of the supported modules, output gradients of Linear/Conv2d; the
    norm layers run in fp32 under CPU autocast)."""
    model, batch = _fresh(case, device=device)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = opt_cls(model, backend=backend, **HP)
    seen = {"input": set(), "grad": set()}

    def record(module, inputs, output):
        seen["input"].add(inputs[0].dtype)
        if output.requires_grad and isinstance(module, (nn.Linear, nn.Conv2d)):  # run in bf16
            output.register_hook(lambda g: seen["grad"].add(g.dtype))

    for m in model.modules():
        if isinstance(m, SUPPORTED):
            m.register_forward_hook(record)
    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = _ce(model, *batch(k))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, initial, seen, losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("case", list(MODELS))
def test_bf16_autocast_training(case, opt_cls, backend, device):
    """fp32 parameters, bf16 activations and output gradients: statistics and factors stay fp32,
    every factor is updated, parameters stay finite and move."""
    model, opt, initial, seen, losses = _autocast_run(case, opt_cls, backend, device)
    assert torch.bfloat16 in seen["input"], "no statistic saw a bf16 input: autocast not exercised"
    assert seen["grad"] == {torch.bfloat16}, f"Linear/Conv2d output gradients were {seen['grad']}"
    assert all(math.isfinite(v) for v in losses)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.isfinite(p).all(), name
    _assert_state_fp32(model, opt, case)
    factors = _factors(model, opt)
    assert factors
    for name, S, H in factors:
        for f in (S, H):  # -1 marks a factor never updated
            assert torch.isfinite(f).all() and (f >= 0).all(), f"factor of {name}: {f}"
    motion = max((p - initial[n]).abs().max().item() for n, p in model.named_parameters())
    assert motion > 0.05, f"parameters barely moved ({motion:.3g})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("case", list(MODELS))
def test_bf16_autocast_fused_matches_reference(case, opt_cls, device):
    """Both backends in lockstep: at every one of STEPS steps, one forward and backward under
    autocast feeds both optimizers' hooks the same activations and output gradients (both hook
    the same model), both step from the same parameters, state and gradients, and that step's
    outputs agree within one bf16 unit roundoff (2**-8): parameters against how far that step
    moved them, factors and moments against their size. Then the fused optimizer takes the
    reference's parameters and state, so every step is compared from the same start.

    Lockstep, not two free-running runs: on CUDA the model's backward sums with atomics (the
    embeddings' gradients among them), so two runs differ by more than the backends, and under
    bf16 such a difference grows from step to step (the GPT's `pos` moments 5.4e-3 apart after
    STEPS free-running steps on an H200). The CPU's free-running comparison is the next test."""
    model, batch = _fresh(case, device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*already hooked by another live.*")
        opr = opt_cls(model, backend="reference", **HP)
        opf = opt_cls(model, backend="fused", **HP)
    params = dict(model.named_parameters())
    worst = {"param": 0.0, "exp_avg": 0.0, "factor": 0.0}
    factor_updates = 0
    for k in range(STEPS):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = _ce(model, *batch(k))
        loss.backward()
        start = {n: p.detach().clone() for n, p in params.items()}
        grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        factors_before = [f.clone() for _, S, H in _factors(model, opr) for f in (S, H)]
        opr.step()
        stepped = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(start[n])
                if n in grads:
                    p.grad.copy_(grads[n])
        opf.step()
        for name, p in params.items():
            moved = (stepped[name] - start[name]).abs().max().item()
            d = (p - stepped[name]).abs().max().item() / moved if moved > 0 else \
                (p - stepped[name]).abs().max().item()
            worst["param"] = max(worst["param"], d)
            assert d <= BF16_TOL, f"step {k}, {name}: |fused - reference| / motion = {d:.3g}"
            d = rel(opf.state[p]["exp_avg"], opr.state[p]["exp_avg"])
            worst["exp_avg"] = max(worst["exp_avg"], d)
            assert d <= BF16_TOL, f"step {k}, exp_avg of {name}: rel diff {d:.3g}"
        after = [f for _, S, H in _factors(model, opr) for f in (S, H)]
        factor_updates += sum(not torch.equal(a, b) for a, b in zip(after, factors_before))
        for (name, Sr, Hr), (_, Sf, Hf) in zip(_factors(model, opr), _factors(model, opf)):
            for fr, ff in ((Sr, Sf), (Hr, Hf)):
                assert ff.dtype == torch.float32
                d = rel(ff, fr)
                worst["factor"] = max(worst["factor"], d)
                assert d <= BF16_TOL, f"step {k}, factor of {name}: rel diff {d:.3g}"
        with torch.no_grad():  # the same start for the next step
            for n, p in params.items():
                p.copy_(stepped[n])
                for key, value in opr.state[p].items():
                    opf.state[p][key].copy_(value)
    assert factor_updates >= 4 * len(_factors(model, opr)), "the curvature steps updated no factors"
    label = f"bf16 autocast {case} {opt_cls.__name__} fused vs reference, lockstep ({device})"
    OBSERVED[label] = ", ".join(f"{k} {v:.2g}" for k, v in worst.items())
    print(f"\n{label}: {OBSERVED[label]}")


@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("case", list(MODELS))
def test_bf16_autocast_fused_matches_reference_free_running(case, opt_cls, device="cpu"):
    """Same model, same data, both backends, each run on its own for STEPS steps: agreement
    within one bf16 unit roundoff (2**-8), parameters measured against how far they moved,
    factors and moments against their size. On the CPU only: there the model's backward is
    deterministic, so the runs differ by the backends alone. On CUDA the model's backward sums
    with atomics (an embedding's gradient among them), and two free-running runs compare those
    sums too (the lockstep test above compares the backends there)."""
    mr, opr, initial, _, _ = _autocast_run(case, opt_cls, "reference", device)
    mf, opf, _, _, _ = _autocast_run(case, opt_cls, "fused", device)
    worst = {"param": 0.0, "exp_avg": 0.0, "factor": 0.0}
    fused_params = dict(mf.named_parameters())
    for name, pr in mr.named_parameters():
        pf = fused_params[name]
        moved = (pr - initial[name]).abs().max().item()
        d = (pf - pr).abs().max().item() / moved
        worst["param"] = max(worst["param"], d)
        assert d <= BF16_TOL, f"{name}: |fused - reference| / motion = {d:.3g}"
        d = rel(opf.state[pf]["exp_avg"], opr.state[pr]["exp_avg"])
        worst["exp_avg"] = max(worst["exp_avg"], d)
        assert d <= BF16_TOL, f"exp_avg of {name}: rel diff {d:.3g}"
    for (name, Sr, Hr), (_, Sf, Hf) in zip(_factors(mr, opr), _factors(mf, opf)):
        for fr, ff in ((Sr, Sf), (Hr, Hf)):
            assert ff.dtype == torch.float32
            d = rel(ff, fr)
            worst["factor"] = max(worst["factor"], d)
            assert d <= BF16_TOL, f"factor of {name}: rel diff {d:.3g}"
    label = f"bf16 autocast {case} {opt_cls.__name__} fused vs reference, free running ({device})"
    OBSERVED[label] = ", ".join(f"{k} {v:.2g}" for k, v in worst.items())
    print(f"\n{label}: {OBSERVED[label]}")


# ------------------------------------------------------ 2. bf16/fp16 parameters, rounded once
LOW_PARAM_CASES = [pytest.param("resnet", AdaFisher, id="resnet-AdaFisher"),
                   pytest.param("gpt", AdaFisherW, id="gpt-AdaFisherW")]


def _expected_update(p, grad, exp_avg, step, S, H, off, opt_cls, group):
    """The fp32 update of one parameter from the state before the step: (theta_new, m_new,
    |update|) in fp32, F~ = S[r] H[off + c] + Lambda (1 where a factor holds -1)."""
    lr, beta = float(group["lr"]), group["beta"]
    wd, lam = group["weight_decay"], group["Lambda"]
    theta, g = p.float(), grad.float()
    if S is None:
        f = torch.ones_like(theta)
    else:
        cols = p.numel() // S.numel()
        h = H[off:off + cols]
        f = S[:, None] * h[None, :] + lam
        f = torch.where((S[:, None] < 0) | (h[None, :] < 0), torch.ones_like(f), f).reshape(p.shape)
    t = float(step) + 1
    bias_correction = 1 - beta ** t
    if opt_cls is AdaFisherW:
        m = beta * exp_avg + (1 - beta) * g
        update = lr * (m / (torch.tensor(bias_correction, dtype=torch.float32) * f) + wd * theta)
    else:
        m = beta * exp_avg + (1 - beta) * (g + wd * theta)
        update = torch.tensor(lr / bias_correction, dtype=torch.float32) * m / f
    return theta - update, m, update


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case,opt_cls", LOW_PARAM_CASES)
def test_low_precision_params_fp32_state_rounded_once(case, opt_cls, dtype, backend, device):
    """model.to(bf16/fp16): exp_avg, factors and statistics fp32; every step, each stored
    parameter equals our fp32 computation of the update (from the state before the step, factors
    as folded in that step) rounded once to the parameter dtype."""
    model, batch = _fresh(case, dtype, device)
    opt = opt_cls(model, backend=backend, **HP)
    optimised = {p for g in opt.param_groups for p in g["params"]}
    owners = _owners(model, optimised)
    modules = dict(model.named_modules())
    group_of = {p: g for g in opt.param_groups for p in g["params"]}
    total = changed = ambiguous = mismatched = twice = 0
    for k in range(STEPS):
        opt.zero_grad()
        _ce(model, *_batch_as(batch(k), dtype)).backward()
        before = {p: (p.detach().clone(), p.grad.clone(), opt.state[p]["exp_avg"].clone(),
                      opt.state[p]["step"].clone()) for p in optimised}
        opt.step()
        for name, p in model.named_parameters():
            assert p.dtype == dtype, name
            theta0, grad, m0, step = before[p]
            S = H = None
            off = 0
            if p in owners:
                anchor, off = owners[p]
                S, H = opt.state[anchor]["fisher_S"], opt.state[anchor]["fisher_H"]
                if isinstance(modules[name.rsplit(".", 1)[0]], nn.Embedding):  # rows: H's side
                    S, H = H, S
            new32, m32, update = _expected_update(theta0, grad, m0, step, S, H, off, opt_cls,
                                                  group_of[p])
            # exp_avg is fp32 and unrounded (fused multiply-adds: a few fp32 ulps)
            m_got = opt.state[p]["exp_avg"]
            assert m_got.dtype == torch.float32
            assert (m_got - m32).abs().max() <= 1e-6 * m32.abs().max(), f"step {k}: exp_avg of {name}"
            expected = new32.to(dtype)
            window = 8 * 2.0 ** -24 * torch.maximum(theta0.float().abs(), update.abs())
            near_boundary = (new32 - window).to(dtype) != (new32 + window).to(dtype)
            wrong = p.detach() != expected
            assert not (wrong & ~near_boundary).any(), (
                f"step {k}: {name} is not the fp32 update rounded once to {dtype}: "
                f"{int((wrong & ~near_boundary).sum())} of {p.numel()} elements differ")
            total += p.numel()
            changed += int((p.detach() != theta0).sum())
            ambiguous += int(near_boundary.sum())
            mismatched += int(wrong.sum())
            # control: rounding the update first, then subtracting in `dtype` (rounded twice)
            twice += int(((theta0 - update.to(dtype)) != expected).sum())
    _assert_state_fp32(model, opt, case)
    for name, S, H in _factors(model, opt):
        assert (S >= 0).all() and (H >= 0).all(), f"factor of {name} never updated"
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert changed > total // 2, "parameters barely changed: the check would be vacuous"
    assert ambiguous < total // 100
    assert twice > total // 100, "rounding twice would pass this test too"
    OBSERVED[f"rounded once {case} {dtype} {backend} {device}"] = (
        f"{total} elements, {mismatched} off by one rounding (all within {ambiguous} near a boundary), "
        f"{twice} would differ if rounded twice")
    print(f"\n{case} {dtype} {backend} {device}: {OBSERVED[f'rounded once {case} {dtype} {backend} {device}']}")


# ----------------------------------------------------------------- 3. statistics op dtypes
def _sumsq(impl, stat, x):
    impl.sumsq_stats_(stat, x, 2, 3, True)  # Linear input over [B, T, C] with a bias


def _sumsq_conv_grad(impl, stat, x):
    impl.sumsq_stats_(stat, x, 1, 2, False)  # Conv2d gradient side over [B, C, H, W]


def _conv_input(impl, stat, x):
    impl.conv2d_input_stats_(stat, x, [3, 2], [1, 2], [1, 0, 2, 1], [1, 2], 1, True)


def _conv_input_groups(impl, stat, x):
    impl.conv2d_input_stats_(stat, x, [3, 3], [2, 1], [1, 1, 1, 1], [1, 1], 3, False)


def _norm_input(impl, stat, x):
    impl.norm_input_stats_(stat, x)


def _norm_grad(impl, stat, x):
    impl.norm_grad_stats_(stat, x, 1, 2)


# name -> (op, input shape, stat length)
STAT_OPS = {
    "sumsq": (_sumsq, (4, 5, 6), 6 + 1 + 1),
    "sumsq_conv_grad": (_sumsq_conv_grad, (3, 6, 5, 4), 6 + 1),
    "conv2d_input": (_conv_input, (2, 3, 7, 6), 3 * 3 * 2 + 1 + 1),
    "conv2d_input_groups": (_conv_input_groups, (2, 6, 5, 5), 2 * 9 + 1),
    "norm_input": (_norm_input, (4, 6, 3, 3), 3),
    "norm_grad": (_norm_grad, (4, 6, 3, 3), 6 + 1),
}


def _stat_of(op, impl, x, length):
    stat = torch.zeros(length, device=x.device)
    op(impl, stat, x)
    return stat


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(STAT_OPS))
def test_statistics_of_low_precision_inputs(name, dtype, impl, device):
    """A bf16/fp16 input gives the fp32 statistic of its (rounded) values: impl(x) equals the
    reference on x.float() within fp32 summation error (1e-5)."""
    op, shape, length = STAT_OPS[name]
    x = (torch.randn(shape, generator=gen(3)) * 3 + 0.5).to(device=device, dtype=dtype)
    want = _stat_of(op, reference, x.float(), length)
    got = _stat_of(op, impl, x, length)
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert rel(got, want) <= STAT_TOL, f"rel diff {rel(got, want):.3g}\n{got}\n{want}"
    if impl is ops:  # a stat in the input dtype is refused (statistics are fp32)
        with pytest.raises(TypeError, match="float32"):
            op(impl, torch.zeros(length, dtype=dtype, device=device), x)


def test_statistics_tolerance_detects_low_precision_squares():
    """Control for the 1e-5 above: squaring and summing in bf16 is far off."""
    x = (torch.randn(64, 32, generator=gen(4)) * 3).to(torch.bfloat16)
    fp32 = (x.float() ** 2).mean(0)
    in_bf16 = (x * x).sum(0).float() / 64
    assert rel(in_bf16, fp32) > 100 * STAT_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(STAT_OPS))
def test_fp16_squares_overflowing_fp16_are_finite(name, impl, device):
    """|x| in [300, 3000]: x*x overflows fp16 (max 65504) but the fp32 statistic is finite and
    equals the reference on x.float()."""
    op, shape, length = STAT_OPS[name]
    g = gen(5)
    magnitude = 300 + 2700 * torch.rand(shape, generator=g)
    sign = torch.where(torch.rand(shape, generator=g) < 0.3, -1.0, 1.0)
    x = (magnitude * sign).to(device=device, dtype=torch.float16)
    assert torch.isinf(x * x).all(), "precondition: every square overflows fp16"
    got = _stat_of(op, impl, x, length)
    want = _stat_of(op, reference, x.float(), length)
    assert torch.isfinite(want).all()
    assert torch.isfinite(got).all(), f"{got}"
    assert rel(got, want) <= STAT_TOL, f"rel diff {rel(got, want):.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["linear_input", "conv2d_input"])
def test_bf16_squares_overflowing_fp32_are_dropped(which, impl, device):
    """A bf16 activation of 1e20 squares to 1e40, beyond fp32 (max 3.4e38): accumulated in fp32,
    the statistic is +inf, and the fold drops it (counted; the factor keeps its value) as it
    drops NaN. The batch is large enough that the mean (1e40 / N) would be finite if the square
    were taken in double: the statistic must not depend on that."""
    if which == "linear_input":
        x = torch.randn(64, 5, generator=gen(6)).to(device=device, dtype=torch.bfloat16)
        x[7, 2] = 1e20
        stat = torch.zeros(5 + 1 + 1, device=device)
        impl.sumsq_stats_(stat, x, 1, 2, True)
        overflowed = torch.zeros(6, dtype=torch.bool, device=device)
        overflowed[2] = True
    else:
        x = torch.randn(2, 3, 6, 6, generator=gen(6)).to(device=device, dtype=torch.bfloat16)
        x[0, 1, 2, 2] = 1e20  # every tap of channel 1 of a 3x3 'same' kernel sees it
        stat = torch.zeros(3 * 9 + 1 + 1, device=device)
        impl.conv2d_input_stats_(stat, x, [3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1, True)
        overflowed = torch.zeros(28, dtype=torch.bool, device=device)
        overflowed[9:18] = True
    assert (1e20 ** 2) / x[:, 0].numel() / 100 < 3.4e38  # finite if squared in double
    z = stat[:-1]
    assert torch.isposinf(z[overflowed]).all(), f"overflowing squares must give +inf, got {z}"
    assert torch.isfinite(z[~overflowed]).all()
    factor = torch.full((z.numel(),), -1.0, device=device)
    skipped = torch.zeros((), device=device)
    impl.fisher_average_([factor], [stat], skipped, 0.8, [False])
    assert bool((factor == -1.0).all()) and float(skipped) == 1
    assert bool((stat == 0).all())  # emptied all the same


# -------------------------------------------------- 4. GradScaler: op contract (device tensors)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_op_takes_grad_scale_and_found_inf_tensors(dtype, impl, device):
    """adafisher_step_ with 0-dim fp32 grad_scale/found_inf tensors, like torch's fused Adam:
    found_inf != 0 writes nothing; otherwise the scaled gradients are unscaled in fp32 (a power
    of two: bitwise the same as the unscaled call)."""
    g = gen(7)
    on = dict(device=device)
    p0 = torch.randn(4, 6, generator=g).to(device=device, dtype=dtype)
    grad = (torch.randn(4, 6, generator=g) * 1e-3).to(device=device, dtype=dtype)
    m0 = (torch.randn(4, 6, generator=g) * 1e-3).to(device)
    S, H = torch.rand(4, generator=g).to(device), torch.rand(7, generator=g).to(device)
    lr = torch.tensor(1e-2, **on)
    scale = torch.tensor(2.0 ** 12, **on)

    def call(grads, grad_scale, found_inf):
        p, m = p0.clone(), m0.clone()
        impl.adafisher_step_([p], [grads], [m], [torch.tensor(3.0, **on)], [S], [H], [1], lr, 0.9, 0.01,
                             1e-3, False, grad_scale, found_inf)
        return p, m

    p, m = call(grad * 2 ** 12, scale, torch.tensor(1.0, **on))
    assert torch.equal(p, p0) and torch.equal(m, m0)
    p_plain, m_plain = call(grad, None, None)
    assert not torch.equal(p_plain, p0)
    p, m = call(grad * 2 ** 12, scale, torch.tensor(0.0, **on))
    assert torch.equal(p, p_plain) and torch.equal(m, m_plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_average_op_takes_grad_scale_and_found_inf_tensors(impl, device):
    """fisher_average_: grad_scale divides the gradient-side statistics by grad_scale^2 (not the
    activation side); found_inf != 0 leaves every factor and discards the statistics."""
    g = gen(8)
    on = dict(device=device)
    raw_h, raw_s = (torch.rand(6, generator=g) * 1e-3).to(device), (torch.rand(4, generator=g) * 1e-7).to(device)
    base = [torch.rand(6, generator=g).to(device), torch.rand(4, generator=g).to(device)]
    scale = torch.tensor(2.0 ** 16, **on)

    def call(stats, grad_scale, found_inf):
        factors = [f.clone() for f in base]
        stats = [s.clone() for s in stats]
        skipped = torch.zeros((), **on)
        impl.fisher_average_(factors, stats, skipped, 0.8, [False, True], grad_scale, found_inf)
        assert all((s == 0).all() for s in stats), "statistics are emptied"
        return factors

    plain = [torch.cat([raw_h, torch.ones(1, **on)]), torch.cat([raw_s, torch.ones(1, **on)])]
    scaled = [plain[0], torch.cat([raw_s * 2.0 ** 32, torch.ones(1, **on)])]
    want = call(plain, None, None)
    got = call(scaled, scale, torch.tensor(0.0, **on))
    for a, b in zip(got, want):
        assert rel(a, b) <= SCALER_TOL
    skipped_step = call(scaled, scale, torch.tensor(1.0, **on))
    assert all(torch.equal(a, b) for a, b in zip(skipped_step, base))
    # unscaled, the statistics (~1e-7 * 2**32) dwarf the 1e-6 min-max eps that dominates the true ones
    assert rel(call(scaled, None, None)[1], want[1]) > 0.1


# ------------------------------------------------------------ 5. GradScaler: optimizer flows
class _NoUnscale(AdaFisher):
    """Control: folds the gradient statistics without dividing by grad_scale^2."""

    def _fold_statistics(self, factors, stats, grad_side, grad_scale, found_inf):
        super()._fold_statistics(factors, stats, grad_side, None, found_inf)


def _scaler_run(backend, *, scaled, statistics="per_step", cls=AdaFisher, clip=None,
                give_scaler=False, steps=STEPS, device="cpu"):
    """The resnet (Conv2d, BatchNorm2d, Linear: tiny BatchNorm gradient statistics) for `steps`
    steps: unscaled, or the documented GradScaler flow (with `clip`: unscale_, clip, step)."""
    model, batch = _fresh("resnet", device=device)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE) if scaled else None
    opt = cls(model, backend=backend, statistics=statistics,
              grad_scaler=scaler if give_scaler else None, **HP)
    norms = []
    for k in range(steps):
        opt.zero_grad()
        loss = _ce(model, *batch(k))
        if not scaled:
            loss.backward()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            continue
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        scaler.step(opt)
        scaler.update()
    return model, opt, scaler, norms


@functools.lru_cache(maxsize=None)
def _unscaled(backend, statistics, clip=None, device="cpu"):
    return _scaler_run(backend, scaled=False, statistics=statistics, clip=clip, device=device)


def _compare_runs(a, b, label):
    (ma, oa), (mb, ob) = a, b
    pb = dict(mb.named_parameters())
    worst_p = max(rel(p, pb[n]) for n, p in ma.named_parameters())
    worst_f = 0.0
    for (name, Sa, Ha), (_, Sb, Hb) in zip(_factors(ma, oa), _factors(mb, ob)):
        worst_f = max(worst_f, rel(Sa, Sb), rel(Ha, Hb))
    OBSERVED[label] = f"params {worst_p:.2g}, factors {worst_f:.2g}"
    print(f"\n{label}: {OBSERVED[label]}")
    return worst_p, worst_f


def _per_pass_refused(statistics: str, err: Exception) -> bool:
    """statistics='per_pass' folds each pass into the factors during backward, before
    GradScaler.step hands over grad_scale/found_inf. With a GradScaler it must either give the
    per_step results or refuse clearly (a RuntimeError naming per_pass, GradScaler or grad_scaler);
    it must never be silently off. This says whether `err` is such a refusal."""
    return statistics == "per_pass" and bool(re.search(r"per_pass|GradScaler|grad_scaler", str(err)))


SCALER_FLOWS = [pytest.param("per_step", False, id="per_step"),
                pytest.param("per_step", True, id="per_step-grad_scaler")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_pass_refuses_a_grad_scaler(backend):
    """statistics='per_pass' folds scaled gradient statistics during backward, before the
    scaler's overflow check: it refuses grad_scaler= at construction and a scaler's step, which
    then writes no parameter and no step count."""
    model, batch = _fresh("resnet")
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    with pytest.raises(ValueError, match="per_pass"):
        AdaFisher(model, backend=backend, statistics="per_pass", grad_scaler=scaler, **HP)
    opt = AdaFisher(model, backend=backend, statistics="per_pass", **HP)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler.scale(_ce(model, *batch(0))).backward()
    with pytest.raises(RuntimeError, match="per_pass"):
        scaler.step(opt)
    for name, p in model.named_parameters():
        assert torch.equal(p, initial[name]), f"{name} written by a refused step"
        assert int(opt.state[p]["step"]) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("statistics,give_scaler", SCALER_FLOWS)
def test_grad_scaler_factors_equal_unscaled_run(statistics, give_scaler, backend, device):
    """scaler.scale(loss).backward(); scaler.step(opt); scaler.update() with init_scale 2**16:
    the hooks see gradients 2**16 too large, yet factors and parameters equal those of the
    unscaled run (1e-6; exact in practice on the CPU: the scale is a power of two; on CUDA the
    model's backward may order a sum differently from run to run, a few ulps)."""
    base = _unscaled(backend, statistics, device=device)
    try:
        model, opt, scaler, _ = _scaler_run(backend, scaled=True, statistics=statistics,
                                            give_scaler=give_scaler, device=device)
    except (RuntimeError, ValueError) as err:
        if _per_pass_refused(statistics, err):
            return
        raise
    assert scaler.get_scale() == INIT_SCALE  # no overflow: every step was taken
    assert all(int(opt.state[p]["step"]) == STEPS for p in model.parameters())
    label = f"GradScaler {statistics}{'+grad_scaler' if give_scaler else ''} {backend} {device}"
    worst_p, worst_f = _compare_runs((model, opt), base[:2], label)
    assert worst_f <= SCALER_TOL, f"factors differ from the unscaled run by {worst_f:.3g}"
    assert worst_p <= SCALER_TOL, f"parameters differ from the unscaled run by {worst_p:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_scaler_unscaling_the_statistics_matters(backend):
    """Control for the test above: folding the scaled gradient statistics without dividing by
    grad_scale^2 gives very different factors (the min-max eps 1e-6 is not negligible against
    the unscaled BatchNorm gradient statistics, and is against the scaled ones)."""
    base = _unscaled(backend, "per_step")
    model, opt, _, _ = _scaler_run(backend, scaled=True, cls=_NoUnscale)
    _, worst_f = _compare_runs((model, opt), base[:2], f"GradScaler without unscaling {backend}")
    assert worst_f > 100 * SCALER_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("statistics,give_scaler", SCALER_FLOWS)
@pytest.mark.parametrize("how", ["inf_grad", "inf_loss"])
def test_grad_scaler_overflow_skips_step(how, statistics, give_scaler, backend, device):
    """An overflow on a curvature step (k = TCov): scaler.step skips it, leaving parameters,
    exp_avg, step counts and factors bitwise unchanged and the statistics discarded (no NaN
    drop counted, no warning); scaler.update halves the scale; training goes on and the next
    curvature step updates the factors. inf_grad: one parameter gradient set to inf by a hook
    (statistics finite); inf_loss: the loss times inf (statistics inf/NaN)."""
    model, batch = _fresh("resnet", device=device)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    opt = AdaFisher(model, backend=backend, statistics=statistics,
                    grad_scaler=scaler if give_scaler else None, **HP)
    anchors = _anchors(model, opt)
    for k in range(2 * TCOV + 1):
        opt.zero_grad()
        if k == TCOV:
            before = _snapshot(model, opt)
        loss = _ce(model, *batch(k))
        handle = None
        if k == TCOV and how == "inf_grad":
            handle = model.fc.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        if k == TCOV and how == "inf_loss":
            loss = loss * float("inf")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.scale(loss).backward()
            if handle is not None:
                handle.remove()
            try:
                scaler.step(opt)
            except (RuntimeError, ValueError) as err:
                if _per_pass_refused(statistics, err):
                    return
                raise
        if k == TCOV:
            after = _snapshot(model, opt)
            for name, (p, state) in before.items():
                assert torch.equal(after[name][0], p), f"parameter {name} changed on a skipped step"
                for key in ("exp_avg", "step", "fisher_S", "fisher_H"):
                    if key in state:
                        assert torch.equal(after[name][1][key], state[key]), \
                            f"{key} of {name} changed on a skipped step"
            for a in anchors:
                for key in ("stat_S", "stat_H"):
                    assert (opt.state[a][key] == 0).all(), f"{key}: statistics of a skipped step kept"
            assert opt.skipped_factor_updates == 0
            assert not [w for w in caught if "NaN" in str(w.message)], [str(w.message) for w in caught]
            factors_at_skip = [f.clone() for _, S, H in _factors(model, opt) for f in (S, H)]
        scaler.update()
        if k == TCOV:
            assert scaler.get_scale() == INIT_SCALE / 2
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert int(opt.state[p]["step"]) == 2 * TCOV, f"{name}: the skipped step was counted"
    factors_now = [f for _, S, H in _factors(model, opt) for f in (S, H)]
    assert any(not torch.equal(a, b) for a, b in zip(factors_now, factors_at_skip)), \
        "the curvature step after the overflow did not update the factors"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("statistics", STATISTICS)
def test_grad_scaler_unscale_then_clip(statistics, backend, device):
    """scaler.unscale_(opt); clip_grad_norm_; scaler.step(opt) with grad_scaler=scaler: the same
    parameters and factors as the unscaled run with the same clipping (1e-6)."""
    clip = 0.5
    base = _unscaled(backend, statistics, clip, device)
    assert max(base[3]) > clip, "precondition: clipping is active"
    try:
        model, opt, scaler, norms = _scaler_run(backend, scaled=True, statistics=statistics,
                                                clip=clip, give_scaler=True, device=device)
    except (RuntimeError, ValueError) as err:
        if _per_pass_refused(statistics, err):
            return
        raise
    assert scaler.get_scale() == INIT_SCALE
    assert norms == pytest.approx(base[3], rel=1e-6)
    worst_p, worst_f = _compare_runs((model, opt), base[:2],
                                     f"unscale_+clip {statistics} {backend} {device}")
    assert worst_f <= SCALER_TOL and worst_p <= SCALER_TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("statistics", STATISTICS)
def test_grad_scaler_unscale_without_grad_scaler_raises(statistics, backend):
    """The unscale_ flow without grad_scaler=: the gradient statistics cannot be unscaled, so the
    step raises a RuntimeError naming grad_scaler, before updating anything (per_pass: a refusal
    naming per_pass/GradScaler is fine too, and its factors were folded during backward already,
    so only parameters and step counts are checked)."""
    model, batch = _fresh("resnet")
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    opt = AdaFisher(model, backend=backend, statistics=statistics, **HP)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    scaler.scale(_ce(model, *batch(0))).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    match = "grad_scaler" if statistics == "per_step" else "per_pass|GradScaler|grad_scaler"
    with pytest.raises(RuntimeError, match=match):
        scaler.step(opt)
    for name, p in model.named_parameters():
        assert torch.equal(p, initial[name]), f"{name} written by a refused step"
        assert int(opt.state[p]["step"]) == 0
    if statistics == "per_step":
        for _, S, H in _factors(model, opt):
            assert (S == -1).all() and (H == -1).all(), "factors written by a refused step"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_autocast_with_grad_scaler(backend, device):
    """The usual fp16 recipe: torch.autocast(float16) + GradScaler on the transformer block:
    finite parameters, fp32 state, every factor updated, no step lost."""
    model, batch = _fresh("gpt", device=device)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    opt = AdaFisher(model, backend=backend, **HP)
    for k in range(STEPS):
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = _ce(model, *batch(k))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == INIT_SCALE
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert int(opt.state[p]["step"]) == STEPS
    _assert_state_fp32(model, opt, "fp16 autocast")
    for name, S, H in _factors(model, opt):
        assert (S >= 0).all() and (H >= 0).all() and torch.isfinite(S).all(), name


# ------------------------------------------------------------------- 6. unsupported dtypes
def _net_with(dtype):
    """A Linear -> Linear model whose second weight has `dtype`, and the param groups to pass
    (an integer tensor cannot require grad: it goes in a param group of its own)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    if dtype.is_floating_point or dtype.is_complex:
        model[1].weight = nn.Parameter(model[1].weight.detach().to(dtype))
        return model, None
    model[1].register_parameter("counter", nn.Parameter(torch.zeros(4, dtype=dtype),
                                                        requires_grad=False))
    return model, [{"params": list(model[0].parameters())}, {"params": [model[1].counter]}]


BAD_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.int32, torch.uint8,
              torch.complex64, torch.complex128]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_unsupported_param_dtype_rejected_at_construction(dtype, backend):
    model, groups = _net_with(dtype)
    with pytest.raises((TypeError, ValueError), match=re.escape(str(dtype))):
        AdaFisher(model, backend=backend, params=groups, **HP)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int64], ids=str)
def test_add_param_group_with_unsupported_dtype_leaves_optimizer_unchanged(dtype, backend):
    """Rejected after construction (add_param_group): the error names the dtype and, as in
    torch.optim, nothing was added; the optimizer still steps."""
    model, _ = _net_with(dtype)
    bad = model[1].weight if dtype.is_floating_point else model[1].counter
    opt = AdaFisher(model, backend=backend, params=list(model[0].parameters()), **HP)
    with pytest.raises((TypeError, ValueError), match=re.escape(str(dtype))):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1
    assert all(bad is not p for g in opt.param_groups for p in g["params"])
    model[0](torch.randn(5, 3)).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int64, torch.complex64], ids=str)
def test_ops_reject_unsupported_dtypes(dtype):
    """The fused ops name the dtype in a TypeError (parameters, statistic inputs, factors)."""
    p = torch.zeros(2, 3).to(dtype)
    m, S, H = torch.zeros(2, 3), torch.ones(2), torch.ones(3)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):
        ops.adafisher_step_([p], [p.clone()], [m], [torch.tensor(1.0)], [S], [H], [0],
                            torch.tensor(1e-3), 0.9, 0.0, 1e-3, False)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):
        ops.sumsq_stats_(torch.zeros(3 + 1), p, 1, 2, False)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):
        ops.norm_input_stats_(torch.zeros(3), p)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):  # factors: fp32/fp64 only
        ops.fisher_average_([torch.zeros(3).to(dtype)], [torch.zeros(4).to(dtype)],
                            torch.zeros(()), 0.8, [False])
