"""DyKAF's eigenbasis refreshes and first eigendecompositions shared out over the ranks of a
process group: each basis due for a refresh (one per preconditioned mode of a parameter: a power
step and a QR of a d x d factor, `cafin.maths.dykaf.refresh_basis`) or made at a parameter's first
step (the eigendecomposition of its first factor, `cafin.maths.dykaf.eigenbasis`) is computed by
one owner rank, and the bases, with the permutations of a refresh's columns or a flag saying
whether a first eigendecomposition succeeded, travel to the other ranks in one collective per
(device, dtype).

Under DDP every rank holds the same factors and bases (the gradients are averaged), so one rank's
refresh is every rank's. The owners are chosen afresh at each refresh step, among the bases due
at that step, as distributed Shampoo's DDP distributor balances its blocks: by cost (d^3: the
products and the QR), most expensive first, each to the least loaded rank (ties: the lowest
rank), with `cafin.core.distribution.kaisa.greedy_assignment`; every rank computes the same assignment from
the same parameters. A first eigendecomposition costs d^3 as well, and is assigned with the
refreshes of its step. The unit is the basis, not the parameter: a model whose largest matrix
holds most of the work (an MLP's 784 x 512 input layer) splits far better by mode. The exchange is
`cafin.core.distribution.kaisa.exchange`: one all_gather, or one broadcast per rank with a share when a padded
all_gather would more than double what is received.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...core.distribution.collectives import distributed
from ...maths import dykaf as dykaf_maths
from ...core.distribution.kaisa import exchange, greedy_assignment

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
    """The refreshes and first eigendecompositions of one step, deferred to its end (`defer`,
    `defer_start`), then made by their owners and shared (`flush`); `collectives` counts the
    collectives the last flush made."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.pending: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []
        self.starts: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []
        self.collectives = 0

    def clear(self) -> None:
        """Forget what a step that raised deferred."""
        self.pending.clear()
        self.starts.clear()

    def defer(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Remember a parameter due for a refresh; its factors and bases are read at `flush`
        (nothing writes them after the refresh point of a step)."""
        self.pending.append((p, state, group))

    def defer_start(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Remember a parameter's first state, built but for its bases (`state["factors"]` set,
        the state not installed): its eigendecompositions are made at `flush`."""
        self.starts.append((p, state, group))

    def owners(self) -> list[list[int | None]]:
        """The owner rank of each mode of each pending refresh, then of each pending start
        (None: no basis), the same on every rank."""
        jobs = self.pending + self.starts
        work = {f"{i}.{k}": {"refresh": float(f.shape[0] ** 3)}
                for i, (_, state, _) in enumerate(jobs)
                for k, f in enumerate(state["factors"]) if f is not None}
        assigned = greedy_assignment(work, [list(range(self.world))], self.world, colocate=False)
        return [[assigned[f"{i}.{k}"]["refresh"] if f is not None else None
                 for k, f in enumerate(state["factors"])]
                for i, (_, state, _) in enumerate(jobs)]

    def flush(self, install: Callable[[torch.Tensor, dict, dict, list], None],
              start: Callable[[torch.Tensor, dict, list | None, str | None], None]) -> int:
        """Make this rank's share of the pending refreshes and first eigendecompositions, share
        the results, and hand every pending refresh's new bases to `install(p, state, group,
        new)`, new[k] = (basis, order) or None for a mode without a basis, and every pending
        start's bases to `start(p, state, bases, None)`, or, where an eigendecomposition failed
        on its owner, `start(p, state, None, why)` on every rank. Returns the collectives made."""
        self.collectives = 0
        if not self.pending and not self.starts:  # a compiled step's refreshes stay local
            return 0
        owners = self.owners()
        jobs = [(job, False) for job in self.pending] + [(job, True) for job in self.starts]
        self.pending, self.starts = [], []
        held: dict[tuple, list[list[torch.Tensor]]] = {}
        results = []
        for ((_, state, _), first), mode_owners in zip(jobs, owners):
            new: list = []
            bases = [None] * len(state["factors"]) if first else state["bases"]
            for factor, basis, owner in zip(state["factors"], bases, mode_owners):
                if factor is None:
                    new.append(None)
                    continue
                if owner == self.rank:
                    # With its basis travels a refresh's permutation, in the basis's dtype (exact
                    # below 2^24 (float32), far above any mode a d x d factor can have), or a
                    # start's flag: 1 where its eigendecomposition succeeded.
                    Q, extra = _first_basis(factor) if first else dykaf_maths.refresh_basis(factor, basis)
                    Q = _column_major(Q)
                    extra = extra.to(Q.dtype)
                else:
                    d = factor.shape[0]
                    Q = _column_major(torch.empty((d, d), dtype=factor.dtype, device=factor.device))
                    extra = torch.empty(1 if first else d, dtype=factor.dtype, device=factor.device)
                shares = held.setdefault((Q.device, Q.dtype), [[] for _ in range(self.world)])
                shares[owner] += [Q, extra]
                new.append((Q, extra))
            results.append(new)
        for shares in held.values():
            self.collectives += exchange(shares, self.rank, self.group)
        for ((p, state, group), first), new, mode_owners in zip(jobs, results, owners):
            if not first:
                install(p, state, group, [None if x is None else (x[0], x[1].long()) for x in new])
                continue
            failed = [owner for x, owner in zip(new, mode_owners) if x is not None and float(x[1]) != 1]
            if failed:
                start(p, state, None, f"on rank {failed[0]}, also in float64")
            else:
                start(p, state, [None if x is None else x[0] for x in new], None)
        return self.collectives


def _first_basis(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A first eigenbasis and its flag (1: made; 0: the eigendecomposition failed also in
    float64, the basis then zeros)."""
    try:
        return dykaf_maths.eigenbasis(factor), torch.ones(1, dtype=factor.dtype, device=factor.device)
    except torch.linalg.LinAlgError:
        return torch.zeros_like(factor), torch.zeros(1, dtype=factor.dtype, device=factor.device)


def _column_major(Q: torch.Tensor) -> torch.Tensor:
    """Q laid out column-major, as LAPACK's QR leaves it: the owner's basis and the received
    copies must have one layout, since a GEMM's rounding can depend on it and the ranks' weights
    must stay bit-identical."""
    d = Q.shape[0]
    if Q.stride() == (1, d):
        return Q
    return torch.empty((d, d), dtype=Q.dtype, device=Q.device).mT.copy_(Q)
