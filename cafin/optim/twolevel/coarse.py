"""Two-level K-FAC's coarse space: the coarse vectors r_l of each space, the per-sample
projections <r_l, G_n,l> they take of the stored statistics, and the coarse matrix F_c assembled
the way `backend` says ("fused": every layer's projections at once, U^T U / B; "reference":
pair by pair from Fisher-vector products, as published), folded into its EMA on T_cov steps."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core import average_over_ranks, distributed, route
from .decompositions import kfac_inverse
from .settings import _NORM_EPS


def location_projections(state, R: torch.Tensor) -> torch.Tensor:
    """p[..., m] = gy_m^T R x_m for R [..., d_out, d_in'] (row-wise bilinear form)."""
    return ((state["gy"] @ R) * state["x"]).sum(-1)


class Coarse:
    """TwoLevelKFAC's coarse vectors and coarse matrix (a part of the class)."""

    # ------------------------------------------------------------------ per-sample projections
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
                and route.eager())

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
        return kfac_inverse(state, v, self._hp("damping", v) if self.published_bugs else 0.0)

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
        if self._route.fused:
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
                p = location_projections(state, torch.stack(rs))
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
            (ri * self._fvp(si, self._samples(sj, location_projections(sj, rj), False))).sum()
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

    def _update_coarse(self, vectors) -> bool:
        """On T_cov steps: assemble F_c from the stored statistics, fold it into the EMA with
        the factors' rho, and invert it (linalg.inv_ex: torch.inverse's numbers without its
        error-check sync). A new F_c with inf/NaN (from a non-finite gradient in the residual
        space's vectors) is dropped. Returns whether there is a coarse matrix to use."""
        k, cov, _ = self._schedule()
        if self._checked():
            if cov:
                folded = self.__dict__.pop("_coarse_folded", None)  # this step's, with the decompositions
                if folded is None:
                    folded = self._fold_coarse(vectors)
                    if folded:
                        self._solve_coarse()
                if not folded:
                    return self.f_coarse is not None
            return True
        gated = isinstance(cov, torch.Tensor)
        if not gated and not cov:  # compiled, not a T_cov step: nothing launched
            return True
        rho = self._rho(k, False)

        def fresh():
            new = self.coarse_matrix(vectors)
            f = torch.where(torch.isfinite(new).all(), rho * self.f_coarse + (1 - rho) * new, self.f_coarse)
            return f, torch.linalg.inv_ex(f)[0]

        if not gated:
            new = fresh()
        else:  # made on the T_cov steps the device counts
            new = torch.cond(cov, fresh, lambda: (self.f_coarse.clone(), self.f_coarse_inv.clone()), ())
        self.f_coarse.copy_(new[0])
        self.f_coarse_inv.copy_(new[1])
        return True

    def _fold_coarse(self, vectors) -> bool:
        """Eager T_cov steps: the new F_c (from the parts averaged with the covariances, or
        assembled and averaged now) folded into its EMA; False, and F_c kept, where it holds
        inf/NaN (dropped, with a warning)."""
        rho = self._rho(self._schedule()[0], True)
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
