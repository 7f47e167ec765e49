"""K-FAC's preconditioning maths, which both backends use and two-level K-FAC builds on: the
factors' decompositions (eigenbasis or damped inverse), the preconditioned gradient, and the KL
clipping scale.

Layouts: a layer's factors are A [groups, d_a, d_a] and G [groups, d_g, d_g]; its gradient as a
matrix is [groups, d_g, d_a] with the bias gradient as the last column (cafin.factors). A diagonal
A (an Embedding's) is kept as its diagonal [groups, d_a]: its eigenbasis is I (no Q_A), its
inverse a vector.
"""
from __future__ import annotations

import torch

from .eigh import protected_eigh

__all__ = [
    "eigen_decompose", "damped_inverse", "eigenvalue_reciprocal", "eigen_precondition",
    "eigen_precondition_into",
    "aligned_empty", "rows_equally_spaced",
    "inverse_precondition", "kl_clip_scale",
    "diagonal_factor_ema_", "diagonal_eigenvalues", "diagonal_damped_inverse",
]


def kl_clip_scale(vg_sum: torch.Tensor, kl_clip: torch.Tensor) -> torch.Tensor:
    """min(1, sqrt(kl_clip / |vg_sum|)), 1 when the sum is 0 (kfac-pytorch's rule), on the device.
    A NaN kl_clip (a kl_clip callable that returned None: clipping off) gives 1, as the kernels do."""
    one = torch.ones_like(vg_sum)
    safe = torch.where(vg_sum == 0, one, vg_sum.abs())
    scale = torch.sqrt(kl_clip.to(vg_sum.dtype) / safe)
    return torch.where((vg_sum == 0) | ~(scale < 1), one, scale)


def eigen_decompose(factor: torch.Tensor, *, decompose_dtype: torch.dtype = torch.float32,
                    out_dtype: torch.dtype = torch.float32, retry_in: tuple[torch.dtype, ...] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(d, Q) of symmetric factors [..., d, d]: eigh on a `decompose_dtype` copy (kfac-pytorch
    decomposes a float32 copy), cast to `out_dtype`, eigenvalues clamped at 0. With `retry_in`,
    an eigh that fails is tried again in each of those dtypes (`protected_eigh`), and None is
    returned where every attempt fails."""
    if not retry_in:
        return _eigen_result(*torch.linalg.eigh(factor.to(decompose_dtype)), out_dtype=out_dtype)
    d_q = protected_eigh(factor, [(dtype, 0.0) for dtype in (decompose_dtype, *retry_in)])
    return None if d_q is None else _eigen_result(*d_q, out_dtype=out_dtype)


def _eigen_result(d: torch.Tensor, q: torch.Tensor, *,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An eigendecomposition as K-FAC keeps it: cast to `out_dtype`, eigenvalues clamped at 0."""
    return d.to(out_dtype).clamp(min=0.0), q.to(out_dtype)


def damped_inverse(factor: torch.Tensor, damping, *, decompose_dtype: torch.dtype = torch.float32,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(F + damping I)^-1 of factors [..., d, d]: damping added in the factor's dtype, inverted
    in `decompose_dtype` with inv_ex (no host sync), cast to `out_dtype`."""
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    damped = factor + eye * (damping.to(factor.dtype) if isinstance(damping, torch.Tensor) else damping)
    return torch.linalg.inv_ex(damped.to(decompose_dtype))[0].to(out_dtype)


def eigenvalue_reciprocal(dg: torch.Tensor, da: torch.Tensor, damping) -> torch.Tensor:
    """1 / (dg da^T + damping), [groups, d_g, d_a]: compute_eigenvalue_outer_product."""
    return 1.0 / (dg.unsqueeze(-1) * da.unsqueeze(-2) + damping)


def eigen_precondition(grad: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor, *,
                       dgda: torch.Tensor | None = None, da: torch.Tensor | None = None,
                       dg: torch.Tensor | None = None, damping=None, scale_=None) -> torch.Tensor:
    """Q_G [(Q_G^T grad Q_A) (*) dgda] Q_A^T, or with (dg da^T + damping) divided out when
    dgda is None; grad [groups, d_g, d_a] in the decomposition's dtype. qa None: Q_A = I (a
    diagonal A)."""
    v = torch.matmul(qg.transpose(-1, -2), grad)
    if qa is not None:
        v = torch.matmul(v, qa)
    if dgda is not None:
        v.mul_(dgda)
    elif scale_ is not None:
        scale_([v], [dg], [da], damping)
    else:
        v.div_(dg.unsqueeze(-1) * da.unsqueeze(-2) + damping)
    v = torch.matmul(qg, v)
    return v if qa is None else torch.matmul(v, qa.transpose(-1, -2))


# Rows of GEMM operands start on this boundary (a cache line): CPU BLAS multiplies matrices whose
# rows are an odd number of floats apart (the bias column: 129, 513, 785) 10-40 % slower.
ALIGN_BYTES = 64


def aligned_empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised tensor of `shape` whose rows (along the last dimension) each start on an
    ALIGN_BYTES boundary: a view of a tensor with the last dimension rounded up, contiguous when
    no rounding is needed. Products of such operands have the same numbers as of contiguous
    ones (same shapes, same order of operations); only the memory layout differs."""
    *lead, width = shape
    step = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    padded = -(-width // step) * step
    return torch.empty(*lead, padded, dtype=dtype, device=device)[..., :width]


def rows_equally_spaced(t: torch.Tensor) -> bool:
    """Whether the rows of a [groups, rows, cols] tensor (groups * rows of them, each cols
    contiguous elements) lie at one distance from each other, as a contiguous tensor's or a
    view of `aligned_empty` storage's do: the layout the K-FAC write kernel reads."""
    groups, rows, cols = t.shape
    if cols > 1 and t.stride(2) != 1:
        return False
    ld = t.stride(1) if rows > 1 else t.stride(0) if groups > 1 else cols
    return ld >= cols and (rows == 1 or groups == 1 or t.stride(0) == rows * ld)


def eigen_precondition_into(grad: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor,
                            dgda: torch.Tensor, work: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`eigen_precondition(grad, qa, qg, dgda=dgda)` written into `out` through preallocated
    buffers (no allocation): the same batched products in the same order. grad, work [groups,
    d_g, d_a] in the decomposition's dtype (grad is overwritten; aligned rows make the products
    faster, see `aligned_empty`), out [groups, d_g, d_a] in any dtype (cast on the last copy)."""
    torch.bmm(qg.mT, grad, out=work)
    if qa is None:
        work.mul_(dgda)
        torch.bmm(qg, work, out=grad)
    else:
        torch.bmm(work, qa, out=grad)
        grad.mul_(dgda)
        torch.bmm(qg, grad, out=work)
        torch.bmm(work, qa.mT, out=grad)
    return out.copy_(grad)


def inverse_precondition(grad: torch.Tensor, a_inv: torch.Tensor, g_inv: torch.Tensor) -> torch.Tensor:
    """G^-1 grad A^-1 (a_inv [groups, d_a]: a diagonal A's inverse)."""
    v = torch.matmul(g_inv, grad)
    if a_inv.dim() == grad.dim() - 1:
        return v * a_inv.unsqueeze(-2)
    return torch.matmul(v, a_inv)


def diagonal_factor_ema_(factor: torch.Tensor, stat: torch.Tensor, count: torch.Tensor,
                         decay: torch.Tensor, step: torch.Tensor | None = None,
                         interval: int = 1) -> None:
    """`kfac_factor_ema_` for one diagonal factor [groups, d] (nothing to symmetrise):
    factor <- decay * factor + (1 - decay) * stat / count where count > 0, stat is finite and
    (with `step`) step % interval == 0; stat and count are zeroed either way."""
    d = decay.to(factor.dtype)
    new = d * factor + (1 - d) * (stat / count.clamp_min(1).to(factor.dtype))
    keep = (count > 0) & torch.isfinite(stat).all()
    if step is not None:
        keep = keep & (torch.remainder(step, interval) == 0)
    factor.copy_(torch.where(keep, new, factor))
    stat.zero_()
    count.zero_()


def diagonal_eigenvalues(factor: torch.Tensor, *, decompose_dtype: torch.dtype = torch.float32,
                         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The eigenvalues of a diagonal factor [groups, d] (its entries, through `decompose_dtype`
    as `eigen_decompose` takes them, clamped at 0); its eigenbasis is I."""
    return factor.to(decompose_dtype).to(out_dtype).clamp(min=0.0)


def diagonal_damped_inverse(factor: torch.Tensor, damping, *,
                            decompose_dtype: torch.dtype = torch.float32,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """1 / (a + damping) of a diagonal factor [groups, d], as `damped_inverse` takes it: damping
    added in the factor's dtype, inverted in `decompose_dtype`."""
    damped = factor + (damping.to(factor.dtype) if isinstance(damping, torch.Tensor) else damping)
    return damped.to(decompose_dtype).reciprocal().to(out_dtype)
