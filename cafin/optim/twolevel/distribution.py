"""Two-level K-FAC under torch.distributed: the owner rank of every decomposition (each
factor's eigendecomposition and the coarse matrix's inverse, assigned greedily by cost with
cafin.core.distribution.kaisa), their exchange, the average of the statistics over the ranks, and FSDP2's
gathering of the full gradients."""
from __future__ import annotations

from typing import Any

import torch

from ...core import average_over_ranks, distributed
from ...factors import factor_sizes
from ...maths import twolevel as twolevel_maths
from ...core.distribution.sharding import gather_rows
from ...core.distribution.kaisa import exchange, factor_costs, greedy_assignment


class Distribution:
    """TwoLevelKFAC's owner ranks and collectives (a part of the class)."""

    def _assign_work(self) -> None:
        """Under torch.distributed (more than one rank, distribute_decompositions): the owner
        rank of every decomposition, the same on every rank: each layer's two factors (A, the
        input side's, and G) and the coarse matrix's inverse, greedily by cost (KAISA's rule,
        one group of every rank). `assignment` maps layer names to {"A": rank, "G": rank};
        `coarse_worker` is the rank that inverts F_c. Both None: every rank makes every one."""
        self.assignment = self.coarse_worker = None
        self._owners = None  # per layer, the owner ranks of (A, G)
        if not (self.distribute_decompositions and distributed()):
            return
        import torch.distributed as dist
        group = self.process_group
        world = dist.get_world_size(group)
        if world == 1:
            return
        self._rank, self._world = dist.get_rank(group), world
        strategy = self.assignment_strategy.name.lower()
        # layers keyed by position, the coarse inverse by the next one: no name can clash
        work: dict[Any, dict[str, float]] = factor_costs(
            {i: factor_sizes(layer.module) for i, layer in enumerate(self._layers)}, strategy)
        if self.coarse_space != "none":
            n = len(self._layers) * (2 if self.krylov else 1)
            work[len(self._layers)] = {"F_c": float(n ** (3 if strategy == "compute" else 2))}
        owners = greedy_assignment(work, [list(range(world))], world, self.colocate_factors)
        self._owners = [(owners[i]["A"], owners[i]["G"]) for i in range(len(self._layers))]
        self.assignment = {layer.name: {"A": a, "G": g} for layer, (a, g) in zip(self._layers, self._owners)}
        if self.coarse_space != "none":
            self.coarse_worker = owners[len(self._layers)]["F_c"]

    def _gather(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """FSDP2: every layer's full weight and bias gradients, in one all_gather per dtype (the
        two-level direction multiplies whole gradient matrices and couples the layers)."""
        tensors = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    raise RuntimeError(f"TwoLevelKFAC: a parameter of shape {tuple(p.shape)} has no "
                                       "gradient: run backward before step()")
                tensors.append(p.grad)
        full = iter(gather_rows(tensors))
        return [(next(full), next(full) if len(g["params"]) == 2 else None) for g in self.param_groups]

    def _shared_eigen(self, states, coarse: bool) -> list[list]:
        """torch.distributed: this rank's share of the eigendecompositions (and, `coarse`, the
        coarse matrix's inverse if it owns it), then every owner's results on every rank, in
        one `exchange` per (device, dtype) over the process group. Each factor travels with a
        flag (1: decomposed or kept, 0: failed with no previous basis), so a failure raises on
        every rank, not only on its owner."""
        me = self._rank
        mine = {(i, j) for i, pair in enumerate(self._owners) for j in range(2) if pair[j] == me}
        own = self._eigen_checked(states, mine)
        held: dict[tuple, list[list[torch.Tensor]]] = {}
        out, flags = [[None, None] for _ in states], []
        for i, state in enumerate(states):
            for j, f in enumerate(("xxt", "ggt")):
                a, owner = state[f], self._owners[i][j]
                r = own[i][j]
                if owner == me and not isinstance(r, str):
                    lam, vec = r
                    flag = torch.ones(1, dtype=a.dtype, device=a.device)
                else:  # received (column-major, as eigh returns it: the products round alike)
                    lam = torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
                    vec = torch.zeros_like(a).t()
                    flag = torch.zeros(1, dtype=a.dtype, device=a.device)
                lists = held.setdefault((a.device, a.dtype), [[] for _ in range(self._world)])
                lists[owner] += [lam, vec, flag]
                out[i][j] = (lam, vec)
                flags.append(((i, j), flag))
        if coarse:
            f = self.f_coarse
            inv = twolevel_maths.coarse_inverse(f) if self.coarse_worker == me else torch.empty_like(f).t()
            held.setdefault((f.device, f.dtype), [[] for _ in range(self._world)])[self.coarse_worker].append(inv)
            self.f_coarse_inv = inv
        for lists in held.values():
            exchange(lists, me, self.process_group)
        ok = torch.cat([flag.cpu() for _, flag in flags]).tolist()  # one host read: eager steps
        for ((i, j), _), good in zip(flags, ok):
            if good != 1.0:
                raise RuntimeError(f"TwoLevelKFAC: the eigendecomposition of layer '{self._layers[i].name}''s "
                                   f"{('xxt', 'ggt')[j]} factor failed on rank {self._owners[i][j]} (its owner) in "
                                   f"{states[i]['xxt'].dtype} and in float64, and there is no previous basis to keep")
        return out

    def _solve_coarse(self) -> None:
        """F_c's inverse: on its owner rank, shared in one `exchange` (torch.distributed), or here."""
        f = self.f_coarse
        if self._owners is None:
            self.f_coarse_inv = twolevel_maths.coarse_inverse(f)
            return
        me = self._rank
        inv = twolevel_maths.coarse_inverse(f) if self.coarse_worker == me else torch.empty_like(f).t()
        held = [[] for _ in range(self._world)]
        held[self.coarse_worker].append(inv)
        exchange(held, me, self.process_group)
        self.f_coarse_inv = inv

    def _average(self, covs, raws) -> None:
        """Data parallel: the batch covariances averaged over the ranks, and with them the new
        coarse matrix when its vectors do not depend on this step's factors (the ones vectors of
        nicolaides and tpselepedis): one collective. The other spaces build their vectors from
        the averaged factors' eigendecomposition, so their coarse matrix needs a second one."""
        tensors = [c for pair in covs for c in pair]
        early = raws is not None and not self.krylov and self.coarse_space in ("nicolaides", "tpselepedis")
        if early:
            ones = [self._coarse_vectors(self.state[g["params"][0]], r, None) for g, r in zip(self.param_groups, raws)]
            self._early_parts = (self._coarse_parts(ones), ones)
            tensors += self._early_parts[0]
        if tensors:  # in place: the covariances and parts now hold the averages
            average_over_ranks(tensors, self.process_group)
