"""The statistics hooks: forward hooks and output-gradient tensor hooks that feed a member's
statistics, holding the member weakly, safe with in-place activations, activation checkpointing
and copies of the model."""
from __future__ import annotations

import importlib
import warnings
import weakref

import torch
from torch import nn

from . import route
from .discovery import Layer

# Which live owner hooks which module, so a second optimizer on the same model is not silent.
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


# Whether Dynamo traces a tensor hook on an intermediate tensor by rewriting it into an
# autograd.Function (torch 2.11's `_ApplyBackwardHook`). That rewrite fails on a model with two
# hooked layers or more: its output is a view of its input, and autograd refuses the in-place op
# of a ReLU(inplace=True) after the layer on a view made inside a custom Function; and it moves
# every graph node the hook depends on to just after the hooked tensor, so the step tensor that
# all the layers' hooks share ends up after the earlier layers' uses of it. There a compiled
# forward takes the gradient through `_GradTap` instead. Later Dynamo traces a tensor hook as a
# higher-order op, which has neither problem.
_DYNAMO_REWRITES_TENSOR_HOOKS = hasattr(importlib.import_module("torch._dynamo.variables.tensor"),
                                        "_ApplyBackwardHook")


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
        if owner is None or module is not self.layer.module or not module.training:
            return None
        if not torch.is_grad_enabled() or not inputs or not isinstance(inputs[0], torch.Tensor):
            return None
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return None  # no gradient will reach this call: nothing to pair its input with
        x = inputs[0].detach()
        if not can_take_statistics(module, x):
            return None
        recomputing = not route.compiled() and _recomputing_saved_tensors()
        launch, step = owner._statistics_gate(self.layer, x.device)
        if not launch:
            return None
        saved = _save(x)
        if recomputing:
            # The first pass's gradient hook takes this call's statistics. Saving x again makes
            # the recompute save what the first pass saved, in the same order, and this copy is
            # the one that hook's saved x unpacks to.
            return None
        # A tensor hook, not a module backward hook: it sees the gradient of the module's own
        # output even when an in-place activation later overwrites that tensor. A view (Linear on
        # 3-D input, unbatched Conv2d) loses its hooks when modified in place, so the hook goes on
        # the tensor it views when that holds the same elements, or on a copy returned instead.
        target, returned = output, None
        if not route.compiled() and output._is_view():
            base = output._base
            if (base.numel() == output.numel() and base.is_contiguous() and output.is_contiguous()
                    and base.storage_offset() == output.storage_offset()):
                target = base
            else:
                target = returned = output.clone()
        if _DYNAMO_REWRITES_TENSOR_HOOKS and route.compiled():
            return _GradTap.apply(output, x, _GradHook(self, step, output.shape, None))
        target.register_hook(_GradHook(self, step, output.shape, saved))
        return returned


class _GradTap(torch.autograd.Function):
    """The output-gradient hook as an autograd.Function, for a forward torch.compile traces where
    Dynamo's own rewrite of tensor hooks fails (`_DYNAMO_REWRITES_TENSOR_HOOKS`). Its output is
    a copy of the layer's output, which in-place successors may write; it saves the layer's input
    as autograd saves any tensor, and hands it, with the gradient that reaches the copy, to the
    hook, then passes the gradient on unchanged."""

    @staticmethod
    def forward(ctx, output, x, hook):
        ctx.hook = hook
        ctx.save_for_backward(x)
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.hook.take(ctx.saved_tensors[0], grad, ctx.hook.step)
        return grad, None, None


def can_take_statistics(module: nn.Module, x: torch.Tensor) -> bool:
    """Inputs the statistics are defined for (a LayerNorm over a 1-D input has no batch dim)."""
    if isinstance(module, nn.LayerNorm):
        return x.dim() > len(module.normalized_shape) and x.dim() >= 2
    return x.numel() > 0


def _recomputing_saved_tensors() -> bool:
    """Whether this forward is non-reentrant activation checkpointing recomputing tensors for
    backward. That pass repeats one whose calls already wait for their gradients, and its
    outputs' gradients are never computed, so it registers no gradient hook. Reentrant
    checkpointing is the other way round: its first pass runs without grad (no statistics), and
    its recompute inside backward is followed by a backward through the recomputed outputs, so
    that pass takes them."""
    if torch._C._current_graph_task_id() == -1:
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", "")


def _resolve_inert():
    return _inert


def _save(x: torch.Tensor):
    """Keep a layer's input until its output gradient arrives, the way autograd keeps a tensor
    saved for backward: through the saved-tensor hooks in force (non-reentrant activation
    checkpointing then recomputes it in backward instead of holding it, `save_on_cpu` offloads
    it); with none, the tensor itself, which the layer's own backward holds already."""
    if route.compiled():
        return x
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return x if hooks is None else _Packed(hooks[1], hooks[0](x))


class _Packed:
    """A tensor packed by saved-tensor hooks, with the hook that unpacks it."""

    def __init__(self, unpack, packed) -> None:
        self.unpack, self.packed = unpack, packed

    def tensor(self) -> torch.Tensor:
        return self.unpack(self.packed)


class _GradHook:
    """The output-gradient hook of one forward call: it hands the call's input and the gradient
    its output got to the owner together, so that statistics pair each input with its own
    gradient, and a call whose output gets none (a validation forward with autograd on) takes
    nothing. It reaches the owner through the forward hook's weak reference: a weak reference
    created while torch.compile traces the forward is rebuilt by Dynamo as a strong reference to
    its referent, which then is not callable."""

    def __init__(self, forward: _ForwardHook, step, shape, saved) -> None:
        self.forward, self.step, self.shape, self.saved = forward, step, shape, saved
        # A compiled forward's graph keeps x as one of its saved activations, freed with them.
        self.eager = not route.compiled()

    def __call__(self, grad: torch.Tensor) -> None:
        x, step = self.saved, self.step
        if self.eager:
            if x is None:  # a second backward through a graph the first one freed
                return
            if not torch._C._autograd._get_current_graph_task_keep_graph():
                # freed with the graph's own saved tensors (a member's `step` may be its record
                # of this call, holding x)
                self.saved = self.step = None
            if isinstance(x, _Packed):
                x = x.tensor()
        self.take(x, grad, step)

    def take(self, x: torch.Tensor, grad: torch.Tensor, step) -> None:
        owner = self.forward.owner()
        if owner is not None:
            owner.take_input_statistics(self.forward.layer, x, step)
            owner.take_grad_statistics(self.forward.layer, grad.reshape(self.shape), step)


class Hooks:
    """The statistics hooks of one owner on its layers.

    The owner provides `_statistics_gate(layer, device) -> (launch, step)`, called on each
    forward pass of a module in train mode with grad enabled, and `take_input_statistics(layer,
    x, step)` and `take_grad_statistics(layer, g, step)`, called one after the other when that
    pass's output gradient arrives in backward, with the `step` the gate gave. The hooks are removed
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
