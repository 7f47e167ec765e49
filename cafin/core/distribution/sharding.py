"""FSDP2 (`torch.distributed.fsdp.fully_shard`) support shared by the members.

A model wrapped with `fully_shard` holds its parameters (and, after backward, their gradients) as
DTensors sharded on dim 0 over a 1-D device mesh (FSDP), or over the shard dimension of a 2-D
(replicate x shard) mesh (HSDP: placements (Replicate(), Shard(0))), with torch.chunk semantics
within the shard dimension: every rank but the last ones holds ceil(n / shards) rows, the last
non-empty shard may be shorter and later ones are empty. FSDP2 averages the gradients over every
rank of the mesh (under HSDP: reduce-scatter within the shard group, all-reduce across the
replicas). The members' hooks see the unsharded module call (plain tensors), so statistics and
factors are the same as under DDP once averaged over every rank of the mesh (`check_sharded`'s
group); only the update touches shards, within the shard dimension:

- elementwise members read the rows of their row factor that the local shard owns (`rows`);
- members that multiply the whole gradient matrix send each layer's gradient to one owner rank
  of the shard group (`gather_to_owners`), which preconditions it and sends every rank its rows
  back (`scatter_from_owners`): one all_to_all per dtype each way, and no rank holds a full
  gradient it does not own;
- where no owner can be chosen (the member needs every rank to hold every full gradient, or an
  owner would lack the layer's second-order data), they gather it on every rank (`gather_rows`,
  one all_gather per dtype for all of a step's gradients), precondition it and keep their own
  rows (`own_rows`).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch without DTensor cannot shard either
    DTensor, Replicate, Shard = (), None, None

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:
    FSDPModule = ()


def is_sharded(t) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: writes reach the DTensor), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def module_class(module: torch.nn.Module) -> type:
    """The class a module had before `fully_shard` swapped it for a generated FSDP subclass, so a
    sharded model's layers are named (layouts, registration) as the plain model's are."""
    cls = type(module)
    if FSDPModule and isinstance(module, FSDPModule) and cls.__bases__[0] is FSDPModule:
        return cls.__bases__[-1]
    return cls


def _layout_ok(p) -> bool:
    """FSDP2's layouts: Shard(0) on a 1-D mesh, (Replicate(), Shard(0)) on a 2-D one (HSDP)."""
    placements = tuple(p.placements)
    if p.device_mesh.ndim == 1:
        return placements == (Shard(0),)
    return p.device_mesh.ndim == 2 and placements == (Replicate(), Shard(0))


def check_sharded(params: Iterable[torch.Tensor], who: str):
    """The process group the statistics of DTensor parameters are averaged over: every rank of
    their mesh, since FSDP2 averages the gradients over all of them (None when no parameter is a
    DTensor). Supported: FSDP2's layouts, Shard(0) on a 1-D mesh (FSDP) and (Replicate(),
    Shard(0)) on a 2-D mesh (HSDP), every parameter on one mesh. Collective on a 2-D mesh that
    does not span the whole world (it makes the flattened mesh's group)."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return None
    mesh = sharded[0].device_mesh
    for p in sharded:
        if not _layout_ok(p):
            raise ValueError(
                f"{who}: a parameter of shape {tuple(p.shape)} is a DTensor placed {tuple(p.placements)} "
                f"on a {p.device_mesh.ndim}-D mesh; cafin supports FSDP2 (fully_shard) on a 1-D mesh "
                "(placement Shard(0)) or a 2-D replicate x shard mesh (HSDP: (Replicate(), Shard(0))) only")
        if p.device_mesh != mesh:
            raise ValueError(f"{who}: the parameters are sharded over different device meshes; "
                             "cafin needs every parameter on one mesh")
    return mesh_group(mesh)


def mesh_group(mesh):
    """The process group of every rank of `mesh` (statistics are averaged over it)."""
    import torch.distributed as dist
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()


def shard_dim(p) -> int:
    """The mesh dimension a DTensor's rows are sharded over (the last one: FSDP2's layouts)."""
    return p.device_mesh.ndim - 1


def shard_group(p):
    """The process group a DTensor's rows are sharded over (HSDP: the shard dimension's)."""
    return p.device_mesh.get_group(shard_dim(p))


def shard_groups(mesh) -> list[list[int]]:
    """The global ranks of each shard group of `mesh` (every replica's; each in shard order)."""
    return mesh.mesh.reshape(-1, mesh.size(mesh.ndim - 1)).tolist()


def rows(p: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows the local shard of `p` holds (all rows if not sharded)."""
    if not isinstance(p, DTensor):
        return 0, p.shape[0] if p.dim() else 1
    dim = shard_dim(p)
    n, shards = p.shape[0], p.device_mesh.size(dim)
    chunk = -(-n // shards)
    start = min(p.device_mesh.get_local_rank(dim) * chunk, n)
    stop = min(start + chunk, n)
    assert stop - start == p.to_local().shape[0], "unexpected FSDP2 shard layout"
    return start, stop


def shard_rows(n: int, shards: int, index: int) -> tuple[int, int]:
    """[start, stop) of the rows of shard `index` of `n` rows split into `shards` (torch.chunk)."""
    chunk = -(-n // shards)
    start = min(index * chunk, n)
    return start, min(start + chunk, n)


def own_rows(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The rows of a full-size tensor that the local shard of `p` holds."""
    start, stop = rows(p)
    return full[start:stop]


def gather_rows(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full tensors of dim-0-sharded DTensors (of one mesh): one all_gather per dtype, within
    the shard group (under HSDP every replica holds the same shards), over one flat buffer that
    holds every shard's padded rows (ceil(n / shards) rows each)."""
    import torch.distributed as dist
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        first = tensors[idx[0]]
        world = first.device_mesh.size(shard_dim(first))
        group = shard_group(first)
        sizes, pieces = [], []
        for i in idx:
            t = tensors[i]
            row = math.prod(t.shape[1:])
            size = -(-t.shape[0] // world) * row
            piece = t.to_local().reshape(-1)
            pieces.append(torch.nn.functional.pad(piece, (0, size - piece.numel())))
            sizes.append(size)
        flat = torch.cat(pieces)
        gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        # all_gather_single is all_gather_into_tensor's newer name
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        gather(gathered, flat, group=group)
        per_rank = gathered.view(world, -1)
        for i, part in zip(idx, per_rank.split(sizes, dim=1)):
            t = tensors[i]
            chunk = -(-t.shape[0] // world)
            out[i] = part.reshape(world * chunk, *t.shape[1:])[: t.shape[0]]
    return out  # type: ignore[return-value]


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    return list(by_dtype.values())


def _shard_layout(t) -> tuple[int, int, object]:
    """(shard count, this rank's shard index, shard group) of a DTensor."""
    dim = shard_dim(t)
    return t.device_mesh.size(dim), t.device_mesh.get_local_rank(dim), shard_group(t)


def _row_numel(t: torch.Tensor, shards: int, index: int) -> int:
    start, stop = shard_rows(t.shape[0], shards, index)
    return (stop - start) * math.prod(t.shape[1:])


def _flat(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not pieces:
        return torch.empty(0, dtype=like.dtype, device=like.device)
    return torch.cat([p.reshape(-1) for p in pieces])


def gather_to_owners(tensors: list[torch.Tensor], owners: list[int]) -> list[torch.Tensor | None]:
    """Each dim-0-sharded DTensor (of one mesh) whole on its owner only: `owners[i]` is the shard
    index (rank within the shard group) that receives tensors[i] whole. Returns the full tensor
    where this rank is the owner, None elsewhere. One all_to_all_single per dtype within the
    shard group (under HSDP every replica does the same within its own): every rank sends its
    rows of each tensor to that tensor's owner and receives, per tensor it owns, every other
    rank's rows; no padding travels."""
    import torch.distributed as dist
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in _by_dtype(tensors):
        first = tensors[idx[0]]
        shards, me, group = _shard_layout(first)
        mine = [i for i in idx if owners[i] == me]
        send = [[local(tensors[i]) for i in idx if owners[i] == dst] for dst in range(shards)]
        send_sizes = [sum(p.numel() for p in ps) for ps in send]
        recv_sizes = [sum(_row_numel(tensors[i], shards, src) for i in mine) for src in range(shards)]
        received = torch.empty(sum(recv_sizes), dtype=first.dtype, device=first.device)
        dist.all_to_all_single(received, _flat([p for ps in send for p in ps], first),
                               recv_sizes, send_sizes, group=group)
        # block src holds, for each tensor this rank owns in order, src's rows of it
        parts = [block.split([_row_numel(tensors[i], shards, src) for i in mine])
                 for src, block in enumerate(received.split(recv_sizes))]
        for k, i in enumerate(mine):
            out[i] = torch.cat([parts[src][k] for src in range(shards)]).view(tensors[i].shape)
    return out


def scatter_from_owners(fulls: list[torch.Tensor | None], tensors: list[torch.Tensor],
                        owners: list[int]) -> list[torch.Tensor]:
    """The inverse of `gather_to_owners`: `fulls[i]` is the full-size tensor on the owner of
    tensors[i] (`owners[i]`; None elsewhere); returns every tensor's rows that the local shard
    holds, shaped as the local shard. One all_to_all_single per dtype within the shard group."""
    import torch.distributed as dist
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in _by_dtype(tensors):
        first = tensors[idx[0]]
        shards, me, group = _shard_layout(first)
        mine = [i for i in idx if owners[i] == me]
        send = [[fulls[i][slice(*shard_rows(tensors[i].shape[0], shards, dst))] for i in mine]
                for dst in range(shards)]
        send_sizes = [sum(p.numel() for p in ps) for ps in send]
        recv_sizes = [sum(local(tensors[i]).numel() for i in idx if owners[i] == src) for src in range(shards)]
        received = torch.empty(sum(recv_sizes), dtype=first.dtype, device=first.device)
        dist.all_to_all_single(received, _flat([p for ps in send for p in ps], first),
                               recv_sizes, send_sizes, group=group)
        for src, block in enumerate(received.split(recv_sizes)):
            theirs = [i for i in idx if owners[i] == src]
            for i, piece in zip(theirs, block.split([local(tensors[i]).numel() for i in theirs])):
                out[i] = piece.view(local(tensors[i]).shape)
    return out  # type: ignore[return-value]


class full_parameters:
    """For a torch optimizer whose update multiplies whole gradient matrices (DyKAF): while the
    context is open, each sharded parameter with a gradient is replaced in the param groups by a
    full-size stand-in whose `.grad` is the full gradient (one all_gather per dtype for all of
    them) and whose own rows are the local shard (the other rows are zeros: the members' final
    apply is row-wise, so they never reach the kept rows); the parameter's state dict is shared
    with its stand-in. On exit the stand-ins' own rows are written back into the local shards.
    The state the optimizer creates is full-size and the same on every rank (replicated)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.swaps: list[tuple[dict, int, torch.Tensor, torch.Tensor]] = []

    def __enter__(self):
        opt = self.optimizer
        where = [(group, i, p) for group in opt.param_groups for i, p in enumerate(group["params"])
                 if isinstance(p, DTensor) and p.grad is not None]
        if not where:
            return self
        grads = gather_rows([p.grad for _, _, p in where])
        for (group, i, p), grad in zip(where, grads):
            with torch.no_grad():
                standin = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
                own_rows(standin, p).copy_(p.to_local())
            standin.grad = grad
            opt.state[standin] = opt.state[p]
            group["params"][i] = standin
            self.swaps.append((group, i, p, standin))
        return self

    def __exit__(self, *exc) -> None:
        opt = self.optimizer
        for group, i, p, standin in self.swaps:
            group["params"][i] = p
            opt.state[p] = opt.state.pop(standin)
            with torch.no_grad():
                p.to_local().copy_(own_rows(standin, p))
        self.swaps.clear()
