"""SINGD's triangular Toeplitz structures (lower and upper): a d x d matrix constant along each
diagonal, stored as its d coefficients; `cafin.optim.singd.structures` holds the interface they
implement and the table of structures by name.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .structures import Structure


@functools.lru_cache(maxsize=64)
def _toeplitz_index(d: int, device: torch.device) -> tuple[Tensor, Tensor]:
    i = torch.arange(d, device=device)
    offset = i.unsqueeze(1) - i.unsqueeze(0)  # i - j
    return offset.clamp(min=0), offset >= 0


def _lower_toeplitz(coef: Tensor) -> Tensor:
    """L[i, j] = coef[i - j] for i >= j, else 0."""
    index, mask = _toeplitz_index(coef.shape[0], coef.device)
    return torch.where(mask, coef[index], coef.new_zeros(()))


def _diagonal_sums(m: Tensor) -> Tensor:
    """s[k] = sum_i m[i, i + k] for k = 0..d-1 (the upper diagonals' sums), without a loop:
    in the row-major flat m, m[i, i + k] sits at i*(d+1) + k, so a [d, d+1] view of the flat
    matrix padded by d puts diagonal k in column k (entries past the end of a row masked)."""
    d = m.shape[0]
    flat = torch.nn.functional.pad(m.reshape(-1), (0, d))
    view = flat.reshape(d, d + 1)[:, :d]
    index, mask = _toeplitz_index(d, m.device)
    # column k of row i is valid while i + k < d, i.e. (d - 1 - i) - k >= 0
    valid = mask.flip(0)
    return torch.where(valid, view, view.new_zeros(())).sum(0)


class _Toeplitz(Structure):
    part_names = ("coef",)
    lower = True

    @classmethod
    def shapes(cls, d):
        return ((d,),)

    @classmethod
    def eye(cls, d, dtype=None, device=None):
        coef = torch.zeros(d, dtype=dtype, device=device)
        coef[0] = 1.0
        return (coef,)

    @classmethod
    def project(cls, m):
        # coef[k] = (sum of diagonal +k + sum of diagonal -k) / (d - k); coef[0] = trace / d.
        d = m.shape[0]
        sums = _diagonal_sums(m) + _diagonal_sums(m.mT)
        sums = torch.cat([sums[:1] * 0.5, sums[1:]])
        return (sums / torch.arange(d, 0, -1, dtype=m.dtype, device=m.device),)

    @classmethod
    def dense(cls, parts):
        low = _lower_toeplitz(parts[0])
        return low if cls.lower else low.mT

    @classmethod
    def product(cls, a, b):
        # Triangular Toeplitz matrices commute and multiply as a causal convolution of their
        # coefficients, which is the lower Toeplitz matrix of one applied to the other.
        return (_lower_toeplitz(a[0]) @ b[0],)

    @classmethod
    def average_trace(cls, parts):
        return parts[0][0]

    @classmethod
    def eye_kinds(cls, d):
        return (cls.EYE_FIRST,)


class TrilToeplitz(_Toeplitz):
    name = "triltoeplitz"
    lower = True


class TriuToeplitz(_Toeplitz):
    name = "triutoeplitz"
    lower = False

