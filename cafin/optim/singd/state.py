"""SINGD's state: the layers it finds, the tensors each keeps (created eagerly, so that a compiled
or captured step finds them), where they sit in `self.state` and what they are built from.

Per parameter `momentum_buffer`; per layer, in the state of its first optimised parameter, the
parts of K, C (`K.<part>`), their momenta m_K, m_C (alpha1 != 0), the curvature accumulators H_K,
H_C, `H_count` (passes added) and, with cache_preconditioner, the dense products P_K, P_C.
"""
from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from ...core import Hooks, Layer, discover
from ...maths import singd as singd_maths
from .settings import build_settings, check_options, supports, work_dtype
from .structures import Dense, Diagonal, Structure, structure

FACTORS = ("K", "C", "m_K", "m_C", "H_K", "H_C")
MAX_PARTS = 5  # the most parts a structure has (hierarchical)


def layer_params(layer: Layer) -> list[Tensor]:
    """The module's weight and bias (optimised or not: singd's natural gradient uses both)."""
    return [t for t in (getattr(layer.module, n, None) for n in ("weight", "bias")) if t is not None]


class State:
    """The layers and their state tensors (a mixin of `SINGD`)."""

    def _attach(self) -> None:
        """Find the layers, create every state tensor eagerly (a compiled or captured step needs
        them to exist) and hook the layers."""
        group_of = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        layers = discover(self.model, list(group_of), accept=supports)
        for layer in layers:  # before anything is written
            check_options(layer)
        self.remove_hooks()
        self._group_of = group_of
        kept = {id(layer.module): layer.anchor for layer in self._curvature}
        for layer in layers:
            groups = {self._group_of[p] for p in layer.params.values()}
            if len(groups) != 1:
                raise ValueError("Parameters of a layer are in different parameter groups. "
                                 f"Layer: {layer.name} ({layer.module}). Groups: {sorted(groups)}.")
            layer.anchor = kept.get(id(layer.module), layer.anchor)  # its factors stay put
        self._curvature = layers
        if not layers:  # as AdaFisher says
            warnings.warn("SINGD: the model has no optimised parameter in a supported layer "
                          "(Linear, Conv1d, Conv2d, Conv3d, Embedding, transformers' Conv1D); every "
                          "parameter is stepped with its plain gradient", UserWarning, stacklevel=3)
        for layer in layers:
            state = self.state[layer.anchor]
            if "K.0" not in state:
                state.update(self._new_factors(layer))
            self._skipped.counter(layer.anchor.device)
            for dtype in self._dtypes(layer):
                self._one(layer.anchor.device, work_dtype(dtype))
        for group in self.param_groups:
            for p in group["params"]:
                # The op module of the device, decided here once: a compiled step reads this
                # table, not the dispatcher.
                self._op_modules[p.device.type] = (self._route.ops(p.device), self._route.runs_kernels(
                    p.device, work_dtype(p.dtype)))
                self._steps.tensor(p.device)
                self._one(p.device, work_dtype(p.dtype))
                self._no_factors(p.device, work_dtype(p.dtype))
                if "momentum_buffer" not in self.state[p]:
                    # Always kept: momentum is a tensor a schedule may move away from 0.
                    self.state[p]["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format)
        # Groups keep the settings of their first build (a group removed by a rejected
        # add_param_group drops its entry).
        del self._built[len(self.param_groups):]
        self._built += [build_settings(g) for g in self.param_groups[len(self._built):]]
        self._plan = None
        self._layer_params_all = [p for g in self.param_groups for p in g["params"]] + [
            p for layer in layers for p in layer_params(layer)]
        self._hooks = Hooks(self, layers)
        self._ranks_checked = False

    def _ops(self, device: torch.device) -> ModuleType:
        """The op module (cafin.ops or cafin.reference: the same ops) the route gives the device.
        SINGD's kernels take every factor dtype (bf16 storage too), so it is per device."""
        return self._op_modules[device.type][0]

    def _kernels(self, device: torch.device) -> bool:
        """Whether the device runs cafin's kernels (the fused backend, built for the device)."""
        return self._op_modules[device.type][1]

    def _expected_state(self, p: Tensor) -> dict[str, tuple[tuple, torch.dtype]]:
        # Every state tensor exists from construction, in its own dtype (factors keep the
        # preconditioner dtype across checkpoints).
        return {key: (tuple(v.shape), v.dtype) for key, v in self.state[p].items()}

    def _group(self, layer: Layer) -> dict[str, Any]:
        return self.param_groups[self._group_of[layer.anchor]]

    @staticmethod
    def dims(module: nn.Module) -> tuple[int, int]:
        """(d_K, d_C) of a supported layer: input side (bias included), output side."""
        return singd_maths.dims(module)

    def _kinds(self, layer: Layer) -> tuple[type[Structure], type[Structure]]:
        """K's and C's structures: the group's, except an Embedding's K, which is diagonal (its
        one-hot rows have no cross terms: a dense vocabulary-squared K would hold zeros off the
        diagonal, exactly so with kfac_approx "expand")."""
        group = self._group(layer)
        exact = group.get("exact_block_transposes", False)
        sk, sc = (structure(s, exact) for s in group["structures"])
        if isinstance(layer.module, nn.Embedding):
            sk = Diagonal
        return sk, sc

    def _dtypes(self, layer: Layer) -> tuple[torch.dtype, torch.dtype]:
        pd = self._group(layer)["preconditioner_dtype"]
        w = layer.module.weight.dtype
        return (pd[0] or w, pd[1] or w)

    def _new_factors(self, layer: Layer) -> dict[str, Tensor]:
        (sk, sc), (dk, dc) = self._kinds(layer), self._dtypes(layer)
        d_k, d_c = self.dims(layer.module)
        device = layer.anchor.device
        out: dict[str, Tensor] = {}

        def put(prefix, parts):
            for i, t in enumerate(parts):
                out[f"{prefix}.{i}"] = t.contiguous()

        put("K", sk.eye(d_k, dk, device))
        put("C", sc.eye(d_c, dc, device))
        if self._group(layer)["alpha1"] != 0.0:
            put("m_K", sk.zeros(d_k, dk, device))
            put("m_C", sc.zeros(d_c, dc, device))
        put("H_K", sk.zeros(d_k, dk, device))
        put("H_C", sc.zeros(d_c, dc, device))
        out["H_count"] = torch.zeros((), device=device)
        if self._caches(sk):
            out["P_K"] = torch.eye(d_k, device=device).to(dk)
        if self._caches(sc):
            out["P_C"] = torch.eye(d_c, device=device).to(dc)
        return out

    def _parts(self, layer: Layer, prefix: str) -> tuple[Tensor, ...] | None:
        state = self.state[layer.anchor]
        parts = []
        while f"{prefix}.{len(parts)}" in state:
            parts.append(state[f"{prefix}.{len(parts)}"])
        return tuple(parts) if parts else None

    @property
    def skipped_factor_updates(self) -> int:
        """Preconditioner updates dropped because a layer's accumulated H_K or H_C held a NaN
        or inf (reads the device counters: a sync off the CPU)."""
        return self._skipped.total()

    def _caches(self, kind) -> bool:
        """Whether a factor of this structure keeps its dense product (P_K = K K^T)."""
        return self.cache_preconditioner and kind is Dense

    def _no_factors(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """An empty tensor of the device and dtype, kept: the factors the diagonal step op is
        given for a parameter stepped with its plain update."""
        key = (device, dtype)
        if key not in self._empty:
            self._empty[key] = torch.empty(0, device=device, dtype=dtype)
        return self._empty[key]

