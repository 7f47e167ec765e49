"""SINGD under torch.distributed: the curvature averaged over the ranks (one collective per
reduction kind), the natural gradient all-reduced as singd does, and FSDP2/HSDP's sharded layers:
each gathered whole to one owner rank of its shard group (`cafin.core.distribution.sharding`), chosen by the cost
of its natural gradient, whose pieces go back as rows.
"""
from __future__ import annotations

from torch import Tensor

from ...core import Layer, average_over_ranks
from ...maths import singd as singd_maths
from ...core.distribution.sharding import gather_to_owners, is_sharded, local, rows, scatter_from_owners, shard_dim
from ...core.distribution.kaisa import greedy_assignment
from .structures import Diagonal


def own_rows_of(layer: Layer, C: tuple) -> tuple:
    """A diagonal C's entries for the local shard's rows (an empty shard: none)."""
    start, stop = rows(layer.module.weight)
    return (C[0][start:stop],)


class Distribution:
    """The step across ranks (a mixin of `SINGD`)."""

    def _step_across_ranks(self, dues, updating, c_g, grad_scale: float,
                           divisor: Tensor | None) -> None:
        """The step under torch.distributed: the curvature averaged over the ranks, FSDP2's
        sharded layers gathered to their owners and their rows sent back. Every layer goes
        through the natural gradient (not the fused diagonal step): singd reduces the natural
        gradient across the ranks (`_reduce_natural_gradient`)."""
        self._average_curvature([layer for layer, due in dues if due is not False])
        owned = set()
        full = self._gather_sharded([layer for layer, _ in dues]) if self._sharded else {}
        returned: list[tuple[Layer, str, Tensor | None]] = []  # FSDP2: (layer, param, owner's piece)
        per_group: dict[int, tuple[list, list, list]] = {}
        self._update_preconditioners(updating, c_g)
        for layer, due in dues:
            module = layer.module
            owned.update(layer.params.values())
            grads = {n: getattr(module, n).grad for n in ("weight", "bias") if getattr(module, n, None) is not None}
            if all(g is None for g in grads.values()):
                continue
            sk, sc = self._kinds(layer)
            K, C = self._parts(layer, "K"), self._parts(layer, "C")
            self._queue_natural_gradient(layer, grads, full.get(id(layer)), sk, sc, K, C,
                                         grad_scale, per_group, returned)
        self._queue_returned(returned, per_group)
        self._apply_updates(per_group, {}, self._unowned(owned), grad_scale, divisor)

    def _average_curvature(self, due: list[Layer]) -> None:
        """Distributed without a DDP wrapper's gradient averaging too: H terms averaged (summed for
        loss_average None, as singd) in one collective per reduction kind."""
        by_op: dict[bool, list[Tensor]] = {}
        for layer in due:
            summed = self._group(layer)["loss_average"] is None
            by_op.setdefault(summed, []).extend(
                list(self._parts(layer, "H_K") + self._parts(layer, "H_C")))
        for summed, tensors in by_op.items():
            average_over_ranks(tensors, self.process_group, summed=summed)

    def _gather_sharded(self, layers: list[Layer]) -> dict[int, dict[str, Tensor | None]]:
        """FSDP2: the full gradients of the sharded layers whose structures multiply the whole
        gradient matrix (not diagonal K and C: elementwise, they need only the local rows). Each
        goes whole to one owner rank of the shard group (`_gradient_owners`), in one all_to_all
        per dtype; the values are None on the other ranks. The factors are replicated, so any
        rank can own any layer (under HSDP too)."""
        self._owned_now = {}
        wanted, tensors = [], []
        for layer in layers:
            grads = {n: getattr(layer.module, n).grad for n in ("weight", "bias")
                     if getattr(layer.module, n, None) is not None}
            if self._elementwise_rows(layer) or any(
                    g is None or not is_sharded(g) for g in grads.values()):
                continue
            wanted.append((layer, list(grads)))
            tensors += list(grads.values())
        if not tensors:
            return {}
        owners = self._gradient_owners(tensors[0])
        self._owned_now = {id(layer): owners[layer.name] for layer, _ in wanted}
        per_tensor = [owners[layer.name] for layer, names in wanted for _ in names]
        gathered = iter(gather_to_owners(tensors, per_tensor))
        out = {id(layer): {n: next(gathered) for n in names} for layer, names in wanted}
        me = tensors[0].device_mesh.get_local_rank(shard_dim(tensors[0]))
        return {key: grads for key, grads in out.items() if self._owned_now[key] == me}

    def _gradient_owners(self, p: Tensor) -> dict[str, int]:
        """FSDP2: each layer's owner (shard index), by the cost of its natural gradient,
        d_K d_C (d_K + d_C), greedily (kaisa.greedy_assignment: most expensive first, each to the
        least loaded rank); the same on every rank. `p`: a sharded gradient."""
        shards = p.device_mesh.size(shard_dim(p))
        work = {}
        for layer in self._curvature:
            d_k, d_c = self.dims(layer.module)
            work[layer.name] = {"natural_gradient": float(d_k * d_c * (d_k + d_c))}
        assignment = greedy_assignment(work, [list(range(shards))], shards, colocate=True)
        return {name: a["natural_gradient"] for name, a in assignment.items()}

    def _queue_returned(self, returned: list[tuple[Layer, str, Tensor | None]], per_group) -> None:
        """FSDP2 owner scheme: the owners' natural-gradient pieces, each rank's rows sent back in
        one all_to_all per dtype, queued for the SGD update of their groups."""
        if not returned:
            return
        grads = [layer.params[pname].grad for layer, pname, _ in returned]
        owners = [self._owned_now[id(layer)] for layer, _, _ in returned]
        pieces = scatter_from_owners([piece for _, _, piece in returned], grads, owners)
        for (layer, pname, _), piece in zip(returned, pieces):
            p = layer.params[pname]
            params, updates, bufs = per_group.setdefault(self._group_of[layer.anchor], ([], [], []))
            params.append(local(p))
            updates.append(piece)
            bufs.append(local(self.state[p]["momentum_buffer"]))

    def _elementwise_rows(self, layer: Layer) -> bool:
        """Whether a shard's natural gradient comes from its own rows alone: diagonal K and C on
        a weight stored [out, in] (a transposed weight's rows are K's, not C's: it is gathered)."""
        sk, sc = self._kinds(layer)
        return sk is Diagonal and sc is Diagonal and not singd_maths.is_transposed(layer.module)

    def _reduce_natural_gradient(self, layer: Layer, nat: Tensor) -> None:
        """singd all-reduces the natural gradient (mean, or sum for loss_average None). Under a
        DDP wrapper the gradients are averaged already, so the natural gradient is too (it is
        linear in them): only the sum's factor is left."""
        import torch.distributed as dist
        summed = self._group(layer)["loss_average"] is None
        if self._ddp:
            if summed:
                nat.mul_(dist.get_world_size(self.process_group))
            return
        dist.all_reduce(nat, group=self.process_group)
        if not summed:
            nat.div_(dist.get_world_size(self.process_group))
