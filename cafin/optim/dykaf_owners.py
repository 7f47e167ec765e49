"""DyKAF's eigenbasis refreshes shared out over the ranks of a process group: each basis due for
a refresh (one per preconditioned mode of a parameter: a power step and a QR of a d x d factor,
`cafin.maths.dykaf.refresh_basis`) is refreshed by one owner rank, and the new bases and the
permutations of their columns travel to the other ranks in one collective per (device, dtype).

Under DDP every rank holds the same factors and bases (the gradients are averaged), so one rank's
refresh is every rank's. The owners are chosen afresh at each refresh step, among the bases due
at that step, as distributed Shampoo's DDP distributor balances its blocks: by cost (d^3: the
products and the QR), most expensive first, each to the least loaded rank (ties: the lowest
rank), with `cafin.optim.kaisa.greedy_assignment`; every rank computes the same assignment from
the same parameters. The unit is the basis, not the parameter: a model whose largest matrix
holds most of the work (an MLP's 784 x 512 input layer) splits far better by mode. The exchange is
`cafin.optim.kaisa.exchange`: one all_gather, or one broadcast per rank with a share when a padded
all_gather would more than double what is received.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.collectives import distributed
from ..maths import dykaf as dykaf_maths
from .kaisa import exchange, greedy_assignment

__all__ = ["RefreshOwners", "refresh_owners"]


def refresh_owners(process_group) -> "RefreshOwners | None":
    """The sharing for DyKAF's `process_group` argument: None (no sharing: every rank refreshes
    every parameter) for None or a group of one rank; a ValueError when torch.distributed is not
    initialised or this rank is not in the group, a TypeError for anything but a ProcessGroup."""
    if process_group is None:
        return None
    if not distributed():
        raise ValueError("DyKAF: process_group given but torch.distributed is not initialised "
                         "(call torch.distributed.init_process_group first, or pass None)")
    import torch.distributed as dist
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a rank outside it
        raise ValueError("DyKAF: process_group does not hold this rank; every rank that steps "
                         "the optimizer must be in it")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"DyKAF: process_group must be a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD) or None, got {type(process_group).__name__}")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("DyKAF: process_group does not hold this rank; every rank that steps "
                         "the optimizer must be in it")
    world = dist.get_world_size(process_group)
    return RefreshOwners(process_group, rank, world) if world > 1 else None


class RefreshOwners:
    """The refreshes of one step, deferred to its end (`defer`), then made by their owners and
    shared (`flush`); `collectives` counts the collectives the last flush made."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.pending: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []
        self.collectives = 0

    def defer(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Remember a parameter due for a refresh; its factors and bases are read at `flush`
        (nothing writes them after the refresh point of a step)."""
        self.pending.append((p, state, group))

    def owners(self) -> list[list[int | None]]:
        """The owner rank of each mode of each pending refresh (None: no basis), the same on
        every rank."""
        work = {f"{i}.{k}": {"refresh": float(f.shape[0] ** 3)}
                for i, (_, state, _) in enumerate(self.pending)
                for k, f in enumerate(state["factors"]) if f is not None}
        assigned = greedy_assignment(work, [list(range(self.world))], self.world, colocate=False)
        return [[assigned[f"{i}.{k}"]["refresh"] if f is not None else None
                 for k, f in enumerate(state["factors"])]
                for i, (_, state, _) in enumerate(self.pending)]

    def flush(self, install: Callable[[torch.Tensor, dict, dict, list], None]) -> int:
        """Refresh this rank's share of the pending parameters, share the results, and hand every
        pending parameter's new bases to `install(p, state, group, new)`, new[k] = (basis,
        order) or None for a mode without a basis. Returns the collectives made."""
        self.collectives = 0
        if not self.pending:  # not a refresh step (or a compiled one: its refreshes stay local)
            return 0
        pending, owners = self.pending, self.owners()
        self.pending = []
        held: dict[tuple, list[list[torch.Tensor]]] = {}
        results = []
        for (_, state, _), mode_owners in zip(pending, owners):
            new: list = []
            for factor, basis, owner in zip(state["factors"], state["bases"], mode_owners):
                if factor is None:
                    new.append(None)
                    continue
                if owner == self.rank:
                    Q, order = dykaf_maths.refresh_basis(factor, basis)
                    Q = _column_major(Q)
                    # The permutation travels with the basis, in its dtype: exact below 2^24
                    # (float32), far above any mode a d x d factor can have.
                    order = order.to(Q.dtype)
                else:
                    d = factor.shape[0]
                    Q = _column_major(torch.empty((d, d), dtype=basis.dtype, device=basis.device))
                    order = torch.empty(d, dtype=basis.dtype, device=basis.device)
                shares = held.setdefault((Q.device, Q.dtype), [[] for _ in range(self.world)])
                shares[owner] += [Q, order]
                new.append((Q, order))
            results.append(new)
        for shares in held.values():
            self.collectives += exchange(shares, self.rank, self.group)
        for (p, state, group), new in zip(pending, results):
            install(p, state, group, [None if x is None else (x[0], x[1].long()) for x in new])
        return self.collectives


def _column_major(Q: torch.Tensor) -> torch.Tensor:
    """Q laid out column-major, as LAPACK's QR leaves it: the owner's basis and the received
    copies must have one layout, since a GEMM's rounding can depend on it and the ranks' weights
    must stay bit-identical."""
    d = Q.shape[0]
    if Q.stride() == (1, d):
        return Q
    return torch.empty((d, d), dtype=Q.dtype, device=Q.device).mT.copy_(Q)
