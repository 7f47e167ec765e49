"""Two-level K-FAC's decompositions: each damped factor's eigendecomposition (eigenvalues
under the published floor zeroed), eager ones checked (retried in float64, else the previous
basis kept), compiled ones written in place (device-gated ones in one `torch.cond`); and the
K-FAC direction they give."""
from __future__ import annotations

import warnings

import torch

from ...core import EigendecompositionWarning
from ...maths import twolevel as twolevel_maths
from .settings import _EIG_FLOOR, _EIGEN


def kfac_inverse(state, v: torch.Tensor, extra: float = 0.0) -> torch.Tensor:
    """The K-FAC direction of v [d_out, d_in (+1)] from the stored eigendecompositions,
    Q_g ((Q_g^T v Q_x) / ((L_g + extra) (L_x + extra)^T)) Q_x^T."""
    qg, qx = state["Q_g"], state["Q_x"]
    s = (qg.t() @ v @ qx) / ((state["L_g"] + extra).unsqueeze(1) * (state["L_x"] + extra).unsqueeze(0))
    return qg @ s @ qx.t()


class Decompositions:
    """TwoLevelKFAC's eigendecompositions of its factors (a part of the class)."""

    def _eigen(self, state) -> tuple[torch.Tensor, ...]:
        # published: damping inside the eigendecomposition, tiny eigenvalues zeroed
        out = []
        for f in ("xxt", "ggt"):
            a = state[f]
            damping = self._hp("damping", a)
            lam, vec = torch.linalg.eigh(a + damping * torch.eye(a.shape[0], dtype=a.dtype, device=a.device))
            out += [lam * (lam > _EIG_FLOOR), vec]
        return tuple(out)

    def _decompose(self, states, checked: bool, gate=None, coarse: bool = False) -> None:
        """Every layer's eigendecompositions, stored once all are made. `checked` (eager): see
        `_eigen_checked`; under torch.distributed each rank makes its share and the results are
        shared, with the coarse matrix's inverse when `coarse`. Otherwise written in place, and
        `gate` (a device bool: device-gated steps) chooses in one `torch.cond` whether they are
        made at all (None: this is a T_inv step)."""
        if checked:
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
        if gate is None:
            new = tuple(t for st in states for t in self._eigen(st))
        else:
            # one branch for every layer (inductor reads a cond's predicate on the host, so one
            # cond is one sync, not one per layer)
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
