"""K-FAC's per-layer state: `_LayerState` (the factors, their statistics and pass counts, the
second-order data), the registration of the supported layers, the stacking of equal-shaped
second-order data, and the lookups over layers the other parts share."""
from __future__ import annotations

import logging
import re
import warnings
from collections import defaultdict

import torch
from torch import nn

from ... import factors
from ...core import Layer, discover
from ...maths import kfac as kfac_maths
from .compat import ComputeMethod


class _LayerState:
    """The tensors of one registered layer."""

    def __init__(self, layer: Layer, factor_dtype: torch.dtype, device: torch.device,
                 eigen: bool, prediv: bool, inv_dtype: torch.dtype) -> None:
        groups, d_a, d_g = factors.factor_sizes(layer.module)
        # An Embedding's A is diagonal: kept as its diagonal [groups, d_a], decomposed as itself.
        diagonal = factors.diagonal_input(layer.module)
        like = dict(dtype=factor_dtype, device=device)
        eye = lambda n: torch.eye(n, **like).expand(groups, n, n).clone()  # noqa: E731
        # the EMA starts from I: kfac-pytorch's first update
        self.A = torch.ones(groups, d_a, **like) if diagonal else eye(d_a)
        self.G = eye(d_g)
        self.stat_A = torch.zeros(groups, d_a, **like) if diagonal else torch.zeros(groups, d_a, d_a, **like)
        self.stat_G = torch.zeros(groups, d_g, d_g, **like)
        # Passes counted per side, in one-element tensors (the ops read 0-dim views): Dynamo
        # traces a captured 0-dim float64 CPU tensor as a Python float, and the AOTAutograd
        # backends (aot_eager, inductor) then drop in-place writes to it, so a compiled forward's
        # count of a float64 model's passes would be lost.
        self.count_A = torch.zeros(1, **like)
        self.count_G = torch.zeros(1, **like)
        # Second-order data, created here so compiled and captured steps find it; it holds the
        # identity preconditioner until the first decomposition.
        inv = dict(dtype=inv_dtype, device=device)
        eye_inv = lambda n: torch.eye(n, **inv).expand(groups, n, n).clone()  # noqa: E731
        if eigen:
            # the eigenbases in row-aligned storage: the fused step's products run faster on it
            basis = lambda n: kfac_maths.aligned_empty((groups, n, n), **inv).copy_(  # noqa: E731
                torch.eye(n, **inv).expand(groups, n, n))
            self.second = {"qg": basis(d_g)} if diagonal else {"qa": basis(d_a), "qg": basis(d_g)}
            if prediv:
                self.second["dgda"] = torch.ones(groups, d_g, d_a, **inv)
            else:
                self.second.update(da=torch.ones(groups, d_a, **inv), dg=torch.ones(groups, d_g, **inv))
        else:
            a_inv = torch.ones(groups, d_a, **inv) if diagonal else eye_inv(d_a)
            self.second = {"a_inv": a_inv, "g_inv": eye_inv(d_g)}
        self.seen = False  # statistics ever taken (a layer whose forward never ran keeps its grad)
        self.decomposed = False  # decomposed at least once by an eager step
        for t in (self.A, self.G, self.stat_A, self.stat_G, self.count_A, self.count_G,
                  *self.second.values()):
            torch._dynamo.mark_static_address(t, guard=False)


class Layers:
    """The layer-registration part of `KFACPreconditioner`."""

    def _register_layers(self, loglevel: int) -> None:
        """Find the supported layers (not skipped, all parameters trained) and create their state."""
        skipped = {id(m) for name, m in self.model.named_modules()
                   if _any_match(name, self.skip_layers) or _any_match(type(m).__name__, self.skip_layers)}
        params = [p for p in self.model.parameters() if p.requires_grad]

        def accept(module):
            return (factors.supports(module) and id(module) not in skipped
                    and next(module.children(), None) is None
                    and all(p.requires_grad for p in module.parameters()))

        self._layers = discover(self.model, params, accept=accept)
        for layer in self._layers:
            why = factors.unsupported_option(layer.module)
            if why is not None:
                raise ValueError(f"KFACPreconditioner: layer '{layer.name}' is an {why}, which K-FAC's "
                                 "factors do not model; skip it with skip_layers")
        if not self._layers:  # as AdaFisher says: a preconditioner that would change nothing
            warnings.warn("KFACPreconditioner: the model has no supported layer (Linear, Conv1d, "
                          "Conv2d, Conv3d, Embedding, transformers' Conv1D) whose parameters are all "
                          "trained and not skipped (skip_layers); no gradient is preconditioned",
                          UserWarning, stacklevel=3)
        self._gathered: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._owners: dict[str, int] | None = None  # FSDP2: each layer's owner (shard index)
        self._owned_now: dict[str, int] = {}  # this step's sharded layers and their owners
        self._state: dict[str, _LayerState] = {}
        log = logging.getLogger(__name__)
        for layer in self._layers:
            dtype = self.factor_dtype or layer.module.weight.dtype
            self._state[layer.name] = _LayerState(
                layer, dtype, layer.module.weight.device, self.compute_method is ComputeMethod.EIGEN,
                self.compute_eigenvalue_outer_product, self.inv_dtype)
            log.log(loglevel, f'Registered name="{layer.name}": {layer.module!r}')

    def _stack_second_order(self) -> None:
        """Layers whose second-order data have equal shapes share one stacked tensor per kind
        (each layer's entries are views of it), so their preconditioning runs as one batched
        product chain without copying the decompositions every step."""
        self._stacks: list[tuple[list[Layer], dict[str, torch.Tensor]]] = []
        groups: dict[tuple, list[Layer]] = defaultdict(list)
        for layer in self._layers:
            st = self._state[layer.name]
            if not st.second:  # preconditioned by other ranks
                continue
            key = (st.A.device, tuple((k, tuple(v.shape[1:])) for k, v in sorted(st.second.items())))
            groups[key].append(layer)
        for members in groups.values():
            if len(members) < 2:
                continue
            states = [self._state[layer.name] for layer in members]
            stacked = {}
            for key in states[0].second:
                joined = torch.cat([st.second[key] for st in states])
                if key in ("qa", "qg"):  # eigenbases stay in row-aligned storage
                    joined = kfac_maths.aligned_empty(joined.shape, dtype=joined.dtype,
                                                      device=joined.device).copy_(joined)
                stacked[key] = joined
                torch._dynamo.mark_static_address(stacked[key], guard=False)
                views = stacked[key].split([st.A.shape[0] for st in states])
                for st, view in zip(states, views):
                    st.second[key] = view
            self._stacks.append((members, stacked))

    @property
    def steps(self) -> int:
        return self._steps.value()

    @property
    def layers(self) -> list[Layer]:
        return list(self._layers)

    def _by_device(self, names=None):
        out: dict[torch.device, list[_LayerState]] = defaultdict(list)
        for layer in self._layers:
            if names is None or layer.name in names:
                st = self._state[layer.name]
                out[st.A.device].append(st)
        return out

    def _module(self, name: str) -> nn.Module:
        return next(layer.module for layer in self._layers if layer.name == name)

    def _live(self, layer: Layer) -> bool:
        return self._state[layer.name].seen

    def memory_usage(self) -> dict[str, int]:
        sizes: dict[str, int] = defaultdict(int)
        for st in self._state.values():
            sizes["a_factors"] += st.A.nbytes
            sizes["g_factors"] += st.G.nbytes
            sizes["a_batch"] += st.stat_A.nbytes
            sizes["g_batch"] += st.stat_G.nbytes
            for key, t in st.second.items():
                sizes["a_inverses" if key in ("qa", "da", "a_inv") else "g_inverses"] += t.nbytes
        sizes["total"] = sum(sizes.values())
        return dict(sizes)


def _any_match(query: str, patterns: list[str]) -> bool:
    return any(re.search(p, query) for p in patterns)
