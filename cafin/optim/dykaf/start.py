"""DyKAF's first step of a parameter: its state built from its first gradient (the kind, the
moments, the Kronecker factors and their eigenbases), installed only when complete; a gradient
that cannot start it (inf/NaN, factors that are not finite, an eigendecomposition that failed) is
dropped, counted and warned of, and the parameter backs off before its next try."""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ...core import NonFiniteStatisticsWarning
from ...maths import dykaf as dykaf_maths
from ...maths import state_dtype
from .factors import _ema

# A parameter whose first gradient was dropped (inf/NaN in it or in the factors it gives, or an
# eigendecomposition that failed) tries again after 2^(drops - 1) - 1 skipped steps, at most
# _MAX_WAIT: the next step after the first drop, then after 1, 3, 7, ... steps, so that a model
# gone non-finite does not pay the 100-iteration start on every step.
_MAX_WAIT = 63


class Start:
    """The first-step methods of `DyKAF` (a mixin: it reads the optimizer's settings and state)."""

    def _kind(self, p: torch.Tensor, group) -> str:
        merged = self._merged_shape(p, group)
        if merged is None and p.dim() == 2:
            return "kron2d"
        # The published code compares only mode 0 of a 4-D weight with max_precond_dim (and
        # crashes when that one is over it); cafin's default honours the limit on every mode.
        modes = p.shape[:1] if self.published_bugs else p.shape
        if merged is None and p.dim() == 4 and max(modes) <= group["max_precond_dim"]:
            return "kron4d"
        return "ema"

    def _init_state(self, p: torch.Tensor, g: torch.Tensor, group) -> str | None:
        """Build a parameter's state from its first gradient. The state is installed only when
        complete; returns None when it is, else why it is not: a gradient holding inf/NaN,
        factors that are not finite (e.g. a power iteration on a gradient so small that its
        squares underflow) or an eigendecomposition that fails also in float64. The caller
        drops that gradient (`_drop_start`)."""
        state: dict[str, Any] = {}
        work = state_dtype(p.dtype)
        g = g.to(work).contiguous()
        if not bool(torch.isfinite(g).all()):  # before the power iterations, which cost ~100 GEMMs
            return "holds inf/NaN"
        shampoo_beta = float(group["shampoo_beta"])
        beta = shampoo_beta if shampoo_beta >= 0 else float(group["betas"][1])
        state["step"] = 0
        state["device_step"] = torch.zeros((), dtype=torch.float64, device=p.device)
        # the base of the ops' float64 scalars (guard, eps, weight decay), made here, eagerly: a
        # compiled step that made it would recompile on the next
        self._one(p.device, torch.float64)
        state["precondition_frequency"] = group["precondition_frequency"]
        state["shampoo_beta"] = beta
        state["exp_avg"] = torch.zeros_like(p, dtype=work, memory_format=torch.contiguous_format)
        kind = state["kind"] = self._kind(p, group)
        if kind == "kron2d" and self.adam_rank_one:
            eps = float(group["eps"])
            state["l"] = torch.full((p.shape[0],), eps, dtype=work, device=p.device)
            state["r"] = torch.full((p.shape[1],), eps, dtype=work, device=p.device)
        else:
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        factors = self._first_factors(p, g, group, kind, beta)
        kept = [f for f in factors if f is not None]
        if kept and not bool(torch.stack([torch.isfinite(f).all() for f in kept]).all()):
            return ("gives factors that are not finite (a gradient too small or too large for "
                    "the power iteration in this dtype?)")
        state["factors"] = factors
        if self._owners is not None:
            # the eigendecompositions on their owner ranks at the end of the step, shared as the
            # refreshes are; the state is installed (or the gradient dropped) there
            self._owners.defer_start(p, state, group)
            return None
        try:
            bases = [None if f is None else dykaf_maths.eigenbasis(f) for f in factors]
        except torch.linalg.LinAlgError as e:  # eigenbasis has already retried in float64
            return f"gives factors whose eigendecomposition failed ({e})"
        self._install_start(p, state, bases)
        return None

    def _install_start(self, p: torch.Tensor, state: dict[str, Any], bases: list) -> None:
        """Install a parameter's first state, its factors' eigenbases given."""
        stacked = (self._route.fused and state["kind"] == "kron2d"
                   and all(f is not None for f in state["factors"]))
        if stacked:
            # The batched GEMMs read row-major bases (factors._stack): made so here, once; every
            # refresh is then copied into these buffers (the other kinds' projections keep the
            # layout eigh and QR give, and their numbers with it).
            bases = [Q.contiguous() for Q in bases]
        state["bases"] = bases
        if stacked:
            # the rotated moment's buffer (update.py), in the state from the start so that a
            # checkpoint template made from a fresh optimizer (torch.distributed.checkpoint) holds it
            state["exp_avg_rot"] = torch.zeros_like(state["exp_avg"])
            state["exp_avg_rot_step"] = -1
        # In place: under FSDP2 the parameter and its full-size stand-in share this dict.
        self.state[p].update(state)

    def _finish_start(self, p: torch.Tensor, state: dict[str, Any], bases: list | None,
                      why: str | None) -> None:
        """A deferred first step, its eigenbases made by their owners: installed, or, where an
        eigendecomposition failed (`why`), the gradient dropped on every rank."""
        if why is not None:
            self._drop_start(p, f"gives factors whose eigendecomposition failed ({why})")
            return
        self._install_start(p, state, bases)
        self._waits.pop(p, None)

    def _drop_start(self, p: torch.Tensor, why: str) -> None:
        """A first gradient that cannot start the parameter's state: dropped (nothing is
        written), counted (`skipped_factor_updates`), warned of, and the parameter waits before
        its next try (_MAX_WAIT)."""
        wait = self._waits.setdefault(p, [0, 0])
        wait[0] += 1
        wait[1] = min(2 ** (wait[0] - 1) - 1, _MAX_WAIT)
        self._dropped += 1
        warnings.warn(f"DyKAF: parameter of shape {tuple(p.shape)}: its first gradient {why}; "
                      f"dropped (its drop {wait[0]}, {self._dropped} in all): its state is not "
                      f"built, and it tries again with the gradient of {wait[1] + 1} step(s) "
                      "from now", NonFiniteStatisticsWarning, stacklevel=6)

    @property
    def skipped_factor_updates(self) -> int:
        """First gradients dropped because they (or the factors they gave) held inf/NaN, or
        because the eigendecomposition of their factors failed: the parameter then keeps no
        state and tries again later (backing off: 1, 2, 4, ... up to 64 steps apart)."""
        return self._dropped

    def _first_factors(self, p: torch.Tensor, g: torch.Tensor, group, kind: str,
                       beta: float) -> list[torch.Tensor | None]:
        """A parameter's Kronecker factors from its first gradient `g` (in the state dtype):
        per side, a factor, or None for a side that is not preconditioned."""
        if kind == "kron2d":
            return self._start_2d(g, group, beta)
        if kind == "kron4d":
            start = dykaf_maths.hopm_start(g, self.seed, self.published_bugs)
            return dykaf_maths.tensor_proj_split(start, g, beta, self.published_bugs)
        if p.dim() == 1 and not group["precondition_1d"]:
            return [None]
        limit = group["max_precond_dim"]
        merged = self._merged_shape(p, group)
        gm = self._to_merged(g, merged) if merged is not None else g
        factors = [None if sh > limit else torch.zeros(sh, sh, dtype=g.dtype, device=p.device)
                   for sh in gm.shape]
        _ema(factors, gm, beta)
        return factors

    def _start_2d(self, g: torch.Tensor, group, beta: float) -> list[torch.Tensor | None]:
        m, n = g.shape
        limit = group["max_precond_dim"]
        if m > limit or n > limit:  # one side (or none) kept, as an undecayed sum of g g^T
            left = None if m > limit else dykaf_maths.one_sided(
                dykaf_maths.one_sided_start(m, g), g, True)
            right = None if n > limit else dykaf_maths.one_sided(
                dykaf_maths.one_sided_start(n, g), g, False)
            return [left, right]
        if group["init"] == "kron":
            L, R = dykaf_maths.kron_start(g, self.seed)
        elif group["init"] == "eps":
            L, R = dykaf_maths.eps_start(m, g), dykaf_maths.eps_start(n, g)
        else:
            return list(dykaf_maths.proj_split_from_zero(g, beta))
        return list(dykaf_maths.proj_split(L, R, g, beta))
