"""SINGD's parameter update, every step: the natural gradient C C^T [grad W | grad b] K K^T of
each layer (by the fused diagonal step op for diagonal K and C on one process), then SGD with
momentum and L2 weight decay per group, parameters no supported layer owns with their plain
gradient. Which path each layer takes is kept from step to step (`_StepPlan`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from ...core import Layer, distributed, route
from ...core import views
from ...maths import singd as singd_maths
from ...core.distribution.sharding import local, own_rows
from .distribution import own_rows_of
from .settings import work_dtype
from .structures import Diagonal


def contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def contiguous_all(tensors: list[Tensor]) -> list[Tensor]:
    """The tensors made contiguous, the strided ones (a weight's or bias's piece of a layer's
    natural gradient [W | b]) copied into new memory by one op for all of them."""
    strided = [i for i, t in enumerate(tensors) if not t.is_contiguous()]
    if not strided:
        return list(tensors)
    out = list(tensors)
    copies = [torch.empty(tensors[i].shape, dtype=tensors[i].dtype, device=tensors[i].device)
              for i in strided]
    torch._foreach_copy_(copies, [tensors[i] for i in strided])
    for i, c in zip(strided, copies):
        out[i] = c
    return out


class _StepPlan(NamedTuple):
    """How a step routes each layer, kept from step to step on one process (no collectives)
    while `key` holds: the parameters' memory (`.data =` moves it) and which parameters have
    gradients. Factors, momenta and parameters are written in place, so the tensors held here
    stay the live ones until `_attach` (a new group, a checkpoint load) drops the plan."""
    key: tuple
    # group index -> (device, dtype) -> (params, momenta, K, C, offsets) of the fused diagonal
    # step, whose gradients are read at each step
    diagonal: dict[int, dict[tuple, tuple[list, ...]]]
    natural: list  # (layer, its gradients' names, sk, sc, K, C): the natural-gradient layers
    unowned: dict[int, list]  # group index -> its parameters no layer owns, with a gradient



class ParameterUpdate:
    """The natural gradient and the SGD update (a mixin of `SINGD`)."""

    def _step_plan(self) -> _StepPlan:
        """This step's `_StepPlan`: the kept one while its key holds, else a new one. A compiled
        step builds it every time (the compiler guards on what it reads; it cannot read the
        memory addresses of the key)."""
        params, key = self._layer_params_all, None
        compiling = route.compiled()
        if not compiling:
            key = (self.backend, tuple(map(torch.Tensor.data_ptr, params)),
                   tuple(p.grad is None for p in params))
            if self._plan is not None and self._plan.key == key:
                return self._plan
        diagonal: dict[int, dict[tuple, tuple[list, ...]]] = {}
        natural, owned = [], set()
        for layer in self._curvature:
            owned.update(layer.params.values())
            names = [n for n in ("weight", "bias") if getattr(layer.module, n, None) is not None]
            if all(getattr(layer.module, n).grad is None for n in names):
                continue
            sk, sc = self._kinds(layer)
            K, C = self._parts(layer, "K"), self._parts(layer, "C")
            if self._fused_diagonal(layer, sk, sc, K, C):
                self._queue_diagonal_step(layer, K, C, diagonal)
            else:
                natural.append((layer, names, sk, sc, K, C))
        plan = _StepPlan(key, diagonal, natural, self._unowned(owned))
        if not compiling:
            self._plan = plan
        return plan

    def _unowned(self, owned: set) -> dict[int, list]:
        """Per group, its parameters with a gradient that no supported layer owns."""
        return {index: [p for p in group["params"] if p not in owned and p.grad is not None]
                for index, group in enumerate(self.param_groups)}

    def _queue_diagonal_step(self, layer: Layer, K, C, per_diag) -> None:
        """Queue a layer with diagonal K and C for the fused diagonal step (the op forms the
        natural gradient and updates the parameters), in its (group, device, dtype) bucket of
        (params, momenta, K, C, offsets into K); each step reads the params' gradients."""
        bucket = per_diag.setdefault(self._group_of[layer.anchor], {}).setdefault(
            (layer.anchor.device, layer.anchor.dtype), ([], [], [], [], []))
        d_k = K[0].numel()
        # The op scales row r by C[r]^2 and column j by K[offset + j]^2. An Embedding's weight is
        # [vocabulary (K's side), dim (C's side)]: its rows take K, its columns C.
        rows, columns = (K[0], C[0]) if isinstance(layer.module, nn.Embedding) else (C[0], K[0])
        for pname, p in layer.params.items():
            if p.grad is None:
                continue
            for lst, v in zip(bucket, (p, self.state[p]["momentum_buffer"], columns, rows,
                                       0 if pname == "weight" else d_k - 1)):
                lst.append(v)

    def _gradient_matrices(self, natural) -> dict[str, Tensor]:
        """Eagerly, the [grad W | grad b] matrices of the layers in `natural` (the step plan's)
        whose weight and bias it updates, both with gradients, in kept buffers written by one
        copy (`views.gradient_matrices_into`). Layer name -> matrix; the others (no bias: the
        weight's gradient as it is; a missing gradient; a compiled step) form theirs in
        `_queue_natural_gradient`."""
        if not route.eager():
            return {}
        entries = []
        for layer, names, *_ in natural:
            module = layer.module
            if (singd_maths.has_bias(module) and {"weight", "bias"} <= set(names)
                    and module.weight.grad is not None and module.bias.grad is not None):
                gw = views.view_of(module).weight_matrix(module, module.weight.grad)
                entries.append((layer.name, gw, module.bias.grad, gw.dtype))
        matrices = views.gradient_matrices_into(self._gradient_buffers, entries)
        return {name: m for (name, *_), m in zip(entries, matrices)}

    def _queue_natural_gradient(self, layer: Layer, grads, full_grads, sk, sc, K, C, grad_scale,
                                per_group, returned, gmat: Tensor | None = None) -> None:
        """Form the layer's natural gradient and queue its pieces, one per parameter, for the
        SGD update of its group (`full_grads`: the gathered gradients of a sharded layer; `gmat`:
        its gradient matrix when `_gradient_matrices` made it). A sharded layer under the owner
        scheme goes to `returned` instead: its owner's full pieces (None on the other ranks,
        which skip the layer), to come back as rows."""
        module = layer.module
        if id(layer) in self._owned_now:
            if full_grads is None:  # another rank owns it
                returned += [(layer, n, None) for n, p in layer.params.items() if p.grad is not None]
                return
            grads = full_grads
        local_rows = self._sharded and self._elementwise_rows(layer)
        if local_rows:
            C = own_rows_of(layer, C)
            grads = {n: local(g) for n, g in grads.items()}
        if full_grads is not None:
            grads = full_grads
        if gmat is None and local_rows:
            gw = grads["weight"].reshape(grads["weight"].shape[0], module.weight.shape[1:].numel())
            gmat = gw if not singd_maths.has_bias(module) else torch.cat([gw, grads["bias"].unsqueeze(1)], 1)
        elif gmat is None:
            like = next(g for g in grads.values() if g is not None)
            gmat = singd_maths.gradient_matrix(module, grads.get("weight"), grads.get("bias"), like)
        if grad_scale != 1.0:
            gmat = gmat / grad_scale
        state = self.state[layer.anchor]
        nat = singd_maths.natural_gradient(sk, K, sc, C, gmat, state.get("P_K"), state.get("P_C"))
        if distributed():
            self._reduce_natural_gradient(layer, nat)
        params, updates, bufs = per_group.setdefault(self._group_of[layer.anchor], ([], [], []))
        pieces = singd_maths.weight_pieces(module, nat)
        for pname, p in layer.params.items():
            if p.grad is None:
                continue
            piece = pieces[pname]
            if id(layer) in self._owned_now:  # the owner: every rank's rows go back together
                returned.append((layer, pname, piece.reshape(p.shape)))
                continue
            if self._sharded and not local_rows:  # each rank keeps its rows
                piece = own_rows(piece, p)
            params.append(local(p))
            updates.append(piece.reshape(local(p).shape))
            bufs.append(local(self.state[p]["momentum_buffer"]))

    def _apply_updates(self, per_group, per_diag, unowned: dict[int, list], grad_scale: float,
                       divisor: Tensor | None) -> None:
        """Per group: the SGD update of the queued natural gradients and of the parameters no
        supported layer owns (`unowned`: their plain gradient), then the fused diagonal steps,
        which read the gradients' divisor on the device (`divisor`, the GradScaler's tensor,
        when there is one)."""
        for index, group in enumerate(self.param_groups):
            params, updates, bufs = per_group.setdefault(index, ([], [], []))
            for p in unowned.get(index, ()):
                grad = local(p.grad)
                params.append(local(p))
                updates.append(grad / grad_scale if grad_scale != 1.0 else grad)
                bufs.append(local(self.state[p]["momentum_buffer"]))
            if params:
                self._apply(params, updates, bufs, group)
            for (device, dtype), (ps, gs, bs, ks, cs, offs) in per_diag.get(index, {}).items():
                work = work_dtype(dtype)
                lr, momentum, wd = (self._hyperparameter(group, name, device, work)
                                    for name in ("lr", "momentum", "weight_decay"))
                scale = None  # unscaled
                if grad_scale != 1.0:
                    scale = divisor.to(device=device, dtype=work) if divisor is not None else \
                        torch.tensor(grad_scale, dtype=work, device=device)
                self._ops(device).singd_diag_step_(ps, gs, bs, ks, cs, offs, lr, momentum, wd, scale)

    def _fused_diagonal(self, layer, sk, sc, K, C) -> bool:
        """Whether the whole step of this layer is one elementwise kernel (on one process):
        cafin's kernels on its device, diagonal K and C in the parameters' op-math dtype."""
        if (not self._kernels(layer.anchor.device) or sk is not Diagonal or sc is not Diagonal
                or views.view_of(layer.module) is views.CONV1D):  # its bias column is not the weight's
            return False
        work = work_dtype(layer.anchor.dtype)
        return (K[0].dtype == work and C[0].dtype == work
                and all(p.dtype == layer.anchor.dtype and p.is_contiguous() for p in layer.params.values()))

    def _apply(self, params, updates, bufs, group) -> None:
        """SGD with momentum (torch's, no dampening) and L2 weight decay, per (device, dtype):
        u = nat + wd*theta, buf <- momentum*buf + u, theta <- theta - lr*buf."""
        buckets: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            buckets.setdefault((p.device, p.dtype), []).append(i)
        for (device, dtype), idx in buckets.items():
            ps, us, bs = ([xs[i] for i in idx] for xs in (params, updates, bufs))
            work = work_dtype(dtype)
            lr, momentum, wd = (self._hyperparameter(group, name, device, work)
                                for name in ("lr", "momentum", "weight_decay"))
            # The diagonal step's op without factors: one elementwise pass over the bucket, the
            # scalars in the op-math dtype as singd's Python floats are.
            none = self._no_factors(device, work)
            self._ops(device).singd_diag_step_(ps, contiguous_all(us), bs, [none] * len(ps),
                                               [none] * len(ps), [0] * len(ps), lr, momentum, wd)

