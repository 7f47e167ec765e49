"""The route from a member's `step()` to a kernel, decided here and nowhere else.

Two decisions:

- **How this step runs**: eagerly, traced by torch.compile, or captured in a CUDA graph.
  torch forces this one per call; members ask the question they need answered: `eager()` (the
  host may read a device value, keep a host cache, warn: a read costs at most a sync),
  `compiled()` (Dynamo is tracing: a host value would become a guard), `captured()` (a CUDA graph
  is being captured: nothing may sync, every write must land in the same storage).
- **Which kernels a tensor runs on** (`Route`, fixed at construction): the fused ops of
  `cafin.ops` or the plain-PyTorch ops of `cafin.reference` (same names, same signatures), per
  (device, dtype), and the form of the batched products per device.

A member keeps one `Route` and never tests `backend`, `is_compiling()` or the capture state itself
(tests/test_route_rule.py holds that).
"""
from __future__ import annotations

from types import ModuleType

import torch

BACKENDS = ("fused", "reference")
# The kernels take these dtypes; other dtypes run the reference ops of the same names.
KERNEL_DTYPES = (torch.float32, torch.float64)


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def compiled() -> bool:
    """torch.compile is tracing this call: what the code reads from the host becomes a guard or
    a constant of the graph."""
    return torch.compiler.is_compiling()


def captured() -> bool:
    """This call runs once, under a CUDA-graph capture, outside a torch.compile trace (a
    compiled graph that is captured later, `mode="reduce-overhead"`, was traced as `compiled`)."""
    return not compiled() and capturing()


def eager() -> bool:
    """Neither traced nor captured: the host may read device values, keep host caches and warn."""
    return not compiled() and not capturing()


def check_backend(backend: object, owner: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{owner}: backend must be one of {list(BACKENDS)}, got {backend!r}")
    return backend


def has_kernels(device: torch.device, op: str) -> bool:
    """This build registers `cafin::<op>` for the device (the CPU always; CUDA when the
    extension was built with its CUDA kernels)."""
    return _registered(device.type, op)


# A constant of the build: torch.compile evaluates it while tracing (the dispatcher query itself
# is no op Dynamo can trace, and a step that asks it would break a fullgraph compile).
@torch._dynamo.assume_constant_result
def _registered(device_type: str, op: str) -> bool:
    if device_type == "cpu":
        return True
    key = {"cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"cafin::{op}", key)


class Route:
    """A member's route to its kernels, fixed at construction from its `backend` argument.

    `fused`: the member asked for cafin's kernels (`backend="fused"`). `ops(device, dtype)`: the
    module whose ops a tensor of that device and dtype runs: `cafin.ops` where the build has the
    kernels for it, else `cafin.reference`. `batched_products(device)`: whether a stack of
    same-shaped products runs as one batched GEMM (GPUs) or as one GEMM per matrix (the CPU, whose
    bmm is itself such a loop and where a layer's products in a row run faster)."""

    def __init__(self, backend: str, owner: str, probe_op: str):
        from .. import ops, reference  # the op modules import the core
        self.backend = check_backend(backend, owner)
        self.fused = backend == "fused"
        self._probe_op = probe_op
        self._ops, self._reference = ops, reference

    def ops(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> ModuleType:
        if not self.fused or (dtype is not None and dtype not in KERNEL_DTYPES):
            return self._reference
        if device is not None and not has_kernels(device, self._probe_op):
            return self._reference
        return self._ops

    def runs_kernels(self, device: torch.device, dtype: torch.dtype) -> bool:
        return self.ops(device, dtype) is self._ops

    @staticmethod
    def batched_products(device: torch.device) -> bool:
        return device.type != "cpu"

    def __deepcopy__(self, memo) -> "Route":
        return self  # fixed at construction and holding modules: a copied member shares it

    def __repr__(self) -> str:
        return f"Route({self.backend!r})"
