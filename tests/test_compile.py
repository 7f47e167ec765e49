"""torch.compile of the optimizer step and of a model carrying cafin's hooks (inductor, on the CPU
and, where there is a GPU, on CUDA with the fused backend).

The step must trace as one graph (fullgraph=True), compile exactly once while a scheduler changes
lr every step, across curvature and non-curvature steps, and give the eager numbers.
"""
import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import cafin
from devices import CUDA_MARKS

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OPTIMIZERS = [cafin.AdaFisher, cafin.AdaFisherW]
BACKENDS = ["fused", "reference"]
# (device, backend): on CUDA the fused backend, whose kernels a compiled step calls; each CUDA case
# is a cold inductor compile of its own (tens of seconds), so the plain-PyTorch reference, which
# inductor compiles like any torch code, is checked for compilation on the CPU only.
PLACES = [pytest.param("cpu", "fused", id="cpu-fused"), pytest.param("cpu", "reference", id="cpu-reference"),
          pytest.param("cuda", "fused", id="cuda-fused", marks=CUDA_MARKS)]
# On CUDA, cuDNN's backward and the model's atomics sum in an order that changes from run to run,
# so two eager runs already differ by a few ulps per step; a wrong compiled step (a missed
# curvature step, a stale lr) differs by orders of magnitude more.
TOLERANCE = {"cpu": dict(rtol=1e-5, atol=1e-7), "cuda": dict(rtol=1e-4, atol=1e-6)}


def small_model(device="cpu"):
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                         nn.Flatten(), nn.Linear(4 * 5 * 5, 7), nn.LayerNorm(7), nn.Linear(7, 3)).to(device)


def batches(n, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 3, 5, 5, generator=g).to(device), torch.randint(0, 3, (6,), generator=g).to(device))
            for _ in range(n)]


def make_optimizer(cls, model, backend, TCov):
    norms = [p for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm))
             for p in m.parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in norms)]
    groups = [{"params": rest}, {"params": norms, "weight_decay": 0.0, "lr": 5e-3}]
    return cls(model, lr=1e-2, TCov=TCov, weight_decay=1e-2, params=groups, backend=backend)


def train(cls, backend, data, compiled, TCov=5, device="cpu"):
    torch.manual_seed(0)
    model = small_model(device)
    opt = make_optimizer(cls, model, backend, TCov)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            step()
        sched.step()
    return model, opt


@pytest.mark.parametrize("device,backend", PLACES)
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_step_compiles_once_and_equals_eager(cls, device, backend):
    data = batches(103, device=device)  # k = 0, 5, ..., 100 are curvature steps; lr changes every step
    eager_model, eager_opt = train(cls, backend, data, compiled=False, device=device)
    model, opt = train(cls, backend, data, compiled=True, device=device)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1.0e-2 / (1 + 0.05 * 103), rel=1e-6)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, **TOLERANCE[device])
    for p, q in zip(model.parameters(), eager_model.parameters()):
        for key, value in eager_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, **TOLERANCE[device])
    # The factors really were updated on the compiled curvature steps (not left at -1).
    assert all((opt.state[r.anchor]["fisher_S"] > 0).all() for r in opt._curvature)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_MARKS)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_step_has_no_graph_break(backend, device):
    model = small_model(device)
    opt = cafin.AdaFisher(model, backend=backend, TCov=2)
    x, y = batches(1, device=device)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        explanation = torch._dynamo.explain(opt.step)()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("device,backend", PLACES)
def test_compiled_model_with_hooks_matches_eager(device, backend):
    """torch.compile(model) traces cafin's forward hooks and output-gradient tensor hooks
    without a graph break; the statistics equal eager ones (on CUDA: generated kernels for the
    batch norm and ReLU round differently from cuDNN's, a few ulps). The model has several hooked
    layers and a ReLU(inplace=True) right after a hooked one.

    On torch 2.11, whose Dynamo rewrites a tensor hook into an autograd.Function returning a view
    (which the in-place ReLU may not write), the hooks take the gradient through their own
    autograd.Function (cafin.core.hooks._GradTap) instead; this test's cpu cases, run under
    torch 2.11 with cafin built against it, cover that path, and the next test forces it on any
    torch."""
    _compiled_model_matches_eager(device, backend)


def test_compiled_model_with_grad_tap_matches_eager(monkeypatch):
    """The same with the gradient taken through `_GradTap`, the path a compiled forward takes on
    a torch whose Dynamo rewrites tensor hooks (2.11), forced here on whatever torch runs."""
    monkeypatch.setattr(cafin.core.hooks, "_DYNAMO_REWRITES_TENSOR_HOOKS", True)
    _compiled_model_matches_eager("cpu", "fused")


@pytest.mark.parametrize("build", [
    lambda model: cafin.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1),
    lambda model: cafin.SINGD(model, T=1)], ids=["KFACPreconditioner", "SINGD"])
def test_compiled_model_with_kfac_or_singd_hooks_has_no_graph_break(build):
    """K-FAC's and SINGD's statistics run in the output-gradient hook (each input with its own
    gradient), which Dynamo traces into the forward only when it writes no Python state: no
    graph break (AdaFisher's: the tests above)."""
    torch._dynamo.reset()
    counters.clear()
    model = small_model()
    build(model)
    x, y = batches(1)[0]
    nn.functional.cross_entropy(torch.compile(model, backend="eager")(x), y).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def _compiled_model_matches_eager(device, backend):
    torch.manual_seed(0)
    base = small_model(device)
    x, y = batches(1, device=device)[0]
    stats = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        opt = cafin.AdaFisher(model, TCov=1, backend=backend)
        net = torch.compile(model) if compiled else model
        nn.functional.cross_entropy(net(x), y).backward()
        stats.append([opt.state[r.anchor][k].clone() for r in opt._curvature
                      for k in ("stat_H", "stat_S")])
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    for eager, compiled in zip(*stats):
        assert eager[-1] == 1 and compiled[-1] == 1  # one contribution each
        torch.testing.assert_close(compiled, eager, rtol=1e-5 if device == "cpu" else 1e-4, atol=1e-9)

    model = copy.deepcopy(base)
    cafin.AdaFisher(model, TCov=1, backend=backend)
    assert torch._dynamo.explain(model)(x).graph_break_count == 0

@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_compiled_step_mutates_only_static_aligned_inputs(cls, monkeypatch):
    """What inductor's CUDA graph trees (mode="reduce-overhead") ask of the compiled step, read from
    the graph inductor compiles on the CPU: every input the step mutates (parameters, moments,
    factors, statistics, step counts, the step counter) is a static input at a 16-byte aligned
    address. A mutated input that is not static, or whose address is not aligned (the trees then
    drop it from the static inputs), makes inductor run the step without CUDA graphs
    ("skipping cudagraphs due to mutated inputs"): step counts packed 4 bytes apart did that."""
    from torch._inductor import output_code
    from torch._inductor.utils import ALIGNMENT

    calls = []
    call = output_code.CompiledFxGraph.__call__

    def recording_call(self, inputs):
        static = set(self.fx_kwargs["static_input_idxs"] or ())
        calls.append([(i, i in static, inputs[i].data_ptr() % ALIGNMENT == 0)
                      for i in sorted(self.mutated_input_idxs)])
        return call(self, inputs)

    monkeypatch.setattr(output_code.CompiledFxGraph, "__call__", recording_call)
    torch.manual_seed(0)
    model = small_model()
    opt = make_optimizer(cls, model, "fused", TCov=2)
    assert all(opt.state[p]["step"].data_ptr() % ALIGNMENT == 0 for p in model.parameters())
    step = torch.compile(opt.step, fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False):
        for i, (x, y) in enumerate(batches(3)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                opt.step() if i == 0 else step()
    assert calls and all(calls), "no compiled step ran, or it mutated nothing"
    n_params = len(list(model.parameters()))
    for mutated in calls:
        assert len(mutated) >= 2 * n_params  # at least the parameters and their moments
        bad = [(i, "not static" if not static else "unaligned") for i, static, aligned in mutated
               if not (static and aligned)]
        assert not bad, f"mutated inputs inductor's CUDA graphs would refuse: {bad}"
