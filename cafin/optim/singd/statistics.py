"""SINGD's curvature statistics: what the hooks add to a layer's accumulators H_K, H_C, H_count
from its inputs and output gradients on the steps k with k % T == 0, and which of them a failed
closure's passes must give back.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ...core import Layer, route
from ...maths import singd as singd_maths

def accumulate(accumulators: tuple[Tensor, ...], terms: tuple[Tensor, ...], step, T) -> None:
    """accumulators += terms; device gated (a step tensor), only on steps k with k % T == 0."""
    if step is None:
        torch._foreach_add_(list(accumulators), list(terms))
        return
    due = torch.remainder(step, T) == 0
    for acc, h in zip(accumulators, terms):
        acc.add_(torch.where(due, h, torch.zeros_like(h)))


class Statistics:
    """The statistics the layers' hooks take (a mixin of `SINGD`; the core's hook protocol)."""

    def _statistics_gate(self, layer: Layer, device: torch.device):
        """Whether this step's passes take the layer's statistics (the settings the hooks read
        are checked first, eagerly)."""
        group = self._group(layer)
        if not route.compiled():
            self._check_statistics_settings(group, self._group_of[layer.anchor])
        return self._steps.due(group["T"], device)

    def take_input_statistics(self, layer: Layer, x: Tensor, step) -> None:
        """Take the statistics of `layer` from its input; its hook calls this in backward, with
        the input of the call whose output gradient then goes to `take_grad_statistics` (as
        singd forms H_K: a forward pass whose backward never runs adds nothing)."""
        group = self._group(layer)
        sk, dk = self._kinds(layer)[0], self._dtypes(layer)[0]
        if isinstance(layer.module, nn.Embedding):  # indices: counted, never cast
            h_k = singd_maths.embedding_inner(self._parts(layer, "K")[0], layer.module, x,
                                              group["kfac_approx"])
        else:
            a = singd_maths.input_rows(layer.module, x.to(dk), group["kfac_approx"])
            h_k = sk.inner(self._parts(layer, "K"), a.mT)
        accumulate(self._parts(layer, "H_K"), h_k, step, group["T"])

    def take_grad_statistics(self, layer: Layer, grad: Tensor, step) -> None:
        """Take the statistics of `layer` from its output gradient; its hook calls this."""
        group = self._group(layer)
        sc, dc = self._kinds(layer)[1], self._dtypes(layer)[1]
        g = singd_maths.grad_rows(layer.module, grad.to(dc), group["loss_average"], group["kfac_approx"])
        if self._grad_scale_prev != 1.0:  # singd: H_C from g / sqrt(previous step's scale)
            g = g / math.sqrt(self._grad_scale_prev)
        h_c = sc.inner(self._parts(layer, "C"), g.mT)
        accumulate(self._parts(layer, "H_C"), h_c, step, group["T"])
        count = self.state[layer.anchor]["H_count"]
        if step is None:
            count.add_(1.0)
        else:  # device gated: counted only on steps k with k % T == 0
            count.add_((torch.remainder(step, group["T"]) == 0).to(count.dtype))

    def _pass_state(self) -> list[Tensor]:
        """The accumulators that passes of this step can add to (the layers whose statistics are
        taken at this step): what a failed closure's passes must give back."""
        out = []
        for layer in self._curvature:
            T = self._group(layer)["T"]
            valid = isinstance(T, int) and not isinstance(T, bool) and T >= 1  # else: rejected later
            if valid and self._steps.host_due(T) is False:
                continue  # no pass of this step takes statistics for it
            out += [*self._parts(layer, "H_K"), *self._parts(layer, "H_C"), self.state[layer.anchor]["H_count"]]
        return out

