"""DyKAF's update of the parameters of one device, after their first step: the gradients
rotated into the eigenbases, the moments (the kept rotated moment of stacked matrices, chosen on
the host in eager and compiled steps and on the device once a step has been captured), the
preconditioning (rank-one or full second moment), the rotation back, and the apply (step size,
bias correction, weight decay)."""
from __future__ import annotations

from types import ModuleType

import torch

from ...core import route
from ...maths import dykaf as dykaf_maths
from .factors import _gather, _refresh_due

# exp_avg_rot_step of a device-decided step: the cache belongs to the device count's step, or to
# none (-1) when that step refreshed the bases; state_dict() writes the number.
_FOLLOWS_DEVICE_STEP = "device"


class Update:
    """The update methods of `DyKAF` (a mixin: it reads the optimizer's settings and state)."""

    def _gated(self) -> bool:
        """Whether this step decides on the device (captured in a CUDA graph, any step after
        one, or compiled by a counter told to decide on the device): then no decision reads a
        host count or a value that changes between steps. A compiled step decides from the host
        counts (a graph per phase) but may not read a tensor on the host (`route.eager()`)."""
        return self._steps.host_due(1) is None

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
        stacks = self._stacks(params, states) if self._route.fused else []
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
        self._apply_updates(group, params, states, updates, lr, beta1, beta2)
        self._update_all_factors(group, params, states, grads, stacks, gated)

    def _rotate_gradients(self, group, params, states, grads, stacks, alone) -> list:
        """The gradients in the eigenbases (stacked matrices of one shape in one batched GEMM)."""
        rotated: list = [None] * len(params)
        for i in alone:  # read only (the moments are preconditioned in place, these are not)
            rotated[i] = self._project(grads[i], states[i], params[i], group, copy=False)
        for idx, QL, QR in stacks:
            stacked = _sandwich(QL.mT, _gather([grads[i] for i in idx]), QR)
            for i, x in zip(idx, _parts(stacked)):
                rotated[i] = x
        return rotated

    def _update_moments(self, group, params, states, grads, rotated, stacks, alone, beta1,
                        gated):
        """exp_avg's average of the gradients, and its rotation into the eigenbases: (the rotated
        moments, one per parameter; the stacked ones, one per stack)."""
        exp_avgs = [st["exp_avg"] for st in states]
        keep, take = _scalars_like(exp_avgs, beta1)
        # 1 - beta1 read on the host once a step (a CPU's eager step), for every average below
        alpha = take.item() if (not gated and exp_avgs[0].device.type == "cpu"
                                and not route.compiled()) else None
        _average_(exp_avgs, grads, keep, take, alpha)
        moments: list = [None] * len(params)
        # Parameters without a basis take a copy of exp_avg (preconditioned in place), all in
        # one foreach op (x * 1 is x, bit for bit).
        plain = [i for i in alone if all(Q is None for Q in states[i]["bases"])]
        if plain:
            for i, x in zip(plain, torch._foreach_mul([exp_avgs[i] for i in plain], 1.0)):
                moments[i] = x
        for i in alone:
            if moments[i] is None:
                moments[i] = self._project(exp_avgs[i], states[i], params[i], group)
        stacked_moments = []
        compiling = route.compiled()
        decided = []  # (known, cached) of each stack
        for idx, _, _ in stacks:
            # The rotated moment Q_L^T exp_avg Q_R is kept between refreshes: rotating is linear,
            # so it follows the same average as exp_avg, from the rotated gradient, without the
            # two GEMMs of a projection (equal up to rounding). "exp_avg_rot_step" is the step it
            # belongs to (-1: none); a host int, so a checkpoint resumes on the same path. Every
            # host-decided step writes it (this step's count, or -1 on a refresh step) and a
            # load keeps it only if it is the last step's, so "not -1" means "the last step's":
            # a compiled step then guards on each count alone, not on a relation between two
            # symbolic counts (which inductor's generated code has failed to bind).
            # Device-decided steps advance no host count: they choose on the device (below).
            known = self._pinned_cache([states[i] for i in idx]) if gated and not compiling else None
            # (a list, not a generator: a compiled step reads every count on its first call and
            # makes each symbolic once it has changed, none left a constant for one more graph)
            cached = known is True or not gated and all([
                states[i].get("exp_avg_rot_step", -1) != -1 for i in idx])
            decided.append((known, cached))
        # the kept moments of every stack averaged together (one foreach op each)
        averaged = [i for (idx, _, _), (_, cached) in zip(stacks, decided) if cached for i in idx]
        if averaged:
            _average_([states[i]["exp_avg_rot"] for i in averaged], [rotated[i] for i in averaged],
                      keep, take, alpha)
        for (idx, QL, QR), (known, cached) in zip(stacks, decided):
            if cached:
                caches = [states[i]["exp_avg_rot"] for i in idx]
                # a copy: preconditioned in place below
                stacked = (caches[0].clone(memory_format=torch.contiguous_format)
                           if len(caches) == 1 else torch.stack(caches))
            else:
                stacked = _sandwich(QL.mT, _gather([exp_avgs[i] for i in idx]), QR)
                if known is None and gated and not compiling and all("exp_avg_rot" in states[i] for i in idx):
                    # The moment an eager step takes, chosen on the device: the kept one averaged
                    # where the last step refreshed no basis, else the projection. The two differ
                    # by rounding, which a refresh can amplify in float32; taking the same one
                    # keeps a captured step equal to the eager step.
                    average = (_gather([states[i]["exp_avg_rot"] for i in idx]) * keep
                               + _gather([rotated[i] for i in idx]) * take)
                    valid = torch.stack([_cache_follows(states[i]) for i in idx])
                    stacked = torch.where(valid.view((-1,) + (1,) * (stacked.dim() - 1)),
                                          average, stacked)
            stacked_moments.append(stacked)
            for i, x in zip(idx, _parts(stacked)):
                moments[i] = x
                st = states[i]
                if compiling and gated:
                    # a device-decided compiled step keeps no cache (inductor wrote the torch.where
                    # below wrong, aot_eager right), so the next step projects
                    st["exp_avg_rot_step"] = -1
                    continue
                if gated:
                    # Written as an eager step writes it, decided on the device, so that the
                    # checkpoint of a device-decided run equals the eager run's (its step filled
                    # in by state_dict() from the device count): an eager step averages a valid
                    # cache (the last step's, which was no refresh step) and copies the moment
                    # into it on a step that is no refresh step. Where the host knows the cache
                    # was averaged (StepGraphs' pinned phase), it already holds the moment.
                    if known is True:
                        st["exp_avg_rot_step"] = _FOLLOWS_DEVICE_STEP
                    elif "exp_avg_rot" in st:
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

    def _ops(self, states) -> ModuleType:
        """The op module of one device's parameters, picked by their state dtype (float32 or
        float64; the parameters themselves may hold a lower precision)."""
        moment = states[0]["exp_avg"]
        return self._route.ops(moment.device, moment.dtype)

    def _precondition(self, group, states, rotated, moments, beta2) -> None:
        """Precondition the rotated moments in place: by the rank-one second moment (l, r) where
        kept, else Adam's elementwise one."""
        impl = self._ops(states)
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
            for i, x in zip(idx, _parts(_sandwich(QL, stacked, QR.mT))):
                updates[i] = x
        return updates

    def _apply_updates(self, group, params, states, updates, lr, beta1, beta2) -> None:
        """Apply the updates to the parameters (step size, bias correction, weight decay) in one
        call. Each parameter's bias correction reads its own device count, and the step sizes
        are one vector: the same few ops in eager, compiled and device-decided steps, whatever
        the number of parameters (one step size per call made a compiled or captured step
        compute it, and call the op, once per parameter)."""
        impl = self._ops(states)
        step_size = lr
        if group["correct_bias"]:
            t = torch.stack([st["device_step"] for st in states])
            step_size = lr * (1 - beta2 ** t).sqrt() / (1 - beta1 ** t)
        # The kernel writes parameters as flat arrays: a channels_last one is updated in a
        # contiguous copy, copied back.
        flat = [p if p.is_contiguous() else p.contiguous() for p in params]
        weight_decay = self._as_tensor(group["weight_decay"], flat[0].device, torch.float64)
        impl.dykaf_apply_(flat, updates, step_size, lr, weight_decay, bool(group["normalize_grads"]))
        for p, q in zip(params, flat):
            if q is not p:
                p.copy_(q)

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


def _cache_follows(state) -> torch.Tensor:
    """Whether the kept rotated moment belongs to the last step (a device bool, from the device
    count t after its increment): the host-decided rule (`exp_avg_rot_step` is the last step's),
    since every step writes it except one that refreshes the bases."""
    t, every = state["device_step"], state["precondition_frequency"]
    return (t > 1) & (torch.fmod(t - 1, every) != 0)


def _sandwich(A: torch.Tensor, X: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """A X B over stacks of matrices (batched GEMMs), or of one matrix (a group of one, `_gather`:
    GEMMs; bmm of one matrix ran slower than mm on the GPT's 128-wide products)."""
    if X.dim() == 2:
        return torch.mm(torch.mm(A, X), B)
    return torch.bmm(torch.bmm(A, X), B)


def _parts(stacked: torch.Tensor) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """The matrices of a result of `_sandwich`: its stack unbound, or the one matrix."""
    return [stacked] if stacked.dim() == 2 else stacked.unbind(0)


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
              take: torch.Tensor, alpha: float | None = None) -> None:
    """xs <- keep xs + take ys. With `alpha`, take as read on the host (a CPU's eager step, where
    a read costs no sync), added as alpha: one pass, no temporary; else the foreach product."""
    torch._foreach_mul_(xs, keep)
    if alpha is not None:
        torch._foreach_add_(xs, ys, alpha=alpha)
    else:
        torch._foreach_add_(xs, torch._foreach_mul(ys, take))
