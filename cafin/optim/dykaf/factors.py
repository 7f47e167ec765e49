"""DyKAF's Kronecker factors after the first step: each step's factor update (the projector
split of a matrix, alone or stacked with the matrices of its shape; the 4-mode split of a conv
kernel; SOAP's EMA of per-mode products), and the eigenbasis refresh every
`precondition_frequency` updates, decided on the host (eager and compiled steps: a compiled
step that is not due holds no refresh) and on the device once a step has been captured, the
second moment's entries permuted along with the basis columns."""
from __future__ import annotations

import torch

from ...core import route
from ...core.route import Route
from ...maths import dykaf as dykaf_maths


class Factors:
    """The factor and refresh methods of `DyKAF` (a mixin: it reads the optimizer's settings
    and state)."""

    def _update_all_factors(self, group, params, states, grads, stacks, gated) -> None:
        """Update the Kronecker factors from the gradients, in place: stacks in one batched
        split; on a CPU, each matrix by `proj_split_matrix_`, its scalars on the host when the
        step may read tensors (eager) and 0-dim tensors when it may not (compiled); a
        device-decided step keeps the batched form, as a captured step must (the GPU's form)."""
        for idx, _, _ in stacks:
            beta = states[idx[0]]["shampoo_beta"]
            if not gated and not self._batched(params[idx[0]].device):
                (i,) = idx
                _write_(states[i]["factors"], dykaf_maths.proj_split_matrix_(
                    *states[i]["factors"], grads[i], beta, host=route.eager()))
                continue
            U, V = dykaf_maths.proj_split_batched(
                _stack([states[i]["factors"][0] for i in idx]),
                _stack([states[i]["factors"][1] for i in idx]),
                _stack([grads[i] for i in idx]), beta,
                self._route.ops(params[idx[0]].device, grads[idx[0]].dtype))
            for i, u, v in zip(idx, U.unbind(0), V.unbind(0)):
                _write_(states[i]["factors"], (u, v))
        done = {i for idx, _, _ in stacks for i in idx}
        done |= self._split_kernels(states, grads)
        for i, (p, g, st) in enumerate(zip(params, grads, states)):
            self._update_factors(p, g, st, group, gated, split=i not in done)

    def _split_kernels(self, states, grads) -> set[int]:
        """The 4-mode splits of the conv kernels, those of one (shampoo_beta, dtype, device) in
        lockstep (`tensor_proj_splits`: each kernel's GEMMs, the elementwise work of each stage
        one foreach op over the kernels) and written by one foreach copy; returns their indices.
        The published step keeps its own per kernel."""
        if self.published_bugs:
            return set()
        groups: dict[tuple, list[int]] = {}
        for i, st in enumerate(states):
            if st["kind"] == "kron4d":
                key = (st["shampoo_beta"], grads[i].dtype, grads[i].device)
                groups.setdefault(key, []).append(i)
        for (beta, _, _), idx in groups.items():
            news = dykaf_maths.tensor_proj_splits([states[i]["factors"] for i in idx],
                                                  [grads[i] for i in idx], beta)
            _write_([f for i in idx for f in states[i]["factors"]], [f for x in news for f in x])
        return {i for idx in groups.values() for i in idx}

    _batch_on_cpu = False  # tests set it to run the GPU's batched path on a CPU

    def _batched(self, device: torch.device) -> bool:
        """Whether the matrices of one shape on `device` share batched GEMMs (see _stacks)."""
        return Route.batched_products(device) or self._batch_on_cpu

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
        # (a group of one keeps its 2-D bases, as its matrices are gathered: `_gather`)
        return [(idx, _gather([states[i]["bases"][0] for i in idx]),
                 _gather([states[i]["bases"][1] for i in idx]))
                for idx in groups.values()]

    def _update_factors(self, p, g, state, group, gated: bool, split: bool = True) -> None:
        """Update one parameter's factors in place, then refresh its eigenbases when due."""
        beta, factors, kind = state["shampoo_beta"], state["factors"], state["kind"]
        if not split:
            pass  # split already, with the other matrices of its shape or kernels of its kind
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
            _ema(factors, self._to_merged(g, merged) if merged is not None else g, beta)
        if gated:
            # A device-decided step reads no host count (a captured one would replay the value
            # of its capture): the refresh is decided from the device count. Left out where the
            # host knows it is not due (StepGraphs); the host count stopped at the counter's, so
            # the offset is fixed.
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
        owner rank makes it and shares it (cafin.optim.dykaf.owners); a compiled one is made on
        every rank (no collective in the graph)."""
        if due is None and self._owners is not None and route.eager():
            self._owners.defer(p, state, group)
            return
        new: list = []
        for factor, basis in zip(state["factors"], state["bases"]):
            if factor is None:
                new.append(None)
            elif due is None:
                new.append(dykaf_maths.refresh_basis(factor, basis))
            elif route.compiled():  # the branch taken on the device
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


def _ema(factors, g, beta) -> None:
    """SOAP's EMA of per-mode products, in place: factors[k] <- beta factors[k] + (1 - beta)
    (the mode-k product of g), for each mode with a factor."""
    kept = [k for k, f in enumerate(factors) if f is not None]
    if not kept:  # e.g. a 1-D tensor without precondition_1d: no product to form
        return
    for k, product in enumerate(dykaf_maths.mode_products(g, kept)):
        if product is not None:
            factors[k].lerp_(product, 1 - beta)


def _refresh_due(state) -> bool:
    """Whether an eager step refreshes the eigenbases at its end (host step count)."""
    return state["step"] % state["precondition_frequency"] == 0


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, or for one tensor a view (a copy only if it is not row-major: the refresh
    leaves LAPACK's column-major bases, a checkpoint restores row-major ones, and a GEMM must see
    one layout to round the same after a resume)."""
    return xs[0].contiguous().unsqueeze(0) if len(xs) == 1 else torch.stack(xs)


def _gather(xs: list[torch.Tensor]) -> torch.Tensor:
    """The matrices of a group as the GEMMs take them (`update._sandwich`): a stack, or for a
    group of one (every group on a CPU) the matrix itself, row-major (as `_stack` makes it; no
    stack dimension to add and take off again: three views fewer per product)."""
    return xs[0].contiguous() if len(xs) == 1 else torch.stack(xs)


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
