"""K-FAC as a gradient preconditioner, a drop-in for kfac-pytorch 0.4.2's
`kfac.preconditioner.KFACPreconditioner`:

- `preconditioner.py`: `KFACPreconditioner`.
- `compat.py`: kfac-pytorch's enums and KAISA options, checked as kfac-pytorch checks them.
- `scheduler.py`: `LambdaParamScheduler`, kfac-pytorch's multiplicative schedules.
- `checkpoint.py`: the DCP recipe (`kfac_checkpoint_template`).
"""
from .checkpoint import kfac_checkpoint_template
from .compat import AssignmentStrategy, ComputeMethod, DistributedStrategy
from .preconditioner import KFACPreconditioner
from .scheduler import LambdaParamScheduler

__all__ = ["KFACPreconditioner", "LambdaParamScheduler", "ComputeMethod", "AssignmentStrategy",
           "DistributedStrategy", "kfac_checkpoint_template"]
