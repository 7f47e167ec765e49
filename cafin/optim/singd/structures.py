"""SINGD's structured matrices (arXiv 2312.05705).

A structured d x d matrix is stored as a tuple of plain tensors (its "parts"), so the optimizer
keeps them in `self.state` and checkpoints hold nothing but tensors. Each structure is a class of
static methods over such tuples; every one of them is a matrix group under multiplication, and
`project` is the projection Pi of a dense symmetric matrix onto the group's tangent space.

Operations SINGD needs (K a structured matrix, X a dense d x n matrix):
  eye, zeros, project (Pi), dense, matmul (K X), rmatmat (K^T X), product (K M in the group),
  inner (Pi(K^T X X^T K), or Pi(K^T K) for X None), mat_inner (Pi(X X^T)), average_trace,
  diag_mask (the identity's parts, so "- I" is elementwise), inf_norm.
Elementwise work (the momentum/trace combination, scaling) runs over the parts uniformly, so the
same code serves every structure.

Here: the interface (`Structure`), the dense, diagonal, block-diagonal and hierarchical
structures and the table of structures by name; the Toeplitz ones are in `toeplitz.py`.
"""
from __future__ import annotations

import torch
from torch import Tensor

Parts = tuple  # tuple[Tensor, ...]


class Structure:
    name = ""
    part_names: tuple[str, ...] = ()

    # ------------------------------------------------------------------ construction
    @classmethod
    def shapes(cls, d: int) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    @classmethod
    def zeros(cls, d: int, dtype=None, device=None) -> Parts:
        return tuple(torch.zeros(s, dtype=dtype, device=device) for s in cls.shapes(d))

    @classmethod
    def eye(cls, d: int, dtype=None, device=None) -> Parts:
        # Built in float32 and cast: bf16 has no eye on every backend.
        return tuple(p.to(dtype) for p in cls.project(torch.eye(d, device=device)))

    @classmethod
    def diag_mask(cls, d: int, dtype=None, device=None) -> Parts:
        """The identity's parts with the off-diagonal Pi factors removed (Pi(I) = I for all)."""
        return cls.eye(d, dtype, device)

    # ------------------------------------------------------------------ maths
    @classmethod
    def project(cls, m: Tensor) -> Parts:
        raise NotImplementedError

    @classmethod
    def dense(cls, parts: Parts) -> Tensor:
        raise NotImplementedError

    @classmethod
    def matmul(cls, parts: Parts, x: Tensor) -> Tensor:
        return cls.dense(parts) @ x

    @classmethod
    def rmatmat(cls, parts: Parts, x: Tensor) -> Tensor:
        return cls.dense(parts).mT @ x

    @classmethod
    def product(cls, a: Parts, b: Parts) -> Parts:
        """a @ b, which stays in the group (no projection needed)."""
        return cls.from_dense_exact(cls.dense(a) @ cls.dense(b))

    @classmethod
    def from_dense_exact(cls, m: Tensor) -> Parts:
        """The parts of a matrix known to have the structure (no Pi factors)."""
        raise NotImplementedError

    @classmethod
    def mat_inner(cls, x: Tensor) -> Parts:
        return cls.project(x @ x.mT)

    @classmethod
    def inner(cls, parts: Parts, x: Tensor | None = None) -> Parts:
        if x is None:
            k = cls.dense(parts)
            return cls.project(k.mT @ k)
        return cls.mat_inner(cls.rmatmat(parts, x))

    @classmethod
    def average_trace(cls, parts: Parts) -> Tensor:
        return torch.diagonal(cls.dense(parts)).mean()

    # ------------------------------------------------------------------ fused update (ops)
    # The elementwise preconditioner-update ops (cafin.ops.singd_momentum_, singd_factor_step_)
    # take, per part, where the identity's ones sit, Pi(K^T K) as a GEMM result times a factor,
    # and K m as a GEMM result or as the elementwise product of the parts.
    EYE_NONE, EYE_MATRIX, EYE_ALL, EYE_FIRST = 0, 1, 2, 3

    @classmethod
    def eye_kinds(cls, d: int) -> tuple[int, ...]:
        """Per part: 0 no identity entry, 1 the diagonal of each matrix, 2 every entry, 3 entry 0."""
        raise NotImplementedError

    @classmethod
    def inner_parts(cls, parts: Parts) -> tuple[Parts, tuple[float, ...]]:
        """(raw, pi) with Pi(K^T K) = pi * raw part by part: the projection's fold factors are
        applied inside the momentum op instead of as passes of their own."""
        ktk = cls.inner(parts)
        return ktk, (1.0,) * len(ktk)

    @classmethod
    def product_parts(cls, k: Parts, m: Parts) -> tuple[Parts, tuple[bool, ...]]:
        """(km, elementwise): K m part by part, where an elementwise part gives m's part itself
        (the op multiplies it by K's)."""
        km = cls.product(k, m)
        return km, (False,) * len(km)

    @staticmethod
    def inf_norm(parts: Parts) -> Tensor:
        return torch.stack([p.abs().max() for p in parts if p.numel() > 0]).max()

    # ------------------------------------------------------------------ many factors at once
    # The preconditioner update takes these over the factors of a bucket's layers (one structure
    # and dtype): the same numbers as the one-factor methods, in fewer ops.
    @classmethod
    def inner_parts_of(cls, factors: list[Parts]) -> tuple[list[Parts], tuple[float, ...]]:
        """inner_parts of each factor: (the raw parts of each, the structure's pi)."""
        out = [cls.inner_parts(parts) for parts in factors]
        return [raw for raw, _ in out], out[0][1]

    @classmethod
    def average_traces(cls, factors: list[Parts]) -> Tensor:
        """average_trace of each factor, as one vector: a copy (a trace that is a view of an
        accumulator, as a Toeplitz one is, keeps its value when the accumulator is reset)."""
        return torch.stack([cls.average_trace(parts) for parts in factors])

    @staticmethod
    def inf_norms(factors: list[Parts]) -> Tensor:
        """inf_norm of each factor, as one vector (a max is exact, so the order of the maxima
        does not matter; a NaN gives NaN either way)."""
        nonempty = [[p for p in parts if p.numel() > 0] for parts in factors]
        counts = {len(parts) for parts in nonempty}
        # The aten op: Dynamo does not trace torch._foreach_max (a graph break).
        maxima = torch.stack(torch.ops.aten._foreach_max.default(
            torch._foreach_abs([p for ps in nonempty for p in ps])))
        if counts == {1}:
            return maxima
        if len(counts) == 1:
            return maxima.view(len(factors), -1).amax(1)
        return torch.stack([m.max() for m in maxima.split([len(ps) for ps in nonempty])])


# ---------------------------------------------------------------------------------- dense
class Dense(Structure):
    """A general d x d matrix. Pi is the identity (nothing is symmetrised: K is not symmetric)."""
    name = "dense"
    part_names = ("mat",)

    @classmethod
    def shapes(cls, d):
        return ((d, d),)

    @classmethod
    def eye(cls, d, dtype=None, device=None):
        return (torch.eye(d, device=device).to(dtype),)

    @classmethod
    def project(cls, m):
        return (m,)

    from_dense_exact = project

    @classmethod
    def dense(cls, parts):
        return parts[0]

    @classmethod
    def product(cls, a, b):
        return (a[0] @ b[0],)

    @classmethod
    def mat_inner(cls, x):
        return (x @ x.mT,)

    @classmethod
    def inner(cls, parts, x=None):
        s = parts[0].mT if x is None else parts[0].mT @ x
        return (s @ s.mT,)

    @classmethod
    def average_trace(cls, parts):
        return torch.diagonal(parts[0]).mean()

    @classmethod
    def eye_kinds(cls, d):
        return (cls.EYE_MATRIX,)


# ---------------------------------------------------------------------------------- diagonal
class Diagonal(Structure):
    name = "diagonal"
    part_names = ("diag",)

    @classmethod
    def shapes(cls, d):
        return ((d,),)

    @classmethod
    def eye(cls, d, dtype=None, device=None):
        return (torch.ones(d, dtype=dtype, device=device),)

    @classmethod
    def project(cls, m):
        return (torch.diagonal(m).clone(),)

    from_dense_exact = project

    @classmethod
    def dense(cls, parts):
        return torch.diag(parts[0])

    @classmethod
    def matmul(cls, parts, x):
        return parts[0].unsqueeze(-1) * x

    rmatmat = matmul

    @classmethod
    def product(cls, a, b):
        return (a[0] * b[0],)

    @classmethod
    def mat_inner(cls, x):
        return ((x * x).sum(1),)

    @classmethod
    def inner(cls, parts, x=None):
        k2 = parts[0] * parts[0]
        return (k2,) if x is None else (k2 * (x * x).sum(1),)

    @classmethod
    def average_trace(cls, parts):
        return parts[0].mean()

    @classmethod
    def inner_parts_of(cls, factors):
        ks = [parts[0] for parts in factors]
        return [(k2,) for k2 in torch._foreach_mul(ks, ks)], (1.0,)

    @classmethod
    def eye_kinds(cls, d):
        return (cls.EYE_ALL,)

    @classmethod
    def product_parts(cls, k, m):
        return m, (True,)


# ---------------------------------------------------------------------------------- block-diagonal
class BlockDiagonal(Structure):
    """floor(d/b) b x b blocks, then one r x r block (r = d mod b).

    singd's rmatmat and inner multiply by K where K^T is meant (they treat the blocks as
    symmetric, which they stop being after the second preconditioner update). `exact=False`
    reproduces that, `exact=True` uses the true transposes."""
    block = 30
    exact = False
    part_names = ("blocks", "last")

    @classmethod
    def shapes(cls, d):
        n, r = divmod(d, cls.block)
        return ((n, cls.block, cls.block), (r, r))

    @classmethod
    def project(cls, m):
        d = m.shape[0]
        n, r = divmod(d, cls.block)
        head = m[: n * cls.block, : n * cls.block].reshape(n, cls.block, n, cls.block)
        idx = torch.arange(n, device=m.device)
        return (head[idx, :, idx, :], m[n * cls.block:, n * cls.block:])

    from_dense_exact = project

    @classmethod
    def dense(cls, parts):
        blocks, last = parts
        return torch.block_diag(*blocks.unbind(0), last)

    @classmethod
    def _apply(cls, parts, x, transpose):
        blocks, last = parts
        n = blocks.shape[0]
        head, tail = x.split([n * cls.block, last.shape[0]])
        if transpose:
            blocks, last = blocks.mT, last.mT
        cols = x.shape[1]
        out_head = torch.bmm(blocks, head.reshape(n, cls.block, cols)).reshape(n * cls.block, cols)
        return torch.cat([out_head, last @ tail])

    @classmethod
    def matmul(cls, parts, x):
        return cls._apply(parts, x, False)

    @classmethod
    def rmatmat(cls, parts, x):
        return cls._apply(parts, x, cls.exact)

    @classmethod
    def product(cls, a, b):
        return (torch.bmm(a[0], b[0]), a[1] @ b[1])

    @classmethod
    def mat_inner(cls, x):
        n, r = divmod(x.shape[0], cls.block)
        head, tail = x.split([n * cls.block, r])
        head = head.reshape(n, cls.block, x.shape[1])
        return (torch.bmm(head, head.mT), tail @ tail.mT)

    @classmethod
    def inner(cls, parts, x=None):
        if x is None:
            blocks, last = parts
            if cls.exact:
                return (torch.bmm(blocks.mT, blocks), last.mT @ last)
            return (torch.bmm(blocks, blocks.mT), last @ last.mT)
        return cls.mat_inner(cls.rmatmat(parts, x))

    @classmethod
    def average_trace(cls, parts):
        blocks, last = parts
        d = blocks.shape[0] * cls.block + last.shape[0]
        return (torch.diagonal(blocks, dim1=-2, dim2=-1).sum() + torch.diagonal(last).sum()) / d

    @classmethod
    def eye_kinds(cls, d):
        return (cls.EYE_MATRIX, cls.EYE_MATRIX)  # every block's diagonal


class Block30Diagonal(BlockDiagonal):
    name = "block30diagonal"


class Block30DiagonalExact(BlockDiagonal):
    name = "block30diagonal"
    exact = True


# ---------------------------------------------------------------------------------- hierarchical
class Hierarchical(Structure):
    """Upper block-triangular [[A, B], [0, diag(C) ; D, E]]:
        rows 0..K1      : A (K1 x K1) | B (K1 x (mid + K2))
        rows mid        : diag(C)
        rows last K2    : D (K2 x mid) | E (K2 x K2)
    with K1 <= max_k1, K2 <= max_k2 (a small d is one dense A block)."""
    max_k1 = 15
    max_k2 = 15
    name = "hierarchical15_15"
    part_names = ("A", "B", "C", "D", "E")

    @classmethod
    def dims(cls, d):
        if d <= cls.max_k1:
            return d, 0, 0
        if d <= cls.max_k1 + cls.max_k2:
            return cls.max_k1, 0, d - cls.max_k1
        return cls.max_k1, d - cls.max_k1 - cls.max_k2, cls.max_k2

    @classmethod
    def shapes(cls, d):
        k1, mid, k2 = cls.dims(d)
        return ((k1, k1), (k1, mid + k2), (mid,), (k2, mid), (k2, k2))

    @classmethod
    def _split(cls, m, scale):
        d = m.shape[0]
        k1, mid, k2 = cls.dims(d)
        e0 = k1 + mid
        return (m[:k1, :k1], scale * m[:k1, k1:], torch.diagonal(m)[k1:e0].clone(),
                scale * m[e0:, k1:e0], m[e0:, e0:])

    @classmethod
    def project(cls, m):
        # The tangent space of the group: a symmetric M's lower part folds onto the upper (x2).
        return cls._split(m, 2.0)

    @classmethod
    def from_dense_exact(cls, m):
        return cls._split(m, 1.0)

    @classmethod
    def eye(cls, d, dtype=None, device=None):
        return tuple(p.to(dtype) for p in cls.from_dense_exact(torch.eye(d, device=device)))

    @classmethod
    def dense(cls, parts):
        a, b, c, dd, e = parts
        k1, mid, k2 = a.shape[0], c.shape[0], e.shape[0]
        d = k1 + mid + k2
        m = a.new_zeros(d, d)
        m[:k1, :k1] = a
        m[:k1, k1:] = b
        idx = torch.arange(k1, k1 + mid, device=a.device)
        m[idx, idx] = c
        m[k1 + mid:, k1:k1 + mid] = dd
        m[k1 + mid:, k1 + mid:] = e
        return m

    @classmethod
    def matmul(cls, parts, x):
        # Each row block is written in place by mm/addmm (no cat, no separate additions).
        a, b, c, dd, e = parts
        k1, mid, k2 = a.shape[0], c.shape[0], e.shape[0]
        top, middle, bottom = x.split([k1, mid, k2])
        b_c, b_e = b.split([mid, k2], dim=1)
        out = x.new_empty(x.shape)
        o_top, o_mid, o_bot = out.split([k1, mid, k2])
        torch.mm(a, top, out=o_top)
        o_top.addmm_(b_c, middle).addmm_(b_e, bottom)
        torch.mul(c.unsqueeze(-1), middle, out=o_mid)
        torch.mm(dd, middle, out=o_bot)
        o_bot.addmm_(e, bottom)
        return out

    @classmethod
    def rmatmat(cls, parts, x):
        a, b, c, dd, e = parts
        k1, mid, k2 = a.shape[0], c.shape[0], e.shape[0]
        top, middle, bottom = x.split([k1, mid, k2])
        b_c, b_e = b.split([mid, k2], dim=1)
        out = x.new_empty(x.shape)
        o_top, o_mid, o_bot = out.split([k1, mid, k2])
        torch.mm(a.mT, top, out=o_top)
        torch.mul(c.unsqueeze(-1), middle, out=o_mid)
        o_mid.addmm_(b_c.mT, top).addmm_(dd.mT, bottom)
        torch.mm(b_e.mT, top, out=o_bot)
        o_bot.addmm_(e.mT, bottom)
        return out

    @classmethod
    def product(cls, p, q):
        a, b, c, dd, e = p
        a2, b2, c2, d2, e2 = q
        mid = c.shape[0]
        b_c, b_e = b.split([mid, e.shape[0]], dim=1)
        b2_c, b2_e = b2.split([mid, e2.shape[0]], dim=1)
        return (a @ a2,
                torch.cat([a @ b2_c + b_c * c2 + b_e @ d2, a @ b2_e + b_e @ e2], dim=1),
                c * c2,
                dd * c2 + e @ d2,
                e @ e2)

    @classmethod
    def mat_inner(cls, x):
        k1, mid, k2 = cls.dims(x.shape[0])
        s_a, s_c, s_e = x.split([k1, mid, k2])
        return (s_a @ s_a.mT,
                2.0 * torch.cat([s_a @ s_c.mT, s_a @ s_e.mT], dim=1),
                (s_c * s_c).sum(1),
                2.0 * (s_e @ s_c.mT),
                s_e @ s_e.mT)

    @classmethod
    def inner(cls, parts, x=None):
        if x is not None:
            return cls.mat_inner(cls.rmatmat(parts, x))
        a, b, c, dd, e = parts
        mid = c.shape[0]
        b_c, b_e = b.split([mid, e.shape[0]], dim=1)
        # Pi(K^T K) from the blocks of K^T K.
        return (a.mT @ a,
                2.0 * (a.mT @ b),
                c * c + (b_c * b_c).sum(0) + (dd * dd).sum(0),
                2.0 * (b_e.mT @ b_c + e.mT @ dd),
                e.mT @ e + b_e.mT @ b_e)

    @classmethod
    def average_trace(cls, parts):
        a, _, c, _, e = parts
        d = a.shape[0] + c.shape[0] + e.shape[0]
        return (torch.diagonal(a).sum() + c.sum() + torch.diagonal(e).sum()) / d

    @classmethod
    def eye_kinds(cls, d):
        return (cls.EYE_MATRIX, cls.EYE_NONE, cls.EYE_ALL, cls.EYE_NONE, cls.EYE_MATRIX)

    @classmethod
    def inner_parts(cls, parts):
        a, b, c, dd, e = parts
        mid = c.shape[0]
        b_c, b_e = b.split([mid, e.shape[0]], dim=1)
        # inner(parts) without the projection's factor 2 on the folded B and D blocks.
        return ((a.mT @ a, a.mT @ b, c * c + (b_c * b_c).sum(0) + (dd * dd).sum(0),
                 b_e.mT @ b_c + e.mT @ dd, e.mT @ e + b_e.mT @ b_e), (1.0, 2.0, 1.0, 2.0, 1.0))

    @classmethod
    def product_parts(cls, p, q):
        km = list(cls.product(p, q))
        km[2] = q[2]  # the diagonal middle: c * c2 in the op
        return tuple(km), (False, False, True, False, False)


# The Toeplitz structures build on `Structure` above, so they are imported once it exists (every
# import of this package runs this module first).
from .toeplitz import TrilToeplitz, TriuToeplitz  # noqa: E402

STRUCTURES: dict[str, type[Structure]] = {
    "dense": Dense,
    "diagonal": Diagonal,
    "block30diagonal": Block30Diagonal,
    "hierarchical15_15": Hierarchical,
    "triltoeplitz": TrilToeplitz,
    "triutoeplitz": TriuToeplitz,
}


def structure(name: str, exact_transposes: bool = False) -> type[Structure]:
    if not isinstance(name, str) or name not in STRUCTURES:
        raise ValueError(f"structure must be one of {sorted(STRUCTURES)}, got {name!r}")
    if name == "block30diagonal" and exact_transposes:
        return Block30DiagonalExact
    return STRUCTURES[name]
