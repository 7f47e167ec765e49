"""The family's core: what every Kronecker-factored member shares and none owns, one file per
concern.

- `route.py`: the one place that decides how a step runs (`eager`, `compiled`, `captured`) and,
  per member (`Route`), which op module (`cafin.ops` or `cafin.reference`) a tensor runs on.
- `amp.py`: what `torch.amp.GradScaler` hands a member, and the scale of statistics taken from
  scaled gradients.
- `runtime.py`: `unwrap` (the model behind DDP/DataParallel/torch.compile wrappers: hooks go on
  the model itself, and checkpoints name its layers the same way with or without a wrapper),
  `to_device` (a tensor on a device).
- `discovery.py`: `Layer` and `discover`, the layers of a model that a member accepts and that
  hold optimised parameters (their weight and bias), matched by identity (the first accepted
  module that holds a parameter owns it; tied parameters once). AdaFisher's registry of layer
  types (`cafin/layers.py`) is AdaFisher's own: it discovers through it (`cafin.layers.discover`).
- `views.py`: one view per module type (Linear, Conv1d/2d/3d, Embedding, transformers' Conv1D,
  BatchNorm, LayerNorm) and `view_of`: which side of the weight is stored transposed, the input
  rows (a convolution's patches and padding), the output-gradient rows, the gradient as a
  [groups, out, in] matrix with its bias column, the sizes; every member's statistics read them.
- `steps.py`: `StepCounter`, k, the completed optimizer steps, on the host while steps run
  eagerly and on every device as a tensor that device-gated ops read after a compile or a
  CUDA-graph capture; `run_closure`, a step's closure that leaves no trace when it raises (`undo_on_error`).
- `hooks.py`: `Hooks`, the forward hooks and output-gradient tensor hooks that feed a member's
  statistics, holding the member weakly, safe with in-place activations, activation
  checkpointing and model copies; `can_take_statistics`, the inputs they take statistics of.
- `distribution/`: work over ranks for every member: `collectives.py` (`distributed`,
  `average_over_ranks`), `kaisa.py` (owner assignments and `exchange`), `sharding.py` (FSDP2, HSDP).
- `failures.py`: `DropCounts` (statistics dropped for inf/NaN, counted per device, reported as
  `NonFiniteStatisticsWarning`) and `EigendecompositionWarning`.
- `checks.py`: the argument checks (`real_number`, `check_range`, `check_int`,
  `check_hyperparameter`, `hyperparameter_tensor`), the hyperparameter rules (`Real`, `Pair`,
  `Int`, `Flag`, `Choice`) and `checked_attribute` (an attribute checked whenever it is set).
- `copies.py`: what a deepcopy of a member copies and shares (`copy_member`), and `HookOwner`
  (`remove_hooks`), for both bases.
- `optimizer.py`: the bases of the members that are torch optimizers, `CoreOptimizer` (model or
  not) and `CurvatureOptimizer` (hook-based, on a model).
- `preconditioner.py`: `Preconditioner`, the base of the members that rewrite `.grad` and leave
  the update to a torch optimizer (K-FAC, two-level K-FAC).
"""
from .checks import (Choice, Flag, Int, Pair, Real, Setting, as_rule, check_gradient,
                     check_hyperparameter, check_int, check_range, checked_attribute,
                     hyperparameter_tensor, real_number)
from .distribution.collectives import average_over_ranks, distributed
from .discovery import Layer, discover
from .failures import DropCounts, EigendecompositionWarning, NonFiniteStatisticsWarning
from .hooks import Hooks
from .optimizer import CoreOptimizer, CurvatureOptimizer
from .preconditioner import Preconditioner
from . import amp, route
from .runtime import to_device, unwrap
from .steps import StepCounter, run_closure, undo_on_error

__all__ = ["Choice", "CoreOptimizer", "CurvatureOptimizer", "DropCounts", "EigendecompositionWarning",
           "Flag", "Hooks", "Int", "Layer", "NonFiniteStatisticsWarning", "Pair", "Preconditioner", "Real",
           "Setting", "StepCounter",
           "as_rule", "average_over_ranks", "check_gradient", "check_hyperparameter", "check_int",
           "check_range", "checked_attribute", "discover", "distributed", "hyperparameter_tensor", "real_number",
           "run_closure", "to_device", "undo_on_error", "unwrap"]
