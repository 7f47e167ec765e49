"""K-FAC's decompositions: on inv_update_steps, each live layer's factors as eigenbases and
eigenvalues (or damped inverses), batched over equal shapes on GPUs; eagerly a failed eigh is
retried in float64 and a layer whose decomposition fails keeps all its previous ones."""
from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from ...core import EigendecompositionWarning, route
from ...core.route import Route
from ...maths import kfac as kfac_maths
from .compat import ComputeMethod
from .state import _LayerState


class Decompositions:
    """The decomposition part of `KFACPreconditioner`."""

    def decompose(self) -> None:
        """Recompute every live layer's decompositions now, with the current damping (eagerly;
        for a captured step whose `decompose_in_step` is False). Under torch.distributed it is
        a collective, as the step's: each rank decomposes its share and the second-order data is
        shared."""
        self._compute_inverses()

    def _compute_inverses(self) -> None:
        """Decompose this rank's share of the factors, then share the results with the other
        gradient workers of each layer."""
        self._decompose(None, self._my_sides(share=True))
        self._share_second_order()
        self._share_decomposed()

    def _update_inverses(self) -> None:
        """On inv_update_steps: eagerly, this rank's share of the decompositions, then shared; a
        compiled or device-gated step decomposes every factor on the device (no collective), a
        device-gated one kept only where the device's k says it is due."""
        due = self._steps.host_due(self.inv_update_steps)
        if due is False:
            return
        if due and route.eager():
            self._compute_inverses()
            return
        self._check_device_gated()
        devices = {self._state[layer.name].A.device for layer in self._layers}
        if len(devices) > 1:
            raise RuntimeError("a compiled or device-gated K-FAC step needs every layer on one device")
        if devices:
            device = devices.pop()
            # every layer is this rank's to precondition (COMM_OPT, checked): all of them
            self._decompose(None if due else
                            torch.remainder(self._steps.tensor(device), self.inv_update_steps) == 0)

    def _decompose(self, gate: torch.Tensor | None, sides: set[tuple[str, str]] | None = None) -> None:
        """Decompositions of the live layers' factors (those in `sides`; None: all), batched
        over factors of equal shape and dtype. With `gate` (a device bool), new values are kept
        only where it holds."""
        live = [layer for layer in self._layers if self._live(layer)]
        eigen = self.compute_method is ComputeMethod.EIGEN
        prediv = eigen and self.compute_eigenvalue_outer_product
        eigenvalues: dict[tuple[str, str], torch.Tensor] = {}
        # Eagerly, every result is kept aside and stored once all are made: a layer whose
        # decomposition fails (in decompose_dtype, then in float64) keeps all its previous ones.
        results: list[tuple[_LayerState, str, torch.Tensor]] = []
        failed: set[int] = set()
        for side in ("a", "g"):
            # Batched over equal shapes on GPUs (fewer launches); one by one on CPUs, where
            # LAPACK loops anyway and a batched call rounds differently from kfac-pytorch's.
            buckets: dict[tuple, list[_LayerState]] = defaultdict(list)
            for layer in live:
                if sides is not None and (layer.name, side) not in sides:
                    continue
                f = getattr(self._state[layer.name], side.upper())
                if f.dim() == 2:  # a diagonal factor: its own eigenvalues, basis I
                    self._diagonal_decomposition(self._state[layer.name], results, eigenvalues, prediv)
                    continue
                batched = Route.batched_products(f.device)
                key = (f.shape[1:], f.dtype, f.device) if batched else (layer.name, None, f.device)
                buckets[key].append(self._state[layer.name])
            for (_, _, device), sts in buckets.items():
                stacked = torch.cat([getattr(st, side.upper()) for st in sts])
                sizes = [st.A.shape[0] for st in sts]
                if eigen:
                    out = self._eigen_decompose(stacked, sts, side, gate)
                    if out is None:
                        failed.update(id(st) for st in sts)
                        continue
                    for st, di, qi in zip(sts, out[0].split(sizes), out[1].split(sizes)):
                        results.append((st, "q" + side, qi))
                        if prediv:
                            eigenvalues[(id(st), side)] = di
                        else:
                            results.append((st, "d" + side, di))
                else:
                    inv = kfac_maths.damped_inverse(stacked, self._settings_on(device)["damping"],
                                            decompose_dtype=self.decompose_dtype,
                                            out_dtype=self.inv_dtype)
                    for st, ii in zip(sts, inv.split(sizes)):
                        results.append((st, f"{side}_inv", ii))
        for st, key, value in results:
            if id(st) not in failed:
                _store(st.second, key, value, gate)
        for layer in live:
            st = self._state[layer.name]
            if id(st) in failed or (sides is not None and (layer.name, "a") not in sides
                                    and (layer.name, "g") not in sides):
                continue
            if gate is None:
                st.decomposed = True
            if prediv:
                damping = self._settings_on(st.A.device)["damping"].to(self.inv_dtype)
                _store(st.second, "dgda", kfac_maths.eigenvalue_reciprocal(
                    eigenvalues[(id(st), "g")], eigenvalues[(id(st), "a")], damping), gate)

    def _diagonal_decomposition(self, st: _LayerState, results: list, eigenvalues: dict,
                                prediv: bool) -> None:
        """The decomposition of a diagonal A (an Embedding's): eigenvalues its entries, or the
        inverse 1 / (a + damping); it cannot fail."""
        if self.compute_method is ComputeMethod.EIGEN:
            d = kfac_maths.diagonal_eigenvalues(st.A, decompose_dtype=self.decompose_dtype,
                                                out_dtype=self.inv_dtype)
            if prediv:
                eigenvalues[(id(st), "a")] = d
            else:
                results.append((st, "da", d))
        else:
            damping = self._settings_on(st.A.device)["damping"]
            results.append((st, "a_inv", kfac_maths.diagonal_damped_inverse(
                st.A, damping, decompose_dtype=self.decompose_dtype, out_dtype=self.inv_dtype)))

    def _eigen_decompose(self, stacked, sts, side, gate):
        """(d, q) of stacked factors; eagerly, a failed eigh is retried in float64, and if that
        fails too, None (with a warning: the layers keep their previous decompositions)."""
        if gate is not None or not route.eager():  # no exception to catch, no warning
            return kfac_maths.eigen_decompose(stacked, decompose_dtype=self.decompose_dtype,
                                              out_dtype=self.inv_dtype)
        d_q = kfac_maths.eigen_decompose(stacked, decompose_dtype=self.decompose_dtype,
                                         out_dtype=self.inv_dtype, retry_in=(torch.float64,))
        if d_q is not None:
            return d_q
        names = [layer.name for layer in self._layers if any(self._state[layer.name] is st for st in sts)]
        warnings.warn(f"KFACPreconditioner: the eigendecomposition of the {side.upper()} factor of "
                      f"{names} failed in {self.decompose_dtype} and in float64; they keep their "
                      "previous decompositions", EigendecompositionWarning, stacklevel=4)
        return None


def _store(store: dict, key: str, value: torch.Tensor, gate) -> None:
    """store[key] <- value in place (compiled and captured steps keep addresses); with a
    device-bool gate, only where the gate holds."""
    old = store[key]
    if gate is None:
        old.copy_(value)
    else:
        old.copy_(torch.where(gate, value.to(old.dtype), old))
