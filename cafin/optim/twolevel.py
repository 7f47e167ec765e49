"""Two-level K-FAC (Koroko et al., arXiv 2303.18083; `TwolevelKFAC` of Abdoulaye-Koroko/natural-gradients).

K-FAC's block-diagonal direction plus a coarse-space correction that couples the layers:

    v_l = F_l^{-1} g_l + y_l r_l,    y = F_c^{-1} (R g),    (R g)_l = <r_l, g_l>,

with one coarse vector r_l per layer (two with `krylov=True`) and F_c the empirical Fisher restricted
to the coarse space, (F_c)_ij = (1/B) sum_n <r_i, G_n,i> <r_j, G_n,j> + damping * |layer i| * [i == j].

Used like the published code: set `update_stats`, call `step(update_params=True)` after backward
(it rewrites every `.grad`), then step a torch optimizer (SGD with momentum). The published
conventions, odd ones included, are kept (docs/twolevel.md lists them). Four published bugs are
fixed unless `published_bugs=True` (docs/twolevel.md says why each is a bug).

How F_c is assembled (`backend`):
- "fused": the per-sample coarse projections of every layer at once, an N x L matrix U, then
  F_c = U^T U / B; a projection <r, g_n x_n^T> is a row-wise bilinear form (never the N' x N'
  matrix gy^T R x of the published code), and for the ones vector (nicolaides, tpselepedis) it is a
  product of row sums.
- "reference": pair by pair, each entry from a Fisher-vector product, as the published code does
  (kept to test the cheap assembly against and to time it).

Intervals follow the core's StepCounter: decided on the host while steps run eagerly, on the
device once a step is compiled (torch.compile(step, fullgraph=True) after one eager step; eigh and
the coarse assembly then sit in torch.cond branches). damping, alpha and clipping are 0-dim
tensors behind properties. Under torch.distributed the batch covariances and, when its vectors
allow, the new coarse matrix are averaged in one collective (docs/twolevel.md, "Data parallel"),
and the decompositions are shared out: each factor's eigendecomposition, and the coarse matrix's
inverse, is made by one owner rank (the greedy assignment of cafin.optim.kaisa, balanced by
cost) and the results reach every rank in one exchange per (device, dtype).
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from ..core import (EigendecompositionWarning, Int, Real, average_over_ranks, capturing, check_int,
                   checked_attribute, discover, distributed, unwrap)
from ..core.modules import is_transposed_linear
from ..core.preconditioner import Preconditioner
from ..factors import factor_sizes, input_rows
from ..maths import state_dtype
from ..maths import kfac as kfac_maths
from ..maths import twolevel as twolevel_maths
from ..sharding import check_sharded, gather_rows, is_sharded, local, module_class, own_rows
from ._docs import _process_group_doc, _published_bugs_doc
from .kaisa import exchange, factor_costs, greedy_assignment
from .kfac_compat import AssignmentStrategy, as_enum

__all__ = ["TwoLevelKFAC", "COARSE_SPACES", "NonFiniteStatisticsWarning", "EigendecompositionWarning"]

COARSE_SPACES = ("nicolaides", "spectral", "residual", "tpselepedis")
_ALIASES = {"tselepidis": "tpselepedis"}
_EIG_FLOOR = 1e-12   # published: eigenvalues <= this are set to 0 (then divided by: inf)
_NORM_EPS = 1e-8     # published: r / (||r||_inf + 1e-8)
_EIGEN = ("L_x", "Q_x", "L_g", "Q_g")
_STATE = ("x", "gy", "num_locations", "xxt", "ggt", *_EIGEN)  # a layer's state, all or nothing
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class NonFiniteStatisticsWarning(UserWarning):
    """A step's statistics (or its new coarse matrix) held inf/NaN: they were dropped and the
    curvature keeps its previous values (`TwoLevelKFAC.dropped_statistics` counts the drops)."""


def _accept(module: nn.Module) -> bool:
    # The published code registers by exact class name, so subclasses are skipped (FSDP2's
    # generated subclass of a sharded module is named by the class it wraps). transformers'
    # Conv1D is a Linear with its weight stored transposed, [in, out].
    name = module_class(module).__name__
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        return name in ("Linear", "Conv2d")
    return name == "Conv1D" and is_transposed_linear(module)


def _refuse_layers_without_curvature(model: nn.Module) -> None:
    """A trained layer that K-FAC has factors for but two-level K-FAC does not (Embedding,
    Conv1d, Conv3d) is an error naming it: its gradient would silently go unpreconditioned."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not isinstance(module, (nn.Embedding, nn.Conv1d, nn.Conv3d)):
            continue
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        if isinstance(module, nn.Embedding):
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


# Why a first step with zero gradients and no forward pass fails: it is what
# get/set_optimizer_state_dict run to create the state of a fresh optimizer.
_DCP_STEP = ("TwoLevelKFAC: step() before any forward pass, with every gradient zero, as "
             "torch.distributed.checkpoint's get_optimizer_state_dict and set_optimizer_state_dict "
             "step a fresh optimizer: its state is made by its first steps, and its coarse matrix "
             "and per-rank statistics are not in the state dict they take. Checkpoint it with "
             "cafin.optim.twolevel_dcp: twolevel_checkpoint(opt) in the saved state, "
             "twolevel_load(opt, checkpoint_id) to resume (docs/distributed.md)")


class TwoLevelKFAC(Preconditioner, torch.optim.Optimizer):
    def __init__(self, net: nn.Module, damping=1e-3, pi=False, T_cov=100, T_inv=100, alpha=0.95,
                 constraint_norm=False, clipping=1e-2, batch_size=64, coarse_space="nicolaides",
                 krylov=False, *, backend="fused", published_bugs=False, process_group=None,
                 distribute_decompositions=True, assignment_strategy="compute", colocate_factors=False):
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
        self._init_settings({"damping": damping, "alpha": alpha, "clipping": clipping})
        self._check_arguments(pi=pi, T_cov=T_cov, T_inv=T_inv, constraint_norm=constraint_norm,
                              batch_size=batch_size, coarse_space=coarse_space, krylov=krylov,
                              backend=backend, published_bugs=published_bugs, process_group=process_group,
                              distribute_decompositions=distribute_decompositions,
                              assignment_strategy=assignment_strategy, colocate_factors=colocate_factors)
        model = unwrap(net)
        # FSDP2: the statistics hooks see the unsharded call, so the factors and the coarse
        # matrix are DDP's once averaged over the parameters' mesh; the update gathers each
        # layer's full gradient (one all_gather per step) and each rank keeps its own rows.
        mesh_group = check_sharded(model.parameters(), "TwoLevelKFAC")
        self._sharded = mesh_group is not None
        if process_group is None:
            self.process_group = mesh_group
        super().__init__(self._register_layers(model), {})
        self.update_stats = False
        # factors, statistics and decompositions: float32 for float16/bfloat16 layers (eigh has
        # no half-precision kernels, and their EMAs would lose the small updates)
        self._work = [state_dtype(layer.module.weight.dtype) for layer in self._layers]
        self._writer = self._choose_writer()
        self.dropped_statistics = 0  # steps whose statistics (or coarse matrix) were non-finite
        self._sizes: dict[tuple, torch.Tensor] = {}
        self._scalings: dict[int, tuple] = {}  # eager: layer -> its kept `_scaling`
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # eager: layer -> `_product_buffers`
        self._constant_vectors: dict[tuple, torch.Tensor] = {}  # eager: nicolaides' vectors
        self._ones = self._create_ones()
        self.f_coarse = None
        self.f_coarse_inv = None
        # per layer: {"calls": one dict per forward call since the last step, "task": the
        # backward pass that delivered the latest output gradient}
        self._pending: dict[int, dict[str, Any]] = {}
        self._assign_work()
        # k, the completed update steps: on the host while steps run eagerly, on the device (and
        # every interval decided there) once a step is compiled; the hooks
        self._start(self._layers)

    def _check_arguments(self, *, pi, T_cov, T_inv, constraint_norm, batch_size, coarse_space, krylov,
                         backend, published_bugs, process_group, distribute_decompositions,
                         assignment_strategy, colocate_factors) -> None:
        self.pi = bool(pi)  # published: read by a branch that is never taken (no effect)
        self.T_cov = check_int(T_cov, "T_cov", 1)
        self.T_inv = check_int(T_inv, "T_inv", 1)
        self.constraint_norm = bool(constraint_norm)
        self.batch_size = check_int(batch_size, "batch_size", 1)
        if not isinstance(coarse_space, str) or _ALIASES.get(coarse_space, coarse_space) not in (*COARSE_SPACES, "none"):
            raise ValueError(f"coarse_space must be one of {list(COARSE_SPACES)}, 'tselepidis' or 'none', "
                             f"got {coarse_space!r}")
        self.coarse_space = _ALIASES.get(coarse_space, coarse_space)
        self.krylov = bool(krylov)
        if self.krylov and self.coarse_space in ("spectral", "tpselepedis", "none"):
            raise ValueError(f"krylov=True is defined for coarse_space 'nicolaides' or 'residual' only, "
                             f"got coarse_space={coarse_space!r}")
        if backend not in ("fused", "reference"):
            raise ValueError(f"backend must be 'fused' or 'reference', got {backend!r}")
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

    def _assign_work(self) -> None:
        """Under torch.distributed (more than one rank, distribute_decompositions): the owner
        rank of every decomposition, the same on every rank: each layer's two factors (A, the
        input side's, and G) and the coarse matrix's inverse, greedily by cost (KAISA's rule,
        one group of every rank). `assignment` maps layer names to {"A": rank, "G": rank};
        `coarse_worker` is the rank that inverts F_c. Both None: every rank makes every one."""
        self.assignment = self.coarse_worker = None
        self._owners = None  # per layer, the owner ranks of (A, G)
        if not (self.distribute_decompositions and distributed()):
            return
        import torch.distributed as dist
        group = self.process_group
        world = dist.get_world_size(group)
        if world == 1:
            return
        self._rank, self._world = dist.get_rank(group), world
        strategy = self.assignment_strategy.name.lower()
        # layers keyed by position, the coarse inverse by the next one: no name can clash
        work: dict[Any, dict[str, float]] = factor_costs(
            {i: factor_sizes(layer.module) for i, layer in enumerate(self._layers)}, strategy)
        if self.coarse_space != "none":
            n = len(self._layers) * (2 if self.krylov else 1)
            work[len(self._layers)] = {"F_c": float(n ** (3 if strategy == "compute" else 2))}
        owners = greedy_assignment(work, [list(range(world))], world, self.colocate_factors)
        self._owners = [(owners[i]["A"], owners[i]["G"]) for i in range(len(self._layers))]
        self.assignment = {layer.name: {"A": a, "G": g} for layer, (a, g) in zip(self._layers, self._owners)}
        if self.coarse_space != "none":
            self.coarse_worker = owners[len(self._layers)]["F_c"]

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

    def _choose_writer(self):
        """The gradient writer, chosen once: K-FAC's kernel where it has one (float32/float64
        layers on one device), its plain-PyTorch twin otherwise (float16/bfloat16 layers,
        layers on several devices), whatever `backend` says about the coarse assembly."""
        fused = (all(layer.module.weight.dtype in (torch.float32, torch.float64) for layer in self._layers)
                 and len({layer.module.weight.device for layer in self._layers}) == 1)
        return ops if fused else reference

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

    # ------------------------------------------------------------------ hyperparameters
    # damping 0 would leave the factors' zero eigenvalues undamped, and the published
    # eigenvalue floor then divides by 0
    settings = {"damping": Real(0.0, math.inf, low_open=True), "alpha": Real(0.0, 1.0),
                "clipping": Real(0.0, math.inf)}
    # intervals in steps, checked whenever set (the step takes k modulo each)
    T_cov = checked_attribute("T_cov", Int(1))
    T_inv = checked_attribute("T_inv", Int(1))

    def _hp(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return self._ones[like.device] if name == "one" else self._tensors[like.device][name]

    @property
    def _iteration_counter(self) -> int:
        return self._steps.value()

    @_iteration_counter.setter
    def _iteration_counter(self, k: int) -> None:
        self._steps.load(k)

    def _schedule(self):
        """(k, rho, gate_cov, gate_inv). Eager: k and rho on the host, gates None (the host
        decides). Device-gated (compiled): k, rho and the gates are device tensors."""
        if self._steps.host_due(1) is not None:
            k = self._steps.host
            return k, (None if k == 0 else min(1 - 1 / k, self.alpha)), None, None
        k = self._steps.tensor(self._device())
        kd = k.to(torch.float64)
        alpha = self._tensors[k.device]["alpha"]
        # published: the first covariances set directly (rho = 0), then rho = min(1 - 1/k, alpha)
        rho = torch.where(kd == 0, torch.zeros_like(kd), torch.minimum(1 - 1 / kd, alpha))
        return k, rho, torch.remainder(k, self.T_cov) == 0, torch.remainder(k, self.T_inv) == 0

    def _device(self) -> torch.device:
        if len(self._tensors) > 1:
            raise RuntimeError("a compiled TwoLevelKFAC step needs every layer on one device, got "
                               f"{sorted(str(d) for d in self._tensors)}")
        return next(iter(self._tensors))

    @property
    def num_layer(self) -> int:
        return len(self._layers)

    # ------------------------------------------------------------------ hooks (core interface)
    def _statistics_gate(self, layer, device):
        # Every pass with update_stats is kept (references only: nothing is computed here);
        # step() uses them on T_cov steps and drops them on the others (published: the hooks
        # store only on T_cov steps, the same numbers). A compiled step thereby always finds them,
        # so its graph does not depend on k. The "step" handed back is this call's own record:
        # the core gives it to both statistics callbacks of the same call when its output
        # gradient arrives, so a layer called twice in one forward pairs each input with its own
        # output gradient, and a call whose output gets none (a validation forward) adds nothing.
        if not self.update_stats:
            return False, None
        # a layer forwarded here whose output then gets no gradient is named at the step
        self._pending.setdefault(id(layer), {"calls": [], "task": None})
        return True, {}

    def take_input_statistics(self, layer, x, call) -> None:
        """Take the statistics of `layer` from its input; its hook calls this."""
        pending = self._pending.setdefault(id(layer), {"calls": [], "task": None})
        task = torch._C._current_graph_task_id()
        if task != pending["task"]:
            # A new backward pass: only the calls it reaches count (accumulated micro-batches, or
            # two losses backpropagated one after the other: the last one's, as in the published
            # code).
            pending["calls"], pending["task"] = [], task
        call["x"] = x.detach()
        pending["calls"].insert(0, call)  # backward reaches a layer's calls last one first

    def take_grad_statistics(self, layer, g, call) -> None:
        """Take the statistics of `layer` from its output gradient; its hook calls this."""
        call["gy"] = g.detach()

    # ------------------------------------------------------------------ per-layer helpers
    def _missing(self, layer, what: str) -> RuntimeError:
        return RuntimeError(f"TwoLevelKFAC: no {what} for layer '{layer.name}' at step "
                            f"{self._iteration_counter}: run forward and backward in train mode with "
                            "update_stats = True before step() on the T_cov steps (step 0 first)")

    def _statistics(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Per layer (rows [B T, d_in (+1)], output gradients [B T, d_out] x B, T) of the pending
        calls that the last backward pass reached, in the state dtype; every layer checked before
        any is returned. Several calls of one layer in one pass are its locations, sample by
        sample (its per-sample gradient sums over them, as over a Conv2d's)."""
        out = []
        for layer, dtype in zip(self._layers, self._work):
            pending = self._pending.get(id(layer))
            calls = pending["calls"] if pending else []
            if pending is None:
                raise RuntimeError(
                    f"TwoLevelKFAC: layer '{layer.name}' was not called in a forward pass with "
                    f"update_stats = True (train mode, grad enabled) before step {self._iteration_counter}; "
                    "the coarse space couples every registered layer, so each one must take part in "
                    "every statistics pass (freeze a layer that does not, and it is skipped)")
            if not calls:
                raise RuntimeError(
                    f"TwoLevelKFAC: layer '{layer.name}' got no output gradient in the last backward pass "
                    f"before step {self._iteration_counter} (its output does not reach the loss)")
            parts = [self._rows(layer, c["x"], c["gy"], dtype) for c in calls]
            if len({rows.shape[0] // T for rows, _, T in parts}) > 1:
                raise ValueError(f"layer '{layer.name}' was called {len(parts)} times in one pass on "
                                 "batches of different sizes: its per-sample gradient is not defined")
            if len(parts) == 1:
                out.append(parts[0])
                continue
            B = parts[0][0].shape[0] // parts[0][2]
            rows, gy = (torch.cat([p[i].reshape(B, p[2], -1) for p in parts], 1).reshape(-1, parts[0][i].shape[1])
                        for i in (0, 1))
            out.append((rows, gy, sum(p[2] for p in parts)))
        return out

    @staticmethod
    def _rows(layer, x, gy, dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(rows [B T, d_in (+1)], output gradients [B T, d_out] x B, T), sample by sample. A
        Linear (or Conv1D) on [B, T..., D] has T locations per sample (the product of the middle
        dims), as a Conv2d has its output positions."""
        # published: grad_output * grad_output.size(0), the per-sample gradient of a mean loss
        m, x, gy = layer.module, x.to(dtype), gy.to(dtype) * gy.shape[0]
        if isinstance(m, nn.Conv2d):
            rows = input_rows(m, x)[0]
            T = gy.shape[-1] * gy.shape[-2]
            gy = gy.reshape(-1, gy.shape[-3], T).transpose(1, 2).reshape(-1, gy.shape[-3])
        else:
            if x.dim() < 2 or x.shape[0] == 0 or x[0].numel() == 0:
                raise ValueError(f"layer '{layer.name}': {type(m).__name__} input must be [batch, ..., "
                                 f"features] with at least one sample and location, got shape {tuple(x.shape)}")
            rows = input_rows(m, x)[0]
            T = rows.shape[0] // x.shape[0]
            gy = gy.reshape(-1, gy.shape[-1])
        if m.bias is not None:
            rows = torch.cat([rows, torch.ones_like(rows[:, :1])], dim=1)
        elif not isinstance(m, nn.Conv2d):
            # a Linear's rows are its input: stored rows are written in place by compiled and
            # captured steps, so they get memory of their own
            rows = rows.clone()
        return rows, gy, T

    def _store(self, stats, gate):
        """Store the statistics; with `gate` (device bool, compiled steps), only where it holds
        and every one of them is finite (a batch of another size replaces them: there is
        nothing to keep it with). Returns the gate the factors are then updated under."""
        if gate is not None:
            finite = torch.stack([torch.isfinite(t).all() for rows, gy, _ in stats for t in (rows, gy)]).all()
            gate = gate & finite
        for (rows, gy, T), group in zip(stats, self.param_groups):
            state = self.state[group["params"][0]]
            if gate is not None and "x" in state and state["x"].shape == rows.shape \
                    and state["gy"].shape == gy.shape:
                # written in place: a compiled or captured step's state keeps its storage
                state["x"].copy_(torch.where(gate, rows, state["x"]))
                state["gy"].copy_(torch.where(gate, gy, state["gy"]))
            else:
                state["x"], state["gy"] = rows, gy
            state["num_locations"] = T
            self.batch_size = int(rows.shape[0] / T)  # published: overwritten at each collection
        return gate

    def _drop(self, what: str) -> None:
        self.dropped_statistics += 1
        warnings.warn(f"TwoLevelKFAC: step {self._iteration_counter}: {what} held inf/NaN and were "
                      "dropped; the curvature keeps its previous values", NonFiniteStatisticsWarning,
                      stacklevel=4)

    @staticmethod
    def _weight_matrix(group, w: torch.Tensor) -> torch.Tensor:
        """A weight gradient as [d_out, d_in]: a view (a Conv1D's [in, out] transposed)."""
        if group["layer_type"] == "Conv1D":
            return w.t()
        return w.reshape(w.shape[0], -1)

    @classmethod
    def _grad_matrix(cls, group, grads=None) -> torch.Tensor:
        """[d_out, d_in (+1)]: the weight gradient with the bias column (`grads`: the full
        gradients gathered under FSDP2 instead of the parameters' own)."""
        w, b = grads if grads is not None else (
            group["params"][0].grad, group["params"][1].grad if len(group["params"]) == 2 else None)
        m = cls._weight_matrix(group, w)
        if b is not None:
            m = torch.cat([m, b.reshape(-1, 1)], dim=1)
        return m

    @classmethod
    def _raw(cls, group, dtype: torch.dtype, grads=None) -> torch.Tensor:
        """The gradient matrix as a tensor of its own in `dtype` (the bias column's
        concatenation is one already: not copied twice)."""
        m = cls._grad_matrix(group, grads)
        own = len(group["params"]) == 2 and (grads is None or grads[1] is not None)
        return m if own and m.dtype == dtype else m.to(dtype, copy=True)

    def _gather(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """FSDP2: every layer's full weight and bias gradients, in one all_gather per dtype (the
        two-level direction multiplies whole gradient matrices and couples the layers)."""
        tensors = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    raise RuntimeError(f"TwoLevelKFAC: a parameter of shape {tuple(p.shape)} has no "
                                       "gradient: run backward before step()")
                tensors.append(p.grad)
        full = iter(gather_rows(tensors))
        return [(next(full), next(full) if len(g["params"]) == 2 else None) for g in self.param_groups]

    @staticmethod
    def _batch_covs(state) -> tuple[torch.Tensor, torch.Tensor]:
        x, gy = state["x"], state["gy"]
        n = float(x.shape[0])
        return x.t() @ x / n, gy.t() @ gy / n

    @staticmethod
    def _covs(state, new, rho, gate) -> None:
        if gate is not None:  # the EMA on the device, kept where the gate holds
            for key, b in zip(("xxt", "ggt"), new):
                old = state[key]
                old.copy_(torch.where(gate, rho * old + (1 - rho) * b, old))
        elif rho is None:
            state["xxt"], state["ggt"] = new
        else:  # new tensors, not in place: a step that raises puts the old ones back
            state["xxt"] = state["xxt"].mul(rho).add(new[0], alpha=1 - rho)
            state["ggt"] = state["ggt"].mul(rho).add(new[1], alpha=1 - rho)

    def _eigen(self, state) -> tuple[torch.Tensor, ...]:
        # published: damping inside the eigendecomposition, tiny eigenvalues zeroed
        out = []
        for f in ("xxt", "ggt"):
            a = state[f]
            damping = self._hp("damping", a)
            lam, vec = torch.linalg.eigh(a + damping * torch.eye(a.shape[0], dtype=a.dtype, device=a.device))
            out += [lam * (lam > _EIG_FLOOR), vec]
        return tuple(out)

    def _decompose(self, states, gate, coarse: bool = False) -> None:
        """Every layer's eigendecompositions (eager: checked, see `_eigen_checked`; under
        torch.distributed each rank makes its share and the results are shared, with the coarse
        matrix's inverse when `coarse`), stored once all are made."""
        if gate is None:
            if self._owners is None:
                new = self._eigen_checked(states)  # every layer's, before any is stored
                failed = next((r for pair in new for r in pair if isinstance(r, str)), None)
                if failed is not None:
                    raise RuntimeError(failed)
            else:
                new = self._shared_eigen(states, coarse)
            for state, pair in zip(states, new):
                state.update(zip(_EIGEN, (t for r in pair for t in r)))
            return
        # eigh only on T_inv steps: one branch for every layer (inductor reads a cond's
        # predicate on the host, so one cond is one sync, not one per layer)
        new = torch.cond(gate, lambda: tuple(t for st in states for t in self._eigen(st)),
                         lambda: tuple(st[k].clone() for st in states for k in _EIGEN), ())
        for i, state in enumerate(states):
            for key, t in zip(_EIGEN, new[4 * i:4 * i + 4]):
                state[key].copy_(t)

    def _eigen_checked(self, states, mine=None) -> list[list]:
        """Eager `_eigen` of every layer's factors, or of those in `mine` ((layer index, 0 for
        A / 1 for G) pairs; the others' entries are None): per layer [A's, G's], each
        (eigenvalues, eigenvectors). An eigh that fails (or returns inf/NaN) is retried in
        float64; if that fails too the factor keeps its previous decomposition, with a warning,
        and where there is none its entry is the error message (the caller raises it)."""
        todo = [(i, j) for i in range(len(states)) for j in range(2) if mine is None or (i, j) in mine]
        damped, results = {}, {}
        for i, j in todo:
            a = states[i][("xxt", "ggt")[j]]
            m = a + self._hp("damping", a) * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
            damped[i, j] = m
            results[i, j] = twolevel_maths.factor_eigh(m)
        tried = [r for r in results.values() if r is not None]
        finite = iter(torch.stack([torch.isfinite(t).all() for r in tried for t in r]).view(-1, 2).all(1).tolist()
                      if tried else [])
        results = {key: r if r is not None and next(finite) else None for key, r in results.items()}
        out = [[None, None] for _ in states]
        for i, j in todo:
            layer, state = self._layers[i], states[i]
            f, lam_key, vec_key = (("xxt", "L_x", "Q_x"), ("ggt", "L_g", "Q_g"))[j]
            m, r = damped[i, j], results[i, j]
            if r is None and m.dtype != torch.float64:
                r = twolevel_maths.factor_eigh(m.double())
                r = r if r is not None and all(bool(torch.isfinite(t).all()) for t in r) else None
                r = None if r is None else tuple(t.to(m.dtype) for t in r)
            if r is None:
                if vec_key not in state:
                    out[i][j] = (f"TwoLevelKFAC: the eigendecomposition of layer '{layer.name}''s {f} factor "
                                 f"failed in {m.dtype} and in float64, and there is no previous basis to keep")
                    continue
                warnings.warn(f"TwoLevelKFAC: step {self._iteration_counter}: the eigendecomposition of "
                              f"layer '{layer.name}''s {f} factor failed in {m.dtype} and in float64; "
                              "the layer keeps its previous basis", EigendecompositionWarning, stacklevel=5)
                out[i][j] = (state[lam_key], state[vec_key])
            else:
                lam, vec = r
                out[i][j] = (lam * (lam > _EIG_FLOOR), vec)
        return out

    def _shared_eigen(self, states, coarse: bool) -> list[list]:
        """torch.distributed: this rank's share of the eigendecompositions (and, `coarse`, the
        coarse matrix's inverse if it owns it), then every owner's results on every rank, in
        one `exchange` per (device, dtype) over the process group. Each factor travels with a
        flag (1: decomposed or kept, 0: failed with no previous basis), so a failure raises on
        every rank, not only on its owner."""
        me = self._rank
        mine = {(i, j) for i, pair in enumerate(self._owners) for j in range(2) if pair[j] == me}
        own = self._eigen_checked(states, mine)
        held: dict[tuple, list[list[torch.Tensor]]] = {}
        out, flags = [[None, None] for _ in states], []
        for i, state in enumerate(states):
            for j, f in enumerate(("xxt", "ggt")):
                a, owner = state[f], self._owners[i][j]
                r = own[i][j]
                if owner == me and not isinstance(r, str):
                    lam, vec = r
                    flag = torch.ones(1, dtype=a.dtype, device=a.device)
                else:  # received (column-major, as eigh returns it: the products round alike)
                    lam = torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
                    vec = torch.zeros_like(a).t()
                    flag = torch.zeros(1, dtype=a.dtype, device=a.device)
                lists = held.setdefault((a.device, a.dtype), [[] for _ in range(self._world)])
                lists[owner] += [lam, vec, flag]
                out[i][j] = (lam, vec)
                flags.append(((i, j), flag))
        if coarse:
            f = self.f_coarse
            inv = twolevel_maths.coarse_inverse(f) if self.coarse_worker == me else torch.empty_like(f).t()
            held.setdefault((f.device, f.dtype), [[] for _ in range(self._world)])[self.coarse_worker].append(inv)
            self.f_coarse_inv = inv
        for lists in held.values():
            exchange(lists, me, self.process_group)
        ok = torch.cat([flag.cpu() for _, flag in flags]).tolist()  # one host read: eager steps
        for ((i, j), _), good in zip(flags, ok):
            if good != 1.0:
                raise RuntimeError(f"TwoLevelKFAC: the eigendecomposition of layer '{self._layers[i].name}''s "
                                   f"{('xxt', 'ggt')[j]} factor failed on rank {self._owners[i][j]} (its owner) in "
                                   f"{states[i]['xxt'].dtype} and in float64, and there is no previous basis to keep")
        return out

    def _solve_coarse(self) -> None:
        """F_c's inverse: on its owner rank, shared in one `exchange` (torch.distributed), or here."""
        f = self.f_coarse
        if self._owners is None:
            self.f_coarse_inv = twolevel_maths.coarse_inverse(f)
            return
        me = self._rank
        inv = twolevel_maths.coarse_inverse(f) if self.coarse_worker == me else torch.empty_like(f).t()
        held = [[] for _ in range(self._world)]
        held[self.coarse_worker].append(inv)
        exchange(held, me, self.process_group)
        self.f_coarse_inv = inv

    @staticmethod
    def _kfac_inverse(state, v: torch.Tensor, extra: float = 0.0) -> torch.Tensor:
        qg, qx = state["Q_g"], state["Q_x"]
        s = (qg.t() @ v @ qx) / ((state["L_g"] + extra).unsqueeze(1) * (state["L_x"] + extra).unsqueeze(0))
        return qg @ s @ qx.t()

    # ------------------------------------------------------------------ per-sample projections
    def _locations(self, state, R: torch.Tensor) -> torch.Tensor:
        """p[..., m] = gy_m^T R x_m for R [..., d_out, d_in'] (row-wise bilinear form)."""
        return ((state["gy"] @ R) * state["x"]).sum(-1)

    def _samples(self, state, p: torch.Tensor, tiled: bool) -> torch.Tensor:
        """Per-sample sums of per-location values p [..., B*T]: contiguous blocks of T (the
        per-sample gradient), or, `tiled`, every B-th location (the published Conv2d pairing)."""
        T, B = state["num_locations"], self.batch_size
        if tiled:
            return p.reshape(*p.shape[:-1], T, B).sum(-2)
        return p.reshape(*p.shape[:-1], B, T).sum(-1)

    def _fvp(self, state, w: torch.Tensor) -> torch.Tensor:
        """Layer block of the empirical Fisher times a vector whose per-sample projections are w [B]."""
        T = state["num_locations"]
        wl = w.repeat(T) if self.published_bugs else w.repeat_interleave(T)
        return (state["gy"] * wl.unsqueeze(1)).t() @ state["x"] / self.batch_size

    # ------------------------------------------------------------------ coarse space
    def _constant_coarse(self) -> bool:
        """Whether each layer's coarse vector is one kept constant c * ones: the eager steps of
        nicolaides and tpselepedis without Krylov (the same numbers at every step)."""
        return (not self.krylov and self.coarse_space in ("nicolaides", "tpselepedis")
                and not torch.compiler.is_compiling())

    def _coarse_vectors(self, state, raw, residual) -> list[torch.Tensor]:
        cs = self.coarse_space
        if self._constant_coarse():
            key = (raw.shape, raw.dtype, raw.device)
            if key not in self._constant_vectors:
                ones = torch.ones_like(raw)
                self._constant_vectors[key] = ones / (ones.abs().max() + _NORM_EPS)
            return [self._constant_vectors[key]]
        if self.krylov:
            r1 = torch.ones_like(raw) if cs == "nicolaides" else self._m_inv(state, residual)
            rs = [r1, self._m_inv(state, r1)]
        elif cs in ("nicolaides", "tpselepedis"):  # compiled: made in the graph
            rs = [torch.ones_like(raw)]
        elif cs == "residual":
            rs = [self._m_inv(state, residual)]
        else:
            qx, qg = state["Q_x"][:, 0], state["Q_g"][:, 0]
            r = torch.kron(qx, qg) if self.published_bugs else torch.outer(qg, qx)
            rs = [r.reshape(raw.shape)]
        return [r / (r.abs().max() + _NORM_EPS) for r in rs]

    def _m_inv(self, state, v):
        # published: damping added again to eigenvalues that already hold it
        return self._kfac_inverse(state, v, self._hp("damping", v) if self.published_bugs else 0.0)

    def coarse_matrix(self, vectors: list[list[torch.Tensor]]) -> torch.Tensor:
        """The coarse matrix F_c of the stored statistics for the given coarse vectors (per
        layer, a list of [d_out, d_in (+1)] matrices in the layout of its gradient), assembled
        the way `backend` says: the statistics the step folds into F_c's EMA on a T_cov step."""
        return self._combine(self._coarse_parts(vectors), vectors)

    def _coarse_parts(self, vectors) -> list[torch.Tensor]:
        """The local pieces of F_c whose average over data-parallel ranks is the global one: F_c
        itself (a mean over samples), or tpselepedis's two factors (it multiplies two means)."""
        if self.coarse_space == "tpselepedis":
            return list(self._tselepidis_parts(vectors))
        if self.backend == "fused":
            return [self._assemble_fused(vectors)]
        return [self._assemble_pairs(vectors)]

    def _combine(self, parts, vectors) -> torch.Tensor:
        if self.coarse_space == "tpselepedis":
            f = parts[0] * parts[1]
            f = f + f.t() - torch.diag(torch.diagonal(f))
        else:
            f = parts[0]
        key = (f.device, f.dtype)
        if key not in self._sizes:  # made once: a host-to-device copy each step would sync
            self._sizes[key] = torch.tensor([float(r[0].numel()) for r in vectors for _ in r],
                                            dtype=f.dtype, device=f.device)
        return f + torch.diag(self._hp("damping", f) * self._sizes[key])

    def _assemble_fused(self, vectors) -> torch.Tensor:
        tiled = self.published_bugs
        U, V = [], []  # U: per-sample projections; V: the same with the published Conv2d pairing
        for group, rs in zip(self.param_groups, vectors):
            state = self.state[group["params"][0]]
            if self.coarse_space == "nicolaides" and not self.krylov:
                c = rs[0].reshape(-1)[0]
                p = (c * state["gy"].sum(1) * state["x"].sum(1)).unsqueeze(0)
            else:
                p = self._locations(state, torch.stack(rs))
            U.append(self._samples(state, p, False))
            V.append(self._samples(state, p, True) if tiled and state["num_locations"] > 1 else U[-1])
        U, V = torch.cat(U).t(), torch.cat(V).t()  # [B, n_c]
        f = V.t() @ U / self.batch_size
        if not self.krylov:  # published: lower triangle computed, then mirrored
            low = torch.tril(f)
            f = low + low.t() - torch.diag(torch.diagonal(f))
        return f

    def _assemble_pairs(self, vectors) -> torch.Tensor:
        states = [self.state[g["params"][0]] for g in self.param_groups]
        items = [(s, r) for s, rs in zip(states, vectors) for r in rs]
        zero = items[0][1].new_zeros(())
        f = torch.stack([torch.stack([
            zero if not self.krylov and j > i else
            (ri * self._fvp(si, self._samples(sj, self._locations(sj, rj), False))).sum()
            for j, (sj, rj) in enumerate(items)]) for i, (si, ri) in enumerate(items)])
        if not self.krylov:
            f = f + f.t() - torch.diag(torch.diagonal(f))
        return f

    def _tselepidis_parts(self, vectors) -> tuple[torch.Tensor, torch.Tensor]:
        """(F_c)_ij = <r_i, G_ij r_j A_ij^T> = c_i c_j sum(A_ij) sum(G_ij) for constant r, from the
        per-location row sums; layers of different location counts are brought to the smaller by
        nearest interpolation over the flattened locations of each sample (published). Returns
        the lower triangles of c_i c_j sum(A_ij) and of sum(G_ij)."""
        B = self.batch_size
        sums, Ts, cs = [], [], []
        for group, rs in zip(self.param_groups, vectors):
            state = self.state[group["params"][0]]
            sums.append(torch.stack([state["x"].sum(1), state["gy"].sum(1)]))
            Ts.append(state["num_locations"])
            cs.append(rs[0].reshape(-1)[0])
        n = len(sums)
        zero = sums[0].new_zeros(())

        def entry(i, j):
            T = min(Ts[i], Ts[j])
            a, b = (self._shrink(s, t, T) for s, t in ((sums[i], Ts[i]), (sums[j], Ts[j])))
            N = float(B * T)
            return torch.stack([cs[i] * cs[j] * ((a[0] @ b[0]) / N), (a[1] @ b[1]) / N])
        # built functionally (no in-place writes): it may run inside a torch.cond branch
        f = torch.stack([torch.stack([entry(i, j) if j <= i else zero.expand(2) for j in range(n)])
                         for i in range(n)])
        return f[..., 0], f[..., 1]

    def _shrink(self, s: torch.Tensor, T: int, to: int) -> torch.Tensor:
        if T == to:
            return s
        B = self.batch_size
        return F.interpolate(s.reshape(2 * B, 1, T), to, mode="nearest").reshape(2, B * to)

    # ------------------------------------------------------------------ step
    # cafin.StepGraphs runs every step of it eagerly, on the host's count
    _uncapturable = ("its T_inv steps decompose with torch.linalg.eigh, which syncs with the host "
                     "on CUDA, and its device-decided step chooses them with torch.cond, which "
                     "eager code decides on the host")

    @torch.no_grad()
    def step(self, update_params: bool = True, closure=None) -> None:
        """Rewrite every layer's gradient with its two-level direction (update_params=True), or
        only take statistics (update_params=False, the published true-Fisher loop).

        Eager steps decide the T_cov/T_inv intervals on the host; a compiled step (after at least
        one eager step, which creates the state it updates) decides them on the device, with the
        eigendecompositions and the coarse assembly in `torch.cond` branches."""
        if closure is not None:
            raise ValueError("closure is not supported: TwoLevelKFAC.step(update_params) only "
                             "rewrites the gradients (step a torch optimizer after it)")
        if not torch.compiler.is_compiling() and capturing():  # before the counter latches
            raise RuntimeError(
                "TwoLevelKFAC's step cannot be captured in a CUDA graph: on T_inv steps it "
                "decomposes its factors with torch.linalg.eigh inside the step, and eigh checks "
                "its result on the host on CUDA (a sync, which a capture forbids); the choice of "
                "step is a torch.cond, which eager code decides on the host. Run the step eagerly, "
                "or compile it with torch.compile(step, fullgraph=True) after one eager step")
        if self._steps.host_due(1) is None:  # compiled (device-gated): in-place updates, no undo
            self._step(update_params)
            return
        # An eager step replaces state entries and never writes into them, so a step that
        # raises is undone by putting the entries back.
        anchors = [g["params"][0] for g in self.param_groups]
        fresh = [p for p in anchors if p not in self.state]  # entries this step creates
        saved = ([(st, dict(st)) for st in (self.state[p] for p in anchors)],
                 {key: {**pending, "calls": list(pending["calls"])} for key, pending in self._pending.items()},
                 {key: getattr(self, key) for key in ("f_coarse", "f_coarse_inv", "batch_size",
                                                      "dropped_statistics")})
        try:
            self._step(update_params)
        except BaseException:
            states, pending, values = saved
            for state, entries in states:
                state.clear()
                state.update(entries)
            for p in fresh:
                del self.state[p]
            self._pending = pending
            self.__dict__.update(values)
            self.__dict__.pop("_early_parts", None)
            self.__dict__.pop("_coarse_folded", None)
            if self._iteration_counter == 0 and not self._pending and self._zero_gradients():
                raise RuntimeError(_DCP_STEP) from None
            raise

    def _zero_gradients(self) -> bool:
        """Whether every parameter has a gradient and all of them are zero: the step that
        torch.distributed.checkpoint's get/set_optimizer_state_dict run on an optimizer without
        state."""
        grads = [p.grad for g in self.param_groups for p in g["params"]]
        return all(g is not None and not bool(g.any()) for g in grads)

    def _step(self, update_params: bool) -> None:
        k, rho, gate_cov, gate_inv = self._schedule()
        eager = gate_cov is None
        if eager:
            collect = self.update_stats and k % self.T_cov == 0
            decompose = self.update_stats and k % self.T_inv == 0
        else:
            collect = decompose = self.update_stats
        self._check_ready(k, update_params, collect, decompose, compiled=not eager)
        # FSDP2: the full gradients, gathered before any state changes (a missing one raises)
        full = self._gather() if update_params and self._sharded else None
        stats = self._statistics() if collect else None  # an unused layer raises here
        self._pending.clear()  # statistics of a pass that is not a T_cov step: not used
        raws = [self._raw(g, dtype, full[i] if full else None)
                for i, (g, dtype) in enumerate(zip(self.param_groups, self._work))] if update_params else None
        states = [self.state[g["params"][0]] for g in self.param_groups]
        covs, gate_fold, undo = self._store_statistics(states, stats, gate_cov) if collect else ([], gate_cov, None)
        if distributed():
            self._average(covs, raws if update_params and eager and k % self.T_cov == 0 else None)
        if eager and covs and not self._all_finite(covs):
            undo()
            covs = []
            if "xxt" not in states[0]:
                return  # nothing to precondition with yet: the gradients are left as they are
        for state, new in zip(states, covs):
            self._covs(state, new, rho, gate_fold)
        coarse = False
        if decompose and self._owners is not None and "_early_parts" in self.__dict__:
            # F_c does not depend on this step's decompositions (ones vectors): folded now, its
            # inverse made by its owner travels with them
            self._coarse_folded = coarse = self._fold_coarse(None)
        if decompose:
            self._decompose(states, gate_inv, coarse)
        if not update_params:
            return
        directions = self._two_level(raws, self._kfac_directions(states, raws))
        if directions is None:
            return  # no coarse matrix yet (this step's was dropped): the gradients are left as they are
        self._write_all(*directions, full)
        self._steps.advance()

    def _check_ready(self, k: int, update_params: bool, collect: bool, decompose: bool, compiled: bool) -> None:
        """Refuse a step that would read state no earlier step created, or a gradient that is missing."""
        if compiled and distributed():
            raise RuntimeError("TwoLevelKFAC: a compiled step under torch.distributed is not "
                               "supported: run its steps eagerly")
        for layer, group in zip(self._layers, self.param_groups):
            state = self.state[group["params"][0]]
            ready = "Q_x" in state and (self.f_coarse is not None or not update_params
                                        or self.coarse_space == "none")
            if compiled and not ready:
                raise RuntimeError("TwoLevelKFAC: a compiled step updates the state an eager step "
                                   "creates: run the first step (step 0, with update_stats) eagerly")
            if "xxt" not in state and not collect:
                raise self._missing(layer, "Kronecker factors")
            if "Q_x" not in state and not decompose:
                raise self._missing(layer, "eigendecomposition")
            if update_params and not torch.compiler.is_compiling():
                for p in group["params"]:
                    if p.grad is None:
                        raise RuntimeError(
                            f"TwoLevelKFAC: layer '{layer.name}' has no gradient at step {k} (not used "
                            "in the forward pass, or frozen after the optimizer was built): the coarse "
                            "space couples every registered layer, so each one needs a gradient at "
                            "every step (freeze a layer before building the optimizer to skip it)")

    def _store_statistics(self, states, stats, gate_cov):
        """Store this step's statistics and return (the batch covariances, the gate of their
        fold into the EMAs, a function that puts the previous statistics back)."""
        kept = [{key: st[key] for key in ("x", "gy", "num_locations") if key in st} for st in states]
        kept_batch = self.batch_size

        def undo():
            for state, entries in zip(states, kept):
                for key in ("x", "gy", "num_locations"):
                    state.pop(key, None)
                state.update(entries)
            self.batch_size = kept_batch
            self.__dict__.pop("_early_parts", None)

        gate_fold = self._store(stats, gate_cov)
        return [self._batch_covs(st) for st in states], gate_fold, undo

    def _all_finite(self, covs) -> bool:
        """Whether every layer's batch covariances are finite; a drop is counted and warned of.
        Checked after the average over the ranks, so that every rank drops the same steps."""
        finite = torch.stack([torch.isfinite(c).all() for pair in covs for c in pair]).view(-1, 2).all(1)
        bad = [layer.name for layer, ok in zip(self._layers, finite.tolist()) if not ok]
        if bad:
            self._drop(f"the statistics (inputs or output gradients) of the layers {bad}")
        return not bad

    def _kfac_directions(self, states, raws) -> list[torch.Tensor]:
        """Every layer's first-level (K-FAC) direction, per location for convolutions. Eager, the
        eigenvalues' division and the per-location one are one kept scaling (`_scaling`), and
        the products of every layer are one `kfac_eigen_products_` call per device and dtype,
        into kept buffers (`_product_buffers`)."""
        if torch.compiler.is_compiling():
            pres = []
            for group, state, raw in zip(self.param_groups, states, raws):
                p = self._kfac_inverse(state, raw)
                locations = group["layer_type"] == "Conv2d" or state["num_locations"] != 1
                pres.append(p / state["num_locations"] if locations else p)
            return pres
        pres = []
        products: dict[tuple, list[tuple[torch.Tensor, ...]]] = defaultdict(list)
        for i, (group, state, raw) in enumerate(zip(self.param_groups, states, raws)):
            locations = group["layer_type"] == "Conv2d" or state["num_locations"] != 1
            scaling = self._scaling(i, state, state["num_locations"] if locations else 1)
            mid, work = self._product_buffers(i, raw)
            products[(raw.device, raw.dtype)].append((mid, work, raw, state["Q_x"], state["Q_g"], scaling))
            pres.append(mid)  # written by the call below
        for entries in products.values():
            ops.kfac_eigen_products_(*zip(*entries))
        return pres

    def _product_buffers(self, i: int, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's two row-aligned buffers of its products Q_g ((Q_g^T raw Q_x) * scaling)
        Q_x^T (`kfac_eigen_products_`, in K-FAC's right-multiplication form), kept from step to
        step (remade when the shape, dtype or device changes): the result is the first, rewritten
        by the next step (the write reads it as it lies)."""
        kept = self._buffers.get(i)
        if kept is None or kept[0].shape != raw.shape or kept[0].dtype != raw.dtype or kept[0].device != raw.device:
            d_g, d_a = raw.shape
            like = dict(dtype=raw.dtype, device=raw.device)
            kept = self._buffers[i] = (kfac_maths.aligned_empty((d_g, d_a), **like),
                                       kfac_maths.aligned_empty((d_a, d_g), **like))
        return kept

    def _scaling(self, i: int, state, locations: int) -> torch.Tensor:
        """1 / (L_g L_x^T locations) of layer i, kept while its eigenvalues are the same tensors
        at the same versions (a decomposition replaces them, or writes them in place)."""
        L_g, L_x = state["L_g"], state["L_x"]
        if torch.compiler.is_compiling() or self._steps.device_gated:
            # the device decides: a host-side cache would be a decision frozen in a graph
            return torch.outer(L_g, L_x).mul_(locations).reciprocal_()
        key = (L_g._version, L_x._version, locations)
        kept = self._scalings.get(i)
        if kept is not None and kept[0] is L_g and kept[1] is L_x and kept[2] == key:
            return kept[3]
        scaling = torch.outer(L_g, L_x).mul_(locations).reciprocal_()
        self._scalings[i] = (L_g, L_x, key, scaling)
        return scaling

    def _write_all(self, final, shift=None, full=None) -> None:
        """Every layer's [d_out, d_in (+1)] direction, plus its entry of `shift` (None: 0), over
        its weight and bias gradients in one call of K-FAC's writer (its layout), which also
        applies the published clipping (constraint_norm): the factor
        min(sqrt(clipping / norm), 1), norm the sum over the tensors (each weight, each bias) of
        |<direction, gradient>|, taken on the device before any gradient is written. FSDP2
        (`full`: the gathered gradients): written over the full gradients, then each rank keeps
        its own rows."""
        if full is not None:
            ws = [w for w, _ in full]
            bs = [b if b is not None else w.new_empty(0) for w, b in full]
        else:
            ws = [g["params"][0].grad for g in self.param_groups]
            bs = [g["params"][1].grad if len(g["params"]) == 2 else ws[i].new_empty(0)
                  for i, g in enumerate(self.param_groups)]
        # [d_out, ...] views: a Conv1D's transposed gradient is written through a copy below
        ws = [w.t() if g["layer_type"] == "Conv1D" else w for w, g in zip(ws, self.param_groups)]
        # the kernel writes contiguous gradients: others (channels_last, Conv1D) through a copy
        targets = [t if t.is_contiguous() else t.contiguous() for t in (*ws, *bs)]
        # the directions are in the state dtype (float32 for float16/bfloat16 gradients)
        final = [f.to(w.dtype).unsqueeze(0) for f, w in zip(final, ws)]
        clipping = self._hp("clipping", ws[0]) if self.constraint_norm else None
        if shift is not None:
            shift = shift.to(ws[0].dtype)
        self._writer.kfac_precondition_apply_(targets[:len(ws)], targets[len(ws):], final,
                                              self._hp("one", ws[0]), clipping, shift, True)
        for t, target in zip((*ws, *bs), targets):
            if target is not t:
                t.copy_(target)
        if full is not None:
            for group, (w, b) in zip(self.param_groups, full):
                for p, g in zip(group["params"], (w, b)):
                    local(p.grad).copy_(own_rows(g, p.grad))

    def _average(self, covs, raws) -> None:
        """Data parallel: the batch covariances averaged over the ranks, and with them the new
        coarse matrix when its vectors do not depend on this step's factors (the ones vectors of
        nicolaides and tpselepedis): one collective. The other spaces build their vectors from
        the averaged factors' eigendecomposition, so their coarse matrix needs a second one."""
        tensors = [c for pair in covs for c in pair]
        early = raws is not None and not self.krylov and self.coarse_space in ("nicolaides", "tpselepedis")
        if early:
            ones = [self._coarse_vectors(self.state[g["params"][0]], r, None) for g, r in zip(self.param_groups, raws)]
            self._early_parts = (self._coarse_parts(ones), ones)
            tensors += self._early_parts[0]
        if tensors:  # in place: the covariances and parts now hold the averages
            average_over_ranks(tensors, self.process_group)

    def _two_level(self, raws, pres) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """The two-level directions: the K-FAC directions `pres`, corrected in place, and a
        per-layer constant the write adds (None: nothing); None without a coarse matrix."""
        if self.coarse_space == "none":  # the first level alone: the paper's K-FAC baseline
            return pres, None
        states = [self.state[g["params"][0]] for g in self.param_groups]
        if self.published_bugs:
            raws = [self._published_layout(g, r) for g, r in zip(self.param_groups, raws)]
        residuals = [None] * len(states)
        if self.coarse_space == "residual":
            # r = g - F x - damping x, x the K-FAC direction, F x the exact empirical Fisher product
            w = sum(self._samples(s, self._locations(s, p), False) for s, p in zip(states, pres))
            fx = [self._fvp(s, w) for s in states]
            if distributed():  # the Fisher of the whole batch: the ranks then agree on the vectors
                average_over_ranks(fx, self.process_group)
            residuals = [r - f - self._hp("damping", p) * p for s, r, f, p in zip(states, raws, fx, pres)]
        vectors = [self._coarse_vectors(s, r, res) for s, r, res in zip(states, raws, residuals)]
        # one kept vector c * ones per layer: <v, r> is c sum(r) and v y is the scalar c y,
        # which the write adds (no pass over the ones, none over the directions)
        constant = self._constant_coarse()
        if constant:
            c = vectors[0][0].reshape(-1)[0]
            rhs = torch.stack([r.sum() for r in raws]) * c
        else:
            rhs = torch.stack([torch.dot(v.reshape(-1), r.reshape(-1)) for vs, r in zip(vectors, raws) for v in vs])
        if not self._update_coarse(vectors):
            return None
        y = self.f_coarse_inv @ rhs
        if constant:
            return pres, y * c
        # v_l += y_l r_l for every layer at once (one call per coarse vector of a layer, not
        # one add per layer): the directions are this step's own, updated in place
        per_layer = len(vectors[0])
        ys = y.view(-1, per_layer)
        for j in range(per_layer):
            torch._foreach_addcmul_(pres, [vs[j] for vs in vectors], list(ys[:, j].unbind()))
        return pres, None

    def _update_coarse(self, vectors) -> bool:
        """On T_cov steps: assemble F_c from the stored statistics, fold it into the EMA with
        the factors' rho, and invert it (linalg.inv_ex: torch.inverse's numbers without its
        error-check sync). A new F_c with inf/NaN (from a non-finite gradient in the residual
        space's vectors) is dropped. Returns whether there is a coarse matrix to use."""
        k, rho, gate, _ = self._schedule()
        if gate is None:
            if k % self.T_cov == 0:
                folded = self.__dict__.pop("_coarse_folded", None)  # this step's, with the decompositions
                if folded is None:
                    folded = self._fold_coarse(vectors)
                    if folded:
                        self._solve_coarse()
                if not folded:
                    return self.f_coarse is not None
            return True

        def fresh():
            new = self.coarse_matrix(vectors)
            f = torch.where(torch.isfinite(new).all(), rho * self.f_coarse + (1 - rho) * new, self.f_coarse)
            return f, torch.linalg.inv_ex(f)[0]

        new = torch.cond(gate, fresh, lambda: (self.f_coarse.clone(), self.f_coarse_inv.clone()), ())
        self.f_coarse.copy_(new[0])
        self.f_coarse_inv.copy_(new[1])
        return True

    def _fold_coarse(self, vectors) -> bool:
        """Eager T_cov steps: the new F_c (from the parts averaged with the covariances, or
        assembled and averaged now) folded into its EMA; False, and F_c kept, where it holds
        inf/NaN (dropped, with a warning)."""
        _, rho, _, _ = self._schedule()
        early = self.__dict__.pop("_early_parts", None)
        if early is not None:
            parts, vectors = early
        else:
            parts = self._coarse_parts(vectors)
            if distributed():
                average_over_ranks(parts, self.process_group)
        f = self._combine(parts, vectors)
        if not bool(torch.isfinite(f).all()):
            self._drop("the coarse matrix's new statistics")
            return False
        self.f_coarse = f if rho is None else rho * self.f_coarse + (1 - rho) * f
        return True

    @staticmethod
    def _published_layout(group, r: torch.Tensor) -> torch.Tensor:
        """The published right-hand side reads the flat [weight, bias] gradient as a
        [d_out, d_in + 1] matrix, which puts bias entries and weights in the wrong places."""
        if len(group["params"]) == 1:
            return r
        return torch.cat([r[:, :-1].reshape(-1), r[:, -1]]).reshape(r.shape)

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
                    "and 'param_groups': checkpoint a TwoLevelKFAC with cafin.optim.twolevel_dcp's "
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
                fs[j] = _checkpoint_tensor(fs[j], name, (n, n), self._work[0], device)
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
            entry[key] = _checkpoint_tensor(saved[key], f"{where}: {key}", shape, self._work[i], w.device)
        for key in ("Q_x", "Q_g"):
            # eigh's column-major layout, which a checkpoint (DCP) may not keep: the products
            # then round as they did before the save (a bit-identical resume)
            entry[key] = entry[key].t().contiguous().t()
        return entry


TwoLevelKFAC.__doc__ = (
    r"""Two-level K-FAC: K-FAC's block-diagonal direction plus a coarse correction coupling the layers.

    A gradient preconditioner, a drop-in for ``TwolevelKFAC`` of Abdoulaye-Koroko/natural-gradients
    (arXiv 2303.18083): ``step(update_params=True)`` after backward rewrites the gradient of every
    registered Linear, Conv2d and Conv1D layer; a torch optimizer (SGD with momentum) then steps. Per
    layer l, with K-FAC factors :math:`A_l = E[x x^\top]`, :math:`G_l = E[g g^\top]` (EMAs,
    updated every T_cov steps, eigendecomposed every T_inv steps, damping added inside the
    decomposition):

    .. math::
        v_l = (G_l + \lambda I)^{-1} g_l (A_l + \lambda I)^{-1} + y_l r_l, \qquad
        y = F_c^{-1} (R g), \quad (R g)_l = \langle r_l, g_l \rangle,

        (F_c)_{ij} = \tfrac{1}{B} \textstyle\sum_n \langle r_i, G_{n,i} \rangle
        \langle r_j, G_{n,j} \rangle + \lambda \, |r_i| \, [i = j]

    with one coarse vector :math:`r_l` per layer (two with ``krylov=True``) and :math:`G_{n,l}`
    sample n's gradient. Layers whose parameters are all frozen are skipped. Factors and
    decompositions of float16 and bfloat16 models are kept in float32. A step whose statistics
    hold inf/NaN drops them with a ``NonFiniteStatisticsWarning`` (counted in
    ``dropped_statistics``).
    """
    + rf"""
    Args:
        net (nn.Module): the model; its Linear and Conv2d modules (exact classes) and
            transformers ``Conv1D`` modules are registered. A Linear (or Conv1D) on
            [B, T..., D] inputs has T locations per sample, as a Conv2d has its output
            positions. A trained Embedding, Conv1d or Conv3d (layers KFACPreconditioner
            supports) is refused with a ValueError naming it.
        damping (float, optional): Tikhonov damping :math:`\lambda`, > 0 (default: 1e-3)
        pi (bool, optional): accepted, no effect (published: feeds a branch that is never
            taken) (default: False)
        T_cov (int, optional): steps between factor and coarse-matrix updates (default: 100)
        T_inv (int, optional): steps between eigendecompositions (default: 100)
        alpha (float, optional): EMA weight cap, :math:`\rho = \min(1 - 1/k, \alpha)`, in
            [0, 1] (default: 0.95)
        constraint_norm (bool, optional): scale the directions by
            min(sqrt(clipping / |<v, g>|), 1) (default: False)
        clipping (float, optional): the bound of constraint_norm, >= 0 (default: 1e-2)
        batch_size (int, optional): initial batch size (overwritten by each collection)
            (default: 64)
        coarse_space (str, optional): "nicolaides", "spectral", "residual" or "tpselepedis";
            "none" (not in the published code) turns the coarse correction off: the same K-FAC
            directions, uncorrected, the baseline the paper compares with (default: "nicolaides")
        krylov (bool, optional): add a second, Krylov coarse vector (nicolaides and residual
            only) (default: False)
        backend (str, optional): how :math:`F_c` is assembled: "fused", the per-sample coarse
            projections of every layer at once, or "reference", pair by pair as the published
            code does (see the module's docstring); keyword only, as all below. Either way the
            gradients are written by K-FAC's kernel for float32/float64 layers on one device
            and by its plain-PyTorch twin otherwise, decided here (default: "fused")
        {_published_bugs_doc}
            Here: the four bugs docs/twolevel.md lists and says why each is one.
        {_process_group_doc}
            The statistics are averaged over it, and the decompositions are shared out over
            its ranks.
        distribute_decompositions (bool, optional): under torch.distributed (more than one
            rank), each decomposition (every factor's eigendecomposition on inverse steps,
            the coarse matrix's inverse on T_cov steps) is made by one owner rank and the
            results are shared: one collective per (device, dtype) on inverse steps, the
            coarse inverse inside it where F_c is known before the decompositions
            (nicolaides and tpselepedis without Krylov vectors), else one of its own.
            ``step()`` is then a collective (every rank calls it, as it already does for the
            statistics). ``assignment`` maps each layer's name to the owners of its factors,
            ``{{"A": rank, "G": rank}}``, and ``coarse_worker`` is the coarse inverse's owner
            (both None in one process or when False). False: every rank makes every
            decomposition (no exchange). The numbers do not depend on it (default: True)
        assignment_strategy (str or AssignmentStrategy, optional): how owners are balanced,
            as KFACPreconditioner's: "compute" costs a matrix of size n as n^3, "memory" as
            n^2 (default: "compute")
        colocate_factors (bool, optional): both factors of a layer on one owner; False places
            each factor alone, which balances better (two-level decomposes A and G apart)
            (default: False)
    """
)


def _checkpoint_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"checkpoint {name} must be an int >= {low}, got {value!r}")
    return value


def _checkpoint_tensor(value, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A copy of a checkpoint tensor in `dtype` on `device`, after checking it."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"checkpoint {name} must be a real floating tensor, got "
                        f"{value.dtype if isinstance(value, torch.Tensor) else type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"checkpoint {name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"checkpoint {name} holds inf/NaN values")
    return value.detach().to(device=device, dtype=dtype, copy=True)
