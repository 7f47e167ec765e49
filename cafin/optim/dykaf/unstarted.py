"""DyKAF's checkpoint entry of a parameter whose state is not built yet (its first usable gradient
has not come): every key and tensor its state will have, zeros, with `step` None.

DyKAF builds a parameter's state from its first gradient, so a fresh optimizer has none. A state
dict that is the template of `torch.distributed.checkpoint.load` (the main recipe:
`get_optimizer_state_dict` of a fresh optimizer, `dcp.load`, `set_optimizer_state_dict`) needs
the saved entry's keys and tensor shapes to load into: DCP fills only what the template holds.
With this entry in every `state_dict()`, a saved parameter and its fresh twin hold the same keys
and shapes whether they were started or not; `step` None (a non-tensor leaf, which DCP replaces
by the saved value) tells `load_state_dict` that the entry was never started, in the checkpoint
or because nothing filled it.
"""
from __future__ import annotations

from typing import Any

import torch

from ...maths import state_dtype


def factor_sizes(opt, p: torch.Tensor, group: dict[str, Any], kind: str) -> list[int | None]:
    """The size of each mode's factor that DyKAF's first step builds for `p` (None: that mode is
    not preconditioned), as `DyKAF._first_factors` builds them."""
    limit = group["max_precond_dim"]
    if kind == "kron2d":
        return [None if d > limit else d for d in p.shape]
    if kind == "kron4d":
        return list(p.shape)
    if p.dim() == 1 and not group["precondition_1d"]:
        return [None]
    merged = opt._merged_shape(p, group)
    return [None if d > limit else d for d in (p.shape if merged is None else merged)]


def unstarted_entry(opt, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
    """The entry of `p` (a parameter of `group`) that has no state: the keys, in the order the
    first step writes them, and zeros of the shapes and dtypes its state will have; `step` None."""
    work = state_dtype(p.dtype)
    device = p.device
    kind = opt._kind(p, group)
    beta = float(group["shampoo_beta"])
    entry: dict[str, Any] = {
        "step": None,
        "device_step": torch.zeros((), dtype=torch.float64, device=device),
        "precondition_frequency": group["precondition_frequency"],
        "shampoo_beta": beta if beta >= 0 else float(group["betas"][1]),
        "exp_avg": torch.zeros(p.shape, dtype=work, device=device),
        "kind": kind,
    }
    if kind == "kron2d" and opt.adam_rank_one:
        entry["l"] = torch.zeros(p.shape[:1], dtype=work, device=device)
        entry["r"] = torch.zeros(p.shape[1:], dtype=work, device=device)
    else:
        entry["exp_avg_sq"] = torch.zeros(p.shape, dtype=work, device=device)
    sizes = factor_sizes(opt, p, group, kind)
    for key in ("factors", "bases"):
        entry[key] = [None if d is None else torch.zeros(d, d, dtype=work, device=device)
                      for d in sizes]
    if opt._route.fused and kind == "kron2d" and None not in sizes:
        entry["exp_avg_rot"] = torch.zeros(p.shape, dtype=work, device=device)
        entry["exp_avg_rot_step"] = -1
    return entry


def check_unstarted(where: str, saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """A saved entry with `step` None must be this parameter's unstarted entry: the same keys,
    kind and factor layout (a mismatch means the checkpoint belongs to another model or
    settings), its device count 0."""
    if set(saved) != set(expected):
        raise ValueError(f"{where} has step None (not started) and keys {sorted(map(str, saved))}, "
                         f"expected {sorted(expected)}")
    count = saved["device_step"]
    if not isinstance(count, torch.Tensor) or count.numel() != 1 or float(count) != 0:
        raise ValueError(f"{where} has step None (not started) and device_step {count!r}, expected 0 "
                         "(a started state has a step)")
    if saved["kind"] != expected["kind"]:
        raise ValueError(f"{where} has step None (not started) and kind {saved['kind']!r}, "
                         f"expected {expected['kind']!r} for this parameter")
    for key in ("factors", "bases"):
        value = saved[key]
        layout = [None if f is None else tuple(f.shape) for f in expected[key]]
        got = ([None if f is None else tuple(getattr(f, "shape", ())) for f in value]
               if isinstance(value, (list, tuple)) else value)
        if got != layout:
            raise ValueError(f"{where} has step None (not started) and {key} of shapes {got}, "
                             f"expected {layout}")
