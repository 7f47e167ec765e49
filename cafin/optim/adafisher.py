"""AdaFisher and AdaFisherW: Adam with the square-root second moment replaced by a diagonal
Kronecker-factored Fisher, F~ = S (x) H + Lambda (arXiv 2405.16397), with fused kernels.

Every persistent tensor lives in `self.state`: per parameter `step` and `exp_avg`; per supported
module, in the state of its first optimised parameter (its anchor), the factors `fisher_S`,
`fisher_H` (-1 until their first update) and the statistic accumulators `stat_S`, `stat_H`
(sums of raw statistics, their last entry counting contributions).

Curvature steps: statistics are taken on the forward/backward passes of the steps k with
k % TCov == 0 (k = completed optimizer steps). Hooks, the step counter and its host/device gating
are the family's core (`cafin.core`); this file holds AdaFisher's statistics kind, factor
average and update rule.
"""
from __future__ import annotations

import math
import operator
import warnings
from itertools import repeat
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..core import (
    CurvatureOptimizer, DropCounts, Hooks, Int, Layer, Real, average_over_ranks, check_int,
    check_range, checked_attribute, distributed, route, run_closure, to_device,
)
from ..core import amp
from ..core.route import Route
from ..layers import discover, supported_names
from ..core.distribution.sharding import is_sharded, local, module_class, rows
from ..maths import state_dtype
from ..ops import StatisticsWorkspaces
from ._docs import _backend_doc, _grad_scaler_doc, _optional_params_doc, _process_group_doc

_FACTOR_KEYS = ("fisher_S", "fisher_H", "stat_S", "stat_H")
_OP_SETTINGS = ("lr", "beta", "weight_decay", "Lambda")  # in the op's order
_grad_of = operator.attrgetter("grad")
# A group's step counts are rows of this many float32 (16 bytes): `_pack_step_counts`.
_COUNT_LANES = 4


class AdaFisher(CurvatureOptimizer):
    # name -> (low, high, low_open, high_open, dtype): lr in the parameters' op-math dtype (as
    # torch's fused optimizers keep it); the others in float64, the precision the published code
    # forms its coefficients in (from Python floats).
    hyperparameters = {
        "lr": (0.0, math.inf, False, True, None),
        "beta": (0.0, 1.0, False, True, torch.float64),
        "Lambda": (0.0, math.inf, True, True, torch.float64),
        "weight_decay": (0.0, math.inf, False, True, torch.float64),
    }
    checkpoint_settings = ("TCov", "gamma", "published_layers")
    # Checked whenever set: the factor average keeps 0.1*gamma of F, which grows without bound
    # past gamma = 10; TCov is a step interval.
    gamma = checked_attribute("gamma", Real(0.0, 10.0, low_open=True, tensor=False))
    TCov = checked_attribute("TCov", Int(1))
    finite_state = ("exp_avg", "fisher_S", "fisher_H", "stat_S", "stat_H")

    decoupled_weight_decay = False
    # The statistics kernels exit early on the device on passes that are not due, at no cost: a
    # compiled step decides on the device and stays one graph for every phase.
    _host_decides_compiled = False
    # torch.amp.GradScaler.step then hands over `grad_scale` and `found_inf` device tensors
    # instead of unscaling: the kernel unscales, and skips everything when found_inf is set.
    _step_supports_amp_scaling = True

    def __init__(self, model: nn.Module, lr: float | torch.Tensor = 1e-3, beta: float = 0.9,
                 Lambda: float = 1e-3, gamma: float = 0.8, TCov: int = 100,
                 weight_decay: float = 0.0, *, params: Iterable | None = None,
                 backend: str = "fused", statistics: str = "per_step", process_group=None,
                 grad_scaler: torch.amp.GradScaler | None = None, published_layers: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}; "
                            "cafin optimizers take the model first (parameters go in params=)")
        # the op module, one for every device and dtype (the ops take any floating dtype)
        chosen = Route(backend, "AdaFisher", "adafisher_step_")
        impl = chosen.ops()
        check_int(TCov, "TCov", 1)
        gamma = check_range(gamma, "gamma", 0.0, 10.0, low_open=True)
        if statistics not in ("per_step", "per_pass"):
            raise ValueError(f"statistics must be 'per_step' or 'per_pass', got {statistics!r}")
        if statistics == "per_pass" and grad_scaler is not None:
            raise ValueError("statistics='per_pass' folds statistics during backward, before a "
                             "GradScaler's overflow check: use statistics='per_step' with grad_scaler")
        if process_group is not None and not distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        if not isinstance(published_layers, bool):
            raise TypeError("published_layers must be a bool (True: only the published code's "
                            "Linear, Conv2d, BatchNorm2d and LayerNorm take curvature), got "
                            f"{type(published_layers).__name__} {published_layers!r}")
        self.published_layers = published_layers
        self.statistics = statistics
        self.grad_scaler = grad_scaler
        self.gamma = gamma
        self.TCov = TCov
        self.backend = backend
        self._impl = impl
        # The statistics ops, with kept CUDA workspaces when they are the fused ones.
        self._stats_impl = StatisticsWorkspaces(impl) if chosen.fused else impl
        self._skipped = DropCounts()  # factor updates dropped for NaN or inf
        self._owner: dict[torch.Tensor, tuple[Layer, int]] = {}
        self._no_curvature: dict[tuple, torch.Tensor] = {}
        defaults = dict(lr=lr, beta=beta, Lambda=Lambda, weight_decay=weight_decay, betas=(beta,))
        super().__init__(model, params, defaults, process_group)

    # ------------------------------------------------------------------ beta for LR schedulers
    # torch's OneCycleLR and CyclicLR cycle Adam's beta1, which they find as `betas` in an
    # optimizer's defaults. beta is AdaFisher's beta1 (the same first-moment decay), so every
    # group mirrors it as `betas = (beta,)`; a tuple a scheduler (or a user) writes there in its
    # place becomes beta at the next step.
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and "betas" in param_group:
            raise ValueError(f"{type(self).__name__} takes 'beta' (a param group's 'betas' only "
                             "mirrors it for LR schedulers)")
        super().add_param_group(param_group)
        self.param_groups[-1]["betas"] = _BetaMirror((self.param_groups[-1]["beta"],))

    def _take_scheduled_betas(self) -> None:
        for index, group in enumerate(self.param_groups):
            betas = group["betas"]
            if type(betas) is _BetaMirror:  # untouched: it follows beta (after the checks)
                continue
            if not isinstance(betas, (tuple, list)) or len(betas) != 1:
                raise ValueError(f"param group {index}: betas mirrors beta for LR schedulers and "
                                 f"must be a 1-tuple (beta,), got {betas!r}")
            if not route.compiled():
                try:
                    self._rules["beta"].check(betas[0], "betas[0] (beta)")
                except (TypeError, ValueError) as e:
                    raise type(e)(f"param group {index}: {e}") from None
            group["beta"] = betas[0]
            group["betas"] = _BetaMirror((betas[0],))

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        for group in sd["param_groups"]:  # a plain tuple: torch.load(weights_only=True) takes it
            group["betas"] = tuple(group["betas"])
        # A step count is a view into its group's counts (`_pack_step_counts`): saved as a tensor
        # of its own, so a checkpoint holds what torch.optim's do (and the saved entry is a new
        # dict: torch.optim's holds the live state's).
        sd["state"] = {index: {**entry, "step": entry["step"].clone()} if "step" in entry else entry
                       for index, entry in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["betas"] = _BetaMirror((group["beta"],))

    # ------------------------------------------------------------------ param groups and state
    def _attach(self) -> None:
        """Map parameters to modules (by identity, first supported module wins), create every
        state tensor eagerly (a compiled or captured step needs them to exist) and hook the
        modules that own optimised parameters."""
        # Discovery refuses unsupported layer options: before anything is changed.
        layers = discover(self.model, [p for g in self.param_groups for p in g["params"]],
                          published=self.published_layers)
        self.remove_hooks()
        kept = {id(layer.module): layer.anchor for layer in self._curvature}
        self._curvature = layers
        self._owner = {}
        for layer in self._curvature:
            layer.anchor = kept.get(id(layer.module), layer.anchor)  # its factors stay where they are
            offsets = layer.kind.h_offsets(layer.module)
            for pname, p in layer.params.items():
                self._owner[p] = (layer, offsets[pname], pname in layer.kind.transposed)
        if not self._curvature:
            warnings.warn(f"{type(self).__name__}: the model has no optimised parameter in a "
                          f"supported layer ({', '.join(supported_names(self.published_layers))}); "
                          "every parameter uses F~ = 1", UserWarning, stacklevel=3)
        for group in self.param_groups:
            for p in group["params"]:
                self._steps.tensor(p.device)
                self._skipped.counter(p.device)
                self._one(p.device, state_dtype(p.dtype))
                self._one(p.device, torch.float64)
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p.dtype),
                                                        memory_format=torch.contiguous_format)
        self._pack_step_counts()
        for layer in self._curvature:
            state = self.state[layer.anchor]
            if "fisher_S" not in state:
                state.update(self._new_factors(layer))
        self._hooks = Hooks(self, self._curvature)
        self._ranks_checked = False
        self._step_tensors: dict[int, _StepTensors] = {}  # rebuilt: layers or state may be new

    def _pack_step_counts(self) -> None:
        """Make the step counts of a group's parameters on one device views of one tensor of
        counts (their values kept), so that the usual step, where every parameter has a gradient,
        advances them with one add instead of one per parameter. Each parameter's `step` stays a
        0-dim float32 tensor of its own to every reader; a step where some parameters have no
        gradient advances the others' views one by one.

        The counts are rows of `_COUNT_LANES` float32 (16 bytes), each `step` the first lane of
        its row, so every count sits at a 16-byte aligned address like a tensor of its own:
        inductor's CUDA graphs take a mutated input in place only if it is static and aligned to
        16 bytes (an unaligned one is not static to them, and a compiled step that advances it
        runs without CUDA graphs). The other lanes are advanced with the row and never read."""
        for group in self.param_groups:
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in group["params"]:
                by_device.setdefault(p.device, []).append(p)
            for params in by_device.values():
                counts = torch.stack([self.state[p]["step"] for p in params])
                counts = counts.unsqueeze(1).repeat(1, _COUNT_LANES)
                for i, p in enumerate(params):
                    self.state[p]["step"] = counts[i, 0]

    def _copied_from(self, original: "AdaFisher") -> None:
        super()._copied_from(original)
        # A deep copy keeps the counts' shared memory but not their views: grouped again.
        self._pack_step_counts()
        self._step_tensors = {}

    def _expected_state(self, p: torch.Tensor) -> dict[str, tuple[tuple, torch.dtype]]:
        work = state_dtype(p.dtype)
        expected = {"step": ((), torch.float32), "exp_avg": (tuple(p.shape), work)}
        if any(p is layer.anchor for layer in self._curvature):
            expected.update({key: (tuple(v.shape), work) for key, v in self.state[p].items()
                             if key in _FACTOR_KEYS})
        return expected

    @staticmethod
    def _new_factors(record: Layer) -> dict[str, torch.Tensor]:
        s, h = record.kind.s_size(record.module), record.kind.h_size(record.module)
        like = dict(dtype=state_dtype(record.anchor.dtype), device=record.anchor.device)
        return {"fisher_S": torch.full((s,), -1.0, **like), "fisher_H": torch.full((h,), -1.0, **like),
                "stat_S": torch.zeros(s + 1, **like), "stat_H": torch.zeros(h + 1, **like)}

    @property
    def skipped_factor_updates(self) -> int:
        """Factor updates dropped because a statistic held NaN or inf (reads device counters)."""
        return self._skipped.total()

    # ------------------------------------------------------------------ statistics hooks
    # The three methods the core's hooks call (cafin.core.hooks.Hooks).
    def _graph_settings(self) -> tuple:
        return (("TCov", self.TCov),)

    def _statistics_gate(self, layer: Layer, device: torch.device):
        return self._steps.due(self.TCov, device)

    def take_input_statistics(self, layer: Layer, x: torch.Tensor, step) -> None:
        """Take the statistics of `layer` from its input; its hook calls this."""
        self._statistics(layer, x, step, layer.kind.input_stats, "H", grad_side=False)

    def take_grad_statistics(self, layer: Layer, grad: torch.Tensor, step) -> None:
        """Take the statistics of `layer` from its output gradient; its hook calls this."""
        self._statistics(layer, grad, step, layer.kind.grad_stats, "S", grad_side=True)

    def _statistics(self, layer: Layer, t: torch.Tensor, step, op, side: str, grad_side: bool) -> None:
        """Accumulate one side's raw statistic (in the factor's dtype); per pass, fold it now."""
        state = self.state[layer.anchor]
        stat = state["stat_" + side]
        if t.is_floating_point() and state_dtype(t.dtype) != stat.dtype:  # not an Embedding's indices
            t = t.to(stat.dtype)
        op(self._stats_impl, stat, layer.module, t, step, self.TCov)
        if self.statistics == "per_pass":
            self._fold_statistics([state["fisher_" + side]], [stat], [grad_side], None, None)

    # ------------------------------------------------------------------ step
    def _init_group(self, group, params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets):
        """Collect the tensors of a group's parameters that have gradients (torch.compile runs
        this eagerly and marks them static; an eager step where every parameter has a gradient
        takes `_usual_step` instead): the gradients at every step, the rest from the group's
        `_StepTensors` when kept."""
        kept = self._step_tensors_of(group)
        current = list(map(_grad_of, group["params"]))
        outputs = (params, exp_avgs, steps, fisher_S, fisher_H, h_offsets)
        entries = kept.entries if kept is not None else [self._step_entry(p) for p in group["params"]]
        for grad, entry in zip(current, entries):
            if grad is None:
                continue
            grad = local(grad)  # FSDP2: the kernels update the local shard
            grads.append(grad if grad.is_contiguous() else grad.contiguous())
            for lst, value in zip(outputs, entry):
                lst.append(value)
        return False

    def _step_entry(self, p: torch.Tensor) -> tuple:
        """What the step reads for parameter p besides its gradient: (p, exp_avg, step, S, H,
        h_offset), local shards for FSDP2 (views, so the DTensors see the writes)."""
        state = self.state[p]
        owner = self._owner.get(p)
        if owner is None:
            empty = self._empty(p)
            return local(p), local(state["exp_avg"]), state["step"], empty, empty, 0
        record, offset, transposed = owner
        anchor_state = self.state[record.anchor]
        # The update op computes F~[r, c] = first[r] * second[offset + c]: S then H, or, for a
        # parameter stored with its rows on the activation side, its rows of H then S (views:
        # the factors are updated in place, so kept entries stay current).
        first, second = anchor_state["fisher_S"], anchor_state["fisher_H"]
        if transposed:
            first, second = second[offset:offset + p.shape[0]], first
            offset = 0
        if is_sharded(p):  # a shard holds rows [start, stop) of F~: their rows of `first`
            start, stop = rows(p)
            first = first[start:stop]
            if start == stop:  # an empty shard: nothing to precondition
                first = second = self._empty(p)
        return local(p), local(state["exp_avg"]), state["step"], first, second, offset

    def _step_tensors_of(self, group) -> "_StepTensors | None":
        """The group's `_step_entry`s, kept from step to step. They change only with the group's
        parameter list (compared here, by identity) and in `_attach` (a new group, a checkpoint
        load), which drops them all. Not kept for sharded (FSDP2) parameters, whose local shards
        are taken at each step, nor while compiling."""
        if route.compiled():
            return None
        params = group["params"]
        kept = self._step_tensors.get(id(group))
        if (kept is not None and kept.group is group and len(kept.params) == len(params)
                and all(map(operator.is_, params, kept.params))):
            return kept
        if any(is_sharded(p) for p in params):
            self._step_tensors.pop(id(group), None)
            return None
        entries = [self._step_entry(p) for p in params]
        columns = [list(c) for c in zip(*entries)] or [[]] * 6
        kept = _StepTensors(group, list(params), entries, columns, _buckets(params),
                            _whole_counts(columns[2]))
        self._step_tensors[id(group)] = kept
        return kept

    def _usual_step(self, group) -> "tuple[_StepTensors, tuple[list, ...]] | None":
        """Eager, where every parameter of the group has a gradient (the usual step): its
        `_StepTensors` and the op's lists, which are its kept lists themselves (read only, not
        copied) with this step's gradients. None otherwise (then `_init_group` builds them)."""
        kept = self._step_tensors_of(group)
        if kept is None:
            return None
        grads = list(map(_grad_of, group["params"]))
        if not all(map(operator.is_not, grads, repeat(None))):
            return None
        if not all(map(torch.Tensor.is_contiguous, grads)):
            grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        params, exp_avgs, steps, fisher_S, fisher_H, h_offsets = kept.columns
        return kept, (params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets)

    def _bucket_settings(self, group, buckets: list, kept: "_StepTensors | None") -> list[tuple]:
        """Per bucket, (lr, beta, weight_decay, Lambda) as the op reads them. Kept with the
        group's `_StepTensors` while the group holds the same tensors (a schedule writes into
        them) and they need no conversion; a number is made a tensor at every step."""
        values = [group[name] for name in _OP_SETTINGS]
        if (kept is not None and kept.settings is not None
                and all(map(operator.is_, values, kept.settings[0]))):
            return kept.settings[1]
        settings = [tuple(self._hyperparameter(group, name, device, state_dtype(dtype))
                          for name in _OP_SETTINGS) for device, dtype, _ in buckets]
        if kept is not None and all(map(operator.is_, (t for ts in settings for t in ts),
                                        values * len(settings))):
            kept.settings = (values, settings)
        return settings

    def _empty(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.device, state_dtype(p.dtype))
        if key not in self._no_curvature:
            self._no_curvature[key] = torch.empty(0, dtype=key[1], device=key[0])
        return self._no_curvature[key]

    def _fold_statistics(self, factors, stats, grad_side, grad_scale, found_inf) -> None:
        """Fold the raw statistics into the factors (one op call for the device); a non-finite
        one is dropped and counted."""
        device = factors[0].device
        skipped = self._skipped.counter(device)
        gamma = self._as_tensor(self.gamma, device, torch.float64)
        self._impl.fisher_average_(factors, stats, skipped, gamma, grad_side,
                                   to_device(grad_scale, device), to_device(found_inf, device))
        # Non-finite statistics are dropped and counted on the device; where reading the count costs no
        # sync (CPU, eager) it also becomes a warning. On CUDA: `skipped_factor_updates`.
        self._skipped.report(lambda n: f"{type(self).__name__}: {n} curvature statistic(s) held NaN "
                             "or inf and were dropped; their factors keep their previous values",
                             stacklevel=3)

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
                grad_scale = amp.scale_for_statistics(self.grad_scaler, type(self).__name__,
                                                      "the gradient statistics")
            for factors, stats, grad_side in by_device.values():
                self._fold_statistics(factors, stats, grad_side, grad_scale, found_inf)
        if distributed():
            for factors, _, _ in by_device.values():
                average_over_ranks(factors, self.process_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimizer step; a closure is evaluated with grad enabled and its loss returned."""
        loss = None
        if closure is not None:
            # What the closure's passes add to (per pass, the factors too) is put back if it raises.
            keys = ("stat_S", "stat_H")
            if self.statistics == "per_pass":
                keys += ("fisher_S", "fisher_H")
            pass_state = [self.state[r.anchor][key] for r in self._curvature for key in keys]
            loss = run_closure(closure, pass_state + list(self._skipped.counts.values()))
        grad_scale, found_inf = amp.handed_over(self)
        if found_inf is not None and self.statistics == "per_pass":
            raise RuntimeError("a GradScaler steps this optimizer, but statistics='per_pass' has "
                               "already folded scaled gradient statistics into the factors: "
                               "use statistics='per_step' (the default) with a GradScaler")
        self._take_scheduled_betas()
        self._begin_step()  # checks everything before anything is written
        if not route.compiled():  # a compiled step would guard on the identity
            for group in self.param_groups:
                if group["betas"][0] is not group["beta"]:
                    group["betas"] = _BetaMirror((group["beta"],))
        groups = []
        for group in self.param_groups:
            usual = None if route.compiled() else self._usual_step(group)
            if usual is None:
                lists: tuple[list, ...] = ([], [], [], [], [], [], [])
                self._init_group(group, *lists)
                usual = (None, lists)
            groups.append((group, *usual))
        self._update_factors(grad_scale, found_inf)
        for group, kept, (params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets) in groups:
            if not params:
                continue
            counts = kept.counts if kept is not None else None
            if counts is not None:  # every step count of the group: one add per device
                for t in counts:
                    t.add_(self._steps.one(t.device))
            else:
                devices = [] if route.compiled() else self._steps.devices()
                if len(devices) == 1:  # eager, one device: the list of one tensor, made at once
                    # (the overload taking a single tensor copies it for every entry on the CPU)
                    torch._foreach_add_(steps, [self._steps.one(devices[0])] * len(steps))
                else:
                    torch._foreach_add_(steps, [self._steps.one(s.device) for s in steps])
            # The usual step: the group's kept buckets and settings.
            buckets = kept.buckets if kept is not None else _buckets(params)
            settings = self._bucket_settings(group, buckets, kept)
            for (device, dtype, idx), (lr, beta, weight_decay, damping) in zip(buckets, settings):
                pick = (lambda xs: xs) if idx is None else (lambda xs: [xs[i] for i in idx])
                self._impl.adafisher_step_(
                    pick(params), pick(grads), pick(exp_avgs), pick(steps), pick(fisher_S),
                    pick(fisher_H), pick(h_offsets), lr, beta, weight_decay, damping,
                    self.decoupled_weight_decay, to_device(grad_scale, device), to_device(found_inf, device))
            if found_inf is not None:  # a skipped step does not count, as in torch's fused Adam
                if counts is not None:
                    for t in counts:
                        t.sub_(to_device(found_inf, t.device))
                else:
                    torch._foreach_sub_(steps, [to_device(found_inf, s.device) for s in steps])
        self._steps.advance()
        return loss

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_state(self, saved_state, index_to_param, curvature):
        # Factors saved under the other layer set belong to other layers: refused by name
        # before the core's layout check. Where both sets give this model the same layers the
        # factors fit, and the core warns that the constructor's setting wins.
        saved = curvature.get("published_layers", False) if isinstance(curvature, dict) else False
        if saved != self.published_layers and curvature.get("layout") != self._layout():
            raise ValueError(
                f"checkpoint was saved with published_layers={saved}, this optimizer has "
                f"published_layers={self.published_layers}: the two layer sets give this model "
                "different curvature layers (True leaves an Embedding, Conv1d, Conv3d, "
                "transformers Conv1D or a registered layer type without curvature); build the "
                f"optimizer with published_layers={saved} to load it")
        return super()._checkpoint_state(saved_state, index_to_param, curvature)

    def _layout(self) -> list[list]:
        return [[r.name, module_class(r.module).__name__, r.kind.s_size(r.module), r.kind.h_size(r.module)]
                for r in self._curvature]

_ADAFISHER_ARGS = rf"""
    Args:
        model (nn.Module): the model, first as in the published code; its Linear, Conv1d,
            Conv2d, Conv3d, BatchNorm2d, LayerNorm and Embedding layers (and subclasses) and
            transformers' Conv1D are hooked for the curvature statistics (docs/adafisher.md).
            Other parameters use :math:`\tilde F = 1`. An Embedding with ``sparse=True`` is
            refused (ValueError).
        lr (float or Tensor, optional): learning rate :math:`\eta`, >= 0; per param group
            (default: 1e-3)
        beta (float, optional): first-moment decay :math:`\beta`, in [0, 1); per param group.
            Mirrored as ``betas = (beta,)`` in every group, so that OneCycleLR and CyclicLR,
            which cycle Adam's beta1 there, cycle it (default: 0.9)
        Lambda (float, optional): damping :math:`\Lambda` added to :math:`\tilde F`, > 0; per
            param group (default: 1e-3)
        gamma (float, optional): factor averaging, :math:`F \leftarrow 0.1\gamma F +
            0.01\gamma \hat z` (as published), in (0, 10] (default: 0.8)
        TCov (int, optional): statistics are taken every TCov steps, on the passes of the
            steps k with k % TCov == 0 (default: 100)
        weight_decay (float, optional): weight decay :math:`\lambda`, >= 0; per param group
            (default: 0)
        {_optional_params_doc}
            (default: the model's trainable parameters); keyword only
        {_backend_doc}
            "reference" computes the way the published code does.
        statistics (str, optional): "per_step": every forward/backward pass of a curvature
            step adds to the statistics and the step folds their mean into the factors once,
            so k micro-batches of gradient accumulation update the factors once; "per_pass":
            each pass updates the factors right away, as the published code does (then the
            factors change before the step can see a GradScaler's overflow: not usable with
            one) (default: "per_step")
        {_process_group_doc}
            The factors are averaged once per curvature update, in one collective.
        {_grad_scaler_doc}
        published_layers (bool, optional): True restricts the curvature to the published
            code's layer set, Linear, Conv2d, BatchNorm2d and LayerNorm (and subclasses), for
            its numbers on models with other layers: an Embedding's weight (tied to a decoder
            or not), Conv1d, Conv3d and transformers' Conv1D then use :math:`\tilde F = 1`, as
            there; a parameter held by several modules takes curvature only from the first, so
            a decoder tied to an Embedding gets none, as there. Checkpoints record it; one whose
            layers differ is refused under the other setting; keyword only (default: False:
            every layer above takes curvature)

    lr, beta, Lambda and weight_decay are kept as 0-dim tensors on the parameters' device, so
    schedulers update them in place (or assign numbers) and a compiled step does not recompile.
    Speed and convergence: docs/adafisher.md.
    """

AdaFisher.__doc__ = (
    r"""AdaFisher: Adam with its second moment replaced by a diagonal Kronecker-factored Fisher.

    Coupled L2 weight decay. Per parameter, with :math:`\tilde F` the diagonal Kronecker-factored
    Fisher of its layer (arXiv 2405.16397), :math:`S` and :math:`H` averaged every TCov steps:

    .. math::
        \tilde F = S \otimes H + \Lambda, \qquad
        g' = g + \lambda \theta, \qquad
        m \leftarrow \beta m + (1 - \beta) g', \qquad
        \theta \leftarrow \theta - \frac{\eta}{1 - \beta^t} \, \frac{m}{\tilde F}
    """
    + _ADAFISHER_ARGS
)


class _StepTensors:
    """A group's `_step_entry`s, its buckets and its settings as the op reads them, kept while
    its parameter list stays the same objects."""
    __slots__ = ("group", "params", "entries", "columns", "buckets", "counts", "settings")

    def __init__(self, group: dict, params: list, entries: list, columns: list, buckets: list,
                 counts: list | None):
        self.group, self.params = group, params
        self.entries = entries  # per parameter
        self.columns = columns  # per kind: the parameters, exp_avgs, steps, fisher_S, fisher_H, h_offsets
        self.buckets = buckets  # `_buckets(params)`
        self.counts = counts  # `_whole_counts` of the steps
        self.settings = None  # (the group's values, per bucket the op's tensors), once resolved


def _whole_counts(steps: list) -> list | None:
    """The tensors of counts that `steps` are views of, when the views cover each of them
    exactly once, one per row (as `_pack_step_counts` makes them): adding to those advances
    exactly these steps. None otherwise (a parameter dropped from the group, a count replaced)."""
    counts: dict[int, tuple[torch.Tensor, set]] = {}
    for t in steps:
        base = t._base
        if (base is None or t.dim() != 0 or base.dim() != 2 or base.shape[1] != _COUNT_LANES
                or not base.is_contiguous()):
            return None
        row, lane = divmod(t.storage_offset() - base.storage_offset(), _COUNT_LANES)
        if lane != 0:
            return None
        counts.setdefault(id(base), (base, set()))[1].add(row)
    if sum(base.shape[0] for base, _ in counts.values()) != len(steps):
        return None
    if any(rows_ != set(range(base.shape[0])) for base, rows_ in counts.values()):
        return None
    return [base for base, _ in counts.values()]


def _buckets(params: list) -> list[tuple]:
    """(device, dtype, indices) of the parameters of each device and dtype, in first-seen order;
    indices None when one bucket holds them all."""
    buckets: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault((p.device, p.dtype), []).append(i)
    if len(buckets) == 1:
        return [(*key, None) for key in buckets]
    return [(*key, idx) for key, idx in buckets.items()]


class _BetaMirror(tuple):
    """A group's `betas` as AdaFisher wrote it (a scheduler writes a plain tuple)."""


class AdaFisherW(AdaFisher):
    decoupled_weight_decay = True


AdaFisherW.__doc__ = (
    r"""AdaFisherW: AdaFisher with decoupled weight decay.

    The same arguments as :class:`AdaFisher`; the weight decay is applied to the weights, not
    added to the gradient:

    .. math::
        \tilde F = S \otimes H + \Lambda, \qquad
        m \leftarrow \beta m + (1 - \beta) g, \qquad
        \theta \leftarrow \theta - \eta \left( \frac{m}{(1 - \beta^t) \tilde F} + \lambda \theta \right)
    """
    + _ADAFISHER_ARGS
)
