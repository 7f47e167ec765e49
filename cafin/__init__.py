"""cafin: Kronecker-factored Fisher optimizers with fused C++/CUDA kernels."""
import torch  # noqa: F401  (the extension links against the loaded torch)

from . import _C  # noqa: F401  (registers the cafin ops; one build per process)
from . import maths, ops, reference  # noqa: F401  (ops registers the fake implementations)

__version__ = "0.1.0"


def cuda_kernels_built() -> bool:
    """Whether this build of cafin._C carries the CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("cafin::adafisher_step_", "CUDA")

from .optim import (SINGD, AdaFisher, AdaFisherW, DyKAF, KFACPreconditioner, LambdaParamScheduler,  # noqa: E402
                    TwoLevelKFAC)
from .core.failures import EigendecompositionWarning, NonFiniteStatisticsWarning  # noqa: E402
from .graphs import StepGraphs  # noqa: E402
from .layers import LayerType, register, supported_types  # noqa: E402
# cafin.nn.MultiheadAttention, replace_multihead_attention; not in __all__, so that
# `from cafin import *` leaves a user's `nn` (torch.nn) alone
from . import nn  # noqa: E402

__all__ = ["AdaFisher", "AdaFisherW", "DyKAF", "KFACPreconditioner", "LambdaParamScheduler", "SINGD", "TwoLevelKFAC",
           "StepGraphs", "LayerType", "register", "supported_types", "cuda_kernels_built",
           "NonFiniteStatisticsWarning", "EigendecompositionWarning"]
