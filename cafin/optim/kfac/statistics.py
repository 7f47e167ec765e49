"""K-FAC's statistics: what the hooks take from each layer's input and output gradient, the fold
of the statistics into the factors' moving averages (inf/NaN statistics dropped and counted), and
the factor update of a step (on the host's interval or gated on the device)."""
from __future__ import annotations


import torch

from ... import factors
from ...core import Layer, amp, distributed, route
from ...maths import finite, kfac as kfac_maths


class Statistics:
    """The statistics part of `KFACPreconditioner`."""

    def _statistics_gate(self, layer: Layer, device: torch.device):
        self._refresh_settings()  # the hooks may fold with factor_decay: this step's value, checked
        launch, step = self._steps.due(self.factor_update_steps, device)
        # Set here, in the forward: the statistics callbacks run in the gradient hook, which a
        # compiled forward traces only if they write no Python state.
        if launch:
            self._state[layer.name].seen = True
            if not self._host_folds():
                self._unfolded = True  # the step folds this pass's statistics
        return launch, step

    def _host_folds(self) -> bool:
        """Whether the hooks fold on the host's count (eager, update_factors_in_hook); a
        compiled forward leaves the fold to the step (a hook that writes Python state breaks
        the graph)."""
        return self._update_factors_in_hook and not self._steps.device_gated and route.eager()

    def take_input_statistics(self, layer: Layer, x: torch.Tensor, step) -> None:
        """Take the statistics of `layer` from its input; its hook calls this."""
        st = self._state[layer.name]
        factors.kfac_input_factor(layer.module, x, self.kfac_approx, out=st.stat_A, accumulate=True)
        st.count_A.add_(1)
        if self._host_folds():
            self._mini_steps[layer.name] += 1
            if self._mini_steps[layer.name] % self._accumulation_steps == 0:
                self._fold_statistics([st.A], [st.stat_A], [st.count_A], st.A.device)

    def take_grad_statistics(self, layer: Layer, g: torch.Tensor, step) -> None:
        """Take the statistics of `layer` from its output gradient; its hook calls this."""
        st = self._state[layer.name]
        scale = None if self.grad_scaler is None else amp.current_scale(self.grad_scaler)
        if scale is not None:
            g = g / (scale.to(g.device) if isinstance(scale, torch.Tensor) else scale)
        factors.kfac_grad_factor(layer.module, g, self.kfac_approx, out=st.stat_G, accumulate=True,
                                 dtype=st.stat_G.dtype)
        st.count_G.add_(1)
        if self._host_folds() and self._mini_steps[layer.name] % self._accumulation_steps == 0:
            self._fold_statistics([st.G], [st.stat_G], [st.count_G], st.G.device)

    @property
    def skipped_factor_updates(self) -> int:
        """Factor statistics (one side of one layer's fold) dropped because they held inf or
        NaN, a GradScaler overflow pass's for instance (reads device counters)."""
        return self._skipped.total()

    def _fold_statistics(self, fs, ss, cs, device, step=None, interval=1) -> None:
        """Fold statistics into factors on `device`, one op call per factor dtype. A non-finite
        statistic is dropped and counted on the device: by the op, and here for the diagonal
        factors, before their fold empties them."""
        if not fs:
            return
        counter = self._skipped.counter(device)
        by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        decay = self._settings_on(device)["factor_decay"]
        for f, s, c in zip(fs, ss, cs):
            if f.dim() == 2:  # a diagonal factor (Embedding's A): nothing to symmetrise
                dropped = ((c.reshape(()) > 0) & ~finite.all_finite([s])[0].to(c.device)).to(counter.dtype)
                if step is not None:  # device gated: only a due step would have folded it
                    dropped = dropped * (torch.remainder(step, interval) == 0)
                counter.add_(dropped)
                kfac_maths.diagonal_factor_ema_(f, s, c.view(()), decay, step, interval)
                continue
            lists = by_dtype.setdefault(f.dtype, [[], [], []])
            lists[0].append(f)
            lists[1].append(s)
            lists[2].append(c.view(()))
        for dtype, (f_, s_, c_) in by_dtype.items():
            self._impl_for(device, dtype).kfac_factor_ema_(f_, s_, c_, decay, step, interval, counter)

    def _report_skipped(self) -> None:
        """Warn of the statistics dropped since the last report (by this step's fold or by the
        hooks' folds of its passes) where reading the count costs no sync: CPU counters, eager
        steps. On CUDA the count is `skipped_factor_updates`."""
        self._skipped.report(lambda n: f"KFACPreconditioner: {n} factor statistic(s) held inf/NaN and "
                             "were dropped; their factors keep their previous values", stacklevel=5)

    def reset_batch(self) -> None:
        """Drop the statistics taken since the last factor update."""
        for st in self._state.values():
            for t in (st.stat_A, st.stat_G, st.count_A, st.count_G):
                t.zero_()

    def _update_factors(self) -> None:
        gated = self._steps.host_due(self.factor_update_steps)
        if gated is None:  # device gated: fold every step, the op decides
            for device, sts in self._by_device().items():
                step = self._steps.tensor(device)
                fs = [t for st in sts for t in (st.A, st.G)]
                ss = [t for st in sts for t in (st.stat_A, st.stat_G)]
                cs = [t for st in sts for t in (st.count_A, st.count_G)]
                self._fold_statistics(fs, ss, cs, device, step, self.factor_update_steps)
        elif gated and (not self._update_factors_in_hook or self._unfolded):
            self._unfolded = False
            for device, sts in self._by_device().items():
                fs = [t for st in sts for t in (st.A, st.G)]
                ss = [t for st in sts for t in (st.stat_A, st.stat_G)]
                cs = [t for st in sts for t in (st.count_A, st.count_G)]
                self._fold_statistics(fs, ss, cs, device)
        if distributed() and gated is not False and self._layers and self._world > 1:
            self._reduce_factors()
