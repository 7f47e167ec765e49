"""AdaFisher and AdaFisherW: Adam with the square-root second moment replaced by a diagonal
Kronecker-factored Fisher, F~ = S (x) H + Lambda (arXiv 2405.16397), with fused kernels.

Every persistent tensor lives in `self.state`: per parameter `step` and `exp_avg`; per supported
module, in the state of its first optimised parameter (its anchor), the factors `fisher_S`,
`fisher_H` (-1 until their first update) and the statistic accumulators `stat_S`, `stat_H`
(sums of raw statistics, their last entry counting contributions).

Curvature steps: statistics are taken on the forward/backward passes of the steps k with
k % TCov == 0 (k = completed optimizer steps, a per-device tensor the step increments). Eager
hooks decide on the host and launch nothing on other steps; the host knows k without a sync from
the tensor's version counter, which every step bumps once, compiled or not (a store into a Python
attribute made inside a compiled step is dropped, so a host counter could not follow). Hooks
traced by torch.compile, and everything after a CUDA-graph capture (replays run no Python), always
launch the statistics ops, which then decide on the device by reading k.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .. import ops, reference
from ..layers import LayerType, can_take_statistics, layer_type_of, supported_types
from ..reference import state_dtype

_BACKENDS = {"fused": ops, "reference": reference}
_COMPILED = torch._dynamo.eval_frame.OptimizedModule
_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel, _COMPILED)
_FACTOR_KEYS = ("fisher_S", "fisher_H", "stat_S", "stat_H")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass
class _Curvature:
    """A supported module with at least one optimised parameter."""
    name: str
    module: nn.Module
    kind: LayerType
    anchor: torch.Tensor  # the parameter whose state holds the module's factors


class AdaFisher(torch.optim.Optimizer):
    """AdaFisher with coupled L2 weight decay: g' = g + wd*theta, m <- beta*m + (1-beta)*g',
    theta <- theta - lr/(1-beta^t) * m / F~.

    Args:
        model: the module whose Linear, Conv2d, BatchNorm2d and LayerNorm layers (and subclasses)
            are hooked for curvature statistics. Other parameters use F~ = 1.
        lr, beta, Lambda, weight_decay: per param group (Lambda is the damping added to F~).
        gamma: factor averaging, F <- 0.1*gamma*F + 0.01*gamma*z_hat (as published).
        TCov: statistics are taken every TCov steps.
        params: parameters or param-group dicts (default: the model's trainable parameters).
        backend: "fused" (C++/CUDA kernels) or "reference" (plain PyTorch, the published way).
        statistics: "per_step" (default): every forward/backward pass of a curvature step adds to
            the statistics and the step folds their mean into the factors once, so k
            micro-batches of gradient accumulation update the factors once; "per_pass": each
            pass updates the factors right away, as the published code does (then the factors
            change before the step can see a GradScaler's overflow: not usable with one).
        process_group: with torch.distributed initialised, factors are averaged over this group
            (default: the world) once per curvature update, in one collective.
        grad_scaler: the torch.amp.GradScaler in use, needed only when gradients are unscaled
            before the step (`scaler.unscale_(opt)`, e.g. for clipping), so the gradient
            statistics, taken from scaled gradients, can still be unscaled.
    lr is kept as a 0-dim tensor on the parameters' device, so schedulers update it in place and
    a compiled step does not recompile when it changes.
    """

    decoupled_weight_decay = False
    # torch.amp.GradScaler.step then hands over `grad_scale` and `found_inf` device tensors
    # instead of unscaling: the kernel unscales, and skips everything when found_inf is set.
    _step_supports_amp_scaling = True

    def __init__(self, model: nn.Module, lr: float | torch.Tensor = 1e-3, beta: float = 0.9,
                 Lambda: float = 1e-3, gamma: float = 0.8, TCov: int = 100,
                 weight_decay: float = 0.0, *, params: Iterable | None = None,
                 backend: str = "fused", statistics: str = "per_step", process_group=None,
                 grad_scaler: torch.amp.GradScaler | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}; "
                            "cafin optimizers take the model first (parameters go in params=)")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        if not (isinstance(TCov, int) and not isinstance(TCov, bool) and TCov >= 1):
            raise ValueError(f"TCov must be an int >= 1, got {TCov!r}")
        if not 0.0 < gamma <= 10.0:
            raise ValueError(f"gamma must be in (0, 10], got {gamma}")
        if statistics not in ("per_step", "per_pass"):
            raise ValueError(f"statistics must be 'per_step' or 'per_pass', got {statistics!r}")
        if statistics == "per_pass" and grad_scaler is not None:
            raise ValueError("statistics='per_pass' folds statistics during backward, before a "
                             "GradScaler's overflow check: use statistics='per_step' with grad_scaler")
        if process_group is not None and not _distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        # Look through DDP/DataParallel and torch.compile wrappers: hooks go on the model itself and
        # checkpoints name its layers the same way with or without a wrapper.
        while isinstance(model, _WRAPPERS):
            model = model._orig_mod if isinstance(model, _COMPILED) else model.module
        self.model = model
        self.statistics = statistics
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        self.gamma = float(gamma)
        self.TCov = TCov
        self.backend = backend
        self._impl = _BACKENDS[backend]
        self._k_base = 0  # k = version of a k tensor - _k_base (see the module docstring)
        self._device_gated = False  # set once a step was captured in a CUDA graph
        self._opt_called = True  # see `step._wrapped_by_lr_sched` below
        self._counters: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._curvature: list[_Curvature] = []
        self._owner: dict[torch.Tensor, tuple[_Curvature, int]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._no_curvature: dict[tuple, torch.Tensor] = {}
        self._attached = False
        self._model_params = {id(p) for p in model.parameters()}
        defaults = dict(lr=lr, beta=beta, Lambda=Lambda, weight_decay=weight_decay)
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        self._attach()

    # ------------------------------------------------------------------ param groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        before = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            del self.param_groups[before:]  # a rejected group leaves nothing behind
            raise
        group = self.param_groups[-1]
        group["lr"] = self._lr_tensor(group["lr"], group["params"])
        if getattr(self, "_attached", False):  # a group added after construction
            self._attach()

    def _check_group(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if id(p) not in self._model_params:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} in params is not a "
                                 "parameter of the model")
            if p.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
                raise TypeError(f"parameter of shape {tuple(p.shape)} has dtype {p.dtype}; "
                                "cafin supports float32, float64, bfloat16 and float16")
            if not p.is_contiguous():
                raise ValueError(f"parameter of shape {tuple(p.shape)} is not contiguous "
                                 "(e.g. channels_last); cafin needs contiguous parameters")
        _check_hyperparameters(group)

    @staticmethod
    def _lr_tensor(lr, params) -> torch.Tensor:
        if not params:
            return torch.as_tensor(lr, dtype=torch.float32).detach().clone()
        work = state_dtype(params[0].dtype)
        return torch.as_tensor(lr).detach().to(device=params[0].device, dtype=work).clone()

    def _attach(self) -> None:
        """Map parameters to modules (by identity, first supported module wins), create every
        state tensor eagerly (a compiled or captured step needs them to exist) and hook the
        modules that own optimised parameters."""
        self.remove_hooks()
        self._attached = True
        optimised = {p for g in self.param_groups for p in g["params"]}
        kept = {id(c.module): c for c in self._curvature}
        self._curvature, self._owner = [], {}
        for name, module in self.model.named_modules():
            kind = layer_type_of(module)
            if kind is None:
                continue
            claimed = []
            for pname, offset in kind.h_offsets(module).items():
                p = getattr(module, pname, None)
                if isinstance(p, nn.Parameter) and p in optimised and p not in self._owner:
                    claimed.append((p, offset))
            if not claimed:
                continue
            previous = kept.get(id(module))
            record = _Curvature(name, module, kind, previous.anchor if previous else claimed[0][0])
            self._curvature.append(record)
            for p, offset in claimed:
                self._owner[p] = (record, offset)
        if not self._curvature:
            warnings.warn(f"{type(self).__name__}: the model has no optimised parameter in a "
                          f"supported layer ({', '.join(t.__name__ for t in supported_types())}); "
                          "every parameter uses F~ = 1", UserWarning, stacklevel=3)
        for group in self.param_groups:
            for p in group["params"]:
                self._counter(p.device)
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p.dtype),
                                                        memory_format=torch.contiguous_format)
        for record in self._curvature:
            state = self.state[record.anchor]
            if "fisher_S" not in state:
                state.update(self._new_factors(record))
            self._hooks.append(record.module.register_forward_hook(
                partial(self._forward_hook, record)))
        if _distributed():
            self._check_ranks_agree()

    def _check_ranks_agree(self) -> None:
        """Every rank must hold the same factors, or the collective over them would hang or mix
        unrelated numbers: compare the layouts once, on every rank, and fail the same way."""
        import torch.distributed as dist
        layouts = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(layouts, self._layout(), group=self.process_group)
        for rank, layout in enumerate(layouts):
            if layout != layouts[0]:
                raise ValueError(f"{type(self).__name__}: ranks disagree on the model's supported "
                                 f"layers: rank 0 has {layouts[0]}, rank {rank} has {layout}")

    @staticmethod
    def _new_factors(record: _Curvature) -> dict[str, torch.Tensor]:
        s, h = record.kind.s_size(record.module), record.kind.h_size(record.module)
        like = dict(dtype=state_dtype(record.anchor.dtype), device=record.anchor.device)
        return {"fisher_S": torch.full((s,), -1.0, **like), "fisher_H": torch.full((h,), -1.0, **like),
                "stat_S": torch.zeros(s + 1, **like), "stat_H": torch.zeros(h + 1, **like)}

    def _counter(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-device k (completed steps, read by device-gated statistics) and the count of
        factor updates dropped for NaN."""
        if device not in self._counters:
            first = not self._counters
            k = self._k()
            counters = {"k": torch.full((), float(k), device=device),
                        "skipped": torch.zeros((), device=device),
                        # added as a tensor: a Python 1 becomes a new 0-dim tensor per call
                        "one": torch.ones((), device=device)}
            for t in counters.values():
                torch._dynamo.mark_static_address(t, guard=False)
            self._counters[device] = counters
            if first:
                self._k_base = counters["k"]._version - k
        return self._counters[device]

    def _k(self) -> int:
        """Completed steps, as the host knows them without reading a device value."""
        if not self._counters:
            return 0
        return next(iter(self._counters.values()))["k"]._version - self._k_base

    def remove_hooks(self) -> None:
        """Remove the statistics hooks from the model (the optimizer then keeps its factors)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def skipped_factor_updates(self) -> int:
        """Factor updates dropped because a statistic held NaN (reads device counters)."""
        return int(sum(c["skipped"].item() for c in self._counters.values()))

    # ------------------------------------------------------------------ statistics hooks
    def _statistics_gate(self, device: torch.device) -> tuple[bool, torch.Tensor | None]:
        if torch.compiler.is_compiling():
            return True, self._counter(device)["k"]
        if self._device_gated or _capturing():
            self._device_gated = True
            return True, self._counter(device)["k"]
        return self._k() % self.TCov == 0, None

    def _forward_hook(self, record: _Curvature, module, inputs, output) -> torch.Tensor | None:
        if not torch.is_grad_enabled() or not inputs or not isinstance(inputs[0], torch.Tensor):
            return
        x = inputs[0].detach()
        if not can_take_statistics(module, x):
            return
        collect, step = self._statistics_gate(x.device)
        if not collect:
            return
        state = self.state[record.anchor]
        stat = state["stat_H"]
        if state_dtype(x.dtype) != stat.dtype:
            x = x.to(stat.dtype)
        record.kind.input_stats(self._impl, stat, module, x, step, self.TCov)
        if self.statistics == "per_pass":
            self._fold([state["fisher_H"]], [stat], [False], None, None)
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
        target.register_hook(partial(self._grad_hook, record, step, output.shape))
        return returned

    def _grad_hook(self, record: _Curvature, step, shape, grad: torch.Tensor) -> None:
        grad = grad.reshape(shape)
        stat = self.state[record.anchor]["stat_S"]
        if state_dtype(grad.dtype) != stat.dtype:
            grad = grad.to(stat.dtype)
        record.kind.grad_stats(self._impl, stat, record.module, grad, step, self.TCov)
        if self.statistics == "per_pass":
            self._fold([self.state[record.anchor]["fisher_S"]], [stat], [True], None, None)

    # ------------------------------------------------------------------ step
    def _init_group(self, group, params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets):
        """Collect one group's tensors (torch.compile runs this eagerly and marks them static)."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdaFisher does not support sparse gradients")
            state = self.state[p]
            params.append(p)
            grads.append(p.grad if p.grad.is_contiguous() else p.grad.contiguous())
            exp_avgs.append(state["exp_avg"])
            steps.append(state["step"])
            owner = self._owner.get(p)
            if owner is None:
                empty = self._empty(p)
                fisher_S.append(empty)
                fisher_H.append(empty)
                h_offsets.append(0)
            else:
                record, offset = owner
                anchor_state = self.state[record.anchor]
                fisher_S.append(anchor_state["fisher_S"])
                fisher_H.append(anchor_state["fisher_H"])
                h_offsets.append(offset)
        return False

    def _empty(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.device, state_dtype(p.dtype))
        if key not in self._no_curvature:
            self._no_curvature[key] = torch.empty(0, dtype=key[1], device=key[0])
        return self._no_curvature[key]

    def _fold(self, factors, stats, grad_side, grad_scale, found_inf) -> None:
        device = factors[0].device
        self._impl.fisher_average_(factors, stats, self._counter(device)["skipped"], self.gamma,
                                   grad_side, _on(grad_scale, device), _on(found_inf, device))

    def _update_factors(self, grad_scale, found_inf) -> None:
        """On a step after statistics were taken: fold them into the factors (one call per
        device over every factor) and, distributed, average the factors over the ranks. After a
        compile or a capture the host cannot tell, so this runs every step and the kernels
        decide (a factor without new statistics is left as it is)."""
        if not self._curvature:
            return
        # On the host: whether this step is a curvature step (the same on every rank, so either
        # all ranks average or none does, whatever their hooks saw).
        if not (torch.compiler.is_compiling() or self._device_gated or self._k() % self.TCov == 0):
            return
        by_device: dict[torch.device, tuple[list, list, list]] = {}
        for record in self._curvature:
            state = self.state[record.anchor]
            factors, stats, grad_side = by_device.setdefault(record.anchor.device, ([], [], []))
            factors += [state["fisher_H"], state["fisher_S"]]
            stats += [state["stat_H"], state["stat_S"]]
            grad_side += [False, True]
        if self.statistics == "per_step":
            if grad_scale is None and found_inf is not None:  # gradients unscaled before step()
                if self.grad_scaler is None:
                    raise RuntimeError(
                        f"{type(self).__name__}: gradients were unscaled before step() "
                        "(scaler.unscale_), so the gradient statistics, taken from scaled "
                        "gradients, cannot be unscaled: pass grad_scaler=scaler to the optimizer")
                grad_scale = self.grad_scaler._get_scale_async()
            for factors, stats, grad_side in by_device.values():
                self._fold(factors, stats, grad_side, grad_scale, found_inf)
        if _distributed():
            for factors, _, _ in by_device.values():
                _average_over_ranks(factors, self.process_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimizer step; a closure is evaluated with grad enabled and its loss returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and self.statistics == "per_pass":
            raise RuntimeError("a GradScaler steps this optimizer, but statistics='per_pass' has "
                               "already folded scaled gradient statistics into the factors: "
                               "use statistics='per_step' (the default) with a GradScaler")
        groups = []
        for group in self.param_groups:
            lists: tuple[list, ...] = ([], [], [], [], [], [], [])
            self._init_group(group, *lists)
            groups.append((group, lists))
        self._update_factors(grad_scale, found_inf)
        for group, (params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets) in groups:
            if not params:
                continue
            torch._foreach_add_(steps, [self._counters[s.device]["one"] for s in steps])
            buckets: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                buckets.setdefault((p.device, p.dtype), []).append(i)
            for (device, dtype), idx in buckets.items():
                lr = group["lr"]
                work = state_dtype(dtype)
                if not isinstance(lr, torch.Tensor):
                    lr = torch.tensor(lr, dtype=work, device=device)
                elif lr.device != device or lr.dtype != work:
                    lr = lr.to(device=device, dtype=work)
                pick = (lambda xs: xs) if len(idx) == len(params) else (lambda xs: [xs[i] for i in idx])
                self._impl.adafisher_step_(
                    pick(params), pick(grads), pick(exp_avgs), pick(steps), pick(fisher_S),
                    pick(fisher_H), pick(h_offsets), lr, group["beta"], group["weight_decay"],
                    group["Lambda"], self.decoupled_weight_decay, _on(grad_scale, device),
                    _on(found_inf, device))
            if found_inf is not None:  # a skipped step does not count, as in torch's fused Adam
                torch._foreach_sub_(steps, [_on(found_inf, s.device) for s in steps])
        ks = [c["k"] for c in self._counters.values()]
        torch._foreach_add_(ks, [c["one"] for c in self._counters.values()])  # one version bump
        if not torch.compiler.is_compiling() and _capturing():
            self._device_gated = True
        return loss

    # LR schedulers wrap `opt.step` in a function that torch.compile refuses to trace
    # (lr_scheduler.py is skipped by Dynamo), which would break `torch.compile(opt.step,
    # fullgraph=True)`. This marks the step as already wrapped; `_opt_called`, which the wrapper
    # records for the scheduler's call-order warning, is set once in __init__.
    step._wrapped_by_lr_sched = True

    # ------------------------------------------------------------------ checkpoints
    def _layout(self) -> list[list]:
        return [[r.name, type(r.module).__name__, r.kind.s_size(r.module), r.kind.h_size(r.module)]
                for r in self._curvature]

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        k = self._k()
        if self._device_gated:  # graph replays bump no version
            k = int(next(iter(self._counters.values()))["k"].item())
        sd["curvature"] = {"k": k, "layout": self._layout(), "TCov": self.TCov, "gamma": self.gamma}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this optimizer on this model; validates everything first, copies
        every tensor onto the parameters' devices and leaves `state_dict` unchanged."""
        for key in ("state", "param_groups", "curvature"):
            if key not in state_dict:
                raise ValueError(f"not a {type(self).__name__} checkpoint: missing '{key}'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(saved_groups)} param groups, this optimizer "
                             f"has {len(self.param_groups)}")
        index_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"checkpoint group has {len(saved['params'])} parameters, "
                                 f"this optimizer's has {len(group['params'])}")
            index_to_param.update(zip(saved["params"], group["params"]))
        layout = state_dict["curvature"].get("layout")
        if layout != self._layout():
            raise ValueError("checkpoint was saved for a different model: its curvature layers "
                             f"{layout} do not match this model's {self._layout()}")
        anchors = {r.anchor for r in self._curvature}
        new_state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for index, saved in state_dict["state"].items():
            if index not in index_to_param:
                raise ValueError(f"checkpoint has state for parameter {index}, which this "
                                 "optimizer does not have")
            p = index_to_param[index]
            expected = {"step": (), "exp_avg": tuple(p.shape)}
            if p in anchors:
                expected.update({k: tuple(v.shape) for k, v in self.state[p].items()
                                 if k in _FACTOR_KEYS})
            if set(saved) != set(expected):
                raise ValueError(f"checkpoint state of parameter {index} has keys {sorted(saved)}, "
                                 f"expected {sorted(expected)}")
            for key, shape in expected.items():
                if tuple(saved[key].shape) != shape:
                    raise ValueError(f"checkpoint {key} of parameter {index} has shape "
                                     f"{tuple(saved[key].shape)}, expected {shape}")
            work = state_dtype(p.dtype)
            new_state[p] = {key: value.detach().to(
                device=p.device, dtype=torch.float32 if key == "step" else work, copy=True)
                for key, value in saved.items()}
        # Everything checked: now replace.
        self.state.clear()
        self.state.update(new_state)
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key == "params":
                    continue
                if key == "lr":
                    value = self._lr_tensor(value, group["params"])
                elif isinstance(value, torch.Tensor):
                    value = value.detach().clone()
                group[key] = value
        k = int(state_dict["curvature"]["k"])
        for counters in self._counters.values():
            counters["k"].fill_(float(k))
        if self._counters:
            self._k_base = next(iter(self._counters.values()))["k"]._version - k
        self._attach()  # state for parameters the checkpoint had none for


class AdaFisherW(AdaFisher):
    """AdaFisherW: decoupled weight decay, m <- beta*m + (1-beta)*g,
    theta <- theta - lr*(m/((1-beta^t)*F~) + wd*theta). Same arguments as AdaFisher."""

    decoupled_weight_decay = True


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _average_over_ranks(factors: list[torch.Tensor], group) -> None:
    """Average the factors over the ranks in one collective over one flat buffer."""
    import torch.distributed as dist
    flat = torch.cat([f.reshape(-1) for f in factors])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    torch._foreach_copy_(factors, list(flat.split([f.numel() for f in factors])))


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return t if t is None or t.device == device else t.to(device)


def _check_hyperparameters(group: dict[str, Any]) -> None:
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a number or a 1-element tensor, got shape {tuple(lr.shape)}")
        lr_value = float(lr)
    else:
        lr_value = float(lr)
    if not lr_value >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr_value}")
    if not 0.0 <= group["beta"] < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {group['beta']}")
    if not group["Lambda"] > 0.0:
        raise ValueError(f"Lambda must be > 0, got {group['Lambda']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
