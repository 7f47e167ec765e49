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
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from ... import factors
from ...core import Choice, DropCounts, route, unwrap
from ...core.preconditioner import Preconditioner
from ...core.distribution.sharding import check_sharded
from .._docs import _backend_doc, _process_group_doc
from .checkpoint import Checkpoint
from .compat import AssignmentStrategy, ComputeMethod, DistributedStrategy
from .decompositions import Decompositions
from .distribution import Distribution
from .preconditioning import Preconditioning, _Chain
from .settings import Settings
from .state import Layers
from .statistics import Statistics

__all__ = ["KFACPreconditioner", "ComputeMethod", "AssignmentStrategy", "DistributedStrategy"]


class KFACPreconditioner(Settings, Layers, Statistics, Decompositions, Preconditioning, Distribution,
                         Checkpoint, Preconditioner):
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
        # The kernels each (device, dtype) runs on: cafin's where the build has them ("fused").
        self._route = route.Route(backend, "KFACPreconditioner", "kfac_precondition_apply_")
        self.process_group = process_group
        self.kfac_approx = kfac_approx
        self._accumulation_steps = accumulation_steps
        self._update_factors_in_hook = update_factors_in_hook
        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._mini_steps: dict[str, int] = defaultdict(int)
        self._unfolded = False  # statistics a compiled forward took, for the step to fold
        # Statistics dropped for inf/NaN entries, counted on each device (float32: no sync, and
        # compiled or captured steps can add to it), and how many of them were already reported.
        self._skipped = DropCounts()
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
                self._impls[(device, dtype)] = self._route.ops(device, dtype)
        for layer in self._layers:  # device state created now: a compiled step cannot create it
            self._skipped.counter(layer.module.weight.device)

    def _impl_for(self, device: torch.device, dtype: torch.dtype):
        """The implementation chosen at construction for tensors of this device and dtype."""
        impl = self._impls.get((device, dtype))
        if impl is None:
            raise RuntimeError(f"KFACPreconditioner: a registered layer now has {dtype} tensors on "
                               f"{device}, which it did not have at construction; move the model "
                               "before creating the preconditioner")
        return impl

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
        if route.captured() and self._capture_refusal() is not None:
            raise RuntimeError("torch.linalg.eigh cannot be captured in a CUDA graph: capture with "
                               "cafin.StepGraphs (it runs the inverse steps eagerly), or set "
                               "preconditioner.decompose_in_step = False, capture the step, and call "
                               "preconditioner.decompose() eagerly every inv_update_steps steps")
        self._refresh_settings()
        self.factor_update_steps, self.inv_update_steps  # noqa: B018  (checked; errors name them)
        self._check_grads()

    def _advance(self) -> None:
        self._mini_steps = defaultdict(int)
        self._steps.advance()
        if not route.compiled():
            self._stale = True
            self._refresh_settings(quiet=True)  # next step's values now; a bad one raises at the next use
            self._report_skipped()  # last: a warning turned into an error finds the step done


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
