"""K-FAC as a gradient preconditioner, a drop-in for kfac-pytorch 0.4.2's
`kfac.preconditioner.KFACPreconditioner`, one file per job (each a part of the class, or
functions):

- `preconditioner.py`: `KFACPreconditioner`, its constructor, the kernel choice per (device,
  dtype) and `step()`.
- `settings.py`: the argument checks, the hyperparameters and intervals, the KAISA options.
- `state.py`: each layer's tensors (`_LayerState`), the registered layers, stacked second-order data.
- `statistics.py`: the hooks' statistics and their fold into the factors.
- `decompositions.py`: eigendecompositions or damped inverses, with the float64 retry.
- `preconditioning.py`: the preconditioned gradients, the kept product buffers, the KL clip.
- `distribution.py`: KAISA's groups and result sharing, FSDP2's gradient gathering.
- `checkpoint.py`: `state_dict` / `load_state_dict` and the DCP template.
- `compat.py`: kfac-pytorch's enums and KAISA options, checked as kfac-pytorch checks them.
- `scheduler.py`: `LambdaParamScheduler`, kfac-pytorch's multiplicative schedules.
"""
from .checkpoint import kfac_checkpoint_template
from .compat import AssignmentStrategy, ComputeMethod, DistributedStrategy
from .preconditioner import KFACPreconditioner
from .scheduler import LambdaParamScheduler

__all__ = ["KFACPreconditioner", "LambdaParamScheduler", "ComputeMethod", "AssignmentStrategy",
           "DistributedStrategy", "kfac_checkpoint_template"]
