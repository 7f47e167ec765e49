"""DyKAF (arXiv 2511.06477): Adam in the eigenbasis of Kronecker factors that track the nearest
Kronecker approximation of the moving-average empirical Fisher by one projector-splitting step per
iteration, with a rank-one second moment. A drop-in for `TensorDyKAF` (Vepricov/LIB,
src/optimizers/tensor_dykaf.py): the same constructor, defaults and numbers; docs/dykaf.md lists
the conventions kept and the published bugs fixed.

State per parameter (all in `self.state[p]`): `step` (completed updates, a host int: the
eigenbasis refresh every `precondition_frequency` updates is decided on the host) and
`device_step` (the same count as a 0-dim float64 tensor, read by the bias corrections), `exp_avg`,
`exp_avg_sq` (only where the full second moment is used), `l`, `r` (the rank-one second moment),
`factors` and `bases` (one entry per mode, None where the mode is not preconditioned), and the
values frozen at the first step: `kind`, `precondition_frequency`, `shampoo_beta`.

kind "kron2d": a matrix, factors by `proj_split` (or the one-sided sum when one side is over
max_precond_dim); "kron4d": a conv kernel, factors by the 4-mode split; "ema": everything else
(1-D, 3-D, >= 5-D, merged shapes), SOAP's EMA of per-mode products, full second moment.
"""
from __future__ import annotations

import warnings
from math import inf
from typing import Any, Callable, Iterable

import torch

from ... import ops, reference
from ...core import Choice, CoreOptimizer, Flag, Int, Pair, Real, checked_attribute
from ...core.runtime import capturing
from ...core.steps import StepCounter
from ...maths import dykaf as dykaf_maths
from ...maths import state_dtype
from ...sharding import check_sharded, full_parameters
from .._docs import _backend_doc, _params_doc, _published_bugs_doc
from .owners import refresh_owners
from .unstarted import check_unstarted, unstarted_entry

_BACKENDS = {"fused": ops, "reference": reference}
_KINDS = ("kron2d", "kron4d", "ema")
_BETA = Real(0.0, 1.0, high_open=True, dtype=torch.float64)
# A parameter whose first gradient was dropped (inf/NaN in it or in the factors it gives, or an
# eigendecomposition that failed) tries again after 2^(drops - 1) - 1 skipped steps, at most
# _MAX_WAIT: the next step after the first drop, then after 1, 3, 7, ... steps, so that a model
# gone non-finite does not pay the 100-iteration start on every step.
_MAX_WAIT = 63
# exp_avg_rot_step of a device-decided step: the cache belongs to the device count's step, or to
# none (-1) when that step refreshed the bases; state_dict() writes the number.
_FOLLOWS_DEVICE_STEP = "device"
# Constructor arguments that are not group settings.
_SETTINGS = {
    "backend": Choice(*_BACKENDS),
    "data_format": Choice("channels_first", "channels_last"),
    "adam_rank_one": Flag(),
    "rank_one_eps": Real(0.0, inf, high_open=True),
    "seed": Int(0, 2 ** 64 - 1),  # what torch.Generator.manual_seed takes
    "published_bugs": Flag(),
}


class DyKAF(CoreOptimizer):
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
        self._impl = _BACKENDS[backend]
        self.process_group = process_group
        self._owners = owners  # None: every rank refreshes every parameter
        # The latch of device-decided steps: once a step is compiled or captured in a CUDA graph,
        # no decision reads a host count (the refresh is decided from `device_step`).
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

    # ------------------------------------------------------------------ first step: state
    def _kind(self, p: torch.Tensor, group) -> str:
        merged = self._merged_shape(p, group)
        if merged is None and p.dim() == 2:
            return "kron2d"
        # The published code compares only mode 0 of a 4-D weight with max_precond_dim (and
        # crashes when that one is over it); cafin's default honours the limit on every mode.
        modes = p.shape[:1] if self.published_bugs else p.shape
        if merged is None and p.dim() == 4 and max(modes) <= group["max_precond_dim"]:
            return "kron4d"
        return "ema"

    def _init_state(self, p: torch.Tensor, g: torch.Tensor, group) -> str | None:
        """Build a parameter's state from its first gradient. The state is installed only when
        complete; returns None when it is, else why it is not: a gradient holding inf/NaN,
        factors that are not finite (e.g. a power iteration on a gradient so small that its
        squares underflow) or an eigendecomposition that fails also in float64. The caller
        drops that gradient (`_drop_start`)."""
        state: dict[str, Any] = {}
        work = state_dtype(p.dtype)
        g = g.to(work).contiguous()
        if not bool(torch.isfinite(g).all()):  # before the power iterations, which cost ~100 GEMMs
            return "holds inf/NaN"
        shampoo_beta = float(group["shampoo_beta"])
        beta = shampoo_beta if shampoo_beta >= 0 else float(group["betas"][1])
        state["step"] = 0
        state["device_step"] = torch.zeros((), dtype=torch.float64, device=p.device)
        # the base of the ops' float64 scalars (guard, eps, weight decay), made here, eagerly: a
        # compiled step that made it would recompile on the next
        self._one(p.device, torch.float64)
        state["precondition_frequency"] = group["precondition_frequency"]
        state["shampoo_beta"] = beta
        state["exp_avg"] = torch.zeros_like(p, dtype=work, memory_format=torch.contiguous_format)
        kind = state["kind"] = self._kind(p, group)
        if kind == "kron2d" and self.adam_rank_one:
            eps = float(group["eps"])
            state["l"] = torch.full((p.shape[0],), eps, dtype=work, device=p.device)
            state["r"] = torch.full((p.shape[1],), eps, dtype=work, device=p.device)
        else:
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        factors = self._first_factors(p, g, group, kind, beta)
        kept = [f for f in factors if f is not None]
        if kept and not bool(torch.stack([torch.isfinite(f).all() for f in kept]).all()):
            return ("gives factors that are not finite (a gradient too small or too large for "
                    "the power iteration in this dtype?)")
        state["factors"] = factors
        if self._owners is not None:
            # the eigendecompositions on their owner ranks at the end of the step, shared as the
            # refreshes are; the state is installed (or the gradient dropped) there
            self._owners.defer_start(p, state, group)
            return None
        try:
            bases = [None if f is None else dykaf_maths.eigenbasis(f) for f in factors]
        except torch.linalg.LinAlgError as e:  # eigenbasis has already retried in float64
            return f"gives factors whose eigendecomposition failed ({e})"
        self._install_start(p, state, bases)
        return None

    def _install_start(self, p: torch.Tensor, state: dict[str, Any], bases: list) -> None:
        """Install a parameter's first state, its factors' eigenbases given."""
        stacked = (self.backend == "fused" and state["kind"] == "kron2d"
                   and all(f is not None for f in state["factors"]))
        if stacked:
            # The batched GEMMs read row-major bases (see _stack): made so here, once; every
            # refresh is then copied into these buffers (the other kinds' projections keep the
            # layout eigh and QR give, and their numbers with it).
            bases = [Q.contiguous() for Q in bases]
        state["bases"] = bases
        if stacked:
            # the rotated moment's buffer (see _update), in the state from the start so that a
            # checkpoint template made from a fresh optimizer (torch.distributed.checkpoint) holds it
            state["exp_avg_rot"] = torch.zeros_like(state["exp_avg"])
            state["exp_avg_rot_step"] = -1
        # In place: under FSDP2 the parameter and its full-size stand-in share this dict.
        self.state[p].update(state)

    def _finish_start(self, p: torch.Tensor, state: dict[str, Any], bases: list | None,
                      why: str | None) -> None:
        """A deferred first step, its eigenbases made by their owners: installed, or, where an
        eigendecomposition failed (`why`), the gradient dropped on every rank."""
        if why is not None:
            self._drop_start(p, f"gives factors whose eigendecomposition failed ({why})")
            return
        self._install_start(p, state, bases)
        self._waits.pop(p, None)

    def _drop_start(self, p: torch.Tensor, why: str) -> None:
        """A first gradient that cannot start the parameter's state: dropped (nothing is
        written), counted (`skipped_factor_updates`), warned of, and the parameter waits before
        its next try (_MAX_WAIT)."""
        wait = self._waits.setdefault(p, [0, 0])
        wait[0] += 1
        wait[1] = min(2 ** (wait[0] - 1) - 1, _MAX_WAIT)
        self._dropped += 1
        warnings.warn(f"DyKAF: parameter of shape {tuple(p.shape)}: its first gradient {why}; "
                      f"dropped (its drop {wait[0]}, {self._dropped} in all): its state is not "
                      f"built, and it tries again with the gradient of {wait[1] + 1} step(s) "
                      "from now", RuntimeWarning, stacklevel=6)

    @property
    def skipped_factor_updates(self) -> int:
        """First gradients dropped because they (or the factors they gave) held inf/NaN, or
        because the eigendecomposition of their factors failed: the parameter then keeps no
        state and tries again later (backing off: 1, 2, 4, ... up to 64 steps apart)."""
        return self._dropped

    def _gated(self) -> bool:
        """Whether this step decides on the device (compiled, captured, or any step after one
        of those): then no decision reads a host count or a value that changes between steps."""
        return self._steps.host_due(1) is None

    def _first_factors(self, p: torch.Tensor, g: torch.Tensor, group, kind: str,
                       beta: float) -> list[torch.Tensor | None]:
        """A parameter's Kronecker factors from its first gradient `g` (in the state dtype):
        per side, a factor, or None for a side that is not preconditioned."""
        if kind == "kron2d":
            return self._start_2d(g, group, beta)
        if kind == "kron4d":
            start = dykaf_maths.hopm_start(g, self.seed, self.published_bugs)
            return dykaf_maths.tensor_proj_split(start, g, beta, self.published_bugs)
        if p.dim() == 1 and not group["precondition_1d"]:
            return [None]
        limit = group["max_precond_dim"]
        merged = self._merged_shape(p, group)
        gm = self._to_merged(g, merged) if merged is not None else g
        factors = [None if sh > limit else torch.zeros(sh, sh, dtype=g.dtype, device=p.device)
                   for sh in gm.shape]
        self._ema(factors, gm, beta)
        return factors

    def _start_2d(self, g: torch.Tensor, group, beta: float) -> list[torch.Tensor | None]:
        m, n = g.shape
        limit = group["max_precond_dim"]
        if m > limit or n > limit:  # one side (or none) kept, as an undecayed sum of g g^T
            left = None if m > limit else dykaf_maths.one_sided(
                dykaf_maths.one_sided_start(m, g), g, True)
            right = None if n > limit else dykaf_maths.one_sided(
                dykaf_maths.one_sided_start(n, g), g, False)
            return [left, right]
        if group["init"] == "kron":
            L, R = dykaf_maths.kron_start(g, self.seed)
        elif group["init"] == "eps":
            L, R = dykaf_maths.eps_start(m, g), dykaf_maths.eps_start(n, g)
        else:
            return list(dykaf_maths.proj_split_from_zero(g, beta))
        return list(dykaf_maths.proj_split(L, R, g, beta))

    @staticmethod
    def _ema(factors, g, beta) -> None:
        kept = [k for k, f in enumerate(factors) if f is not None]
        if not kept:  # e.g. a 1-D tensor without precondition_1d: no product to form
            return
        for k, product in enumerate(dykaf_maths.mode_products(g, kept)):
            if product is not None:
                factors[k].lerp_(product, 1 - beta)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One step; a closure is evaluated with grad enabled and its loss returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                    if capturing():
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

    def _update(self, group, params: list[torch.Tensor]) -> None:
        """One step of the parameters of one device: rotate the gradients into the eigenbases,
        update the moments, precondition, rotate back, apply, then update the factors."""
        device = params[0].device
        lr = self._hyperparameter(group, "lr", device, torch.float64)
        beta1, beta2 = self._hyperparameter(group, "betas", device, torch.float64)
        states = [self.state[p] for p in params]
        grads = [p.grad.to(st["exp_avg"].dtype).contiguous() for p, st in zip(params, states)]
        gated = self._gated()
        # fused: matrices of one shape rotate (and split their factors) in batched GEMMs, with
        # the split's elementwise work in two ops
        stacks = self._stacks(params, states) if self.backend == "fused" else []
        alone = sorted(set(range(len(params))) - {i for idx, _, _ in stacks for i in idx})
        rotated = self._rotate_gradients(group, params, states, grads, stacks, alone)
        if not gated:
            for st in states:
                st["step"] += 1
        # The same count on the device: bias corrections read it there, so a compiled step
        # holds no symbolic step count in its graph, and device-decided steps decide their
        # refreshes from it.
        torch._foreach_add_([st["device_step"] for st in states], 1.0)
        moments, stacked_moments = self._update_moments(group, params, states, grads, rotated,
                                                        stacks, alone, beta1, gated)
        self._precondition(group, states, rotated, moments, beta2)
        updates = self._rotate_back(group, params, states, moments, stacks, stacked_moments, alone)
        self._apply_updates(group, params, states, updates, lr, beta1, beta2, gated)
        self._update_all_factors(group, params, states, grads, stacks, gated)

    def _rotate_gradients(self, group, params, states, grads, stacks, alone) -> list:
        """The gradients in the eigenbases (stacked matrices of one shape in one batched GEMM)."""
        rotated: list = [None] * len(params)
        for i in alone:  # read only (the moments are preconditioned in place, these are not)
            rotated[i] = self._project(grads[i], states[i], params[i], group, copy=False)
        for idx, QL, QR in stacks:
            stacked = _sandwich(QL.mT, _stack([grads[i] for i in idx]), QR)
            for i, x in zip(idx, stacked.unbind(0)):
                rotated[i] = x
        return rotated

    def _update_moments(self, group, params, states, grads, rotated, stacks, alone, beta1,
                        gated):
        """exp_avg's average of the gradients, and its rotation into the eigenbases: (the rotated
        moments, one per parameter; the stacked ones, one per stack)."""
        exp_avgs = [st["exp_avg"] for st in states]
        keep, take = _scalars_like(exp_avgs, beta1)
        _average_(exp_avgs, grads, keep, take, host=not gated)
        moments: list = [None] * len(params)
        for i in alone:
            moments[i] = self._project(exp_avgs[i], states[i], params[i], group)
        stacked_moments = []
        for idx, QL, QR in stacks:
            # The rotated moment Q_L^T exp_avg Q_R is kept between refreshes: rotating is linear,
            # so it follows the same average as exp_avg, from the rotated gradient, without the
            # two GEMMs of a projection (equal up to rounding). "exp_avg_rot_step" is the step it
            # belongs to (-1: none); a host int, so a checkpoint resumes on the same path.
            # Device-decided steps advance no host count: they choose on the device (below).
            compiling = torch.compiler.is_compiling()
            known = self._pinned_cache([states[i] for i in idx]) if gated and not compiling else None
            cached = known is True or not gated and all(
                states[i].get("exp_avg_rot_step", -1) == states[i]["step"] - 1 for i in idx)
            if cached:
                caches = [states[i]["exp_avg_rot"] for i in idx]
                _average_(caches, [rotated[i] for i in idx], keep, take, host=not gated)
                stacked = torch.stack(caches)  # a copy: preconditioned in place below
            else:
                stacked = _sandwich(QL.mT, _stack([exp_avgs[i] for i in idx]), QR)
                if known is None and gated and not compiling and all("exp_avg_rot" in states[i] for i in idx):
                    # The moment an eager step takes, chosen on the device: the kept one averaged
                    # where the last step refreshed no basis, else the projection. The two differ
                    # by rounding, which a refresh can amplify in float32; taking the same one
                    # keeps a captured step equal to the eager step.
                    average = (torch.stack([states[i]["exp_avg_rot"] for i in idx]) * keep
                               + torch.stack([rotated[i] for i in idx]) * take)
                    valid = torch.stack([_cache_follows(states[i]) for i in idx])
                    stacked = torch.where(valid.view(-1, 1, 1), average, stacked)
            stacked_moments.append(stacked)
            for i, x in zip(idx, stacked.unbind(0)):
                moments[i] = x
                st = states[i]
                if compiling:
                    # inductor's step writes this cache wrong (aot_eager's is right): a compiled
                    # step keeps none, so the next eager step projects
                    st["exp_avg_rot_step"] = -1
                    continue
                if gated:
                    # Written as an eager step writes it, decided on the device, so that the
                    # checkpoint of a device-decided run equals the eager run's (its step filled
                    # in by state_dict() from the device count): an eager step averages a valid
                    # cache (the last step's, which was no refresh step) and copies the moment
                    # into it on a step that is no refresh step.
                    if "exp_avg_rot" in st:
                        t, every = st["device_step"], st["precondition_frequency"]
                        write = (torch.fmod(t, every) != 0) | (
                            (torch.fmod(t - 1, every) != 0) & (t > 1))
                        st["exp_avg_rot"].copy_(torch.where(write, x, st["exp_avg_rot"]))
                        st["exp_avg_rot_step"] = _FOLLOWS_DEVICE_STEP
                    continue
                if _refresh_due(st):
                    st["exp_avg_rot_step"] = -1  # the bases change after this step
                    continue
                if not cached:
                    if "exp_avg_rot" in st:
                        st["exp_avg_rot"].copy_(x)
                    else:  # a checkpoint of the reference backend
                        st["exp_avg_rot"] = x.clone()
                st["exp_avg_rot_step"] = st["step"]
        return moments, stacked_moments

    def _pinned_cache(self, states) -> bool | None:
        """With k pinned (cafin.StepGraphs), whether the kept rotated moments belong to the last
        step (`_cache_follows`, as the host knows it): True or False when it is so for every
        state, None when the device decides. A parameter's count t runs alongside k from where
        both stopped on the host."""
        if self._steps.pinned is None or not all("exp_avg_rot" in st for st in states):
            return None
        follows = set()
        for st in states:
            offset = st["step"] + 1 - self._steps.host  # t = k + offset after this step's increment
            refreshed = self._steps.host_due(st["precondition_frequency"], offset - 1) is None
            follows.add(self._steps.pinned + offset > 1 and not refreshed)
        return follows.pop() if len(follows) == 1 else None

    def _precondition(self, group, states, rotated, moments, beta2) -> None:
        """Precondition the rotated moments in place: by the rank-one second moment (l, r) where
        kept, else Adam's elementwise one."""
        impl = self._impl
        rank_one = [i for i, st in enumerate(states) if "l" in st]
        full = [i for i, st in enumerate(states) if "l" not in st]
        if rank_one:
            ls, rs = [states[i]["l"] for i in rank_one], [states[i]["r"] for i in rank_one]
            guard = self._as_tensor(self.rank_one_eps, ls[0].device, torch.float64)
            impl.dykaf_rank_one_(ls, rs, [rotated[i] for i in rank_one], beta2, guard)
            impl.dykaf_precondition_([moments[i] for i in rank_one], ls, rs, guard)
        if full:
            impl.dykaf_adam_precondition_([moments[i] for i in full],
                                          [states[i]["exp_avg_sq"] for i in full],
                                          [rotated[i] for i in full], beta2,
                                          self._as_tensor(group["eps"], moments[full[0]].device, torch.float64))

    def _rotate_back(self, group, params, states, moments, stacks, stacked_moments, alone) -> list:
        """The preconditioned moments rotated back out of the eigenbases: the updates."""
        updates: list = [None] * len(params)
        for i in alone:
            updates[i] = self._project(moments[i], states[i], params[i], group, back=True)
        for (idx, QL, QR), stacked in zip(stacks, stacked_moments):
            for i, x in zip(idx, _sandwich(QL, stacked, QR.mT).unbind(0)):
                updates[i] = x
        return updates

    def _apply_updates(self, group, params, states, updates, lr, beta1, beta2, gated) -> None:
        """Apply the updates to the parameters (step size, bias correction, weight decay)."""
        impl = self._impl
        # Eagerly, parameters share one step size and one apply call when their host step counts
        # agree (the usual case); no dict keyed by the count, which would make a compiled step
        # specialise on its value and recompile every step. A device-decided step reads no host
        # count: one call per parameter, each with its own device count.
        counts = [st["step"] for st in states] if not gated else None
        if counts is not None and all(t == counts[0] for t in counts):
            calls = [list(range(len(states)))]
        else:
            calls = [[i] for i in range(len(states))]
        for idx in calls:
            step_size = lr
            if group["correct_bias"]:
                t = states[idx[0]]["device_step"]
                step_size = lr * (1 - beta2 ** t).sqrt() / (1 - beta1 ** t)
            # The kernel writes parameters as flat arrays: a channels_last one is updated in a
            # contiguous copy, copied back.
            targets = [params[i] for i in idx]
            flat = [p if p.is_contiguous() else p.contiguous() for p in targets]
            weight_decay = self._as_tensor(group["weight_decay"], flat[0].device, torch.float64)
            impl.dykaf_apply_(flat, [updates[i] for i in idx], step_size, lr, weight_decay,
                              bool(group["normalize_grads"]))
            for p, q in zip(targets, flat):
                if q is not p:
                    p.copy_(q)

    def _update_all_factors(self, group, params, states, grads, stacks, gated) -> None:
        """Update the Kronecker factors from the gradients, in place: stacks in one batched
        split; on a CPU, eagerly, each matrix by `proj_split_matrix_` (host scalars: a
        device-decided step keeps the batched form, whose scalars stay on the device)."""
        for idx, _, _ in stacks:
            beta = states[idx[0]]["shampoo_beta"]
            if not gated and not self._batched(params[idx[0]].device):
                (i,) = idx
                _write_(states[i]["factors"], dykaf_maths.proj_split_matrix_(
                    *states[i]["factors"], grads[i], beta))
                continue
            U, V = dykaf_maths.proj_split_batched(
                _stack([states[i]["factors"][0] for i in idx]),
                _stack([states[i]["factors"][1] for i in idx]),
                _stack([grads[i] for i in idx]), beta, self._impl)
            for i, u, v in zip(idx, U.unbind(0), V.unbind(0)):
                _write_(states[i]["factors"], (u, v))
        done = {i for idx, _, _ in stacks for i in idx}
        for i, (p, g, st) in enumerate(zip(params, grads, states)):
            self._update_factors(p, g, st, group, gated, split=i not in done)

    def _project(self, x, state, p, group, back: bool = False, copy: bool = True) -> torch.Tensor:
        bases = state["bases"]
        if all(Q is None for Q in bases):
            # a copy where the caller writes the result in place (the moments)
            return x.clone() if copy and not back else x
        merged = self._merged_shape(p, group)
        if merged is not None:
            x = self._to_merged(x, merged)
        x = dykaf_maths.project_back(x, bases) if back else dykaf_maths.project(x, bases)
        if merged is not None:
            x = self._from_merged(x, p)
        return x.contiguous()

    _batch_on_cpu = False  # tests set it to run the GPU's batched path on a CPU

    def _batched(self, device: torch.device) -> bool:
        """Whether the matrices of one shape on `device` share batched GEMMs (see _stacks)."""
        return device.type != "cpu" or self._batch_on_cpu

    def _stacks(self, params, states) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """Matrices rotated on both sides, grouped by (shape, dtype, device, shampoo_beta):
        (indices, stacked Q_L, stacked Q_R). On a GPU one batched GEMM per group saves launches;
        on a CPU every matrix is a group of its own, a view without a copy: there stacking
        copied every basis, factor and gradient each step and bmm ran no faster than mm
        (measured: docs/dykaf.md, "Speed (CPU only)")."""
        groups: dict[tuple, list[int]] = {}
        for i, (p, st) in enumerate(zip(params, states)):
            if st["kind"] == "kron2d" and all(Q is not None for Q in st["bases"]):
                key = (tuple(p.shape), st["exp_avg"].dtype, p.device, st["shampoo_beta"])
                batched = self._batched(p.device)
                groups.setdefault(key if batched else (i,), []).append(i)
                # The GEMMs read row-major bases (see _stack): the bases are made row-major and
                # every refresh is copied into them (a checkpoint may bring column-major ones,
                # which _stack then copies; the state's buffers are never replaced).
        return [(idx, _stack([states[i]["bases"][0] for i in idx]),
                 _stack([states[i]["bases"][1] for i in idx]))
                for idx in groups.values()]

    def _update_factors(self, p, g, state, group, gated: bool, split: bool = True) -> None:
        """Update one parameter's factors in place, then refresh its eigenbases when due."""
        beta, factors, kind = state["shampoo_beta"], state["factors"], state["kind"]
        if kind == "kron2d" and not split:
            pass  # split already, batched with the other matrices of its shape
        elif kind == "kron2d":
            L, R = factors
            if L is not None and R is not None:
                _write_(factors, dykaf_maths.proj_split(L, R, g, beta))
            else:
                for F, left in ((L, True), (R, False)):
                    if F is not None:
                        dykaf_maths.one_sided_(F, g, left)
        elif kind == "kron4d":
            _write_(factors, dykaf_maths.tensor_proj_split(factors, g, beta, self.published_bugs))
        else:
            merged = self._merged_shape(p, group)
            self._ema(factors, self._to_merged(g, merged) if merged is not None else g, beta)
        if gated:
            # A device-decided step reads no host count (a compiled one would recompile for each
            # value, a captured one would replay the value of its capture): the refresh is
            # decided from the device count. Left out where the host knows it is not due
            # (StepGraphs); the host count stopped at the counter's, so the offset is fixed.
            every = state["precondition_frequency"]
            if self._steps.pinned is not None and self._steps.host_due(
                    every, state["step"] + 1 - self._steps.host) is False:
                return
            due = torch.fmod(state["device_step"], every) == 0
            self._refresh(p, state, group, due)
        elif _refresh_due(state):
            self._refresh(p, state, group)

    def _refresh(self, p, state, group, due: torch.Tensor | None = None) -> None:
        """The eigenbasis refresh (one power step and QR, float32), with the second moment's
        entries permuted along with the basis columns; with `due` (a device bool) the old basis
        and order are kept where it is false: while compiling a torch.cond (the QR runs only on
        due steps), otherwise (a CUDA-graph capture, whose eager torch.cond would read `due` on
        the host) the refresh runs on every step and torch.where keeps the old basis where it is
        not due. With a process_group an eager refresh waits for the end of the step, where its
        owner rank makes it and shares it (cafin.optim.dykaf_owners)."""
        if due is None and self._owners is not None:
            self._owners.defer(p, state, group)
            return
        new: list = []
        for factor, basis in zip(state["factors"], state["bases"]):
            if factor is None:
                new.append(None)
            elif due is None:
                new.append(dykaf_maths.refresh_basis(factor, basis))
            elif torch.compiler.is_compiling():  # the branch taken on the device
                new.append(torch.cond(due, dykaf_maths.refresh_basis, _keep_basis, (factor, basis)))
            else:
                new.append(_blend_refresh(factor, basis, due))
        self._install_refresh(p, state, group, new)

    def _install_refresh(self, p, state, group, new: list) -> None:
        """Write a refresh into the state, in place: new[k] = (basis, order) for each mode with
        a basis (None for the others); the second moment follows each new order."""
        bases = state["bases"]
        merged = self._merged_shape(p, group)
        v = state.get("exp_avg_sq")
        if v is not None and merged is not None:
            v = self._to_merged(v, merged)
        for k, refreshed in enumerate(new):
            if refreshed is None:
                continue
            basis, order = refreshed
            bases[k].copy_(basis)
            if "l" in state:
                moment = state["l" if k == 0 else "r"]
                moment.copy_(moment.index_select(0, order.to(moment.device)))
            else:
                v = v.index_select(k, order)
        if v is not None:
            state["exp_avg_sq"].copy_(self._from_merged(v, p) if merged is not None else v)

    # ------------------------------------------------------------------ checkpoints
    def _groups_changed(self) -> None:
        self._hold_every_parameter()

    def _loaded(self, record: Any) -> None:
        self._hold_every_parameter()

    def _hold_every_parameter(self) -> None:
        """An entry in `self.state` for every parameter, empty until its first step: an optimizer
        with state is one that torch.distributed.checkpoint's get/set_optimizer_state_dict do not
        step with zero gradients to create state (such a step would build the state of "eps"
        starts from a zero gradient, and change the run)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state.setdefault(p, {})

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout; `step` is read from `device_step` (compiled steps advance only
        the device count), one host read per parameter at checkpoint time. A parameter that
        requires grad and has no state yet has its unstarted entry (`step` None, zeros of its
        state's shapes: cafin.optim.dykaf_unstarted), so that the state dict of a fresh optimizer
        is a template that torch.distributed.checkpoint can load a saved one into."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # not the live dicts
        for st in sd["state"].values():
            if "device_step" in st:
                st["step"] = int(st["device_step"].item())
            if st.get("exp_avg_rot_step") == _FOLLOWS_DEVICE_STEP:
                due = st["step"] % st["precondition_frequency"] == 0
                st["exp_avg_rot_step"] = -1 if due else st["step"]
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and "step" not in self.state.get(p, {}):
                    sd["state"][index] = unstarted_entry(self, p, group)
                index += 1
        sd["state"] = {k: v for k, v in sorted(sd["state"].items()) if v}  # frozen: none
        return sd

    def _checked_layout(self, where: str, p: torch.Tensor, saved: dict[str, Any],
                        group: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
        """A saved state's kind, checked against the parameter's shape and its group's
        merge_dims, and its keys against the kind; returns (kind, the modes its factors cover)."""
        kind = saved.get("kind")
        if not isinstance(kind, str) or kind not in _KINDS:
            raise ValueError(f"{where}: kind must be one of {', '.join(map(repr, _KINDS))}, got {kind!r}")
        merged = self._merged_shape(p, group)
        if kind != "ema" and (p.dim() != {"kron2d": 2, "kron4d": 4}[kind] or merged is not None):
            raise ValueError(f"{where}: kind {kind!r} does not fit a parameter of shape "
                             f"{tuple(p.shape)}" + (" with merge_dims" if merged is not None else ""))
        modes = tuple(p.shape) if merged is None else merged
        moments = {"l", "r"} if kind == "kron2d" and "l" in saved else {"exp_avg_sq"}
        required = {"step", "device_step", "precondition_frequency", "shampoo_beta", "exp_avg",
                    "kind", "factors", "bases"} | moments
        optional = {"exp_avg_rot", "exp_avg_rot_step"} if kind == "kron2d" else set()
        keys = set(saved)
        if not required <= keys or keys - required - optional:
            raise ValueError(f"{where} has keys {sorted(map(str, keys))}, expected "
                             f"{sorted(required)}" + (f" (and optionally {sorted(optional)})"
                                                      if optional else ""))
        return kind, modes

    def _checkpoint_entry(self, index, p: torch.Tensor, saved: dict[str, Any],
                          group: dict[str, Any]) -> dict[str, Any]:
        """The validated copy of one parameter's saved state (the core calls this for every
        parameter before it replaces anything). Checked against the parameter and its group's
        settings as loaded: the kind, the keys it needs, every tensor's shape (factors and bases
        against the parameter's modes, or its merged shape), that it is real and finite (moments
        also >= 0), the counts. Tensors are copied onto the parameter's device in its state
        dtype."""
        if not saved:
            return {}  # a parameter that waits for a usable first gradient
        where = f"checkpoint state of parameter {index}"
        if "step" in saved and saved["step"] is None:  # its unstarted entry: no state yet
            check_unstarted(where, saved, unstarted_entry(self, p, group))
            return {}
        kind, modes = self._checked_layout(where, p, saved, group)
        work = state_dtype(p.dtype)

        def tensor(key, shape, dtype=work, nonnegative=False):
            return _saved_tensor(saved[key], f"{where}: {key}", shape, dtype, p.device, nonnegative)

        def setting(key, rule):
            rule.check(saved[key], f"{where}: {key}")
            return saved[key]

        entry: dict[str, Any] = {"kind": kind}
        entry["step"] = step = setting("step", Int(0))
        entry["precondition_frequency"] = setting("precondition_frequency", Int(1))
        entry["shampoo_beta"] = float(setting("shampoo_beta", Real(0.0, 1.0)))
        entry["device_step"] = tensor("device_step", (), torch.float64)
        if float(entry["device_step"]) != step:
            raise ValueError(f"{where}: device_step {float(entry['device_step'])} is not step {step}")
        entry["exp_avg"] = tensor("exp_avg", p.shape)
        if kind == "kron2d" and "l" in saved:
            entry["l"] = tensor("l", p.shape[:1], nonnegative=True)
            entry["r"] = tensor("r", p.shape[1:], nonnegative=True)
        else:
            entry["exp_avg_sq"] = tensor("exp_avg_sq", p.shape, nonnegative=True)
        entry.update(_checked_factors(where, saved, kind, modes, work, p.device))
        if "exp_avg_rot" in saved:
            entry["exp_avg_rot"] = tensor("exp_avg_rot", p.shape)
        if "exp_avg_rot_step" in saved:
            rot_step = setting("exp_avg_rot_step", Int(-1, step))
            if rot_step != -1 and "exp_avg_rot" not in saved:
                raise ValueError(f"{where}: exp_avg_rot_step {rot_step} without exp_avg_rot")
            entry["exp_avg_rot_step"] = rot_step
        return {key: entry[key] for key in saved}  # the saved order


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


def _cache_follows(state) -> torch.Tensor:
    """Whether the kept rotated moment belongs to the last step (a device bool, from the device
    count t after its increment): the host-decided rule `exp_avg_rot_step == step - 1`, since
    every step writes it except one that refreshes the bases."""
    t, every = state["device_step"], state["precondition_frequency"]
    return (t > 1) & (torch.fmod(t - 1, every) != 0)


def _refresh_due(state) -> bool:
    """Whether an eager step refreshes the eigenbases at its end (host step count)."""
    return state["step"] % state["precondition_frequency"] == 0


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, or for one tensor a view (a copy only if it is not row-major: the refresh
    leaves LAPACK's column-major bases, a checkpoint restores row-major ones, and a GEMM must see
    one layout to round the same after a resume)."""
    return xs[0].contiguous().unsqueeze(0) if len(xs) == 1 else torch.stack(xs)


def _sandwich(A: torch.Tensor, X: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """A X B over stacks of matrices: batched GEMMs, or for a stack of one (a CPU's group) GEMMs
    of its 2-D views (bmm of one matrix ran slower than mm on the GPT's 128-wide products)."""
    if X.shape[0] == 1:
        return torch.mm(torch.mm(A[0], X[0]), B[0]).unsqueeze(0)
    return torch.bmm(torch.bmm(A, X), B)


def _scalars_like(xs: list[torch.Tensor], beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """beta and 1 - beta (0-dim float64) in the dtype of `xs` when they share one: the values the
    foreach ops would convert them to for every tensor, converted once."""
    take = 1 - beta
    dtypes = {x.dtype for x in xs}
    if len(dtypes) != 1:
        return beta, take
    (dtype,) = dtypes
    return beta.to(dtype), take.to(dtype)


def _average_(xs: list[torch.Tensor], ys: list[torch.Tensor], keep: torch.Tensor,
              take: torch.Tensor, host: bool = True) -> None:
    """xs <- keep xs + take ys. On a CPU, with `host` (eager, not device-decided) and outside a
    compiled step, take is read on the host (no sync there) and added as alpha: one pass, no
    temporary; elsewhere the foreach product."""
    torch._foreach_mul_(xs, keep)
    if host and xs[0].device.type == "cpu" and not torch.compiler.is_compiling():
        torch._foreach_add_(xs, ys, alpha=take.item())
    else:
        torch._foreach_add_(xs, torch._foreach_mul(ys, take))


def _write_(olds: list, news) -> None:
    """Write new factors into the state's buffers (the same storage from step to step, as a
    CUDA graph's replays need); a new value that is its old buffer (written in place) stays.
    One foreach copy: a 4-D weight's four factors in one dispatch."""
    pairs = [(old, new) for old, new in zip(olds, news) if old is not None and new is not old]
    if pairs:
        torch._foreach_copy_([old for old, _ in pairs], [new for _, new in pairs])


def _blend_refresh(factor: torch.Tensor, basis: torch.Tensor,
                   due: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The refresh of a device-decided step outside a compile: made on every step, kept where
    `due` (a 0-dim device bool) is true, else the basis as it is and the identity order."""
    new, order = dykaf_maths.refresh_basis(factor, basis)
    keep = torch.arange(basis.shape[1], device=basis.device)
    return torch.where(due, new, basis), torch.where(due, order, keep)


def _keep_basis(factor: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The not-due branch of a compiled refresh: the basis as it is, the identity order. In QR's
    column-major layout, as the due branch returns it (an eager step may have left it row-major)."""
    kept = torch.empty_strided(basis.shape, (1, basis.shape[0]), dtype=basis.dtype,
                               device=basis.device)
    return kept.copy_(basis), torch.arange(basis.shape[1], device=basis.device)


# ----------------------------------------------------------------------------------- checkpoints
def _checked_factors(where: str, saved: dict[str, Any], kind: str, modes: tuple[int, ...],
                     dtype: torch.dtype, device: torch.device) -> dict[str, list]:
    """A saved state's factors and bases: one [d, d] tensor or None per mode, None for the same
    modes in both (a kron4d state has all four)."""
    out: dict[str, list] = {}
    for key in ("factors", "bases"):
        value = saved[key]
        if not isinstance(value, (list, tuple)) or len(value) != len(modes):
            raise ValueError(f"{where}: {key} must be a list of {len(modes)} entries (one per "
                             f"mode of {modes}), got {type(value).__name__} "
                             f"{len(value) if isinstance(value, (list, tuple)) else ''}".rstrip())
        out[key] = [None if x is None else _saved_tensor(x, f"{where}: {key}[{k}]", (d, d), dtype, device)
                    for k, (x, d) in enumerate(zip(value, modes))]
    if [f is None for f in out["factors"]] != [b is None for b in out["bases"]]:
        raise ValueError(f"{where}: factors and bases must be None for the same modes")
    if kind == "kron4d" and any(f is None for f in out["factors"]):
        raise ValueError(f"{where}: a kron4d state needs all four factors")
    return out


def _saved_tensor(value, what: str, shape, dtype: torch.dtype, device: torch.device,
                  nonnegative: bool = False) -> torch.Tensor:
    """A checkpoint's tensor, checked (real, of `shape`, finite; >= 0 when asked) and copied
    onto `device` in `dtype`, its strides kept."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{what} must be a real floating tensor, got "
                        f"{getattr(value, 'dtype', type(value).__name__)}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    out = value.detach().to(device=device, dtype=dtype, copy=True)
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{what} holds non-finite values")
    if nonnegative and bool((out < 0).any()):
        raise ValueError(f"{what} holds negative values")
    return out
