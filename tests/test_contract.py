"""The contract every member keeps, run over the table in tests/members.py (float64, CPU).

- a step that raises changes nothing; a setting a user breaks between steps is refused at the
  next step at the latest, naming it; callables of the step are checked when they are called;
- checkpoints: a good one resumes bit-identically through torch.save/torch.load(weights_only=True),
  a bad one is refused with the state_dict left bit-identical;
- copies train identically; a deleted member is freed and its hooks are gone;
- torch.compile(model) under every backend and activation checkpointing (reentrant or not) train
  like the plain eager model;
- a NaN statistic is dropped with a warning, never stored;
- awkward models (frozen parameters, an unused layer, batch size 1, bf16): correct, or refused at
  construction.
"""
from __future__ import annotations

import ast
import copy
import gc
import inspect
import io
import math
import re
import warnings
import weakref

import pytest
import torch
from torch import nn

from cafin import NonFiniteStatisticsWarning
from members import DELETE, HOOKED, IDS, MEMBERS, OPTIMIZERS, Run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def mlp(seed=0, dtype=torch.float64, bias_last=False):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6, bias=bias_last), nn.Tanh(),
                         nn.Linear(6, 3)).to(dtype)


def batches(n, seed=1, batch=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g, dtype=dtype), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(n)]


def clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_tree(v) for v in x)
    return copy.deepcopy(x)


def assert_tree_equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, list(a), list(b))
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            assert_tree_equal(u, v, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, (path, a, b)


def everything(run: Run):
    """All a step may write: parameters and every object's state_dict."""
    return clone_tree(([p for p in run.model.parameters()], run.checkpoint()))


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_params_equal(a, b, tol=0.0):
    for p, q in zip(a, b):
        if tol == 0.0:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=tol, atol=tol)


def train(member, model, data, **kwargs):
    run = Run(member, model, **kwargs)
    for x, y in data:
        run.step(x, y)
    return run


# ----------------------------------------------------------------------------- steps that raise
@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_bad_setting_between_steps_is_refused_and_changes_nothing(member):
    data = batches(3)
    for label, set_bad in member.bad_between_steps:
        run = train(member, mlp(), data[:2])
        run.backward(*data[2])
        before = everything(run)
        try:
            set_bad(run)  # refused here, or at the next step
        except (ValueError, TypeError) as e:
            assert label.split("=")[0] in str(e)
            assert_tree_equal(everything(run), before, label)
            continue
        before = everything(run)
        with pytest.raises((ValueError, TypeError), match=label.split("=")[0]):
            run.update()
        assert_tree_equal(everything(run), before, label)


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_out_of_range_argument_is_refused_at_construction(member):
    """Every numeric argument just outside its range, at each end that has one (betas and
    momenta below 1, intervals from 1, damping above 0, ...): refused, naming it."""
    for name, value in member.out_of_range:
        with pytest.raises((ValueError, TypeError), match=name):
            member.build(mlp(), **{name: value})


def _numeric(value) -> bool:
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(map(_numeric, value))
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_every_numeric_argument_has_out_of_range_values_in_the_table(member):
    """The table above covers the constructor: a numeric argument added later needs its rows
    (loglevel, a logging level, has no range)."""
    signature = inspect.signature(type(member.build(mlp())).__init__)
    numeric = {name for name, p in signature.parameters.items() if _numeric(p.default)}
    assert numeric - {"loglevel"} <= {name for name, _ in member.out_of_range}


@pytest.mark.parametrize("member", [m for m in MEMBERS if m.callables], ids=lambda m: m.name)
def test_callable_settings_are_checked_when_called(member):
    """kfac-pytorch style callables of the step: a bad value raises at the step that reads it,
    naming the argument, before anything is written."""
    data = batches(3)
    for name, (good, also_bad) in member.callables.items():
        for bad in (-1.0, math.nan, math.inf, "0.1", *also_bad):
            run = train(member, mlp(), data[:2],
                        **{name: (lambda k, good=good, bad=bad: good if k < 2 else bad)})
            before = everything(run)
            with pytest.raises((ValueError, TypeError), match=name):
                try:
                    run.backward(*data[2])  # hooks that read the value check it here
                except (ValueError, TypeError):
                    raise
                else:  # the pass's statistics are taken: the step checks before it writes
                    before = everything(run)
                    run.update()
            assert_tree_equal(everything(run), before, f"{name}={bad!r}")


@pytest.mark.parametrize("member", [m for m in OPTIMIZERS if m.closure], ids=lambda m: m.name)
def test_closure_that_raises_changes_nothing(member):
    """Statistics the aborted pass took are gone too: the next clean step equals a run that
    never saw the failing closure."""
    data = batches(4)
    clean = train(member, mlp(), data)
    run = train(member, mlp(), data[:2])
    before = everything(run)

    def closure():
        run.backward(*data[3])
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run.curvature.step(closure)
    assert_tree_equal(everything(run)[1], before[1])
    for x, y in data[2:]:
        run.step(x, y)
    assert_params_equal(params_of(run.model), params_of(clean.model))


@pytest.mark.parametrize("member", [m for m in OPTIMIZERS if m.float_settings], ids=lambda m: m.name)
def test_plain_float_assigned_to_a_group_setting_works(member):
    data = batches(4)
    for name in member.float_settings:
        runs = [train(member, mlp(), data[:2]) for _ in range(2)]
        value = 0.05 if name != "beta" else 0.8
        runs[0].curvature.param_groups[0][name] = value
        current = runs[1].curvature.param_groups[0][name]
        if isinstance(current, torch.Tensor):
            current.fill_(value)
        else:
            runs[1].curvature.param_groups[0][name] = value
        for x, y in data[2:]:
            for run in runs:
                run.step(x, y)
        assert_params_equal(params_of(runs[0].model), params_of(runs[1].model))


# ----------------------------------------------------------------------------- checkpoints
def _round_trip(checkpoint):
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_checkpoint_resumes_bit_identically(member):
    data = batches(5)
    original = train(member, mlp(), data[:3])
    saved = _round_trip(original.checkpoint())
    resumed = Run(member, mlp(seed=7))
    with torch.no_grad():
        for p, q in zip(resumed.model.parameters(), original.model.parameters()):
            p.copy_(q)
    resumed.restore(saved)
    for x, y in data[3:]:
        original.step(x, y)
        resumed.step(x, y)
    assert_params_equal(params_of(resumed.model), params_of(original.model))
    assert_tree_equal(resumed.checkpoint(), original.checkpoint())


def _corruptions(member, checkpoint):
    """(label, corrupted copy): the member's own bad settings, and for every floating state
    tensor a NaN in it and, for square ones (factors, bases), the wrong size."""
    found = []

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.numel() > 1:
                found.append(path)
        elif isinstance(x, dict):
            for k, v in x.items():
                if k != "param_groups":
                    walk(v, path + (k,))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, path + (i,))

    walk(checkpoint, ())
    for label, path, value in member.bad_checkpoint:
        yield label, _with(checkpoint, path, value)
    for path in found:
        t = _at(checkpoint, path)
        bad = t.clone()
        bad[(0,) * t.dim()] = math.nan
        yield f"NaN at {path}", _with(checkpoint, path, bad)
        if t.dim() == 2 and t.shape[0] == t.shape[1]:
            yield f"shape at {path}", _with(checkpoint, path, t[:-1, :-1].clone())


def _last_key(label: str):
    """The last key of the path in a `_corruptions` label ("NaN at ('state', 0, 'K.0')")."""
    return ast.literal_eval(label.split(" at ", 1)[1])[-1]


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _with(tree, path, value):
    tree = clone_tree(tree)
    parent = _at(tree, path[:-1])
    if isinstance(parent, tuple):
        raise AssertionError(f"cannot corrupt inside a tuple at {path}")
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return tree


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_rejected_checkpoint_changes_nothing(member):
    data = batches(3)
    source = train(member, mlp(), data)
    checkpoint = source.checkpoint()[0]
    target = train(member, mlp(seed=3), batches(2, seed=5))
    before = clone_tree(target.curvature.state_dict())
    accepted = []
    for label, bad in _corruptions(member, checkpoint):
        try:
            target.curvature.load_state_dict(bad)
        except (ValueError, TypeError, KeyError) as e:
            # the error names the bad entry, and reads as written ("checkpoint checkpoint state")
            assert not re.search(r"\b([a-z]{3,}) \1\b", str(e), re.IGNORECASE), str(e)
            if label.startswith(("NaN at", "shape at")):
                assert str(_last_key(label)) in str(e), (label, str(e))
        else:
            accepted.append(label)
            target.curvature.load_state_dict(before)
            continue
        assert_tree_equal(target.curvature.state_dict(), before, label)
    assert not accepted, f"{member.name} accepted corrupt checkpoints: {accepted}"


# ----------------------------------------------------------------------------- copies, lifetime
@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_deepcopy_of_model_and_member_trains_identically(member):
    data = batches(5)
    run = train(member, mlp(), data[:2])
    twin = copy.deepcopy(run)
    assert twin.model is not run.model
    for x, y in data[2:]:
        run.step(x, y)
        twin.step(x, y)
    assert_params_equal(params_of(twin.model), params_of(run.model))


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_deleted_member_is_freed_and_unhooked(member):
    model = mlp()
    run = train(member, model, batches(2))
    ref = weakref.ref(run.curvature)
    del run
    gc.collect()
    assert ref() is None
    assert all(len(m._forward_hooks) == 0 and len(m._backward_hooks) == 0 for m in model.modules())


# ----------------------------------------------------------------------------- compile, checkpointing
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_compiled_model_trains_like_eager(member, backend):
    torch._dynamo.reset()
    data = batches(3)
    eager = train(member, mlp(), data)
    model = mlp()
    run = Run(member, model)
    compiled = torch.compile(model, backend=backend)
    for x, y in data:
        run.step(x, y, model=compiled)
    assert_params_equal(params_of(model), params_of(eager.model), tol=1e-10)
    torch._dynamo.reset()


class _Checkpointed(nn.Module):
    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        if self.reentrant is None:
            return self.inner(x)
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def checkpointed_mlp(reentrant):
    model = mlp()
    return nn.Sequential(model[0], model[1], _Checkpointed(nn.Sequential(model[2], model[3]), reentrant),
                         model[4])


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("member", HOOKED, ids=lambda m: m.name)
def test_activation_checkpointing_takes_statistics_once(member, reentrant):
    data = batches(3)
    plain = train(member, checkpointed_mlp(None), data)
    ckpt = train(member, checkpointed_mlp(reentrant), data)
    assert_params_equal(params_of(ckpt.model), params_of(plain.model))
    assert_tree_equal(ckpt.checkpoint(), plain.checkpoint())


# ----------------------------------------------------------------------------- validation forwards
def _validation_forward(model, x):
    """A validation loss computed inside the training loop with autograd on, result discarded."""
    torch.nn.functional.cross_entropy(model(x), torch.zeros(x.shape[0], dtype=torch.long))


def _train_with_extra_forward(member, where):
    """Four training steps with an extra forward (a batch of another size) at `where` of each."""
    data, extra = batches(4), batches(4, seed=7, batch=5)
    run = Run(member, mlp())
    for (x, y), (xv, _) in zip(data, extra):
        if where == "before forward":
            _validation_forward(run.model, xv)
        if where == "between forward and backward":
            run.model.zero_grad(set_to_none=True)
            if member.name == "TwoLevelKFAC":
                run.curvature.update_stats = True
            loss = torch.nn.functional.cross_entropy(run.model(x), y)
            _validation_forward(run.model, xv)
            loss.backward()
        else:
            run.backward(x, y)
        if where == "between backward and step":
            _validation_forward(run.model, xv)
        run.update()
    return run


@pytest.mark.parametrize("where", ["before forward", "between forward and backward", "between backward and step"])
@pytest.mark.parametrize("member", HOOKED, ids=lambda m: m.name)
def test_a_forward_without_backward_takes_no_statistics(member, where):
    """Statistics pair each input with the gradient it gets: a forward whose output never gets
    one (a validation loss with autograd on) adds nothing, wherever it falls in the step."""
    clean = train(member, mlp(), batches(4))
    run = _train_with_extra_forward(member, where)
    assert_params_equal(params_of(run.model), params_of(clean.model), tol=1e-13)


@pytest.mark.parametrize("reentrant", [False, None], ids=["non-reentrant", "plain"])
@pytest.mark.parametrize("member", HOOKED, ids=lambda m: m.name)
def test_an_input_waits_for_its_gradient_as_autograd_keeps_it(member, reentrant):
    """Each input waits in its call's gradient hook, kept as autograd keeps a saved tensor:
    inside non-reentrant checkpointing it is freed after the forward (and recomputed), and a
    backward that frees its graph frees it, even with the loss kept alive."""
    base = mlp()
    model = nn.Sequential(base[0], _Checkpointed(nn.Sequential(*base[1:]), reentrant))
    run = Run(member, model)
    if member.name == "TwoLevelKFAC":
        run.curvature.update_stats = True
    inputs = []  # the input of the last Linear, a Tanh's output inside the checkpointed part
    base[4].register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0].untyped_storage())))
    x, y = batches(1)[0]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    gc.collect()
    assert (inputs[0]() is None) == (reentrant is False)
    loss.backward()
    run.update()
    gc.collect()
    assert loss.grad_fn is not None and all(ref() is None for ref in inputs)


@pytest.mark.parametrize("member", HOOKED, ids=lambda m: m.name)
def test_eval_mode_no_grad_and_inference_mode_take_no_statistics(member):
    """A module in eval() takes no statistics, even when its output gets a gradient; nor does
    a forward under no_grad or inference_mode."""
    data, extra = batches(4), batches(4, seed=7, batch=5)
    clean = train(member, mlp(), data)
    run = Run(member, mlp())
    for (x, y), (xv, yv) in zip(data, extra):
        run.model.eval()
        torch.nn.functional.cross_entropy(run.model(xv), yv).backward()
        run.model.train()
        with torch.no_grad():
            run.model(xv)
        with torch.inference_mode():
            run.model(xv)
        run.step(x, y)  # zeroes the eval pass's gradients first
    assert_params_equal(params_of(run.model), params_of(clean.model), tol=1e-13)


# ----------------------------------------------------------------------------- NaN statistics
@pytest.mark.parametrize("poison", [math.nan, 1e200], ids=["nan", "inf"])
@pytest.mark.parametrize("member", HOOKED, ids=lambda m: m.name)
def test_nan_statistic_is_dropped_with_a_warning(member, poison):
    """A pass on a NaN batch whose step is skipped (as a GradScaler skips one): its statistics
    are dropped when they would be folded, and the factors stay finite. The same for a batch
    of 1e200, whose squares overflow float64: statistics that are inf (and not NaN)."""
    data = batches(4)
    run = train(member, mlp(), data[:2])
    x, y = data[2]
    run.backward(torch.full_like(x, poison), y)
    run.model.zero_grad(set_to_none=True)
    run.backward(*data[3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.update()
    if not member.last_pass_statistics:  # else the clean pass replaced the NaN one: no drop
        assert any(issubclass(w.category, NonFiniteStatisticsWarning) for w in caught), \
            f"no NonFiniteStatisticsWarning for a dropped statistic: {[str(w.message) for w in caught]}"
        assert run.curvature.skipped_factor_updates >= 1, "the drop is not counted"

    def finite(tree):
        if isinstance(tree, torch.Tensor):
            return not tree.is_floating_point() or bool(torch.isfinite(tree).all())
        if isinstance(tree, dict):
            return all(finite(v) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return all(finite(v) for v in tree)
        return True

    assert finite(run.curvature.state_dict())
    run.step(*data[0])
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


# ----------------------------------------------------------------------------- awkward models
class _Scale(nn.Module):
    """A parameter in no layer any member supports."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(5, dtype=torch.float64))

    def forward(self, x):
        return x * self.weight


_NO_LAYER = "has no .*supported layer"


def _says_no_layer(build) -> None:
    """`build()` raises a ValueError or warns (UserWarning) that the model has no supported layer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            build()
        except ValueError as e:
            assert re.search(_NO_LAYER, str(e)), str(e)
            return
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(re.search(_NO_LAYER, m) for m in said), said


@pytest.mark.parametrize("member", HOOKED, ids=lambda m: m.name)
def test_model_without_a_supported_layer_is_named_at_construction(member):
    """A member that would take no curvature says so when it is built: a warning (it trains with
    plain gradients, or leaves them alone) or an error (it would have nothing to train)."""
    _says_no_layer(lambda: member.build(nn.Sequential(_Scale())))


@pytest.mark.parametrize("member", [m for m in HOOKED if not m.preconditioner], ids=lambda m: m.name)
def test_parameters_given_outside_every_supported_layer_warn(member):
    model = nn.Sequential(_Scale())
    _says_no_layer(lambda: member.build(model, params=list(model.parameters())))


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_frozen_parameter_stays_put_or_is_refused_at_construction(member):
    model = mlp()
    model[2].weight.requires_grad_(False)
    frozen = model[2].weight.detach().clone()
    try:
        run = Run(member, model)
    except (ValueError, TypeError) as e:
        assert "frozen" in str(e) or "requires_grad" in str(e) or "optimised" in str(e)
        return
    for x, y in batches(3):
        run.step(x, y)
    assert torch.equal(model[2].weight, frozen)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.spare = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_unused_layer_stays_put_or_is_named_before_any_write(member):
    model = _Unused()
    spare = [p.detach().clone() for p in model.spare.parameters()]
    data = batches(3)
    run = Run(member, model)
    before = everything(run)
    try:
        run.step(*data[0])
    except RuntimeError as e:  # two-level K-FAC's coarse space needs every layer's gradient
        assert "'spare'" in str(e)
        assert_tree_equal(everything(run)[1], before[1])
        return
    for x, y in data[1:]:
        run.step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(model.spare.parameters(), spare))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_batch_of_one(member):
    run = train(member, mlp(), batches(3, batch=1))
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_low_precision_model_trains_or_is_refused_at_construction(member, dtype):
    model = mlp(dtype=dtype)
    try:
        run = Run(member, model)
    except (ValueError, TypeError) as e:
        assert str(dtype).split(".")[-1] in str(e)
        return
    for x, y in batches(3, dtype=dtype):
        run.step(x, y)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _Twice(nn.Module):
    """One Linear called twice in a forward (weight sharing across positions or depth)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.out = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        return self.out(torch.tanh(self.shared(h)))


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_module_called_twice_trains_or_is_refused_before_any_write(member):
    model = _Twice().double()
    data = batches(3)
    run = Run(member, model)
    before = everything(run)
    try:
        run.step(*data[0])
    except (ValueError, RuntimeError) as e:
        assert "shared" in str(e) or "twice" in str(e) or "called" in str(e)
        assert_tree_equal(everything(run)[1], before[1])
        return
    for x, y in data[1:]:
        run.step(x, y)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 3, bias=False),
                         nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).double()


def image_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_channels_last_model_trains_like_contiguous_or_is_refused_at_construction(member):
    data = image_batches(3)
    plain = train(member, cnn(), data)
    model = cnn().to(memory_format=torch.channels_last)
    try:
        run = Run(member, model)
    except ValueError as e:
        assert "channels_last" in str(e) or "contiguous" in str(e)
        return
    for x, y in data:
        run.step(x.to(memory_format=torch.channels_last), y)
    assert_params_equal(params_of(model), params_of(plain.model), tol=1e-10)


# ----------------------------------------------------------------------------- compiled steps
def _tensor_settings(group):
    return [k for k, v in group.items() if isinstance(v, torch.Tensor) and v.dim() == 0]


@pytest.mark.parametrize("member", [m for m in OPTIMIZERS if m.float_settings], ids=lambda m: m.name)
def test_compiled_step_under_a_schedule_of_every_tensor_setting(member):
    """torch.compile(opt.step, fullgraph=True) compiles once more at most while every 0-dim
    tensor setting of every group changes each step, and equals the eager step."""
    from torch._dynamo.utils import counters
    data = batches(6)
    runs = [train(member, mlp(), data[:1]) for _ in range(2)]  # first steps build state eagerly
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(runs[1].curvature.step, fullgraph=True)
    for i, (x, y) in enumerate(data[1:]):
        for run in runs:
            for group in run.curvature.param_groups:
                for name in _tensor_settings(group):
                    group[name].mul_(0.97 - 0.01 * i)
            run.backward(x, y)
        runs[0].curvature.step()
        compiled()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert not counters["graph_break"]
    assert_params_equal(params_of(runs[1].model), params_of(runs[0].model), tol=1e-10)
    torch._dynamo.reset()


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_gradient_of_another_dtype_is_refused_before_any_write(member):
    """A gradient the kernels would reject (torch allows one of another dtype once the
    parameter's grad_dtype is cleared) raises before the step writes anything."""
    data = batches(3)
    run = train(member, mlp(), data[:2])
    run.backward(*data[2])
    p = run.model[2].weight
    p.grad_dtype = None
    p.grad = p.grad.float()
    before = everything(run)
    grads = [q.grad.clone() for q in run.model.parameters()]
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        run.update()
    assert_tree_equal(everything(run), before)
    assert all(torch.equal(q.grad, g) for q, g in zip(run.model.parameters(), grads))


@pytest.mark.parametrize("member", OPTIMIZERS, ids=lambda m: m.name)
def test_a_kept_gradient_given_memory_of_another_dtype_is_refused_before_any_write(member):
    """Gradients kept from step to step (zero_grad(set_to_none=False)) are checked again when
    one is given new memory (`.data =`): one of another dtype raises before anything is written."""
    data = batches(2)
    run = train(member, mlp(), data[:1])
    run.backward(*data[1])
    run.update()
    run.update()  # the same gradients again: the step has seen them
    p = run.model[2].weight
    p.grad.data = p.grad.data.float()
    before = everything(run)
    with pytest.raises((ValueError, TypeError), match="gradient"):
        run.update()
    assert_tree_equal(everything(run), before)


@pytest.mark.parametrize("member", OPTIMIZERS, ids=lambda m: m.name)
def test_a_kept_gradient_reshaped_in_place_is_refused_before_any_write(member):
    """A kept gradient transposed in place keeps its memory and changes shape: refused before
    anything is written."""
    data = batches(2)
    run = train(member, mlp(), data[:1])
    run.backward(*data[1])
    run.update()
    run.update()
    with torch.no_grad():
        run.model[2].weight.grad.t_()
    before = everything(run)
    with pytest.raises((ValueError, TypeError), match="gradient"):
        run.update()
    assert_tree_equal(everything(run), before)


class _Tied(nn.Module):
    """Two Linear layers sharing one weight (as an embedding and a tied output layer do)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.out = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(torch.tanh(self.inp(x)))))))


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_tied_weights_train_or_are_refused_at_construction(member):
    model = _Tied().double()
    try:
        run = Run(member, model)
    except ValueError as e:
        assert "shared" in str(e) or "tied" in str(e)
        return
    for x, y in batches(3):
        run.step(x, y)
    assert model.a.weight is model.b.weight
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("member", [m for m in MEMBERS if isinstance(m.build(mlp()), torch.optim.Optimizer)],
                         ids=lambda m: m.name)
def test_step_hooks_and_the_profiler_see_every_step(member):
    """torch.optim's step hooks (the optimizer's own and the global ones) run around each step,
    in torch's order, and the profiler shows the step's range; without either, the step runs as
    it did (the same state after it)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.profiler import ProfilerActivity, profile
    data = batches(3)
    run = train(member, mlp(), data[:1])
    opt, calls = run.curvature, []
    handles = [opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
               register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post"))]
    try:
        run.step(*data[1])
    finally:
        for handle in handles:
            handle.remove()
    follower = ["global pre", "global post"] if run.follower is not None else []  # its torch SGD
    assert calls == ["global pre", "pre", "post", "global post"] + follower
    run.backward(*data[2])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run.update()
    name = f"Optimizer.step#{type(opt).__name__}.step"
    assert any(e.name == name for e in prof.events()), name
    plain = train(member, mlp(), data)  # no hook, no profiler: the same steps, the same numbers
    assert_tree_equal(everything(plain), everything(run), "hooked and profiled steps")
