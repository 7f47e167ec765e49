"""Where a step's tensors live: the model behind its wrappers, a tensor on a given device. How a
step runs (eager, compiled, captured) is `route.py`'s."""
from __future__ import annotations

import torch
from torch import nn

_COMPILED = torch._dynamo.eval_frame.OptimizedModule
_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel, _COMPILED)


def unwrap(model: nn.Module) -> nn.Module:
    while isinstance(model, _WRAPPERS):
        model = model._orig_mod if isinstance(model, _COMPILED) else model.module
    return model


def to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """`t` on `device` (itself when it is there already, or None)."""
    return t if t is None or t.device == device else t.to(device)
