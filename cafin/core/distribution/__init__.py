"""Work over ranks, for every member: one place that each member's own distribution file calls.

- `collectives.py`: `distributed` (torch.distributed is initialised) and `average_over_ranks`
  (one collective over one flat buffer, over the parameters' FSDP2 mesh when they are sharded).
- `kaisa.py`: KAISA's assignment of the decompositions to ranks by cost (K-FAC), the greedy
  owner assignment (two-level K-FAC, SINGD, DyKAF) and `exchange`, the results shared back.
- `sharding.py`: FSDP2 and HSDP: the statistics' group (`check_sharded`), a shard's rows,
  gradients gathered to one owner rank and rows scattered back, the checkpoint helpers.
"""
