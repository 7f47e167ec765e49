"""Two-level K-FAC's recipe for torch.distributed.checkpoint (DCP): what to save beside the
optimizer's state dict, and how to read it back, for a `TwoLevelKFAC` whose ranks hold their own
per-sample statistics (`cafin.optim.twolevel.twolevel_checkpoint`, `twolevel_load`)."""
from __future__ import annotations

# TwoLevelKFAC's per-sample statistics of the last curvature step: each rank's own batch, so
# they are saved under a key of each rank (DCP would keep one rank's copy of a plain tensor).
_RANK_LOCAL = ("x", "gy")


def twolevel_checkpoint(optimizer, group=None) -> dict:
    """The entries to add to a DCP checkpoint for a TwoLevelKFAC (`optimizer.state_dict()`,
    which `get_optimizer_state_dict` would cut to `state` and `param_groups`): "twolevel" holds
    what every rank holds alike (factors, eigenbases, coarse matrix, step count), and
    "twolevel_rank{r}" the rank's own per-sample statistics (read again by the residual coarse
    space's Fisher products between curvature steps). Load with `twolevel_load`."""
    import torch.distributed as dist
    sd = optimizer.state_dict()
    state, own = {}, {}
    for idx, st in sd["state"].items():
        state[idx] = {k: v for k, v in st.items() if k not in _RANK_LOCAL}
        own[idx] = {k: st[k] for k in _RANK_LOCAL if k in st}
    group = optimizer.process_group if group is None else group
    return {"twolevel": {**sd, "state": state}, f"twolevel_rank{dist.get_rank(group)}": own}


def saved_ranks(checkpoint_id) -> int:
    """How many ranks saved their own statistics into a DCP checkpoint (a directory) holding
    `twolevel_checkpoint`: the world size it was saved at."""
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    return len({key.split(".")[0] for key in keys if key.startswith("twolevel_rank")})


def twolevel_load(optimizer, checkpoint_id, group=None) -> None:
    """Resume a TwoLevelKFAC from a DCP checkpoint holding `twolevel_checkpoint(optimizer)`.
    Its state is created by the first steps, so a fresh optimizer's state dict is no template
    for `dcp.load`: the entries are read whole (the replicated one and this rank's own).

    On another world size (resharding) rank r reads the statistics of saved rank r mod W (W the
    saved world size): the statistics are samples of a batch, which no rule can split or merge
    exactly, and a copy keeps every rank's shapes and the average over ranks of what they feed
    (the residual coarse space's Fisher products between curvature steps) exact when the new
    world size is a multiple of W. The next curvature step replaces them with the rank's own."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    group = optimizer.process_group if group is None else group
    world = saved_ranks(checkpoint_id)
    key = f"twolevel_rank{dist.get_rank(group) % max(world, 1)}"
    saved = _load_state_dict_from_keys({"twolevel", key}, checkpoint_id=checkpoint_id)
    sd = saved["twolevel"]
    # DCP gives the state's parameter indices back as strings
    sd["state"] = {int(idx): st for idx, st in sd["state"].items()}
    for idx, st in saved.get(key, {}).items():
        sd["state"][int(idx)].update(st)
    optimizer.load_state_dict(sd)
