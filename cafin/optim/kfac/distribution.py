"""K-FAC over ranks: the KAISA assignment (cafin.core.distribution.kaisa) and its process groups, the factor
all-reduce, the sharing of decompositions within a column and of preconditioned gradients within
a row, and FSDP2's gradient gathering (to each layer's owner, or to every rank) and KL clip."""
from __future__ import annotations

import logging
from collections import defaultdict

import torch

from ... import factors
from ...core import Layer, distributed, route
from ...maths import kfac as kfac_maths
from ...core.distribution.sharding import (gather_rows, gather_to_owners, is_sharded, local, own_rows,
                                           scatter_from_owners, shard_dim, shard_group, shard_groups)
from ...core.distribution.kaisa import KaisaAssignment, allreduce_factors, exchange, factor_costs
from .compat import ComputeMethod
from .state import _LayerState


class Distribution:
    """The distributed part of `KFACPreconditioner`."""

    def _assign_work(self, loglevel: int) -> None:
        """KAISA: which rank decomposes each factor and which ranks precondition each layer
        (cafin.core.distribution.kaisa), the same on every rank; the process groups that share second-order
        data (a column) and preconditioned gradients (a row); layers this rank does not
        precondition hold no second-order data."""
        import torch.distributed as dist
        group = self.process_group
        rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed() else (0, 1)
        sizes = {layer.name: factors.factor_sizes(layer.module) for layer in self._layers}
        work = factor_costs(sizes, self.assignment_strategy.name.lower())
        self.assignment = KaisaAssignment(work, rank=rank, world=world,
                                          grad_worker_fraction=self.grad_worker_fraction,
                                          colocate_factors=self.colocate_factors)
        self._world = world
        a = self.assignment
        self._column_group = self._row_group = None
        if a.broadcast_inverses() and a.broadcast_gradients():  # HYBRID_OPT: groups of its own
            if world != dist.get_world_size():
                raise ValueError("grad_worker_fraction strictly between 1/world and 1 (HYBRID_OPT) "
                                 "needs process_group to span the whole world")
            for ranks in a.columns:  # every rank creates every group, in one order
                g = dist.new_group(ranks)
                self._column_group = g if ranks is a.my_column else self._column_group
            for ranks in a.rows:
                g = dist.new_group(ranks)
                self._row_group = g if ranks is a.my_row else self._row_group
        elif a.broadcast_inverses():  # COMM_OPT: one column, the whole group
            self._column_group = group
        elif a.broadcast_gradients():  # MEM_OPT: one row, the whole group
            self._row_group = group
        for layer in self._layers:
            if not a.is_grad_worker(layer.name):
                self._state[layer.name].second = {}
        if world > 1:
            logging.getLogger(__name__).log(loglevel, f"KFAC layer assignments: {a}")

    def _reduce_factors(self) -> None:
        """Average every factor over the ranks: buckets of allreduce_bucket_cap_mb, the upper
        triangles only with symmetry_aware."""
        allreduce_factors([t for sts in self._by_device().values() for st in sts for t in (st.A, st.G)],
                          self.process_group, self._world, cap_bytes=self.allreduce_bucket_cap_mb * 1e6,
                          symmetric=self.symmetry_aware)

    def _my_sides(self, share: bool) -> set[tuple[str, str]]:
        """(layer, "a" or "g") this rank decomposes: the factors it is the inverse worker of
        (share=True), or every factor of the layers it preconditions (no collective needed)."""
        a = self.assignment
        if share:
            return {(layer.name, side) for layer in self._layers for side in "ag"
                    if a.inv_worker(layer.name, side.upper()) == a.rank}
        return {(layer.name, side) for layer in self._layers for side in "ag" if a.is_grad_worker(layer.name)}

    def _share_decomposed(self) -> None:
        """MEM_OPT and HYBRID_OPT: whether each layer is decomposed, from its column to every
        rank (one all_gather per device over the row), so that every rank rewrites the same
        layers and sends or receives their preconditioned gradients."""
        a = self.assignment
        if not a.broadcast_gradients():
            return
        held: dict[torch.device, list[list[torch.Tensor]]] = defaultdict(lambda: [[] for _ in a.my_row])
        flags = []
        for layer in self._layers:
            st = self._state[layer.name]
            flag = torch.full((1,), float(st.decomposed and a.is_grad_worker(layer.name)), device=st.A.device)
            held[st.A.device][a.column(layer.name)].append(flag)  # row[c] is in column c
            flags.append((st, flag))
        for lists in held.values():
            exchange(lists, a.my_row.index(a.rank), self._row_group)
        done = torch.cat([f.cpu() for _, f in flags]).tolist() if flags else []
        for (st, _), ok in zip(flags, done):
            st.decomposed = ok == 1.0

    def _second_order_keys(self, st: _LayerState, side: str) -> list[str]:
        """The second-order tensors the inverse worker of a layer's `side` factor computes (a
        diagonal A, an Embedding's, has no basis)."""
        if self.compute_method is not ComputeMethod.EIGEN:
            return [f"{side}_inv"]
        if self.compute_eigenvalue_outer_product:  # colocated: the G side carries the product
            keys = ["qa"] if side == "a" else ["qg", "dgda"]
        else:
            keys = ["q" + side, "d" + side]
        return [k for k in keys if k in st.second]

    def _share_second_order(self) -> None:
        """Within this rank's column (the gradient workers of its layers), every inverse
        worker's results and whether its layer is decomposed, in one all_gather per device."""
        a = self.assignment
        if not a.broadcast_inverses():
            return
        column = a.my_column
        held: dict[torch.device, list[list[torch.Tensor]]] = defaultdict(lambda: [[] for _ in column])
        flags: list[tuple[_LayerState, torch.Tensor]] = []
        for layer in self._layers:
            if not a.is_grad_worker(layer.name):
                continue
            st = self._state[layer.name]
            # [decomposed by the A side's worker, by the G side's]
            flag = torch.full((2,), float(st.decomposed), dtype=self.inv_dtype, device=st.A.device)
            for i, side in enumerate("ag"):
                member = column.index(a.inv_worker(layer.name, side.upper()))
                held[st.A.device][member] += [st.second[k] for k in self._second_order_keys(st, side)]
                held[st.A.device][member].append(flag[i:i + 1])
            flags.append((st, flag))
        for lists in held.values():
            exchange(lists, column.index(a.rank), self._column_group)
        done = torch.cat([f.cpu() for _, f in flags]).view(-1, 2).tolist() if flags else []
        for (st, _), ok in zip(flags, done):  # one host read: eager steps only
            st.decomposed = ok == [1.0, 1.0]

    def _check_device_gated(self) -> None:
        if (self._steps.device_gated or not route.eager()) and self.assignment.broadcast_gradients():
            raise RuntimeError("a compiled or captured K-FAC step needs grad_worker_fraction=1 "
                               "(COMM_OPT) under torch.distributed: the preconditioned gradients "
                               "of MEM_OPT and HYBRID_OPT are shared by eager collectives")

    def _gather(self, active: list[Layer]) -> list[Layer]:
        """FSDP2: the full gradients this rank preconditions; returns the layers it rewrites.

        Owner scheme (`_gradient_owners`): each sharded layer's gradient goes whole to its owner
        only (one all_to_all per dtype), which preconditions it; the other ranks skip it and get
        their rows back in `_keep_own_rows`. Otherwise every rank gathers every sharded
        gradient (one all_gather per dtype), preconditions its share and keeps its rows."""
        self._gathered, self._owned_now = {}, {}
        sharded = [layer for layer in active if is_sharded(layer.module.weight.grad)]
        if not sharded:
            return active
        tensors = []
        for layer in sharded:
            bias = getattr(layer.module, "bias", None)
            if bias is not None and not is_sharded(bias.grad):
                raise RuntimeError(f"KFACPreconditioner: layer '{layer.name}' has a sharded weight "
                                   "but an unsharded bias; shard whole modules with fully_shard")
            tensors += [layer.module.weight.grad] + ([bias.grad] if bias is not None else [])
        owners = self._gradient_owners(tensors[0])
        if owners is None:
            full = iter(gather_rows(tensors))  # over the mesh the gradients are sharded on
        else:
            self._owned_now = {layer.name: owners[layer.name] for layer in sharded}
            per_tensor = [owners[layer.name] for layer in sharded
                          for _ in range(1 + (getattr(layer.module, "bias", None) is not None))]
            full = iter(gather_to_owners(tensors, per_tensor))
        for layer in sharded:
            self._gathered[layer.name] = (next(full), next(full) if getattr(layer.module, "bias", None)
                                          is not None else None)
        if owners is None:
            return active
        me = tensors[0].device_mesh.get_local_rank(shard_dim(tensors[0]))
        return [layer for layer in active if self._owned_now.get(layer.name, me) == me]

    def _gradient_owners(self, p) -> dict[str, int] | None:
        """FSDP2: per layer, the shard index of its gradient's owner, the member of each shard
        group at the shard coordinate of the layer's KAISA inverse worker (of G): on a 1-D mesh
        that worker itself, which holds the layer's second-order data for every strategy. None
        (every rank gathers every gradient) where some shard group's owner would lack that data
        (HSDP with MEM_OPT, or HYBRID_OPT columns that do not meet every shard group at the
        worker's coordinate) or process_group is not the mesh's ranks. `p`: a sharded gradient."""
        if self._owners is not None:
            return self._owners or None
        import torch.distributed as dist
        a = self.assignment
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)  # global rank of each KAISA rank
        groups = shard_groups(p.device_mesh)
        owners: dict[str, int] = {}
        if sorted(r for g in groups for r in g) == sorted(ranks):
            coordinate = {r: s for g in groups for s, r in enumerate(g)}
            for layer in self._layers:
                s = coordinate[ranks[a.inv_worker(layer.name, "G")]]
                column = a.columns[a.column(layer.name)]
                if any(ranks.index(g[s]) not in column for g in groups):
                    owners = {}
                    break
                owners[layer.name] = s
        self._owners = owners
        return owners or None

    def _share_preconditioned_grads(self, active: list[Layer], precond: dict[str, torch.Tensor]) -> None:
        """MEM_OPT and HYBRID_OPT: within this rank's row (one rank of every column), each
        layer's preconditioned gradient from its column's rank, in one all_gather per device
        and dtype; `precond` then holds every active layer's."""
        a = self.assignment
        if not a.broadcast_gradients():
            return
        self._check_device_gated()
        row = a.my_row
        held: dict[tuple, list[list[torch.Tensor]]] = defaultdict(lambda: [[] for _ in row])
        for layer in active:
            if layer.name not in precond:
                w = self._grads(layer)[0]
                groups, d_a, d_g = factors.factor_sizes(layer.module)
                precond[layer.name] = torch.empty(groups, d_g, d_a, dtype=w.dtype, device=w.device)
            v = precond[layer.name]
            held[(v.device, v.dtype)][a.column(layer.name)].append(v)  # row[c] is in column c
        for lists in held.values():
            exchange(lists, row.index(a.rank), self._row_group)

    def _keep_own_rows(self) -> None:
        """FSDP2: each rank's rows of the rewritten full gradients into its shards: under the owner
        scheme the owners send them (one all_to_all per dtype), else each rank keeps its own."""
        if self._owned_now:
            names = list(self._owned_now)
            tensors, fulls, owners = [], [], []
            for name in names:
                m = self._module(name)
                for p, full in zip((m.weight, getattr(m, "bias", None)), self._gathered[name]):
                    if p is not None:
                        tensors.append(p.grad)
                        fulls.append(full)
                        owners.append(self._owned_now[name])
            for grad, rows in zip(tensors, scatter_from_owners(fulls, tensors, owners)):
                local(grad).copy_(rows)
        else:
            for name, (w, b) in self._gathered.items():
                m = self._module(name)
                local(m.weight.grad).copy_(own_rows(w, m.weight.grad))
                if b is not None:
                    local(m.bias.grad).copy_(own_rows(b, m.bias.grad))
        self._gathered, self._owned_now = {}, {}

    def _owner_kl_scale(self, active: list[Layer], precond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The KL-clip factor under the FSDP2 owner scheme: each rank sums <V, grad> over the
        sharded layers it owns, one all_reduce within the shard group adds them up, and the
        unsharded layers (the same on every rank) are added once. Accumulated in float64 when any
        sharded layer is (the same choice on every rank), else float32."""
        import torch.distributed as dist
        sharded = [self._module(name).weight for name in self._owned_now]
        acc = torch.float64 if any(w.dtype == torch.float64 for w in sharded) else torch.float32
        device = sharded[0].device
        owned = torch.zeros((), dtype=acc, device=device)
        rest = torch.zeros((), dtype=acc, device=device)
        for layer in active:
            term = (precond[layer.name].to(acc) * self._grad(layer).to(acc)).sum().to(device)
            if layer.name in self._owned_now:
                owned = owned + term
            else:
                rest = rest + term
        dist.all_reduce(owned, group=shard_group(sharded[0]))
        ts = self._settings_on(device)
        return kfac_maths.kl_clip_scale((owned + rest) * ts["lr"].to(acc) ** 2, ts["kl_clip"])
