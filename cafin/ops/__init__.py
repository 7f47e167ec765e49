"""The Python face of every cafin op, one file per member: typed wrappers with clear argument
checks, and the fake implementations torch.compile traces (registered on import).

Schemas: csrc/ops.cpp. Semantics: the function of the same name in `cafin.reference`.
Each optimizer calls its ops through a backend, `cafin.ops` or `cafin.reference`, which provide
the same names, so the fused and the plain-PyTorch paths share one optimizer.
"""
from ..maths import state_dtype  # noqa: F401  (the dtype of the state the ops write)
from .adafisher import (  # noqa: F401
    StatisticsWorkspaces, adafisher_step_, conv2d_input_stats_, embedding_input_stats_, fisher_average_,
    norm_grad_stats_, norm_input_stats_, statistics_workspace_numel, sumsq_stats_,
)
from .singd import singd_diag_step_, singd_factor_step_, singd_momentum_  # noqa: F401,E402
from .kfac import (  # noqa: F401
    kfac_eigen_products_, kfac_eigen_scale_, kfac_factor_ema_, kfac_precondition_apply_)
from .dykaf import (  # noqa: F401
    dykaf_adam_precondition_, dykaf_apply_, dykaf_precondition_, dykaf_rank_one_,
    dykaf_split_normalize_, dykaf_split_scale_,
)
