"""K-FAC's checkpoints: `state_dict` / `load_state_dict` in kfac-pytorch's layout (everything
checked before anything changes), and the recipe for torch.distributed.checkpoint (DCP): a state
dict to load a saved `KFACPreconditioner` into."""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch

from ...core import check_int
from ...core.checks import checkpoint_tensor


class Checkpoint:
    """The checkpoint part of `KFACPreconditioner`."""

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """kfac-pytorch's layout: steps, the non-callable hyperparameters and, per layer name,
        its factors 'A' and 'G' ([d, d]; [groups, d, d] for grouped convolutions)."""
        sd: dict[str, Any] = {"steps": self.steps}
        if not callable(self._factor_update_steps):
            sd["factor_update_steps"] = self._factor_update_steps
        if not callable(self._inv_update_steps):
            sd["inv_update_steps"] = self._inv_update_steps
        for name in self.settings:
            if not callable(self._values[name]):
                sd[name] = self._values[name]
        if include_factors:
            sd["layers"] = {}
            for layer in self._layers:
                st = self._state[layer.name]
                A, G = st.A, st.G
                if A.shape[0] == 1:
                    A, G = A[0], G[0]
                sd["layers"][layer.name] = {"A": A.detach().clone() if st.seen else None,
                                            "G": G.detach().clone() if st.seen else None}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Load a state_dict of this class or of kfac-pytorch; checks everything (steps, intervals,
        hyperparameters, every factor's type, shape and finiteness) before changing anything,
        copies the factors onto the layers' devices in their dtype, leaves `state_dict`
        unchanged."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if "steps" not in state_dict:
            raise ValueError("not a KFACPreconditioner state_dict: missing 'steps'")
        steps = _checkpoint_steps(state_dict["steps"])
        for key in ("factor_update_steps", "inv_update_steps"):
            if key in state_dict:
                check_int(state_dict[key], f"state_dict['{key}']", 1)
        for name in self.settings:
            if name in state_dict:
                self._check_setting(name, state_dict[name], " (in state_dict)")
        layers = state_dict.get("layers")
        new = {}
        if layers is not None:
            if not isinstance(layers, Mapping):
                raise TypeError(f"state_dict['layers'] must be a dict, got {type(layers).__name__}")
            mine = {layer.name for layer in self._layers}
            if len(layers) != len(self._layers) or set(layers) != mine:
                raise ValueError(f"state_dict has layers {sorted(layers)}, this preconditioner "
                                 f"has {sorted(mine)}")
            for name, saved in layers.items():
                if not isinstance(saved, Mapping) or "A" not in saved or "G" not in saved:
                    raise KeyError(f"the state of layer '{name}' must be a dict with keys 'A' and 'G'")
                st = self._state[name]
                new[name] = [_checkpoint_factor(saved[key], own, f"factor {key} of layer '{name}'")
                             for key, own in (("A", st.A), ("G", st.G))]
        # Everything is checked: from here on nothing raises on the checkpoint's account.
        self._steps.load(steps)
        for key in ("factor_update_steps", "inv_update_steps"):
            if key in state_dict:
                setattr(self, "_" + key, state_dict[key])
        for name in self.settings:
            if name in state_dict:
                self._set(name, state_dict[name])
        self._stale = True
        self._refresh_settings(quiet=True)
        for name, (A, G) in new.items():
            st = self._state[name]
            if A is not None:
                st.A.copy_(A)
            if G is not None:
                st.G.copy_(G)
            st.seen = st.seen or A is not None or G is not None
        if layers is None and compute_inverses:
            warnings.warn("Layer factors are not included in the state_dict so inverses cannot "
                          "be computed. Skipping inverse computation.", stacklevel=2)
            compute_inverses = False
        if compute_inverses:  # local: every factor of the layers this rank preconditions
            self._decompose(None, self._my_sides(share=False))
            for layer in self._layers:  # the others are decomposed by their gradient workers
                st = self._state[layer.name]
                st.decomposed = st.decomposed or (st.seen and not self.assignment.is_grad_worker(layer.name))


def _checkpoint_steps(value: Any) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"state_dict['steps'] must be an int >= 0, got {value!r}")
    return value


def _checkpoint_factor(t: Any, own: torch.Tensor, what: str) -> torch.Tensor | None:
    """A saved factor ([d, d] or [groups, d, d]; an Embedding's diagonal A [d] or [groups, d]) in
    the preconditioner's shape, checked: a floating tensor of that shape, every entry finite.
    None: no statistics yet."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor) and t.dim() == own.dim() - 1:
        t = t.unsqueeze(0)
    return checkpoint_tensor(t, f"state_dict {what}", own.shape)


def kfac_checkpoint_template(preconditioner) -> dict:
    """`preconditioner.state_dict()` (a KFACPreconditioner) with a tensor for every layer's
    factors, to `torch.distributed.checkpoint.load` into: a fresh preconditioner has None there
    (no statistics yet), and DCP loads a saved tensor only into a tensor. Then
    `preconditioner.load_state_dict(template)`. Save after the first factor update, so that every
    layer's factors are tensors in the checkpoint too."""
    sd = preconditioner.state_dict()
    for name, entry in sd.get("layers", {}).items():
        st = preconditioner._state[name]
        for key, own in (("A", st.A), ("G", st.G)):
            if entry[key] is None:
                entry[key] = (own[0] if own.shape[0] == 1 else own).detach().clone()
    return sd
