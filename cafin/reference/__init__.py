"""Every cafin op in plain PyTorch, one file per member, computed the way the published code
computes it: the ground truth of the tests and the baseline of the bench. Each function has the
signature and in-place semantics of the op of the same name in `cafin.ops`.
"""
from .adafisher import (  # noqa: F401
    MINMAX_EPS, adafisher_step_, conv2d_input_stats_, fisher_average_, norm_grad_stats_,
    norm_input_stats_, preconditioner, state_dtype, sumsq_stats_,
)
from . import singd  # noqa: F401,E402  (SINGD's per-layer maths: cafin.reference.singd)
from .kfac import (  # noqa: F401
    kfac_eigen_scale_, kfac_factor_ema_, kfac_precondition_apply_,
)
from .dykaf import (  # noqa: F401
    dykaf_adam_precondition_, dykaf_apply_, dykaf_precondition_, dykaf_rank_one_,
    dykaf_split_normalize_, dykaf_split_scale_,
)
from .twolevel import coarse_matrix_pairwise  # noqa: F401,E402  (two-level K-FAC's published assembly)
