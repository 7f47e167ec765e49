"""KAISA's distribution of K-FAC's work over the ranks (kfac-pytorch 0.4.2's meaning): which rank
decomposes each factor, which ranks precondition each layer's gradient, and the bucketed
collectives that move factors, second-order data and preconditioned gradients.

With W ranks and a gradient worker fraction f, the ranks form a grid of g = max(1, W f) rows by
W / g columns (ranks in ascending order, row by row). A column is a gradient worker group: every
layer belongs to one column, whose ranks hold its second-order data and precondition its
gradient; one rank of that column (the inverse worker) decomposes each of its factors. A row is
a gradient receiver group: it holds one rank of every column, so a row exchanges preconditioned
gradients in one collective. f = 1 (COMM_OPT): one column, every rank preconditions every layer
and receives the second-order data. f = 1/W (MEM_OPT): one row, a layer's inverse worker is its
only gradient worker and sends the preconditioned gradient. In between: HYBRID_OPT.

Layers go to columns, and factors to ranks, greedily by cost, most expensive first, each to the
least loaded (ties: the lowest index), as kfac-pytorch's KAISA assignment does; every rank
computes the same assignment from the layers' factor sizes.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["KaisaAssignment", "factor_costs", "greedy_assignment", "worker_columns", "receiver_rows",
           "allreduce_factors", "exchange"]


def worker_columns(world: int, grad_workers: int) -> list[list[int]]:
    """The gradient worker groups: the columns of the grid of `grad_workers` rows."""
    if world < 1 or grad_workers < 1 or world % grad_workers:
        raise ValueError(f"the world size ({world}) must be a multiple of the gradient worker "
                         f"count ({grad_workers})")
    columns = world // grad_workers
    return [list(range(c, world, columns)) for c in range(columns)]


def receiver_rows(world: int, grad_workers: int) -> list[list[int]]:
    """The gradient receiver groups: the rows of that grid."""
    columns = len(worker_columns(world, grad_workers))
    return [list(range(r * columns, (r + 1) * columns)) for r in range(grad_workers)]


def factor_costs(sizes: dict[str, tuple[int, int, int]], strategy: str) -> dict[str, dict[str, float]]:
    """Per layer (name -> (groups, d_A, d_G)), the cost of each factor: its decomposition,
    groups * d^3 ("compute"), or its size, groups * d^2 ("memory")."""
    power = {"compute": 3, "memory": 2}[strategy]
    return {name: {"A": float(g * d_a ** power), "G": float(g * d_g ** power)}
            for name, (g, d_a, d_g) in sizes.items()}


def greedy_assignment(work: dict[str, dict[str, float]], groups: Sequence[Sequence[int]], world: int,
                      colocate: bool) -> dict[str, dict[str, int]]:
    """The rank of every factor: layers by descending total cost (stable: ties keep their order)
    each to the column with the least summed load, then each factor (or, colocated, the whole
    layer) to the least loaded rank of that column."""
    load = [0.0] * world
    out: dict[str, dict[str, int]] = {}
    for name in sorted(work, key=lambda n: -sum(work[n].values())):
        sums = [sum(load[r] for r in g) for g in groups]
        group = groups[sums.index(min(sums))]
        if colocate:
            rank = min(group, key=lambda r: (load[r], group.index(r)))
            load[rank] += sum(work[name].values())
            out[name] = {factor: rank for factor in work[name]}
        else:
            out[name] = {}
            for factor, cost in sorted(work[name].items(), key=lambda kv: (kv[1], kv[0]), reverse=True):
                rank = min(group, key=lambda r: (load[r], group.index(r)))
                load[rank] += cost
                out[name][factor] = rank
    return {name: out[name] for name in work}


class KaisaAssignment:
    """This rank's view of the assignment: `inv_worker(layer, factor)`, `is_grad_worker(layer)`,
    the column of each layer, and this rank's column and row (ranks of the process group)."""

    def __init__(self, work: dict[str, dict[str, float]], *, rank: int, world: int,
                 grad_worker_fraction: float, colocate_factors: bool) -> None:
        grad_workers = max(1, round(world * grad_worker_fraction))
        if not math.isclose(world * grad_worker_fraction, grad_workers) and world * grad_worker_fraction > 1:
            raise ValueError(f"grad_worker_fraction={grad_worker_fraction} times the world size {world} "
                             "must be an integer")
        self.rank, self.world, self.grad_workers = rank, world, grad_workers
        self.columns = worker_columns(world, grad_workers)
        self.rows = receiver_rows(world, grad_workers)
        # kfac-pytorch hands the columns to the greedy rule in the order of a set of frozensets
        # (deterministic for ints); the same order gives its assignment where loads tie
        self._inv = greedy_assignment(work, [list(c) for c in {frozenset(c) for c in self.columns}], world,
                                      colocate_factors)
        self._column = {name: next(i for i, c in enumerate(self.columns) if next(iter(f.values())) in c)
                        for name, f in self._inv.items()}
        self.my_column = next(c for c in self.columns if rank in c)
        self.my_row = next(r for r in self.rows if rank in r)

    def inv_worker(self, layer: str, factor: str) -> int:
        return self._inv[layer][factor]

    def column(self, layer: str) -> int:
        """The index of the layer's gradient worker group."""
        return self._column[layer]

    def is_grad_worker(self, layer: str) -> bool:
        return self.rank in self.columns[self._column[layer]]

    def broadcast_inverses(self) -> bool:
        """Whether second-order data moves (a column holds more than one rank: not MEM_OPT)."""
        return self.grad_workers > 1

    def broadcast_gradients(self) -> bool:
        """Whether preconditioned gradients move (more than one column: not COMM_OPT)."""
        return len(self.columns) > 1

    def __repr__(self) -> str:
        lines = [f"  {name}: column={self._column[name]}, inv_workers={f}" for name, f in self._inv.items()]
        return f"KaisaAssignment(rank={self.rank}, world={self.world}, grad_workers={self.grad_workers},\n" \
               + "\n".join(lines) + "\n)"


# ------------------------------------------------------------------------------ collectives
_TRIU: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _triu(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (n, device)
    if key not in _TRIU:
        i, j = torch.triu_indices(n, n, device=device)
        _TRIU[key] = (i, j)
    return _TRIU[key]


def _packed(f: torch.Tensor, symmetric: bool) -> torch.Tensor:
    if not symmetric or f.dim() < 3:  # a diagonal factor ([groups, n]) travels whole
        return f.reshape(-1)
    i, j = _triu(f.shape[-1], f.device)
    return f[..., i, j].reshape(-1)


def _unpack(piece: torch.Tensor, f: torch.Tensor, symmetric: bool) -> None:
    if not symmetric or f.dim() < 3:
        f.copy_(piece.view_as(f))
        return
    i, j = _triu(f.shape[-1], f.device)
    values = piece.view(*f.shape[:-2], i.numel())
    f[..., i, j] = values
    f[..., j, i] = values


def _packed_numel(f: torch.Tensor, symmetric: bool) -> int:
    n = f.shape[-1]
    return f.numel() // (n * n) * (n * (n + 1) // 2) if symmetric and f.dim() >= 3 else f.numel()


def allreduce_factors(factors: list[torch.Tensor], group, world: int, *, cap_bytes: float,
                      symmetric: bool) -> int:
    """Average factors (square, [..., n, n], or diagonal, [groups, n]) over the ranks of `group` in place: each (device,
    dtype) in buckets of at most `cap_bytes` (a factor larger than that alone; 0: one collective
    per factor; a megabyte is 10^6 bytes, as kfac-pytorch counts), one all_reduce per bucket over one flat buffer. `symmetric`: only the upper
    triangles travel and both triangles are written from them. Returns the collectives made."""
    import torch.distributed as dist
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for f in factors:
        by_kind.setdefault((f.device, f.dtype), []).append(f)
    calls = 0
    for fs in by_kind.values():
        buckets: list[list[torch.Tensor]] = [[]]
        used = 0
        for f in fs:
            nbytes = _packed_numel(f, symmetric) * f.element_size()
            if buckets[-1] and used + nbytes > cap_bytes:
                buckets.append([])
                used = 0
            buckets[-1].append(f)
            used += nbytes
        for bucket in buckets:
            pieces = [_packed(f, symmetric) for f in bucket]
            flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            for piece, f in zip(flat.split([p.numel() for p in pieces]), bucket):
                _unpack(piece, f, symmetric)
            calls += 1
    return calls


def exchange(held: list[list[torch.Tensor]], me: int, group) -> int:
    """Share tensors within a group: `held[i]` lists the tensors member i of the group computed
    (every member lists every member's, in the same order, same dtype and device); on return
    each member's copies hold member i's values. One all_gather of flat buffers padded to the
    largest member's when the padding at most doubles what is received; else, so that a group
    with a few large shares does not receive every member's padding, one broadcast per member
    with a share. Returns the collectives made."""
    import torch.distributed as dist
    sizes = [sum(t.numel() for t in ts) for ts in held]
    longest, total = max(sizes), sum(sizes)
    if longest == 0:
        return 0
    like = next(t for ts in held for t in ts)

    def unpack(i: int, flat: torch.Tensor) -> None:
        for t, piece in zip(held[i], flat[:sizes[i]].split([t.numel() for t in held[i]])):
            t.copy_(piece.view_as(t))

    if len(held) * longest <= 2 * total:
        mine = torch.zeros(longest, dtype=like.dtype, device=like.device)
        if sizes[me]:
            torch.cat([t.reshape(-1) for t in held[me]], out=mine[:sizes[me]])
        out = [torch.empty_like(mine) for _ in held]
        dist.all_gather(out, mine, group=group)
        for i in range(len(held)):
            if i != me and sizes[i]:
                unpack(i, out[i])
        return 1
    calls = 0
    for i, size in enumerate(sizes):
        if not size:
            continue
        if i == me:
            flat = torch.cat([t.reshape(-1) for t in held[i]])
        else:
            flat = torch.empty(size, dtype=like.dtype, device=like.device)
        if group is None:
            dist.broadcast(flat, src=i)
        else:
            dist.broadcast(flat, group=group, group_src=i)
        if i != me:
            unpack(i, flat)
        calls += 1
    return calls
