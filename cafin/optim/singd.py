"""SINGD / IKFAC / INGD: structured inverse-free natural gradient (arXiv 2312.05705), a drop-in for
singd 0.0.5's `singd.optim.optimizer.SINGD` (same constructor names, defaults and numbers).

Per Linear/Conv2d layer, factors K (d_K x d_K) and C (d_C x d_C) track K K^T ~ (A + lambda)^-1 and
C C^T ~ (G + lambda)^-1 by matrix products only: every T steps
    m_K <- s*(c_g tr(H_C)/d_C H_K + lambda tr(C^T C)/d_C Pi(K^T K) - I) + alpha1 m_K,   K <- K - beta1 K m_K
(and the same for C with the roles swapped), with H_K = Pi(K^T a^T a K), H_C = Pi(C^T g^T g C)
from the inputs and output gradients of that step's passes; every step the natural gradient
C C^T [grad W | grad b] K K^T drives SGD with momentum. kfac_like=True is IKFAC.

Every persistent tensor lives in `self.state`: per parameter `momentum_buffer` (momentum != 0);
per layer, in the state of its first optimised parameter, the parts of K, C (`K.<part>`), their
momenta m_K, m_C (alpha1 != 0), the curvature accumulators H_K, H_C and `H_count` (passes added).
Hooks, the step counter and its host/device gating come from the family's core (`cafin.curvature`).
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from ..curvature import (Hooks, average_over_ranks, Layer, StepCounter, check_int, discover,
                         distributed, on, real_number, unwrap)
from ..reference import singd as ref
from .. import ops
from ..sharding import check_sharded, gather_rows, is_sharded, local, module_class, own_rows, rows
from ..structures import STRUCTURES, Diagonal, Structure, structure

_SUPPORTED = (nn.Linear, nn.Conv2d)
_LOSS_AVERAGES = (None, "batch", "batch+sequence")
_BACKENDS = ("fused", "reference")
_FACTORS = ("K", "C", "m_K", "m_C", "H_K", "H_C")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _scalar_tensor(value, device, dtype) -> Tensor:
    """A 0-dim tensor of `value` in `dtype` (a Python float is not rounded through float32)."""
    if isinstance(value, Tensor):
        return value.detach().to(device=device, dtype=dtype).clone().reshape(())
    return torch.tensor(float(value), device=device, dtype=dtype)


class SINGD(torch.optim.Optimizer):
    """Structured inverse-free natural gradient descent (singd 0.0.5's contract).

    Args (as singd): model; params (default: the parameters of the model's Linear and Conv2d
    layers; others are warned about when warn_unsupported); lr (beta2); momentum (alpha2);
    damping (lambda); alpha1 (Riemannian momentum); weight_decay (gamma); T (preconditioner
    update interval); loss_average (None, "batch", "batch+sequence"); lr_cov (beta1, a number or
    a callable of the step count); structures ((K's, C's) of "dense", "diagonal",
    "block30diagonal", "hierarchical15_15", "triltoeplitz", "triutoeplitz"); kfac_approx
    ("expand", "reduce"); kfac_like (IKFAC; forces alpha1 = 0); preconditioner_dtype ((K's, C's)
    storage dtype, None = the weight's); init_grad_scale; normalize_lr_cov.
    Every one but model, params and warn_unsupported may differ per param group.

    Beyond singd (keyword only):
        backend: "fused" (batched multi-tensor updates) or "reference" (per layer, singd's order).
        exact_block_transposes: block30diagonal with true transposes (singd multiplies by K where
            K^T is meant); per group. Default False: singd's numbers.
        process_group: with torch.distributed initialised, the H terms are averaged (summed for
            loss_average=None) over this group in one collective per preconditioner update.
        cache_preconditioner: keep P_K = K K^T and P_C = C C^T (dense) from each preconditioner
            update, so a step takes two GEMMs instead of four (singd's order of products is then
            not kept: the numbers differ by rounding). Not for diagonal-diagonal layers, whose
            step is elementwise anyway.
        grad_scaler: the torch.amp.GradScaler in use, needed only when the gradients are unscaled
            before the step (`scaler.unscale_(opt)`, e.g. to clip them).
    Parameters in params that no Linear/Conv2d owns are updated with their plain gradient
    (weight decay and momentum as the others); singd silently never updates them.
    """

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
        if process_group is not None and not distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        model = unwrap(model)
        self.model = model
        self.backend = backend
        self.process_group = process_group
        self._opt_called = True  # see `step._wrapped_by_lr_sched`
        self._steps = StepCounter()
        self._layers: list[Layer] = []
        self._group_of: dict[Tensor, int] = {}
        self._pending: dict[int, list] = {}
        self._hooks: Hooks | None = None
        self._model_params = {id(p) for p in model.parameters()}
        self._attached = False
        self._init_scale = real_number(init_grad_scale, "init_grad_scale")
        self._manual_scale: float | None = None
        self.grad_scaler = grad_scaler
        self.cache_preconditioner = bool(cache_preconditioner)
        self._grad_scale_prev = self._init_scale
        defaults = dict(lr=lr, momentum=momentum, damping=damping, alpha1=alpha1,
                        weight_decay=weight_decay, T=T, loss_average=loss_average, lr_cov=lr_cov,
                        structures=structures, kfac_approx=kfac_approx, kfac_like=kfac_like,
                        preconditioner_dtype=preconditioner_dtype, normalize_lr_cov=normalize_lr_cov,
                        exact_block_transposes=exact_block_transposes)
        if params is None:
            params = self._trainable(model, warn_unsupported)
        super().__init__(params, defaults)
        # FSDP2: gradients arrive averaged over the mesh, as under DDP; the H terms are averaged
        # over it, and the natural gradient of a whole layer is taken from its gathered gradient.
        mesh_group = check_sharded([p for g in self.param_groups for p in g["params"]], "SINGD")
        self._sharded = mesh_group is not None
        if self._sharded:
            self._ddp = True
            self.process_group = process_group if process_group is not None else mesh_group
        self._attach()

    # ------------------------------------------------------------------ groups and state
    @staticmethod
    def _trainable(model: nn.Module, warn_unsupported: bool) -> list[Tensor]:
        found = []
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if isinstance(module, _SUPPORTED):
                found += [p for p in own if all(p is not q for q in found)]
            elif own and warn_unsupported:
                warnings.warn(f"Found un-supported parameter(s) that will not be trained in layer "
                              f"{name}: {module}. To disable this warning, construct the optimizer "
                              "with `warn_unsupported=False`.", UserWarning, stacklevel=3)
        return found

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        before = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1], before)
        except Exception:
            del self.param_groups[before:]  # a rejected group leaves nothing behind
            raise
        if self._attached:
            self._attach()

    def _check_group(self, group: dict[str, Any], index: int) -> None:
        for p in group["params"]:
            if id(p) not in self._model_params:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} in params is not a "
                                 "parameter of the model")
            if not p.is_floating_point():
                raise TypeError(f"parameter of shape {tuple(p.shape)} has dtype {p.dtype}")
        for name in ("lr", "momentum", "alpha1", "weight_decay", "damping"):
            v = real_number(group[name], name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if not callable(group["lr_cov"]):
            v = real_number(group["lr_cov"], "lr_cov")
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"lr_cov must be >= 0 or a callable of the step, got {v}")
        check_int(group["T"], "T", 1)
        if group["loss_average"] not in _LOSS_AVERAGES:
            raise ValueError(f"loss_average must be one of {_LOSS_AVERAGES}, got "
                             f"{group['loss_average']!r}")
        if group["kfac_approx"] not in ("expand", "reduce"):
            raise ValueError(f"kfac_approx must be 'expand' or 'reduce', got {group['kfac_approx']!r}")
        st = group["structures"]
        if not (isinstance(st, (tuple, list)) and len(st) == 2):
            raise ValueError(f"structures must be a pair of structure names, got {st!r}")
        for s in st:
            structure(s)
        pd = group["preconditioner_dtype"]
        if not (isinstance(pd, (tuple, list)) and len(pd) == 2
                and all(d is None or (isinstance(d, torch.dtype) and d.is_floating_point) for d in pd)):
            raise ValueError(f"preconditioner_dtype must be a pair of floating dtypes or None, got {pd!r}")
        if group["kfac_like"] and real_number(group["alpha1"], "alpha1") != 0.0:
            warnings.warn(f"Parameter group {index} has kfac_like=True but was initialized with "
                          f"non-zero Riemannian momentum (alpha1={group['alpha1']}). Setting "
                          "alpha1 to zero.", UserWarning, stacklevel=4)
            group["alpha1"] = 0.0
        for name in ("momentum", "alpha1", "weight_decay", "damping"):
            group[name] = real_number(group[name], name)
        work = _work_dtype(group["params"][0].dtype) if group["params"] else torch.float32
        device = group["params"][0].device if group["params"] else None
        group["lr"] = _scalar_tensor(group["lr"], device, work)
        if not callable(group["lr_cov"]):
            group["lr_cov"] = _scalar_tensor(group["lr_cov"], device, work)

    def _attach(self) -> None:
        """Find the layers, create every state tensor eagerly (a compiled or captured step needs
        them to exist) and hook the layers."""
        self.remove_hooks()
        self._attached = True
        self._group_of = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._layers = discover(self.model, list(self._group_of),
                                accept=lambda module, kind: isinstance(module, _SUPPORTED))
        for layer in self._layers:
            groups = {self._group_of[p] for p in layer.params.values()}
            if len(groups) != 1:
                raise ValueError("Parameters of a layer are in different parameter groups. "
                                 f"Layer: {layer.name} ({layer.module}). Groups: {sorted(groups)}.")
            state = self.state[layer.anchor]
            if "K.0" not in state:
                state.update(self._new_factors(layer))
        for group in self.param_groups:
            for p in group["params"]:
                self._steps.tensor(p.device)
                if group["momentum"] != 0.0 and "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format)
        self._pending = {id(layer): [] for layer in self._layers}
        self._hooks = Hooks(self, self._layers)

    def _group(self, layer: Layer) -> dict[str, Any]:
        return self.param_groups[self._group_of[layer.anchor]]

    @staticmethod
    def dims(module: nn.Module) -> tuple[int, int]:
        """(d_K, d_C) of a Linear or Conv2d."""
        w = module.weight
        return w.shape[1:].numel() + (module.bias is not None), w.shape[0]

    def _kinds(self, layer: Layer) -> tuple[type[Structure], type[Structure]]:
        group = self._group(layer)
        exact = group.get("exact_block_transposes", False)
        return tuple(structure(s, exact) for s in group["structures"])

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
        if self._caches(sk, sc):
            out["P_K"] = torch.eye(d_k, device=device).to(dk)
            out["P_C"] = torch.eye(d_c, device=device).to(dc)
        return out

    def _parts(self, layer: Layer, prefix: str) -> tuple[Tensor, ...] | None:
        state = self.state[layer.anchor]
        parts = []
        while f"{prefix}.{len(parts)}" in state:
            parts.append(state[f"{prefix}.{len(parts)}"])
        return tuple(parts) if parts else None

    def remove_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key != "_hooks":
                setattr(new, key, copy.deepcopy(value, memo))
        new._pending = {id(layer): [] for layer in new._layers}
        new._hooks = Hooks(new, new._layers) if self._hooks is not None else None
        return new

    # ------------------------------------------------------------------ hooks (core protocol)
    def _statistics_gate(self, layer: Layer, device: torch.device):
        return self._steps.due(self._group(layer)["T"], device)

    def _input_statistics(self, layer: Layer, x: Tensor, step) -> None:
        # H_K is formed in the backward pass, from the input of the call whose output gradient
        # arrives (as singd does: a forward pass whose backward never runs adds nothing).
        self._pending[id(layer)].append(x)

    def _grad_statistics(self, layer: Layer, grad: Tensor, step) -> None:
        pending = self._pending[id(layer)]
        if not pending:
            return
        x = pending.pop()
        group = self._group(layer)
        (sk, sc), (dk, dc) = self._kinds(layer), self._dtypes(layer)
        a = ref.input_rows(layer.module, x.to(dk), group["kfac_approx"])
        g = ref.grad_rows(layer.module, grad.to(dc), group["loss_average"], group["kfac_approx"])
        if self._grad_scale_prev != 1.0:  # singd: H_C from g / sqrt(previous step's scale)
            g = g / math.sqrt(self._grad_scale_prev)
        h_k = sk.inner(self._parts(layer, "K"), a.mT)
        h_c = sc.inner(self._parts(layer, "C"), g.mT)
        acc_k, acc_c = self._parts(layer, "H_K"), self._parts(layer, "H_C")
        count = self.state[layer.anchor]["H_count"]
        if step is None:
            torch._foreach_add_(list(acc_k + acc_c), list(h_k + h_c))
            count.add_(1.0)
        else:  # device gated: add only on steps k with k % T == 0
            due = torch.remainder(step, group["T"]) == 0
            for acc, h in zip(acc_k + acc_c, h_k + h_c):
                acc.add_(torch.where(due, h, torch.zeros_like(h)))
            count.add_(due.to(count.dtype))

    # ------------------------------------------------------------------ step
    def _lr_cov(self, group, device, dtype) -> Tensor:
        lr_cov = group["lr_cov"]
        if callable(lr_cov):
            k = self._steps.host_due(1)  # None once device gated
            lr_cov = lr_cov(self._steps.host if k is not None else self._steps.tensor(device))
        return _scalar_tensor(lr_cov, device, dtype)

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
        kfac_like, damping, alpha1 = group["kfac_like"], group["damping"], group["alpha1"]
        scale = 0.5 * ((1.0 - alpha1) if group["normalize_lr_cov"] else 1.0)
        K_tK, C_tC = sk.inner(K), sc.inner(C)
        if kfac_like:
            ck, dmp_k = torch.ones((), dtype=dk, device=device), damping
            cc, dmp_c = c_g, damping
        else:
            ck = c_g * sc.average_trace(H_C)
            dmp_k = damping * sc.average_trace(C_tC)
            cc = c_g * sk.average_trace(H_K)
            dmp_c = damping * sk.average_trace(K_tK)
        new_mK = ref.new_momentum(sk, H_K, K_tK, sk.eye(d_k, dk, device), ck, dmp_k, scale,
                                  alpha1, m_K if alpha1 != 0.0 else None)
        new_mC = ref.new_momentum(sc, H_C, C_tC, sc.eye(d_c, dc, device), cc, dmp_c, scale,
                                  alpha1, m_C if alpha1 != 0.0 else None)
        beta_k = self._lr_cov(group, device, dk)
        beta_c = self._lr_cov(group, device, dc)
        if group["normalize_lr_cov"]:
            beta_k = beta_k / torch.clamp(sk.inf_norm(new_mK), min=1.0)
            beta_c = beta_c / torch.clamp(sc.inf_norm(new_mC), min=1.0)
        new_K = ref.factor_step(sk, K, new_mK, beta_k)
        new_C = ref.factor_step(sc, C, new_mC, beta_c)
        # Commit only where this is a preconditioner step that saw statistics (singd raises
        # KeyError when a layer took none; this leaves its factors as they are).
        go = count > 0
        if due_host is None:
            go = go & (torch.remainder(self._steps.tensor(device), group["T"]) == 0)
        olds = K + C + ((m_K + m_C) if alpha1 != 0.0 else ())
        news = new_K + new_C + ((new_mK + new_mC) if alpha1 != 0.0 else ())
        for old, new in zip(olds, news):
            old.copy_(torch.where(go, new.to(old.dtype), old))
        if due_host is None:
            for t in H_K + H_C:
                t.copy_(torch.where(go, torch.zeros_like(t), t))
            count.copy_(torch.where(go, torch.zeros_like(count), count))
        else:
            torch._foreach_zero_(list(H_K + H_C))
            count.zero_()
        if "P_K" in state:  # the cached products follow the factors
            for key, kind, parts, d in (("P_K", sk, K, d_k), ("P_C", sc, C, d_c)):
                eye = torch.eye(d, device=device, dtype=state[key].dtype)
                state[key].copy_(kind.matmul(parts, kind.rmatmat(parts, eye)))

    def _average_curvature(self, due: list[Layer]) -> None:
        """Distributed without a DDP wrapper's gradient averaging too: H terms averaged (summed for
        loss_average None, as singd) in one collective per reduction kind."""
        import torch.distributed as dist
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
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        found_inf = getattr(self, "found_inf", None)
        if self._manual_scale is not None:  # set_current_grad_scale, as singd
            scale, divide = self._manual_scale, self._manual_scale
        elif grad_scale is not None:
            scale = divide = float(grad_scale)
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
        self._manual_scale = None
        if scale != 1.0 and self._init_scale == 1.0 and self._steps.value() == 0:
            warnings.warn(f"Detected non-zero gradient scaling ({scale} at step 0). Consider passing "
                          f"a value similar to {scale} to `init_grad_scale` when initializing the "
                          "optimizer as this will improve numerical stability (was initialized to "
                          "1.0).", UserWarning, stacklevel=2)
        for pending in self._pending.values():
            pending.clear()
        if found_inf is not None and float(found_inf) != 0.0:
            warnings.warn("Encountered inf in gradients. Skipping update.", UserWarning, stacklevel=2)
            for layer in self._layers:  # the accumulated curvature of this step is dropped
                torch._foreach_zero_(list(self._parts(layer, "H_K") + self._parts(layer, "H_C")))
                self.state[layer.anchor]["H_count"].zero_()
        else:
            self._step(scale, divide)
        self._grad_scale_prev = scale
        self._steps.advance()
        return loss

    def set_current_grad_scale(self, grad_scale: float) -> None:
        """The gradient scale of this step's backward pass (singd's API, for a scaler driven by
        hand); the gradients are divided by it."""
        self._manual_scale = real_number(grad_scale, "grad_scale")

    def _step(self, scale: float, grad_scale: float) -> None:
        c_g = self._grad_scale_prev / scale ** 2
        dues = [(layer, self._steps.host_due(self._group(layer)["T"])) for layer in self._layers]
        if distributed():
            self._average_curvature([layer for layer, due in dues if due is not False])
        owned = set()
        full = self._gather_sharded([layer for layer, _ in dues]) if self._sharded else {}
        per_group: dict[int, tuple[list, list, list]] = {}
        per_diag: dict[int, dict[tuple, tuple[list, ...]]] = {}
        for layer, due in dues:
            module = layer.module
            owned.update(layer.params.values())
            grads = {n: getattr(module, n).grad for n in ("weight", "bias") if getattr(module, n, None) is not None}
            if all(g is None for g in grads.values()):
                continue
            if due is not False:
                self._update_preconditioner(layer, due, c_g)
            sk, sc = self._kinds(layer)
            K, C = self._parts(layer, "K"), self._parts(layer, "C")
            if self._fused_diagonal(layer, sk, sc, K, C):
                bucket = per_diag.setdefault(self._group_of[layer.anchor], {}).setdefault(
                    (layer.anchor.device, layer.anchor.dtype), ([], [], [], [], [], []))
                d_k = K[0].numel()
                for pname, p in layer.params.items():
                    if p.grad is None:
                        continue
                    grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                    for lst, v in zip(bucket, (p, grad, self.state[p].get("momentum_buffer"), K[0],
                                               C[0], 0 if pname == "weight" else d_k - 1)):
                        lst.append(v)
                continue
            local_rows = self._sharded and sk is Diagonal and sc is Diagonal  # elementwise
            if local_rows:
                C = self._own_rows(layer, C, sc)
                grads = {n: local(g) for n, g in grads.items()}
            grads = full.get(id(layer), grads)
            like = next(g for g in grads.values() if g is not None)
            if local_rows:
                gw = grads["weight"].reshape(grads["weight"].shape[0], module.weight.shape[1:].numel())
                gmat = gw if module.bias is None else torch.cat([gw, grads["bias"].unsqueeze(1)], 1)
            else:
                gmat = ref.gradient_matrix(module, grads.get("weight"), grads.get("bias"), like)
            if grad_scale != 1.0:
                gmat = gmat / grad_scale
            state = self.state[layer.anchor]
            if "P_K" in state:
                nat = ref.cached_natural_gradient(state["P_K"], state["P_C"], gmat)
            else:
                nat = ref.natural_gradient(sk, K, sc, C, gmat)
            if distributed():
                self._reduce_natural_gradient(layer, nat)
            params, updates, bufs = per_group.setdefault(self._group_of[layer.anchor], ([], [], []))
            if module.bias is not None:
                pieces = {"weight": nat[:, :-1], "bias": nat[:, -1]}
            else:
                pieces = {"weight": nat}
            for pname, p in layer.params.items():
                if p.grad is None:
                    continue
                piece = pieces[pname]
                if self._sharded and not local_rows:  # each rank keeps its rows
                    piece = own_rows(piece, p)
                params.append(local(p))
                updates.append(piece.reshape(local(p).shape))
                bufs.append(local(self.state[p].get("momentum_buffer")))
        for index, group in enumerate(self.param_groups):
            params, updates, bufs = per_group.setdefault(index, ([], [], []))
            for p in group["params"]:  # parameters no Linear/Conv2d owns: the plain gradient
                if p not in owned and p.grad is not None:
                    grad = local(p.grad)
                    params.append(local(p))
                    updates.append(grad / grad_scale if grad_scale != 1.0 else grad)
                    bufs.append(local(self.state[p].get("momentum_buffer")))
            if params:
                self._apply(params, updates, bufs, group)
            for ps, gs, bs, ks, cs, offs in per_diag.get(index, {}).values():
                ops.singd_diag_step_(ps, gs, bs if group["momentum"] != 0.0 else [], ks, cs, offs,
                                     on(group["lr"], ps[0].device), group["momentum"],
                                     group["weight_decay"], grad_scale)

    def _gather_sharded(self, layers: list[Layer]) -> dict[int, dict[str, Tensor]]:
        """FSDP2: the full gradients of the sharded layers whose structures multiply the whole
        gradient matrix (not diagonal K and C: elementwise, they need only the local rows), in
        one all_gather per dtype."""
        wanted, tensors = [], []
        for layer in layers:
            sk, sc = self._kinds(layer)
            grads = {n: getattr(layer.module, n).grad for n in ("weight", "bias")
                     if getattr(layer.module, n, None) is not None}
            if (sk is Diagonal and sc is Diagonal) or any(
                    g is None or not is_sharded(g) for g in grads.values()):
                continue
            wanted.append((layer, list(grads)))
            tensors += list(grads.values())
        gathered = iter(gather_rows(tensors) if tensors else [])
        return {id(layer): {n: next(gathered) for n in names} for layer, names in wanted}

    @staticmethod
    def _own_rows(layer: Layer, C: tuple, sc) -> tuple:
        """A diagonal C's entries for the local shard's rows (an empty shard: none)."""
        start, stop = rows(layer.module.weight)
        return (C[0][start:stop],)

    def _caches(self, sk, sc) -> bool:
        return self.cache_preconditioner and not (sk is Diagonal and sc is Diagonal)

    def _fused_diagonal(self, layer, sk, sc, K, C) -> bool:
        """Whether the whole step of this layer is one elementwise kernel: diagonal K and C in the
        parameters' op-math dtype, and no natural-gradient collective."""
        if self.backend != "fused" or sk is not Diagonal or sc is not Diagonal or distributed():
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
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        if self.backend == "reference":
            ref.sgd_update_(params, updates, bufs, lr, momentum, wd)
            return
        # Multi-tensor: one launch per op over the group, per (device, dtype).
        buckets: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            buckets.setdefault((p.device, p.dtype), []).append(i)
        for (device, dtype), idx in buckets.items():
            ps = [params[i] for i in idx]
            us = [updates[i] for i in idx]
            if wd != 0.0:
                us = torch._foreach_add(us, ps, alpha=wd)
            if momentum != 0.0:
                bs = [bufs[i] for i in idx]
                torch._foreach_mul_(bs, momentum)
                torch._foreach_add_(bs, us)
                us = bs
            step_lr = on(lr, device)
            torch._foreach_add_(ps, torch._foreach_mul(us, step_lr.to(dtype).neg()))

    # LR schedulers wrap `opt.step` in a function torch.compile refuses to trace; this marks it
    # as already wrapped (`_opt_called` is set once in __init__).
    step._wrapped_by_lr_sched = True

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["singd"] = {"k": self._steps.value(), "grad_scale_prev": self._grad_scale_prev,
                       "layout": self._layout()}
        # Also in every group: torch.distributed.checkpoint keeps only `state` and `param_groups`.
        sd["param_groups"] = [{**g, "singd": copy.deepcopy(sd["singd"])} for g in sd["param_groups"]]
        return sd

    def _layout(self) -> list:
        return [[layer.name, module_class(layer.module).__name__, *self.dims(layer.module)]
                for layer in self._layers]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict.get("param_groups") or [{}]
        if "singd" not in state_dict and "singd" not in groups[0]:
            raise ValueError("not a cafin SINGD checkpoint: missing 'singd'")
        extra = state_dict["singd"] if "singd" in state_dict else groups[0]["singd"]
        if extra.get("layout") != self._layout():
            raise ValueError(f"checkpoint was saved for a different model: layers {extra.get('layout')} "
                             f"do not match this model's {self._layout()}")
        sd = {k: v for k, v in state_dict.items() if k != "singd"}
        sd["param_groups"] = [{k: v for k, v in g.items() if k != "singd"} for g in sd["param_groups"]]
        super().load_state_dict(sd)
        # torch casts every state tensor to its parameter's dtype and may alias the argument's
        # tensors: factors keep their own (preconditioner) dtype, and nothing is shared.
        saved_ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for index, p in zip(saved_ids, params):
            for key, value in sd["state"].get(index, {}).items():
                dtype = p.dtype if key == "momentum_buffer" else value.dtype
                self.state[p][key] = value.detach().to(device=p.device, dtype=dtype, copy=True)
        for group in self.param_groups:  # scalars saved as tensors come back as tensors
            for key in ("lr", "lr_cov"):
                if isinstance(group[key], Tensor) and group["params"]:
                    p = group["params"][0]
                    group[key] = _scalar_tensor(group[key], p.device, _work_dtype(p.dtype))
        self._steps.load(int(extra["k"]))
        self._grad_scale_prev = float(extra["grad_scale_prev"])
        self._attach()


__all__ = ["SINGD", "STRUCTURES"]
