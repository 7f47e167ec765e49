"""The family's core: what every Kronecker-factored member shares and none owns.

- `unwrap`: the model behind DDP/DataParallel/torch.compile wrappers (hooks go on the model itself,
  and checkpoints name its layers the same way with or without a wrapper).
- `discover`: the supported layers of a model that hold optimised parameters, matched by identity
  (the first supported module that holds a parameter owns it; tied parameters once).
- `StepCounter`: k, the completed optimizer steps, on the host while steps run eagerly and on every
  device as a tensor that device-gated ops read after a compile or a CUDA-graph capture.
- `Hooks`: forward hooks and output-gradient tensor hooks that feed a member's statistics, holding
  the member weakly, safe with in-place activations, activation checkpointing and model copies.
- `average_over_ranks`: one collective over one flat buffer.
- Argument checks shared by the members.
"""
from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from .layers import LayerType, can_take_statistics, layer_type_of

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
        # Activation checkpointing recomputes the forward inside backward: that pass is the same
        # pass again, and its output's gradient is never computed, so it takes no statistics.
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
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
        target.register_hook(_GradHook(self.owner, self.layer, step, output.shape))
        return returned


def _resolve_inert():
    return _inert


class _GradHook:
    def __init__(self, owner_ref, layer: Layer, step, shape) -> None:
        self.owner, self.layer, self.step, self.shape = owner_ref, layer, step, shape

    def __call__(self, grad: torch.Tensor) -> None:
        owner = self.owner()
        if owner is not None:
            owner._grad_statistics(self.layer, grad.reshape(self.shape), self.step)


class Hooks:
    """The statistics hooks of one owner on its layers.

    The owner provides `_statistics_gate(layer, device) -> (launch, step)`,
    `_input_statistics(layer, x, step)` and `_grad_statistics(layer, g, step)`; the hooks call
    them on forward passes with grad enabled and on the matching backward. The hooks are removed
    when the owner is collected or `remove()` is called."""

    def __init__(self, owner, layers: list[Layer]) -> None:
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
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

    def __deepcopy__(self, memo):
        raise TypeError("Hooks are not copied; the owner re-hooks its copy")


# ------------------------------------------------------------------------------ collectives
def average_over_ranks(tensors: list[torch.Tensor], group=None) -> None:
    """Average tensors over the ranks of `group` in one collective over one flat buffer."""
    import torch.distributed as dist
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    torch._foreach_copy_(tensors, list(flat.split([t.numel() for t in tensors])))


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


def hyperparameter_tensor(value: Any, params: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim tensor of the parameters' op-math dtype on their device (float32 on the CPU for
    an empty group): what the step reads, and what schedules update in place."""
    dtype = torch.float64 if params and params[0].dtype == torch.float64 else torch.float32
    device = params[0].device if params else torch.device("cpu")
    return torch.as_tensor(value).detach().reshape(()).to(device=device, dtype=dtype).clone()
