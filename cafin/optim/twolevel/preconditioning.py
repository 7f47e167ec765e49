"""Two-level K-FAC's preconditioning: each layer's gradient as a [d_out, d_in (+1)] matrix, the
first level (K-FAC's direction, eagerly one `kfac_eigen_products_` call per device and dtype into
kept buffers), the coarse correction y_l r_l, and the write over the gradients (K-FAC's
`kfac_precondition_apply_`, with the published clipping)."""
from __future__ import annotations

from collections import defaultdict

import torch

from ...core import average_over_ranks, distributed, route
from ...core.views import gradient_matrices_into, view_named
from ...maths import kfac as kfac_maths
from ...core.distribution.sharding import local, own_rows
from .coarse import location_projections
from .decompositions import kfac_inverse


def weight_matrix(group, w: torch.Tensor) -> torch.Tensor:
    """A weight gradient as [d_out, d_in]: a view (a Conv1D's [in, out] transposed)."""
    view = view_named(group["layer_type"])
    return w.t() if view.transposed else w.reshape(w.shape[0], -1)


def grad_matrix(group, grads=None) -> torch.Tensor:
    """[d_out, d_in (+1)]: the weight gradient with the bias column (`grads`: the full
    gradients gathered under FSDP2 instead of the parameters' own)."""
    w, b = grads if grads is not None else (
        group["params"][0].grad, group["params"][1].grad if len(group["params"]) == 2 else None)
    m = weight_matrix(group, w)
    if b is not None:
        m = torch.cat([m, b.reshape(-1, 1)], dim=1)
    return m


def raw_gradient(group, dtype: torch.dtype, grads=None) -> torch.Tensor:
    """The gradient matrix as a tensor of its own in `dtype` (the bias column's
    concatenation is one already: not copied twice)."""
    m = grad_matrix(group, grads)
    own = len(group["params"]) == 2 and (grads is None or grads[1] is not None)
    return m if own and m.dtype == dtype else m.to(dtype, copy=True)


def published_layout(group, r: torch.Tensor) -> torch.Tensor:
    """The published right-hand side reads the flat [weight, bias] gradient as a
    [d_out, d_in + 1] matrix, which puts bias entries and weights in the wrong places."""
    if len(group["params"]) == 1:
        return r
    return torch.cat([r[:, :-1].reshape(-1), r[:, -1]]).reshape(r.shape)


class Preconditioning:
    """TwoLevelKFAC's directions and their write over the gradients (a part of the class)."""

    def _raw_gradients(self, full=None) -> list[torch.Tensor]:
        """Every layer's gradient matrix [d_out, d_in (+1)] as a tensor of its own in its work
        dtype (`raw_gradient`; `full`: the gradients gathered under FSDP2). Where the host
        decides, into kept buffers by one copy over every weight and bias
        (`gradient_matrices_into`). A compiled or device-gated step makes them in its graph."""
        grads = [full[i] if full else
                 (g["params"][0].grad, g["params"][1].grad if len(g["params"]) == 2 else None)
                 for i, g in enumerate(self.param_groups)]
        if not self._checked():
            return [raw_gradient(g, dtype, grad)
                    for g, dtype, grad in zip(self.param_groups, self._work, grads)]
        return gradient_matrices_into(self._raw_buffers, [
            (i, weight_matrix(group, w), b, dtype)
            for i, (group, dtype, (w, b)) in enumerate(zip(self.param_groups, self._work, grads))])

    def _kfac_directions(self, states, raws) -> list[torch.Tensor]:
        """Every layer's first-level (K-FAC) direction, per location for convolutions. Eager, the
        eigenvalues' division and the per-location one are one kept scaling (`_scaling`), and
        the products of every layer are one `kfac_eigen_products_` call per device and dtype,
        into kept buffers (`_product_buffers`)."""
        if route.compiled():
            pres = []
            for group, state, raw in zip(self.param_groups, states, raws):
                p = kfac_inverse(state, raw)
                locations = view_named(group["layer_type"]).conv or state["num_locations"] != 1
                pres.append(p / state["num_locations"] if locations else p)
            return pres
        pres = []
        products: dict[tuple, list[tuple[torch.Tensor, ...]]] = defaultdict(list)
        for i, (group, state, raw) in enumerate(zip(self.param_groups, states, raws)):
            locations = view_named(group["layer_type"]).conv or state["num_locations"] != 1
            scaling = self._scaling(i, state, state["num_locations"] if locations else 1)
            mid, work = self._product_buffers(i, raw)
            products[(raw.device, raw.dtype)].append((mid, work, raw, state["Q_x"], state["Q_g"], scaling))
            pres.append(mid)  # written by the call below
        for (device, dtype), entries in products.items():
            self._kernels.ops(device, dtype).kfac_eigen_products_(*zip(*entries))
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
        if not self._checked():  # a host-side cache would be a decision frozen in a graph
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
        ws = [w.t() if view_named(g["layer_type"]).transposed else w
              for w, g in zip(ws, self.param_groups)]
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

    def _two_level(self, raws, pres) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """The two-level directions: the K-FAC directions `pres`, corrected in place, and a
        per-layer constant the write adds (None: nothing); None without a coarse matrix."""
        if self.coarse_space == "none":  # the first level alone: the paper's K-FAC baseline
            return pres, None
        states = [self.state[g["params"][0]] for g in self.param_groups]
        if self.published_bugs:
            raws = [published_layout(g, r) for g, r in zip(self.param_groups, raws)]
        residuals = [None] * len(states)
        if self.coarse_space == "residual":
            # r = g - F x - damping x, x the K-FAC direction, F x the exact empirical Fisher product
            w = sum(self._samples(s, location_projections(s, p), False) for s, p in zip(states, pres))
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
