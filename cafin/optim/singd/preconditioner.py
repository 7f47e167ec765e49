"""SINGD's preconditioner update, every T steps: per layer the new Riemannian momenta
    m_K <- s*(c_g tr(H_C)/d_C H_K + lambda tr(C^T C)/d_C Pi(K^T K) - I) + alpha1 m_K
(and m_C with the roles swapped), then K <- K - beta1 K m_K, C <- C - beta1 C m_C. The products
run in torch, per layer; the momentum/trace combination (with the projection's folds) and the
truncated-exponential step run as two elementwise ops over every part of every factor of a
(device, dtype) bucket: `singd_momentum_` and `singd_factor_step_` of the op module the route
gives the device (cafin.ops, or cafin.reference, the same ops in plain PyTorch). A due update
whose accumulated H_K or H_C holds a NaN or inf is dropped (the layer keeps its factors, the
accumulators are reset) and counted on the device.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...core import Layer, route
from .settings import lr_cov_value, work_dtype


class _PendingUpdate(NamedTuple):
    """One layer's preconditioner update between the momentum op and the factor step op."""
    layer: Layer
    group: dict
    state: dict
    sk: type  # K's structure
    sc: type  # C's structure
    wk: torch.dtype  # K's work dtype
    wc: torch.dtype  # C's work dtype
    K: tuple
    C: tuple
    m_K: tuple
    m_C: tuple
    commit: Tensor  # the update is written (due, and its accumulators are finite)
    device: torch.device
    H_K: tuple
    H_C: tuple
    due: Tensor  # its accumulators are reset
    due_host: bool | None


class Preconditioner:
    """The update of the factors K, C and their momenta (a mixin of `SINGD`)."""

    def _lr_cov(self, group, device, dtype) -> Tensor:
        """This step's beta1 of the group, a 0-dim tensor."""
        lr_cov = group["lr_cov"]
        if callable(lr_cov):
            lr_cov = self._lr_cov_now.get(id(group))
            if lr_cov is None:  # device gated: the callable takes the step tensor, unchecked
                lr_cov = group["lr_cov"](self._steps.tensor(device))
        # The group's own 0-dim tensor where it is one already (no copy per layer and step);
        # a number times the cached one, which a compiled step keeps symbolic.
        return self._as_tensor(lr_cov, device, dtype)

    def _evaluate_lr_cov(self) -> dict[int, Any]:
        """Each callable lr_cov of a group with a preconditioner update due at this step, called
        once with the step count and, eagerly, checked before the step writes anything (while the
        host counts the steps; once the device decides, the callable takes the step tensor). A
        compiled step calls it with the host's count too, a symbol there, and reads nothing of
        the result (a host check of a symbolic number or a tensor breaks the graph)."""
        values = {}
        for index, group in enumerate(self.param_groups):
            if callable(group["lr_cov"]) and self._steps.host_due(group["T"]):
                value = group["lr_cov"](self._steps.host)
                if route.eager():
                    lr_cov_value(value, f"param group {index}: the value of the callable ")
                values[id(group)] = value
        return values

    def _due_and_commit(self, layer: Layer, due_host: bool | None,
                        accumulators: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """(due, commit), 0-dim bool tensors. due: this layer's preconditioner update is due, so its
        accumulators are reset: it saw statistics (singd raises KeyError when a layer took none;
        this leaves its factors as they are) and, once the device decides, this is a step k with
        k % T == 0. commit: the update is written, as it is due and its accumulated H_K and H_C (the
        parts in `accumulators`) are finite (a NaN or inf would turn K and C non-finite for good)."""
        count = self.state[layer.anchor]["H_count"]
        due = count > 0
        if due_host is None:
            due = due & (torch.remainder(self._steps.tensor(count.device), self._group(layer)["T"]) == 0)
        # One reduction per part: a NaN or inf anywhere makes the sum non-finite (so does a sum
        # that overflows the op-math dtype, from entries near its limit). total - total is 0
        # exactly when total is finite (two ops; torch.isfinite takes more in eager).
        total = None
        for h in accumulators:
            s = h.sum() if h.dtype in (torch.float32, torch.float64) else h.sum(dtype=torch.float32)
            total = s if total is None else total + s
        return due, due & ((total - total) == 0)

    def _count_dropped(self, layer: Layer, due: Tensor, commit: Tensor) -> None:
        """Count the update as dropped where it was due and not written."""
        self._skipped.counter(layer.anchor.device).add_(due ^ commit)  # commit implies due

    def _update_preconditioners(self, items: list[tuple[Layer, bool | None]], c_g) -> None:
        """Every due layer's preconditioner update (`items`: each layer with whether the host says
        it is due, None once the device decides); while the CPU counts the dropped ones without a
        sync (eager), a NonFiniteStatisticsWarning says how many."""
        if not items:
            return
        momentum: dict[tuple, tuple[list, ...]] = {}
        scalars: dict[tuple, tuple[Tensor, ...]] = {}  # a group's, made once per device and dtypes
        pending = [self._queue_momentum(layer, due_host, c_g, momentum, scalars) for layer, due_host in items]
        for (device, _), lists in momentum.items():
            self._ops(device).singd_momentum_(*lists)
        for (device, _), lists in self._factor_steps(pending).items():
            self._ops(device).singd_factor_step_(*lists)
        self._finish_updates(pending)
        # attributed to step()'s caller (past _step, step, torch's wrappers)
        self._skipped.report(lambda n: f"{type(self).__name__}: {n} preconditioner update(s) dropped: "
                             "the accumulated curvature (H_K, H_C) held NaN or inf; those layers keep "
                             "their factors K, C and their accumulators are reset", stacklevel=6)

    def _queue_momentum(self, layer: Layer, due_host: bool | None, c_g, momentum: dict,
                        scalars: dict) -> _PendingUpdate:
        """Add a layer's factors to the momentum op's (device, dtype) buckets; returns what the
        factor step needs of the layer."""
        group = self._group(layer)
        state = self.state[layer.anchor]
        (sk, sc), (dk, dc) = self._kinds(layer), self._dtypes(layer)
        d_k, d_c = self.dims(layer.module)
        device = layer.anchor.device
        K, C = self._parts(layer, "K"), self._parts(layer, "C")
        H_K, H_C = self._parts(layer, "H_K"), self._parts(layer, "H_C")
        alpha1 = group["alpha1"]
        if alpha1 != 0.0:
            m_K, m_C = self._parts(layer, "m_K"), self._parts(layer, "m_C")
        else:  # m is not kept: the op writes the new one into scratch
            m_K = tuple(torch.empty_like(h) for h in H_K)
            m_C = tuple(torch.empty_like(h) for h in H_C)
        (K_tK, pi_k), (C_tC, pi_c) = sk.inner_parts(K), sc.inner_parts(C)
        wk, wc = work_dtype(dk), work_dtype(dc)
        key = (id(group), device, wk, wc)
        if key not in scalars:
            scale = 0.5 * ((1.0 - alpha1) if group["normalize_lr_cov"] else 1.0)
            scalars[key] = (self._as_tensor(scale, device, wk), self._as_tensor(scale, device, wc),
                            self._as_tensor(alpha1, device, wk), self._as_tensor(alpha1, device, wc))
        scale_k, scale_c, alpha1_k, alpha1_c = scalars[key]
        damping_k = self._hyperparameter(group, "damping", device, wk)
        damping_c = self._hyperparameter(group, "damping", device, wc)
        if group["kfac_like"]:
            ck, dmp_k = self._one(device, wk), damping_k
            cc, dmp_c = self._one(device, wc) * c_g, damping_c
        else:  # (the diagonal-carrying parts of Pi(K^T K) are unfolded: pi = 1 there)
            ck = (c_g * sc.average_trace(H_C)).to(wk)
            dmp_k = damping_k * sc.average_trace(C_tC)
            cc = (c_g * sk.average_trace(H_K)).to(wc)
            dmp_c = damping_c * sk.average_trace(K_tK)
        due, commit = self._due_and_commit(layer, due_host, H_K + H_C)
        for kind, d, dtype, m, h, ktk, pi, c_h, c_d, s, a1 in (
                (sk, d_k, dk, m_K, H_K, K_tK, pi_k, ck, dmp_k.to(wk), scale_k, alpha1_k),
                (sc, d_c, dc, m_C, H_C, C_tC, pi_c, cc, dmp_c.to(wc), scale_c, alpha1_c)):
            lists = momentum.setdefault((device, dtype), ([], [], [], [], [], [], [], [], [], []))
            n = len(m)
            for lst, values in zip(lists, (m, h, ktk, [c_h] * n, [c_d] * n, [commit] * n,
                                           kind.eye_kinds(d), [int(p) for p in pi], [s] * n,
                                           [a1] * n)):
                lst.extend(values)
        return _PendingUpdate(layer, group, state, sk, sc, wk, wc, K, C, m_K, m_C, commit,
                              device, H_K, H_C, due, due_host)

    def _factor_steps(self, pending: list[_PendingUpdate]) -> dict[tuple, tuple[list, ...]]:
        """The factor step op's arguments per (device, dtype) bucket, after the momentum op."""
        steps: dict[tuple, tuple[list, ...]] = {}
        for u in pending:
            beta_k, beta_c = self._lr_cov(u.group, u.device, u.wk), self._lr_cov(u.group, u.device, u.wc)
            if u.group["normalize_lr_cov"]:
                beta_k = beta_k / torch.clamp(u.sk.inf_norm(u.m_K), min=1.0)
                beta_c = beta_c / torch.clamp(u.sc.inf_norm(u.m_C), min=1.0)
            for kind, parts, m, beta in ((u.sk, u.K, u.m_K, beta_k), (u.sc, u.C, u.m_C, beta_c)):
                km, elementwise = kind.product_parts(parts, m)
                lists = steps.setdefault((u.device, parts[0].dtype), ([], [], [], [], []))
                n = len(parts)
                for lst, values in zip(lists, (parts, km, [beta] * n, [u.commit] * n, elementwise)):
                    lst.extend(values)
        return steps

    def _finish_updates(self, pending: list[_PendingUpdate]) -> None:
        """The op reset the accumulators of the committed updates; those of the dropped ones are
        reset too (while the host gates, every layer here is due or has empty accumulators: all
        of them in one op). Then the drop counts and the cached products."""
        resets = []
        for u in pending:
            accumulators = u.H_K + u.H_C + (u.state["H_count"],)
            if u.due_host is None:
                for t in accumulators:
                    t.copy_(torch.where(u.due, torch.zeros_like(t), t))
            else:
                resets += list(accumulators)
            self._count_dropped(u.layer, u.due, u.commit)
            self._refresh_cache(u.layer, u.sk, u.sc, u.K, u.C)
        if resets:
            torch._foreach_zero_(resets)

    def _refresh_cache(self, layer: Layer, sk, sc, K, C) -> None:
        """With cache_preconditioner, P = K K^T (C C^T) from the factors just written."""
        state = self.state[layer.anchor]
        for key, parts in (("P_K", K), ("P_C", C)):  # the cached products follow the factors
            if key in state:  # (dense factors only)
                state[key].copy_(parts[0] @ parts[0].mT)

