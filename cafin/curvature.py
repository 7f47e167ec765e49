"""The family's core: what every Kronecker-factored member shares and none owns.

- `unwrap`: the model behind DDP/DataParallel/torch.compile wrappers (hooks go on the model itself,
  and checkpoints name its layers the same way with or without a wrapper).
- `discover`: the supported layers of a model that hold optimised parameters, matched by identity
  (the first supported module that holds a parameter owns it; tied parameters once).
- `StepCounter`: k, the completed optimizer steps, on the host while steps run eagerly and on every
  device as a tensor that device-gated ops read after a compile or a CUDA-graph capture.
- `Hooks`: forward hooks and output-gradient tensor hooks that feed a member's statistics, holding
  the member weakly, safe with in-place activations, activation checkpointing and model copies.
- `average_over_ranks`: one collective over one flat buffer (over the parameters' FSDP2 mesh when
  they are sharded: `cafin.sharding` holds what the members share for `fully_shard`).
- Argument checks shared by the members.
"""
from __future__ import annotations

import copy
import math
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from .layers import LayerType, can_take_statistics, layer_type_of
from .sharding import check_sharded

_COMPILED = torch._dynamo.eval_frame.OptimizedModule
_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel, _COMPILED)


def unwrap(model: nn.Module) -> nn.Module:
    while isinstance(model, _WRAPPERS):
        model = model._orig_mod if isinstance(model, _COMPILED) else model.module
    return model


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# ------------------------------------------------------------------------------ layers
@dataclass(eq=False)
class Layer:
    """A supported module with at least one optimised parameter."""
    name: str
    module: nn.Module
    kind: LayerType
    anchor: torch.Tensor  # the parameter whose state holds the layer's factors
    params: dict  # parameter name -> the optimised parameter this layer owns


def discover(model: nn.Module, optimised: Iterable[torch.Tensor],
             accept=lambda module, kind: True) -> list[Layer]:
    """The supported layers of `model` that own optimised parameters, in `named_modules()` order.

    A parameter belongs to the first supported module that holds it (a decoder tied to an
    embedding takes the decoder's curvature). `accept(module, kind)` lets a member narrow the
    registry (K-FAC takes Linear and Conv2d only)."""
    optimised = set(optimised)
    owned: set[torch.Tensor] = set()
    layers = []
    for name, module in model.named_modules():
        kind = layer_type_of(module)
        if kind is None or not accept(module, kind):
            continue
        params = {}
        for pname in kind.h_offsets(module):
            p = getattr(module, pname, None)
            if isinstance(p, nn.Parameter) and p in optimised and p not in owned:
                params[pname] = p
        if not params:
            continue
        owned.update(params.values())
        layers.append(Layer(name, module, kind, next(iter(params.values())), params))
    return layers


# ------------------------------------------------------------------------------ step counter
class StepCounter:
    """k = completed optimizer steps.

    While steps run eagerly the host counts them and decides which passes take statistics, so
    nothing is launched on the other passes. A compiled step cannot keep a host count (a Python int
    it changed would be a new constant, and a recompile, every step; a tensor's version counter
    moves a backend-dependent number of times per step), and a CUDA-graph replay runs no Python at
    all: after either, the counter is "device gated" for good. Then every statistic op is launched
    on every pass with the per-device k tensor and decides on the device, and the host reads k from
    that tensor when it must (checkpoints).
    """

    def __init__(self) -> None:
        self.host = 0
        self.device_gated = False
        self.stepped = False  # whether any step ran (for the LR scheduler's call-order warning)
        self._tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _pair(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tensors:
            k = torch.full((), float(self.value()), device=device)
            # Added as a tensor: a Python 1 would become a new 0-dim tensor per call.
            one = torch.ones((), device=device)
            for t in (k, one):
                torch._dynamo.mark_static_address(t, guard=False)
            self._tensors[device] = (k, one)
        return self._tensors[device]

    def tensor(self, device: torch.device) -> torch.Tensor:
        """k on `device` (float32, 0-dim), the value device-gated ops read."""
        return self._pair(device)[0]

    def one(self, device: torch.device) -> torch.Tensor:
        return self._pair(device)[1]

    def devices(self) -> list[torch.device]:
        return list(self._tensors)

    def _latch(self) -> bool:
        """Whether decisions are made on the device from now on (latched once true)."""
        if torch.compiler.is_compiling():
            self.device_gated = True  # a store, no read: no guard, no recompile when it flips
            return True
        if not self.device_gated and capturing():
            self.device_gated = True
        return self.device_gated

    def due(self, interval: int, device: torch.device) -> tuple[bool, torch.Tensor | None]:
        """(launch, step): launch the statistics at all, and the k tensor when the op must decide
        on the device (None when the host already decided that k % interval == 0)."""
        if self._latch():
            return True, self.tensor(device)
        return self.host % interval == 0, None

    def host_due(self, interval: int) -> bool | None:
        """k % interval == 0 as the host knows it, or None once the device decides."""
        return None if self._latch() else self.host % interval == 0

    def advance(self) -> None:
        """One completed step: +1 on every device tensor (one op), and on the host when eager."""
        self.stepped = True
        if self._tensors:
            ks, ones = zip(*self._tensors.values())
            torch._foreach_add_(list(ks), list(ones))
        if not self._latch():
            self.host += 1

    def value(self) -> int:
        if self.device_gated and self._tensors:
            return int(next(iter(self._tensors.values()))[0].item())
        return self.host

    def load(self, k: int) -> None:
        self.host = k
        for t, _ in self._tensors.values():
            t.fill_(float(k))


# ------------------------------------------------------------------------------ hooks
# Which live owner hooks which module, so a second optimizer on the same model is not silent.
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _inert(*args, **kwargs) -> None:
    """What a statistics hook becomes in a copy or a pickle of the model: the copy is not the
    model the optimizer trains, so it takes no statistics."""
    return None


class _ForwardHook:
    """The forward hook of one layer. Holds its owner weakly (a deleted optimizer is freed, and
    its hooks removed), and copies or pickles as an inert function (copies of the model, EMA
    models, `torch.save(model)`)."""

    def __init__(self, owner, layer: Layer) -> None:
        self.owner = weakref.ref(owner)
        self.layer = layer

    def __deepcopy__(self, memo):
        return _inert

    def __reduce__(self):
        return (_resolve_inert, ())

    def __call__(self, module, inputs, output):
        owner = self.owner()
        if owner is None or module is not self.layer.module:
            return None
        if not torch.is_grad_enabled() or not inputs or not isinstance(inputs[0], torch.Tensor):
            return None
        if not torch.compiler.is_compiling() and _recomputing_saved_tensors():
            return None
        x = inputs[0].detach()
        if not can_take_statistics(module, x):
            return None
        launch, step = owner._statistics_gate(self.layer, x.device)
        if not launch:
            return None
        owner._input_statistics(self.layer, x, step)
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return None
        # A tensor hook, not a module backward hook: it sees the gradient of the module's own
        # output even when an in-place activation later overwrites that tensor. A view (Linear on
        # 3-D input, unbatched Conv2d) loses its hooks when modified in place, so the hook goes on
        # the tensor it views when that holds the same elements, or on a copy returned instead.
        target, returned = output, None
        if not torch.compiler.is_compiling() and output._is_view():
            base = output._base
            if (base.numel() == output.numel() and base.is_contiguous() and output.is_contiguous()
                    and base.storage_offset() == output.storage_offset()):
                target = base
            else:
                target = returned = output.clone()
        target.register_hook(_GradHook(self, step, output.shape))
        return returned


def _recomputing_saved_tensors() -> bool:
    """Whether this forward is non-reentrant activation checkpointing recomputing tensors for
    backward. That pass repeats one whose statistics were taken, and its outputs' gradients are
    never computed, so it takes none. Reentrant checkpointing is the other way round: its first
    pass runs without grad (no statistics), and its recompute inside backward is followed by a
    backward through the recomputed outputs, so that pass takes them."""
    if torch._C._current_graph_task_id() == -1:
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", "")


def _resolve_inert():
    return _inert


class _GradHook:
    """The output-gradient hook of one forward call. It reaches the owner through the forward
    hook's weak reference: a weak reference created while torch.compile traces the forward is
    rebuilt by Dynamo as a strong reference to its referent, which then is not callable."""

    def __init__(self, forward: _ForwardHook, step, shape) -> None:
        self.forward, self.step, self.shape = forward, step, shape

    def __call__(self, grad: torch.Tensor) -> None:
        owner = self.forward.owner()
        if owner is not None:
            owner._grad_statistics(self.forward.layer, grad.reshape(self.shape), self.step)


class Hooks:
    """The statistics hooks of one owner on its layers.

    The owner provides `_statistics_gate(layer, device) -> (launch, step)`,
    `_input_statistics(layer, x, step)` and `_grad_statistics(layer, g, step)`; the hooks call
    them on forward passes with grad enabled and on the matching backward. The hooks are removed
    when the owner is collected or `remove()` is called."""

    def __init__(self, owner, layers: list[Layer]) -> None:
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self._owner = weakref.ref(owner)
        self._modules = [layer.module for layer in layers]
        for layer in layers:
            other = _HOOKED.get(layer.module)
            if other is not None and other() is not None and other() is not owner:
                warnings.warn(
                    f"{type(owner).__name__}: layer '{layer.name}' is already hooked by another "
                    f"live {type(other()).__name__}, so its statistics are now taken twice per "
                    "pass; call remove_hooks() on the old optimizer (or delete it) first",
                    UserWarning, stacklevel=4)
            _HOOKED[layer.module] = weakref.ref(owner)
            self.handles.append(layer.module.register_forward_hook(_ForwardHook(owner, layer)))
        # The handles list does not reference the owner, so this keeps nothing alive.
        self._finalizer = weakref.finalize(owner, Hooks._remove_handles, self.handles)

    @staticmethod
    def _remove_handles(handles) -> None:
        for handle in handles:
            handle.remove()
        handles.clear()

    def remove(self) -> None:
        self._finalizer.detach()
        Hooks._remove_handles(self.handles)
        for module in self._modules:
            if _HOOKED.get(module) == self._owner:  # weak references compare their referents
                del _HOOKED[module]

    def __deepcopy__(self, memo):
        raise TypeError("Hooks are not copied; the owner re-hooks its copy")


# ------------------------------------------------------------------------------ collectives
def average_over_ranks(tensors: list[torch.Tensor], group=None, *, summed: bool = False) -> None:
    """Average (or sum) tensors of any shapes over the ranks of `group` in one collective over
    one flat buffer."""
    import torch.distributed as dist
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if not summed:
        flat.div_(dist.get_world_size(group))
    pieces = [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    torch._foreach_copy_(tensors, pieces)


class EigendecompositionWarning(UserWarning):
    """A factor's eigendecomposition failed in its dtype and in float64: its layer keeps its
    previous eigenbasis."""


class DropCounts:
    """Statistics dropped because they held inf/NaN, counted per device in 0-dim float32 tensors
    that exist before any compile or capture and are marked static, so that compiled and captured
    steps add to them without a sync. `total()` reads them (a sync off the CPU)."""

    def __init__(self) -> None:
        self.counts: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self.counts:
            self.counts[device] = torch.zeros((), device=device)
            torch._dynamo.mark_static_address(self.counts[device], guard=False)
        return self.counts[device]

    def total(self, cpu_only: bool = False) -> int:
        return int(sum(c.item() for d, c in self.counts.items() if not cpu_only or d.type == "cpu"))


def run_closure(closure, pass_state: list[torch.Tensor]):
    """`closure()` with grad enabled. If it raises, the tensors its passes add to (statistics
    accumulators, counters) are put back as they were: a step that raises leaves no trace."""
    saved = [t.clone() for t in pass_state]
    try:
        with torch.enable_grad():
            return closure()
    except BaseException:
        if pass_state:
            torch._foreach_copy_(pass_state, saved)
        raise


def on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return t if t is None or t.device == device else t.to(device)


# ------------------------------------------------------------------------------ checks
def real_number(value: Any, name: str) -> float:
    """A hyperparameter as a Python float, with an error naming it when it is not a real number
    (a string from a YAML file, None, a tensor of several elements)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got a tensor of shape "
                             f"{tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor")
        return float(value.detach().cpu() if value.device.type != "meta" else math.nan)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_range(value: Any, name: str, low: float, high: float, *, low_open=False,
                high_open=False) -> float:
    """`value` as a float in the interval [low, high] (open ends as asked); infinities and NaN fail."""
    v = real_number(value, name)
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        if high == math.inf:  # no upper end: say so plainly
            raise ValueError(f"{name} must be a finite number {'>' if low_open else '>='} {low}, got {v}")
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {left}{low}, {high}{right}, got {v}")
    return v


def check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def check_hyperparameter(value: Any, name: str, low: float, high: float, low_open: bool,
                         high_open: bool) -> None:
    """A hyperparameter given as a number or a 1-element real tensor, in its range."""
    check_range(value, name, low, high, low_open=low_open, high_open=high_open)


def hyperparameter_tensor(value: Any, params: list[torch.Tensor],
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 0-dim tensor on the parameters' device (the CPU for an empty group) of `dtype`, by
    default their op-math dtype: what the step reads, and what schedules update in place."""
    if dtype is None:
        dtype = torch.float64 if params and params[0].dtype == torch.float64 else torch.float32
    device = params[0].device if params else torch.device("cpu")
    if not isinstance(value, torch.Tensor):  # straight to `dtype`: no float32 detour for 0.9
        return torch.tensor(float(value), dtype=dtype, device=device)
    return value.detach().reshape(()).to(device=device, dtype=dtype).clone()


# ------------------------------------------------------------------------------ the optimizer base
_FLOAT_PARAMS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------ hyperparameter rules
class Real:
    """A real hyperparameter in [low, high] (open ends as asked; never inf or NaN). Kept in the
    groups as a 0-dim tensor of `dtype` on the parameters' device (None: their op-math dtype), so
    schedules change it in place and a compiled step sees new values, not new constants; with
    tensor=False as a Python float (a value only the host reads)."""

    def __init__(self, low: float, high: float, low_open: bool = False, high_open: bool = False,
                 dtype: torch.dtype | None = None, tensor: bool = True) -> None:
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open
        self.dtype, self.tensor = dtype, tensor

    def check(self, value: Any, name: str) -> None:
        check_hyperparameter(value, name, self.low, self.high, self.low_open, self.high_open)

    def check_live(self, value: Any, name: str) -> None:
        """The value a group holds at a step (a schedule or a user may have put any number or
        tensor there). Values are read only where that costs no sync (numbers, CPU tensors)
        and not while compiling (they are symbolic there)."""
        if isinstance(value, torch.Tensor):
            if value.dim() != 0 or not value.is_floating_point():
                raise ValueError(f"{name} must be a number or a 0-dim float tensor, got a "
                                 f"{value.dtype} tensor of shape {tuple(value.shape)}")
            if value.device.type != "cpu" or torch.compiler.is_compiling():
                return
        elif torch.compiler.is_compiling():
            return
        self.check(value, name)

    def keep(self, value: Any, params: list[torch.Tensor], name: str) -> Any:
        if not self.tensor:
            return real_number(value, name)
        return hyperparameter_tensor(value, params, self.dtype)


class Pair:
    """A pair of real hyperparameters (Adam's betas), each checked and kept by its own rule."""

    def __init__(self, first: Real, second: Real) -> None:
        self.rules = (first, second)
        self.dtype = first.dtype

    def _entries(self, value: Any, name: str) -> tuple:
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise TypeError(f"{name} must be a pair of numbers (a tuple of 2), got "
                            f"{type(value).__name__} {value!r}")
        return tuple(value)

    def check(self, value: Any, name: str) -> None:
        for i, (v, rule) in enumerate(zip(self._entries(value, name), self.rules)):
            rule.check(v, f"{name}[{i}]")

    def check_live(self, value: Any, name: str) -> None:
        for i, (v, rule) in enumerate(zip(self._entries(value, name), self.rules)):
            rule.check_live(v, f"{name}[{i}]")

    def keep(self, value: Any, params: list[torch.Tensor], name: str) -> tuple:
        return tuple(rule.keep(v, params, f"{name}[{i}]")
                     for i, (v, rule) in enumerate(zip(value, self.rules)))


class Setting:
    """A setting that is not a real number (an int, a flag, a choice): kept as it is given."""
    dtype = None

    def check(self, value: Any, name: str) -> None:
        raise NotImplementedError

    def check_live(self, value: Any, name: str) -> None:
        if not torch.compiler.is_compiling():  # a compiled step reads it as a constant
            self.check(value, name)

    def keep(self, value: Any, params: list[torch.Tensor], name: str) -> Any:
        return value


class Int(Setting):
    """An int in [low, high] (high None: no upper end)."""

    def __init__(self, low: int, high: int | None = None) -> None:
        self.low, self.high = low, high

    def check(self, value: Any, name: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < self.low or (self.high is not None and value > self.high):
            upper = "" if self.high is None else f" and <= {self.high}"
            raise ValueError(f"{name} must be an int >= {self.low}{upper}, got {value}")


class Flag(Setting):
    """True or False (an int 0/1 is not taken: a mistyped value would pass)."""

    def check(self, value: Any, name: str) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


class Choice(Setting):
    """One of a few values (strings)."""

    def __init__(self, *options: Any) -> None:
        self.options = options

    def check(self, value: Any, name: str) -> None:
        if not any(type(value) is type(option) and value == option for option in self.options):
            raise ValueError(f"{name} must be one of {', '.join(map(repr, self.options))}, "
                             f"got {value!r}")


def as_rule(rule: Any) -> Real | Pair | Setting:
    """A rule, or a tuple (low, high, low_open, high_open, dtype) read as a tensor `Real`."""
    return rule if isinstance(rule, (Real, Pair, Setting)) else Real(*rule)


class _Called:
    """Whether a step has run, for the LR scheduler's call-order warning: a holder, because a store
    into it from a compiled step is kept (one into the optimizer itself is not)."""
    value = False


# ------------------------------------------------------------------------------ the optimizer base
class CoreOptimizer(torch.optim.Optimizer):
    """What every member that is a torch optimizer shares, model or not: validated param groups
    whose real hyperparameters are tensors end to end, a step that checks everything before it
    writes, copies, and checkpoints validated field by field before anything is replaced.

    A member sets `hyperparameters` (name -> rule: `Real`, `Pair`, `Int`, `Flag`, `Choice`, or a
    tuple (low, high, low_open, high_open, dtype) for a tensor `Real`; dtype None means the
    parameters' op-math dtype) and implements `_expected_state(p)` (key -> (shape, dtype) of a
    parameter's state) or, for irregular state, `_checkpoint_entry`. It calls `_begin_step()`
    first in its step."""

    hyperparameters: dict[str, Any] = {}
    _rules: dict[str, Any] = {}  # hyperparameters, every entry as a rule object
    finite_state: tuple[str, ...] = ()  # state keys a checkpoint must hold finite values in
    contiguous_params = True  # whether parameters must be contiguous (kernels that index them flat)
    _not_copied: tuple[str, ...] = ()  # attributes a deepcopy leaves to `_copied_from`
    _group_records: tuple[str, ...] = ()  # saved group entries that are a member's own record

    def __init__(self, params, defaults: dict[str, Any]) -> None:
        self._ones: dict[tuple, torch.Tensor] = {}
        self._called = _Called()
        super().__init__(params, defaults)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # LR schedulers wrap `opt.step` in a function that torch.compile refuses to trace
        # (lr_scheduler.py is skipped by Dynamo), which would break `torch.compile(opt.step,
        # fullgraph=True)`: mark every member's step as already wrapped. `_opt_called`, which the
        # wrapper would record for the scheduler's call-order warning, is kept by the member.
        if "step" in cls.__dict__:
            cls.step._wrapped_by_lr_sched = True
        cls._rules = {name: as_rule(rule) for name, rule in cls.hyperparameters.items()}

    @property
    def _opt_called(self) -> bool:
        return self._called.value

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:
        self._called.value = bool(value)

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its parameters and settings. A rejected group leaves
        nothing behind."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a param group holds the same parameter twice")
        self._check_params(params)
        for name, rule in self._rules.items():
            rule.check(param_group.get(name, self.defaults.get(name)), name)
        before = len(self.param_groups)
        try:
            super().add_param_group(param_group)
            group = self.param_groups[-1]
            for name, rule in self._rules.items():
                group[name] = rule.keep(group[name], group["params"], name)
            self._groups_changed()
        except BaseException:
            del self.param_groups[before:]
            for p in params:
                if not any(p is q for g in self.param_groups for q in g["params"]):
                    self.state.pop(p, None)
            self._groups_changed()
            raise

    def _check_params(self, params: list) -> None:
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params must hold Tensors, got {type(p).__name__}")
            if p.dtype not in _FLOAT_PARAMS:
                raise TypeError(f"parameter of shape {tuple(p.shape)} has dtype {p.dtype}; "
                                "cafin supports float32, float64, bfloat16 and float16")
            if self.contiguous_params and not p.is_contiguous():
                raise ValueError(f"parameter of shape {tuple(p.shape)} is not contiguous "
                                 "(e.g. channels_last); cafin needs contiguous parameters")

    def _groups_changed(self) -> None:
        """A group was added (or a rejected one removed again)."""

    def _expected_state(self, p: torch.Tensor) -> dict[str, tuple[tuple, torch.dtype]]:
        raise NotImplementedError

    def __deepcopy__(self, memo):
        """A copy optimises copies of the parameters, with state of its own."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if isinstance(value, types.ModuleType):  # a backend (cafin.ops, cafin.reference): shared
                setattr(new, key, value)
            elif key not in self._not_copied:
                setattr(new, key, copy.deepcopy(value, memo))
        new._copied_from(self)
        return new

    def _copied_from(self, original: "CoreOptimizer") -> None:
        """Set up what `_not_copied` names, in a fresh copy of `original`."""

    # ------------------------------------------------------------------ step
    def _begin_step(self) -> None:
        """Check every group before the step writes anything (a rejected step leaves no trace)."""
        for index, group in enumerate(self.param_groups):
            self._check_group(index, group)

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        """Everything the kernels would reject, in what a user or a schedule may have changed
        since the group was added."""
        for name, rule in self._rules.items():
            try:
                rule.check_live(group[name], name)
            except (TypeError, ValueError) as e:
                raise type(e)(f"param group {index}: {e}") from None
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            where = f"param group {index}, parameter of shape {tuple(p.shape)}"
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients ({where})")
            if grad.shape != p.shape or grad.dtype != p.dtype or grad.device != p.device:
                raise ValueError(f"{where}: its gradient is a {grad.dtype} tensor of shape "
                                 f"{tuple(grad.shape)} on {grad.device}, expected {p.dtype} of "
                                 f"shape {tuple(p.shape)} on {p.device}")
            if self.contiguous_params and not p.is_contiguous():
                raise ValueError(f"{where} is not contiguous (e.g. the model was moved to "
                                 "channels_last after the optimizer was built); cafin needs "
                                 "contiguous parameters")

    def _hyperparameter(self, group: dict[str, Any], name: str, device: torch.device,
                        work: torch.dtype):
        """A group's hyperparameter as the 0-dim tensor an op reads (a tuple of them for a
        `Pair`). A number that a schedule assigned is multiplied into a cached one, not wrapped
        with torch.tensor: under compile the number becomes symbolic after its first change,
        and this stays one graph."""
        rule = self._rules[name]
        dtype = rule.dtype or work
        if isinstance(rule, Pair):
            return tuple(self._as_tensor(v, device, dtype) for v in group[name])
        return self._as_tensor(group[name], device, dtype)

    def _as_tensor(self, value: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value if value.device == device and value.dtype == dtype else value.to(device, dtype)
        return self._one(device, dtype) * value

    def _one(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._ones:  # members make them when they create state; here only for strays
            self._ones[key] = torch.ones((), device=device, dtype=dtype)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self._ones[key], guard=False)
        return self._ones[key]

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this optimizer. Everything is validated before anything is
        replaced (a rejected checkpoint leaves the optimizer as it was); every tensor is copied
        onto its parameter's device and `state_dict` is left unchanged."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"not a {type(self).__name__} checkpoint: missing '{key}'")
        record = self._checkpoint_record(state_dict)
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, (list, tuple)):
            raise TypeError(f"checkpoint param_groups must be a list, got {type(saved_groups).__name__}")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(saved_groups)} param groups, this optimizer "
                             f"has {len(self.param_groups)}")
        index_to_param = {}
        new_groups = []
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if not isinstance(saved, dict):
                raise TypeError(f"checkpoint group {i} must be a dict, got {type(saved).__name__}")
            if len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(f"checkpoint group {i} has {len(saved.get('params', ()))} "
                                 f"parameters, this optimizer's has {len(group['params'])}")
            values = {}
            for name, rule in self._rules.items():
                if name not in saved:
                    raise ValueError(f"checkpoint group {i} has no {name}")
                try:
                    rule.check(saved[name], name)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"checkpoint group {i}: {e}") from None
                values[name] = rule.keep(saved[name], group["params"], name)
            for key, value in saved.items():
                if key not in ("params", *self._group_records) and key not in values:
                    values[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
            index_to_param.update((index, (p, values)) for index, p in zip(saved["params"], group["params"]))
            new_groups.append(values)
        new_state = self._checkpoint_state(state_dict["state"], index_to_param, record)
        # Everything checked: now replace.
        self.state.clear()
        self.state.update(new_state)
        for values, group in zip(new_groups, self.param_groups):
            group.update(values)
        self._loaded(record)

    def _checkpoint_record(self, state_dict: dict[str, Any]) -> Any:
        """A member's own record in a checkpoint, found before anything else is read."""
        return None

    def _checkpoint_state(self, saved_state: Any, index_to_param: dict, record: Any) -> dict:
        """The validated copy of a checkpoint's `state`. `index_to_param`: saved index ->
        (parameter, its group's settings as they will be after the load)."""
        if not isinstance(saved_state, dict):
            raise TypeError(f"checkpoint state must be a dict, got {type(saved_state).__name__}")
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for index, saved in saved_state.items():
            if index not in index_to_param:
                raise ValueError(f"checkpoint has state for parameter {index}, which this "
                                 "optimizer does not have")
            if not isinstance(saved, dict):
                raise TypeError(f"checkpoint state of parameter {index} must be a dict, got "
                                f"{type(saved).__name__}")
            p, group = index_to_param[index]
            new_state[p] = self._checkpoint_entry(index, p, saved, group)
        return new_state

    def _checkpoint_entry(self, index: Any, p: torch.Tensor, saved: dict[str, Any],
                          group: dict[str, Any]) -> dict[str, Any]:
        """The validated copy of one parameter's saved state, by `_expected_state(p)`."""
        expected = self._expected_state(p)
        if set(saved) != set(expected):
            raise ValueError(f"checkpoint state of parameter {index} has keys {sorted(saved)}, "
                             f"expected {sorted(expected)}")
        entry = {}
        for key, (shape, dtype) in expected.items():
            value = saved[key]
            if key == "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(float(value))  # torch.optim style: a Python number
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise TypeError(f"checkpoint {key} of parameter {index} must be a real "
                                f"floating tensor, got {getattr(value, 'dtype', type(value).__name__)}")
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"checkpoint {key} of parameter {index} has shape "
                                 f"{tuple(value.shape)}, expected {tuple(shape)}")
            if key == "step" and not (math.isfinite(float(value)) and float(value) >= 0):
                raise ValueError(f"checkpoint step of parameter {index} must be >= 0, "
                                 f"got {float(value)}")
            if key in self.finite_state and not torch.isfinite(value).all():
                raise ValueError(f"checkpoint {key} of parameter {index} holds non-finite values")
            entry[key] = value.detach().to(device=p.device, dtype=dtype, copy=True)
        return entry

    def _loaded(self, record: Any) -> None:
        """After a checkpoint replaced the state and the groups' settings."""


class CurvatureOptimizer(CoreOptimizer):
    """What every hook-based member that is a torch optimizer shares, beyond `CoreOptimizer`:
    the model, its supported layers, a step counter, hooks held weakly, the layout that
    checkpoints and ranks compare.

    A member sets `hyperparameters`, `checkpoint_settings` (constructor arguments that
    checkpoints record) and implements `_attach()` (discover layers, create every state tensor,
    install `Hooks`), `_layout()`, `_expected_state(p)` and the three hook callbacks."""

    checkpoint_settings: tuple[str, ...] = ()
    _not_copied = ("_hooks",)
    _group_records = ("curvature",)

    def __init__(self, model: nn.Module, params, defaults: dict[str, Any], process_group=None):
        if process_group is not None and not distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        self.model = unwrap(model)
        self.process_group = process_group
        self._steps = StepCounter()
        self._hooks: Hooks | None = None
        self._curvature: list[Layer] = []
        self._attached = False
        self._ranks_checked = False
        if params is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        # FSDP2: factors are averaged over the mesh the parameters are sharded on.
        mesh_group = check_sharded([p for g in self.param_groups for p in g["params"]],
                                   type(self).__name__)
        if self.process_group is None:
            self.process_group = mesh_group
        self._sharded = mesh_group is not None
        self._attached = True
        self._attach()
        if distributed():
            self._check_ranks_agree()

    # The call-order record is the step counter's (a store into it survives a compiled step).
    @property
    def _opt_called(self) -> bool:
        return self._steps.stepped

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:
        self._steps.stepped = bool(value)

    # ------------------------------------------------------------------ param groups
    def _check_params(self, params: list) -> None:
        model_params = {id(p) for p in self.model.parameters()}
        for p in params:
            if isinstance(p, torch.Tensor) and id(p) not in model_params:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} in params is not a "
                                 "parameter of the model")
        super()._check_params(params)

    def _groups_changed(self) -> None:
        # A group's parameters may belong to layers added to the model after construction:
        # they get curvature.
        if self._attached:  # a group added after construction
            self._attach()

    def _attach(self) -> None:
        raise NotImplementedError

    def _layout(self) -> list:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Remove the statistics hooks from the model (the optimizer then keeps its factors)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def _check_ranks_agree(self) -> None:
        """Every rank must hold the same factors, or the collective over them would hang or mix
        unrelated numbers: compare the layouts on every rank, and fail the same way. Collective:
        it runs in the constructor (collective, like DDP's) and in the first step after the
        layout may have changed (add_param_group, load_state_dict), never in those calls."""
        import torch.distributed as dist
        self._ranks_checked = True
        layouts = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(layouts, self._layout(), group=self.process_group)
        for rank, layout in enumerate(layouts):
            if layout != layouts[0]:
                raise ValueError(f"{type(self).__name__}: ranks disagree on the model's supported "
                                 f"layers: rank 0 has {layouts[0]}, rank {rank} has {layout}")

    def _copied_from(self, original: "CurvatureOptimizer") -> None:
        """A copy optimises a copy of the model, with hooks of its own."""
        self._hooks = Hooks(self, self._curvature) if original._hooks is not None else None

    # ------------------------------------------------------------------ step
    def _begin_step(self) -> None:
        """Check every group before the step writes anything, and compare the ranks' layouts
        when they may have changed."""
        super()._begin_step()
        if not self._ranks_checked and not torch.compiler.is_compiling() and distributed():
            self._check_ranks_agree()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's `state` and `param_groups`; every saved group also holds `curvature`:
        {"k": completed steps, "layout": the curvature layers, and the checkpointed settings}.
        It sits in the groups, not beside them, because torch.distributed.checkpoint's
        `get_optimizer_state_dict` keeps only `state` and `param_groups`."""
        sd = super().state_dict()
        curvature = {"k": self._steps.value(), "layout": self._layout(),
                     **{name: getattr(self, name) for name in self.checkpoint_settings}}
        sd["param_groups"] = [{**group, "curvature": copy.deepcopy(curvature)}
                              for group in sd["param_groups"]]
        return sd

    def _checkpoint_record(self, state_dict: dict[str, Any]) -> dict:
        saved_groups = state_dict["param_groups"]
        # Where `curvature` lives: in the groups (this version), beside them (earlier versions).
        if "curvature" in state_dict:
            return state_dict["curvature"]
        if saved_groups and isinstance(saved_groups[0], dict) and "curvature" in saved_groups[0]:
            return saved_groups[0]["curvature"]
        raise ValueError(f"not a {type(self).__name__} checkpoint: missing 'curvature'")

    def _checkpoint_state(self, saved_state: Any, index_to_param: dict, curvature: Any) -> dict:
        k = curvature.get("k") if isinstance(curvature, dict) else None
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"checkpoint curvature['k'] (completed steps) must be an int >= 0, "
                             f"got {k!r}")
        layout = curvature.get("layout")
        if layout != self._layout():
            raise ValueError("checkpoint was saved for a different model: its curvature layers "
                             f"{layout} do not match this model's {self._layout()}")
        new_state = super()._checkpoint_state(saved_state, index_to_param, curvature)
        missing = [layer.name for layer in self._curvature if layer.anchor not in new_state]
        if missing:
            raise ValueError(f"checkpoint has no factors for the layers {missing}")
        for name in self.checkpoint_settings:
            saved = curvature.get(name)
            if saved is not None and saved != getattr(self, name):
                warnings.warn(f"checkpoint was saved with {name}={saved}; this optimizer keeps "
                              f"its own {name}={getattr(self, name)} (the constructor's wins)",
                              UserWarning, stacklevel=3)
        return new_state

    def _loaded(self, curvature: dict) -> None:
        # Local: no collective runs in a load (ranks are compared at the next step).
        self._steps.load(curvature["k"])
        self._attach()  # state for parameters the checkpoint had none for
