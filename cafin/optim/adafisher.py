"""AdaFisher and AdaFisherW: Adam with the square-root second moment replaced by a diagonal
Kronecker-factored Fisher, F~ = S (x) H + Lambda (arXiv 2405.16397), with fused kernels.

Every persistent tensor lives in `self.state`: per parameter `step` and `exp_avg`; per supported
module, in the state of its first optimised parameter (its anchor), the factors `fisher_S`,
`fisher_H` (-1 until their first update) and the statistic accumulators `stat_S`, `stat_H`
(sums of raw statistics, their last entry counting contributions).

Curvature steps: statistics are taken on the forward/backward passes of the steps k with
k % TCov == 0 (k = completed optimizer steps). Hooks, the step counter and its host/device gating
are the family's core (`cafin.curvature`); this file holds AdaFisher's statistics kind, factor
average and update rule.
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .. import ops, reference
from ..curvature import (
    Hooks, Layer, StepCounter, average_over_ranks, check_hyperparameter, check_int, check_range,
    discover, distributed, hyperparameter_tensor, on, unwrap,
)
from ..layers import supported_types
from ..reference import state_dtype

_BACKENDS = {"fused": ops, "reference": reference}
_FACTOR_KEYS = ("fisher_S", "fisher_H", "stat_S", "stat_H")


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
        check_int(TCov, "TCov", 1)
        gamma = check_range(gamma, "gamma", 0.0, 10.0, low_open=True)
        if statistics not in ("per_step", "per_pass"):
            raise ValueError(f"statistics must be 'per_step' or 'per_pass', got {statistics!r}")
        if statistics == "per_pass" and grad_scaler is not None:
            raise ValueError("statistics='per_pass' folds statistics during backward, before a "
                             "GradScaler's overflow check: use statistics='per_step' with grad_scaler")
        if process_group is not None and not distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        model = unwrap(model)
        self.model = model
        self.statistics = statistics
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        self.gamma = float(gamma)
        self.TCov = TCov
        self.backend = backend
        self._impl = _BACKENDS[backend]
        self._opt_called = False  # see `step._wrapped_by_lr_sched` below
        self._steps = StepCounter()
        self._skipped: dict[torch.device, torch.Tensor] = {}  # factor updates dropped for NaN
        self._curvature: list[Layer] = []
        self._owner: dict[torch.Tensor, tuple[Layer, int]] = {}
        self._hooks: Hooks | None = None
        self._no_curvature: dict[tuple, torch.Tensor] = {}
        self._ones: dict[tuple, torch.Tensor] = {}
        self._attached = False
        defaults = dict(lr=lr, beta=beta, Lambda=Lambda, weight_decay=weight_decay)
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        self._attach()
        if distributed():
            self._check_ranks_agree()

    # ------------------------------------------------------------------ param groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its parameters may belong to layers added to the model after
        construction (they get curvature). A rejected group leaves nothing behind."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a param group holds the same parameter twice")
        model_params = {id(p) for p in self.model.parameters()}
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params must hold Tensors, got {type(p).__name__}")
            if id(p) not in model_params:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} in params is not a "
                                 "parameter of the model")
            if p.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
                raise TypeError(f"parameter of shape {tuple(p.shape)} has dtype {p.dtype}; "
                                "cafin supports float32, float64, bfloat16 and float16")
            if not p.is_contiguous():
                raise ValueError(f"parameter of shape {tuple(p.shape)} is not contiguous "
                                 "(e.g. channels_last); cafin needs contiguous parameters")
        for name in _HYPERPARAMETERS:
            check_hyperparameter(param_group.get(name, self.defaults.get(name)), name,
                                 *_HYPERPARAMETERS[name])
        before = len(self.param_groups)
        try:
            super().add_param_group(param_group)
            group = self.param_groups[-1]
            # Tensors end to end: schedules change them in place (fill_) or assign numbers,
            # and a compiled step sees new values, not new constants.
            for name in _HYPERPARAMETERS:
                group[name] = hyperparameter_tensor(group[name], group["params"])
            if getattr(self, "_attached", False):  # a group added after construction
                self._attach()
        except BaseException:
            del self.param_groups[before:]
            for p in params:
                if not any(p is q for g in self.param_groups for q in g["params"]):
                    self.state.pop(p, None)
            if getattr(self, "_attached", False):
                self._attach()
            raise

    def _attach(self) -> None:
        """Map parameters to modules (by identity, first supported module wins), create every
        state tensor eagerly (a compiled or captured step needs them to exist) and hook the
        modules that own optimised parameters."""
        self.remove_hooks()
        self._attached = True
        kept = {id(layer.module): layer.anchor for layer in self._curvature}
        self._curvature = discover(self.model, [p for g in self.param_groups for p in g["params"]])
        self._owner = {}
        for layer in self._curvature:
            layer.anchor = kept.get(id(layer.module), layer.anchor)  # its factors stay where they are
            offsets = layer.kind.h_offsets(layer.module)
            for pname, p in layer.params.items():
                self._owner[p] = (layer, offsets[pname])
        if not self._curvature:
            warnings.warn(f"{type(self).__name__}: the model has no optimised parameter in a "
                          f"supported layer ({', '.join(t.__name__ for t in supported_types())}); "
                          "every parameter uses F~ = 1", UserWarning, stacklevel=3)
        for group in self.param_groups:
            for p in group["params"]:
                self._steps.tensor(p.device)
                self._skipped_counter(p.device)
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p.dtype),
                                                        memory_format=torch.contiguous_format)
        for layer in self._curvature:
            state = self.state[layer.anchor]
            if "fisher_S" not in state:
                state.update(self._new_factors(layer))
        self._hooks = Hooks(self, self._curvature)
        self._ranks_checked = False

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

    @staticmethod
    def _new_factors(record: Layer) -> dict[str, torch.Tensor]:
        s, h = record.kind.s_size(record.module), record.kind.h_size(record.module)
        like = dict(dtype=state_dtype(record.anchor.dtype), device=record.anchor.device)
        return {"fisher_S": torch.full((s,), -1.0, **like), "fisher_H": torch.full((h,), -1.0, **like),
                "stat_S": torch.zeros(s + 1, **like), "stat_H": torch.zeros(h + 1, **like)}

    def _skipped_counter(self, device: torch.device) -> torch.Tensor:
        if device not in self._skipped:
            self._skipped[device] = torch.zeros((), device=device)
            torch._dynamo.mark_static_address(self._skipped[device], guard=False)
        return self._skipped[device]

    def remove_hooks(self) -> None:
        """Remove the statistics hooks from the model (the optimizer then keeps its factors)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    @property
    def skipped_factor_updates(self) -> int:
        """Factor updates dropped because a statistic held NaN (reads device counters)."""
        return int(sum(c.item() for c in self._skipped.values()))

    # ------------------------------------------------------------------ statistics hooks
    # The three methods the core's hooks call (cafin.curvature.Hooks).
    def _statistics_gate(self, layer: Layer, device: torch.device):
        return self._steps.due(self.TCov, device)

    def _input_statistics(self, layer: Layer, x: torch.Tensor, step) -> None:
        state = self.state[layer.anchor]
        stat = state["stat_H"]
        if state_dtype(x.dtype) != stat.dtype:
            x = x.to(stat.dtype)
        layer.kind.input_stats(self._impl, stat, layer.module, x, step, self.TCov)
        if self.statistics == "per_pass":
            self._fold([state["fisher_H"]], [stat], [False], None, None)

    def _grad_statistics(self, layer: Layer, grad: torch.Tensor, step) -> None:
        state = self.state[layer.anchor]
        stat = state["stat_S"]
        if state_dtype(grad.dtype) != stat.dtype:
            grad = grad.to(stat.dtype)
        layer.kind.grad_stats(self._impl, stat, layer.module, grad, step, self.TCov)
        if self.statistics == "per_pass":
            self._fold([state["fisher_S"]], [stat], [True], None, None)

    def __deepcopy__(self, memo):
        """A copy optimises a copy of the model, with hooks of its own."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key != "_hooks":
                setattr(new, key, copy.deepcopy(value, memo))
        new._hooks = Hooks(new, new._curvature) if self._hooks is not None else None
        return new

    # ------------------------------------------------------------------ step
    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        """Everything the kernels would reject, checked before the step writes anything.
        Hyperparameter values are read only where that costs no sync (numbers, CPU tensors) and
        not while compiling (the values are symbolic there)."""
        for name, rule in _HYPERPARAMETERS.items():
            value = group[name]
            if isinstance(value, torch.Tensor):
                if value.dim() != 0 or not value.is_floating_point():
                    raise ValueError(f"param group {index}: {name} must be a number or a 0-dim "
                                     f"float tensor, got a {value.dtype} tensor of shape "
                                     f"{tuple(value.shape)}")
                if value.device.type != "cpu" or torch.compiler.is_compiling():
                    continue
            elif torch.compiler.is_compiling():
                continue
            try:
                check_hyperparameter(value, name, *rule)
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
            if not p.is_contiguous():
                raise ValueError(f"{where} is not contiguous (e.g. the model was moved to "
                                 "channels_last after the optimizer was built); cafin needs "
                                 "contiguous parameters")

    def _init_group(self, group, params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets):
        """Collect one group's tensors (torch.compile runs this eagerly and marks them static)."""
        for p in group["params"]:
            if p.grad is None:
                continue
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

    def _hyperparameter(self, value, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A group's hyperparameter as the 0-dim tensor the op reads. A number that a schedule
        assigned is multiplied into a cached one, not wrapped with torch.tensor: under compile
        the number becomes symbolic after its first change, and this stays one graph."""
        if isinstance(value, torch.Tensor):
            return value if value.device == device and value.dtype == dtype else value.to(device, dtype)
        key = (device, dtype)
        if key not in self._ones:
            self._ones[key] = torch.ones((), device=device, dtype=dtype)
            torch._dynamo.mark_static_address(self._ones[key], guard=False)
        return self._ones[key] * value

    def _empty(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.device, state_dtype(p.dtype))
        if key not in self._no_curvature:
            self._no_curvature[key] = torch.empty(0, dtype=key[1], device=key[0])
        return self._no_curvature[key]

    def _fold(self, factors, stats, grad_side, grad_scale, found_inf) -> None:
        device = factors[0].device
        self._impl.fisher_average_(factors, stats, self._skipped_counter(device), self.gamma,
                                   grad_side, on(grad_scale, device), on(found_inf, device))

    def _update_factors(self, grad_scale, found_inf) -> None:
        """On a step after statistics were taken: fold them into the factors (one call per
        device over every factor) and, distributed, average the factors over the ranks. After a
        compile or a capture the host cannot tell, so this runs every step and the kernels
        decide (a factor without new statistics is left as it is)."""
        if not self._curvature:
            return
        # On the host: whether this step is a curvature step (the same on every rank, so either
        # all ranks average or none does, whatever their hooks saw).
        if self._steps.host_due(self.TCov) is False:
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
        if distributed():
            for factors, _, _ in by_device.values():
                average_over_ranks(factors, self.process_group)

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
        self._opt_called = True  # for the LR scheduler's call-order warning
        # Check every group before anything is written: a rejected step leaves no trace.
        for index, group in enumerate(self.param_groups):
            self._check_group(index, group)
        if not self._ranks_checked and not torch.compiler.is_compiling() and distributed():
            self._check_ranks_agree()
        groups = []
        for group in self.param_groups:
            lists: tuple[list, ...] = ([], [], [], [], [], [], [])
            self._init_group(group, *lists)
            groups.append((group, lists))
        self._update_factors(grad_scale, found_inf)
        for group, (params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets) in groups:
            if not params:
                continue
            torch._foreach_add_(steps, [self._steps.one(s.device) for s in steps])
            buckets: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                buckets.setdefault((p.device, p.dtype), []).append(i)
            for (device, dtype), idx in buckets.items():
                work = state_dtype(dtype)
                lr, beta, weight_decay, damping = (
                    self._hyperparameter(group[name], device, work)
                    for name in ("lr", "beta", "weight_decay", "Lambda"))
                pick = (lambda xs: xs) if len(idx) == len(params) else (lambda xs: [xs[i] for i in idx])
                self._impl.adafisher_step_(
                    pick(params), pick(grads), pick(exp_avgs), pick(steps), pick(fisher_S),
                    pick(fisher_H), pick(h_offsets), lr, beta, weight_decay, damping,
                    self.decoupled_weight_decay, on(grad_scale, device), on(found_inf, device))
            if found_inf is not None:  # a skipped step does not count, as in torch's fused Adam
                torch._foreach_sub_(steps, [on(found_inf, s.device) for s in steps])
        self._steps.advance()
        return loss

    # LR schedulers wrap `opt.step` in a function that torch.compile refuses to trace
    # (lr_scheduler.py is skipped by Dynamo), which would break `torch.compile(opt.step,
    # fullgraph=True)`. This marks the step as already wrapped; the step itself sets
    # `_opt_called`, which the wrapper would record for the scheduler's call-order warning.
    step._wrapped_by_lr_sched = True

    # ------------------------------------------------------------------ checkpoints
    def _layout(self) -> list[list]:
        return [[r.name, type(r.module).__name__, r.kind.s_size(r.module), r.kind.h_size(r.module)]
                for r in self._curvature]

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["curvature"] = {"k": self._steps.value(), "layout": self._layout(), "TCov": self.TCov, "gamma": self.gamma}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this optimizer on this model. Everything is validated before
        anything is replaced (a rejected checkpoint leaves the optimizer as it was); every tensor
        is copied onto its parameter's device and `state_dict` is left unchanged. Local: no
        collective runs here (ranks are compared at the next step)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        for key in ("state", "param_groups", "curvature"):
            if key not in state_dict:
                raise ValueError(f"not a {type(self).__name__} checkpoint: missing '{key}'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(saved_groups)} param groups, this optimizer "
                             f"has {len(self.param_groups)}")
        index_to_param = {}
        new_groups = []
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(f"checkpoint group {i} has {len(saved.get('params', ()))} "
                                 f"parameters, this optimizer's has {len(group['params'])}")
            index_to_param.update(zip(saved["params"], group["params"]))
            values = {}
            for name, rule in _HYPERPARAMETERS.items():
                if name not in saved:
                    raise ValueError(f"checkpoint group {i} has no {name}")
                try:
                    check_hyperparameter(saved[name], name, *rule)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"checkpoint group {i}: {e}") from None
                values[name] = hyperparameter_tensor(saved[name], group["params"])
            for key, value in saved.items():
                if key != "params" and key not in values:
                    values[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
            new_groups.append(values)
        curvature = state_dict["curvature"]
        k = curvature.get("k") if isinstance(curvature, dict) else None
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"checkpoint curvature['k'] (completed steps) must be an int >= 0, "
                             f"got {k!r}")
        layout = curvature.get("layout")
        if layout != self._layout():
            raise ValueError("checkpoint was saved for a different model: its curvature layers "
                             f"{layout} do not match this model's {self._layout()}")
        anchors = {layer.anchor for layer in self._curvature}
        new_state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for index, saved in state_dict["state"].items():
            if index not in index_to_param:
                raise ValueError(f"checkpoint has state for parameter {index}, which this "
                                 "optimizer does not have")
            p = index_to_param[index]
            expected = {"step": (), "exp_avg": tuple(p.shape)}
            if p in anchors:
                expected.update({key: tuple(v.shape) for key, v in self.state[p].items()
                                 if key in _FACTOR_KEYS})
            if set(saved) != set(expected):
                raise ValueError(f"checkpoint state of parameter {index} has keys {sorted(saved)}, "
                                 f"expected {sorted(expected)}")
            work = state_dtype(p.dtype)
            entry = {}
            for key, shape in expected.items():
                value = saved[key]
                if key == "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    value = torch.tensor(float(value))  # torch.optim style: a Python number
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    raise TypeError(f"checkpoint {key} of parameter {index} must be a real "
                                    f"floating tensor, got {getattr(value, 'dtype', type(value).__name__)}")
                if tuple(value.shape) != shape:
                    raise ValueError(f"checkpoint {key} of parameter {index} has shape "
                                     f"{tuple(value.shape)}, expected {shape}")
                if key == "step" and not (math.isfinite(float(value)) and float(value) >= 0):
                    raise ValueError(f"checkpoint step of parameter {index} must be >= 0, "
                                     f"got {float(value)}")
                if key in _FACTOR_KEYS and not torch.isfinite(value).all():
                    raise ValueError(f"checkpoint {key} of parameter {index} holds non-finite values")
                entry[key] = value.detach().to(
                    device=p.device, dtype=torch.float32 if key == "step" else work, copy=True)
            new_state[p] = entry
        missing = [layer.name for layer in self._curvature if layer.anchor not in new_state]
        if missing:
            raise ValueError(f"checkpoint has no factors for the layers {missing}")
        for name in ("TCov", "gamma"):
            saved = curvature.get(name)
            if saved is not None and saved != getattr(self, name):
                warnings.warn(f"checkpoint was saved with {name}={saved}; this optimizer keeps "
                              f"its own {name}={getattr(self, name)} (the constructor's wins)",
                              UserWarning, stacklevel=2)
        # Everything checked: now replace.
        self.state.clear()
        self.state.update(new_state)
        for values, group in zip(new_groups, self.param_groups):
            group.update(values)
        self._steps.load(k)
        self._attach()  # state for parameters the checkpoint had none for


class AdaFisherW(AdaFisher):
    """AdaFisherW: decoupled weight decay, m <- beta*m + (1-beta)*g,
    theta <- theta - lr*(m/((1-beta^t)*F~) + wd*theta). Same arguments as AdaFisher."""

    decoupled_weight_decay = True


# name -> (low, high, low_open, high_open): the range a group's value must lie in.
_HYPERPARAMETERS = {
    "lr": (0.0, math.inf, False, True),
    "beta": (0.0, 1.0, False, True),
    "Lambda": (0.0, math.inf, True, True),
    "weight_decay": (0.0, math.inf, False, True),
}
