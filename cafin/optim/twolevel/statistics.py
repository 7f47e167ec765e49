"""Two-level K-FAC's statistics: the hooks' records of each forward call (input) and its
output gradient, turned on T_cov steps into per-sample rows x [B T, d_in (+1)] and output
gradients gy [B T, d_out] (stored, read again by the coarse space), the batch covariances and
their EMAs (the Kronecker factors xxt, ggt), and the drop of non-finite statistics."""
from __future__ import annotations

import warnings

import torch

from ...core import NonFiniteStatisticsWarning
from ...core.views import view_of
from ...maths.finite import all_finite


def layer_rows(layer, x, gy, dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows [B T, d_in (+1)], output gradients [B T, d_out] x B, T), sample by sample. A
    Linear (or Conv1D) on [B, T..., D] has T locations per sample (the product of the middle
    dims), as a Conv2d has its output positions."""
    # published: grad_output * grad_output.size(0), the per-sample gradient of a mean loss
    m, x, gy = layer.module, x.to(dtype), gy.to(dtype) * gy.shape[0]
    view = view_of(m)
    if view.conv:
        rows = view.input_rows(m, x)[0]
        T = view.locations(m, gy)
        gy = view.sample_rows(m, gy).reshape(-1, gy.shape[-3])
    else:
        if x.dim() < 2 or x.shape[0] == 0 or x[0].numel() == 0:
            raise ValueError(f"layer '{layer.name}': {type(m).__name__} input must be [batch, ..., "
                             f"features] with at least one sample and location, got shape {tuple(x.shape)}")
        rows = view.input_rows(m, x)[0]
        T = rows.shape[0] // x.shape[0]
        gy = gy.reshape(-1, gy.shape[-1])
    if m.bias is not None:
        rows = torch.cat([rows, torch.ones_like(rows[:, :1])], dim=1)
    elif not view.conv:
        # a Linear's rows are its input: stored rows are written in place by compiled and
        # captured steps, so they get memory of their own
        rows = rows.clone()
    return rows, gy, T


def batch_covariances(x, gy) -> tuple[torch.Tensor, torch.Tensor]:
    n = float(x.shape[0])
    return x.t() @ x / n, gy.t() @ gy / n


def fold_covariances(state, new, rho, gate) -> None:
    if gate is not None:  # the EMA on the device, kept where the gate holds
        for key, b in zip(("xxt", "ggt"), new):
            old = state[key]
            old.copy_(torch.where(gate, rho * old + (1 - rho) * b, old))
    elif rho is None:
        state["xxt"], state["ggt"] = new
    else:  # new tensors, not in place: a step that raises puts the old ones back
        state["xxt"] = state["xxt"].mul(rho).add(new[0], alpha=1 - rho)
        state["ggt"] = state["ggt"].mul(rho).add(new[1], alpha=1 - rho)


class Statistics:
    """TwoLevelKFAC's hooks, stored statistics and factor EMAs (a part of the class)."""

    # ------------------------------------------------------------------ hooks (core interface)
    def _statistics_gate(self, layer, device):
        # Every pass with update_stats is kept (references only: nothing is computed here);
        # step() uses them on T_cov steps and drops them on the others (published: the hooks
        # store only on T_cov steps, the same numbers). The "step" handed back is this call's
        # own record: the core gives it to both statistics callbacks of the same call when its
        # output gradient arrives, so a layer called twice in one forward pairs each input with
        # its own output gradient, and a call whose output gets none (a validation forward) adds
        # nothing.
        if not self.update_stats:
            return False, None
        # a layer forwarded here whose output then gets no gradient is named at the step
        self._pending.setdefault(id(layer), {"calls": [], "task": None})
        return True, {}

    def take_input_statistics(self, layer, x, call) -> None:
        """Take the statistics of `layer` from its input; its hook calls this."""
        pending = self._pending.setdefault(id(layer), {"calls": [], "task": None})
        task = torch._C._current_graph_task_id()
        if task != pending["task"]:
            # A new backward pass: only the calls it reaches count (accumulated micro-batches, or
            # two losses backpropagated one after the other: the last one's, as in the published
            # code).
            pending["calls"], pending["task"] = [], task
        call["x"] = x.detach()
        pending["calls"].insert(0, call)  # backward reaches a layer's calls last one first

    def take_grad_statistics(self, layer, g, call) -> None:
        """Take the statistics of `layer` from its output gradient; its hook calls this."""
        call["gy"] = g.detach()

    # ------------------------------------------------------------------ per-layer helpers
    def _missing(self, layer, what: str) -> RuntimeError:
        return RuntimeError(f"TwoLevelKFAC: no {what} for layer '{layer.name}' at step "
                            f"{self._iteration_counter}: run forward and backward in train mode with "
                            "update_stats = True before step() on the T_cov steps (step 0 first)")

    def _statistics(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Per layer (rows [B T, d_in (+1)], output gradients [B T, d_out] x B, T) of the pending
        calls that the last backward pass reached, in the state dtype; every layer checked before
        any is returned. Several calls of one layer in one pass are its locations, sample by
        sample (its per-sample gradient sums over them, as over a Conv2d's)."""
        out = []
        for layer, dtype in zip(self._layers, self._work):
            pending = self._pending.get(id(layer))
            calls = pending["calls"] if pending else []
            if pending is None:
                raise RuntimeError(
                    f"TwoLevelKFAC: layer '{layer.name}' was not called in a forward pass with "
                    f"update_stats = True (train mode, grad enabled) before step {self._iteration_counter}; "
                    "the coarse space couples every registered layer, so each one must take part in "
                    "every statistics pass (freeze a layer that does not, and it is skipped)")
            if not calls:
                raise RuntimeError(
                    f"TwoLevelKFAC: layer '{layer.name}' got no output gradient in the last backward pass "
                    f"before step {self._iteration_counter} (its output does not reach the loss)")
            parts = [layer_rows(layer, c["x"], c["gy"], dtype) for c in calls]
            if len({rows.shape[0] // T for rows, _, T in parts}) > 1:
                raise ValueError(f"layer '{layer.name}' was called {len(parts)} times in one pass on "
                                 "batches of different sizes: its per-sample gradient is not defined")
            if len(parts) == 1:
                out.append(parts[0])
                continue
            B = parts[0][0].shape[0] // parts[0][2]
            rows, gy = (torch.cat([p[i].reshape(B, p[2], -1) for p in parts], 1).reshape(-1, parts[0][i].shape[1])
                        for i in (0, 1))
            out.append((rows, gy, sum(p[2] for p in parts)))
        return out

    def _store(self, stats, gate):
        """Store the statistics; with `gate` (a device bool: steps the host does not check),
        written in place where it holds (a batch of another size replaces them: there is
        nothing to keep it with)."""
        for (rows, gy, T), group in zip(stats, self.param_groups):
            state = self.state[group["params"][0]]
            if gate is not None and "x" in state and state["x"].shape == rows.shape \
                    and state["gy"].shape == gy.shape:
                # written in place: a compiled step's state keeps its storage
                state["x"].copy_(torch.where(gate, rows, state["x"]))
                state["gy"].copy_(torch.where(gate, gy, state["gy"]))
            else:
                state["x"], state["gy"] = rows, gy
            state["num_locations"] = T
            self.batch_size = int(rows.shape[0] / T)  # published: overwritten at each collection

    @property
    def skipped_factor_updates(self) -> int:
        """Curvature updates dropped because their statistics (or the coarse matrix) held inf or
        NaN: the count every member keeps under this name (here `dropped_statistics`, counted on
        the host, which decides every two-level step)."""
        return self.dropped_statistics

    def _drop(self, what: str) -> None:
        self.dropped_statistics += 1
        warnings.warn(f"TwoLevelKFAC: step {self._iteration_counter}: {what} held inf/NaN and were "
                      "dropped; the curvature keeps its previous values", NonFiniteStatisticsWarning,
                      stacklevel=4)

    def _store_statistics(self, states, stats, checked: bool, gate):
        """Store this step's statistics and return (the batch covariances, the gate of their
        fold into the EMAs, a function that puts the previous statistics back). `checked`: the
        caller checks the covariances on the host and undoes the store if they are not finite.
        Otherwise they are stored and folded only where `gate` (None: this is a T_cov step) holds
        and every covariance is finite (one device bool, no host read), and nothing is undone."""
        if not checked:
            covs = [batch_covariances(rows, gy) for rows, gy, _ in stats]
            finite = all_finite([c for pair in covs for c in pair]).all()
            gate = finite if gate is None else gate & finite
            self._store(stats, gate)
            return covs, gate, None
        kept = [{key: st[key] for key in ("x", "gy", "num_locations") if key in st} for st in states]
        kept_batch = self.batch_size

        def undo():
            for state, entries in zip(states, kept):
                for key in ("x", "gy", "num_locations"):
                    state.pop(key, None)
                state.update(entries)
            self.batch_size = kept_batch
            self.__dict__.pop("_early_parts", None)

        self._store(stats, None)
        return [batch_covariances(st["x"], st["gy"]) for st in states], None, undo

    def _all_finite(self, covs) -> bool:
        """Whether every layer's batch covariances are finite; a drop is counted and warned of.
        Checked after the average over the ranks, so that every rank drops the same steps."""
        finite = all_finite([c for pair in covs for c in pair]).view(-1, 2).all(1)
        bad = [layer.name for layer, ok in zip(self._layers, finite.tolist()) if not ok]
        if bad:
            self._drop(f"the statistics (inputs or output gradients) of the layers {bad}")
        return not bad
