"""cafin.DyKAF's step as a CUDA graph needs it, checked on the CPU: every state tensor a step writes
keeps its storage from the first step on (refresh steps included); once the step is device
decided (compiled or captured), no decision reads a host count; a captured step (the CPU
stand-in of tests/capture.py) replays like the eager steps through several refresh intervals;
a first gradient that cannot start a parameter is dropped, counted and retried with backoff;
and the batched (GPU) form of the fused step equals the CPU form on ResNet-18's and GPT-2's
layer shapes (scaled down), in float64."""
import copy
import math
import warnings

import pytest
import torch
from torch import nn

import cafin
from cafin.maths import dykaf as dykaf_maths
from capture import Graph
from test_dykaf import float64_default  # noqa: F401  (the fixture)

FREQUENCY = 3


def cnn():
    """A conv kernel (kron4d), matrices of one shape twice (stacked on the batched path), a
    matrix over max_precond_dim on one side when asked, and 1-D parameters."""
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, (3, 2)), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 7, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(),
                         nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 5))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 8, 8, generator=g).to(torch.get_default_dtype()),
             torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


# (name, DyKAF settings, batched): the kinds of state and the paths that write it
SETTINGS = [
    ("fused-cpu", dict(), False),
    ("fused-batched", dict(), True),
    ("reference", dict(backend="reference"), False),
    ("full-second-moment-1d", dict(adam_rank_one=False, precondition_1d=True), True),
    ("one-sided", dict(max_precond_dim=8), False),
    ("merge-dims", dict(merge_dims=True, max_precond_dim=20), False),
    ("kron-start", dict(init="kron", eps=1e-8), True),
]
IDS = [s[0] for s in SETTINGS]


def make(settings, batched, monkeypatch, model=None):
    monkeypatch.setattr(cafin.DyKAF, "_batch_on_cpu", batched)
    torch.manual_seed(0)
    model = cnn() if model is None else model
    kw = {**dict(lr=1e-2, eps=1e-4, init="eps", precondition_frequency=FREQUENCY), **settings}
    return model, cafin.DyKAF(model.parameters(), **kw)


def step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def state_tensors(opt):
    """(parameter index, key, position) -> tensor, for every tensor in the state."""
    out = {}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for key, value in opt.state[p].items():
            if torch.is_tensor(value):
                out[i, key, None] = value
            elif isinstance(value, list):
                out.update({(i, key, k): t for k, t in enumerate(value) if t is not None})
    return out


@pytest.mark.parametrize("name,settings,batched", SETTINGS, ids=IDS)
def test_state_is_written_in_place(name, settings, batched, float64_default, monkeypatch):
    """From the first step (which builds the state) on, every step (plain ones and the refresh
    steps, every FREQUENCY-th) writes the state into the same tensors: same objects, same
    storage, same strides; and it does write them (the factors and moments change)."""
    model, opt = make(settings, batched, monkeypatch)
    data = batches(2 * FREQUENCY + 2)
    step(model, opt, *data[0])
    before = state_tensors(opt)
    layout = {k: (t.data_ptr(), t.shape, t.stride()) for k, t in before.items()}
    values = {k: t.clone() for k, t in before.items()}
    changed = set()
    for t, (x, y) in enumerate(data[1:], start=1):
        step(model, opt, x, y)
        now = state_tensors(opt)
        assert now.keys() == before.keys(), f"step {t}"
        for k, tensor in now.items():
            assert tensor is before[k], f"step {t}: {k} is a new tensor"
            assert (tensor.data_ptr(), tensor.shape, tensor.stride()) == layout[k], \
                f"step {t}: {k} moved"
            if not torch.equal(tensor, values[k]):
                changed.add(k[1])
            values[k] = tensor.clone()
    written = {"exp_avg", "device_step", "factors", "bases"}
    written |= {"l", "r"} if any(k[1] == "l" for k in before) else set()
    written |= {"exp_avg_sq"} if any(k[1] == "exp_avg_sq" for k in before) else set()
    assert written <= changed, written - changed


class HostCount:
    """A host step count that must not be read: any use raises."""

    def _refuse(self, *args):
        raise AssertionError("a device-decided DyKAF step read a host step count")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __mod__ = __add__ = __radd__ = _refuse
    __sub__ = __rsub__ = __int__ = __index__ = __bool__ = __float__ = __iadd__ = _refuse
    __hash__ = None


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name,settings,batched", SETTINGS, ids=IDS)
def test_device_decided_steps_read_no_host_count(name, settings, batched, float64_default,
                                                 monkeypatch):
    """After the counter is device gated (as a compile or a capture leaves it), the host step
    counts are replaced by values whose every use raises, and the steps (through two refresh
    intervals) still equal eager steps: the refreshes, bias corrections and moment paths are
    decided from the device counts. The gated steps run the batched split where eager CPU steps
    use host scalars: equal to rounding."""
    data = batches(3 * FREQUENCY + 1)
    runs = []
    for gated in (False, True):
        model, opt = make(settings, batched, monkeypatch)
        step(model, opt, *data[0])
        if gated:
            opt._steps.device_gated = True
            for p in opt.param_groups[0]["params"]:
                if "step" in opt.state[p]:
                    opt.state[p]["step"] = HostCount()
        for x, y in data[1:]:
            step(model, opt, x, y)
        runs.append((model, opt))
    (eager, eager_opt), (gated, gated_opt) = runs
    worst = max(rel(p, q) for p, q in zip(gated.parameters(), eager.parameters()))
    assert worst <= 1e-10, worst
    for p, q in zip(gated.parameters(), eager.parameters()):
        a, b = gated_opt.state[p], eager_opt.state[q]
        assert float(a["device_step"]) == float(b["device_step"]) == 3 * FREQUENCY
        for Qa, Qb in zip(a.get("bases", []), b.get("bases", [])):
            if Qa is not None:
                torch.testing.assert_close(Qa, Qb, rtol=0, atol=1e-8)  # refreshed alike
    # the checkpoints agree, the rotated-moment cache's step included (filled in from the
    # device count)
    saved, want = gated_opt.state_dict()["state"], eager_opt.state_dict()["state"]
    for i in want:
        for key in ("step", "exp_avg_rot_step"):
            assert saved[i].get(key) == want[i].get(key), (i, key)
        if "exp_avg_rot" in want[i]:
            torch.testing.assert_close(saved[i]["exp_avg_rot"], want[i]["exp_avg_rot"],
                                       rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("settings", [dict(), dict(adam_rank_one=False), dict(init="kron", eps=1e-8)],
                         ids=["rank-one", "full-second-moment", "kron-start"])
def test_device_decided_float32_steps_equal_eager_bit_for_bit(settings, monkeypatch):
    """In float32 a basis refresh amplifies rounding differences to 1e-2 (near-equal eigenvalues
    reorder; Adam's first steps normalise tiny rotated entries), so a device-decided step must
    run the eager step's arithmetic, not a form equal to rounding: the moments take the kept
    rotated moment where the eager step does. On the batched (CUDA) path, with the averages in
    their device form (CUDA's eager form too; on the CPU an eager step adds with a host alpha),
    device-decided steps equal eager ones bit for bit through three refresh intervals."""
    from cafin.optim.dykaf import update as dykaf_module
    average = dykaf_module._average_
    monkeypatch.setattr(dykaf_module, "_average_",
                        lambda xs, ys, keep, take, alpha=None: average(xs, ys, keep, take))
    data = batches(3 * FREQUENCY + 1)
    runs = []
    for gated in (False, True):
        model, opt = make({"eps": 1e-8, "init": "kron", **settings}, True, monkeypatch)
        step(model, opt, *data[0])
        opt._steps.device_gated = gated
        history = []
        for x, y in data[1:]:
            step(model, opt, x, y)
            history.append([p.detach().clone() for p in model.parameters()])
        runs.append(history)
    for k, (eager, gated) in enumerate(zip(*runs), start=1):
        for i, (a, b) in enumerate(zip(gated, eager)):
            assert torch.equal(a, b), f"step {k}, parameter {i}: {rel(a, b):.1e}"


@pytest.mark.parametrize("name,settings,batched", SETTINGS, ids=IDS)
def test_captured_step_replays_like_eager(name, settings, batched, float64_default, monkeypatch):
    """A whole training step (forward, backward, step) captured with the CPU stand-in of a CUDA
    graph after two eager steps, then replayed through three refresh intervals on new batches
    copied into the captured inputs: the parameters and the state equal eager steps'."""
    data = batches(3 * FREQUENCY + 3)
    model, opt = make(settings, batched, monkeypatch)
    twin, twin_opt = copy.deepcopy(model), None
    _, twin_opt = make(settings, batched, monkeypatch, model=twin)
    for x, y in data:
        step(twin, twin_opt, x, y)
    warmup = 2
    for x, y in data[:warmup]:
        step(model, opt, x, y)
    static_x, static_y = data[warmup][0].clone(), data[warmup][1].clone()
    graph = Graph()
    opt.zero_grad(set_to_none=True)
    with graph.capture():
        nn.functional.cross_entropy(model(static_x), static_y).backward()
        opt.step()
    for x, y in data[warmup:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    worst = max(rel(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert worst <= 1e-10, worst
    for p, q in zip(model.parameters(), twin.parameters()):
        assert float(opt.state[p]["device_step"]) == float(twin_opt.state[q]["device_step"])
    assert opt.state_dict()["state"][0]["step"] == len(data) - 1


def test_capture_before_the_state_is_built_is_refused(monkeypatch):
    """A parameter's first step (eigendecompositions, host checks of the gradient) cannot be
    captured: after an eager step in which the first conv kernel had no gradient, a capture
    that would build its state raises, naming why, and leaves it without state."""
    model, opt = make({}, False, monkeypatch)
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    model[0].weight.grad = None
    opt.step()
    assert not opt.state[model[0].weight] and opt.state[model[2].weight]
    graph = Graph()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="no state yet"):
        with graph.capture():
            nn.functional.cross_entropy(model(x2), y2).backward()
            opt.step()
    assert not opt.state[model[0].weight]


# ------------------------------------------------------------------------ a first gradient dropped
def test_non_finite_first_gradient_is_dropped_counted_and_retried_with_backoff(monkeypatch):
    """A parameter whose first gradients hold NaN (a model gone non-finite): each try is dropped
    with a RuntimeWarning and counted, and the tries back off (steps 0, 1, 3, 7, 15, 31: after
    the k-th drop 2^(k-1) - 1 steps are skipped), so the 100-iteration start is not paid on every
    step; the gradient of the next try after the model is finite again starts the state."""
    w = nn.Parameter(torch.randn(5, 4))
    b = nn.Parameter(torch.randn(5))
    opt = cafin.DyKAF([w, b], lr=1e-2)  # init="kron": the power iteration
    starts = []
    kron_start = dykaf_maths.kron_start
    monkeypatch.setattr(dykaf_maths, "kron_start", lambda *a: starts.append(1) or kron_start(*a))
    tries = []
    for t in range(40):
        w.grad = torch.full((5, 4), math.nan) if t < 20 else torch.randn(5, 4)
        b.grad = torch.randn(5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        dropped = [c for c in caught if issubclass(c.category, RuntimeWarning)]
        if dropped:
            tries.append(t)
            assert "inf/NaN" in str(dropped[0].message) and "(5, 4)" in str(dropped[0].message)
        if t < 31:
            assert opt.state[w] == {}, t
    assert tries == [0, 1, 3, 7, 15], tries  # the drops; the try at 31 succeeds
    assert opt.skipped_factor_updates == 5
    assert starts == [1]  # a NaN gradient never reaches the power iteration
    assert opt.state[w]["step"] == 40 - 31 - 1 and opt.state[b]["step"] == 39
    assert torch.isfinite(w).all()


# ------------------------------------------------------------ the batched form on real layer shapes
def resnet18_shapes(width=8):
    """ResNet-18's parameters, channels divided by 64 / width: the 7x7 stem, four stages of two
    basic blocks (3x3 kernels, 1x1 downsampling kernels from the second stage), batch norms
    (1-D), the classifier."""
    shapes = [(width, 3, 7, 7), (width,), (width,)]
    c_in = width
    for stage, c in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for block in range(2):
            first = c_in if block == 0 else c
            shapes += [(c, first, 3, 3), (c,), (c,), (c, c, 3, 3), (c,), (c,)]
            if block == 0 and stage > 0:
                shapes += [(c, c_in, 1, 1), (c,), (c,)]
        c_in = c
    return shapes + [(10, 8 * width), (10,)]


def gpt2_shapes(d=24, vocab=160, positions=16, layers=2):
    """GPT-2's parameters (HuggingFace layout, Conv1D weights stored [in, out]): the token
    embedding, tied to the output layer (one parameter; with vocab > max_precond_dim its long
    side is unrotated, as GPT-2's 50257 tokens are under the default 10000), positions, per
    layer two layer norms, c_attn, c_proj, c_fc, c_proj and their biases, the final norm."""
    shapes = [(vocab, d), (positions, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d),
                   (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


@pytest.mark.parametrize("model", ["resnet18", "gpt2"])
@pytest.mark.parametrize("settings", [dict(), dict(init="eps", adam_rank_one=False)],
                         ids=["kron-rank-one", "eps-full-moment"])
def test_batched_path_equals_cpu_path_on_real_shapes(model, settings, float64_default, monkeypatch):
    """The fused step's GPU form (matrices of one shape stacked: batched GEMMs and the split's
    two ops) against its CPU form (each matrix by proj_split_matrix_, host scalars, the
    rotated-moment cache), both run on the CPU in float64 with the same gradients, through two
    refresh intervals: equal to rounding. The GPT-2 tied embedding ([vocab, d], vocab over
    max_precond_dim) takes the one-sided path, the conv kernels the 4-mode split, the 1-D
    parameters Adam (or SOAP's EMA with precondition_1d on the full-moment run)."""
    shapes = resnet18_shapes() if model == "resnet18" else gpt2_shapes()
    kw = dict(lr=1e-2, eps=1e-4, precondition_frequency=FREQUENCY, max_precond_dim=100,
              precondition_1d="adam_rank_one" in settings, **settings)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    grads = [[torch.randn(s, generator=gen) / math.sqrt(s[0]) for s in shapes]
             for _ in range(2 * FREQUENCY + 2)]
    runs = []
    for batched in (False, True):
        monkeypatch.setattr(cafin.DyKAF, "_batch_on_cpu", batched)
        params = [nn.Parameter(x.clone()) for x in start]
        opt = cafin.DyKAF(params, **kw)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        runs.append((params, opt))
    (cpu, cpu_opt), (batched, batched_opt) = runs
    kinds = {cpu_opt.state[p]["kind"] for p in cpu}
    assert kinds == ({"kron4d", "kron2d", "ema"} if model == "resnet18" else {"kron2d", "ema"})
    if model == "gpt2":
        embedding = cpu_opt.state[cpu[0]]
        assert embedding["kind"] == "kron2d" and embedding["factors"][0] is None
    worst = max(rel(p, q) for p, q in zip(batched, cpu))
    assert worst <= 1e-10, worst
    assert all(torch.isfinite(p).all() for p in batched)


# ------------------------------------------------------------- the bench's whole-step phase (CUDA)
def test_whole_step_trainers_keep_what_a_captured_iteration_writes(monkeypatch):
    """What poisoned DyKAF's model in the bench's whole-step phase on CUDA: a captured iteration's
    replay (`CUDAGraph.replay`) holds no reference to the model and optimizer it writes, so once
    the next trainer was built they were freed and their memory went to the next trainers'
    models (K-FAC's, SINGD's, DyKAF's), which every replay then overwrote. Here on the CPU, the
    capture stood in by a replay that holds nothing, as a graph's: every trainer keeps its model
    and optimizer alive."""
    import gc
    import types
    import weakref

    from bench import whole_step
    from bench.members import registry
    from bench.models import MODELS, batch_for

    built = []

    def captured(name, model, opt, x, y, device):
        built.append((weakref.ref(model), weakref.ref(opt)))
        return types.SimpleNamespace().__init__, 0  # a bound method that holds nothing of them

    monkeypatch.setattr(whole_step, "_captured_iteration", captured)
    torch.manual_seed(0)
    base = MODELS["mlp"]()
    x, y = batch_for("mlp", base, 8, generator=torch.Generator().manual_seed(0))
    members = [m for name, m in registry().items() if name in ("adafisher", "dykaf")]
    run = types.SimpleNamespace(device=torch.device("cpu"), model="mlp", skipped=[])
    ctx = types.SimpleNamespace(run=run, base=base, x=x, y=y, members=members, published={},
                                selected=lambda m: {"fused", "cuda-graph"}, why_not=lambda m, v: None)
    trainers = whole_step.trainers(ctx)
    gc.collect()
    assert [t.variant for t in trainers if t.optimizer != "adamw"] == ["fused", "cuda-graph"] * 2
    assert len(built) == 2 and not run.skipped
    for model, opt in built:
        assert model() is not None and opt() is not None
    del trainers
    gc.collect()
    assert all(model() is None for model, _ in built)  # kept by the trainers, not leaked
