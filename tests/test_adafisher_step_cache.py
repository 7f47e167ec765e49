"""What AdaFisher's eager step keeps from step to step, and the layout of its step counts.

A group's step counts are views of one float32 tensor per device, advanced with one add when
every parameter has a gradient and one by one otherwise; checkpoints hold each count as a 0-dim
tensor of its own, as torch.optim's do. The step runs torch.optim's step wrapper only when a
profiler or a step hook would see it. Each test compares counts, parameters and state exactly.
"""
from __future__ import annotations

import copy
import io
from unittest import mock

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from cafin import AdaFisher, AdaFisherW


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.LayerNorm(3), nn.Linear(3, 2))


N_PARAMS = 8  # _model's


def _data(k):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + k))


def _backward(model, k):
    model.zero_grad(set_to_none=True)
    model(_data(k)).square().mean().backward()


def _two_groups(cls, model, **kw):
    params = list(model.parameters())
    groups = [{"params": params[::2]}, {"params": params[1::2], "lr": 3e-3, "weight_decay": 1e-2}]
    return cls(model, lr=1e-2, Lambda=0.5, TCov=2, params=groups, **kw)


def _counts(opt, model):
    return [float(opt.state[p]["step"]) for p in model.parameters()]


def _same(model_a, opt_a, model_b, opt_b):
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key


def test_a_groups_step_counts_are_views_of_one_tensor():
    model = _model()
    opt = _two_groups(AdaFisher, model)
    for group in opt.param_groups:
        steps = [opt.state[p]["step"] for p in group["params"]]
        assert all(s.dim() == 0 and s.dtype == torch.float32 for s in steps)
        bases = {id(s._base) for s in steps}
        assert len(bases) == 1 and steps[0]._base.shape[0] == len(steps)
    first, second = (opt.state[g["params"][0]]["step"]._base for g in opt.param_groups)
    assert first is not second


@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
def test_step_counts_advance_per_parameter(cls):
    """Every parameter with a gradient advances by one per step; one without a gradient, or
    dropped from its group, does not."""
    model = _model()
    opt = _two_groups(cls, model)
    params = list(model.parameters())
    expected = [0.0] * len(params)
    for k in range(6):
        _backward(model, k)
        if k == 2:  # some parameters without gradients (in both groups)
            for p in params[1:4]:
                p.grad = None
        if k == 4:  # a parameter dropped from its group
            dropped = opt.param_groups[0]["params"].pop()
        opt.step()
        for i, p in enumerate(params):
            in_group = not (k >= 4 and p is dropped)
            expected[i] += float(p.grad is not None and in_group)
        assert _counts(opt, model) == expected, k
    assert expected[1] == 5.0 and expected[0] == 6.0 and expected[[p is dropped for p in params].index(True)] == 4.0


def test_one_add_for_the_group_equals_one_add_per_parameter_bit_for_bit():
    """The usual step's single add of a group's counts against the same steps advancing each
    count on its own (counts made separate tensors, as a step with a missing gradient does)."""
    models = [_model(), _model()]
    opts = [_two_groups(AdaFisher, m) for m in models]
    for p in models[1].parameters():  # separate tensors: no whole group of views
        opts[1].state[p]["step"] = opts[1].state[p]["step"].clone()
    opts[1]._step_tensors.clear()
    for k in range(5):
        for m, o in zip(models, opts):
            _backward(m, k)
            o.step()
    assert opts[0]._step_tensors[id(opts[0].param_groups[0])].counts is not None
    assert opts[1]._step_tensors[id(opts[1].param_groups[0])].counts is None
    _same(models[0], opts[0], models[1], opts[1])
    assert _counts(opts[0], models[0]) == [5.0] * N_PARAMS


def test_a_skipped_step_leaves_the_counts():
    """A GradScaler's found_inf (set on the optimizer by scaler.step) leaves every count and
    parameter as they were; a step without overflow advances them."""
    model = _model()
    opt = _two_groups(AdaFisher, model)
    _backward(model, 0)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.ones(())
    opt.step()
    assert _counts(opt, model) == [1.0] * N_PARAMS
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.found_inf = torch.zeros(())
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert _counts(opt, model) == [2.0] * N_PARAMS


def test_state_dict_holds_step_counts_of_their_own():
    """A checkpoint's counts are 0-dim float32 tensors with storage of their own (what
    torch.optim saves); the optimizer's own counts stay views of its groups' tensors."""
    model = _model()
    opt = _two_groups(AdaFisher, model)
    for k in range(3):
        _backward(model, k)
        opt.step()
    sd = opt.state_dict()
    ordered = [p for group in opt.param_groups for p in group["params"]]  # the saved indices
    assert sorted(sd["state"]) == list(range(len(ordered)))
    for index, entry in sd["state"].items():
        step = entry["step"]
        assert step._base is None and step.shape == () and step.dtype == torch.float32
        assert step.untyped_storage().nbytes() == 4
        assert float(step) == 3.0
        live = opt.state[ordered[index]]
        assert entry is not live and entry.keys() == live.keys()
        assert entry["exp_avg"] is live["exp_avg"]  # the rest as torch.optim gives it
        assert live["step"]._base is not None


@pytest.mark.parametrize("saved_as", ["tensors", "numbers"])
def test_a_checkpoint_with_separate_counts_resumes_bit_for_bit(saved_as):
    """A checkpoint whose counts are separate tensors (this version's and earlier ones') or
    Python numbers (torch.optim style) loads into the grouped layout, and the resumed run is
    the uninterrupted one bit for bit."""
    straight = _model()
    opt = _two_groups(AdaFisher, straight)
    first = _model()
    first_opt = _two_groups(AdaFisher, first)
    for k in range(3):
        for m, o in ((straight, opt), (first, first_opt)):
            _backward(m, k)
            o.step()
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    if saved_as == "numbers":
        for entry in saved["opt"]["state"].values():
            entry["step"] = float(entry["step"])
    resumed = _model()
    resumed_opt = _two_groups(AdaFisher, resumed)
    _backward(resumed, 99)
    resumed_opt.step()  # its own counts and kept step tensors must give way to the loaded ones
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    for group in resumed_opt.param_groups:
        assert len({id(resumed_opt.state[p]["step"]._base) for p in group["params"]}) == 1
    assert _counts(resumed_opt, resumed) == [3.0] * N_PARAMS
    for k in range(3, 7):
        for m, o in ((straight, opt), (resumed, resumed_opt)):
            _backward(m, k)
            o.step()
    _same(straight, opt, resumed, resumed_opt)


def test_a_param_group_added_later_gets_its_counts_and_keeps_the_others():
    model = _model()
    params = list(model.parameters())
    opt = AdaFisher(model, lr=1e-2, Lambda=0.5, TCov=2, params=params[:4])
    for k in range(2):
        _backward(model, k)
        opt.step()
    opt.add_param_group({"params": params[4:], "lr": 5e-3})
    for k in range(2, 4):
        _backward(model, k)
        opt.step()
    assert _counts(opt, model) == [4.0] * 4 + [2.0] * (N_PARAMS - 4)
    for group in opt.param_groups:
        assert len({id(opt.state[p]["step"]._base) for p in group["params"]}) == 1


def test_a_deepcopy_steps_its_own_counts():
    model = _model()
    opt = _two_groups(AdaFisher, model)
    _backward(model, 0)
    opt.step()
    twin_model, twin = copy.deepcopy((model, opt))
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert twin.state[q]["step"]._base is not None
        assert twin.state[q]["step"].data_ptr() != opt.state[p]["step"].data_ptr()
    _backward(twin_model, 1)
    twin.step()
    assert _counts(opt, model) == [1.0] * N_PARAMS
    assert _counts(twin, twin_model) == [2.0] * N_PARAMS


def test_a_parameter_given_new_memory_is_stepped_there():
    """`.data =` between kept steps (as model.to(...) does): the step reads and writes the
    parameter's new memory."""
    models = [_model(), _model()]
    opts = [_two_groups(AdaFisher, m) for m in models]
    for k in range(2):
        for m, o in zip(models, opts):
            _backward(m, k)
            o.step()
    moved = models[1][2].weight
    moved.data = moved.data.clone()
    moved.grad.data = moved.grad.data.clone()
    for k in range(2, 4):
        for m, o in zip(models, opts):
            _backward(m, k)
            o.step()
    _same(models[0], opts[0], models[1], opts[1])


# ------------------------------------------------------------------ torch.optim's step wrapper
def _stepped():
    model = _model()
    opt = AdaFisher(model, lr=1e-2, Lambda=0.5, TCov=2)
    _backward(model, 0)
    return model, opt


def test_the_profiler_sees_the_step():
    from torch.profiler import ProfilerActivity, profile
    _, opt = _stepped()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    assert any(e.name == "Optimizer.step#AdaFisher.step" for e in prof.events())


def test_step_hooks_run():
    _, opt = _stepped()
    calls = []
    handles = [opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
               register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post"))]
    try:
        opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["global pre", "pre", "post", "global post"]
    with mock.patch.object(opt, "_optimizer_step_code") as code:  # no hook, no profiler: direct
        opt.step()
    assert code.call_count == 0
    with mock.patch.object(opt, "_optimizer_step_code") as code:
        handle = opt.register_step_pre_hook(lambda o, a, k: None)
        opt.step()
        handle.remove()
    assert code.call_count == 1
    assert float(opt.state[opt.param_groups[0]["params"][0]]["step"]) == 3.0
