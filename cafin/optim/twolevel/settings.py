"""Two-level K-FAC's settings and construction: the published constants, the argument checks,
which layers are preconditioned (checked, one param group each), the op modules (`Route`), the
0-dim hyperparameter tensors and the step schedule (k, rho and the T_cov/T_inv gates)."""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from ...core import check_int, discover, distributed, route
from ...core.views import view_of
from ...core.route import Route
from ...core.distribution.sharding import is_sharded, module_class
from ..kfac.compat import AssignmentStrategy, as_enum

COARSE_SPACES = ("nicolaides", "spectral", "residual", "tpselepedis")
_ALIASES = {"tselepidis": "tpselepedis"}
_EIG_FLOOR = 1e-12   # published: eigenvalues <= this are set to 0 (then divided by: inf)
_NORM_EPS = 1e-8     # published: r / (||r||_inf + 1e-8)
_EIGEN = ("L_x", "Q_x", "L_g", "Q_g")
_STATE = ("x", "gy", "num_locations", "xxt", "ggt", *_EIGEN)  # a layer's state, all or nothing
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# the kernel that writes the gradients (K-FAC's), the op a Route probes for the device
_KERNEL = "kfac_precondition_apply_"
# The views of the layers two-level K-FAC preconditions (transformers' Conv1D: a Linear with its
# weight stored transposed, [in, out]).
_PUBLISHED = ("Linear", "Conv2d", "Conv1D")


def _accept(module: nn.Module) -> bool:
    # The published code registers by exact class name, so subclasses are skipped (FSDP2's
    # generated subclass of a sharded module is named by the class it wraps).
    view = view_of(module)
    return (view is not None and view.label in _PUBLISHED
            and module_class(module).__name__ == view.label)


def _refuse_layers_without_curvature(model: nn.Module) -> None:
    """A trained layer that K-FAC has factors for but two-level K-FAC does not (Embedding,
    Conv1d, Conv3d) is an error naming it: its gradient would silently go unpreconditioned."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        view = view_of(module)
        if view is None or not view.kronecker or view.label in _PUBLISHED:
            continue
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        if view.diagonal_input:
            # Its input rows are one-hot: the dense input factor and its eigendecomposition would
            # be num_embeddings x num_embeddings, and a tied output layer adds to its gradient.
            raise ValueError(f"layer '{name}': TwoLevelKFAC does not precondition Embedding layers (their "
                             "input factor would be a dense vocabulary x vocabulary matrix); freeze it "
                             "(requires_grad=False), or build TwoLevelKFAC on the submodules without it "
                             "(e.g. the transformer blocks) so that the torch optimizer steps it with "
                             "its plain gradient")
        raise ValueError(f"layer '{name}': TwoLevelKFAC supports Linear, Conv2d and transformers' Conv1D "
                         f"layers only, not {kind} (the published coarse space is built for them); freeze "
                         "it (requires_grad=False) or use KFACPreconditioner, which supports it")


class Settings:
    """TwoLevelKFAC's arguments, layers, op modules and schedule (a part of the class)."""

    def _check_arguments(self, *, pi, T_cov, T_inv, constraint_norm, batch_size, coarse_space, krylov,
                         backend, published_bugs, process_group, distribute_decompositions,
                         assignment_strategy, colocate_factors) -> None:
        self.pi = bool(pi)  # published: read by a branch that is never taken (no effect)
        self.T_cov = check_int(T_cov, "T_cov", 1)
        self.T_inv = check_int(T_inv, "T_inv", 1)
        self.constraint_norm = bool(constraint_norm)
        self.batch_size = check_int(batch_size, "batch_size", 1)
        known = (*COARSE_SPACES, "none")
        if not isinstance(coarse_space, str) or _ALIASES.get(coarse_space, coarse_space) not in known:
            raise ValueError(f"coarse_space must be one of {list(COARSE_SPACES)}, 'tselepidis' or 'none', "
                             f"got {coarse_space!r}")
        self.coarse_space = _ALIASES.get(coarse_space, coarse_space)
        self.krylov = bool(krylov)
        if self.krylov and self.coarse_space in ("spectral", "tpselepedis", "none"):
            raise ValueError(f"krylov=True is defined for coarse_space 'nicolaides' or 'residual' only, "
                             f"got coarse_space={coarse_space!r}")
        # `backend` decides how F_c is assembled; the gradients are written by K-FAC's kernel
        # under either (`_kernels`, `_choose_writer`)
        self._route = Route(backend, "TwoLevelKFAC", _KERNEL)
        self._kernels = Route("fused", "TwoLevelKFAC", _KERNEL)
        self.backend = backend
        self.published_bugs = bool(published_bugs)
        if process_group is not None and not distributed():
            raise ValueError("process_group given but torch.distributed is not initialised")
        self.process_group = process_group
        if not isinstance(distribute_decompositions, bool):
            raise TypeError("distribute_decompositions must be a bool, got "
                            f"{type(distribute_decompositions).__name__}")
        if not isinstance(colocate_factors, bool):
            raise TypeError(f"colocate_factors must be a bool, got {type(colocate_factors).__name__}")
        self.distribute_decompositions = distribute_decompositions
        self.assignment_strategy = as_enum(assignment_strategy, AssignmentStrategy, "assignment_strategy")
        self.colocate_factors = colocate_factors
    def _register_layers(self, model: nn.Module) -> list[dict[str, Any]]:
        """The layers two-level K-FAC preconditions, checked, as one param group each. A layer
        whose parameters are all frozen takes no part (no curvature, no hooks): the published
        code registers it and fails at the step on its missing gradient."""
        _refuse_layers_without_curvature(model)
        self._layers = discover(model, [p for p in model.parameters() if p.requires_grad], _accept)
        if not self._layers:
            raise ValueError("net has no supported layer (Linear, Conv2d, transformers' Conv1D) with "
                             "trainable parameters: TwoLevelKFAC would precondition nothing")
        groups = []
        for layer in self._layers:
            m = layer.module
            if isinstance(m, nn.Conv2d) and m.groups != 1:
                raise ValueError(f"layer '{layer.name}': Conv2d with groups={m.groups} is not supported "
                                 "(the published code supports groups=1 only)")
            named = [("weight", m.weight)] + ([("bias", m.bias)] if m.bias is not None else [])
            frozen = [n for n, p in named if not p.requires_grad]
            if frozen:  # its curvature would need a gradient that is never computed
                raise ValueError(f"layer '{layer.name}': its {frozen[0]} is frozen (requires_grad=False) "
                                 "but the rest of the layer is not: freeze the whole layer (it is then "
                                 "skipped) or none of it")
            shared = [n for n, _ in named if n not in layer.params]
            if shared:
                raise ValueError(f"layer '{layer.name}': its {shared[0]} is shared with an earlier layer "
                                 "(tied parameters are not supported)")
            if m.weight.dtype not in _FLOATS:
                raise TypeError(f"layer '{layer.name}': weight dtype {m.weight.dtype} is not supported "
                                "(float16, bfloat16, float32, float64)")
            params = [p for _, p in named]
            if self._sharded and any(not is_sharded(p) for p in params):
                # its gradient would be this rank's own (FSDP2 averages only what it shards)
                raise ValueError(f"layer '{layer.name}' is not sharded while other layers are (FSDP2): "
                                 "TwoLevelKFAC needs every Linear, Conv2d and Conv1D layer under fully_shard "
                                 "(wrap the root too)")
            groups.append({"params": params, "layer_type": module_class(m).__name__})
        return groups

    def _choose_writer(self) -> ModuleType:
        """The op module that writes the gradients, chosen once: K-FAC's kernel where the build
        has one for every layer (float32/float64 layers on one device), its plain-PyTorch twin
        otherwise (float16/bfloat16 layers, layers on several devices), whatever `backend` says
        about the coarse assembly."""
        weights = [layer.module.weight for layer in self._layers]
        if len({w.device for w in weights}) == 1 and all(self._kernels.runs_kernels(w.device, w.dtype)
                                                        for w in weights):
            return self._kernels.ops(weights[0].device, weights[0].dtype)
        return Route("reference", "TwoLevelKFAC", _KERNEL).ops()

    def _create_ones(self) -> dict[torch.device, torch.Tensor]:
        """The lr K-FAC's gradient-writing op reads (1: two-level's clip has no lr), one per
        device, created now because a compiled step cannot create device state."""
        ones = {}
        for layer in self._layers:
            device = layer.module.weight.device
            if device not in ones:
                ones[device] = torch.ones((), dtype=torch.float64, device=device)
                torch._dynamo.mark_static_address(ones[device], guard=False)
        return ones
    def _hp(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return self._ones[like.device] if name == "one" else self._tensors[like.device][name]

    @property
    def _iteration_counter(self) -> int:
        return self._steps.value()

    @_iteration_counter.setter
    def _iteration_counter(self, k: int) -> None:
        self._steps.load(k)

    def _schedule(self):
        """(k, cov, inv): k and whether this is a T_cov step and a T_inv step. Where the host
        decides, eagerly and under torch.compile alike (a compiled step guards on the phase of k,
        one graph per phase), k is the host's count and cov, inv are bools. Once the counter is
        device gated, k, cov and inv are device tensors: every interval is decided on the
        device."""
        if self._steps.host_due(1) is not None:
            return self._steps.host, self._steps.host_due(self.T_cov), self._steps.host_due(self.T_inv)
        k = self._steps.tensor(self._device())
        return k, torch.remainder(k, self.T_cov) == 0, torch.remainder(k, self.T_inv) == 0

    def _checked(self) -> bool:
        """Whether the host decides this step and may read its results (eager, the counter not
        device gated): statistics and decompositions are then checked on the host (drops,
        retries, warnings) and state entries replaced, not written in place."""
        return route.eager() and self._steps.host_due(1) is not None

    def _rho(self, k, checked: bool):
        """The EMA weight of the old factors and coarse matrix on a T_cov step (published: the
        first statistics set directly, then min(1 - 1/k, alpha)). `checked`: a float, None at
        k = 0; otherwise a device tensor, 0 at k = 0, from the k and alpha tensors (a Python
        alpha would be a constant of a compiled graph)."""
        if checked:
            return None if k == 0 else min(1 - 1 / k, self.alpha)
        kd = self._steps.tensor(self._device()).to(torch.float64)
        alpha = self._tensors[kd.device]["alpha"]
        return torch.where(kd == 0, torch.zeros_like(kd), torch.minimum(1 - 1 / kd, alpha))

    def _device(self) -> torch.device:
        if len(self._tensors) > 1:
            raise RuntimeError("a compiled TwoLevelKFAC step needs every layer on one device, got "
                               f"{sorted(str(d) for d in self._tensors)}")
        return next(iter(self._tensors))

    @property
    def num_layer(self) -> int:
        return len(self._layers)
