"""SINGD keeps how each step routes its layers (fused diagonal step, natural gradient, plain SGD for
parameters no layer owns) from step to step on one process. Everything that can change the routing
or the tensors it holds must be seen: the fused backend, its plan kept, equals the reference
backend (which keeps nothing) step for step, in float64, through each such change."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cafin

STRUCTURES = [("diagonal", "diagonal"), ("diagonal", "dense")]


def model(gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    # An Embedding (its weight is [vocab, dim]: the natural-gradient route), Linear layers with
    # and without bias (the fused diagonal step) and a LayerNorm no layer owns (plain SGD).
    return nn.Sequential(nn.Embedding(11, 7), nn.Linear(7, 9), nn.LayerNorm(9), nn.Tanh(),
                         nn.Linear(9, 5, bias=False)).double()


def pair(structures, gen, T=2):
    m = model(gen)
    kw = dict(structures=structures, T=T, lr=0.05, lr_cov=0.1, weight_decay=1e-3,
              warn_unsupported=False)
    models = (m, copy.deepcopy(m))
    opts = (cafin.SINGD(models[0], backend="fused", **kw),
            cafin.SINGD(models[1], backend="reference", **kw))
    return models, opts


def started(structures, seed, steps):
    """The fused/reference pair and its batch generator, after `steps` checked steps."""
    gen = torch.Generator().manual_seed(seed)
    models, opts = pair(structures, gen)
    for _ in range(steps):
        step(models, opts, gen)
    return models, opts, gen


def backward(models, gen):
    x = torch.randint(0, 11, (6, 4), generator=gen)
    y = torch.randn(6, 4, 5, generator=gen, dtype=torch.float64)
    for m in models:
        ((m(x) - y) ** 2).mean().backward()


def step(models, opts, gen, zero=True):
    for opt in opts:
        if zero:
            opt.zero_grad()
    backward(models, gen)
    for opt in opts:
        opt.step()
    assert_equal(models)


def assert_equal(models):
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("structures", STRUCTURES)
def test_kept_gradients_and_new_gradients_each_step(structures):
    gen = torch.Generator().manual_seed(0)
    models, opts = pair(structures, gen)
    for k in range(5):  # zero_grad(set_to_none=True) gives new gradient tensors; kept ones below
        step(models, opts, gen)
    for opt in opts:
        opt.zero_grad(set_to_none=False)
    for k in range(3):
        step(models, opts, gen, zero=False)
    assert opts[0]._plan is not None  # the plan is what is kept, not rebuilt per step


@pytest.mark.parametrize("structures", STRUCTURES)
def test_a_parameter_without_gradient_then_with_one_again(structures):
    models, opts, gen = started(structures, 1, steps=1)
    for k in range(2):
        for opt in opts:
            opt.zero_grad()
        backward(models, gen)
        for m in models:  # the bias of the first Linear and the LayerNorm weight skip this step
            m[1].bias.grad = None
            m[2].weight.grad = None
        before = models[0][1].bias.detach().clone(), models[0][2].weight.detach().clone()
        for opt in opts:
            opt.step()
        assert_equal(models)
        assert torch.equal(models[0][1].bias, before[0]) and torch.equal(models[0][2].weight, before[1])
    step(models, opts, gen)


@pytest.mark.parametrize("structures", STRUCTURES)
def test_a_parameter_given_new_memory(structures):
    models, opts, gen = started(structures, 2, steps=2)
    for m in models:  # .data = (what model.to(...) does): the step must write the new memory
        m[1].weight.data = m[1].weight.data.clone()
        m[2].bias.data = m[2].bias.data.clone()
    step(models, opts, gen)
    step(models, opts, gen)


@pytest.mark.parametrize("structures", STRUCTURES)
def test_checkpoint_load_new_group_and_copy(structures):
    models, opts, gen = started(structures, 3, steps=1)
    saved = [opt.state_dict() for opt in opts]
    step(models, opts, gen)
    for opt, sd in zip(opts, saved):  # new state tensors: the kept routing must not hold the old
        opt.load_state_dict(sd)
    step(models, opts, gen)
    copies = tuple(copy.deepcopy((m, opt)) for m, opt in zip(models, opts))
    step(tuple(c[0] for c in copies), tuple(c[1] for c in copies), gen)
    step(models, opts, gen)


def test_a_group_added_after_steps():
    gen = torch.Generator().manual_seed(4)
    m = model(gen)
    later = [m[4].weight]
    first = [p for p in m.parameters() if all(p is not q for q in later)]
    kw = dict(structures=("diagonal", "diagonal"), T=1, lr=0.05, warn_unsupported=False)
    models = (m, copy.deepcopy(m))
    opts = []
    for mm, backend in zip(models, ("fused", "reference")):
        params = [p for p in mm.parameters() if p is not mm[4].weight]
        opts.append(cafin.SINGD(mm, params=params, backend=backend, **kw))
    step(models, opts, gen)
    frozen = models[0][4].weight.detach().clone()
    step(models, opts, gen)
    assert torch.equal(models[0][4].weight, frozen)
    for mm, opt in zip(models, opts):
        opt.add_param_group({"params": [mm[4].weight], "lr": 0.1})
    step(models, opts, gen)
    assert not torch.equal(models[0][4].weight, frozen)
    step(models, opts, gen)
    assert len(first) == len(list(m.parameters())) - 1


BAD_SETTINGS = [("alpha1", -1.0), ("T", 0), ("kfac_like", "yes"), ("normalize_lr_cov", 2),
                ("exact_block_transposes", None), ("loss_average", "mean"), ("kfac_approx", "bogus"),
                ("structures", ("dense", "dense")), ("structures", ["diagonal", "bogus"]),
                ("preconditioner_dtype", (torch.float32, None)), ("lr_cov", -1.0)]


@pytest.mark.parametrize("name,value", BAD_SETTINGS, ids=[f"{n}={v!r}" for n, v in BAD_SETTINGS])
def test_a_setting_changed_after_kept_checks_is_refused_before_any_write(name, value):
    gen = torch.Generator().manual_seed(5)
    (m, _), (opt, _) = pair(("diagonal", "diagonal"), gen)
    for _ in range(3):  # the settings' checks are kept from here on
        opt.zero_grad()
        backward((m,), gen)
        opt.step()
    opt.zero_grad()
    backward((m,), gen)
    before = [p.detach().clone() for p in m.parameters()]
    opt.param_groups[0][name] = value
    with pytest.raises((ValueError, TypeError), match=name.rstrip("s")):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_lr_cov_written_in_place_after_kept_checks_is_refused():
    gen = torch.Generator().manual_seed(6)
    (m, _), (opt, _) = pair(("diagonal", "diagonal"), gen)
    for _ in range(2):
        opt.zero_grad()
        backward((m,), gen)
        opt.step()
    opt.param_groups[0]["lr_cov"].fill_(-1.0)
    with pytest.raises(ValueError, match="lr_cov"):
        opt.step()
