"""DyKAF's checkpoints: `state_dict()` (the host step read from the device count, an unstarted
entry for every parameter without state: unstarted.py) and the checks `load_state_dict` runs on
every saved entry before it replaces anything (kind, keys, shapes, finite values, counts)."""
from __future__ import annotations

from typing import Any

import torch

from ...core import Int, Real
from ...core.checks import checkpoint_tensor
from ...maths import state_dtype
from .unstarted import check_unstarted, unstarted_entry
from .update import _FOLLOWS_DEVICE_STEP

_KINDS = ("kron2d", "kron4d", "ema")


class Checkpoint:
    """The checkpoint methods of `DyKAF` (a mixin: it reads the optimizer's settings and state)."""

    def _groups_changed(self) -> None:
        self._hold_every_parameter()

    def _loaded(self, record: Any) -> None:
        self._hold_every_parameter()

    def _hold_every_parameter(self) -> None:
        """An entry in `self.state` for every parameter, empty until its first step: an optimizer
        with state is one that torch.distributed.checkpoint's get/set_optimizer_state_dict do not
        step with zero gradients to create state (such a step would build the state of "eps"
        starts from a zero gradient, and change the run)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state.setdefault(p, {})

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout; `step` is read from `device_step` (compiled steps advance only
        the device count), one host read per parameter at checkpoint time. A parameter that
        requires grad and has no state yet has its unstarted entry (`step` None, zeros of its
        state's shapes: cafin.optim.dykaf.unstarted), so that the state dict of a fresh optimizer
        is a template that torch.distributed.checkpoint can load a saved one into."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # not the live dicts
        for st in sd["state"].values():
            if "device_step" in st:
                st["step"] = int(st["device_step"].item())
            if st.get("exp_avg_rot_step") == _FOLLOWS_DEVICE_STEP:
                due = st["step"] % st["precondition_frequency"] == 0
                st["exp_avg_rot_step"] = -1 if due else st["step"]
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and "step" not in self.state.get(p, {}):
                    sd["state"][index] = unstarted_entry(self, p, group)
                index += 1
        sd["state"] = {k: v for k, v in sorted(sd["state"].items()) if v}  # frozen: none
        return sd

    def _checked_layout(self, where: str, p: torch.Tensor, saved: dict[str, Any],
                        group: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
        """A saved state's kind, checked against the parameter's shape and its group's
        merge_dims, and its keys against the kind; returns (kind, the modes its factors cover)."""
        kind = saved.get("kind")
        if not isinstance(kind, str) or kind not in _KINDS:
            raise ValueError(f"{where}: kind must be one of {', '.join(map(repr, _KINDS))}, got {kind!r}")
        merged = self._merged_shape(p, group)
        if kind != "ema" and (p.dim() != {"kron2d": 2, "kron4d": 4}[kind] or merged is not None):
            raise ValueError(f"{where}: kind {kind!r} does not fit a parameter of shape "
                             f"{tuple(p.shape)}" + (" with merge_dims" if merged is not None else ""))
        modes = tuple(p.shape) if merged is None else merged
        moments = {"l", "r"} if kind == "kron2d" and "l" in saved else {"exp_avg_sq"}
        required = {"step", "device_step", "precondition_frequency", "shampoo_beta", "exp_avg",
                    "kind", "factors", "bases"} | moments
        optional = {"exp_avg_rot", "exp_avg_rot_step"} if kind == "kron2d" else set()
        keys = set(saved)
        if not required <= keys or keys - required - optional:
            raise ValueError(f"{where} has keys {sorted(map(str, keys))}, expected "
                             f"{sorted(required)}" + (f" (and optionally {sorted(optional)})"
                                                      if optional else ""))
        return kind, modes

    def _checkpoint_entry(self, index, p: torch.Tensor, saved: dict[str, Any],
                          group: dict[str, Any]) -> dict[str, Any]:
        """The validated copy of one parameter's saved state (the core calls this for every
        parameter before it replaces anything). Checked against the parameter and its group's
        settings as loaded: the kind, the keys it needs, every tensor's shape (factors and bases
        against the parameter's modes, or its merged shape), that it is real and finite (moments
        also >= 0), the counts. Tensors are copied onto the parameter's device in its state
        dtype."""
        if not saved:
            return {}  # a parameter that waits for a usable first gradient
        where = f"checkpoint state of parameter {index}"
        if "step" in saved and saved["step"] is None:  # its unstarted entry: no state yet
            check_unstarted(where, saved, unstarted_entry(self, p, group))
            return {}
        kind, modes = self._checked_layout(where, p, saved, group)
        work = state_dtype(p.dtype)

        def tensor(key, shape, dtype=work, nonnegative=False):
            return checkpoint_tensor(saved[key], f"{where}: {key}", shape, dtype=dtype, device=p.device,
                                     nonnegative=nonnegative)

        def setting(key, rule):
            rule.check(saved[key], f"{where}: {key}")
            return saved[key]

        entry: dict[str, Any] = {"kind": kind}
        entry["step"] = step = setting("step", Int(0))
        entry["precondition_frequency"] = setting("precondition_frequency", Int(1))
        entry["shampoo_beta"] = float(setting("shampoo_beta", Real(0.0, 1.0)))
        entry["device_step"] = tensor("device_step", (), torch.float64)
        if float(entry["device_step"]) != step:
            raise ValueError(f"{where}: device_step {float(entry['device_step'])} is not step {step}")
        entry["exp_avg"] = tensor("exp_avg", p.shape)
        if kind == "kron2d" and "l" in saved:
            entry["l"] = tensor("l", p.shape[:1], nonnegative=True)
            entry["r"] = tensor("r", p.shape[1:], nonnegative=True)
        else:
            entry["exp_avg_sq"] = tensor("exp_avg_sq", p.shape, nonnegative=True)
        entry.update(_checked_factors(where, saved, kind, modes, work, p.device))
        if "exp_avg_rot" in saved:
            entry["exp_avg_rot"] = tensor("exp_avg_rot", p.shape)
        if "exp_avg_rot_step" in saved:
            rot_step = setting("exp_avg_rot_step", Int(-1, step))
            if rot_step != -1 and "exp_avg_rot" not in saved:
                raise ValueError(f"{where}: exp_avg_rot_step {rot_step} without exp_avg_rot")
            # A cache of an earlier step than the last (kept while another backend stepped)
            # is none: the step reads "not -1" as "the last step's" (update.py)
            entry["exp_avg_rot_step"] = rot_step if rot_step == step else -1
        return {key: entry[key] for key in saved}  # the saved order


def _checked_factors(where: str, saved: dict[str, Any], kind: str, modes: tuple[int, ...],
                     dtype: torch.dtype, device: torch.device) -> dict[str, list]:
    """A saved state's factors and bases: one [d, d] tensor or None per mode, None for the same
    modes in both (a kron4d state has all four)."""
    out: dict[str, list] = {}
    for key in ("factors", "bases"):
        value = saved[key]
        if not isinstance(value, (list, tuple)) or len(value) != len(modes):
            raise ValueError(f"{where}: {key} must be a list of {len(modes)} entries (one per "
                             f"mode of {modes}), got {type(value).__name__} "
                             f"{len(value) if isinstance(value, (list, tuple)) else ''}".rstrip())
        out[key] = [None if x is None else
                    checkpoint_tensor(x, f"{where}: {key}[{k}]", (d, d), dtype=dtype, device=device)
                    for k, (x, d) in enumerate(zip(value, modes))]
    if [f is None for f in out["factors"]] != [b is None for b in out["bases"]]:
        raise ValueError(f"{where}: factors and bases must be None for the same modes")
    if kind == "kron4d" and any(f is None for f in out["factors"]):
        raise ValueError(f"{where}: a kron4d state needs all four factors")
    return out
