"""SINGD / IKFAC / INGD (arXiv 2312.05705), a drop-in for singd 0.0.5's SINGD: the optimizer
(`optimizer.py`, one mixin per job in the files beside it) and its structured matrices
(`structures.py`, `toeplitz.py`).
"""
from .optimizer import SINGD
from .structures import STRUCTURES

__all__ = ["SINGD", "STRUCTURES"]
