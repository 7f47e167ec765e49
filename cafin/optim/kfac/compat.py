"""The arguments K-FAC takes for kfac-pytorch 0.4.2 compatibility: its enums, and the KAISA
distribution options (`allreduce_bucket_cap_mb`, `assignment_strategy`, `colocate_factors`,
`grad_worker_fraction`, `symmetry_aware`), checked as kfac-pytorch checks them.

`kaisa_options` validates and normalises them into one frozen record that the preconditioner
keeps; cafin.core.distribution.kaisa distributes the work with them.
"""
from __future__ import annotations

import enum
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ...core import distributed, real_number

__all__ = ["ComputeMethod", "AssignmentStrategy", "DistributedStrategy", "KaisaOptions",
           "as_enum", "kaisa_options", "worker_fraction"]


class ComputeMethod(enum.Enum):
    """As kfac-pytorch's `kfac.enums.ComputeMethod` (same names and values)."""
    EIGEN = 1
    INVERSE = 2


class AssignmentStrategy(enum.Enum):
    """As kfac-pytorch's `kfac.enums.AssignmentStrategy`."""
    COMPUTE = 1
    MEMORY = 2


class DistributedStrategy(enum.Enum):
    """As kfac-pytorch's `kfac.enums.DistributedStrategy`."""
    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


def as_enum(value: Any, cls: type[enum.Enum], name: str) -> enum.Enum:
    """An enum member from itself, its name (any case) or an enum of another module with the same
    member name (kfac-pytorch's own enums)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    if isinstance(value, enum.Enum) and value.name in cls.__members__:
        return cls[value.name]
    raise ValueError(f"{name} must be one of {list(cls.__members__)} (or their lower-case "
                     f"names), got {value!r}")


def worker_fraction(value: Any) -> tuple[float, DistributedStrategy]:
    """kfac-pytorch's reading of `grad_worker_fraction` for this process's world size: the
    fraction of ranks that precondition each layer's gradient, and the strategy it amounts to."""
    size = torch.distributed.get_world_size() if distributed() else 1
    expected = (f"grad_worker_fraction must be a number in [0, 1], a DistributedStrategy or its "
                f"name in any case ({', '.join(DistributedStrategy.__members__)}), got {value!r}")
    if isinstance(value, (enum.Enum, str)):  # names as compute_method and assignment_strategy take them
        try:
            strategy = as_enum(value, DistributedStrategy, "grad_worker_fraction")
        except ValueError:
            raise ValueError(expected) from None
        fraction = {DistributedStrategy.COMM_OPT: 1.0, DistributedStrategy.HYBRID_OPT: 0.5,
                    DistributedStrategy.MEM_OPT: 1.0 / size}[strategy]
        return fraction, strategy
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(expected)
    if value == 0:
        value = 1.0 / size
    if size % max(1, round(size * value)) != 0:
        raise ValueError("grad_worker_fraction must produce groups of equal size")
    if value == 1:
        return 1.0, DistributedStrategy.COMM_OPT
    if value <= 1 / size:
        return float(value), DistributedStrategy.MEM_OPT
    return float(value), DistributedStrategy.HYBRID_OPT


@dataclass(frozen=True)
class KaisaOptions:
    """The KAISA options, normalised."""
    allreduce_bucket_cap_mb: float
    assignment_strategy: AssignmentStrategy
    colocate_factors: bool
    grad_worker_fraction: float
    distributed_strategy: DistributedStrategy
    symmetry_aware: bool


def kaisa_options(*, allreduce_bucket_cap_mb: Any, assignment_strategy: Any, colocate_factors: Any,
                  grad_worker_fraction: Any, symmetry_aware: Any, compute_method: ComputeMethod,
                  compute_eigenvalue_outer_product: bool) -> KaisaOptions:
    """Check the KAISA options as kfac-pytorch does (the colocation rule needs the compute
    method) and return them normalised."""
    cap = real_number(allreduce_bucket_cap_mb, "allreduce_bucket_cap_mb")
    if math.isnan(cap) or cap < 0:
        raise ValueError(f"allreduce_bucket_cap_mb must be >= 0, got {allreduce_bucket_cap_mb!r}")
    for name, flag in (("colocate_factors", colocate_factors), ("symmetry_aware", symmetry_aware)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    strategy = as_enum(assignment_strategy, AssignmentStrategy, "assignment_strategy")
    if (compute_method is ComputeMethod.EIGEN and compute_eigenvalue_outer_product
            and not colocate_factors):
        raise ValueError("colocate_factors must be True to use compute_eigenvalue_outer_product")
    fraction, distributed_strategy = worker_fraction(grad_worker_fraction)
    if not colocate_factors and distributed_strategy is DistributedStrategy.MEM_OPT:
        # a layer's only gradient worker decomposes both of its factors (kfac-pytorch's rule)
        warnings.warn("grad_worker_frac=1/world_size (MEM_OPT) requires colocate_factors=True. "
                      "Enabling colocate_factors.", stacklevel=4)
        colocate_factors = True
    return KaisaOptions(allreduce_bucket_cap_mb=cap, assignment_strategy=strategy,
                        colocate_factors=colocate_factors, grad_worker_fraction=fraction,
                        distributed_strategy=distributed_strategy, symmetry_aware=symmetry_aware)
