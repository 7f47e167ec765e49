"""Two-level K-FAC (Koroko et al., arXiv 2303.18083; `TwolevelKFAC` of Abdoulaye-Koroko/natural-gradients).

K-FAC's block-diagonal direction plus a coarse-space correction that couples the layers:

    v_l = F_l^{-1} g_l + y_l r_l,    y = F_c^{-1} (R g),    (R g)_l = <r_l, g_l>,

with one coarse vector r_l per layer (two with `krylov=True`) and F_c the empirical Fisher restricted
to the coarse space, (F_c)_ij = (1/B) sum_n <r_i, G_n,i> <r_j, G_n,j> + damping * |layer i| * [i == j].

Used like the published code: set `update_stats`, call `step(update_params=True)` after backward
(it rewrites every `.grad`), then step a torch optimizer (SGD with momentum). The published
conventions, odd ones included, are kept (docs/twolevel.md lists them). Four published bugs are
fixed unless `published_bugs=True` (docs/twolevel.md says why each is a bug).

How F_c is assembled (`backend`):
- "fused": the per-sample coarse projections of every layer at once, an N x L matrix U, then
  F_c = U^T U / B; a projection <r, g_n x_n^T> is a row-wise bilinear form (never the N' x N'
  matrix gy^T R x of the published code), and for the ones vector (nicolaides, tpselepedis) it is a
  product of row sums.
- "reference": pair by pair, each entry from a Fisher-vector product, as the published code does
  (kept to test the cheap assembly against and to time it).

Intervals follow the core's StepCounter: decided on the host, eagerly and under torch.compile
(torch.compile(step, fullgraph=True) after one eager step builds one graph per phase, and a step
that is not due launches no curvature work). damping, alpha and clipping are 0-dim
tensors behind properties. Under torch.distributed the batch covariances and, when its vectors
allow, the new coarse matrix are averaged in one collective (docs/twolevel.md, "Data parallel"),
and the decompositions are shared out: each factor's eigendecomposition, and the coarse matrix's
inverse, is made by one owner rank (the greedy assignment of cafin.core.distribution.kaisa, balanced by
cost) and the results reach every rank in one exchange per (device, dtype).

One file per job, each a part (mixin) of `TwoLevelKFAC` or plain functions:

- `optimizer.py`: `TwoLevelKFAC`, its constructor and `step()`, and its docstring.
- `settings.py`: the argument checks, the layers taken (one param group each), the op modules
  (`Route`), the hyperparameter tensors and the step schedule.
- `statistics.py`: the hooks, the stored per-sample rows and output gradients, the factor EMAs,
  the drop of non-finite statistics (`NonFiniteStatisticsWarning`).
- `decompositions.py`: the factors' eigendecompositions (checked, retried in float64).
- `coarse.py`: the coarse vectors and the coarse matrix F_c (per `backend`), its EMA.
- `preconditioning.py`: the first level, the coarse correction and the write over the gradients.
- `distribution.py`: owner ranks (cafin.core.distribution.kaisa), exchanges, averages, FSDP2 gathering.
- `checkpoint.py`: `state_dict` and the checked `load_state_dict`.
- `dcp.py`: the torch.distributed.checkpoint recipe (`twolevel_checkpoint`, `twolevel_load`).
"""
from __future__ import annotations

from ...core import EigendecompositionWarning
from .dcp import twolevel_checkpoint, twolevel_load
from .optimizer import TwoLevelKFAC
from .settings import COARSE_SPACES
from .statistics import NonFiniteStatisticsWarning

__all__ = ["TwoLevelKFAC", "COARSE_SPACES", "NonFiniteStatisticsWarning", "EigendecompositionWarning",
           "twolevel_checkpoint", "twolevel_load"]
