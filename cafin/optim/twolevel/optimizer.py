"""`TwoLevelKFAC`: its constructor and `step()`, which runs the jobs of the other files in
order (statistics, factor EMAs, decompositions, first level, coarse correction, write); each
of them is a part of the class (a mixin) holding one job's methods."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...core import Int, Real, checked_attribute, distributed, route, unwrap
from ...core.preconditioner import Preconditioner
from ...maths import state_dtype
from ...core.distribution.sharding import check_sharded
from .._docs import _process_group_doc, _published_bugs_doc
from .checkpoint import Checkpoint
from .coarse import Coarse
from .decompositions import Decompositions
from .distribution import Distribution
from .preconditioning import Preconditioning
from .settings import Settings
from .statistics import Statistics, fold_covariances

# Why a first step with zero gradients and no forward pass fails: it is what
# get/set_optimizer_state_dict run to create the state of a fresh optimizer.
_DCP_STEP = ("TwoLevelKFAC: step() before any forward pass, with every gradient zero, as "
             "torch.distributed.checkpoint's get_optimizer_state_dict and set_optimizer_state_dict "
             "step a fresh optimizer: its state is made by its first steps, and its coarse matrix "
             "and per-rank statistics are not in the state dict they take. Checkpoint it with "
             "cafin.optim.twolevel.twolevel_checkpoint(opt) in the saved state, "
             "cafin.optim.twolevel.twolevel_load(opt, checkpoint_id) to resume (docs/distributed.md)")


class TwoLevelKFAC(Settings, Statistics, Decompositions, Coarse, Preconditioning, Distribution, Checkpoint,
                   Preconditioner, torch.optim.Optimizer):
    def __init__(self, net: nn.Module, damping=1e-3, pi=False, T_cov=100, T_inv=100, alpha=0.95,
                 constraint_norm=False, clipping=1e-2, batch_size=64, coarse_space="nicolaides",
                 krylov=False, *, backend="fused", published_bugs=False, process_group=None,
                 distribute_decompositions=True, assignment_strategy="compute", colocate_factors=False):
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
        self._init_settings({"damping": damping, "alpha": alpha, "clipping": clipping})
        self._check_arguments(pi=pi, T_cov=T_cov, T_inv=T_inv, constraint_norm=constraint_norm,
                              batch_size=batch_size, coarse_space=coarse_space, krylov=krylov,
                              backend=backend, published_bugs=published_bugs, process_group=process_group,
                              distribute_decompositions=distribute_decompositions,
                              assignment_strategy=assignment_strategy, colocate_factors=colocate_factors)
        model = unwrap(net)
        # FSDP2: the statistics hooks see the unsharded call, so the factors and the coarse
        # matrix are DDP's once averaged over the parameters' mesh; the update gathers each
        # layer's full gradient (one all_gather per step) and each rank keeps its own rows.
        mesh_group = check_sharded(model.parameters(), "TwoLevelKFAC")
        self._sharded = mesh_group is not None
        if process_group is None:
            self.process_group = mesh_group
        super().__init__(self._register_layers(model), {})
        self.update_stats = False
        # factors, statistics and decompositions: float32 for float16/bfloat16 layers (eigh has
        # no half-precision kernels, and their EMAs would lose the small updates)
        self._work = [state_dtype(layer.module.weight.dtype) for layer in self._layers]
        self._writer = self._choose_writer()
        self.dropped_statistics = 0  # steps whose statistics (or coarse matrix) were non-finite
        self._sizes: dict[tuple, torch.Tensor] = {}
        self._scalings: dict[int, tuple] = {}  # eager: layer -> its kept `_scaling`
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # eager: layer -> `_product_buffers`
        self._raw_buffers: dict[int, torch.Tensor] = {}  # eager: layer -> `_raw_gradients`' matrix
        self._constant_vectors: dict[tuple, torch.Tensor] = {}  # eager: nicolaides' vectors
        self._ones = self._create_ones()
        self.f_coarse = None
        self.f_coarse_inv = None
        # per layer: {"calls": one dict per forward call since the last step, "task": the
        # backward pass that delivered the latest output gradient}
        self._pending: dict[int, dict[str, Any]] = {}
        self._assign_work()
        # k, the completed update steps, counted on the host, which decides the T_cov/T_inv
        # steps eagerly and under torch.compile; the hooks
        self._start(self._layers)

    # ------------------------------------------------------------------ hyperparameters
    # damping 0 would leave the factors' zero eigenvalues undamped, and the published
    # eigenvalue floor then divides by 0
    settings = {"damping": Real(0.0, math.inf, low_open=True), "alpha": Real(0.0, 1.0),
                "clipping": Real(0.0, math.inf)}
    # intervals in steps, checked whenever set (the step takes k modulo each)
    T_cov = checked_attribute("T_cov", Int(1))
    T_inv = checked_attribute("T_inv", Int(1))

    # ------------------------------------------------------------------ step
    # cafin.StepGraphs runs every step of it eagerly, on the host's count
    _uncapturable = ("its T_inv steps decompose with torch.linalg.eigh, which syncs with the host "
                     "on CUDA, and its device-decided step chooses them with torch.cond, which "
                     "eager code decides on the host")

    @torch.no_grad()
    def step(self, update_params: bool = True, closure=None) -> None:
        """Rewrite every layer's gradient with its two-level direction (update_params=True), or
        only take statistics (update_params=False, the published true-Fisher loop).

        The host decides the T_cov/T_inv steps, eagerly and compiled: a compiled step (after at
        least one eager step, which creates the state it updates) builds one graph per phase
        (which of T_cov and T_inv are due), and one that is not due does no curvature work. A
        compiled step reads no device value: it writes the state in place and drops non-finite
        statistics on the device."""
        if closure is not None:
            raise ValueError("closure is not supported: TwoLevelKFAC.step(update_params) only "
                             "rewrites the gradients (step a torch optimizer after it)")
        if route.captured():  # before the counter latches
            raise RuntimeError(
                "TwoLevelKFAC's step cannot be captured in a CUDA graph: on T_inv steps it "
                "decomposes its factors with torch.linalg.eigh inside the step, and eigh checks "
                "its result on the host on CUDA (a sync, which a capture forbids); the choice of "
                "step is a torch.cond, which eager code decides on the host. Run the step eagerly, "
                "or compile it with torch.compile(step, fullgraph=True) after one eager step")
        if not self._checked():  # compiled or device gated: written in place, no undo
            self._step(update_params)
            return
        # An eager step replaces state entries and never writes into them, so a step that
        # raises is undone by putting the entries back.
        anchors = [g["params"][0] for g in self.param_groups]
        fresh = [p for p in anchors if p not in self.state]  # entries this step creates
        saved = ([(st, dict(st)) for st in (self.state[p] for p in anchors)],
                 {key: {**pending, "calls": list(pending["calls"])} for key, pending in self._pending.items()},
                 {key: getattr(self, key) for key in ("f_coarse", "f_coarse_inv", "batch_size",
                                                      "dropped_statistics")})
        try:
            self._step(update_params)
        except BaseException:
            states, pending, values = saved
            for state, entries in states:
                state.clear()
                state.update(entries)
            for p in fresh:
                del self.state[p]
            self._pending = pending
            self.__dict__.update(values)
            self.__dict__.pop("_early_parts", None)
            self.__dict__.pop("_coarse_folded", None)
            if self._iteration_counter == 0 and not self._pending and self._zero_gradients():
                raise RuntimeError(_DCP_STEP) from None
            raise

    def _zero_gradients(self) -> bool:
        """Whether every parameter has a gradient and all of them are zero: the step that
        torch.distributed.checkpoint's get/set_optimizer_state_dict run on an optimizer without
        state."""
        grads = [p.grad for g in self.param_groups for p in g["params"]]
        return all(g is not None and not bool(g.any()) for g in grads)

    def _step(self, update_params: bool) -> None:
        k, cov, inv = self._schedule()
        checked = self._checked()
        # Where the host decides (cov and inv are bools, eager and compiled), a step that is not
        # due launches no curvature work; a device-gated step launches all of it and commits it
        # where the device says the interval is due.
        gated = isinstance(cov, torch.Tensor)
        collect = self.update_stats and (gated or cov)
        decompose = self.update_stats and (gated or inv)
        self._check_ready(k, update_params, collect, decompose, in_place=not checked)
        # FSDP2: the full gradients, gathered before any state changes (a missing one raises)
        full = self._gather() if update_params and self._sharded else None
        stats = self._statistics() if collect else None  # an unused layer raises here
        self._pending.clear()  # statistics of a pass that is not a T_cov step: not used
        raws = self._raw_gradients(full) if update_params else None
        states = [self.state[g["params"][0]] for g in self.param_groups]
        covs, gate_fold, undo = (self._store_statistics(states, stats, checked, cov if gated else None)
                                 if collect else ([], None, None))
        if distributed():
            self._average(covs, raws if update_params and checked and cov else None)
        if checked and covs and not self._all_finite(covs):
            undo()
            covs = []
            if "xxt" not in states[0]:
                return  # nothing to precondition with yet: the gradients are left as they are
        rho = self._rho(k, checked) if covs else None
        for state, new in zip(states, covs):
            fold_covariances(state, new, rho, gate_fold)
        coarse = False
        if decompose and self._owners is not None and "_early_parts" in self.__dict__:
            # F_c does not depend on this step's decompositions (ones vectors): folded now, its
            # inverse made by its owner travels with them
            self._coarse_folded = coarse = self._fold_coarse(None)
        if decompose:
            self._decompose(states, checked, inv if gated else None, coarse)
        if not update_params:
            return
        directions = self._two_level(raws, self._kfac_directions(states, raws))
        if directions is None:
            return  # no coarse matrix yet (this step's was dropped): the gradients are left as they are
        self._write_all(*directions, full)
        self._steps.advance()

    def _check_ready(self, k: int, update_params: bool, collect: bool, decompose: bool, in_place: bool) -> None:
        """Refuse a step that would read state no earlier step created, or a gradient that is
        missing. `in_place`: a compiled (or device-gated) step, which writes into the state an
        eager step created."""
        if in_place and distributed():
            raise RuntimeError("TwoLevelKFAC: a compiled step under torch.distributed is not "
                               "supported: run its steps eagerly")
        for layer, group in zip(self._layers, self.param_groups):
            state = self.state[group["params"][0]]
            ready = "Q_x" in state and (self.f_coarse is not None or not update_params
                                        or self.coarse_space == "none")
            if in_place and not ready:
                raise RuntimeError("TwoLevelKFAC: a compiled step updates the state an eager step "
                                   "creates: run the first step (step 0, with update_stats) eagerly")
            if "xxt" not in state and not collect:
                raise self._missing(layer, "Kronecker factors")
            if "Q_x" not in state and not decompose:
                raise self._missing(layer, "eigendecomposition")
            if update_params and not route.compiled():
                for p in group["params"]:
                    if p.grad is None:
                        raise RuntimeError(
                            f"TwoLevelKFAC: layer '{layer.name}' has no gradient at step {k} (not used "
                            "in the forward pass, or frozen after the optimizer was built): the coarse "
                            "space couples every registered layer, so each one needs a gradient at "
                            "every step (freeze a layer before building the optimizer to skip it)")


TwoLevelKFAC.__doc__ = (
    r"""Two-level K-FAC: K-FAC's block-diagonal direction plus a coarse correction coupling the layers.

    A gradient preconditioner, a drop-in for ``TwolevelKFAC`` of Abdoulaye-Koroko/natural-gradients
    (arXiv 2303.18083): ``step(update_params=True)`` after backward rewrites the gradient of every
    registered Linear, Conv2d and Conv1D layer; a torch optimizer (SGD with momentum) then steps. Per
    layer l, with K-FAC factors :math:`A_l = E[x x^\top]`, :math:`G_l = E[g g^\top]` (EMAs,
    updated every T_cov steps, eigendecomposed every T_inv steps, damping added inside the
    decomposition):

    .. math::
        v_l = (G_l + \lambda I)^{-1} g_l (A_l + \lambda I)^{-1} + y_l r_l, \qquad
        y = F_c^{-1} (R g), \quad (R g)_l = \langle r_l, g_l \rangle,

        (F_c)_{ij} = \tfrac{1}{B} \textstyle\sum_n \langle r_i, G_{n,i} \rangle
        \langle r_j, G_{n,j} \rangle + \lambda \, |r_i| \, [i = j]

    with one coarse vector :math:`r_l` per layer (two with ``krylov=True``) and :math:`G_{n,l}`
    sample n's gradient. Layers whose parameters are all frozen are skipped. Factors and
    decompositions of float16 and bfloat16 models are kept in float32. A step whose statistics
    hold inf/NaN drops them with a ``NonFiniteStatisticsWarning`` (counted in
    ``dropped_statistics``).
    """
    + rf"""
    Args:
        net (nn.Module): the model; its Linear and Conv2d modules (exact classes) and
            transformers ``Conv1D`` modules are registered. A Linear (or Conv1D) on
            [B, T..., D] inputs has T locations per sample, as a Conv2d has its output
            positions. A trained Embedding, Conv1d or Conv3d (layers KFACPreconditioner
            supports) is refused with a ValueError naming it.
        damping (float, optional): Tikhonov damping :math:`\lambda`, > 0 (default: 1e-3)
        pi (bool, optional): accepted, no effect (published: feeds a branch that is never
            taken) (default: False)
        T_cov (int, optional): steps between factor and coarse-matrix updates (default: 100)
        T_inv (int, optional): steps between eigendecompositions (default: 100)
        alpha (float, optional): EMA weight cap, :math:`\rho = \min(1 - 1/k, \alpha)`, in
            [0, 1] (default: 0.95)
        constraint_norm (bool, optional): scale the directions by
            min(sqrt(clipping / |<v, g>|), 1) (default: False)
        clipping (float, optional): the bound of constraint_norm, >= 0 (default: 1e-2)
        batch_size (int, optional): initial batch size (overwritten by each collection)
            (default: 64)
        coarse_space (str, optional): "nicolaides", "spectral", "residual" or "tpselepedis";
            "none" (not in the published code) turns the coarse correction off: the same K-FAC
            directions, uncorrected, the baseline the paper compares with (default: "nicolaides")
        krylov (bool, optional): add a second, Krylov coarse vector (nicolaides and residual
            only) (default: False)
        backend (str, optional): how :math:`F_c` is assembled: "fused", the per-sample coarse
            projections of every layer at once, or "reference", pair by pair as the published
            code does (see the module's docstring); keyword only, as all below. Either way the
            gradients are written by K-FAC's kernel for float32/float64 layers on one device
            and by its plain-PyTorch twin otherwise, decided here (default: "fused")
        {_published_bugs_doc}
            Here: the four bugs docs/twolevel.md lists and says why each is one.
        {_process_group_doc}
            The statistics are averaged over it, and the decompositions are shared out over
            its ranks.
        distribute_decompositions (bool, optional): under torch.distributed (more than one
            rank), each decomposition (every factor's eigendecomposition on inverse steps,
            the coarse matrix's inverse on T_cov steps) is made by one owner rank and the
            results are shared: one collective per (device, dtype) on inverse steps, the
            coarse inverse inside it where F_c is known before the decompositions
            (nicolaides and tpselepedis without Krylov vectors), else one of its own.
            ``step()`` is then a collective (every rank calls it, as it already does for the
            statistics). ``assignment`` maps each layer's name to the owners of its factors,
            ``{{"A": rank, "G": rank}}``, and ``coarse_worker`` is the coarse inverse's owner
            (both None in one process or when False). False: every rank makes every
            decomposition (no exchange). The numbers do not depend on it (default: True)
        assignment_strategy (str or AssignmentStrategy, optional): how owners are balanced,
            as KFACPreconditioner's: "compute" costs a matrix of size n as n^3, "memory" as
            n^2 (default: "compute")
        colocate_factors (bool, optional): both factors of a layer on one owner; False places
            each factor alone, which balances better (two-level decomposes A and G apart)
            (default: False)
    """
)
