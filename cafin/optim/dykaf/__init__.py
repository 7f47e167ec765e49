"""DyKAF (arXiv 2511.06477): Adam in the eigenbasis of Kronecker factors that track the nearest
Kronecker approximation of the moving-average empirical Fisher by one projector-splitting step per
iteration, with a rank-one second moment. A drop-in for `TensorDyKAF` (Vepricov/LIB,
src/optimizers/tensor_dykaf.py): the same constructor, defaults and numbers; docs/dykaf.md lists
the conventions kept and the published bugs fixed.

State per parameter (all in `self.state[p]`): `step` (completed updates, a host int: the
eigenbasis refresh every `precondition_frequency` updates is decided on the host) and
`device_step` (the same count as a 0-dim float64 tensor, read by the bias corrections), `exp_avg`,
`exp_avg_sq` (only where the full second moment is used), `l`, `r` (the rank-one second moment),
`factors` and `bases` (one entry per mode, None where the mode is not preconditioned), and the
values frozen at the first step: `kind`, `precondition_frequency`, `shampoo_beta`.

kind "kron2d": a matrix, factors by `proj_split` (or the one-sided sum when one side is over
max_precond_dim); "kron4d": a conv kernel, factors by the 4-mode split; "ema": everything else
(1-D, 3-D, >= 5-D, merged shapes), SOAP's EMA of per-mode products, full second moment.

The package, one file per job:
- optimizer.py: the `DyKAF` class, its settings, construction and the step loop;
- start.py: a parameter's first step (its state from its first gradient, dropped gradients);
- update.py: the update (rotations, moments, preconditioning, apply);
- factors.py: the factor updates, the stacked same-shape path, the eigenbasis refreshes;
- owners.py: the refreshes shared out over the ranks of a process group;
- checkpoint.py: state_dict and the checks of a loaded state; unstarted.py: the checkpoint
  entry of a parameter without state.
"""
from .optimizer import DyKAF  # noqa: F401

__all__ = ["DyKAF"]
