"""The two bases of the members that are torch optimizers: `CoreOptimizer` (validated param
groups, checked steps, copies, validated checkpoints; model or not) and `CurvatureOptimizer`
(the model, its layers, the step counter and the hooks, on top)."""
from __future__ import annotations

import copy
import functools
import math
import operator
import warnings
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .distribution.sharding import check_sharded
from . import route
from .checks import Pair, as_rule, check_gradient, checkpoint_tensor
from .distribution.collectives import distributed
from .copies import HookOwner, copy_member
from .discovery import Layer
from .hooks import Hooks
from .runtime import unwrap
from .steps import Captured, StepCounter

_FLOAT_PARAMS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _Called:
    """Whether a step has run, for the LR scheduler's call-order warning: a holder, because a store
    into it from a compiled step is kept (one into the optimizer itself is not)."""
    value = False


def _version_of(value: Any) -> int | tuple | None:
    """The version counter of a tensor hyperparameter (a tuple of them for a tuple of tensors):
    what a write in place changes. None for anything else (numbers are checked every step)."""
    if isinstance(value, torch.Tensor):
        return None if value.is_inference() else value._version
    if isinstance(value, tuple) and all(isinstance(t, torch.Tensor) and not t.is_inference()
                                        for t in value):
        return tuple(t._version for t in value)
    return None


# ------------------------------------------------------------------------------ the optimizer base
class CoreOptimizer(Captured, torch.optim.Optimizer):
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
        # id(group) -> (group, values, versions) of the hyperparameters that passed `_check_group`
        self._live_checked: dict[int, tuple] = {}
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

    @staticmethod
    def profile_hook_step(func):
        """torch.optim's wrapper of `step` (the profiler's "Optimizer.step#..." range, the step
        pre and post hooks), entered when anything would see it: a profiler, a hook, or a
        compile (which traces it as torch's own optimizers are traced). Otherwise the step runs
        directly: opening the range costs an op call and a scripted object per step, as much
        as a fifth of an eager AdaFisher step's Python side on ResNet-18."""
        hooked = torch.optim.Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            self = args[0]
            if (route.compiled() or torch._C._autograd._profiler_enabled()
                    or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                    or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
                return hooked(*args, **kwargs)
            return func(*args, **kwargs)
        return wrapper

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
        new = copy_member(self, memo, self._not_copied)
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
        since the group was added. A hyperparameter tensor that passed is not read again until
        it changes (another object, or a write bumped its version counter). The gradients are
        compared with their parameters at every step, in one pass over the group: a test of
        whether kept gradients changed would cost as much (`.data =`, as `model.to(...)` uses,
        and `resize_` leave no counter to watch)."""
        self._check_hyperparameters(index, group)
        self._check_gradients(index, group["params"])

    def _check_gradients(self, index: int, params: list) -> list:
        """Every gradient dense and of its parameter's dtype, shape and device, every parameter
        with a gradient contiguous (when the kernels need it). Returns the gradients."""
        owner, contiguous = type(self).__name__, self.contiguous_params
        grads = []
        for p in params:
            grad = p.grad
            grads.append(grad)
            if grad is None:
                continue
            # One test for the usual case; the message (and its shape string) only for a bad one.
            # dtypes are singletons; on a CPU `is_cpu` is the device test without building the
            # two torch.device objects (a third of the loop's time on ResNet-18's 62 tensors).
            if (grad.shape == p.shape and grad.dtype is p.dtype
                    and (grad.is_cpu if p.is_cpu else grad.device == p.device)
                    and not grad.is_sparse and (not contiguous or p.is_contiguous())):
                continue
            where = f"param group {index}, parameter of shape {tuple(p.shape)}"
            check_gradient(p, owner, where)
            raise ValueError(f"{where} is not contiguous (e.g. the model was moved to "
                             "channels_last after the optimizer was built); cafin needs "
                             "contiguous parameters")
        return grads

    def _check_hyperparameters(self, index: int, group: dict[str, Any]) -> None:
        """A group's hyperparameters by their rules. Eager, tensors that passed are skipped while
        they are the same objects at the same versions; numbers are checked every time."""
        rules = self._rules
        values = [group[name] for name in rules]
        eager = not route.compiled()
        versions = [_version_of(value) for value in values] if eager else [None] * len(values)
        seen = self._live_checked.get(id(group)) if eager else None
        if seen is not None and seen[0] is not group:  # another group at a reused address
            seen = None
        if (seen is not None and None not in versions and versions == seen[2]
                and all(map(operator.is_, values, seen[1]))):
            return
        for i, ((name, rule), value, version) in enumerate(zip(rules.items(), values, versions)):
            if (seen is not None and version is not None and value is seen[1][i]
                    and version == seen[2][i]):
                continue
            try:
                rule.check_live(value, name)
            except (TypeError, ValueError) as e:
                raise type(e)(f"param group {index}: {e}") from None
        if eager:
            self._live_checked[id(group)] = (group, values, versions)

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
            if not route.compiled():
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
                raise ValueError(f"not a checkpoint of {type(self).__name__}: missing '{key}'")
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
            value = checkpoint_tensor(value, f"checkpoint {key} of parameter {index}", shape,
                                      dtype=dtype, device=p.device, finite=key in self.finite_state)
            if key == "step" and not (math.isfinite(float(value)) and float(value) >= 0):
                raise ValueError(f"checkpoint step of parameter {index} must be >= 0, "
                                 f"got {float(value)}")
            entry[key] = value
        return entry

    def _loaded(self, record: Any) -> None:
        """After a checkpoint replaced the state and the groups' settings."""


class CurvatureOptimizer(HookOwner, CoreOptimizer):
    """What every hook-based member that is a torch optimizer shares, beyond `CoreOptimizer`:
    the model, its supported layers, a step counter, hooks held weakly, the layout that
    checkpoints and ranks compare.

    A member sets `hyperparameters`, `checkpoint_settings` (constructor arguments that
    checkpoints record) and implements `_attach()` (discover layers, create every state tensor,
    install `Hooks`), `_layout()`, `_expected_state(p)` and the three hook callbacks."""

    checkpoint_settings: tuple[str, ...] = ()
    _not_copied = ("_hooks",)
    _group_records = ("curvature",)
    # Whether a compiled step decides from the host count (a graph per phase, no curvature work on
    # the others) or, as a captured one, on the device (one graph): core.steps.StepCounter.
    _host_decides_compiled = True

    def __init__(self, model: nn.Module, params, defaults: dict[str, Any], process_group=None):
        if process_group is not None and not distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        self.model = unwrap(model)
        self.process_group = process_group
        self._steps = StepCounter(self._host_decides_compiled)
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
        if not self._ranks_checked and not route.compiled() and distributed():
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
        # `curvature` sits in every saved group (torch.distributed.checkpoint keeps only `state`
        # and `param_groups`); a checkpoint may also hold it beside them.
        if "curvature" in state_dict:
            return state_dict["curvature"]
        if saved_groups and isinstance(saved_groups[0], dict) and "curvature" in saved_groups[0]:
            return saved_groups[0]["curvature"]
        raise ValueError(f"not a checkpoint of {type(self).__name__}: missing 'curvature'")

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
