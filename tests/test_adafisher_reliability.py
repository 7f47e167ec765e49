"""The core's guarantees, used the way a hostile but realistic user would: a rejected step or checkpoint changes nothing, a deleted optimizer is
freed, models and optimizers can be copied and saved, hyperparameter schedules under torch.compile
neither crash nor recompile, and the curvature-step decision is right under every compile backend.
"""
from __future__ import annotations

import copy
import gc
import io
import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import cafin
from cafin import AdaFisher, AdaFisherW

BACKENDS = ["fused", "reference"]


def tiny_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def tiny_cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                         nn.Flatten(), nn.Linear(4 * 5 * 5, 3))


def data(n, seed=1, image=False):
    g = torch.Generator().manual_seed(seed)
    shape = (6, 3, 5, 5) if image else (6, 5)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def backward(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def snapshot(model, opt):
    """Everything a step may write, cloned: parameters, optimizer state, groups, k."""
    return ([p.detach().clone() for p in model.parameters()],
            {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())
             if p in opt.state},
            [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
             for g in opt.param_groups],
            opt._steps.value())


def assert_same(a, b):
    params_a, state_a, groups_a, k_a = a
    params_b, state_b, groups_b, k_b = b
    assert k_a == k_b
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
    assert state_a.keys() == state_b.keys()
    for i in state_a:
        assert state_a[i].keys() == state_b[i].keys()
        for key in state_a[i]:
            assert torch.equal(state_a[i][key], state_b[i][key]), (i, key)
    for g, h in zip(groups_a, groups_b):
        assert g.keys() == h.keys()
        for key in g:
            assert (torch.equal(g[key], h[key]) if isinstance(g[key], torch.Tensor) else g[key] == h[key])


# ----------------------------------------------------------------------------- 1. rejected step
def _break_lambda(model, opt):
    opt.param_groups[-1]["Lambda"] = 0.0
    return lambda: opt.param_groups[-1].__setitem__("Lambda", 1e-3)


def _break_beta(model, opt):
    opt.param_groups[-1]["beta"] = 1.0
    return lambda: opt.param_groups[-1].__setitem__("beta", 0.9)


def _break_lr_shape(model, opt):
    good = opt.param_groups[-1]["lr"]
    opt.param_groups[-1]["lr"] = torch.tensor([1e-2])
    return lambda: opt.param_groups[-1].__setitem__("lr", good)


def _break_grad_dtype(model, opt):
    last = list(model.parameters())[-1]
    good = last.grad
    last.grad_dtype = None  # torch checks assigned gradients' dtype unless told not to
    last.grad = good.double()

    def fix():
        last.grad = good
        last.grad_dtype = last.dtype
    return fix


def _break_grad_shape(model, opt):
    last = list(model.parameters())[-1]
    good = last.grad.clone()
    last.grad.data = good[:-1].clone()  # `.data` skips the shape check of `.grad =`
    return lambda: setattr(last, "grad", good)


def _break_channels_last(model, opt):
    model.to(memory_format=torch.channels_last)
    return lambda: model.to(memory_format=torch.contiguous_format)


BREAKS = {"Lambda=0": (_break_lambda, "Lambda must be a finite number > 0"), "beta=1": (_break_beta, "beta must be in"),
          "lr-shape": (_break_lr_shape, "lr must be a number or a 0-dim"),
          "grad-float64": (_break_grad_dtype, "its gradient is a torch.float64"),
          "grad-shape": (_break_grad_shape, "its gradient is a"),
          "channels_last": (_break_channels_last, "not contiguous")}


def _two_groups(model, cls, backend):
    params = list(model.parameters())
    return cls(model, lr=1e-2, TCov=2, weight_decay=0.01, backend=backend,
               params=[{"params": params[:-2]}, {"params": params[-2:], "lr": 5e-3}])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(BREAKS))
def test_rejected_step_writes_nothing_and_retry_equals_clean_run(name, backend):
    make_break, message = BREAKS[name]
    batches = data(5, image=True)
    clean, broken = tiny_cnn(), tiny_cnn()
    clean_opt, opt = _two_groups(clean, AdaFisherW, backend), _two_groups(broken, AdaFisherW, backend)
    for i, (x, y) in enumerate(batches):
        for model, o in ((clean, clean_opt), (broken, opt)):
            backward(model, x, y)
            if o is opt and i == 2:  # a curvature step (k = 2): statistics are pending
                before = snapshot(model, o)
                fix = make_break(model, o)
                with pytest.raises((ValueError, TypeError), match=message):
                    o.step()
                fix()
                assert_same(snapshot(model, o), before)
            o.step()
    for p, q in zip(broken.parameters(), clean.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(broken.parameters(), clean.parameters()):
        for key, value in clean_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


# ----------------------------------------------------------------------------- 2. rejected load
def _trained(backend="fused"):
    model = tiny_mlp()
    opt = AdaFisher(model, lr=1e-2, TCov=2, backend=backend)
    for x, y in data(3):
        backward(model, x, y)
        opt.step()
    return model, opt


CORRUPT = {
    "no-k": (lambda sd: sd["param_groups"][0]["curvature"].pop("k"), ValueError, r"curvature\['k'\]"),
    "k-None": (lambda sd: sd["param_groups"][0]["curvature"].__setitem__("k", None), ValueError,
               r"curvature\['k'\]"),
    "k-negative": (lambda sd: sd["param_groups"][0]["curvature"].__setitem__("k", -1), ValueError,
                   r"curvature\['k'\]"),
    "no-curvature": (lambda sd: sd["param_groups"][0].pop("curvature"), ValueError, "missing 'curvature'"),
    "lr-string": (lambda sd: sd["param_groups"][0].__setitem__("lr", "fast"), TypeError, "lr must be a real"),
    "beta-range": (lambda sd: sd["param_groups"][0].__setitem__("beta", 1.5), ValueError, "beta must be in"),
    "factor-nan": (lambda sd: sd["state"][0]["fisher_H"].__setitem__(0, float("nan")), ValueError, "non-finite"),
    "factor-int": (lambda sd: sd["state"][0].__setitem__("fisher_S", sd["state"][0]["fisher_S"].long()),
                   TypeError, "real floating"),
    "anchor-missing": (lambda sd: sd["state"].pop(0), ValueError, "no factors for the layers"),
    "step-string": (lambda sd: sd["state"][1].__setitem__("step", "3"), TypeError, "real floating"),
}


@pytest.mark.parametrize("name", list(CORRUPT))
def test_rejected_checkpoint_leaves_optimizer_untouched(name):
    corrupt, exc, match = CORRUPT[name]
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    corrupt(sd)
    other_model, other = _trained()
    x, y = data(1, seed=7)[0]
    backward(other_model, x, y)
    other.step()  # other now differs from sd's source: a partial load would show
    before = snapshot(other_model, other)
    with pytest.raises(exc, match=match):
        other.load_state_dict(sd)
    assert_same(snapshot(other_model, other), before)


def test_checkpoint_with_python_float_step_loads():
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        entry["step"] = float(entry["step"])  # torch.optim style
    clone_model = copy.deepcopy(model)
    clone = AdaFisher(clone_model, lr=1e-2, TCov=2)
    clone.load_state_dict(sd)
    x, y = data(1, seed=5)[0]
    for m, o in ((model, opt), (clone_model, clone)):
        backward(m, x, y)
        o.step()
    for p, q in zip(model.parameters(), clone_model.parameters()):
        assert torch.equal(p, q)


def test_checkpoint_with_other_TCov_warns_and_constructor_wins():
    model, opt = _trained()
    sd = opt.state_dict()
    other = AdaFisher(copy.deepcopy(model), lr=1e-2, TCov=5)
    with pytest.warns(UserWarning, match=r"TCov=2.*keeps its own TCov=5"):
        other.load_state_dict(sd)
    assert other.TCov == 5


# ----------------------------------------------------------------------------- 3. lifetime
def test_deleted_optimizers_are_freed_and_unhooked():
    model = tiny_mlp()
    refs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "already hooked" warning: each one is gone first
        for _ in range(30):
            opt = AdaFisher(model, TCov=1)
            refs.append(weakref.ref(opt))
            del opt
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


def test_second_live_optimizer_on_same_model_warns():
    model = tiny_mlp()
    first = AdaFisher(model)
    with pytest.warns(UserWarning, match="already hooked by another live AdaFisher"):
        second = AdaFisherW(model)
    del first, second


def test_remove_hooks_then_new_optimizer_is_silent():
    model = tiny_mlp()
    first = AdaFisher(model)
    first.remove_hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdaFisher(model)


# ----------------------------------------------------------------------------- 4. copies
def test_deepcopy_of_model_trains_without_touching_the_optimizer():
    model = tiny_cnn()
    opt = AdaFisher(model, TCov=1)
    x, y = data(1, image=True)[0]
    backward(model, x, y)
    opt.step()
    ema = copy.deepcopy(model)
    averaged = torch.optim.swa_utils.AveragedModel(model)
    before = snapshot(model, opt)
    backward(ema, x, y)  # a copy's forward/backward with grad enabled
    F.cross_entropy(averaged(x), y).backward()
    averaged.update_parameters(model)
    assert_same(snapshot(model, opt), before)
    backward(model, x, y)
    opt.step()
    assert opt.state[model[0].weight]["fisher_S"].min() > 0


def test_torch_save_of_model_with_optimizer_attached():
    model = tiny_cnn()
    opt = AdaFisher(model, TCov=1)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x, y = data(1, image=True)[0]
    backward(loaded, x, y)  # the loaded copy's hooks are inert
    for p, q in zip(loaded.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert opt.state[model[0].weight]["stat_H"][-1] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_deepcopy_of_optimizer_steps_its_own_model(backend):
    model = tiny_cnn()
    opt = AdaFisher(model, lr=1e-2, TCov=2, backend=backend)
    batches = data(4, image=True)
    backward(model, *batches[0])
    opt.step()
    twin = copy.deepcopy(opt)
    assert twin.model is not model
    for x, y in batches[1:]:
        for o in (opt, twin):
            backward(o.model, x, y)
            o.step()
    for p, q in zip(model.parameters(), twin.model.parameters()):
        assert p is not q and torch.equal(p, q)
    assert twin.state[twin.model[0].weight]["fisher_S"].min() > 0


# ----------------------------------------------------------------------------- 5. compile
def _schedule_run(backend, compiled, tensors):
    model = tiny_mlp()
    opt = AdaFisher(model, lr=1e-2, TCov=3, weight_decay=0.01, backend=backend)
    step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
    for i, (x, y) in enumerate(data(8)):  # 8 distinct values of each hyperparameter
        values = {"beta": 0.9 - 0.01 * i, "Lambda": 1e-3 * (1 + i), "weight_decay": 0.01 + 0.002 * i}
        for group in opt.param_groups:
            for name, value in values.items():
                if tensors:
                    group[name].fill_(value)
                else:
                    group[name] = value  # timm / DINO style: a number assigned every step
        backward(model, x, y)
        with torch.no_grad():
            step()
    return model


@pytest.mark.parametrize("tensors", [True, False], ids=["fill_", "assigned-floats"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_under_hyperparameter_schedules(backend, tensors, fresh_dynamo):
    eager = _schedule_run(backend, compiled=False, tensors=tensors)
    compiled = _schedule_run(backend, compiled=True, tensors=tensors)
    assert counters["stats"]["unique_graphs"] <= (1 if tensors else 2), dict(counters["stats"])
    assert not counters["graph_break"]
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("compile_backend", [None, "eager", "aot_eager", "inductor"])
def test_curvature_steps_right_under_every_compile_backend(compile_backend, fresh_dynamo):
    """Statistics are taken on exactly the steps k % TCov == 0, whatever runs the step."""
    def run(compile_backend):
        model = tiny_mlp()
        opt = AdaFisher(model, lr=1e-2, TCov=3)
        step = opt.step if compile_backend is None else torch.compile(
            opt.step, backend=compile_backend, fullgraph=True)
        factors = []
        for x, y in data(7):
            backward(model, x, y)
            with torch.no_grad():
                step()
            factors.append(opt.state[model[0].weight]["fisher_H"].clone())
        return model, factors

    model, factors = run(compile_backend)
    changed = [i for i in range(1, len(factors)) if not torch.equal(factors[i], factors[i - 1])]
    assert changed == [3, 6]  # folded on the steps after the passes of k = 3 and 6
    ref_model, ref_factors = run(None)
    for a, b in zip(factors, ref_factors):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- 6. param groups
def test_add_param_group_for_a_layer_added_later_gets_curvature():
    model = tiny_mlp()
    opt = AdaFisher(model, lr=1e-2, TCov=1)
    head = nn.Linear(3, 2)
    model.append(head)
    opt.add_param_group({"params": list(head.parameters()), "lr": 1e-3})
    x, _ = data(1)[0]
    model.zero_grad()
    F.cross_entropy(model(x), torch.zeros(6, dtype=torch.long)).backward()
    opt.step()
    assert opt.state[head.weight]["fisher_S"].min() > 0


@pytest.mark.parametrize("bad, exc, match", [
    ({"lr": "1e-3"}, TypeError, "lr must be a real number"),
    ({"lr": math.inf}, ValueError, r"lr must be a finite number >= 0"),
    ({"weight_decay": math.inf}, ValueError, "weight_decay must be a finite number >= 0"),
    ({"beta": None}, TypeError, "beta must be a real number"),
])
def test_rejected_param_group_leaves_nothing(bad, exc, match):
    model = tiny_mlp()
    params = list(model.parameters())
    opt = AdaFisher(model, params=params[:-2], TCov=1)
    groups, state_keys = len(opt.param_groups), set(opt.state)
    with pytest.raises(exc, match=match):
        opt.add_param_group({"params": params[-2:], **bad})
    assert len(opt.param_groups) == groups and set(opt.state) == state_keys
    backward(model, *data(1)[0])
    opt.step()  # later steps still work


def test_constructor_error_for_string_lr_names_lr():
    with pytest.raises(TypeError, match="lr must be a real number, got str '1e-3'"):
        AdaFisher(tiny_mlp(), lr="1e-3")


def test_duplicate_parameter_in_a_group_is_rejected():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="same parameter twice"):
        AdaFisher(model, params=[model[0].weight, model[0].weight])


def test_empty_param_group_steps_as_no_op():
    model = tiny_mlp()
    opt = AdaFisher(model, params=[{"params": list(model.parameters())}, {"params": []}])
    backward(model, *data(1)[0])
    opt.step()
    assert opt.param_groups[1]["params"] == []


# ----------------------------------------------------------------------------- 7. collectives
def test_load_state_dict_and_add_param_group_run_no_collective(monkeypatch, tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/init")
    try:
        calls = []
        real = dist.all_gather_object
        monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        model = tiny_mlp()
        params = list(model.parameters())
        opt = AdaFisher(model, params=params[:-2], TCov=1)
        assert len(calls) == 1  # the constructor is collective, like DDP's
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        opt.add_param_group({"params": params[-2:]})
        assert len(calls) == 1  # local
        backward(model, *data(1)[0])
        opt.step()
        assert len(calls) == 2  # the next step compares the ranks' layouts once
        backward(model, *data(1)[0])
        opt.step()
        assert len(calls) == 2
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- 8. checkpointing
class _Checkpointed(nn.Module):
    def __init__(self, use_checkpoint):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        if self.use_checkpoint:
            h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        else:
            h = self.block(x)
        return self.head(h)


@pytest.mark.parametrize("statistics", ["per_pass", "per_step"])
def test_activation_checkpointing_counts_each_pass_once(statistics):
    plain, ckpt = _Checkpointed(False), _Checkpointed(True)
    opts = [AdaFisher(m, lr=1e-2, TCov=1, statistics=statistics) for m in (plain, ckpt)]
    for x, y in data(3):
        for m, o in zip((plain, ckpt), opts):
            backward(m, x, y)
            o.step()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p, q)
    for key in ("fisher_H", "fisher_S"):
        assert torch.equal(opts[0].state[plain.block[0].weight][key], opts[1].state[ckpt.block[0].weight][key])


# ----------------------------------------------------------------------------- 9. NaN statistics
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_statistics_warn_through_python_warnings(backend):
    model = tiny_mlp()
    opt = AdaFisher(model, TCov=1, backend=backend)
    x, y = data(1)[0]
    x[0, 0] = float("nan")
    backward(model, x, y)
    before = opt.state[model[0].weight]["fisher_H"].clone()
    with pytest.warns(RuntimeWarning, match=r"statistic\(s\) held NaN or inf and were dropped"):
        opt.step()
    assert torch.equal(opt.state[model[0].weight]["fisher_H"], before)
    assert opt.skipped_factor_updates >= 1


# ----------------------------------------------------------------------------- 10. smaller
def test_scheduler_step_before_optimizer_step_warns():
    opt = AdaFisher(tiny_mlp())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        sched.step()


def test_scheduler_after_optimizer_step_is_silent():
    model = tiny_mlp()
    opt = AdaFisher(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    backward(model, *data(1)[0])
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()


def test_one_cycle_lr_cycles_beta_as_adams_beta1():
    """OneCycleLR and CyclicLR cycle Adam's beta1 through `betas`; AdaFisher's beta is that
    decay: a run under OneCycleLR equals one that sets lr and beta by hand to the same values."""
    model, twin = tiny_mlp(), tiny_mlp()
    opt = AdaFisher(model, lr=1e-2)
    by_hand = AdaFisher(twin, lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    betas = []
    for x, y in data(4):
        by_hand.param_groups[0]["lr"] = float(opt.param_groups[0]["lr"])
        by_hand.param_groups[0]["beta"] = opt.param_groups[0]["betas"][0]
        for m, o in ((model, opt), (twin, by_hand)):
            backward(m, x, y)
            o.step()
        betas.append(float(opt.param_groups[0]["beta"]))
        sched.step()
    assert betas[0] == pytest.approx(0.95) and betas[-1] < betas[0]  # max_momentum, then down
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="betas"):
        opt.param_groups[0]["betas"] = (1.5,)
        backward(model, *data(1)[0])
        opt.step()
    with pytest.raises(ValueError, match="'beta'"):
        opt.add_param_group({"params": [], "betas": (0.9, 0.99)})


def test_multihead_attention_out_proj_uses_identity_curvature():
    """MultiheadAttention calls out_proj's weight functionally: its forward (and hooks) never run,
    so out_proj keeps F~ = 1 (documented), with no error."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    opt = AdaFisher(attention, lr=1e-2, TCov=1)
    x = torch.randn(3, 4, 8)
    for _ in range(2):
        attention.zero_grad()
        attention(x, x, x)[0].square().mean().backward()
        opt.step()
    state = opt.state[attention.out_proj.weight]
    assert (state["fisher_S"] == -1).all() and (state["fisher_H"] == -1).all()
    assert torch.isfinite(attention.out_proj.weight).all()


def test_discovered_parameters_match_the_registry_offsets_and_module_order():
    """The core names a layer's parameters as AdaFisher's registry does and as the module
    registers them, for every type the members support: layouts and checkpoints are the same
    whichever finds the layers."""
    from cafin.core import discover
    from cafin.layers import layer_type_of
    modules = [nn.Linear(4, 3), nn.Linear(4, 3, bias=False), nn.Conv2d(2, 3, 3), nn.Conv2d(2, 3, 3, bias=False),
               nn.BatchNorm2d(3), nn.LayerNorm(5), nn.LayerNorm(5, bias=False), nn.Conv1d(2, 3, 3),
               nn.Conv3d(2, 3, 2, bias=False), nn.Embedding(5, 3)]
    for module in modules:
        model = nn.Sequential(module)
        (layer,) = discover(model, model.parameters(), accept=lambda m: m is module)
        own = [name for name, _ in module.named_parameters(recurse=False)]
        assert list(layer.params) == own, module
        assert [n for n in layer_type_of(module).h_offsets(module) if getattr(module, n) is not None] == own
        (registered,) = cafin.layers.discover(model, model.parameters())
        assert list(registered.params) == own and registered.anchor is layer.anchor
        assert registered.kind is layer_type_of(module)


def test_kfac_and_singd_find_their_layers_without_adafisher_registry(monkeypatch):
    """K-FAC, two-level K-FAC and SINGD choose their layers themselves: AdaFisher's registry
    (emptied here) is not consulted."""
    monkeypatch.setattr(cafin.layers, "_REGISTRY", [])
    model = tiny_cnn()
    names = ["0", "4"]  # the Conv2d and the Linear
    assert [layer.name for layer in cafin.KFACPreconditioner(model).layers] == names
    assert [layer.name for layer in cafin.TwoLevelKFAC(model)._layers] == names
    assert [layer.name for layer in cafin.SINGD(model, warn_unsupported=False)._curvature] == names
    with pytest.warns(UserWarning, match="no optimised parameter in a supported layer"):
        AdaFisher(tiny_cnn())
