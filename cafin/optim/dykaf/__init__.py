"""DyKAF (arXiv 2511.06477): Adam in the eigenbasis of Kronecker factors tracked by one
projector-splitting step per iteration. The optimizer is `DyKAF` (optimizer.py)."""
from .optimizer import DyKAF  # noqa: F401
