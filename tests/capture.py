"""A CPU stand-in for CUDA-graph capture and replay, so that "captured equals eager" runs without
a GPU.

`Graph` is used as `torch.cuda.CUDAGraph` is:

    graph = Graph()
    with graph.capture():       # one training step: forward with hooks, backward, step
        train_step()
    for x, y in loader:
        static_x.copy_(x); static_y.copy_(y)
        graph.replay()          # the recorded ops again, on the same tensors; no Python of cafin

While it records, a TorchDispatchMode runs every aten op (and every cafin custom op) and keeps
(op, args, kwargs, outputs); the autograd engine runs a CPU backward on the calling thread with
the caller's dispatch modes, so the backward's ops are recorded too (tests/test_capture_contract.py
checks this). What a real capture does, and so does this:

- cafin is told it is being captured: `cafin.core.route.capturing()` returns True (every module
  that imported the name sees the patched one), so the step counter becomes device gated;
- a host read raises: `.item()`, `bool(tensor)`, `nonzero`, `masked_select`, `unique`, `equal`
  and the other ops whose result the host must see (a capture forbids a sync), and so do the ops
  whose CUDA kernels check their result on the host (`linalg.eigh` and the non-`_ex` solvers);
- the capture does not run the step: every tensor that existed before the capture and that the
  recorded step wrote is put back as it was, and every tensor the capture allocated (the graph's
  pool) is kept alive and filled with NaN (integers with their maximum), as a pool's memory is
  undefined until a replay writes it: a replay that reads pool memory before writing it shows;
- a replay runs the recorded ops in order on the same tensor objects, reading their storage as
  it is then: an op's results are written into the recorded output tensors (unless the output
  aliases an input: views and in-place or out= ops mutate what they mutated when recorded).
  Python values (scalars, host-side decisions, which tensor object a dict holds) are frozen as
  they were at capture.

What it cannot model, and where a GPU is still needed (tests/test_cuda_graphs*.py):
- random ops draw new numbers on each replay from the CPU generator; a CUDA graph advances its
  Philox offset instead, so the numbers differ from an eager run's either way (the tests use none);
- a CPU kernel may read a tensor's value on the host inside the kernel (a custom op deciding on
  the host from the step tensor); each replay re-runs it, so it follows the value where a CUDA
  graph would need the CUDA kernel to decide on the device: that property is the CUDA kernels'
  (tests of the ops, and the GPU tests);
- an op whose output shape depends on the data (other than the refused host reads) is refused at
  replay when its shape differs from the recorded one, where a graph would silently keep the old
  shape;
- memory reuse inside a pool (a tensor freed during capture whose memory a later op takes) is not
  modelled: every allocation keeps its own memory, which is the safe side of the pool;
- kernels launched on other streams, `.set_()` or `.data =` on a tensor after capture (a real
  graph keeps the old address; this stand-in follows the tensor object).
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import cafin.core.route as _route

aten = torch.ops.aten


class HostSyncDuringCapture(RuntimeError):
    """An op a CUDA-graph capture forbids (it reads a device value on the host)."""


# Ops whose result the host reads, or whose output shape depends on the data.
_HOST_READS = {
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
    aten.nonzero.default, aten.nonzero_static.default if hasattr(aten, "nonzero_static") else None,
    aten.masked_select.default, aten.unique_consecutive.default, aten._unique2.default,
    aten.unique_dim.default, aten.argwhere.default, aten.allclose.default,
    aten.repeat_interleave.Tensor,
}
_HOST_READS.discard(None)
# Ops whose CUDA kernels check their result on the host: not capturable on a GPU
# (`_linalg_check_errors` is the check the non-`_ex` solvers, inverses and Cholesky add).
_SYNCS_ON_CUDA = {aten._linalg_eigh.default, aten._linalg_svd.default, aten.linalg_eig.default,
                  aten._linalg_check_errors.default}
# Factory ops whose values are undefined: a replay leaves the memory as it is.
_UNINITIALISED = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                  aten.new_empty.default, aten.new_empty_strided.default}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written_args(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors the op writes, from its schema (Tensor(a!) arguments, out= included)."""
    out = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out += _tensors(value)
    return out


def _returns_alias(func) -> list[bool]:
    return [r.alias_info is not None for r in func._schema.returns]


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "Graph") -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = self.graph
        if func in _HOST_READS:
            raise HostSyncDuringCapture(f"{func} reads a device value on the host: a CUDA graph "
                                        "capture forbids it")
        if func in _SYNCS_ON_CUDA and not g.allow_cuda_syncs:
            raise HostSyncDuringCapture(f"{func} checks its result on the host on CUDA (a sync): "
                                        "it cannot be captured in a CUDA graph")
        for t in _written_args(func, args, kwargs):  # first write of a tensor from before capture
            key = _storage_key(t)
            if key not in g._pool and key not in g._saved:
                g._saved[key] = (t.untyped_storage(), t.untyped_storage().clone())
        out = func(*args, **kwargs)
        g.ops.append((func, args, kwargs, out))
        aliased = _returns_alias(func)
        outs = out if isinstance(out, (tuple, list)) and len(func._schema.returns) > 1 else (out,)
        for result, alias in zip(outs, aliased):
            if alias:
                continue
            for t in _tensors(result):
                key = _storage_key(t)
                if key not in g._saved:
                    g._pool[key] = t  # kept alive like a graph's pool
        return out


class Graph:
    """One captured step (see the module docstring)."""

    def __init__(self, allow_cuda_syncs: bool = False) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.allow_cuda_syncs = allow_cuda_syncs
        self._pool: dict[int, torch.Tensor] = {}
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.captured = False

    @contextlib.contextmanager
    def capture(self):
        if self.captured:
            raise RuntimeError("a Graph captures once")
        patched = [m for m in list(sys.modules.values())
                   if getattr(m, "__name__", "").startswith("cafin")
                   and getattr(m, "capturing", None) is _route.capturing]
        original = _route.capturing
        for m in patched:
            m.capturing = lambda: True
        try:
            with _Recorder(self):
                yield self
        finally:
            for m in patched:
                m.capturing = original
        self.captured = True
        for storage, saved in self._saved.values():  # the capture ran nothing
            storage.copy_(saved)
        for t in self._pool.values():
            _poison(t)

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay() before capture()")
        with torch.no_grad():
            for func, args, kwargs, recorded in self.ops:
                result = func(*args, **kwargs)
                if func in _UNINITIALISED:
                    continue
                outs = (recorded, result) if len(func._schema.returns) <= 1 else None
                pairs = [outs] if outs else list(zip(recorded, result))
                for alias, (old, new) in zip(_returns_alias(func), pairs):
                    if alias:
                        continue
                    for o, n in zip(_tensors(old), _tensors(new)):
                        if o.shape != n.shape:
                            raise RuntimeError(f"{func} returned shape {tuple(n.shape)} on replay, "
                                               f"{tuple(o.shape)} at capture")
                        o.copy_(n)

    def ops_named(self, name: str) -> list:
        return [op for op in self.ops if name in str(op[0])]


def _poison(t: torch.Tensor) -> None:
    """Undefined memory, made visible: NaN for floating tensors, the maximum for integers."""
    with torch.no_grad():
        base = t._base if t._base is not None else t
        if base.is_floating_point() or base.is_complex():
            base.fill_(math.nan)
        elif base.dtype == torch.bool:
            base.fill_(True)
        else:
            base.fill_(torch.iinfo(base.dtype).max)


# ----------------------------------------------------------------------------- the members' recipes
@dataclass(frozen=True)
class Case:
    """A member of tests/members.py built with curvature interval `interval` and captured the
    way its docs say: `before_capture` once before the capture, `before_step` eagerly (outside
    the graph) before each captured step k; `refused`: a capture raises an error naming these."""
    id: str
    member: str
    kwargs: Callable[[int], dict]
    before_capture: Callable[[Any], None] = lambda run: None
    before_step: Callable[[Any, int, int], None] = lambda run, k, interval: None
    refused: tuple[str, ...] = ()

    def build(self, model, interval: int):
        from members import MEMBERS, Run
        member = next(m for m in MEMBERS if m.name == self.member)
        return Run(member, model, **self.kwargs(interval))

    def eager(self, model, interval: int, data, warmup: int, on_step=None):
        """The reference: every step eager, with the recipe's outside work from step `warmup`
        (where the capture would be) on; `on_step(k, run)` after each step."""
        run = self.build(model, interval)
        for k, (x, y) in enumerate(data):
            if k == warmup:
                self.before_capture(run)
            if k >= warmup:
                self.before_step(run, k, interval)
            run.step(x, y)
            if on_step is not None:
                on_step(k, run)
        return run

    def replayed(self, model, interval: int, data, warmup: int, on_step=None):
        """The recipe captured: `warmup` eager steps, one training step captured (the stand-in
        Graph, on static input buffers), then replayed on each later batch, with the recipe's
        outside work before each; `on_step(k, run)` after each replay."""
        run = self.build(model, interval)
        for x, y in data[:warmup]:
            run.step(x, y)
        static_x, static_y = data[warmup][0].clone(), data[warmup][1].clone()
        self.before_capture(run)
        graph = Graph()
        with graph.capture():
            run.step(static_x, static_y)
        for k in range(warmup, len(data)):
            self.before_step(run, k, interval)
            static_x.copy_(data[k][0])
            static_y.copy_(data[k][1])
            graph.replay()
            if on_step is not None:
                on_step(k, run)
        return run


def _kfac_outside(run) -> None:
    run.curvature.decompose_in_step = False


def _kfac_decompose(run, k: int, interval: int) -> None:
    if k % interval == 0:  # inv_update_steps = interval
        run.curvature.decompose()


CASES = [
    Case("AdaFisher", "AdaFisher", lambda i: {"TCov": i}),
    # eigh syncs on CUDA: decompose() eagerly, outside the graph, on inverse steps
    Case("KFACPreconditioner", "KFACPreconditioner",
         lambda i: {"factor_update_steps": i, "inv_update_steps": i},
         before_capture=_kfac_outside, before_step=_kfac_decompose),
    # linalg.inv_ex does not sync: the inverses are made in the graph, gated on the device
    Case("KFACPreconditioner-inverse", "KFACPreconditioner",
         lambda i: {"factor_update_steps": i, "inv_update_steps": i, "compute_method": "inverse"}),
    Case("TwoLevelKFAC", "TwoLevelKFAC", lambda i: {"T_cov": i, "T_inv": i},
         refused=("CUDA graph", "eigh")),
    Case("SINGD-dense", "SINGD", lambda i: {"T": i, "structures": ("dense", "dense")}),
    Case("SINGD-diagonal", "SINGD", lambda i: {"T": i, "structures": ("diagonal", "diagonal")}),
    # eps 1e-4 (as DyKAF's other compile and capture tests): with 1e-8, eps-sized denominators
    # amplify the float32 rounding of inductor's fused kernels (reduce-overhead) past 1e-5
    Case("DyKAF", "DyKAF", lambda i: {"precondition_frequency": i, "eps": 1e-4, "init": "eps"}),
]
