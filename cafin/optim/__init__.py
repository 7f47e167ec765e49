"""The optimizers of the family, one small file each, on the shared core (`cafin.core`)."""
from .adafisher import AdaFisher, AdaFisherW  # noqa: F401
from .singd import SINGD  # noqa: F401
from .kfac import KFACPreconditioner  # noqa: F401
from .kfac import LambdaParamScheduler  # noqa: F401
from .dykaf import DyKAF  # noqa: F401
from .twolevel import TwoLevelKFAC  # noqa: F401
