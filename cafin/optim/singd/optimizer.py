"""SINGD / IKFAC / INGD: structured inverse-free natural gradient (arXiv 2312.05705), a drop-in for
singd 0.0.5's `singd.optim.optimizer.SINGD` (same constructor names, defaults and numbers).

Per layer (Linear, Conv1d/2d/3d, transformers' Conv1D, Embedding with a diagonal K over its
vocabulary), factors K (d_K x d_K) and C (d_C x d_C) track K K^T ~ (A + lambda)^-1 and
C C^T ~ (G + lambda)^-1 by matrix products only: every T steps
    m_K <- s*(c_g tr(H_C)/d_C H_K + lambda tr(C^T C)/d_C Pi(K^T K) - I) + alpha1 m_K,   K <- K - beta1 K m_K
(and the same for C with the roles swapped), with H_K = Pi(K^T a^T a K), H_C = Pi(C^T g^T g C)
from the inputs and output gradients of that step's passes; every step the natural gradient
C C^T [grad W | grad b] K K^T drives SGD with momentum. kfac_like=True is IKFAC.

This file holds the class, its constructor and the step; each job is a mixin of its own file:
settings.py (group entries and their rules), state.py (the layers and their tensors),
statistics.py (the hooks' H_K, H_C), preconditioner.py (the update of K, C and their momenta),
update.py (the natural gradient and SGD), distribution.py (torch.distributed, FSDP2/HSDP),
checkpoint.py. Param groups, tensor hyperparameters, hooks, the step counter and its host/device
gating, copies and checkpoints come from the family's core
(`cafin.core.optimizer.CurvatureOptimizer`).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from ...core import CurvatureOptimizer, DropCounts, amp, distributed, run_closure, undo_on_error, unwrap
from ...core.route import Route
from .._docs import _backend_doc, _grad_scaler_doc, _optional_params_doc, _process_group_doc
from .checkpoint import Checkpoint
from .distribution import Distribution
from .preconditioner import Preconditioner
from .settings import Settings, check_grad_scale, trainable
from .state import FACTORS, MAX_PARTS, State, layer_params
from .statistics import Statistics
from .update import ParameterUpdate, _StepPlan, contiguous


class SINGD(Settings, State, Statistics, Preconditioner, ParameterUpdate, Distribution, Checkpoint,
            CurvatureOptimizer):
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
    finite_state = tuple(f"{f}.{i}" for f in FACTORS for i in range(MAX_PARTS)) + (
        "H_count", "P_K", "P_C", "momentum_buffer")
    # the Route holds the op modules, which a copy shares (as the core shares a module attribute)
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
        self._route = Route(backend, "SINGD", "singd_momentum_")
        self._op_modules: dict[str, tuple] = {}  # device type -> (op module, whether cafin's kernels)
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.backend = backend
        self._group_of: dict[Tensor, int] = {}
        self._owned_now: dict[int, int] = {}  # FSDP2: this step's owner of each gathered layer
        self._empty: dict[tuple, Tensor] = {}
        self._gradient_buffers: dict[str, Tensor] = {}  # eager: layer -> `_gradient_matrices`' matrix
        self._plan: _StepPlan | None = None
        # id(group) -> (group, its _SETTINGS values, lr_cov's version) that passed _check_settings
        self._settings_checked: dict[int, tuple] = {}
        self._skipped = DropCounts()  # updates dropped for non-finite statistics
        self._init_scale = check_grad_scale(init_grad_scale, "init_grad_scale")
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
            params = trainable(unwrap(model), warn_unsupported)
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

    def __deepcopy__(self, memo):
        new = super().__deepcopy__(memo)
        new._plan = None
        return new

    def _graph_settings(self) -> tuple:
        return tuple((f"param group {i}: T", group["T"]) for i, group in enumerate(self.param_groups))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One SINGD step; a closure is evaluated with grad enabled and its loss returned."""
        loss = None
        if closure is None:
            scale, divide, divisor, found_inf = self._prepare_step()
        else:
            # A step rejected after its closure ran is undone like a closure that raises.
            with undo_on_error(self._pass_state()):
                loss = run_closure(closure, [])
                scale, divide, divisor, found_inf = self._prepare_step()
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
        grad_scale, found_inf = amp.handed_over(self)
        divisor = None
        if self._manual_scale is not None:  # set_current_grad_scale, as singd
            scale, divide = self._manual_scale, self._manual_scale
        elif grad_scale is not None:
            scale = divide = float(grad_scale)
            divisor = grad_scale
        elif found_inf is not None:
            # scaler.unscale_(opt) ran before the step (clipping): the gradients are unscaled,
            # but the H_C taken from scaled gradients still needs this step's scale.
            scale = float(amp.scale_for_statistics(self.grad_scaler, "SINGD", "H_C"))
            divide = 1.0
        else:
            scale = divide = 1.0
        return scale, divide, divisor, found_inf

    def set_current_grad_scale(self, grad_scale: float) -> None:
        """The gradient scale of this step's backward pass (singd's API, for a scaler driven by
        hand); the gradients are divided by it."""
        self._manual_scale = check_grad_scale(grad_scale, "grad_scale")

    def _step(self, scale: float, grad_scale: float, divisor: Tensor | None) -> None:
        """The step on one process (or across ranks): the due preconditioner updates, then the
        parameter update by this step's plan."""
        c_g = self._grad_scale_prev / scale ** 2
        due_of = [self._steps.host_due(group["T"]) for group in self.param_groups]
        dues = [(layer, due_of[self._group_of[layer.anchor]]) for layer in self._curvature]
        updating = [(layer, due) for layer, due in dues
                    if due is not False and any(p.grad is not None for p in layer_params(layer))]
        if distributed() or self._sharded:
            self._step_across_ranks(dues, updating, c_g, grad_scale, divisor)
            return
        self._update_preconditioners(updating, c_g)
        plan = self._step_plan()
        per_group: dict[int, tuple[list, list, list]] = {}
        gmats = self._gradient_matrices(plan.natural)
        for layer, names, sk, sc, K, C in plan.natural:
            grads = {n: getattr(layer.module, n).grad for n in names}
            self._queue_natural_gradient(layer, grads, None, sk, sc, K, C, grad_scale, per_group, [],
                                         gmats.get(layer.name))
        per_diag = {index: {key: (ps, [contiguous(p.grad) for p in ps], *rest)
                            for key, (ps, *rest) in buckets.items()}
                    for index, buckets in plan.diagonal.items()}
        self._apply_updates(per_group, per_diag, plan.unowned, grad_scale, divisor)


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
            Beyond singd, keyword only, as all below. Both run the same update, over the
            same buckets: "fused" with cafin's multi-tensor ops (diagonal layers in one step
            op), "reference" with the same ops in plain PyTorch (`cafin.reference`).
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


__all__ = ["SINGD"]
