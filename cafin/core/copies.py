"""What `copy.deepcopy` of a member copies and what the copy shares with the original, for both
bases (`CoreOptimizer`, `Preconditioner`): the tensors, settings and state are the copy's own;
what is fixed at construction is shared (the op modules `cafin.ops` and `cafin.reference`, the
process group); the statistics hooks are the copy's own, on the copied model, and the
`HookOwner` base gives both bases their removal."""
from __future__ import annotations

import copy
import types
from typing import Any

from .hooks import Hooks


def copy_member(original: Any, memo: dict, skip: tuple[str, ...]) -> Any:
    """A new object of `original`'s type holding a deep copy of each attribute not in `skip`,
    sharing the op modules (wherever they are held) and the process group."""
    from .. import ops, reference  # the op modules import the core
    for shared in (ops, reference, getattr(original, "process_group", None)):
        if shared is not None:
            memo.setdefault(id(shared), shared)
    new = type(original).__new__(type(original))
    memo[id(original)] = new
    for key, value in original.__dict__.items():
        if key not in skip:
            shared = isinstance(value, types.ModuleType)
            setattr(new, key, value if shared else copy.deepcopy(value, memo))
    return new


class HookOwner:
    """A member whose statistics come from hooks on the model (`_hooks`; None once removed)."""

    _hooks: Hooks | None

    def remove_hooks(self) -> None:
        """Remove the statistics hooks from the model (the factors are kept)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
