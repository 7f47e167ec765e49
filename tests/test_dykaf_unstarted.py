"""DyKAF's state dict before a parameter's first step (cafin.optim.dykaf.unstarted): every
parameter that requires grad has an entry with its state's keys and tensor shapes (`step` None),
so that a fresh optimizer's state dict is a template for torch.distributed.checkpoint (the
2-rank round trips are in tests/test_fsdp.py); such entries load as "not started"; and
torch.distributed.checkpoint's get_optimizer_state_dict does not step a fresh DyKAF with zero
gradients (which built "eps" starts from a zero gradient and changed the run)."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import cafin
from test_dykaf import batches, cnn, mlp, same, train


def layout(value):
    """A state entry's structure: tensors as (shape, dtype), lists as lists, the rest as is;
    `step` and the counts a first step writes left out."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, (list, tuple)):
        return [layout(v) for v in value]
    if isinstance(value, dict):
        return {k: layout(v) for k, v in value.items() if k not in ("step", "exp_avg_rot_step")}
    return value


def model_and_groups():
    """Every kind and factor layout: a conv kernel (kron4d), a matrix rotated on both sides, one
    rotated on one side only (max_precond_dim), 1-D tensors with and without a factor, a merged
    conv kernel (ema)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, (3, 2)),
                          nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 7, 5)).double()
    groups = [dict(params=[model[0].weight, model[0].bias]),
              dict(params=[model[2].weight, model[2].bias], merge_dims=True, precondition_1d=True),
              dict(params=[model[5].weight, model[5].bias], max_precond_dim=100)]
    return model, groups


@pytest.mark.parametrize("backend, adam_rank_one", [("fused", True), ("reference", False)],
                         ids=["fused-rank-one", "reference-full-moment"])
def test_fresh_state_dict_has_the_layout_of_the_first_step(backend, adam_rank_one):
    model, groups = model_and_groups()
    opt = cafin.DyKAF(groups, backend=backend, adam_rank_one=adam_rank_one, init="eps")
    fresh = opt.state_dict()["state"]
    assert sorted(fresh) == list(range(6)) and all(st["step"] is None for st in fresh.values())
    kinds = [fresh[i]["kind"] for i in range(6)]
    assert kinds == ["kron4d", "ema", "ema", "ema", "kron2d", "ema"]
    assert [f is None for f in fresh[4]["factors"]] == [False, True]  # 168 > max_precond_dim
    x, y = batches("cnn", 1)[0]
    train(model, opt, [(x.double(), y)])
    started = opt.state_dict()["state"]
    assert all(st["step"] == 0 for st in started.values())
    assert layout(fresh) == layout(started)


def test_unstarted_entries_load_as_no_state():
    """A checkpoint taken while one layer has had no gradient yet (its entries unstarted) resumes
    bit-identically through torch.save, that layer starting at its first gradient as in the run
    that was not interrupted."""
    torch.manual_seed(0)
    model = mlp()
    opt = cafin.DyKAF(model.parameters(), init="eps", precondition_frequency=2, lr=1e-2)
    data = batches("mlp", 6)
    head = model[4]
    head.requires_grad_(False)  # no gradient for the Linear during the first steps
    train(model, opt, data[:2])
    head.requires_grad_(True)
    sd = opt.state_dict()
    assert sd["state"][4]["step"] is None and sd["state"][0]["step"] == 1
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    twin = copy.deepcopy(model)
    opt2 = cafin.DyKAF(twin.parameters(), init="eps", precondition_frequency=2, lr=1e-2)
    opt2.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert not opt2.state[twin[4].weight] and opt2.state[twin[0].weight]["step"] == 1
    assert same(opt2.state_dict(), opt.state_dict())
    train(model, opt, data[2:])
    train(twin, opt2, data[2:])
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert opt.state[head.weight]["step"] == 3  # started at data[2], three updates since


def test_frozen_parameters_have_no_entry():
    model = cnn()
    model[5].requires_grad_(False)
    opt = cafin.DyKAF(model.parameters())
    assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]


def test_unstarted_entry_that_does_not_fit_is_refused():
    torch.manual_seed(0)
    model = mlp()
    opt = cafin.DyKAF(model.parameters(), init="eps")
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    bad["state"][2]["factors"][0] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"state of parameter 2.*factors"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][2]["kind"] = "ema"
    with pytest.raises(ValueError, match=r"state of parameter 2.*kind"):
        opt.load_state_dict(bad)
    train(model, opt, batches("mlp", 2))
    started = opt.state_dict()
    started["state"][0]["step"] = None  # a started state's step lost: not taken for unstarted
    with pytest.raises(ValueError, match=r"state of parameter 0.*device_step"):
        opt.load_state_dict(started)


def test_get_optimizer_state_dict_leaves_a_fresh_optimizer_alone():
    """torch.distributed.checkpoint's get_optimizer_state_dict steps an optimizer without state
    with zero gradients: DyKAF holds an entry for every parameter from construction, so it is
    not stepped, and a run that took a state dict before its first step equals one that did
    not ("eps" starts were built from the zero gradient: another run)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    runs = []
    for take in (False, True):
        torch.manual_seed(0)
        model = mlp()
        opt = cafin.DyKAF(model.parameters(), init="eps", lr=1e-2)
        if take:
            sd = get_optimizer_state_dict(model, opt)
            assert all(st["step"] is None for st in sd["state"].values())
            assert all(not st for st in opt.state.values())
        train(model, opt, batches("mlp", 3))
        runs.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*runs):
        assert torch.equal(p, q)
