"""K-FAC as a gradient preconditioner, a drop-in for kfac-pytorch 0.4.2's
`kfac.preconditioner.KFACPreconditioner` (KAISA, gpauloski/kfac-pytorch): `step()` after
`backward()` rewrites the gradients of the registered Linear, Conv1d/2d/3d, Embedding and
transformers' Conv1D layers in place with their K-FAC preconditioned, KL-clipped values, and any
torch optimizer then steps.

Per layer: A = E[abar abar^T] and G = E[g g^T] (cafin.factors, kfac-pytorch's normalisation;
an Embedding's A is diagonal, kept and decomposed as a vector),
an EMA of each from the identity, a periodic decomposition (eigh, or damped inverses) and the
preconditioned gradient Q_G[(Q_G^T dW Q_A) / (d_G d_A^T + damping)]Q_A^T (or G^-1 dW A^-1).
Conventions (docs/kfac.md) are kfac-pytorch's; what differs is listed there.

Interval decisions are the core's (cafin.core.steps.StepCounter): on the host while steps run
eagerly, on the device after torch.compile or a CUDA-graph capture.
"""
from __future__ import annotations

import logging
import math
import re
import warnings
from collections import defaultdict
from functools import partial
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ... import factors
from ... import ops, reference
from ...core import (Choice, DropCounts, EigendecompositionWarning, Layer, Real,
                         capturing, check_gradient, check_int, discover, distributed, unwrap)
from ...core.preconditioner import Preconditioner
from ...maths import kfac as kfac_maths
from ...sharding import (check_sharded, gather_rows, gather_to_owners, is_sharded, local, own_rows,
                        scatter_from_owners, shard_dim, shard_group, shard_groups)
from .._docs import _backend_doc, _process_group_doc
from ..kaisa import KaisaAssignment, allreduce_factors, exchange, factor_costs
from .compat import AssignmentStrategy, ComputeMethod, DistributedStrategy, as_enum, kaisa_options

__all__ = ["KFACPreconditioner", "ComputeMethod", "AssignmentStrategy", "DistributedStrategy"]

_BACKENDS = {"fused": ops, "reference": reference}
_PRECISIONS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_PRECISION_NAMES = ", ".join(map(str, _PRECISIONS))


class _LayerState:
    """The tensors of one registered layer."""

    def __init__(self, layer: Layer, factor_dtype: torch.dtype, device: torch.device,
                 eigen: bool, prediv: bool, inv_dtype: torch.dtype) -> None:
        groups, d_a, d_g = factors.factor_sizes(layer.module)
        # An Embedding's A is diagonal: kept as its diagonal [groups, d_a], decomposed as itself.
        diagonal = factors.diagonal_input(layer.module)
        like = dict(dtype=factor_dtype, device=device)
        eye = lambda n: torch.eye(n, **like).expand(groups, n, n).clone()  # noqa: E731
        # the EMA starts from I: kfac-pytorch's first update
        self.A = torch.ones(groups, d_a, **like) if diagonal else eye(d_a)
        self.G = eye(d_g)
        self.stat_A = torch.zeros(groups, d_a, **like) if diagonal else torch.zeros(groups, d_a, d_a, **like)
        self.stat_G = torch.zeros(groups, d_g, d_g, **like)
        # Passes counted per side, in one-element tensors (the ops read 0-dim views): Dynamo
        # traces a captured 0-dim float64 CPU tensor as a Python float, and the AOTAutograd
        # backends (aot_eager, inductor) then drop in-place writes to it, so a compiled forward's
        # count of a float64 model's passes would be lost.
        self.count_A = torch.zeros(1, **like)
        self.count_G = torch.zeros(1, **like)
        # Second-order data, created here so compiled and captured steps find it; it holds the
        # identity preconditioner until the first decomposition.
        inv = dict(dtype=inv_dtype, device=device)
        eye_inv = lambda n: torch.eye(n, **inv).expand(groups, n, n).clone()  # noqa: E731
        if eigen:
            # the eigenbases in row-aligned storage: the fused step's products run faster on it
            basis = lambda n: kfac_maths.aligned_empty((groups, n, n), **inv).copy_(  # noqa: E731
                torch.eye(n, **inv).expand(groups, n, n))
            self.second = {"qg": basis(d_g)} if diagonal else {"qa": basis(d_a), "qg": basis(d_g)}
            if prediv:
                self.second["dgda"] = torch.ones(groups, d_g, d_a, **inv)
            else:
                self.second.update(da=torch.ones(groups, d_a, **inv), dg=torch.ones(groups, d_g, **inv))
        else:
            a_inv = torch.ones(groups, d_a, **inv) if diagonal else eye_inv(d_a)
            self.second = {"a_inv": a_inv, "g_inv": eye_inv(d_g)}
        self.seen = False  # statistics ever taken (a layer whose forward never ran keeps its grad)
        self.decomposed = False  # decomposed at least once by an eager step
        for t in (self.A, self.G, self.stat_A, self.stat_G, self.count_A, self.count_G,
                  *self.second.values()):
            torch._dynamo.mark_static_address(t, guard=False)


class KFACPreconditioner(Preconditioner):
    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Callable[[int], int] | int = 1,
        inv_update_steps: Callable[[int], int] | int = 1,
        damping: Callable[[int], float] | float = 0.001,
        factor_decay: Callable[[int], float] | float = 0.95,
        kl_clip: Callable[[int], float] | float | None = 0.001,
        lr: Callable[[int], float] | float = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: Any = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: Any = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: Any = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: list[str] | str | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        backend: str = "fused",
        decompose_dtype: torch.dtype = torch.float32,
        process_group=None,
        kfac_approx: str = "expand",
    ) -> None:
        Choice(*factors.KFAC_APPROXIMATIONS).check(kfac_approx, "kfac_approx")
        compute_method, kaisa, skip_layers = self._check_arguments(
            model, factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps,
            damping=damping, factor_decay=factor_decay, kl_clip=kl_clip, lr=lr,
            accumulation_steps=accumulation_steps, allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy, colocate_factors=colocate_factors,
            compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            grad_worker_fraction=grad_worker_fraction, symmetry_aware=symmetry_aware,
            factor_dtype=factor_dtype, inv_dtype=inv_dtype, decompose_dtype=decompose_dtype,
            skip_layers=skip_layers, update_factors_in_hook=update_factors_in_hook,
            backend=backend, process_group=process_group)

        self.model = unwrap(model)
        # FSDP2: factors are averaged over the parameters' mesh; gradients go to their owners per step.
        mesh_group = check_sharded(self.model.parameters(), "KFACPreconditioner")
        if process_group is None:
            process_group = mesh_group
        self._kaisa = kaisa
        self.compute_method = compute_method
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self.grad_scaler = grad_scaler
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.decompose_dtype = decompose_dtype
        self.skip_layers = skip_layers
        self.backend = backend
        self.process_group = process_group
        self.kfac_approx = kfac_approx
        self._accumulation_steps = accumulation_steps
        self._update_factors_in_hook = update_factors_in_hook
        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._mini_steps: dict[str, int] = defaultdict(int)
        # Statistics dropped for inf/NaN entries, counted on each device (float32: no sync, and
        # compiled or captured steps can add to it), and how many of them were already reported.
        self._skipped = DropCounts()
        self._skipped_reported = 0
        # Whether step() decomposes on its interval; False leaves that to `decompose()` (a
        # CUDA-graph-captured step cannot hold eigh).
        self.decompose_in_step = True

        self._register_layers(loglevel)
        self._assign_work(loglevel)
        self._stack_second_order()
        # The eager fused step's product buffers, per chain (a layer, or a stack of layers):
        # made on first use, kept (see `_chain`).
        self._chains: dict[tuple[str, ...], _Chain] = {}
        self._choose_backends()
        self._start(self._layers)

    def _check_arguments(self, model, *, factor_update_steps, inv_update_steps, damping, factor_decay,
                         kl_clip, lr, accumulation_steps, allreduce_bucket_cap_mb, assignment_strategy,
                         colocate_factors, compute_method, compute_eigenvalue_outer_product,
                         grad_worker_fraction, symmetry_aware, factor_dtype, inv_dtype, decompose_dtype,
                         skip_layers, update_factors_in_hook, backend, process_group):
        """Validate the constructor's arguments before anything is built (the schedule settings
        are stored as they are checked); returns (compute_method, kaisa options, skip patterns)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        compute_method = as_enum(compute_method, ComputeMethod, "compute_method")
        for name, flag in (("compute_eigenvalue_outer_product", compute_eigenvalue_outer_product),
                           ("update_factors_in_hook", update_factors_in_hook)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        kaisa = kaisa_options(
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb, assignment_strategy=assignment_strategy,
            colocate_factors=colocate_factors, grad_worker_fraction=grad_worker_fraction,
            symmetry_aware=symmetry_aware, compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product)
        for name, value in (("factor_update_steps", factor_update_steps),
                            ("inv_update_steps", inv_update_steps)):
            if not callable(value):
                check_int(value, name, 1)
        check_int(accumulation_steps, "accumulation_steps", 1)
        self._init_settings(dict(damping=damping, factor_decay=factor_decay, kl_clip=kl_clip, lr=lr))
        # The precisions the factors' statistics and EMA, and the preconditioning products, run
        # in (docs/kfac.md "Reduced precision"); float8 and the like have no GEMMs to run them.
        if inv_dtype not in _PRECISIONS:
            raise TypeError(f"inv_dtype must be one of {_PRECISION_NAMES}, got {inv_dtype!r}")
        if decompose_dtype not in (torch.float32, torch.float64):  # eigh and inv_ex take only these
            raise TypeError(f"decompose_dtype must be torch.float32 or torch.float64, got {decompose_dtype!r}")
        if factor_dtype is not None and factor_dtype not in _PRECISIONS:
            raise TypeError(f"factor_dtype must be None or one of {_PRECISION_NAMES}, got {factor_dtype!r}")
        skip_layers = _patterns(skip_layers)
        if (not callable(inv_update_steps) and not callable(factor_update_steps)
                and inv_update_steps % factor_update_steps != 0):
            warnings.warn("It is suggested that inv_update_steps be an integer multiple of "
                          "factor_update_steps", stacklevel=3)
        if process_group is not None and not distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        return compute_method, kaisa, skip_layers

    def _register_layers(self, loglevel: int) -> None:
        """Find the supported layers (not skipped, all parameters trained) and create their state."""
        skipped = {id(m) for name, m in self.model.named_modules()
                   if _any_match(name, self.skip_layers) or _any_match(type(m).__name__, self.skip_layers)}
        params = [p for p in self.model.parameters() if p.requires_grad]

        def accept(module):
            return (factors.supports(module) and id(module) not in skipped
                    and next(module.children(), None) is None
                    and all(p.requires_grad for p in module.parameters()))

        self._layers = discover(self.model, params, accept=accept)
        for layer in self._layers:
            why = factors.unsupported_option(layer.module)
            if why is not None:
                raise ValueError(f"KFACPreconditioner: layer '{layer.name}' is an {why}, which K-FAC's "
                                 "factors do not model; skip it with skip_layers")
        if not self._layers:  # as AdaFisher says: a preconditioner that would change nothing
            warnings.warn("KFACPreconditioner: the model has no supported layer (Linear, Conv1d, "
                          "Conv2d, Conv3d, Embedding, transformers' Conv1D) whose parameters are all "
                          "trained and not skipped (skip_layers); no gradient is preconditioned",
                          UserWarning, stacklevel=3)
        self._gathered: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._owners: dict[str, int] | None = None  # FSDP2: each layer's owner (shard index)
        self._owned_now: dict[str, int] = {}  # this step's sharded layers and their owners
        self._state: dict[str, _LayerState] = {}
        log = logging.getLogger(__name__)
        for layer in self._layers:
            dtype = self.factor_dtype or layer.module.weight.dtype
            self._state[layer.name] = _LayerState(
                layer, dtype, layer.module.weight.device, self.compute_method is ComputeMethod.EIGEN,
                self.compute_eigenvalue_outer_product, self.inv_dtype)
            log.log(loglevel, f'Registered name="{layer.name}": {layer.module!r}')

    def _assign_work(self, loglevel: int) -> None:
        """KAISA: which rank decomposes each factor and which ranks precondition each layer
        (cafin.optim.kaisa), the same on every rank; the process groups that share second-order
        data (a column) and preconditioned gradients (a row); layers this rank does not
        precondition hold no second-order data."""
        import torch.distributed as dist
        group = self.process_group
        rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed() else (0, 1)
        sizes = {layer.name: factors.factor_sizes(layer.module) for layer in self._layers}
        work = factor_costs(sizes, self.assignment_strategy.name.lower())
        self.assignment = KaisaAssignment(work, rank=rank, world=world,
                                          grad_worker_fraction=self.grad_worker_fraction,
                                          colocate_factors=self.colocate_factors)
        self._world = world
        a = self.assignment
        self._column_group = self._row_group = None
        if a.broadcast_inverses() and a.broadcast_gradients():  # HYBRID_OPT: groups of its own
            if world != dist.get_world_size():
                raise ValueError("grad_worker_fraction strictly between 1/world and 1 (HYBRID_OPT) "
                                 "needs process_group to span the whole world")
            for ranks in a.columns:  # every rank creates every group, in one order
                g = dist.new_group(ranks)
                self._column_group = g if ranks is a.my_column else self._column_group
            for ranks in a.rows:
                g = dist.new_group(ranks)
                self._row_group = g if ranks is a.my_row else self._row_group
        elif a.broadcast_inverses():  # COMM_OPT: one column, the whole group
            self._column_group = group
        elif a.broadcast_gradients():  # MEM_OPT: one row, the whole group
            self._row_group = group
        for layer in self._layers:
            if not a.is_grad_worker(layer.name):
                self._state[layer.name].second = {}
        if world > 1:
            logging.getLogger(__name__).log(loglevel, f"KFAC layer assignments: {a}")

    def __deepcopy__(self, memo):
        for group in (self._column_group, self._row_group):  # shared, as the process group is
            if group is not None:
                memo.setdefault(id(group), group)
        # The product buffers are not copied: their bound operations hold the original's
        # tensors; the copy makes its own on its first step.
        memo.setdefault(id(self._chains), {})
        return super().__deepcopy__(memo)

    def _choose_backends(self) -> None:
        """The backend decision, made once: the implementation of the ops for every (device,
        dtype) that a layer's gradients, factors or inv_dtype products have."""
        self._impls: dict[tuple[torch.device, torch.dtype], Any] = {}
        for layer in self._layers:
            device = layer.module.weight.device
            for dtype in (layer.module.weight.dtype, self._state[layer.name].A.dtype, self.inv_dtype):
                self._impls[(device, dtype)] = _implementation(self.backend, device, dtype)
        for layer in self._layers:  # device state created now: a compiled step cannot create it
            self._skipped.counter(layer.module.weight.device)

    def _stack_second_order(self) -> None:
        """Layers whose second-order data have equal shapes share one stacked tensor per kind
        (each layer's entries are views of it), so their preconditioning runs as one batched
        product chain without copying the decompositions every step."""
        self._stacks: list[tuple[list[Layer], dict[str, torch.Tensor]]] = []
        groups: dict[tuple, list[Layer]] = defaultdict(list)
        for layer in self._layers:
            st = self._state[layer.name]
            if not st.second:  # preconditioned by other ranks
                continue
            key = (st.A.device, tuple((k, tuple(v.shape[1:])) for k, v in sorted(st.second.items())))
            groups[key].append(layer)
        for members in groups.values():
            if len(members) < 2:
                continue
            states = [self._state[layer.name] for layer in members]
            stacked = {}
            for key in states[0].second:
                joined = torch.cat([st.second[key] for st in states])
                if key in ("qa", "qg"):  # eigenbases stay in row-aligned storage
                    joined = kfac_maths.aligned_empty(joined.shape, dtype=joined.dtype,
                                                      device=joined.device).copy_(joined)
                stacked[key] = joined
                torch._dynamo.mark_static_address(stacked[key], guard=False)
                views = stacked[key].split([st.A.shape[0] for st in states])
                for st, view in zip(states, views):
                    st.second[key] = view
            self._stacks.append((members, stacked))

    # ------------------------------------------------------------------ hyperparameters
    # numbers or callables of the step (kfac-pytorch's contract); kl_clip None: no clipping
    settings = {"damping": Real(0.0, math.inf, low_open=True),
                "factor_decay": Real(0.0, 1.0, low_open=True),
                "kl_clip": Real(0.0, math.inf, low_open=True),
                "lr": Real(0.0, math.inf)}
    optional_settings = ("kl_clip",)
    callable_settings = True

    def _interval(self, name: str) -> int:
        value = getattr(self, "_" + name)
        if not callable(value):
            return value
        v = value(self.steps)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r} (returned by its callable at "
                             f"step {self.steps})")
        return v

    @property
    def factor_update_steps(self) -> int:
        return self._interval("factor_update_steps")

    @property
    def inv_update_steps(self) -> int:
        return self._interval("inv_update_steps")

    # kfac-pytorch's KAISA options, as checked at construction (cafin.optim.kfac_compat).
    allreduce_bucket_cap_mb = property(lambda self: self._kaisa.allreduce_bucket_cap_mb)
    assignment_strategy = property(lambda self: self._kaisa.assignment_strategy)
    colocate_factors = property(lambda self: self._kaisa.colocate_factors)
    grad_worker_fraction = property(lambda self: self._kaisa.grad_worker_fraction)
    distributed_strategy = property(lambda self: self._kaisa.distributed_strategy)
    symmetry_aware = property(lambda self: self._kaisa.symmetry_aware)

    @property
    def steps(self) -> int:
        return self._steps.value()

    @property
    def layers(self) -> list[Layer]:
        return list(self._layers)

    def __repr__(self) -> str:
        items = [("accumulation_steps", self._accumulation_steps), ("backend", self.backend),
                 ("compute_method", self.compute_method), ("damping", self._values["damping"]),
                 ("factor_decay", self._values["factor_decay"]),
                 ("factor_update_steps", self._factor_update_steps),
                 ("inv_update_steps", self._inv_update_steps), ("kfac_approx", self.kfac_approx),
                 ("kl_clip", self._values["kl_clip"]),
                 ("layers", len(self._layers)), ("lr", self._values["lr"]),
                 ("update_factors_in_hook", self._update_factors_in_hook)]
        return "KFACPreconditioner(\n" + "\n".join(f"  {k}={v}," for k, v in items) + "\n)"

    # ------------------------------------------------------------------ statistics hooks
    def _statistics_gate(self, layer: Layer, device: torch.device):
        self._refresh_settings()  # the hooks may fold with factor_decay: this step's value, checked
        launch, step = self._steps.due(self.factor_update_steps, device)
        # Set here, in the forward: the statistics callbacks run in the gradient hook, which a
        # compiled forward traces only if they write no Python state.
        if launch:
            self._state[layer.name].seen = True
        return launch, step

    def _host_folds(self) -> bool:
        """Whether the hooks fold on the host's count (eager, update_factors_in_hook)."""
        return self._update_factors_in_hook and not self._steps.device_gated

    def take_input_statistics(self, layer: Layer, x: torch.Tensor, step) -> None:
        """Take the statistics of `layer` from its input; its hook calls this."""
        st = self._state[layer.name]
        factors.kfac_input_factor(layer.module, x, self.kfac_approx, out=st.stat_A, accumulate=True)
        st.count_A.add_(1)
        if self._host_folds():
            self._mini_steps[layer.name] += 1
            if self._mini_steps[layer.name] % self._accumulation_steps == 0:
                self._fold_statistics([st.A], [st.stat_A], [st.count_A], st.A.device)

    def take_grad_statistics(self, layer: Layer, g: torch.Tensor, step) -> None:
        """Take the statistics of `layer` from its output gradient; its hook calls this."""
        st = self._state[layer.name]
        if self.grad_scaler is not None:
            scale = self.grad_scaler
            if hasattr(scale, "_get_scale_async"):
                s = scale._get_scale_async()
                g = g / (s.to(g.device) if s is not None else 1.0)
            else:
                g = g / scale()
        factors.kfac_grad_factor(layer.module, g, self.kfac_approx, out=st.stat_G, accumulate=True,
                                 dtype=st.stat_G.dtype)
        st.count_G.add_(1)
        if self._host_folds() and self._mini_steps[layer.name] % self._accumulation_steps == 0:
            self._fold_statistics([st.G], [st.stat_G], [st.count_G], st.G.device)

    @property
    def skipped_factor_updates(self) -> int:
        """Factor statistics (one side of one layer's fold) dropped because they held inf or
        NaN, a GradScaler overflow pass's for instance (reads device counters)."""
        return self._skipped.total()

    def _fold_statistics(self, fs, ss, cs, device, step=None, interval=1) -> None:
        """Fold statistics into factors on `device`, one op call per factor dtype. The op drops
        a non-finite statistic; it is counted here first, on the device (the op empties it)."""
        if not fs:
            return
        dropped = torch.stack([(c > 0) & ~torch.isfinite(s).all() for s, c in zip(ss, cs)]).sum()
        if step is not None:  # device gated: only a due step would have folded them
            dropped = dropped * (torch.remainder(step, interval) == 0)
        self._skipped.counter(device).add_(dropped)
        by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        decay = self._settings_on(device)["factor_decay"]
        for f, s, c in zip(fs, ss, cs):
            if f.dim() == 2:  # a diagonal factor (Embedding's A): nothing to symmetrise
                kfac_maths.diagonal_factor_ema_(f, s, c.view(()), decay, step, interval)
                continue
            lists = by_dtype.setdefault(f.dtype, [[], [], []])
            lists[0].append(f)
            lists[1].append(s)
            lists[2].append(c.view(()))
        for dtype, (f_, s_, c_) in by_dtype.items():
            self._impl_for(device, dtype).kfac_factor_ema_(f_, s_, c_, decay, step, interval)

    def _impl_for(self, device: torch.device, dtype: torch.dtype):
        """The implementation chosen at construction for tensors of this device and dtype."""
        impl = self._impls.get((device, dtype))
        if impl is None:
            raise RuntimeError(f"KFACPreconditioner: a registered layer now has {dtype} tensors on "
                               f"{device}, which it did not have at construction; move the model "
                               "before creating the preconditioner")
        return impl

    def _report_skipped(self) -> None:
        """Warn of the statistics dropped since the last report (by this step's fold or by the
        hooks' folds of its passes), where reading the count costs no sync: CPU counters, eager
        steps. On CUDA the count is `skipped_factor_updates`."""
        if capturing():  # a read of the count: the next eager step reports it
            return
        total = self._skipped.total(cpu_only=True)
        if total > self._skipped_reported:
            warnings.warn(f"KFACPreconditioner: {total - self._skipped_reported} factor statistic(s) "
                          "held inf/NaN and were dropped; their factors keep their previous values",
                          RuntimeWarning, stacklevel=5)
            self._skipped_reported = total

    def reset_batch(self) -> None:
        """Drop the statistics taken since the last factor update."""
        for st in self._state.values():
            for t in (st.stat_A, st.stat_G, st.count_A, st.count_G):
                t.zero_()

    # ------------------------------------------------------------------ step
    def _by_device(self, names=None):
        out: dict[torch.device, list[_LayerState]] = defaultdict(list)
        for layer in self._layers:
            if names is None or layer.name in names:
                st = self._state[layer.name]
                out[st.A.device].append(st)
        return out

    def _update_factors(self) -> None:
        gated = self._steps.host_due(self.factor_update_steps)
        if gated is None:  # device gated: fold every step, the op decides
            for device, sts in self._by_device().items():
                step = self._steps.tensor(device)
                fs = [t for st in sts for t in (st.A, st.G)]
                ss = [t for st in sts for t in (st.stat_A, st.stat_G)]
                cs = [t for st in sts for t in (st.count_A, st.count_G)]
                self._fold_statistics(fs, ss, cs, device, step, self.factor_update_steps)
        elif gated and not self._update_factors_in_hook:
            for device, sts in self._by_device().items():
                fs = [t for st in sts for t in (st.A, st.G)]
                ss = [t for st in sts for t in (st.stat_A, st.stat_G)]
                cs = [t for st in sts for t in (st.count_A, st.count_G)]
                self._fold_statistics(fs, ss, cs, device)
        if distributed() and gated is not False and self._layers and self._world > 1:
            self._reduce_factors()

    def _reduce_factors(self) -> None:
        """Average every factor over the ranks: buckets of allreduce_bucket_cap_mb, the upper
        triangles only with symmetry_aware."""
        allreduce_factors([t for sts in self._by_device().values() for st in sts for t in (st.A, st.G)],
                          self.process_group, self._world, cap_bytes=self.allreduce_bucket_cap_mb * 1e6,
                          symmetric=self.symmetry_aware)

    def _module(self, name: str) -> nn.Module:
        return next(layer.module for layer in self._layers if layer.name == name)

    def _live(self, layer: Layer) -> bool:
        return self._state[layer.name].seen

    def decompose(self) -> None:
        """Recompute every live layer's decompositions now, with the current damping (eagerly;
        for a captured step whose `decompose_in_step` is False). Under torch.distributed it is
        a collective, as the step's: each rank decomposes its share and the second-order data is
        shared."""
        self._compute_inverses()

    def _my_sides(self, share: bool) -> set[tuple[str, str]]:
        """(layer, "a" or "g") this rank decomposes: the factors it is the inverse worker of
        (share=True), or every factor of the layers it preconditions (no collective needed)."""
        a = self.assignment
        if share:
            return {(layer.name, side) for layer in self._layers for side in "ag"
                    if a.inv_worker(layer.name, side.upper()) == a.rank}
        return {(layer.name, side) for layer in self._layers for side in "ag" if a.is_grad_worker(layer.name)}

    def _compute_inverses(self) -> None:
        """Decompose this rank's share of the factors, then share the results with the other
        gradient workers of each layer."""
        self._decompose(None, self._my_sides(share=True))
        self._share_second_order()
        self._share_decomposed()

    def _share_decomposed(self) -> None:
        """MEM_OPT and HYBRID_OPT: whether each layer is decomposed, from its column to every
        rank (one all_gather per device over the row), so that every rank rewrites the same
        layers and sends or receives their preconditioned gradients."""
        a = self.assignment
        if not a.broadcast_gradients():
            return
        held: dict[torch.device, list[list[torch.Tensor]]] = defaultdict(lambda: [[] for _ in a.my_row])
        flags = []
        for layer in self._layers:
            st = self._state[layer.name]
            flag = torch.full((1,), float(st.decomposed and a.is_grad_worker(layer.name)), device=st.A.device)
            held[st.A.device][a.column(layer.name)].append(flag)  # row[c] is in column c
            flags.append((st, flag))
        for lists in held.values():
            exchange(lists, a.my_row.index(a.rank), self._row_group)
        done = torch.cat([f.cpu() for _, f in flags]).tolist() if flags else []
        for (st, _), ok in zip(flags, done):
            st.decomposed = ok == 1.0

    def _second_order_keys(self, st: _LayerState, side: str) -> list[str]:
        """The second-order tensors the inverse worker of a layer's `side` factor computes (a
        diagonal A, an Embedding's, has no basis)."""
        if self.compute_method is not ComputeMethod.EIGEN:
            return [f"{side}_inv"]
        if self.compute_eigenvalue_outer_product:  # colocated: the G side carries the product
            keys = ["qa"] if side == "a" else ["qg", "dgda"]
        else:
            keys = ["q" + side, "d" + side]
        return [k for k in keys if k in st.second]

    def _share_second_order(self) -> None:
        """Within this rank's column (the gradient workers of its layers), every inverse
        worker's results and whether its layer is decomposed, in one all_gather per device."""
        a = self.assignment
        if not a.broadcast_inverses():
            return
        column = a.my_column
        held: dict[torch.device, list[list[torch.Tensor]]] = defaultdict(lambda: [[] for _ in column])
        flags: list[tuple[_LayerState, torch.Tensor]] = []
        for layer in self._layers:
            if not a.is_grad_worker(layer.name):
                continue
            st = self._state[layer.name]
            # [decomposed by the A side's worker, by the G side's]
            flag = torch.full((2,), float(st.decomposed), dtype=self.inv_dtype, device=st.A.device)
            for i, side in enumerate("ag"):
                member = column.index(a.inv_worker(layer.name, side.upper()))
                held[st.A.device][member] += [st.second[k] for k in self._second_order_keys(st, side)]
                held[st.A.device][member].append(flag[i:i + 1])
            flags.append((st, flag))
        for lists in held.values():
            exchange(lists, column.index(a.rank), self._column_group)
        done = torch.cat([f.cpu() for _, f in flags]).view(-1, 2).tolist() if flags else []
        for (st, _), ok in zip(flags, done):  # one host read: eager steps only
            st.decomposed = ok == [1.0, 1.0]

    def _decompose(self, gate: torch.Tensor | None, sides: set[tuple[str, str]] | None = None) -> None:
        """Decompositions of the live layers' factors (those in `sides`; None: all), batched
        over factors of equal shape and dtype. With `gate` (a device bool), new values are kept
        only where it holds."""
        live = [layer for layer in self._layers if self._live(layer)]
        eigen = self.compute_method is ComputeMethod.EIGEN
        prediv = eigen and self.compute_eigenvalue_outer_product
        eigenvalues: dict[tuple[str, str], torch.Tensor] = {}
        # Eagerly, every result is kept aside and stored once all are made: a layer whose
        # decomposition fails (in decompose_dtype, then in float64) keeps all its previous ones.
        results: list[tuple[_LayerState, str, torch.Tensor]] = []
        failed: set[int] = set()
        for side in ("a", "g"):
            # Batched over equal shapes on GPUs (fewer launches); one by one on CPUs, where
            # LAPACK loops anyway and a batched call rounds differently from kfac-pytorch's.
            buckets: dict[tuple, list[_LayerState]] = defaultdict(list)
            for layer in live:
                if sides is not None and (layer.name, side) not in sides:
                    continue
                f = getattr(self._state[layer.name], side.upper())
                if f.dim() == 2:  # a diagonal factor: its own eigenvalues, basis I
                    self._diagonal_decomposition(self._state[layer.name], results, eigenvalues, prediv)
                    continue
                key = (f.shape[1:], f.dtype, f.device) if f.device.type != "cpu" else (layer.name, None, f.device)
                buckets[key].append(self._state[layer.name])
            for (_, _, device), sts in buckets.items():
                stacked = torch.cat([getattr(st, side.upper()) for st in sts])
                sizes = [st.A.shape[0] for st in sts]
                if eigen:
                    out = self._eigen_decompose(stacked, sts, side, gate)
                    if out is None:
                        failed.update(id(st) for st in sts)
                        continue
                    for st, di, qi in zip(sts, out[0].split(sizes), out[1].split(sizes)):
                        results.append((st, "q" + side, qi))
                        if prediv:
                            eigenvalues[(id(st), side)] = di
                        else:
                            results.append((st, "d" + side, di))
                else:
                    inv = kfac_maths.damped_inverse(stacked, self._settings_on(device)["damping"],
                                            decompose_dtype=self.decompose_dtype,
                                            out_dtype=self.inv_dtype)
                    for st, ii in zip(sts, inv.split(sizes)):
                        results.append((st, f"{side}_inv", ii))
        for st, key, value in results:
            if id(st) not in failed:
                _store(st.second, key, value, gate)
        for layer in live:
            st = self._state[layer.name]
            if id(st) in failed or (sides is not None and (layer.name, "a") not in sides
                                    and (layer.name, "g") not in sides):
                continue
            if gate is None:
                st.decomposed = True
            if prediv:
                damping = self._settings_on(st.A.device)["damping"].to(self.inv_dtype)
                _store(st.second, "dgda", kfac_maths.eigenvalue_reciprocal(
                    eigenvalues[(id(st), "g")], eigenvalues[(id(st), "a")], damping), gate)

    def _diagonal_decomposition(self, st: _LayerState, results: list, eigenvalues: dict,
                                prediv: bool) -> None:
        """The decomposition of a diagonal A (an Embedding's): eigenvalues its entries, or the
        inverse 1 / (a + damping); it cannot fail."""
        if self.compute_method is ComputeMethod.EIGEN:
            d = kfac_maths.diagonal_eigenvalues(st.A, decompose_dtype=self.decompose_dtype,
                                                out_dtype=self.inv_dtype)
            if prediv:
                eigenvalues[(id(st), "a")] = d
            else:
                results.append((st, "da", d))
        else:
            damping = self._settings_on(st.A.device)["damping"]
            results.append((st, "a_inv", kfac_maths.diagonal_damped_inverse(
                st.A, damping, decompose_dtype=self.decompose_dtype, out_dtype=self.inv_dtype)))

    def _eigen_decompose(self, stacked, sts, side, gate):
        """(d, q) of stacked factors; eagerly, a failed eigh is retried in float64, and if that
        fails too, None (with a warning: the layers keep their previous decompositions)."""
        if gate is not None:  # compiled: no exception to catch
            return kfac_maths.eigen_decompose(stacked, decompose_dtype=self.decompose_dtype,
                                              out_dtype=self.inv_dtype)
        for dtype in dict.fromkeys((self.decompose_dtype, torch.float64)):
            try:
                return kfac_maths.eigen_decompose(stacked, decompose_dtype=dtype,
                                                  out_dtype=self.inv_dtype)
            except torch.linalg.LinAlgError:
                continue
        names = [layer.name for layer in self._layers if any(self._state[layer.name] is st for st in sts)]
        warnings.warn(f"KFACPreconditioner: the eigendecomposition of the {side.upper()} factor of "
                      f"{names} failed in {self.decompose_dtype} and in float64; they keep their "
                      "previous decompositions", EigendecompositionWarning, stacklevel=4)
        return None

    def _check_grads(self) -> None:
        """Every registered gradient as its parameter is (dtype, shape, device, dense), or an
        error naming it before the step writes anything."""
        for layer in self._layers:
            for name, p in layer.module.named_parameters(recurse=False):
                check_gradient(p, "KFACPreconditioner", f"KFACPreconditioner: layer '{layer.name}', {name}")

    def _grads(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's weight and bias gradients: the full ones gathered this step when sharded."""
        m = layer.module
        if layer.name in self._gathered:
            return self._gathered[layer.name]
        return m.weight.grad, None if getattr(m, "bias", None) is None else m.bias.grad

    def _grad(self, layer: Layer) -> torch.Tensor:
        return factors.grad_matrix(layer.module, *self._grads(layer))

    def _gather(self, active: list[Layer]) -> list[Layer]:
        """FSDP2: the full gradients this rank preconditions; returns the layers it rewrites.

        Owner scheme (`_gradient_owners`): each sharded layer's gradient goes whole to its owner
        only (one all_to_all per dtype), which preconditions it; the other ranks skip it and get
        their rows back in `_keep_own_rows`. Otherwise every rank gathers every sharded
        gradient (one all_gather per dtype), preconditions its share and keeps its rows."""
        self._gathered, self._owned_now = {}, {}
        sharded = [layer for layer in active if is_sharded(layer.module.weight.grad)]
        if not sharded:
            return active
        tensors = []
        for layer in sharded:
            bias = getattr(layer.module, "bias", None)
            if bias is not None and not is_sharded(bias.grad):
                raise RuntimeError(f"KFACPreconditioner: layer '{layer.name}' has a sharded weight "
                                   "but an unsharded bias; shard whole modules with fully_shard")
            tensors += [layer.module.weight.grad] + ([bias.grad] if bias is not None else [])
        owners = self._gradient_owners(tensors[0])
        if owners is None:
            full = iter(gather_rows(tensors))  # over the mesh the gradients are sharded on
        else:
            self._owned_now = {layer.name: owners[layer.name] for layer in sharded}
            per_tensor = [owners[layer.name] for layer in sharded
                          for _ in range(1 + (getattr(layer.module, "bias", None) is not None))]
            full = iter(gather_to_owners(tensors, per_tensor))
        for layer in sharded:
            self._gathered[layer.name] = (next(full), next(full) if getattr(layer.module, "bias", None)
                                          is not None else None)
        if owners is None:
            return active
        me = tensors[0].device_mesh.get_local_rank(shard_dim(tensors[0]))
        return [layer for layer in active if self._owned_now.get(layer.name, me) == me]

    def _gradient_owners(self, p) -> dict[str, int] | None:
        """FSDP2: per layer, the shard index of its gradient's owner, the member of each shard
        group at the shard coordinate of the layer's KAISA inverse worker (of G): on a 1-D mesh
        that worker itself, which holds the layer's second-order data for every strategy. None
        (every rank gathers every gradient) where some shard group's owner would lack that data
        (HSDP with MEM_OPT, or HYBRID_OPT columns that do not meet every shard group at the
        worker's coordinate) or process_group is not the mesh's ranks. `p`: a sharded gradient."""
        if self._owners is not None:
            return self._owners or None
        import torch.distributed as dist
        a = self.assignment
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)  # global rank of each KAISA rank
        groups = shard_groups(p.device_mesh)
        owners: dict[str, int] = {}
        if sorted(r for g in groups for r in g) == sorted(ranks):
            coordinate = {r: s for g in groups for s, r in enumerate(g)}
            for layer in self._layers:
                s = coordinate[ranks[a.inv_worker(layer.name, "G")]]
                column = a.columns[a.column(layer.name)]
                if any(ranks.index(g[s]) not in column for g in groups):
                    owners = {}
                    break
                owners[layer.name] = s
        self._owners = owners
        return owners or None

    def _precondition(self, grad: torch.Tensor, s: dict[str, torch.Tensor], device) -> torch.Tensor:
        """The preconditioned gradient [groups, d_g, d_a] (in grad's dtype) of one layer, or of a
        stack of layers sharing second-order shapes."""
        work = grad.to(self.inv_dtype)
        if self.compute_method is ComputeMethod.EIGEN:
            if self.compute_eigenvalue_outer_product:
                v = kfac_maths.eigen_precondition(work, s.get("qa"), s["qg"], dgda=s["dgda"])
            else:
                damping = self._settings_on(device)["damping"]
                v = kfac_maths.eigen_precondition(
                    work, s.get("qa"), s["qg"], da=s["da"], dg=s["dg"], damping=damping,
                    scale_=self._impl_for(device, self.inv_dtype).kfac_eigen_scale_)
        else:
            v = kfac_maths.inverse_precondition(work, s["a_inv"], s["g_inv"])
        return v.to(grad.dtype).contiguous()

    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers in place (call after backward(),
        before the optimizer's step). Under torch.distributed it is a collective."""
        self._check_step()
        self._update_factors()
        if self.decompose_in_step:
            self._update_inverses()
        active = self._gather(self._active_layers())  # FSDP2 owner scheme: the layers this rank owns
        precond = self._precondition_grads(active)
        shared = [layer for layer in active if layer.name not in self._owned_now]  # not sent back by owners
        self._share_preconditioned_grads(shared, precond)
        self._update_grads(active, precond)
        self._keep_own_rows()
        self._advance()

    def _graph_settings(self) -> tuple:
        return (("factor_update_steps", self._factor_update_steps),
                ("inv_update_steps", self._inv_update_steps),
                ("decompose_in_step", self.decompose_in_step), ("compute_method", self.compute_method))

    def _capture_refusal(self) -> str | None:
        if (self.decompose_in_step and self.compute_method is ComputeMethod.EIGEN
                and self._steps.host_due(self.inv_update_steps) is not False):
            return ("torch.linalg.eigh (the inverse step's decompositions) syncs with the host on "
                    "CUDA, which a capture forbids")
        return None

    def _check_step(self) -> None:
        """Every value the step reads, checked before it writes anything (callables are
        evaluated for this step count here)."""
        if capturing() and self._capture_refusal() is not None:
            raise RuntimeError("torch.linalg.eigh cannot be captured in a CUDA graph: capture with "
                               "cafin.StepGraphs (it runs the inverse steps eagerly), or set "
                               "preconditioner.decompose_in_step = False, capture the step, and call "
                               "preconditioner.decompose() eagerly every inv_update_steps steps")
        self._refresh_settings()
        self.factor_update_steps, self.inv_update_steps  # noqa: B018  (checked; errors name them)
        self._check_grads()

    def _update_inverses(self) -> None:
        """On inv_update_steps: eagerly, this rank's share of the decompositions, then shared; a
        device-gated step decomposes every factor on the device (no collective)."""
        due = self._steps.host_due(self.inv_update_steps)
        if due is None:
            self._check_device_gated()
            devices = {self._state[layer.name].A.device for layer in self._layers}
            if len(devices) > 1:
                raise RuntimeError("a device-gated K-FAC step needs every layer on one device")
            if devices:
                device = devices.pop()
                # every layer is this rank's to precondition (COMM_OPT, checked): all of them
                self._decompose(torch.remainder(self._steps.tensor(device), self.inv_update_steps) == 0)
        elif due:
            self._compute_inverses()

    def _check_device_gated(self) -> None:
        if self._steps.device_gated and self.assignment.broadcast_gradients():
            raise RuntimeError("a compiled or captured K-FAC step needs grad_worker_fraction=1 "
                               "(COMM_OPT) under torch.distributed: the preconditioned gradients "
                               "of MEM_OPT and HYBRID_OPT are shared by eager collectives")

    def _active_layers(self) -> list[Layer]:
        """The layers whose gradients the step rewrites: statistics taken, gradients present,
        decomposed at least once (kfac-pytorch raises otherwise; cafin leaves them as they are)."""
        active = []
        for layer in self._layers:
            m = layer.module
            if not self._live(layer) or m.weight.grad is None or (
                    getattr(m, "bias", None) is not None and m.bias.grad is None):
                continue  # never ran (or unused this step): its gradient is left as it is
            if not (self._state[layer.name].decomposed or self._steps.device_gated):
                continue  # not decomposed yet (kfac-pytorch raises): left as it is
            active.append(layer)
        return active

    def _precondition_grads(self, active: list[Layer]) -> dict[str, torch.Tensor]:
        """The preconditioned gradients of the active layers this rank is a gradient worker of:
        layers stacked by second-order shape in one product chain, the others one by one."""
        precond: dict[str, torch.Tensor] = {}
        names = {layer.name for layer in active if self.assignment.is_grad_worker(layer.name)}
        chained = self._chained()
        chains: list[_Chain] = []  # their pieces go into precond now; `_run_chains` fills them
        for members, stacked in self._stacks:
            if not all(layer.name in names for layer in members):
                continue
            if len({self._grads(layer)[0].dtype for layer in members}) > 1:
                continue
            if chained:
                chains.append(self._chain(members, stacked))
                pieces = chains[-1].pieces
            else:
                v = self._precondition(torch.cat([self._grad(layer) for layer in members]), stacked,
                                       members[0].module.weight.device)
                pieces = v.split([self._state[layer.name].A.shape[0] for layer in members])
            for layer, piece in zip(members, pieces):
                precond[layer.name] = piece
        for layer in active:
            if layer.name in names and layer.name not in precond:
                second = self._state[layer.name].second
                if chained:
                    chains.append(self._chain([layer], second))
                    precond[layer.name] = chains[-1].pieces[0]
                else:
                    precond[layer.name] = self._precondition(self._grad(layer), second,
                                                             layer.module.weight.device)
        self._run_chains(chains)
        return precond

    def _chained(self) -> bool:
        """Whether this step's products run through kept buffers (`_chain`): the fused backend's
        eager steps with eigenbases and the eigenvalue outer product (the default). A compiled
        or captured step keeps the plain products, whose memory the compiler or the graph's
        pool plans."""
        return (self.backend == "fused" and self.compute_method is ComputeMethod.EIGEN
                and self.compute_eigenvalue_outer_product and not torch.compiler.is_compiling()
                and not capturing())

    def _chain(self, layers: list[Layer], s: dict[str, torch.Tensor]) -> _Chain:
        """The kept buffers (`_Chain`) of `layers` (one, or a stack sharing the second-order data
        `s`), with the layers' gradients copied into its row-aligned matrices (no
        concatenation); `_run_chains` then writes the products of `_precondition` into kept
        buffers (no allocation), and each chain's `pieces` are its layers' preconditioned
        gradients [groups, d_g, d_a] in their gradients' dtype."""
        w = self._grads(layers[0])[0]
        key = tuple(layer.name for layer in layers)
        chain = self._chains.get(key)
        if chain is None or not chain.fits(w, s):
            chain = _Chain(layers, [self._state[layer.name].A.shape[0] for layer in layers], s,
                           self.inv_dtype, w)
            self._chains[key] = chain
        for layer, into in zip(layers, chain.into):
            _copy_into(self._grads(layer), into)
        return chain

    def _run_chains(self, chains: list[_Chain]) -> None:
        """The products of the chains, in the form `_per_layer_products` picks for the device:
        the per-layer ones in one `kfac_eigen_products_` call per device (on the CPU it shares
        the layers out over the threads), then their copies out."""
        per_layer: dict[torch.device, list[tuple[torch.Tensor, ...]]] = defaultdict(list)
        for chain in chains:
            if chain.per_layer:
                per_layer[chain.grad.device].extend(chain.products)
                continue
            qa, qg, dgda = chain.sources
            kfac_maths.eigen_precondition_into(chain.grad, qa, qg, dgda, chain.work, chain.outs[0])
        for device, products in per_layer.items():
            grads, works, qa, qg, dgda = zip(*products)
            self._impl_for(device, self.inv_dtype).kfac_eigen_products_(
                grads, works, [None] * len(grads), qa, qg, dgda)
        for chain in chains:
            for copy in chain.copies:
                copy()

    def _share_preconditioned_grads(self, active: list[Layer], precond: dict[str, torch.Tensor]) -> None:
        """MEM_OPT and HYBRID_OPT: within this rank's row (one rank of every column), each
        layer's preconditioned gradient from its column's rank, in one all_gather per device
        and dtype; `precond` then holds every active layer's."""
        a = self.assignment
        if not a.broadcast_gradients():
            return
        self._check_device_gated()
        row = a.my_row
        held: dict[tuple, list[list[torch.Tensor]]] = defaultdict(lambda: [[] for _ in row])
        for layer in active:
            if layer.name not in precond:
                w = self._grads(layer)[0]
                groups, d_a, d_g = factors.factor_sizes(layer.module)
                precond[layer.name] = torch.empty(groups, d_g, d_a, dtype=w.dtype, device=w.device)
            v = precond[layer.name]
            held[(v.device, v.dtype)][a.column(layer.name)].append(v)  # row[c] is in column c
        for lists in held.values():
            exchange(lists, row.index(a.rank), self._row_group)

    def _update_grads(self, active: list[Layer], precond: dict[str, torch.Tensor]) -> None:
        """Write the KL-clipped preconditioned gradients into the gradients, one op call per
        device and dtype (one clip factor over all of them)."""
        buckets: dict[tuple, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
        for layer in active:
            w, b = self._grads(layer)
            w = factors.weight_grad_view(layer.module, w)  # [gradient side, input side], as the matrix
            ws, bs, vs = buckets[(w.device, w.dtype)]
            ws.append(w)
            bs.append(b if b is not None else _empty(w))
            vs.append(precond[layer.name])
        # A callable kl_clip returning None is a NaN tensor, which both backends read as "off".
        kl_off = self._values["kl_clip"] is None
        joint = None
        if self._owned_now and not kl_off:  # FSDP2 owner scheme: the owners' sums, all-reduced
            joint = self._owner_kl_scale(active, precond)
        elif len(buckets) > 1 and not kl_off:
            joint = self._joint_kl_scale(active, precond)
        for (device, dtype), (ws, bs, vs) in buckets.items():
            ts = self._settings_on(device)
            impl = self._impl_for(device, dtype)
            if joint is not None:  # the clip factor is applied here, the op only writes
                vs = [v * joint.to(device=device, dtype=v.dtype) for v in vs]
            kl = None if kl_off or joint is not None else ts["kl_clip"]
            if impl is ops:
                _apply_contiguous(impl, ws, bs, vs, ts["lr"], kl)
            else:
                impl.kfac_precondition_apply_(ws, bs, vs, ts["lr"], kl)

    def _keep_own_rows(self) -> None:
        """FSDP2: each rank's rows of the rewritten full gradients into its shards: under the owner
        scheme the owners send them (one all_to_all per dtype), else each rank keeps its own."""
        if self._owned_now:
            names = list(self._owned_now)
            tensors, fulls, owners = [], [], []
            for name in names:
                m = self._module(name)
                for p, full in zip((m.weight, getattr(m, "bias", None)), self._gathered[name]):
                    if p is not None:
                        tensors.append(p.grad)
                        fulls.append(full)
                        owners.append(self._owned_now[name])
            for grad, rows in zip(tensors, scatter_from_owners(fulls, tensors, owners)):
                local(grad).copy_(rows)
        else:
            for name, (w, b) in self._gathered.items():
                m = self._module(name)
                local(m.weight.grad).copy_(own_rows(w, m.weight.grad))
                if b is not None:
                    local(m.bias.grad).copy_(own_rows(b, m.bias.grad))
        self._gathered, self._owned_now = {}, {}

    def _owner_kl_scale(self, active: list[Layer], precond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The KL-clip factor under the FSDP2 owner scheme: each rank sums <V, grad> over the
        sharded layers it owns, one all_reduce within the shard group adds them up, and the
        unsharded layers (the same on every rank) are added once. Accumulated in float64 when any
        sharded layer is (the same choice on every rank), else float32."""
        import torch.distributed as dist
        sharded = [self._module(name).weight for name in self._owned_now]
        acc = torch.float64 if any(w.dtype == torch.float64 for w in sharded) else torch.float32
        device = sharded[0].device
        owned = torch.zeros((), dtype=acc, device=device)
        rest = torch.zeros((), dtype=acc, device=device)
        for layer in active:
            term = (precond[layer.name].to(acc) * self._grad(layer).to(acc)).sum().to(device)
            if layer.name in self._owned_now:
                owned = owned + term
            else:
                rest = rest + term
        dist.all_reduce(owned, group=shard_group(sharded[0]))
        ts = self._settings_on(device)
        return kfac_maths.kl_clip_scale((owned + rest) * ts["lr"].to(acc) ** 2, ts["kl_clip"])

    def _advance(self) -> None:
        self._mini_steps = defaultdict(int)
        self._steps.advance()
        if not torch.compiler.is_compiling():
            self._stale = True
            self._refresh_settings(quiet=True)  # next step's values now; a bad one raises at the next use
            self._report_skipped()  # last: a warning turned into an error finds the step done

    def _joint_kl_scale(self, active: list[Layer], precond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The KL-clip factor of layers of several dtypes or devices: one sum of <V, grad> over
        all of them (float64 when any gradient is, else float32), on the first layer's device."""
        acc = torch.float64 if any(precond[layer.name].dtype == torch.float64 for layer in active) else torch.float32
        device = active[0].module.weight.device
        vg = torch.zeros((), dtype=acc, device=device)
        for layer in active:
            v = precond[layer.name]
            vg = vg + (v.to(acc) * self._grad(layer).to(acc)).sum().to(device)
        ts = self._settings_on(device)
        return kfac_maths.kl_clip_scale(vg * ts["lr"].to(acc) ** 2, ts["kl_clip"])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """kfac-pytorch's layout: steps, the non-callable hyperparameters and, per layer name,
        its factors 'A' and 'G' ([d, d]; [groups, d, d] for grouped convolutions)."""
        sd: dict[str, Any] = {"steps": self.steps}
        if not callable(self._factor_update_steps):
            sd["factor_update_steps"] = self._factor_update_steps
        if not callable(self._inv_update_steps):
            sd["inv_update_steps"] = self._inv_update_steps
        for name in self.settings:
            if not callable(self._values[name]):
                sd[name] = self._values[name]
        if include_factors:
            sd["layers"] = {}
            for layer in self._layers:
                st = self._state[layer.name]
                A, G = st.A, st.G
                if A.shape[0] == 1:
                    A, G = A[0], G[0]
                sd["layers"][layer.name] = {"A": A.detach().clone() if st.seen else None,
                                            "G": G.detach().clone() if st.seen else None}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Load a state_dict of this class or of kfac-pytorch; checks everything (steps, intervals,
        hyperparameters, every factor's type, shape and finiteness) before changing anything,
        copies the factors onto the layers' devices in their dtype, leaves `state_dict`
        unchanged."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if "steps" not in state_dict:
            raise ValueError("not a KFACPreconditioner state_dict: missing 'steps'")
        steps = _checkpoint_steps(state_dict["steps"])
        for key in ("factor_update_steps", "inv_update_steps"):
            if key in state_dict:
                check_int(state_dict[key], f"state_dict['{key}']", 1)
        for name in self.settings:
            if name in state_dict:
                self._check_setting(name, state_dict[name], " (in state_dict)")
        layers = state_dict.get("layers")
        new = {}
        if layers is not None:
            if not isinstance(layers, Mapping):
                raise TypeError(f"state_dict['layers'] must be a dict, got {type(layers).__name__}")
            mine = {layer.name for layer in self._layers}
            if len(layers) != len(self._layers) or set(layers) != mine:
                raise ValueError(f"state_dict has layers {sorted(layers)}, this preconditioner "
                                 f"has {sorted(mine)}")
            for name, saved in layers.items():
                if not isinstance(saved, Mapping) or "A" not in saved or "G" not in saved:
                    raise KeyError(f"the state of layer '{name}' must be a dict with keys 'A' and 'G'")
                st = self._state[name]
                new[name] = [_checkpoint_factor(saved[key], own, f"factor {key} of layer '{name}'")
                             for key, own in (("A", st.A), ("G", st.G))]
        # Everything is checked: from here on nothing raises on the checkpoint's account.
        self._steps.load(steps)
        for key in ("factor_update_steps", "inv_update_steps"):
            if key in state_dict:
                setattr(self, "_" + key, state_dict[key])
        for name in self.settings:
            if name in state_dict:
                self._set(name, state_dict[name])
        self._stale = True
        self._refresh_settings(quiet=True)
        for name, (A, G) in new.items():
            st = self._state[name]
            if A is not None:
                st.A.copy_(A)
            if G is not None:
                st.G.copy_(G)
            st.seen = st.seen or A is not None or G is not None
        if layers is None and compute_inverses:
            warnings.warn("Layer factors are not included in the state_dict so inverses cannot "
                          "be computed. Skipping inverse computation.", stacklevel=2)
            compute_inverses = False
        if compute_inverses:  # local: every factor of the layers this rank preconditions
            self._decompose(None, self._my_sides(share=False))
            for layer in self._layers:  # the others are decomposed by their gradient workers
                st = self._state[layer.name]
                st.decomposed = st.decomposed or (st.seen and not self.assignment.is_grad_worker(layer.name))

    def memory_usage(self) -> dict[str, int]:
        sizes: dict[str, int] = defaultdict(int)
        for st in self._state.values():
            sizes["a_factors"] += st.A.nbytes
            sizes["g_factors"] += st.G.nbytes
            sizes["a_batch"] += st.stat_A.nbytes
            sizes["g_batch"] += st.stat_G.nbytes
            for key, t in st.second.items():
                sizes["a_inverses" if key in ("qa", "da", "a_inv") else "g_inverses"] += t.nbytes
        sizes["total"] = sum(sizes.values())
        return dict(sizes)


KFACPreconditioner.__doc__ = (
    r"""K-FAC gradient preconditioner, a drop-in for kfac-pytorch 0.4.2's ``KFACPreconditioner``.

    ``step()`` after ``backward()`` rewrites the gradients of the registered layers in place;
    any torch optimizer then steps. Per layer, with :math:`A = E[\bar a \bar a^\top]` over its
    input rows (:math:`\bar a = [a; 1]` with a bias) and :math:`G = E[g g^\top]` over its
    output-gradient rows (kfac-pytorch's normalisation), every factor_update_steps steps
    :math:`F \leftarrow \rho F + (1 - \rho) F_{new}` (:math:`\rho`: factor_decay, from
    :math:`F = I`), every inv_update_steps steps :math:`A = Q_A \mathrm{diag}(d_A) Q_A^\top`,
    :math:`G = Q_G \mathrm{diag}(d_G) Q_G^\top`, and every step:

    .. math::
        V = Q_G \big[ (Q_G^\top \nabla_W Q_A) \oslash (d_G d_A^\top + \lambda) \big] Q_A^\top
            \quad \text{(or } (G + \lambda I)^{-1} \nabla_W (A + \lambda I)^{-1}
            \text{ with "inverse")},

        \nu = \min\Big(1, \sqrt{\kappa \,/\, \big|\textstyle\sum_{layers} \eta^2
            \langle V, \nabla_W \rangle\big|}\Big), \qquad \nabla_W \leftarrow \nu V

    (:math:`\nabla_W`: the weight gradient with the bias gradient as its last column;
    :math:`\lambda`: damping, :math:`\kappa`: kl_clip, :math:`\eta`: lr). The conventions are
    kfac-pytorch's; docs/kfac.md lists them and what differs.

    The arguments after model are keyword only. Up to loglevel they are kfac-pytorch's, with
    its meaning; backend, decompose_dtype and process_group are cafin's own. A callable takes
    the step count ``steps`` and is evaluated by eager steps, which check what it returns
    before anything is written.
    """
    + rf"""
    Args:
        model (nn.Module): the model; its Linear, Conv1d, Conv2d, Conv3d and Embedding
            modules (and subclasses) and transformers' ``Conv1D`` modules whose parameters all
            require grad are registered, except those matched by skip_layers. An Embedding
            with max_norm, scale_grad_by_freq or sparse=True is a ValueError naming it.
        factor_update_steps (int or callable, optional): interval of the factor updates:
            statistics are taken on the passes where steps % factor_update_steps == 0
            (default: 1)
        inv_update_steps (int or callable, optional): interval of the decompositions (best a
            multiple of factor_update_steps; a warning says so otherwise) (default: 1)
        damping (float or callable, optional): :math:`\lambda` (default: 0.001)
        factor_decay (float or callable, optional): :math:`\rho`, the factors' moving-average
            weight (default: 0.95)
        kl_clip (float, callable or None, optional): :math:`\kappa`; None (or a callable
            returning None) turns the clipping off (default: 0.001)
        lr (float or callable, optional): :math:`\eta`, only used by the KL clip (default: 0.1)
        accumulation_steps (int, optional): forward/backward passes per step; their factors
            are averaged (default: 1)
        allreduce_bucket_cap_mb (float, optional): the largest bucket of the factor
            all-reduce, in megabytes (10^6 bytes; a larger factor goes alone; 0: one
            all-reduce per factor) (default: 25.0)
        assignment_strategy (AssignmentStrategy or str, optional): how layers are balanced
            over the inverse workers: "compute" (a factor of size n costs n^3) or "memory"
            (n^2) (default: AssignmentStrategy.COMPUTE)
        colocate_factors (bool, optional): decompose a layer's A and G on one rank; False
            places each factor alone (needs compute_eigenvalue_outer_product=False with
            "eigen"; MEM_OPT turns it on, with a warning, as kfac-pytorch) (default: True)
        compute_method (ComputeMethod or str, optional): "eigen" or "inverse", or a
            ComputeMethod (cafin's or kfac-pytorch's) (default: ComputeMethod.EIGEN)
        compute_eigenvalue_outer_product (bool, optional): precompute
            :math:`1/(d_G d_A^\top + \lambda)` at decomposition (default: True)
        grad_worker_fraction (DistributedStrategy, its name or float, optional): the fraction
            of the ranks that precondition each layer (KAISA), or its strategy (cafin's or
            kfac-pytorch's enum, or the name in any case, "comm_opt"): 1 (COMM_OPT: each layer
            is decomposed on one rank and the results are shared with every rank), 1/world
            (MEM_OPT: the layer's one rank decomposes, preconditions and shares the
            preconditioned gradient), or in between (HYBRID_OPT). Results do not depend on it;
            docs/distributed.md has the cost of each (default: DistributedStrategy.COMM_OPT)
        symmetry_aware (bool, optional): the factor all-reduce sends only the upper triangles
            (default: False)
        grad_scaler (torch.amp.GradScaler or callable, optional): a GradScaler (or a callable
            returning the scale): the gradient statistics are unscaled with it (default: None)
        factor_dtype (torch.dtype, optional): dtype of the factors, their statistics GEMMs
            and moving average: torch.float64, float32, bfloat16 or float16 (default: None:
            the layer weight's dtype)
        inv_dtype (torch.dtype, optional): dtype the decompositions are kept in and the
            preconditioning products (GEMMs) run in: torch.float64, float32, bfloat16 or
            float16. Reduced precision, its measured accuracy and TF32: docs/kfac.md
            (default: torch.float32)
        skip_layers (str or list[str], optional): a regular expression, or a list of them,
            searched in module names and class names (default: None)
        update_factors_in_hook (bool, optional): fold the statistics into the factors in the
            hooks (True) or at the start of step(). A statistic holding inf or NaN (a
            GradScaler overflow pass) is dropped, never folded: counted in
            ``skipped_factor_updates`` and, for layers on the CPU, reported by step() as a
            RuntimeWarning (default: True)
        loglevel (int, optional): level of the registration log lines (default: logging.DEBUG)
        {_backend_doc}
            The choice is made once, here, per (device, dtype) of the tensors
            each op works on (a layer's weight gradients, its factors, the inv_dtype
            products): "fused" runs the kernels where cafin has them, float32/float64 tensors
            on the CPU and on CUDA when this build carries the CUDA kernels, and the
            plain-PyTorch ops of the same semantics elsewhere (a bfloat16 model's gradients,
            bfloat16 factors). Non-contiguous gradients (channels_last) are written through a
            contiguous copy. A layer moved to another device or dtype after construction is
            an error at the step.
        decompose_dtype (torch.dtype, optional): the dtype eigh/inv run in,
            torch.float32 or torch.float64 (kfac-pytorch: a float32 copy; torch.float64 is the
            precise choice for float64 models) (default: torch.float32)
        {_process_group_doc}
            The factors are averaged over it and the KAISA work is shared out over its ranks;
            under torch.distributed ``step()`` and ``decompose()`` are collectives (every rank
            calls them), ``load_state_dict`` stays local. ``preconditioner.assignment`` says
            which rank decomposes each factor.
        kfac_approx (str, optional): "expand" (one statistics row per location: kfac-pytorch)
            or "reduce" (Eschenhagen et al., 2023: one row per sample, the mean of its input
            rows and the sum of its gradient rows over the shared dims of a Linear's input or a
            convolution's output locations; an Embedding always expands). Equal for a Linear
            on 2-D inputs (default: "expand")

    damping, factor_decay, kl_clip and lr are kept as 0-dim device tensors (assigning
    ``preconditioner.lr = x`` between steps does not recompile a compiled step).

    Layers of several dtypes or devices work with KL clipping: the clip factor is one reduction
    over all of them (in float64 when any gradient is float64).

    ``copy.deepcopy`` copies the model with the preconditioner (or uses the model's copy when
    one deepcopy call copies both): the copy is hooked to the copied model and trains as the
    original does. The backend modules and the process group are shared. Speed: docs/kfac.md.
    """
)


# ------------------------------------------------------------------------------ helpers
def _per_layer_products(device: torch.device) -> bool:
    """The form of a chain's eigenbasis products in the eager fused step. On the CPU, per layer,
    each product a multiplication by an eigenbasis on the right
    (`eigen_precondition_right_into`): torch's CPU bmm is itself a loop of one GEMM per matrix
    (one product at a time over the stack), so a loop over the layers runs the same GEMMs with a
    layer's four products in a row, and written that way MKL runs them faster on bias-column
    widths. On other devices, one batched product (bmm) over the stack each, as they are
    (`eigen_precondition_into`)."""
    return device.type == "cpu"


class _Chain:
    """The kept buffers of one product chain (a layer, or a stack of layers sharing second-order
    shapes) over its groups, made on first use: the gradient matrix `grad` [groups, d_g, d_a] and
    the product buffer `work` in row-aligned storage (`aligned_empty`) in the decomposition's
    dtype, and the preconditioned gradients in the gradients' dtype. Each layer's views: `into`
    (where in grad its weight and bias gradients go, in their own shapes:
    `factors.grad_matrix_destinations`) and `pieces` ([groups, d_g, d_a] of the preconditioned
    gradients).

    Batched form (`per_layer` False): one `out` [groups, d_g, d_a] of the whole chain. Per-layer
    form: each layer's operands of `kfac_eigen_products_`, `products` (grad, work, qa, qg, dgda:
    its matrices for one group, else stacks), and any copy of its result out, `copies`; `work`
    is then [groups, d_a, d_g] with both eigenbases. Its piece is
    its rows of `grad` as they are where the gradients have the decomposition's dtype (the
    write reads row-aligned rows), else an output of its own: [groups, d_a, d_g] for a weight
    stored transposed (`factors.weight_is_transposed`: the kernel then writes it in that
    layout, no copy of the gradient), else [groups, d_g, d_a]."""

    def __init__(self, layers: list[Layer], sizes: list[int], s: dict[str, torch.Tensor],
                 inv_dtype: torch.dtype, like: torch.Tensor) -> None:
        _, d_a, d_g = factors.factor_sizes(layers[0].module)
        groups = sum(sizes)
        inv = dict(dtype=inv_dtype, device=like.device)
        out_like = dict(dtype=like.dtype, device=like.device)
        self.per_layer = _per_layer_products(like.device)
        transposed = self.per_layer and s.get("qa") is not None
        self.grad = kfac_maths.aligned_empty((groups, d_g, d_a), **inv)
        self.work = kfac_maths.aligned_empty((groups, d_a, d_g) if transposed else (groups, d_g, d_a), **inv)
        self.sources = (s.get("qa"), s["qg"], s["dgda"])
        self.outs = [] if self.per_layer else [torch.empty((groups, d_g, d_a), **out_like)]
        self.into: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.pieces: list[torch.Tensor] = []
        self.products: list[tuple[torch.Tensor, ...]] = []
        self.copies: list[Callable[[], torch.Tensor]] = []
        offset = 0
        for layer, n in zip(layers, sizes):
            rows = slice(offset, offset + n)
            self.into.append(factors.grad_matrix_destinations(layer.module, self.grad[rows]))
            offset += n
            if not self.per_layer:
                self.pieces.append(self.outs[0][rows])
                continue
            pick = (lambda t, i=rows.start: t[i]) if n == 1 else (lambda t, r=rows: t[r])  # noqa: E731
            qa, qg, dgda, grad, work = (None if t is None else pick(t)
                                        for t in (*self.sources, self.grad, self.work))
            self.products.append((grad, work, qa, qg, dgda))
            if factors.weight_is_transposed(layer.module):
                out = torch.empty((n, d_a, d_g), **out_like)
                self.copies.append(partial(out.copy_, self.grad[rows].mT))
                self.pieces.append(out.mT)
                self.outs.append(out)
            elif like.dtype == inv_dtype:  # the result as it lies (the write reads aligned rows)
                self.pieces.append(self.grad[rows])
            else:
                out = torch.empty((n, d_g, d_a), **out_like)
                self.copies.append(partial(out.copy_, self.grad[rows]))
                self.pieces.append(out)
                self.outs.append(out)

    def fits(self, w: torch.Tensor, s: dict[str, torch.Tensor]) -> bool:
        """Whether these buffers serve gradients like `w` and the second-order tensors `s`."""
        return (self.pieces[0].dtype == w.dtype and self.pieces[0].device == w.device
                and all(a is b for a, b in zip(self.sources, (s.get("qa"), s["qg"], s["dgda"]))))

    def tensors(self) -> list[torch.Tensor]:
        return [self.grad, self.work, *self.outs]


def _copy_into(grads: tuple[torch.Tensor, torch.Tensor | None],
               into: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """`factors.grad_matrix_into` through a chain's kept views (`_Chain.into`)."""
    w_dst, b_dst = into
    w_dst.copy_(grads[0])
    if b_dst is not None:
        b_dst.copy_(grads[1])


def _apply_contiguous(impl, ws: list[torch.Tensor], bs: list[torch.Tensor], vs: list[torch.Tensor],
                      lr: torch.Tensor, kl: torch.Tensor | None) -> None:
    """`kfac_precondition_apply_` of the kernels, which take contiguous gradients and
    preconditioned gradients whose rows are equally spaced (a chain's row-aligned pieces). A
    transposed weight gradient (an Embedding's, a `Conv1D`'s) whose preconditioned gradient is
    kept transposed too (`_Chain`) is written in their own layout, as two entries without a bias
    column (weight rows, then the bias row: the same terms of the clip sum); any other layout
    goes through a contiguous copy."""
    kw: list[torch.Tensor] = []
    kb: list[torch.Tensor] = []
    kv: list[torch.Tensor] = []
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for w, b, v in zip(ws, bs, vs):
        if w.dim() == 2 and not w.is_contiguous() and w.mT.is_contiguous() and v.mT.is_contiguous():
            d_w = w.shape[1]
            kw.append(w.mT)
            kb.append(_empty(w))
            kv.append(v.mT[:, :d_w])
            if b.numel():
                kw.append(b)
                kb.append(_empty(w))
                kv.append(v.mT[:, d_w:])
            continue
        for t, into in ((w, kw), (b, kb)):
            if not t.is_contiguous():
                back.append((t, t.contiguous()))
                t = back[-1][1]
            into.append(t)
        kv.append(v if kfac_maths.rows_equally_spaced(v) else v.contiguous())
    impl.kfac_precondition_apply_(kw, kb, kv, lr, kl)
    for t, out in back:
        t.copy_(out)


_EMPTY: dict[tuple, torch.Tensor] = {}


def _empty(like: torch.Tensor) -> torch.Tensor:
    key = (like.device, like.dtype)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=like.dtype, device=like.device)
    return _EMPTY[key]


def _store(store: dict, key: str, value: torch.Tensor, gate) -> None:
    """store[key] <- value in place (compiled and captured steps keep addresses); with a
    device-bool gate, only where the gate holds."""
    old = store[key]
    if gate is None:
        old.copy_(value)
    else:
        old.copy_(torch.where(gate, value.to(old.dtype), old))


def _any_match(query: str, patterns: list[str]) -> bool:
    return any(re.search(p, query) for p in patterns)


def _patterns(skip_layers) -> list[str]:
    """skip_layers as a list of regular expressions (a single string is one pattern)."""
    if skip_layers is None:
        return []
    patterns = [skip_layers] if isinstance(skip_layers, str) else skip_layers
    try:
        patterns = list(patterns)
    except TypeError:
        raise TypeError(f"skip_layers must be a string or a list of strings, got {skip_layers!r}") from None
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"skip_layers must be a string or a list of strings, got the entry {p!r}")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"skip_layers holds an invalid regular expression {p!r}: {e}") from None
    return patterns


def _implementation(backend: str, device: torch.device, dtype: torch.dtype):
    """The ops a (device, dtype) runs on: the kernels where cafin has them (float32/float64, on
    the CPU, or on CUDA when this build carries the CUDA kernels), else the reference ops."""
    if backend == "reference" or dtype not in (torch.float32, torch.float64):
        return reference
    if device.type == "cpu" or (device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key(
            "cafin::kfac_precondition_apply_", "CUDA")):
        return ops
    return reference


def _checkpoint_steps(value: Any) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"state_dict['steps'] must be an int >= 0, got {value!r}")
    return value


def _checkpoint_factor(t: Any, own: torch.Tensor, what: str) -> torch.Tensor | None:
    """A saved factor ([d, d] or [groups, d, d]; an Embedding's diagonal A [d] or [groups, d]) in
    the preconditioner's shape, checked: a floating tensor of that shape, every entry finite.
    None: no statistics yet."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"state_dict {what} must be a tensor or None, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"state_dict {what} must be a floating tensor, got {t.dtype}")
    shape = tuple(t.shape)
    t = t.detach()
    if t.dim() == own.dim() - 1:
        t = t.unsqueeze(0)
    if tuple(t.shape) != tuple(own.shape):
        raise ValueError(f"state_dict {what} has shape {shape}, expected {tuple(own.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"state_dict {what} has non-finite entries")
    return t
