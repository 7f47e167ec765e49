"""DyKAF (arXiv 2511.06477): Adam in the eigenbasis of Kronecker factors that track the nearest
Kronecker approximation of the moving-average empirical Fisher by one projector-splitting step per
iteration, with a rank-one second moment. A drop-in for `TensorDyKAF` (Vepricov/LIB,
src/optimizers/tensor_dykaf.py): the same constructor, defaults and numbers; the README section "DyKAF" lists
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

from typing import Any, Callable, Iterable

import torch

from .. import ops, reference
from ..reference import dykaf as math
from ..reference import state_dtype
from ..sharding import check_sharded, full_parameters

_BACKENDS = {"fused": ops, "reference": reference}
_INITS = ("kron", "eps", "zeros")


class DyKAF(torch.optim.Optimizer):
    """DyKAF over `params` (parameters or param-group dicts), with the published signature.

    Args (published meaning): lr; betas (Adam's beta1, beta2); shampoo_beta (factor decay, < 0:
    betas[1]; frozen at a parameter's first step); eps (start of the rank-one moment, epsilon of the
    full second moment); weight_decay (decoupled, on the updated weights); precondition_frequency
    (refresh of the eigenbases, frozen at the first step); max_precond_dim (a mode longer than this
    is not rotated); merge_dims; precondition_1d; normalize_grads; data_format ("channels_first" or
    "channels_last": how merge_dims reads 4-D tensors); correct_bias; init ("kron", "eps" or
    "zeros": the start of the 2-D factors); adam_rank_one (rank-one second moment for matrices).
    cafin's keywords:
        backend: "fused" (C++/CUDA kernels) or "reference" (plain PyTorch).
        rank_one_eps: 0 (published): the rank-one denominator is sqrt(l r^T) with no epsilon.
            > 0: it is sqrt(l r^T) + rank_one_eps, and a rank-one moment that collapsed to zero
            restarts from the uniform direction instead of turning NaN.
        seed: the starting vectors of the "kron" and 4-D (HOPM) power iterations are drawn from a
            CPU generator seeded with this (the published code uses the global torch.randn).
        published_bugs: False (default): the 4-D (conv kernel) factor step keeps unit factors and
            carries the weight as the norm of each mode's update, and the HOPM start takes |s|.
            True: the published step, whose weight roughly squares every step (it overflows to NaN
            on a small CNN within 13 steps) and whose start is NaN for a negative s.
    The first step of each parameter only builds its state (no update, no decay), as published.
    lr and betas are kept as 0-dim float64 tensors on the parameters' device, so schedulers change
    them in place (for betas: `group["betas"][i].fill_(x)`) and a compiled step does not recompile.
    """

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 3e-3, betas=(0.95, 0.95),
                 shampoo_beta: float = -1, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 10, max_precond_dim: int = 10000,
                 merge_dims: bool = False, precondition_1d: bool = False,
                 normalize_grads: bool = False, data_format: str = "channels_first",
                 correct_bias: bool = True, init: str = "kron", adam_rank_one: bool = True, *,
                 backend: str = "fused", rank_one_eps: float = 0.0, seed: int = 0,
                 published_bugs: bool = False):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        if data_format not in ("channels_first", "channels_last"):
            raise ValueError(f"data_format must be 'channels_first' or 'channels_last', "
                             f"got {data_format!r}")
        if not rank_one_eps >= 0.0:
            raise ValueError(f"rank_one_eps must be >= 0, got {rank_one_eps}")
        defaults = dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps,
                        weight_decay=weight_decay, precondition_frequency=precondition_frequency,
                        max_precond_dim=max_precond_dim, merge_dims=merge_dims,
                        precondition_1d=precondition_1d, normalize_grads=normalize_grads,
                        correct_bias=correct_bias, init=init)
        self.adam_rank_one = bool(adam_rank_one)
        self.data_format = data_format
        self.backend = backend
        self.rank_one_eps = float(rank_one_eps)
        self.seed = int(seed)
        self.published_bugs = bool(published_bugs)
        self._impl = _BACKENDS[backend]
        super().__init__(params, defaults)
        self._sharded = check_sharded([p for g in self.param_groups for p in g["params"]],
                                      "DyKAF") is not None

    # ------------------------------------------------------------------ groups and hyperparameters
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        before = len(self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_group(group)
        except Exception:
            del self.param_groups[before:]  # a rejected group leaves nothing behind
            raise
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        group["lr"] = _scalar(group["lr"], device)
        group["betas"] = tuple(_scalar(b, device) for b in group["betas"])

    # ------------------------------------------------------------------ merge_dims
    def _merged_shape(self, p: torch.Tensor, group) -> tuple[int, ...] | None:
        return math.merged_shape(p.shape, group["merge_dims"], group["max_precond_dim"],
                                 self.data_format)

    def _to_merged(self, x: torch.Tensor, shape) -> torch.Tensor:
        return math.to_merged(x, shape, self.data_format)

    def _from_merged(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return math.from_merged(x, like.shape, self.data_format)

    # ------------------------------------------------------------------ first step: state
    def _init_state(self, p: torch.Tensor, g: torch.Tensor, group) -> None:
        state = self.state[p]
        work = state_dtype(p.dtype)
        g = g.to(work)
        limit = group["max_precond_dim"]
        beta = group["shampoo_beta"] if group["shampoo_beta"] >= 0 else float(group["betas"][1])
        merged = self._merged_shape(p, group)
        state["step"] = 0
        state["device_step"] = torch.zeros((), dtype=torch.float64, device=p.device)
        state["precondition_frequency"] = group["precondition_frequency"]
        state["shampoo_beta"] = beta
        state["exp_avg"] = torch.zeros_like(p, dtype=work, memory_format=torch.contiguous_format)
        if merged is None and p.dim() == 2:
            kind = "kron2d"
        elif merged is None and p.dim() == 4 and max(p.shape) <= limit:
            kind = "kron4d"
        else:
            kind = "ema"
        state["kind"] = kind
        if kind == "kron2d" and self.adam_rank_one:
            state["l"] = torch.full((p.shape[0],), group["eps"], dtype=work, device=p.device)
            state["r"] = torch.full((p.shape[1],), group["eps"], dtype=work, device=p.device)
        else:
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        if kind == "kron2d":
            factors = self._start_2d(g, group, beta)
        elif kind == "kron4d":
            factors = math.tensor_proj_split(math.hopm_start(g, self.seed, self.published_bugs), g, beta,
                                                 self.published_bugs)
        else:
            shape = merged if merged is not None else p.shape
            if p.dim() == 1 and not group["precondition_1d"]:
                factors = [None]
            else:
                gm = self._to_merged(g, shape) if merged is not None else g
                factors = [None if sh > limit else torch.zeros(sh, sh, dtype=work, device=p.device)
                           for sh in gm.shape]
                self._ema(factors, gm, beta)
        state["factors"] = factors
        state["bases"] = [None if f is None else math.eigenbasis(f) for f in factors]
        if self.backend == "fused" and kind == "kron2d" and all(f is not None for f in factors):
            # the rotated moment's buffer (see _update), in the state from the start so that a
            # checkpoint template made from a fresh optimizer (torch.distributed.checkpoint) holds it
            state["exp_avg_rot"] = torch.zeros_like(state["exp_avg"])
            state["exp_avg_rot_step"] = -1

    def _start_2d(self, g: torch.Tensor, group, beta: float) -> list[torch.Tensor | None]:
        m, n = g.shape
        limit = group["max_precond_dim"]
        if m > limit or n > limit:  # one side (or none) kept, as an undecayed sum of g g^T
            left = None if m > limit else math.one_sided(math.one_sided_start(m, g), g, True)
            right = None if n > limit else math.one_sided(math.one_sided_start(n, g), g, False)
            return [left, right]
        if group["init"] == "kron":
            L, R = math.kron_start(g, self.seed)
        elif group["init"] == "eps":
            L, R = math.eps_start(m, g), math.eps_start(n, g)
        else:
            return list(math.proj_split_from_zero(g, beta))
        return list(math.proj_split(L, R, g, beta))

    @staticmethod
    def _ema(factors, g, beta) -> None:
        for k, product in enumerate(math.mode_products(g)):
            if factors[k] is not None:
                factors[k].lerp_(product, 1 - beta)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One step; a closure is evaluated with grad enabled and its loss returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._sharded:  # FSDP2: the update reads full gradients; each rank keeps its rows
            with full_parameters(self):
                self._step()
        else:
            self._step()
        return loss

    def _step(self) -> None:
        for group in self.param_groups:
            active = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("DyKAF does not support sparse gradients")
                state = self.state[p]
                if "step" not in state:
                    # A zero first gradient gives the power iterations (and the "zeros" start)
                    # no direction to start from: wait for a non-zero one (published for "kron").
                    if ((group["init"] in ("kron", "zeros") or p.dim() == 4)
                            and not bool(p.grad.any())):
                        continue
                    self._init_state(p, p.grad, group)
                    continue  # the first step only builds state, as published
                active.append(p)
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in active:
                by_device.setdefault(p.device, []).append(p)
            for params in by_device.values():
                self._update(group, params)

    # LR schedulers wrap `opt.step` in a function Dynamo will not trace; marking it as wrapped
    # keeps `torch.compile(opt.step, fullgraph=True)` possible under a scheduler.
    step._wrapped_by_lr_sched = True
    _opt_called = True

    def _update(self, group, params: list[torch.Tensor]) -> None:
        impl = self._impl
        device = params[0].device
        lr, beta1, beta2 = (_on(x, device) for x in (group["lr"], *group["betas"]))
        states = [self.state[p] for p in params]
        grads = [p.grad.to(st["exp_avg"].dtype).contiguous() for p, st in zip(params, states)]
        # fused: matrices of one shape rotate (and split their factors) in batched GEMMs, with
        # the split's elementwise work in two ops
        stacks = self._stacks(params, states) if self.backend == "fused" else []
        alone = sorted(set(range(len(params))) - {i for idx, _, _ in stacks for i in idx})
        rotated: list = [None] * len(params)
        for i in alone:
            rotated[i] = self._project(grads[i], states[i], params[i], group)
        for idx, QL, QR in stacks:
            for i, x in zip(idx, (QL.mT @ _stack([grads[i] for i in idx]) @ QR).unbind(0)):
                rotated[i] = x
        if not torch.compiler.is_compiling():
            for st in states:
                st["step"] += 1
        # The same count on the device: bias corrections read it there, so a compiled step
        # holds no symbolic step count in its graph (the host count only decides refreshes).
        torch._foreach_add_([st["device_step"] for st in states], 1.0)
        exp_avgs = [st["exp_avg"] for st in states]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, torch._foreach_mul(grads, 1 - beta1))
        moments: list = [None] * len(params)
        for i in alone:
            moments[i] = self._project(exp_avgs[i], states[i], params[i], group)
        stacked_moments = []
        compiling = torch.compiler.is_compiling()
        for idx, QL, QR in stacks:
            # The rotated moment Q_L^T exp_avg Q_R is kept between refreshes: rotating is linear,
            # so it follows the same average as exp_avg, from the rotated gradient, without the
            # two GEMMs of a projection (equal up to rounding). "exp_avg_rot_step" is the step it
            # belongs to (-1: none); a host int, so a checkpoint resumes on the same path.
            # Compiled steps advance no host count: they always project.
            cached = not compiling and all(states[i].get("exp_avg_rot_step", -1) == states[i]["step"] - 1
                                           for i in idx)
            if cached:
                caches = [states[i]["exp_avg_rot"] for i in idx]
                torch._foreach_mul_(caches, beta1)
                torch._foreach_add_(caches, torch._foreach_mul([rotated[i] for i in idx], 1 - beta1))
                stacked = torch.stack(caches)  # a copy: preconditioned in place below
            else:
                stacked = QL.mT @ _stack([exp_avgs[i] for i in idx]) @ QR
            stacked_moments.append(stacked)
            for i, x in zip(idx, stacked.unbind(0)):
                moments[i] = x
                st = states[i]
                if compiling or _refresh_due(st):
                    st["exp_avg_rot_step"] = -1  # no host count, or the bases change after this step
                    continue
                if not cached:
                    if "exp_avg_rot" in st:
                        st["exp_avg_rot"].copy_(x)
                    else:  # a checkpoint of the reference backend
                        st["exp_avg_rot"] = x.clone()
                st["exp_avg_rot_step"] = st["step"]
        rank_one = [i for i, st in enumerate(states) if "l" in st]
        full = [i for i, st in enumerate(states) if "l" not in st]
        if rank_one:
            ls, rs = [states[i]["l"] for i in rank_one], [states[i]["r"] for i in rank_one]
            impl.dykaf_rank_one_(ls, rs, [rotated[i] for i in rank_one], beta2, self.rank_one_eps)
            impl.dykaf_precondition_([moments[i] for i in rank_one], ls, rs, self.rank_one_eps)
        if full:
            impl.dykaf_adam_precondition_([moments[i] for i in full],
                                          [states[i]["exp_avg_sq"] for i in full],
                                          [rotated[i] for i in full], beta2, group["eps"])
        updates: list = [None] * len(params)
        for i in alone:
            updates[i] = self._project(moments[i], states[i], params[i], group, back=True)
        for (idx, QL, QR), stacked in zip(stacks, stacked_moments):
            for i, x in zip(idx, (QL @ stacked @ QR.mT).unbind(0)):
                updates[i] = x
        # Parameters share one step size and one apply call when their step counts agree (the
        # usual case); no dict keyed by the count, which would make a compiled step specialise
        # on its value and recompile every step.
        counts = [st["step"] for st in states]
        if all(t == counts[0] for t in counts):
            calls = [(counts[0], list(range(len(states))))]
        else:
            calls = [(t, [i]) for i, t in enumerate(counts)]
        for t, idx in calls:
            step_size = lr
            if group["correct_bias"]:
                t = states[idx[0]]["device_step"]
                step_size = lr * (1 - beta2 ** t).sqrt() / (1 - beta1 ** t)
            impl.dykaf_apply_([params[i] for i in idx], [updates[i] for i in idx], step_size, lr,
                              float(group["weight_decay"]), bool(group["normalize_grads"]))
        for idx, _, _ in stacks:
            beta = states[idx[0]]["shampoo_beta"]
            U, V = math.proj_split_batched(
                _stack([states[i]["factors"][0] for i in idx]),
                _stack([states[i]["factors"][1] for i in idx]),
                _stack([grads[i] for i in idx]), beta, self._impl)
            for i, u, v in zip(idx, U.unbind(0), V.unbind(0)):
                states[i]["factors"] = [u, v]
        done = {i for idx, _, _ in stacks for i in idx}
        for i, (p, g, st) in enumerate(zip(params, grads, states)):
            self._update_factors(p, g, st, group, split=i not in done)

    def _project(self, x, state, p, group, back: bool = False) -> torch.Tensor:
        bases = state["bases"]
        if all(Q is None for Q in bases):
            return x if back else x.clone()  # rotated tensors are written in place later
        merged = self._merged_shape(p, group)
        if merged is not None:
            x = self._to_merged(x, merged)
        x = math.project_back(x, bases) if back else math.project(x, bases)
        if merged is not None:
            x = self._from_merged(x, p)
        return x.contiguous()

    _batch_on_cpu = False  # tests set it to run the GPU's batched path on a CPU

    def _stacks(self, params, states) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """Matrices rotated on both sides, grouped by (shape, dtype, device, shampoo_beta):
        (indices, stacked Q_L, stacked Q_R). On a GPU one batched GEMM per group saves launches;
        on a CPU every matrix is a group of its own, a view without a copy: there stacking
        copied every basis, factor and gradient each step and bmm ran no faster than mm
        (measured on the bench's GPT: 9 ms of copies and 6 ms more GEMM time in a 122 ms step)."""
        groups: dict[tuple, list[int]] = {}
        for i, (p, st) in enumerate(zip(params, states)):
            if st["kind"] == "kron2d" and all(Q is not None for Q in st["bases"]):
                key = (tuple(p.shape), st["exp_avg"].dtype, p.device, st["shampoo_beta"])
                batched = p.device.type != "cpu" or self._batch_on_cpu
                groups.setdefault(key if batched else (i,), []).append(i)
        return [(idx, _stack([states[i]["bases"][0] for i in idx]),
                 _stack([states[i]["bases"][1] for i in idx]))
                for idx in groups.values()]

    def _update_factors(self, p, g, state, group, split: bool = True) -> None:
        beta, factors, kind = state["shampoo_beta"], state["factors"], state["kind"]
        if kind == "kron2d" and not split:
            pass  # split already, batched with the other matrices of its shape
        elif kind == "kron2d":
            L, R = factors
            if L is not None and R is not None:
                state["factors"] = list(math.proj_split(L, R, g, beta))
            else:
                state["factors"] = [None if L is None else math.one_sided(L, g, True),
                                    None if R is None else math.one_sided(R, g, False)]
        elif kind == "kron4d":
            state["factors"] = math.tensor_proj_split(factors, g, beta, self.published_bugs)
        else:
            merged = self._merged_shape(p, group)
            self._ema(factors, self._to_merged(g, merged) if merged is not None else g, beta)
        if torch.compiler.is_compiling():
            # A compiled step cannot branch on a host count without recompiling for each value:
            # the refresh is a torch.cond on the device count.
            due = torch.fmod(state["device_step"], state["precondition_frequency"]) == 0
            self._refresh(p, state, group, due)
        elif _refresh_due(state):
            self._refresh(p, state, group)

    def _refresh(self, p, state, group, due: torch.Tensor | None = None) -> None:
        """The eigenbasis refresh (one power step and QR, float32), with the second moment's
        entries permuted along with the basis columns; with `due` (a device bool) the old basis
        and order are kept where it is false."""
        bases = list(state["bases"])
        merged = self._merged_shape(p, group)
        v = state.get("exp_avg_sq")
        if v is not None and merged is not None:
            v = self._to_merged(v, merged)
        for k, (factor, basis) in enumerate(zip(state["factors"], bases)):
            if factor is None:
                continue
            if due is None:
                bases[k], order = math.refresh_basis(factor, basis)
            else:  # the QR runs only on due steps, the branch taken on the device
                bases[k], order = torch.cond(due, math.refresh_basis, _keep_basis, (factor, basis))
            if "l" in state:
                key = "l" if k == 0 else "r"
                state[key] = state[key].index_select(0, order.to(state[key].device))
            else:
                v = v.index_select(k, order)
        if v is not None:
            state["exp_avg_sq"] = self._from_merged(v, p).contiguous() if merged is not None else v
        state["bases"] = bases

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout; `step` is read from `device_step` (compiled steps advance only
        the device count), one host read per parameter at checkpoint time."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # not the live dicts
        for st in sd["state"].values():
            if "device_step" in st:
                st["step"] = int(st["device_step"].item())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint; every tensor is copied onto its parameter's device in its saved dtype
        (factors stay float32 for bf16 parameters), and `state_dict` is left unchanged."""
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"not a DyKAF checkpoint: missing '{key}'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(saved_groups)} param groups, this optimizer "
                             f"has {len(self.param_groups)}")
        index_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"checkpoint group has {len(saved['params'])} parameters, this "
                                 f"optimizer's has {len(group['params'])}")
            index_to_param.update(zip(saved["params"], group["params"]))
        new_state = {}
        for index, saved in state_dict["state"].items():
            if index not in index_to_param:
                raise ValueError(f"checkpoint has state for parameter {index}, which this "
                                 "optimizer does not have")
            p = index_to_param[index]
            if tuple(saved["exp_avg"].shape) != tuple(p.shape):
                raise ValueError(f"checkpoint exp_avg of parameter {index} has shape "
                                 f"{tuple(saved['exp_avg'].shape)}, expected {tuple(p.shape)}")
            new_state[p] = {k: _copy_to(v, p.device) for k, v in saved.items()}
        self.state.clear()
        self.state.update(new_state)
        for saved, group in zip(saved_groups, self.param_groups):
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            for key, value in saved.items():
                if key == "params":
                    continue
                if key == "lr":
                    value = _scalar(value, device)
                elif key == "betas":
                    value = tuple(_scalar(b, device) for b in value)
                group[key] = value


def _refresh_due(state) -> bool:
    """Whether an eager step refreshes the eigenbases at its end (host step count)."""
    return state["step"] % state["precondition_frequency"] == 0


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, or for one tensor a view (a copy only if it is not row-major: the refresh
    leaves LAPACK's column-major bases, a checkpoint restores row-major ones, and a GEMM must see
    one layout to round the same after a resume)."""
    return xs[0].contiguous().unsqueeze(0) if len(xs) == 1 else torch.stack(xs)


def _keep_basis(factor: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The not-due branch of a compiled refresh: the basis as it is, the identity order."""
    return basis.clone(), torch.arange(basis.shape[1], device=basis.device)


# ----------------------------------------------------------------------------------- generic
# Helpers any member needs (checkpoint copies, 0-dim hyperparameters): kept apart so that the
# family's core (cafin/curvature.py) can replace them.
def _copy_to(value, device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, copy=True)
    if isinstance(value, list):
        return [_copy_to(v, device) for v in value]
    return value


def _scalar(value, device: torch.device) -> torch.Tensor:
    """A hyperparameter as a 0-dim float64 tensor on `device` (a fresh copy)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"a tensor hyperparameter must have one element, got shape "
                             f"{tuple(value.shape)}")
        return value.detach().reshape(()).to(device=device, dtype=torch.float64, copy=True)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def _check_group(group: dict[str, Any]) -> None:
    lr = float(group["lr"])
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
    if not group["shampoo_beta"] <= 1.0:
        raise ValueError(f"shampoo_beta must be <= 1 (< 0 means betas[1]), got {group['shampoo_beta']}")
    if not group["eps"] >= 0.0:
        raise ValueError(f"eps must be >= 0, got {group['eps']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    f = group["precondition_frequency"]
    if not (isinstance(f, int) and not isinstance(f, bool) and f >= 1):
        raise ValueError(f"precondition_frequency must be an int >= 1, got {f!r}")
    d = group["max_precond_dim"]
    if not (isinstance(d, int) and not isinstance(d, bool) and d >= 1):
        raise ValueError(f"max_precond_dim must be an int >= 1, got {d!r}")
    if group["init"] not in _INITS:
        raise ValueError(f"init must be one of {_INITS}, got {group['init']!r}")
    for p in group["params"]:
        if p.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise TypeError(f"parameter of shape {tuple(p.shape)} has dtype {p.dtype}; DyKAF "
                            "supports float32, float64, bfloat16 and float16")
