"""Two-level K-FAC's checkpoints: `state_dict` (torch.optim's, plus a "twolevel" entry with the
step count, the batch size, the coarse matrix and its inverse, and the settings) and
`load_state_dict`, which checks every entry against this optimizer's layers before it replaces
anything. The DCP recipe is in `dcp.py`."""
from __future__ import annotations

from typing import Any

import torch

from ...core.checks import checkpoint_tensor
from ...factors import factor_sizes
from .settings import _STATE


def _checkpoint_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"checkpoint {name} must be an int >= {low}, got {value!r}")
    return value


class Checkpoint:
    """TwoLevelKFAC's state dict and its checked load (a part of the class)."""

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["twolevel"] = {"iteration_counter": self._iteration_counter, "batch_size": self.batch_size,
                          "f_coarse": self.f_coarse, "f_coarse_inv": self.f_coarse_inv,
                          **self._numeric_settings()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this optimizer on this model. Every entry is checked (shapes
        against the layers, dtypes, finiteness, counters, hyperparameters) before anything is
        replaced; the tensors are copied, in the state dtype, onto their layers' devices."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        for key in ("state", "param_groups", "twolevel"):
            if key not in state_dict:
                raise ValueError(f"not a TwoLevelKFAC checkpoint: missing '{key}'" + (
                    " (torch.distributed.checkpoint's get_optimizer_state_dict keeps only 'state' "
                    "and 'param_groups': checkpoint a TwoLevelKFAC with cafin.optim.twolevel's "
                    "twolevel_checkpoint and twolevel_load)" if key == "twolevel" else ""))
        extra, groups, saved_state = state_dict["twolevel"], state_dict["param_groups"], state_dict["state"]
        if not isinstance(extra, dict):
            raise TypeError(f"checkpoint 'twolevel' must be a dict, got {type(extra).__name__}")
        for key in ("iteration_counter", "batch_size", "f_coarse", "f_coarse_inv"):
            if key not in extra:
                raise ValueError(f"checkpoint 'twolevel' has no '{key}'")
        k = _checkpoint_int(extra["iteration_counter"], "iteration_counter", 0)
        batch_size = _checkpoint_int(extra["batch_size"], "batch_size", 1)
        values = {}
        for name in self.settings:  # a checkpoint without a setting keeps ours
            if name in extra:
                self._check_setting(name, extra[name], " (in checkpoint 'twolevel')")
                values[name] = extra[name]
        new_state = self._checked_layer_states(groups, saved_state, batch_size)
        fs = [extra["f_coarse"], extra["f_coarse_inv"]]
        if (fs[0] is None) != (fs[1] is None):
            raise ValueError("checkpoint 'twolevel' must hold both f_coarse and f_coarse_inv, or neither")
        n = len(self._layers) * (2 if self.krylov else 1)
        device = self._layers[0].module.weight.device  # a checkpoint read on the CPU (DCP)
        for j, name in enumerate(("f_coarse", "f_coarse_inv")):
            if fs[j] is not None:
                fs[j] = checkpoint_tensor(fs[j], f"checkpoint {name}", (n, n), dtype=self._work[0], device=device)
        if fs[0] is not None and not new_state:
            raise ValueError("checkpoint has a coarse matrix (f_coarse) but no layer state")
        if not new_state and k > 0:
            raise ValueError(f"checkpoint has no layer state but iteration_counter = {k} > 0")
        # Everything checked: now replace.
        self.state.clear()
        for i, entry in new_state.items():
            self.state[self.param_groups[i]["params"][0]] = entry
        self._iteration_counter = k
        self.batch_size = batch_size
        self.f_coarse, self.f_coarse_inv = fs
        for name, v in values.items():
            self._set(name, v)

    def _checked_layer_states(self, groups, saved_state, batch_size: int) -> dict[int, dict[str, Any]]:
        """The checkpoint's per-layer state, checked against this optimizer's layers: layer
        position -> its state (no entry: a layer before its first step)."""
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self.param_groups):
            raise ValueError(f"checkpoint 'param_groups' must list {len(self.param_groups)} groups (one "
                             f"per layer), got {len(groups) if isinstance(groups, (list, tuple)) else groups!r}")
        anchors = {}  # saved index of a layer's weight -> the layer's position
        for i, (saved, group, layer) in enumerate(zip(groups, self.param_groups, self._layers)):
            params = saved.get("params") if isinstance(saved, dict) else None
            if not isinstance(params, (list, tuple)) or len(params) != len(group["params"]):
                raise ValueError(f"checkpoint param group {i} must hold {len(group['params'])} params "
                                 f"(layer '{layer.name}'), got {params!r}")
            if saved.get("layer_type") != group["layer_type"]:
                raise ValueError(f"checkpoint param group {i} has layer_type {saved.get('layer_type')!r}, "
                                 f"layer '{layer.name}' is a {group['layer_type']}")
            anchors[params[0]] = i
        if not isinstance(saved_state, dict):
            raise TypeError(f"checkpoint 'state' must be a dict, got {type(saved_state).__name__}")
        # an empty entry: a layer before its first step (torch.optim saves one per state it has seen)
        saved_state = {index: st for index, st in saved_state.items() if not (isinstance(st, dict) and not st)}
        for index in saved_state:
            if index not in anchors:
                raise ValueError(f"checkpoint 'state' has an entry for param {index!r}, which is not a "
                                 "layer's weight in this optimizer")
        if saved_state and len(saved_state) != len(self._layers):
            missing = [self._layers[i].name for index, i in anchors.items() if index not in saved_state]
            raise ValueError(f"checkpoint 'state' has no entry for the layers {missing}")
        new_state = {}
        for index, i in anchors.items():
            if index in saved_state:
                new_state[i] = self._checked_layer_state(i, saved_state[index], batch_size)
        return new_state

    def _checked_layer_state(self, i: int, saved, batch_size: int) -> dict[str, Any]:
        layer = self._layers[i]
        where = f"state of layer '{layer.name}'"  # the checks below say "checkpoint" first
        if not isinstance(saved, dict):
            raise TypeError(f"checkpoint {where} must be a dict, got {type(saved).__name__}")
        if set(saved) != set(_STATE):
            raise ValueError(f"checkpoint {where} has the keys {sorted(saved)}, expected {sorted(_STATE)}")
        w = layer.module.weight
        _, d_in, d_out = factor_sizes(layer.module)
        T = _checkpoint_int(saved["num_locations"], f"{where}: num_locations", 1)
        rows = batch_size * T
        shapes = {"x": (rows, d_in), "gy": (rows, d_out), "xxt": (d_in, d_in), "ggt": (d_out, d_out),
                  "L_x": (d_in,), "Q_x": (d_in, d_in), "L_g": (d_out,), "Q_g": (d_out, d_out)}
        entry = {"num_locations": T}
        for key, shape in shapes.items():
            entry[key] = checkpoint_tensor(saved[key], f"checkpoint {where}: {key}", shape,
                                           dtype=self._work[i], device=w.device)
        for key in ("Q_x", "Q_g"):
            # eigh's column-major layout, which a checkpoint (DCP) may not keep: the products
            # then round as they did before the save (a bit-identical resume)
            entry[key] = entry[key].t().contiguous().t()
        return entry
