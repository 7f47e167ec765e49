"""Collectives the members share: whether torch.distributed is up, and one all_reduce over one
flat buffer (over the parameters' FSDP2 mesh when they are sharded: `cafin.core.distribution.sharding` holds what
the members share for `fully_shard`)."""
from __future__ import annotations

import torch


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def average_over_ranks(tensors: list[torch.Tensor], group=None, *, summed: bool = False) -> None:
    """Average (or sum) tensors of any shapes over the ranks of `group` in one collective over
    one flat buffer."""
    import torch.distributed as dist
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if not summed:
        flat.div_(dist.get_world_size(group))
    pieces = [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    torch._foreach_copy_(tensors, pieces)
