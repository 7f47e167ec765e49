"""SINGD / IKFAC / INGD: structured inverse-free natural gradient (arXiv 2312.05705), a drop-in for
singd 0.0.5's `singd.optim.optimizer.SINGD` (same constructor names, defaults and numbers).

Per layer (Linear, Conv1d/2d/3d, transformers' Conv1D, Embedding with a diagonal K over its
vocabulary), factors K (d_K x d_K) and C (d_C x d_C) track K K^T ~ (A + lambda)^-1 and
C C^T ~ (G + lambda)^-1 by matrix products only: every T steps
    m_K <- s*(c_g tr(H_C)/d_C H_K + lambda tr(C^T C)/d_C Pi(K^T K) - I) + alpha1 m_K,   K <- K - beta1 K m_K
(and the same for C with the roles swapped), with H_K = Pi(K^T a^T a K), H_C = Pi(C^T g^T g C)
from the inputs and output gradients of that step's passes; every step the natural gradient
C C^T [grad W | grad b] K K^T drives SGD with momentum. kfac_like=True is IKFAC.

Every persistent tensor lives in `self.state`: per parameter `momentum_buffer`; per layer, in the
state of its first optimised parameter, the parts of K, C (`K.<part>`), their momenta m_K, m_C
(alpha1 != 0), the curvature accumulators H_K, H_C and `H_count` (passes added). A due update
whose accumulated H_K or H_C holds a NaN or inf is dropped (the layer keeps its factors, the
accumulators are reset) and counted on the device: `skipped_factor_updates`. Param groups,
tensor hyperparameters, hooks, the step counter and its host/device gating, copies and checkpoints
come from the family's core (`cafin.core.optimizer.CurvatureOptimizer`); this file holds SINGD's
settings, statistics and update rule.
"""
from __future__ import annotations

import math
import operator
import warnings
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch import Tensor, nn

from ...core.modules import is_transposed_linear
from ...core import (Choice, CurvatureOptimizer, DropCounts, Flag, Hooks, Layer, average_over_ranks,
                         capturing, check_int, check_range, discover, distributed, hyperparameter_tensor,
                         real_number, unwrap)
from ...maths import singd as singd_maths
from ... import ops
from ..kaisa import greedy_assignment
from ...sharding import (gather_to_owners, is_sharded, local, module_class, own_rows, rows,
                        scatter_from_owners, shard_dim)
from .structures import STRUCTURES, Dense, Diagonal, Structure, structure
from .._docs import _backend_doc, _grad_scaler_doc, _optional_params_doc, _process_group_doc

_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
_LOSS_AVERAGES = (None, "batch", "batch+sequence")
# Rules of the settings the statistics hooks read, shared by the constructor's, a checkpoint's and
# the forward pass's checks.
_LOSS_AVERAGE = Choice(*_LOSS_AVERAGES)
_KFAC_APPROX = Choice("expand", "reduce")
_FLAG = Flag()


# Every group entry `_check_settings` and `_check_built` read.
_SETTINGS = ("alpha1", "lr_cov", "T", "kfac_like", "normalize_lr_cov", "exact_block_transposes",
             "loss_average", "kfac_approx", "structures", "preconditioner_dtype")


def _check_statistics_choices(group: dict[str, Any], where: str) -> None:
    _LOSS_AVERAGE.check(group["loss_average"], f"{where}loss_average")
    _KFAC_APPROX.check(group["kfac_approx"], f"{where}kfac_approx")
_BACKENDS = ("fused", "reference")
_FACTORS = ("K", "C", "m_K", "m_C", "H_K", "H_C")
_MAX_PARTS = 5  # the most parts a structure has (hierarchical)


def _supports(module: nn.Module) -> bool:
    return isinstance(module, _SUPPORTED) or is_transposed_linear(module)


def _check_options(layer: Layer) -> None:
    """Refuse layer options whose gradient is not the outer product the factors model."""
    module = layer.module
    if not isinstance(module, nn.Embedding):
        return
    refused = (("max_norm", module.max_norm is not None,
                "it renormalises rows of the weight in the forward pass"),
               ("sparse", module.sparse, "its gradient is sparse; SINGD forms a dense natural "
                                         "gradient"),
               ("scale_grad_by_freq", module.scale_grad_by_freq,
                "it divides gradient rows by token frequencies"))
    for name, present, why in refused:
        if present:
            raise ValueError(f"SINGD: Embedding layer '{layer.name}' ({module}) has "
                             f"{name}={getattr(module, name)!r}, which SINGD does not support: "
                             f"{why}. Construct it without {name}, or leave its parameters out "
                             "of params")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _grad_scale(value, name: str) -> float:
    v = real_number(value, name)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {v}")
    return v


def _lr_cov_value(value, where: str = "") -> None:
    """A value of lr_cov (beta1): a real number >= 0 (a tensor off the CPU is not read: no sync)."""
    if isinstance(value, Tensor) and (value.numel() != 1 or not value.is_floating_point()):
        raise ValueError(f"{where}lr_cov must be a number, a 0-dim float tensor or a callable "
                         f"of the step, got a {value.dtype} tensor of shape {tuple(value.shape)}")
    if not isinstance(value, Tensor) or value.device.type == "cpu":
        v = real_number(value, f"{where}lr_cov")
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{where}lr_cov must be a finite number >= 0, got {v}")


class _PendingUpdate(NamedTuple):
    """One layer's preconditioner update between the momentum op and the factor step op."""
    layer: Layer
    group: dict
    state: dict
    sk: type  # K's structure
    sc: type  # C's structure
    wk: torch.dtype  # K's work dtype
    wc: torch.dtype  # C's work dtype
    K: tuple
    C: tuple
    m_K: tuple
    m_C: tuple
    commit: Tensor  # the update is written (due, and its accumulators are finite)
    device: torch.device
    H_K: tuple
    H_C: tuple
    due: Tensor  # its accumulators are reset
    due_host: bool | None


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _accumulate(accumulators: tuple[Tensor, ...], terms: tuple[Tensor, ...], step, T) -> None:
    """accumulators += terms; device gated (a step tensor), only on steps k with k % T == 0."""
    if step is None:
        torch._foreach_add_(list(accumulators), list(terms))
        return
    due = torch.remainder(step, T) == 0
    for acc, h in zip(accumulators, terms):
        acc.add_(torch.where(due, h, torch.zeros_like(h)))


def _scalar_tensor(value, device, dtype) -> Tensor:
    """A 0-dim tensor of `value` in `dtype` (a Python float is not rounded through float32)."""
    if isinstance(value, Tensor):
        return value.detach().to(device=device, dtype=dtype).clone().reshape(())
    return torch.tensor(float(value), device=device, dtype=dtype)


class _StepPlan(NamedTuple):
    """How a step routes each layer, kept from step to step on one process (no collectives)
    while `key` holds: the parameters' memory (`.data =` moves it) and which parameters have
    gradients. Factors, momenta and parameters are written in place, so the tensors held here
    stay the live ones until `_attach` (a new group, a checkpoint load) drops the plan."""
    key: tuple
    # group index -> (device, dtype) -> (params, momenta, K, C, offsets) of the fused diagonal
    # step, whose gradients are read at each step
    diagonal: dict[int, dict[tuple, tuple[list, ...]]]
    natural: list  # (layer, its gradients' names, sk, sc, K, C): the natural-gradient layers
    unowned: dict[int, list]  # group index -> its parameters no layer owns, with a gradient


class SINGD(CurvatureOptimizer):
    # name -> (low, high, low_open, high_open, dtype): all in the parameters' op-math dtype, the
    # precision singd's Python floats take in its float32/float64 tensor arithmetic.
    hyperparameters = {
        "lr": (0.0, math.inf, False, True, None),
        # heavy-ball momentum (buf <- momentum*buf + u): at 1 or more the buffer never decays
        "momentum": (0.0, 1.0, False, True, None),
        "damping": (0.0, math.inf, False, True, None),
        "weight_decay": (0.0, math.inf, False, True, None),
    }
    checkpoint_settings = ("cache_preconditioner",)
    finite_state = tuple(f"{f}.{i}" for f in _FACTORS for i in range(_MAX_PARTS)) + (
        "H_count", "P_K", "P_C", "momentum_buffer")

    _step_supports_amp_scaling = True

    def __init__(self, model: nn.Module, params: Iterable | None = None, lr: float = 0.001,
                 momentum: float = 0.9, damping: float = 0.001, alpha1: float = 0.5,
                 weight_decay: float = 0.0, T: int = 10, loss_average: str | None = "batch",
                 lr_cov: float | Callable[[int], float] = 1e-2,
                 structures: tuple[str, str] = ("dense", "dense"), kfac_approx: str = "expand",
                 warn_unsupported: bool = True, kfac_like: bool = False,
                 preconditioner_dtype: tuple = (None, None), init_grad_scale: float = 1.0,
                 normalize_lr_cov: bool = False, *, backend: str = "fused",
                 exact_block_transposes: bool = False, process_group=None,
                 grad_scaler: torch.amp.GradScaler | None = None,
                 cache_preconditioner: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}; SINGD takes "
                            "the model first (parameters go in params=)")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {list(_BACKENDS)}, got {backend!r}")
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.backend = backend
        self._group_of: dict[Tensor, int] = {}
        self._owned_now: dict[int, int] = {}  # FSDP2: this step's owner of each gathered layer
        self._empty: dict[tuple, Tensor] = {}
        self._plan: _StepPlan | None = None
        # id(group) -> (group, its _SETTINGS values, lr_cov's version) that passed _check_settings
        self._settings_checked: dict[int, tuple] = {}
        self._skipped = DropCounts()  # updates dropped for non-finite statistics
        self._init_scale = _grad_scale(init_grad_scale, "init_grad_scale")
        self._manual_scale: float | None = None
        self._built: list[tuple] = []  # per group: the settings its factors were built with
        self._lr_cov_now: dict[int, Any] = {}  # this step's value of each callable lr_cov
        self.grad_scaler = grad_scaler
        self.cache_preconditioner = bool(cache_preconditioner)
        self._grad_scale_prev = self._init_scale
        defaults = dict(lr=lr, momentum=momentum, damping=damping, alpha1=alpha1,
                        weight_decay=weight_decay, T=T, loss_average=loss_average, lr_cov=lr_cov,
                        structures=structures, kfac_approx=kfac_approx, kfac_like=kfac_like,
                        preconditioner_dtype=preconditioner_dtype, normalize_lr_cov=normalize_lr_cov,
                        exact_block_transposes=exact_block_transposes)
        if params is None:
            params = self._trainable(unwrap(model), warn_unsupported)
            if not params:
                raise ValueError("SINGD: the model has no supported layer (Linear, Conv1d, Conv2d, "
                                 "Conv3d, Embedding, transformers' Conv1D) with trainable parameters, "
                                 "and only those are trained when params is not given; pass params= "
                                 "to step others with their plain gradient")
        super().__init__(model, params, defaults, process_group)
        # FSDP2 (the core took the mesh's group): gradients arrive averaged over the mesh, as under
        # DDP, and the natural gradient of a whole layer is taken by its owner from its full gradient.
        if self._sharded:
            self._ddp = True

    # ------------------------------------------------------------------ groups and state
    @staticmethod
    def _trainable(model: nn.Module, warn_unsupported: bool) -> list[Tensor]:
        found = []
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if _supports(module):
                found += [p for p in own if all(p is not q for q in found)]
            elif own and warn_unsupported:
                warnings.warn(f"Found un-supported parameter(s) that will not be trained in layer "
                              f"{name}: {module}. To disable this warning, construct the optimizer "
                              "with `warn_unsupported=False`.", UserWarning, stacklevel=4)
        return found

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The core's validated add_param_group (ranges, tensor hyperparameters, nothing left
        behind by a rejected group), after SINGD's own settings are checked."""
        if isinstance(param_group, dict):
            merged = {**self.defaults, **param_group}
            self._check_settings(merged, len(self.param_groups))
            if merged["kfac_like"] and merged["alpha1"] != 0.0:
                warnings.warn(f"Parameter group {len(self.param_groups)} has kfac_like=True but "
                              f"was initialized with non-zero Riemannian momentum "
                              f"(alpha1={merged['alpha1']}). Setting alpha1 to zero.",
                              UserWarning, stacklevel=3)
                param_group["alpha1"] = 0.0
            elif "alpha1" in param_group:
                param_group["alpha1"] = real_number(param_group["alpha1"], "alpha1")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for name in ("structures", "preconditioner_dtype"):  # tuples: the hooks compare them
            group[name] = tuple(group[name])
        if not callable(group["lr_cov"]):
            group["lr_cov"] = hyperparameter_tensor(group["lr_cov"], group["params"])

    @staticmethod
    def _check_settings(group: dict[str, Any], index: int) -> None:
        """SINGD's settings outside the core's hyperparameter table (names as singd's errors)."""
        where = f"param group {index}: "
        try:
            # Riemannian momentum (m <- m~ + alpha1*m): at 1 or more it never decays (and
            # normalize_lr_cov's half step 0.5*(1 - alpha1) is 0 or negative)
            check_range(group["alpha1"], "alpha1", 0.0, 1.0, high_open=True)
            if not callable(group["lr_cov"]):
                _lr_cov_value(group["lr_cov"])
            check_int(group["T"], "T", 1)
            for name in ("kfac_like", "normalize_lr_cov", "exact_block_transposes"):
                _FLAG.check(group[name], name)
            _check_statistics_choices(group, "")
            st = group["structures"]
            if not (isinstance(st, (tuple, list)) and len(st) == 2):
                raise ValueError(f"structures must be a pair of structure names, got {st!r}")
            for s in st:
                structure(s)
            pd = group["preconditioner_dtype"]
            if not (isinstance(pd, (tuple, list)) and len(pd) == 2
                    and all(d is None or (isinstance(d, torch.dtype) and d.is_floating_point)
                            for d in pd)):
                raise ValueError(f"preconditioner_dtype must be a pair of floating dtypes or None, "
                                 f"got {pd!r}")
        except (TypeError, ValueError) as e:
            raise type(e)(where + str(e)) from None

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        """The core's checks, then SINGD's own settings, which are read again only when one of
        them is another object than the one that passed (or lr_cov, a tensor, was written)."""
        super()._check_group(index, group)
        if torch.compiler.is_compiling():
            return
        values = [group[name] for name in _SETTINGS]
        lr_cov = group["lr_cov"]
        version = lr_cov._version if isinstance(lr_cov, Tensor) and not lr_cov.is_inference() else None
        seen = self._settings_checked.get(id(group))
        if (seen is not None and seen[0] is group and version is not None and seen[2] == version
                and all(map(operator.is_, values, seen[1]))):
            return
        self._check_settings(group, index)
        self._check_built(group, index)
        if isinstance(group["structures"], tuple) and isinstance(group["preconditioner_dtype"], tuple):
            self._settings_checked[id(group)] = (group, values, version)  # (a list can change in place)

    @staticmethod
    def _build_settings(group: dict[str, Any]) -> tuple:
        """What a group's factors were built with: their structures, their dtypes, whether the
        Riemannian momenta m_K, m_C exist."""
        return tuple(group["structures"]), tuple(group["preconditioner_dtype"]), group["alpha1"] != 0.0

    def _check_built(self, group: dict[str, Any], index: int, where: str = "") -> None:
        """The settings that decide the factors' layout must stay what the factors were built
        with (the settings themselves are checked already)."""
        where = f"{where}param group {index}: "
        structures, dtypes, momenta = self._built[index]
        for name, built in (("structures", structures), ("preconditioner_dtype", dtypes)):
            if tuple(group[name]) != built:
                raise ValueError(f"{where}{name} is {tuple(group[name])!r}, but the factors were "
                                 f"built with {built!r}; it is fixed at construction")
        if group["alpha1"] != 0.0 and not momenta:
            raise ValueError(f"{where}alpha1 is {group['alpha1']}, but the factors were built "
                             "with alpha1 = 0 (no Riemannian momentum kept); a zero alpha1 is "
                             "fixed at construction")
        if group["kfac_like"] and group["alpha1"] != 0.0:
            raise ValueError(f"{where}kfac_like=True needs alpha1 = 0, got alpha1 = "
                             f"{group['alpha1']}")

    def _attach(self) -> None:
        """Find the layers, create every state tensor eagerly (a compiled or captured step needs
        them to exist) and hook the layers."""
        group_of = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        layers = discover(self.model, list(group_of), accept=_supports)
        for layer in layers:  # before anything is written
            _check_options(layer)
        self.remove_hooks()
        self._group_of = group_of
        kept = {id(layer.module): layer.anchor for layer in self._curvature}
        for layer in layers:
            groups = {self._group_of[p] for p in layer.params.values()}
            if len(groups) != 1:
                raise ValueError("Parameters of a layer are in different parameter groups. "
                                 f"Layer: {layer.name} ({layer.module}). Groups: {sorted(groups)}.")
            layer.anchor = kept.get(id(layer.module), layer.anchor)  # its factors stay put
        self._curvature = layers
        if not layers:  # as AdaFisher says
            warnings.warn("SINGD: the model has no optimised parameter in a supported layer "
                          "(Linear, Conv1d, Conv2d, Conv3d, Embedding, transformers' Conv1D); every "
                          "parameter is stepped with its plain gradient", UserWarning, stacklevel=3)
        for layer in layers:
            state = self.state[layer.anchor]
            if "K.0" not in state:
                state.update(self._new_factors(layer))
            self._skipped.counter(layer.anchor.device)
            for dtype in self._dtypes(layer):
                self._one(layer.anchor.device, _work_dtype(dtype))
        for group in self.param_groups:
            for p in group["params"]:
                self._steps.tensor(p.device)
                self._one(p.device, _work_dtype(p.dtype))
                self._no_factors(p.device, _work_dtype(p.dtype))
                if "momentum_buffer" not in self.state[p]:
                    # Always kept: momentum is a tensor a schedule may move away from 0.
                    self.state[p]["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format)
        # Groups keep the settings of their first build (a group removed by a rejected
        # add_param_group drops its entry).
        del self._built[len(self.param_groups):]
        self._built += [self._build_settings(g) for g in self.param_groups[len(self._built):]]
        self._plan = None
        self._layer_params_all = [p for g in self.param_groups for p in g["params"]] + [
            p for layer in layers for p in self._layer_params(layer)]
        self._hooks = Hooks(self, layers)
        self._ranks_checked = False

    def _expected_state(self, p: Tensor) -> dict[str, tuple[tuple, torch.dtype]]:
        # Every state tensor exists from construction, in its own dtype (factors keep the
        # preconditioner dtype across checkpoints).
        return {key: (tuple(v.shape), v.dtype) for key, v in self.state[p].items()}

    def _group(self, layer: Layer) -> dict[str, Any]:
        return self.param_groups[self._group_of[layer.anchor]]

    @staticmethod
    def dims(module: nn.Module) -> tuple[int, int]:
        """(d_K, d_C) of a supported layer: input side (bias included), output side."""
        return singd_maths.dims(module)

    def _kinds(self, layer: Layer) -> tuple[type[Structure], type[Structure]]:
        """K's and C's structures: the group's, except an Embedding's K, which is diagonal (its
        one-hot rows have no cross terms: a dense vocabulary-squared K would hold zeros off the
        diagonal, exactly so with kfac_approx "expand")."""
        group = self._group(layer)
        exact = group.get("exact_block_transposes", False)
        sk, sc = (structure(s, exact) for s in group["structures"])
        if isinstance(layer.module, nn.Embedding):
            sk = Diagonal
        return sk, sc

    def _dtypes(self, layer: Layer) -> tuple[torch.dtype, torch.dtype]:
        pd = self._group(layer)["preconditioner_dtype"]
        w = layer.module.weight.dtype
        return (pd[0] or w, pd[1] or w)

    def _new_factors(self, layer: Layer) -> dict[str, Tensor]:
        (sk, sc), (dk, dc) = self._kinds(layer), self._dtypes(layer)
        d_k, d_c = self.dims(layer.module)
        device = layer.anchor.device
        out: dict[str, Tensor] = {}

        def put(prefix, parts):
            for i, t in enumerate(parts):
                out[f"{prefix}.{i}"] = t.contiguous()

        put("K", sk.eye(d_k, dk, device))
        put("C", sc.eye(d_c, dc, device))
        if self._group(layer)["alpha1"] != 0.0:
            put("m_K", sk.zeros(d_k, dk, device))
            put("m_C", sc.zeros(d_c, dc, device))
        put("H_K", sk.zeros(d_k, dk, device))
        put("H_C", sc.zeros(d_c, dc, device))
        out["H_count"] = torch.zeros((), device=device)
        if self._caches(sk):
            out["P_K"] = torch.eye(d_k, device=device).to(dk)
        if self._caches(sc):
            out["P_C"] = torch.eye(d_c, device=device).to(dc)
        return out

    def _parts(self, layer: Layer, prefix: str) -> tuple[Tensor, ...] | None:
        state = self.state[layer.anchor]
        parts = []
        while f"{prefix}.{len(parts)}" in state:
            parts.append(state[f"{prefix}.{len(parts)}"])
        return tuple(parts) if parts else None

    @property
    def skipped_factor_updates(self) -> int:
        """Preconditioner updates dropped because a layer's accumulated H_K or H_C held a NaN
        or inf (reads the device counters: a sync off the CPU)."""
        return self._skipped.total()

    def __deepcopy__(self, memo):
        new = super().__deepcopy__(memo)
        new._plan = None
        return new

    def _graph_settings(self) -> tuple:
        return tuple((f"param group {i}: T", group["T"]) for i, group in enumerate(self.param_groups))

    # ------------------------------------------------------------------ hooks (core protocol)
    def _statistics_gate(self, layer: Layer, device: torch.device):
        group = self._group(layer)
        if not torch.compiler.is_compiling():
            self._check_statistics_settings(group, self._group_of[layer.anchor])
        return self._steps.due(group["T"], device)

    def _check_statistics_settings(self, group: dict[str, Any], index: int) -> None:
        """The settings the statistics hooks read, which a user may have set between steps:
        checked in the forward pass, before its statistics are taken (the step checks the rest)."""
        where = f"param group {index}: "
        check_int(group["T"], f"{where}T", 1)
        _check_statistics_choices(group, where)
        structures, dtypes, _ = self._built[index]
        if group["structures"] != structures or group["preconditioner_dtype"] != dtypes:
            self._check_settings(group, index)
            self._check_built(group, index)

    def take_input_statistics(self, layer: Layer, x: Tensor, step) -> None:
        """Take the statistics of `layer` from its input; its hook calls this in backward, with
        the input of the call whose output gradient then goes to `take_grad_statistics` (as
        singd forms H_K: a forward pass whose backward never runs adds nothing)."""
        group = self._group(layer)
        sk, dk = self._kinds(layer)[0], self._dtypes(layer)[0]
        if isinstance(layer.module, nn.Embedding):  # indices: counted, never cast
            h_k = singd_maths.embedding_inner(self._parts(layer, "K")[0], layer.module, x,
                                              group["kfac_approx"])
        else:
            a = singd_maths.input_rows(layer.module, x.to(dk), group["kfac_approx"])
            h_k = sk.inner(self._parts(layer, "K"), a.mT)
        _accumulate(self._parts(layer, "H_K"), h_k, step, group["T"])

    def take_grad_statistics(self, layer: Layer, grad: Tensor, step) -> None:
        """Take the statistics of `layer` from its output gradient; its hook calls this."""
        group = self._group(layer)
        sc, dc = self._kinds(layer)[1], self._dtypes(layer)[1]
        g = singd_maths.grad_rows(layer.module, grad.to(dc), group["loss_average"], group["kfac_approx"])
        if self._grad_scale_prev != 1.0:  # singd: H_C from g / sqrt(previous step's scale)
            g = g / math.sqrt(self._grad_scale_prev)
        h_c = sc.inner(self._parts(layer, "C"), g.mT)
        _accumulate(self._parts(layer, "H_C"), h_c, step, group["T"])
        count = self.state[layer.anchor]["H_count"]
        if step is None:
            count.add_(1.0)
        else:  # device gated: counted only on steps k with k % T == 0
            count.add_((torch.remainder(step, group["T"]) == 0).to(count.dtype))

    # ------------------------------------------------------------------ step
    def _lr_cov(self, group, device, dtype) -> Tensor:
        lr_cov = group["lr_cov"]
        if callable(lr_cov):
            lr_cov = self._lr_cov_now.get(id(group))
            if lr_cov is None:  # device gated: the callable takes the step tensor, unchecked
                lr_cov = group["lr_cov"](self._steps.tensor(device))
        return _scalar_tensor(lr_cov, device, dtype)

    def _evaluate_lr_cov(self) -> dict[int, Any]:
        """Each callable lr_cov of a group with a preconditioner update due at this step, called
        once with the step count and checked, before the step writes anything (while the host
        counts the steps; once the device decides, the callable takes the step tensor)."""
        values = {}
        for index, group in enumerate(self.param_groups):
            if callable(group["lr_cov"]) and self._steps.host_due(group["T"]):
                value = group["lr_cov"](self._steps.host)
                _lr_cov_value(value, f"param group {index}: the value of the callable ")
                values[id(group)] = value
        return values

    @staticmethod
    def _layer_params(layer: Layer) -> list[Tensor]:
        """The module's weight and bias (optimised or not: singd's natural gradient uses both)."""
        return [t for t in (getattr(layer.module, n, None) for n in ("weight", "bias")) if t is not None]

    def _due_and_commit(self, layer: Layer, due_host: bool | None,
                    accumulators: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """(due, commit), 0-dim bool tensors. due: this layer's preconditioner update is due, so its
        accumulators are reset: it saw statistics (singd raises KeyError when a layer took none;
        this leaves its factors as they are) and, once the device decides, this is a step k with
        k % T == 0. commit: the update is written, as it is due and its accumulated H_K and H_C (the
        parts in `accumulators`) are finite (a NaN or inf would turn K and C non-finite for good)."""
        count = self.state[layer.anchor]["H_count"]
        due = count > 0
        if due_host is None:
            due = due & (torch.remainder(self._steps.tensor(count.device), self._group(layer)["T"]) == 0)
        # One reduction per part: a NaN or inf anywhere makes the sum non-finite (so does a sum
        # that overflows the op-math dtype, from entries near its limit). total - total is 0
        # exactly when total is finite (two ops; torch.isfinite takes more in eager).
        total = None
        for h in accumulators:
            s = h.sum() if h.dtype in (torch.float32, torch.float64) else h.sum(dtype=torch.float32)
            total = s if total is None else total + s
        return due, due & ((total - total) == 0)

    def _count_dropped(self, layer: Layer, due: Tensor, commit: Tensor) -> None:
        self._skipped.counter(layer.anchor.device).add_(due ^ commit)  # commit implies due

    def _update_preconditioners(self, items: list[tuple[Layer, bool | None]], c_g) -> None:
        """Every due layer's preconditioner update, by the backend; while the CPU counts the
        dropped ones without a sync (eager), a RuntimeWarning says how many."""
        if not items:
            return
        watch = [] if torch.compiler.is_compiling() or capturing() else [
            c for d, c in self._skipped.counts.items() if d.type == "cpu"]
        before = sum(float(c) for c in watch)
        if self.backend == "fused":
            self._update_preconditioners_fused(items, c_g)
        else:
            for layer, due in items:
                self._update_preconditioner(layer, due, c_g)
        dropped = sum(float(c) for c in watch) - before
        if dropped > 0:  # attributed to step()'s caller (past _step, step, torch's wrappers)
            warnings.warn(f"{type(self).__name__}: {int(dropped)} preconditioner update(s) dropped: "
                          "the accumulated curvature (H_K, H_C) held NaN or inf; those layers keep "
                          "their factors K, C and their accumulators are reset", RuntimeWarning,
                          stacklevel=6)

    def _update_preconditioners_fused(self, items: list[tuple[Layer, bool | None]], c_g) -> None:
        """Every due layer's preconditioner update: the products in torch (per layer), the
        momentum/trace combination with the projection's folds and the truncated-exponential step
        as two elementwise ops over every part of every factor of a (device, dtype) bucket."""
        if not items:
            return
        momentum: dict[tuple, tuple[list, ...]] = {}
        pending = [self._queue_momentum(layer, due_host, c_g, momentum) for layer, due_host in items]
        for lists in momentum.values():
            ops.singd_momentum_(*lists)
        for lists in self._factor_steps(pending).values():
            ops.singd_factor_step_(*lists)
        self._finish_updates(pending)

    def _queue_momentum(self, layer: Layer, due_host: bool | None, c_g, momentum: dict) -> "_PendingUpdate":
        """Add a layer's factors to the momentum op's (device, dtype) buckets; returns what the
        factor step needs of the layer."""
        group = self._group(layer)
        state = self.state[layer.anchor]
        (sk, sc), (dk, dc) = self._kinds(layer), self._dtypes(layer)
        d_k, d_c = self.dims(layer.module)
        device = layer.anchor.device
        K, C = self._parts(layer, "K"), self._parts(layer, "C")
        H_K, H_C = self._parts(layer, "H_K"), self._parts(layer, "H_C")
        alpha1 = group["alpha1"]
        if alpha1 != 0.0:
            m_K, m_C = self._parts(layer, "m_K"), self._parts(layer, "m_C")
        else:  # m is not kept: the op writes the new one into scratch
            m_K = tuple(torch.empty_like(h) for h in H_K)
            m_C = tuple(torch.empty_like(h) for h in H_C)
        scale = 0.5 * ((1.0 - alpha1) if group["normalize_lr_cov"] else 1.0)
        (K_tK, pi_k), (C_tC, pi_c) = sk.inner_parts(K), sc.inner_parts(C)
        wk, wc = _work_dtype(dk), _work_dtype(dc)
        scale_k, scale_c = self._as_tensor(scale, device, wk), self._as_tensor(scale, device, wc)
        alpha1_k, alpha1_c = self._as_tensor(alpha1, device, wk), self._as_tensor(alpha1, device, wc)
        damping_k = self._hyperparameter(group, "damping", device, wk)
        damping_c = self._hyperparameter(group, "damping", device, wc)
        if group["kfac_like"]:
            ck, dmp_k = self._one(device, wk), damping_k
            cc, dmp_c = self._one(device, wc) * c_g, damping_c
        else:  # (the diagonal-carrying parts of Pi(K^T K) are unfolded: pi = 1 there)
            ck = (c_g * sc.average_trace(H_C)).to(wk)
            dmp_k = damping_k * sc.average_trace(C_tC)
            cc = (c_g * sk.average_trace(H_K)).to(wc)
            dmp_c = damping_c * sk.average_trace(K_tK)
        due, commit = self._due_and_commit(layer, due_host, H_K + H_C)
        for kind, d, dtype, m, h, ktk, pi, c_h, c_d, s, a1 in (
                (sk, d_k, dk, m_K, H_K, K_tK, pi_k, ck, dmp_k.to(wk), scale_k, alpha1_k),
                (sc, d_c, dc, m_C, H_C, C_tC, pi_c, cc, dmp_c.to(wc), scale_c, alpha1_c)):
            lists = momentum.setdefault((device, dtype), ([], [], [], [], [], [], [], [], [], []))
            n = len(m)
            for lst, values in zip(lists, (m, h, ktk, [c_h] * n, [c_d] * n, [commit] * n,
                                           kind.eye_kinds(d), [int(p) for p in pi], [s] * n,
                                           [a1] * n)):
                lst.extend(values)
        return _PendingUpdate(layer, group, state, sk, sc, wk, wc, K, C, m_K, m_C, commit,
                              device, H_K, H_C, due, due_host)

    def _factor_steps(self, pending: list["_PendingUpdate"]) -> dict[tuple, tuple[list, ...]]:
        """The factor step op's arguments per (device, dtype) bucket, after the momentum op."""
        steps: dict[tuple, tuple[list, ...]] = {}
        for u in pending:
            beta_k, beta_c = self._lr_cov(u.group, u.device, u.wk), self._lr_cov(u.group, u.device, u.wc)
            if u.group["normalize_lr_cov"]:
                beta_k = beta_k / torch.clamp(u.sk.inf_norm(u.m_K), min=1.0)
                beta_c = beta_c / torch.clamp(u.sc.inf_norm(u.m_C), min=1.0)
            for kind, parts, m, beta in ((u.sk, u.K, u.m_K, beta_k), (u.sc, u.C, u.m_C, beta_c)):
                km, elementwise = kind.product_parts(parts, m)
                lists = steps.setdefault((u.device, parts[0].dtype), ([], [], [], [], []))
                n = len(parts)
                for lst, values in zip(lists, (parts, km, [beta] * n, [u.commit] * n, elementwise)):
                    lst.extend(values)
        return steps

    def _finish_updates(self, pending: list["_PendingUpdate"]) -> None:
        """The op reset the accumulators of the committed updates; those of the dropped ones are
        reset too (while the host gates, every layer here is due or has empty accumulators: all
        of them in one op). Then the drop counts and the cached products."""
        resets = []
        for u in pending:
            accumulators = u.H_K + u.H_C + (u.state["H_count"],)
            if u.due_host is None:
                for t in accumulators:
                    t.copy_(torch.where(u.due, torch.zeros_like(t), t))
            else:
                resets += list(accumulators)
            self._count_dropped(u.layer, u.due, u.commit)
            self._refresh_cache(u.layer, u.sk, u.sc, u.K, u.C)
        if resets:
            torch._foreach_zero_(resets)

    def _refresh_cache(self, layer: Layer, sk, sc, K, C) -> None:
        state = self.state[layer.anchor]
        for key, parts in (("P_K", K), ("P_C", C)):  # the cached products follow the factors
            if key in state:  # (dense factors only)
                state[key].copy_(parts[0] @ parts[0].mT)

    def _update_preconditioner(self, layer: Layer, due_host: bool | None, c_g) -> None:
        group = self._group(layer)
        state = self.state[layer.anchor]
        (sk, sc), (dk, dc) = self._kinds(layer), self._dtypes(layer)
        d_k, d_c = self.dims(layer.module)
        device = layer.anchor.device
        K, C = self._parts(layer, "K"), self._parts(layer, "C")
        H_K, H_C = self._parts(layer, "H_K"), self._parts(layer, "H_C")
        m_K, m_C = self._parts(layer, "m_K"), self._parts(layer, "m_C")
        count = state["H_count"]
        kfac_like, alpha1 = group["kfac_like"], group["alpha1"]
        damping_k = self._hyperparameter(group, "damping", device, _work_dtype(dk))
        damping_c = self._hyperparameter(group, "damping", device, _work_dtype(dc))
        scale = 0.5 * ((1.0 - alpha1) if group["normalize_lr_cov"] else 1.0)
        K_tK, C_tC = sk.inner(K), sc.inner(C)
        if kfac_like:
            ck, dmp_k = torch.ones((), dtype=dk, device=device), damping_k
            cc, dmp_c = c_g, damping_c
        else:
            ck = c_g * sc.average_trace(H_C)
            dmp_k = damping_k * sc.average_trace(C_tC)
            cc = c_g * sk.average_trace(H_K)
            dmp_c = damping_c * sk.average_trace(K_tK)
        new_mK = singd_maths.new_momentum(sk, H_K, K_tK, sk.eye(d_k, dk, device), ck, dmp_k, scale,
                                          alpha1, m_K if alpha1 != 0.0 else None)
        new_mC = singd_maths.new_momentum(sc, H_C, C_tC, sc.eye(d_c, dc, device), cc, dmp_c, scale,
                                          alpha1, m_C if alpha1 != 0.0 else None)
        beta_k = self._lr_cov(group, device, dk)
        beta_c = self._lr_cov(group, device, dc)
        if group["normalize_lr_cov"]:
            beta_k = beta_k / torch.clamp(sk.inf_norm(new_mK), min=1.0)
            beta_c = beta_c / torch.clamp(sc.inf_norm(new_mC), min=1.0)
        new_K = singd_maths.factor_step(sk, K, new_mK, beta_k)
        new_C = singd_maths.factor_step(sc, C, new_mC, beta_c)
        due, commit = self._due_and_commit(layer, due_host, H_K + H_C)
        olds = K + C + ((m_K + m_C) if alpha1 != 0.0 else ())
        news = new_K + new_C + ((new_mK + new_mC) if alpha1 != 0.0 else ())
        for old, new in zip(olds, news):
            old.copy_(torch.where(commit, new.to(old.dtype), old))
        if due_host is None:
            for t in H_K + H_C:
                t.copy_(torch.where(due, torch.zeros_like(t), t))
            count.copy_(torch.where(due, torch.zeros_like(count), count))
        else:
            torch._foreach_zero_(list(H_K + H_C))
            count.zero_()
        self._count_dropped(layer, due, commit)
        self._refresh_cache(layer, sk, sc, K, C)

    def _average_curvature(self, due: list[Layer]) -> None:
        """Distributed without a DDP wrapper's gradient averaging too: H terms averaged (summed for
        loss_average None, as singd) in one collective per reduction kind."""
        by_op: dict[bool, list[Tensor]] = {}
        for layer in due:
            summed = self._group(layer)["loss_average"] is None
            by_op.setdefault(summed, []).extend(
                list(self._parts(layer, "H_K") + self._parts(layer, "H_C")))
        for summed, tensors in by_op.items():
            average_over_ranks(tensors, self.process_group, summed=summed)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One SINGD step; a closure is evaluated with grad enabled and its loss returned."""
        loss = None
        if closure is None:
            scale, divide, divisor, found_inf = self._prepare_step()
        else:
            # A closure that raises, or a step rejected after it ran, must not leave the
            # statistics of its passes behind (the step will be retried, closure and all).
            saved = self._save_statistics()
            try:
                with torch.enable_grad():
                    loss = closure()
                scale, divide, divisor, found_inf = self._prepare_step()
            except BaseException:
                self._restore_statistics(saved)
                raise
        self._manual_scale = None
        if scale != 1.0 and self._init_scale == 1.0 and self._steps.value() == 0:
            warnings.warn(f"Detected non-zero gradient scaling ({scale} at step 0). Consider passing "
                          f"a value similar to {scale} to `init_grad_scale` when initializing the "
                          "optimizer as this will improve numerical stability (was initialized to "
                          "1.0).", UserWarning, stacklevel=2)
        if found_inf is not None and float(found_inf) != 0.0:
            warnings.warn("Encountered inf in gradients. Skipping update.", UserWarning, stacklevel=2)
            for layer in self._curvature:  # the accumulated curvature of this step is dropped
                torch._foreach_zero_(list(self._parts(layer, "H_K") + self._parts(layer, "H_C")))
                self.state[layer.anchor]["H_count"].zero_()
        else:
            self._step(scale, divide, divisor)
        self._grad_scale_prev = scale
        self._steps.advance()
        return loss

    def _prepare_step(self) -> tuple[float, float, Tensor | None, Tensor | None]:
        """Everything that can reject the step, before it writes anything: the groups, this
        step's callable lr_cov values and the gradient scale (H_C's, the gradients' divisor, and
        the GradScaler's tensor holding that divisor, if it is one)."""
        self._begin_step()
        self._lr_cov_now = self._evaluate_lr_cov()
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        found_inf = getattr(self, "found_inf", None)
        divisor = None
        if self._manual_scale is not None:  # set_current_grad_scale, as singd
            scale, divide = self._manual_scale, self._manual_scale
        elif grad_scale is not None:
            scale = divide = float(grad_scale)
            divisor = grad_scale
        elif found_inf is not None:
            # scaler.unscale_(opt) ran before the step (clipping): the gradients are unscaled,
            # but the H_C taken from scaled gradients still needs this step's scale.
            if self.grad_scaler is None:
                raise RuntimeError("SINGD: gradients were unscaled before step() (scaler.unscale_), "
                                   "so H_C, taken from scaled gradients, needs the scale: pass "
                                   "grad_scaler=scaler to SINGD")
            scale, divide = float(self.grad_scaler.get_scale()), 1.0
        else:
            scale = divide = 1.0
        return scale, divide, divisor, found_inf

    def _save_statistics(self) -> list[tuple[Tensor, Tensor]]:
        """Copies of the accumulators that passes of this step can add to (the layers whose
        statistics are taken at this step), to take a failed closure's passes back."""
        saved = []
        for layer in self._curvature:
            T = self._group(layer)["T"]
            valid = isinstance(T, int) and not isinstance(T, bool) and T >= 1  # else: rejected later
            if valid and self._steps.host_due(T) is False:
                continue  # no pass of this step takes statistics for it
            state = self.state[layer.anchor]
            for t in self._parts(layer, "H_K") + self._parts(layer, "H_C") + (state["H_count"],):
                saved.append((t, t.clone()))
        return saved

    def _restore_statistics(self, saved: list[tuple[Tensor, Tensor]]) -> None:
        if saved:
            torch._foreach_copy_([t for t, _ in saved], [copy for _, copy in saved])

    def set_current_grad_scale(self, grad_scale: float) -> None:
        """The gradient scale of this step's backward pass (singd's API, for a scaler driven by
        hand); the gradients are divided by it."""
        self._manual_scale = _grad_scale(grad_scale, "grad_scale")

    def _step(self, scale: float, grad_scale: float, divisor: Tensor | None) -> None:
        c_g = self._grad_scale_prev / scale ** 2
        due_of = [self._steps.host_due(group["T"]) for group in self.param_groups]
        dues = [(layer, due_of[self._group_of[layer.anchor]]) for layer in self._curvature]
        updating = [(layer, due) for layer, due in dues
                    if due is not False and any(p.grad is not None for p in self._layer_params(layer))]
        if distributed() or self._sharded:
            self._step_across_ranks(dues, updating, c_g, grad_scale, divisor)
            return
        self._update_preconditioners(updating, c_g)
        plan = self._step_plan()
        per_group: dict[int, tuple[list, list, list]] = {}
        for layer, names, sk, sc, K, C in plan.natural:
            grads = {n: getattr(layer.module, n).grad for n in names}
            self._queue_natural_gradient(layer, grads, None, sk, sc, K, C, grad_scale, per_group, [])
        per_diag = {index: {key: (ps, [_contiguous(p.grad) for p in ps], *rest)
                            for key, (ps, *rest) in buckets.items()}
                    for index, buckets in plan.diagonal.items()}
        self._apply_updates(per_group, per_diag, plan.unowned, grad_scale, divisor)

    def _step_plan(self) -> _StepPlan:
        """This step's `_StepPlan`: the kept one while its key holds, else a new one. A compiled
        step builds it every time (the compiler guards on what it reads; it cannot read the
        memory addresses of the key)."""
        params, key = self._layer_params_all, None
        compiling = torch.compiler.is_compiling()
        if not compiling:
            key = (self.backend, tuple(map(torch.Tensor.data_ptr, params)),
                   tuple(p.grad is None for p in params))
            if self._plan is not None and self._plan.key == key:
                return self._plan
        diagonal: dict[int, dict[tuple, tuple[list, ...]]] = {}
        natural, owned = [], set()
        for layer in self._curvature:
            owned.update(layer.params.values())
            names = [n for n in ("weight", "bias") if getattr(layer.module, n, None) is not None]
            if all(getattr(layer.module, n).grad is None for n in names):
                continue
            sk, sc = self._kinds(layer)
            K, C = self._parts(layer, "K"), self._parts(layer, "C")
            if self._fused_diagonal(layer, sk, sc, K, C):
                self._queue_diagonal_step(layer, K, C, diagonal)
            else:
                natural.append((layer, names, sk, sc, K, C))
        plan = _StepPlan(key, diagonal, natural, self._unowned(owned))
        if not compiling:
            self._plan = plan
        return plan

    def _unowned(self, owned: set) -> dict[int, list]:
        """Per group, its parameters with a gradient that no supported layer owns."""
        return {index: [p for p in group["params"] if p not in owned and p.grad is not None]
                for index, group in enumerate(self.param_groups)}

    def _step_across_ranks(self, dues, updating, c_g, grad_scale: float,
                           divisor: Tensor | None) -> None:
        """The step under torch.distributed: the curvature averaged over the ranks, FSDP2's
        sharded layers gathered to their owners and their rows sent back. Every layer goes
        through the natural gradient (not the fused diagonal step): singd reduces the natural
        gradient across the ranks (`_reduce_natural_gradient`)."""
        self._average_curvature([layer for layer, due in dues if due is not False])
        owned = set()
        full = self._gather_sharded([layer for layer, _ in dues]) if self._sharded else {}
        returned: list[tuple[Layer, str, Tensor | None]] = []  # FSDP2: (layer, param, owner's piece)
        per_group: dict[int, tuple[list, list, list]] = {}
        self._update_preconditioners(updating, c_g)
        for layer, due in dues:
            module = layer.module
            owned.update(layer.params.values())
            grads = {n: getattr(module, n).grad for n in ("weight", "bias") if getattr(module, n, None) is not None}
            if all(g is None for g in grads.values()):
                continue
            sk, sc = self._kinds(layer)
            K, C = self._parts(layer, "K"), self._parts(layer, "C")
            self._queue_natural_gradient(layer, grads, full.get(id(layer)), sk, sc, K, C,
                                         grad_scale, per_group, returned)
        self._queue_returned(returned, per_group)
        self._apply_updates(per_group, {}, self._unowned(owned), grad_scale, divisor)

    def _queue_diagonal_step(self, layer: Layer, K, C, per_diag) -> None:
        """Queue a layer with diagonal K and C for the fused diagonal step (the op forms the
        natural gradient and updates the parameters), in its (group, device, dtype) bucket of
        (params, momenta, K, C, offsets into K); each step reads the params' gradients."""
        bucket = per_diag.setdefault(self._group_of[layer.anchor], {}).setdefault(
            (layer.anchor.device, layer.anchor.dtype), ([], [], [], [], []))
        d_k = K[0].numel()
        # The op scales row r by C[r]^2 and column j by K[offset + j]^2. An Embedding's weight is
        # [vocabulary (K's side), dim (C's side)]: its rows take K, its columns C.
        rows, columns = (K[0], C[0]) if isinstance(layer.module, nn.Embedding) else (C[0], K[0])
        for pname, p in layer.params.items():
            if p.grad is None:
                continue
            for lst, v in zip(bucket, (p, self.state[p]["momentum_buffer"], columns, rows,
                                       0 if pname == "weight" else d_k - 1)):
                lst.append(v)

    def _queue_natural_gradient(self, layer: Layer, grads, full_grads, sk, sc, K, C, grad_scale,
                                per_group, returned) -> None:
        """Form the layer's natural gradient and queue its pieces, one per parameter, for the
        SGD update of its group (`full_grads`: the gathered gradients of a sharded layer). A
        sharded layer under the owner scheme goes to `returned` instead: its owner's full pieces
        (None on the other ranks, which skip the layer), to come back as rows."""
        module = layer.module
        if id(layer) in self._owned_now:
            if full_grads is None:  # another rank owns it
                returned += [(layer, n, None) for n, p in layer.params.items() if p.grad is not None]
                return
            grads = full_grads
        local_rows = self._sharded and self._elementwise_rows(layer)
        if local_rows:
            C = self._own_rows(layer, C, sc)
            grads = {n: local(g) for n, g in grads.items()}
        if full_grads is not None:
            grads = full_grads
        like = next(g for g in grads.values() if g is not None)
        if local_rows:
            gw = grads["weight"].reshape(grads["weight"].shape[0], module.weight.shape[1:].numel())
            gmat = gw if not singd_maths.has_bias(module) else torch.cat([gw, grads["bias"].unsqueeze(1)], 1)
        else:
            gmat = singd_maths.gradient_matrix(module, grads.get("weight"), grads.get("bias"), like)
        if grad_scale != 1.0:
            gmat = gmat / grad_scale
        state = self.state[layer.anchor]
        nat = singd_maths.natural_gradient(sk, K, sc, C, gmat, state.get("P_K"), state.get("P_C"))
        if distributed():
            self._reduce_natural_gradient(layer, nat)
        params, updates, bufs = per_group.setdefault(self._group_of[layer.anchor], ([], [], []))
        pieces = singd_maths.weight_pieces(module, nat)
        for pname, p in layer.params.items():
            if p.grad is None:
                continue
            piece = pieces[pname]
            if id(layer) in self._owned_now:  # the owner: every rank's rows go back together
                returned.append((layer, pname, piece.reshape(p.shape)))
                continue
            if self._sharded and not local_rows:  # each rank keeps its rows
                piece = own_rows(piece, p)
            params.append(local(p))
            updates.append(piece.reshape(local(p).shape))
            bufs.append(local(self.state[p]["momentum_buffer"]))

    def _apply_updates(self, per_group, per_diag, unowned: dict[int, list], grad_scale: float,
                       divisor: Tensor | None) -> None:
        """Per group: the SGD update of the queued natural gradients and of the parameters no
        supported layer owns (`unowned`: their plain gradient), then the fused diagonal steps,
        which read the gradients' divisor on the device (`divisor`, the GradScaler's tensor,
        when there is one)."""
        for index, group in enumerate(self.param_groups):
            params, updates, bufs = per_group.setdefault(index, ([], [], []))
            for p in unowned.get(index, ()):
                grad = local(p.grad)
                params.append(local(p))
                updates.append(grad / grad_scale if grad_scale != 1.0 else grad)
                bufs.append(local(self.state[p]["momentum_buffer"]))
            if params:
                self._apply(params, updates, bufs, group)
            for (device, dtype), (ps, gs, bs, ks, cs, offs) in per_diag.get(index, {}).items():
                work = _work_dtype(dtype)
                lr, momentum, wd = (self._hyperparameter(group, name, device, work)
                                    for name in ("lr", "momentum", "weight_decay"))
                scale = None  # unscaled
                if grad_scale != 1.0:
                    scale = divisor.to(device=device, dtype=work) if divisor is not None else \
                        torch.tensor(grad_scale, dtype=work, device=device)
                ops.singd_diag_step_(ps, gs, bs, ks, cs, offs, lr, momentum, wd, scale)

    def _gather_sharded(self, layers: list[Layer]) -> dict[int, dict[str, Tensor | None]]:
        """FSDP2: the full gradients of the sharded layers whose structures multiply the whole
        gradient matrix (not diagonal K and C: elementwise, they need only the local rows). Each
        goes whole to one owner rank of the shard group (`_gradient_owners`), in one all_to_all
        per dtype; the values are None on the other ranks. The factors are replicated, so any
        rank can own any layer (under HSDP too)."""
        self._owned_now = {}
        wanted, tensors = [], []
        for layer in layers:
            grads = {n: getattr(layer.module, n).grad for n in ("weight", "bias")
                     if getattr(layer.module, n, None) is not None}
            if self._elementwise_rows(layer) or any(
                    g is None or not is_sharded(g) for g in grads.values()):
                continue
            wanted.append((layer, list(grads)))
            tensors += list(grads.values())
        if not tensors:
            return {}
        owners = self._gradient_owners(tensors[0])
        self._owned_now = {id(layer): owners[layer.name] for layer, _ in wanted}
        per_tensor = [owners[layer.name] for layer, names in wanted for _ in names]
        gathered = iter(gather_to_owners(tensors, per_tensor))
        out = {id(layer): {n: next(gathered) for n in names} for layer, names in wanted}
        me = tensors[0].device_mesh.get_local_rank(shard_dim(tensors[0]))
        return {key: grads for key, grads in out.items() if self._owned_now[key] == me}

    def _gradient_owners(self, p: Tensor) -> dict[str, int]:
        """FSDP2: each layer's owner (shard index), by the cost of its natural gradient,
        d_K d_C (d_K + d_C), greedily (kaisa.greedy_assignment: most expensive first, each to the
        least loaded rank); the same on every rank. `p`: a sharded gradient."""
        shards = p.device_mesh.size(shard_dim(p))
        work = {}
        for layer in self._curvature:
            d_k, d_c = self.dims(layer.module)
            work[layer.name] = {"natural_gradient": float(d_k * d_c * (d_k + d_c))}
        assignment = greedy_assignment(work, [list(range(shards))], shards, colocate=True)
        return {name: a["natural_gradient"] for name, a in assignment.items()}

    def _queue_returned(self, returned: list[tuple[Layer, str, Tensor | None]], per_group) -> None:
        """FSDP2 owner scheme: the owners' natural-gradient pieces, each rank's rows sent back in
        one all_to_all per dtype, queued for the SGD update of their groups."""
        if not returned:
            return
        grads = [layer.params[pname].grad for layer, pname, _ in returned]
        owners = [self._owned_now[id(layer)] for layer, _, _ in returned]
        pieces = scatter_from_owners([piece for _, _, piece in returned], grads, owners)
        for (layer, pname, _), piece in zip(returned, pieces):
            p = layer.params[pname]
            params, updates, bufs = per_group.setdefault(self._group_of[layer.anchor], ([], [], []))
            params.append(local(p))
            updates.append(piece)
            bufs.append(local(self.state[p]["momentum_buffer"]))

    def _elementwise_rows(self, layer: Layer) -> bool:
        """Whether a shard's natural gradient comes from its own rows alone: diagonal K and C on
        a weight stored [out, in] (a transposed weight's rows are K's, not C's: it is gathered)."""
        sk, sc = self._kinds(layer)
        return sk is Diagonal and sc is Diagonal and not singd_maths.is_transposed(layer.module)

    @staticmethod
    def _own_rows(layer: Layer, C: tuple, sc) -> tuple:
        """A diagonal C's entries for the local shard's rows (an empty shard: none)."""
        start, stop = rows(layer.module.weight)
        return (C[0][start:stop],)

    def _caches(self, kind) -> bool:
        return self.cache_preconditioner and kind is Dense

    def _fused_diagonal(self, layer, sk, sc, K, C) -> bool:
        """Whether the whole step of this layer is one elementwise kernel (on one process):
        diagonal K and C in the parameters' op-math dtype."""
        if (self.backend != "fused" or sk is not Diagonal or sc is not Diagonal
                or is_transposed_linear(layer.module)):  # its bias column is not the weight's
            return False
        work = _work_dtype(layer.anchor.dtype)
        return (K[0].dtype == work and C[0].dtype == work
                and all(p.dtype == layer.anchor.dtype and p.is_contiguous() for p in layer.params.values()))

    def _reduce_natural_gradient(self, layer: Layer, nat: Tensor) -> None:
        """singd all-reduces the natural gradient (mean, or sum for loss_average None). Under a
        DDP wrapper the gradients are averaged already, so the natural gradient is too (it is
        linear in them): only the sum's factor is left."""
        import torch.distributed as dist
        summed = self._group(layer)["loss_average"] is None
        if self._ddp:
            if summed:
                nat.mul_(dist.get_world_size(self.process_group))
            return
        dist.all_reduce(nat, group=self.process_group)
        if not summed:
            nat.div_(dist.get_world_size(self.process_group))

    def _apply(self, params, updates, bufs, group) -> None:
        """SGD with momentum (torch's, no dampening) and L2 weight decay, per (device, dtype):
        u = nat + wd*theta, buf <- momentum*buf + u, theta <- theta - lr*buf."""
        buckets: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            buckets.setdefault((p.device, p.dtype), []).append(i)
        for (device, dtype), idx in buckets.items():
            ps, us, bs = ([xs[i] for i in idx] for xs in (params, updates, bufs))
            work = _work_dtype(dtype)
            lr, momentum, wd = (self._hyperparameter(group, name, device, work)
                                for name in ("lr", "momentum", "weight_decay"))
            if self.backend == "reference":
                singd_maths.sgd_update_(ps, us, bs, lr, momentum, wd)
                continue
            # The diagonal step's kernel without factors: one elementwise pass over the bucket,
            # the scalars in the op-math dtype as singd's Python floats are.
            none = self._no_factors(device, work)
            ops.singd_diag_step_(ps, [u.contiguous() for u in us], bs, [none] * len(ps),
                                 [none] * len(ps), [0] * len(ps), lr, momentum, wd)

    def _no_factors(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        key = (device, dtype)
        if key not in self._empty:
            self._empty[key] = torch.empty(0, device=device, dtype=dtype)
        return self._empty[key]

    # ------------------------------------------------------------------ checkpoints
    def _layout(self) -> list:
        return [[layer.name, module_class(layer.module).__name__, *self.dims(layer.module)]
                for layer in self._curvature]

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["curvature"]["grad_scale_prev"] = self._grad_scale_prev
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The core's validated load (nothing replaced unless everything checks), plus H_C's
        previous gradient scale; a numeric lr_cov comes back as a tensor on the group's device.
        SINGD's group settings are checked by the constructor's rules first, and those that
        decide the factors' layout must be the ones this optimizer's factors were built with."""
        curvature = None
        if isinstance(state_dict, dict):
            groups = state_dict.get("param_groups")
            if isinstance(groups, list):
                for index, (saved, group) in enumerate(zip(groups, self.param_groups)):
                    if not isinstance(saved, dict):
                        raise TypeError(f"checkpoint param group {index} must be a dict, got "
                                        f"{type(saved).__name__}")
                    merged = {**group, **{k: v for k, v in saved.items()
                                          if k not in ("params", "curvature")}}
                    if isinstance(merged["lr_cov"], Tensor):  # read it (no step waits on a load)
                        merged["lr_cov"] = merged["lr_cov"].detach().cpu()
                    try:
                        self._check_settings(merged, index)
                    except (TypeError, ValueError) as e:
                        raise type(e)(f"checkpoint {e}") from None
                    self._check_built(merged, index, where="checkpoint ")
            curvature = state_dict.get("curvature")
            if curvature is None and isinstance(groups, list) and groups and isinstance(groups[0], dict):
                curvature = groups[0].get("curvature")
        prev = curvature.get("grad_scale_prev", self._init_scale) if isinstance(curvature, dict) else None
        prev = real_number(prev, "checkpoint curvature['grad_scale_prev']") if prev is not None else None
        if prev is not None and not (math.isfinite(prev) and prev > 0.0):
            raise ValueError(f"checkpoint curvature['grad_scale_prev'] must be a finite number > 0, "
                             f"got {prev}")
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["alpha1"] = real_number(group["alpha1"], "alpha1")
            if not callable(group["lr_cov"]):
                group["lr_cov"] = hyperparameter_tensor(group["lr_cov"], group["params"])
        self._grad_scale_prev = prev


SINGD.__doc__ = (
    r"""Structured inverse-free natural gradient descent (SINGD; IKFAC with ``kfac_like=True``).

    singd 0.0.5's contract: the same arguments, defaults and numbers. Per layer (Linear and
    Conv2d as singd; beyond it Conv1d, Conv3d, transformers' Conv1D and Embedding, whose K is
    always diagonal),
    structured factors :math:`K` (:math:`d_K \times d_K`) and :math:`C` (:math:`d_C \times d_C`)
    track :math:`K K^\top \approx (A + \lambda)^{-1}` and :math:`C C^\top \approx (G +
    \lambda)^{-1}` by matrix products only. Every T steps, from the layer inputs :math:`a` and
    output gradients :math:`g` of that step's passes:

    .. math::
        m_K \leftarrow \alpha_1 m_K + s \Big( c \, \tfrac{\mathrm{tr} H_C}{d_C} H_K
            + \lambda \tfrac{\mathrm{tr}(C^\top C)}{d_C} \Pi(K^\top K) - I \Big), \qquad
        K \leftarrow K - \beta_1 K m_K,

        H_K = \Pi(K^\top a^\top a K), \qquad H_C = \Pi(C^\top g^\top g C),

    and the same for :math:`C` with the roles swapped (:math:`\Pi`: projection onto the
    structure; :math:`s = 1/2`; :math:`c`: the gradient-scale correction, 1 without AMP;
    kfac_like: the trace factors are 1). Every step, SGD with momentum on the natural gradient:

    .. math::
        u = C C^\top [\nabla_W \,|\, \nabla_b] K K^\top + \gamma \theta, \qquad
        b \leftarrow \alpha_2 b + u, \qquad
        \theta \leftarrow \theta - \beta_2 b
    """
    + rf"""
    Args:
        model (nn.Module): the model, first as in singd; its Linear, Conv1d, Conv2d, Conv3d,
            transformers' Conv1D and Embedding layers are hooked (an Embedding with max_norm,
            sparse=True or scale_grad_by_freq is refused; a tied weight belongs to the first
            of these modules that holds it).
        {_optional_params_doc}
            (default: the parameters of the model's supported layers; others are warned about
            when warn_unsupported). Parameters in params that no supported layer owns are
            updated with their plain gradient (weight decay and momentum as the others);
            singd silently never updates them.
        lr (float, optional): :math:`\beta_2`, the learning rate, >= 0; per param group
            (default: 0.001)
        momentum (float, optional): :math:`\alpha_2`, SGD momentum, in [0, 1); per param group
            (default: 0.9)
        damping (float, optional): :math:`\lambda`, >= 0; per param group (default: 0.001)
        alpha1 (float, optional): :math:`\alpha_1`, the Riemannian momentum of the factor
            updates, in [0, 1); per param group. It stays a number: whether it is 0 decides whether
            m_K and m_C are kept at all (default: 0.5)
        weight_decay (float, optional): :math:`\gamma`, L2 weight decay, >= 0; per param group
            (default: 0)
        T (int, optional): preconditioner update interval: statistics come from the passes of
            the steps k with k % T == 0, summed over micro-batches; per param group
            (default: 10)
        loss_average (str or None, optional): None, "batch" or "batch+sequence": the gradient
            rows are scaled by sqrt(B) ("batch") or sqrt(B * locations) ("batch+sequence"),
            as the loss is averaged; per param group (default: "batch")
        lr_cov (float or callable, optional): :math:`\beta_1`, the factors' step size, >= 0: a
            number or a callable of the step count; per param group (default: 0.01)
        structures (tuple[str, str], optional): K's and C's structure, each of "dense",
            "diagonal", "block30diagonal", "hierarchical15_15", "triltoeplitz",
            "triutoeplitz"; per param group (default: ("dense", "dense"))
        kfac_approx (str, optional): "expand" or "reduce", for layers that share weights over
            locations ("reduce": the mean of the input rows, the sum of the gradient rows);
            per param group (default: "expand")
        warn_unsupported (bool, optional): warn about the model's parameters outside the
            supported layers when params is not given (default: True)
        kfac_like (bool, optional): IKFAC; forces alpha1 = 0 (with a warning); per param group
            (default: False)
        preconditioner_dtype (tuple, optional): K's and C's storage dtype, None = the
            weight's; per param group (default: (None, None))
        init_grad_scale (float, optional): the gradient scale assumed for step 0's H_C (H_C
            uses the previous step's scale), finite and > 0 (default: 1.0)
        normalize_lr_cov (bool, optional): :math:`s = (1 - \alpha_1)/2` and :math:`\beta_1`
            divided by :math:`\max(1, \|m\|_\infty)`; per param group (default: False)
        {_backend_doc}
            Beyond singd, keyword only, as all below. "fused": batched multi-tensor updates;
            "reference": per layer, in singd's order.
        exact_block_transposes (bool, optional): block30diagonal with true transposes (singd
            multiplies by K where K^T is meant); per param group (default: False: singd's
            numbers)
        {_process_group_doc}
            The H terms are averaged (summed for loss_average=None) in one collective per
            preconditioner update.
        {_grad_scaler_doc}
        cache_preconditioner (bool, optional): for a factor with the dense structure, keep
            P = K K^T (C C^T) from each preconditioner update, so the step multiplies by it
            once instead of by K and K^T (a dense-dense layer: two GEMMs instead of four).
            singd's order of products is then not kept: the numbers differ by rounding.
            Structured factors keep their cheaper structured products (a dense cache would
            cost more) (default: False)

    structures, preconditioner_dtype and a zero alpha1 are fixed once a group's factors are
    built: a group entry or a checkpoint that changes them is rejected. lr, momentum, damping,
    weight_decay and a numeric lr_cov are 0-dim tensors in the groups (schedules change them in
    place or assign numbers; a compiled step does not recompile). Speed: docs/singd.md.
    """
)


__all__ = ["SINGD", "STRUCTURES"]
