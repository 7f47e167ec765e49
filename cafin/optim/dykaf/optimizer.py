"""The `DyKAF` class: its settings (checked at construction and at every step), its
construction, and the step that builds first states and updates the started parameters per
device; the jobs live in the mixins it is made of (start.py, update.py, factors.py,
checkpoint.py) and the refresh sharing in owners.py."""
from __future__ import annotations

from math import inf
from typing import Any, Callable, Iterable

import torch

from ...core import (Choice, CoreOptimizer, Flag, Int, Pair, Real, checked_attribute, route,
                     run_closure)
from ...core.route import BACKENDS, Route
from ...core.steps import StepCounter
from ...maths import dykaf as dykaf_maths
from ...core.distribution.sharding import check_sharded, full_parameters
from .._docs import _backend_doc, _params_doc, _published_bugs_doc
from .checkpoint import Checkpoint
from .factors import Factors
from .owners import refresh_owners
from .start import Start
from .update import Update

_BETA = Real(0.0, 1.0, high_open=True, dtype=torch.float64)
# Constructor arguments that are not group settings.
_SETTINGS = {
    "backend": Choice(*BACKENDS),
    "data_format": Choice("channels_first", "channels_last"),
    "adam_rank_one": Flag(),
    "rank_one_eps": Real(0.0, inf, high_open=True),
    "seed": Int(0, 2 ** 64 - 1),  # what torch.Generator.manual_seed takes
    "published_bugs": Flag(),
}


class DyKAF(Start, Update, Factors, Checkpoint, CoreOptimizer):
    hyperparameters = {
        "lr": Real(0.0, inf, high_open=True, dtype=torch.float64),
        "betas": Pair(_BETA, _BETA),
        # < 0: betas[1]. Read on the host when a parameter's state is built.
        "shampoo_beta": Real(-inf, 1.0, tensor=False),
        # The rank-one moment starts at eps * 1 (0 would make it 0/0) and eps is the full second
        # moment's epsilon: > 0 and finite.
        "eps": Real(0.0, inf, low_open=True, high_open=True, tensor=False),
        "weight_decay": Real(0.0, inf, high_open=True, tensor=False),
        "precondition_frequency": Int(1),
        "max_precond_dim": Int(1),
        "merge_dims": Flag(),
        "precondition_1d": Flag(),
        "normalize_grads": Flag(),
        "correct_bias": Flag(),
        "init": Choice("kron", "eps", "zeros"),
    }
    contiguous_params = False  # channels_last weights work (the apply writes a contiguous copy)
    # The numeric constructor arguments that are attributes, checked whenever set.
    rank_one_eps = checked_attribute("rank_one_eps", Real(0.0, inf, high_open=True, tensor=False))
    seed = checked_attribute("seed", _SETTINGS["seed"])

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 3e-3, betas=(0.95, 0.95),
                 shampoo_beta: float = -1, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 10, max_precond_dim: int = 10000,
                 merge_dims: bool = False, precondition_1d: bool = False,
                 normalize_grads: bool = False, data_format: str = "channels_first",
                 correct_bias: bool = True, init: str = "kron", adam_rank_one: bool = True, *,
                 backend: str = "fused", rank_one_eps: float = 0.0, seed: int = 0,
                 published_bugs: bool = False, process_group=None):
        given = dict(backend=backend, data_format=data_format, adam_rank_one=adam_rank_one,
                     rank_one_eps=rank_one_eps, seed=seed, published_bugs=published_bugs)
        for name, rule in _SETTINGS.items():
            rule.check(given[name], name)
        owners = refresh_owners(process_group)
        defaults = dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps,
                        weight_decay=weight_decay, precondition_frequency=precondition_frequency,
                        max_precond_dim=max_precond_dim, merge_dims=merge_dims,
                        precondition_1d=precondition_1d, normalize_grads=normalize_grads,
                        correct_bias=correct_bias, init=init)
        self.adam_rank_one = adam_rank_one
        self.data_format = data_format
        self.backend = backend
        self.rank_one_eps = float(rank_one_eps)
        self.seed = seed
        self.published_bugs = published_bugs
        # which op module runs each (device, dtype): cafin's kernels or the reference ops
        self._route = Route(backend, "DyKAF", "dykaf_apply_")
        self.process_group = process_group
        self._owners = owners  # None: every rank refreshes every parameter
        # The latch of device-decided steps: once a step is captured in a CUDA graph, no decision
        # reads a host count (the refresh is decided from `device_step`); a compiled step
        # decides from the host counts, one graph per phase.
        self._steps = StepCounter()
        self._dropped = 0  # first gradients dropped (skipped_factor_updates)
        # parameter -> [drops, steps left to skip] while its state waits for a usable gradient
        self._waits: dict[torch.Tensor, list[int]] = {}
        super().__init__(params, defaults)
        self._sharded = check_sharded([p for g in self.param_groups for p in g["params"]],
                                      "DyKAF") is not None

    # ------------------------------------------------------------------ merge_dims
    def _merged_shape(self, p: torch.Tensor, group) -> tuple[int, ...] | None:
        return dykaf_maths.merged_shape(p.shape, group["merge_dims"], group["max_precond_dim"],
                                 self.data_format)

    def _to_merged(self, x: torch.Tensor, shape) -> torch.Tensor:
        return dykaf_maths.to_merged(x, shape, self.data_format)

    def _from_merged(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return dykaf_maths.from_merged(x, like.shape, self.data_format)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One step; a closure is evaluated with grad enabled and its loss returned."""
        loss = None
        if closure is not None:
            loss = run_closure(closure, [])  # no hooks: its passes add to nothing of DyKAF's
        self._begin_step()  # checks everything before anything is written
        self._called.value = True  # for the LR scheduler's call-order warning
        if self._sharded:  # FSDP2: the update reads full gradients; each rank keeps its rows
            with full_parameters(self):
                self._step()
        else:
            self._step()
        return loss

    def _step(self) -> None:
        if self._owners is not None:
            self._owners.clear()  # what a step that raised left behind
        for group in self.param_groups:
            active = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    if route.captured():
                        raise RuntimeError(
                            f"DyKAF: a parameter of shape {tuple(p.shape)} has no state yet, and "
                            "building it (eigendecompositions, host checks of its first gradient) "
                            "cannot be captured in a CUDA graph: run eager steps until every "
                            "parameter has state (its first step with a finite gradient), then "
                            "capture")
                    wait = self._waits.get(p)
                    if wait is not None and wait[1] > 0:  # backing off after a dropped gradient
                        wait[1] -= 1
                        continue
                    # A zero first gradient gives the power iterations (and the "zeros" start)
                    # no direction to start from: wait for a non-zero one (published for "kron").
                    if ((group["init"] in ("kron", "zeros") or p.dim() == 4)
                            and not bool(p.grad.any())):
                        continue
                    why = self._init_state(p, p.grad, group)
                    if why is not None:
                        self._drop_start(p, why)
                    elif "step" in state:  # installed (with a process_group: at the step's end)
                        self._waits.pop(p, None)
                    continue  # the first step only builds state, as published
                active.append(p)
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in active:
                by_device.setdefault(p.device, []).append(p)
            for params in by_device.values():
                self._update(group, params)
        if self._owners is not None:  # the step's decompositions, by their owners, then shared
            self._owners.flush(self._install_refresh, self._finish_start)


DyKAF.__doc__ = (
    r"""DyKAF: Adam in the eigenbasis of dynamically tracked Kronecker factors of the Fisher.

    A drop-in for ``TensorDyKAF`` (Vepricov/LIB, arXiv 2511.06477): the published signature,
    defaults and numbers. For a matrix parameter with gradient :math:`g`, factors :math:`L, R`
    track the nearest Kronecker approximation :math:`L \otimes R` of the moving-average empirical
    Fisher :math:`F \leftarrow \beta_s F + (1 - \beta_s)\,\mathrm{vec}(g)\mathrm{vec}(g)^\top` by
    one projector-splitting step per iteration, and :math:`Q_L, Q_R`, their eigenbases, are
    refreshed every precondition_frequency updates. The update, with a rank-one second moment
    :math:`l r^\top`:

    .. math::
        m \leftarrow \beta_1 m + (1 - \beta_1) g, \qquad \tilde g = Q_L^\top g Q_R, \qquad
        l r^\top \approx \beta_2 l r^\top + (1 - \beta_2)\, \tilde g \odot \tilde g,

        u = Q_L \frac{Q_L^\top m Q_R}{\sqrt{l r^\top}} Q_R^\top, \qquad
        \theta \leftarrow \theta - \eta \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t} u, \qquad
        \theta \leftarrow \theta - \eta \lambda \theta

    Conv kernels (4-D) use a 4-mode factor split and a full second moment; the other
    preconditioned tensors SOAP's EMA of per-mode products (docs/dykaf.md). The first step of each parameter only builds its
    state (no update, no decay), as published.
    """
    + rf"""
    Args:
        {_params_doc}
        lr (float or Tensor, optional): :math:`\eta`, >= 0 (default: 3e-3)
        betas (tuple[float, float], optional): Adam's :math:`\beta_1, \beta_2`, each in
            [0, 1) (default: (0.95, 0.95))
        shampoo_beta (float, optional): :math:`\beta_s`, the factor decay, <= 1; < 0: betas[1];
            frozen at a parameter's first step (default: -1)
        eps (float, optional): the start of the rank-one moment (:math:`l = r = \epsilon
            \mathbf 1`) and the epsilon of the full second moment; finite and > 0
            (default: 1e-8)
        weight_decay (float, optional): :math:`\lambda`, decoupled, on the updated weights,
            >= 0 (default: 0.01)
        precondition_frequency (int, optional): updates between refreshes of the eigenbases,
            >= 1; frozen at a parameter's first step (default: 10)
        max_precond_dim (int, optional): a mode longer than this is not rotated (default: 10000)
        merge_dims (bool, optional): merge the dimensions of a tensor before preconditioning it,
            as SOAP does (default: False)
        precondition_1d (bool, optional): precondition 1-D tensors too (default: False)
        normalize_grads (bool, optional): divide the update by its RMS (default: False)
        data_format (str, optional): "channels_first" or "channels_last": how merge_dims reads
            4-D tensors (default: "channels_first")
        correct_bias (bool, optional): Adam's bias correction (default: True)
        init (str, optional): the start of the 2-D factors: "kron", "eps" or "zeros"
            (default: "kron")
        adam_rank_one (bool, optional): the rank-one second moment for matrices (default: True)
        {_backend_doc}
            cafin's own, keyword only, as all below.
        rank_one_eps (float, optional): 0 (published): the rank-one denominator is
            :math:`\sqrt{{l r^\top}}` with no epsilon. > 0: it is :math:`\sqrt{{l r^\top}}` +
            rank_one_eps, and a rank-one moment that collapsed to zero restarts from the
            uniform direction instead of turning NaN (default: 0.0)
        seed (int, optional): the starting vectors of the "kron" and 4-D (HOPM) power
            iterations are drawn from a CPU generator seeded with this (the published code
            uses the global torch.randn) (default: 0)
        {_published_bugs_doc}
            False: the 4-D (conv kernel) factor step keeps unit factors and carries the weight
            as the norm of each mode's update, and the HOPM start takes |s|; a 4-D weight with
            any mode over max_precond_dim takes the EMA path, that mode unrotated. True: the
            published step, whose weight roughly squares every step (it overflows to NaN on a
            small CNN within 13 steps) and whose start is NaN for a negative s; and the
            published limit: only mode 0 of a 4-D weight is compared with max_precond_dim, the
            factor split then preconditioning every mode whatever its size.
        process_group (ProcessGroup, optional): share the eigenbasis refreshes over the ranks
            of this group (e.g. ``torch.distributed.group.WORLD``; every rank of it steps the
            same parameters with the same gradients, as under DDP or FSDP2): each basis due
            for a refresh is refreshed by one owner rank, balanced by cost, and the bases are
            shared in one collective per (device, dtype). The numbers do not change. A
            ValueError when torch.distributed is not initialised or the group lacks this
            rank (default: None: every rank refreshes every parameter)

    All but backend, data_format, adam_rank_one, rank_one_eps, seed, published_bugs and
    process_group may differ per param group. lr and betas are kept as 0-dim float64 tensors on the parameters'
    device, so schedulers change them in place (for betas: ``group["betas"][i].fill_(x)``) and
    a compiled step does not recompile; a number assigned instead works too. Every setting is
    checked at construction, at each step (before anything is written) and in
    ``load_state_dict``. Speed: docs/dykaf.md.
    """
)
