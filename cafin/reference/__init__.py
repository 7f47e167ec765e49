"""Every cafin op in plain PyTorch, one file per member, computed the way the published code
computes it: the ground truth of the tests and the baseline of the bench. Each function is the
op-for-op twin of the op of the same name in `cafin.ops`, with its signature and in-place
semantics, so either module can serve an optimizer as its backend. The maths both backends share
is in `cafin.maths`.
"""
from .adafisher import (  # noqa: F401
    adafisher_step_, conv2d_input_stats_, embedding_input_stats_, fisher_average_, norm_grad_stats_,
    norm_input_stats_, sumsq_stats_,
)
from .singd import singd_diag_step_, singd_factor_step_, singd_momentum_  # noqa: F401
from .kfac import (  # noqa: F401
    kfac_eigen_products_, kfac_eigen_scale_, kfac_factor_ema_, kfac_precondition_apply_)
from .dykaf import (  # noqa: F401
    dykaf_adam_precondition_, dykaf_apply_, dykaf_precondition_, dykaf_rank_one_,
    dykaf_split_normalize_, dykaf_split_scale_,
)
