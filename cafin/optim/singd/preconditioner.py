"""SINGD's preconditioner update, every T steps: per layer the new Riemannian momenta
    m_K <- s*(c_g tr(H_C)/d_C H_K + lambda tr(C^T C)/d_C Pi(K^T K) - I) + alpha1 m_K
(and m_C with the roles swapped), then K <- K - beta1 K m_K, C <- C - beta1 C m_C. The products
run in torch, per layer; the momentum/trace combination (with the projection's folds) and the
truncated-exponential step run as two elementwise ops over every part of every factor of a
(device, dtype) bucket: `singd_momentum_` and `singd_factor_step_` of the op module the route
gives the device (cafin.ops, or cafin.reference, the same ops in plain PyTorch). The scalars
they take (trace factors, the commit test, beta1) are vectors over a `_Bucket`'s layers. A due update
whose accumulated H_K or H_C holds a NaN or inf is dropped (the layer keeps its factors, the
accumulators are reset) and counted on the device.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...core import Layer, route
from .settings import lr_cov_value, work_dtype


class _Bucket(NamedTuple):
    """The due layers of one param group, device, pair of structures and pair of factor dtypes.
    Their scalars (the traces, the due/commit test, the drop count, normalize_lr_cov's norms) are
    vectors with one entry per layer, so the bookkeeping launches a few ops per bucket instead of a
    dozen per layer; the ops take each layer's entries as 0-dim views of those vectors."""
    layers: list[Layer]
    group: dict
    sk: type  # K's structure
    sc: type  # C's structure
    wk: torch.dtype  # K's work dtype
    wc: torch.dtype  # C's work dtype
    device: torch.device
    due_host: bool | None
    K: list[tuple]  # per layer, its parts
    C: list[tuple]
    m_K: list[tuple]
    m_C: list[tuple]
    due: Tensor  # [layers] bool: the accumulators are reset
    commit: Tensor  # [layers] bool: the update is written (due, and its accumulators are finite)
    commits: tuple[Tensor, ...]  # commit's entries


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

    def _due_and_commit(self, layers: list[Layer], due_host: bool | None, device: torch.device,
                        T: int, accumulators: list[tuple[Tensor, ...]]) -> tuple[Tensor, Tensor]:
        """(due, commit), bool vectors with one entry per layer of a bucket. due: the layer's
        preconditioner update is due, so its accumulators are reset: it saw statistics (singd
        raises KeyError when a layer took none; this leaves its factors as they are) and, once the
        device decides, this is a step k with k % T == 0. commit: the update is written, as it is
        due and its accumulated H_K and H_C (its parts in `accumulators`) are finite (a NaN or inf
        would turn K and C non-finite for good)."""
        due = torch.stack([self.state[layer.anchor]["H_count"] for layer in layers]) > 0
        if due_host is None:
            due = due & (torch.remainder(self._steps.tensor(device), T) == 0)
        # One reduction per part: a NaN or inf anywhere makes the layer's sum non-finite (so does
        # a sum that overflows the op-math dtype, from entries near its limit). total - total is 0
        # exactly when total is finite (two ops; torch.isfinite takes more in eager). The parts'
        # sums are added in each layer's order of parts, one vector per part.
        sums = [[h.sum() if h.dtype in (torch.float32, torch.float64) else h.sum(dtype=torch.float32)
                 for h in parts] for parts in accumulators]
        if len({s.dtype for row in sums for s in row}) == 1:
            columns = torch.stack([s for row in sums for s in row]).view(len(sums), -1).unbind(1)
        else:  # H_K and H_C of different dtypes: added with type promotion, as 0-dim sums are
            columns = [torch.stack(column) for column in zip(*sums)]
        total = columns[0]
        for column in columns[1:]:
            total = total + column
        return due, due & ((total - total) == 0)

    @staticmethod
    def _times(scalar: Tensor, values: Tensor) -> Tensor:
        """scalar * values in the dtype the 0-dim products would take (a 0-dim tensor times a
        vector takes the vector's dtype, a 0-dim one times a 0-dim one promotes)."""
        if values.dtype != scalar.dtype:
            values = values.to(torch.promote_types(scalar.dtype, values.dtype))
        return scalar * values

    def _update_preconditioners(self, items: list[tuple[Layer, bool | None]], c_g) -> None:
        """Every due layer's preconditioner update (`items`: each layer with whether the host says
        it is due, None once the device decides); while the CPU counts the dropped ones without a
        sync (eager), a NonFiniteStatisticsWarning says how many."""
        if not items:
            return
        by_key: dict[tuple, list[Layer]] = {}
        for layer, due_host in items:
            key = (self._group_of[layer.anchor], layer.anchor.device, *self._kinds(layer),
                   *self._dtypes(layer), due_host)
            by_key.setdefault(key, []).append(layer)
        momentum: dict[tuple, tuple[list, ...]] = {}
        scalars: dict[tuple, tuple[Tensor, ...]] = {}  # a group's, made once per device and dtypes
        buckets = [self._queue_momentum(layers, key[-1], c_g, momentum, scalars)
                   for key, layers in by_key.items()]
        for (device, _), lists in momentum.items():
            self._ops(device).singd_momentum_(*lists)
        for (device, _), lists in self._factor_steps(buckets).items():
            self._ops(device).singd_factor_step_(*lists)
        self._finish_updates(buckets)
        # attributed to step()'s caller (past _step, step, torch's wrappers)
        self._skipped.report(lambda n: f"{type(self).__name__}: {n} preconditioner update(s) dropped: "
                             "the accumulated curvature (H_K, H_C) held NaN or inf; those layers keep "
                             "their factors K, C and their accumulators are reset", stacklevel=6)

    def _queue_momentum(self, layers: list[Layer], due_host: bool | None, c_g, momentum: dict,
                        scalars: dict) -> _Bucket:
        """Add a bucket's factors to the momentum op's (device, dtype) lists; returns what the
        factor step needs of the bucket."""
        first = layers[0]
        group = self._group(first)
        (sk, sc), (dk, dc) = self._kinds(first), self._dtypes(first)
        device = first.anchor.device
        K, C = [self._parts(x, "K") for x in layers], [self._parts(x, "C") for x in layers]
        H_K, H_C = [self._parts(x, "H_K") for x in layers], [self._parts(x, "H_C") for x in layers]
        alpha1 = group["alpha1"]
        if alpha1 != 0.0:
            m_K, m_C = [self._parts(x, "m_K") for x in layers], [self._parts(x, "m_C") for x in layers]
        else:  # m is not kept: the op writes the new one into scratch
            m_K = [tuple(torch.empty_like(h) for h in hs) for hs in H_K]
            m_C = [tuple(torch.empty_like(h) for h in hs) for hs in H_C]
        (K_tK, pi_k), (C_tC, pi_c) = sk.inner_parts_of(K), sc.inner_parts_of(C)
        wk, wc = work_dtype(dk), work_dtype(dc)
        key = (id(group), device, wk, wc)
        if key not in scalars:
            scale = 0.5 * ((1.0 - alpha1) if group["normalize_lr_cov"] else 1.0)
            scalars[key] = (self._as_tensor(scale, device, wk), self._as_tensor(scale, device, wc),
                            self._as_tensor(alpha1, device, wk), self._as_tensor(alpha1, device, wc))
        scale_k, scale_c, alpha1_k, alpha1_c = scalars[key]
        damping_k = self._hyperparameter(group, "damping", device, wk)
        damping_c = self._hyperparameter(group, "damping", device, wc)
        n = len(layers)
        if group["kfac_like"]:
            ck, dmp_k = [self._one(device, wk)] * n, [damping_k] * n
            cc, dmp_c = [self._one(device, wc) * c_g] * n, [damping_c] * n
        else:  # (the diagonal-carrying parts of Pi(K^T K) are unfolded: pi = 1 there)
            # The traces are copies (stacked), so the op's reset of H leaves them as they were.
            ck = (c_g * sc.average_traces(H_C)).to(wk).unbind()
            dmp_k = self._times(damping_k, sc.average_traces(C_tC)).to(wk).unbind()
            cc = (c_g * sk.average_traces(H_K)).to(wc).unbind()
            dmp_c = self._times(damping_c, sk.average_traces(K_tK)).to(wc).unbind()
        due, commit = self._due_and_commit(layers, due_host, device, group["T"],
                                           [hk + hc for hk, hc in zip(H_K, H_C)])
        commits = commit.unbind()
        for i, layer in enumerate(layers):
            d_k, d_c = self.dims(layer.module)
            for kind, d, dtype, m, h, ktk, pi, c_h, c_d, s, a1 in (
                    (sk, d_k, dk, m_K[i], H_K[i], K_tK[i], pi_k, ck[i], dmp_k[i], scale_k, alpha1_k),
                    (sc, d_c, dc, m_C[i], H_C[i], C_tC[i], pi_c, cc[i], dmp_c[i], scale_c, alpha1_c)):
                lists = momentum.setdefault((device, dtype), ([], [], [], [], [], [], [], [], [], []))
                p = len(m)
                for lst, values in zip(lists, (m, h, ktk, [c_h] * p, [c_d] * p, [commits[i]] * p,
                                               kind.eye_kinds(d), [int(x) for x in pi], [s] * p,
                                               [a1] * p)):
                    lst.extend(values)
        return _Bucket(layers, group, sk, sc, wk, wc, device, due_host, K, C, m_K, m_C, due,
                       commit, commits)

    def _betas(self, b: _Bucket, kind, m: list[tuple], work: torch.dtype) -> list[Tensor]:
        """This step's beta1 of each layer of the bucket for one factor; with normalize_lr_cov
        divided by max(1, the inf-norm of the layer's new momentum)."""
        beta = self._lr_cov(b.group, b.device, work)
        if not b.group["normalize_lr_cov"]:
            return [beta] * len(b.layers)
        norms = torch.clamp(kind.inf_norms(m), min=1.0)
        if norms.dtype != beta.dtype:  # as a 0-dim beta over a 0-dim norm would promote
            norms = norms.to(torch.promote_types(beta.dtype, norms.dtype))
        return list((beta / norms).unbind())

    def _factor_steps(self, buckets: list[_Bucket]) -> dict[tuple, tuple[list, ...]]:
        """The factor step op's arguments per (device, dtype) bucket, after the momentum op."""
        steps: dict[tuple, tuple[list, ...]] = {}
        for b in buckets:
            beta_k, beta_c = self._betas(b, b.sk, b.m_K, b.wk), self._betas(b, b.sc, b.m_C, b.wc)
            for i in range(len(b.layers)):
                for kind, parts, m, beta in ((b.sk, b.K[i], b.m_K[i], beta_k[i]),
                                             (b.sc, b.C[i], b.m_C[i], beta_c[i])):
                    km, elementwise = kind.product_parts(parts, m)
                    lists = steps.setdefault((b.device, parts[0].dtype), ([], [], [], [], []))
                    n = len(parts)
                    for lst, values in zip(lists, (parts, km, [beta] * n, [b.commits[i]] * n,
                                                   elementwise)):
                        lst.extend(values)
        return steps

    def _finish_updates(self, buckets: list[_Bucket]) -> None:
        """The op reset the accumulators of the committed updates; those of the dropped ones are
        reset too (while the host gates, every layer here is due or has empty accumulators: all
        of them in one op). Then the drop counts (commit implies due) and the cached products."""
        resets = []
        for b in buckets:
            dues = b.due.unbind() if b.due_host is None else None
            for i, layer in enumerate(b.layers):
                accumulators = self._parts(layer, "H_K") + self._parts(layer, "H_C") + (
                    self.state[layer.anchor]["H_count"],)
                if dues is not None:
                    for t in accumulators:
                        t.copy_(torch.where(dues[i], torch.zeros_like(t), t))
                else:
                    resets += list(accumulators)
                self._refresh_cache(layer, b.K[i], b.C[i])
            self._skipped.counter(b.device).add_((b.due ^ b.commit).sum())
        if resets:
            torch._foreach_zero_(resets)

    def _refresh_cache(self, layer: Layer, K, C) -> None:
        """With cache_preconditioner, P = K K^T (C C^T) from the factors just written."""
        state = self.state[layer.anchor]
        for key, parts in (("P_K", K), ("P_C", C)):  # the cached products follow the factors
            if key in state:  # (dense factors only)
                torch.mm(parts[0], parts[0].mT, out=state[key])
