"""DyKAF's factor maths, which both backends use (`cafin.ops` and `cafin.reference` differ only
in the elementwise ops): the projector-splitting steps of the Kronecker factors, their starts, the
eigenbasis and its refresh, and the merge_dims reshapes, computed the way the published
TensorDyKAF computes them (Vepricov/LIB, src/optimizers/tensor_dykaf.py). They are GEMMs and
decompositions, which stay in torch.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .eigh import protected_eigh

# The constant the published one-sided fallback divides by: a side that is kept while the other is
# over max_precond_dim starts at I / (||I|| * 1e-3) = I * 1000 / sqrt(d).
ONE_SIDED_START = 1e-3
# The "eps" start: I / ||I|| * 1e-3.
EPS_START = 1e-3
POWER_ITERATIONS = 100


def start_vectors(sizes: Sequence[int], seed: int, dtype: torch.dtype,
                  device: torch.device) -> list[torch.Tensor]:
    """The deterministic starting vectors of the power iterations (the published code draws them
    with torch.randn from the global generator): standard normal draws, in order, from a fresh CPU
    generator seeded with `seed`, made in float64 and then cast."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
            for n in sizes]


def kron_start(g: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published 2-D "kron" start: the top singular triplet (s, u, v) of g by 100 alternating
    power steps, returned as L = sqrt(s) u u^T, R = sqrt(s) v v^T (a product scaling like s, where
    the nearest Kronecker product of vec(g)vec(g)^T would scale like s^2: kept as published)."""
    (right,) = start_vectors([g.shape[1]], seed, g.dtype, g.device)
    for _ in range(POWER_ITERATIONS):
        left = g @ right
        left = left / left.norm()
        right = left @ g
        right = right / right.norm()
    left = g @ right
    s = left.norm()
    left = left / s
    root = s.sqrt()
    return (left * root)[:, None] * left[None, :], (right * root)[:, None] * right[None, :]


def eps_start(n: int, like: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(n, dtype=like.dtype, device=like.device)
    return eye / eye.norm() * EPS_START


# The 4-D contractions are GEMMs in a fixed order, not einsums: a torch.einsum of three or more
# operands searches a contraction path (opt_einsum) on every call, most of an eager step's host
# time on a ResNet, and without opt_einsum contracts left to right (g (x) g first: d^8 entries).


def unfoldings(g: torch.Tensor) -> list[torch.Tensor]:
    """The mode unfoldings of a 4-D tensor: [d_k, d_(k+1) d_(k+2) d_(k+3)] for each mode k, the
    other modes in cyclic order (indices mod 4). Modes 0 and 3 are views of g (3 transposed), 1
    and 2 copies."""
    d = g.shape
    g = g.contiguous()
    return [g.reshape(d[0], -1), g.permute(1, 2, 3, 0).reshape(d[1], -1),
            g.permute(2, 3, 0, 1).reshape(d[2], -1), g.reshape(-1, d[3]).T]


def _split_sweep(unfolded: list[torch.Tensor], factors: list[torch.Tensor],
                 step: Callable[[int, torch.Tensor], None]) -> None:
    """The four mode terms of the 4-D factor step, in turn: for i = 0..3, `step(i, C_i)` with

        C_i[x, y] = sum g[.., x, ..] g[.., y, ..] prod_(t != i) F_t[j_t, j'_t]

    (x at mode i of the first g, y at mode i of the second; each other mode t pairs the first
    g's index j_t with the second's j'_t through F_t), where F = `factors` as the earlier steps
    left it (`step` replaces factors[i]). Twelve GEMMs on the unfoldings (`unfoldings(g)`):
    modes 0 and 1 share A = g x_2 F_2 x_3 F_3, modes 2 and 3 B = g x_0 F_0 x_1 F_1 (F_0 and F_1
    as updated); mode 0 puts F_1 and mode 2 F_3 on the first g. A GEMM on the transposed
    unfolding (mode k in front) returns the mode at the back, the next mode in front."""
    _split_sweeps([unfolded], [factors], lambda i, Cs: step(i, Cs[0]))


def _split_sweeps(unfolded: list[list[torch.Tensor]], factors: list[list[torch.Tensor]],
                  step: Callable[[int, list[torch.Tensor]], None]) -> None:
    """`_split_sweep` of several tensors in lockstep: `step(i, [C_i of each tensor])`, so that
    the elementwise work of a mode runs as one foreach op over the tensors. Each tensor's GEMMs
    are its own, in its own order (the same numbers as one sweep each)."""
    d = [[x.shape[0] for x in u] for u in unfolded]
    # (a, b) the pair of modes stepped, (c, e) the other two: A for modes 0 and 1, then B
    # (the transposed reshapes of GEMM results are taken as one view each: _unfolded_t)
    for a, b, c, e in ((0, 1, 2, 3), (2, 3, 0, 1)):
        shared_t, firsts_t = [], []
        for u, F, n in zip(unfolded, factors, d):
            s_t = _unfolded_t(torch.mm(u[c].T, F[c].T), n[e])
            # modes (a, b, c, e), a in front; transposed
            shared_t.append(_unfolded_t(torch.mm(s_t, F[e].T), n[a]))
            first = torch.mm(F[b].T, u[b])  # (b, c, e | a)
            firsts_t.append(_unfolded_t(first, first.numel() // n[a] if n[a] else 0))
        step(a, [torch.mm(f_t, s_t) for f_t, s_t in zip(firsts_t, shared_t)])
        seconds_t = [_unfolded_t(torch.mm(s_t, F[a].T), n[b])  # (b | c, e, a), transposed
                     for s_t, F, n in zip(shared_t, factors, d)]
        step(b, [torch.mm(u[b], x_t) for u, x_t in zip(unfolded, seconds_t)])


def _unfolded_t(m: torch.Tensor, rows: int) -> torch.Tensor:
    """`m.reshape(rows, -1).T` of a contiguous m (a GEMM's result) as one view: the same strides,
    without the view between."""
    if not rows or not m.is_contiguous():
        return m.reshape(rows, -1).T
    cols = m.numel() // rows
    return m.as_strided((cols, rows), (1, cols))


def _mode_vector(unfolded: list[torch.Tensor], v: Sequence[torch.Tensor], i: int) -> torch.Tensor:
    """sum g[.., x, ..] prod_(t != i) v_t[j_t] (x at mode i): the unfolding at mode i times the
    Kronecker product of the other modes' vectors, in its cyclic order."""
    a, b, c = (v[(i + k) % 4] for k in (1, 2, 3))
    return torch.mv(unfolded[i], (torch.outer(a, b).reshape(-1, 1) * c).reshape(-1))


def hopm_start(g: torch.Tensor, seed: int, published: bool = False) -> list[torch.Tensor]:
    """The published 4-D start: rank-1 higher-order power method, each factor v v^T with v scaled
    so that the four factors' product scales like s (the rank-1 component's weight)."""
    v = start_vectors(list(g.shape), seed, g.dtype, g.device)
    unfolded = unfoldings(g)
    for _ in range(POWER_ITERATIONS):
        for k in range(4):
            v[k] = _mode_vector(unfolded, v, k)
            v[k] = v[k] / v[k].norm()
    s = torch.dot(v[0], _mode_vector(unfolded, v, 0))
    # Published: s ** 0.25, NaN when the power iteration ends on a negative component; the sign
    # is the vectors' (v v^T does not see it), so the weight is |s|.
    root = (s if published else s.abs()) ** 0.25
    return [torch.outer(x * root, x * root) for x in v]


def proj_split(L: torch.Tensor, R: torch.Tensor, g: torch.Tensor,
               beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank-1 projector-splitting step of the nearest Kronecker product L (x) R of
    F <- beta F + (1-beta) vec(g)vec(g)^T (the published two-sided `proj_split`); g is not written."""
    if beta != 1:
        g = g * (1 - beta) ** 0.5
    L = L * beta ** 0.5
    R = R * beta ** 0.5
    left_norm, right_norm = L.norm(), R.norm()
    sigma = left_norm * right_norm
    L, R = L / left_norm, R / right_norm
    K = L * sigma + g @ R @ g.T
    M = R * sigma + g.T @ L @ g
    U = K / K.norm()
    V = M / M.norm()
    S = (L * U).sum() * (R * V).sum() * sigma + (U * (g @ V @ g.T)).sum()
    root = S ** 0.5
    return U * root, V * root


def one_sided(L: torch.Tensor, g: torch.Tensor, left: bool) -> torch.Tensor:
    """The published fallback when the other side is over max_precond_dim: an undecayed sum."""
    return L + (g @ g.T if left else g.T @ g)


def one_sided_(L: torch.Tensor, g: torch.Tensor, left: bool) -> torch.Tensor:
    """`one_sided` written into L (the same sum, the same rounding)."""
    return L.add_(g @ g.T if left else g.T @ g)


def one_sided_start(n: int, like: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(n, dtype=like.dtype, device=like.device)
    return eye / (eye.norm() * ONE_SIDED_START)


def tensor_proj_split(factors: list[torch.Tensor], g: torch.Tensor, beta: float,
                      published: bool = False) -> list[torch.Tensor]:
    """The 4-D factor step: the four factors hold S^(1/4) u_t (unit u_t, weight S) of the rank-1
    approximation S (x) u_t of F <- beta F + (1-beta) vec(g)vec(g)^T; sequential per-mode updates,
    each seeing the modes already updated: K_i = beta S u_i + (1-beta) C_i(u), u_i = K_i / |K_i|,
    S = |K_i| (the target's weight on the new rank-1 term, up to the other modes' overlaps).

    published=True: the published step, which multiplies S by the stored factors (norm S^(1/4)
    each, not unit) and carries S as |K_i| - |u_i * C_i| (the norm of an elementwise product):
    the weight then roughly squares every step from above 1 (overflow, then NaN: the digits CNN
    diverges at step 13) and collapses from below 1.

    The terms C_i come from `_split_sweep` (fixed GEMMs, no contraction planned per call)."""
    if not published:
        return tensor_proj_splits([factors], [g], beta)[0]
    S = factors[0].norm() ** 4
    L = list(torch._foreach_mul(factors, beta ** 0.25))
    if beta != 1:
        g = g * (1 - beta) ** 0.5

    def published_step(i, C):
        nonlocal S
        K = torch.addcmul(C, L[i], S)  # S L_i + C
        s_hat = K.norm()
        L[i] = K / s_hat
        S = s_hat - (L[i] * C).norm()
    _split_sweep(unfoldings(g), L, published_step)
    return list(torch._foreach_mul(L, S ** 0.25))


def tensor_proj_splits(factors: list[list[torch.Tensor]], gs: list[torch.Tensor],
                       beta: float) -> list[list[torch.Tensor]]:
    """`tensor_proj_split` (not published) of several 4-D tensors on one device, their factors
    in one dtype: each tensor's GEMMs as in its own step, the elementwise and scalar work of
    each stage in one foreach op over the tensors (the same numbers: a foreach op of the CPU
    runs the single-tensor op on each tensor)."""
    count = len(gs)
    flat = [f for fs in factors for f in fs]
    norms = torch._foreach_norm(flat)
    S = list(torch._foreach_mul(torch._foreach_pow(norms[::4], 4), beta))
    u = torch._foreach_div(flat, norms)
    u = [list(u[4 * j:4 * j + 4]) for j in range(count)]
    if beta != 1:
        gs = torch._foreach_mul(gs, (1 - beta) ** 0.5)

    def step(i, Cs):
        nonlocal S
        torch._foreach_addcmul_(Cs, [x[i] for x in u], S)  # S u_i + C
        S = torch._foreach_norm(Cs)
        for x, K in zip(u, torch._foreach_div(Cs, S)):
            x[i] = K
    _split_sweeps([unfoldings(g) for g in gs], u, step)
    roots = torch._foreach_pow(S, 0.25)
    scaled = torch._foreach_mul([f for x in u for f in x], [r for r in roots for _ in range(4)])
    return [list(scaled[4 * j:4 * j + 4]) for j in range(count)]


def mode_products(g: torch.Tensor, modes: Sequence[int] | None = None) -> list[torch.Tensor | None]:
    """SOAP's per-mode g g^T (contracting every other dimension), for the EMA path; with `modes`,
    only those (None for the others)."""
    dims = list(range(g.dim()))
    return [torch.tensordot(g, g, dims=[dims[:k] + dims[k + 1:]] * 2)
            if modes is None or k in modes else None for k in dims]


def eigenbasis(factor: torch.Tensor) -> torch.Tensor:
    """The first eigenbasis, with the published precision rule: eigh of factor.float() plus
    1e-30*I made in the default dtype (so float64 under a float64 default), eigenvalues in
    descending order, returned in the factor's dtype."""
    first = torch.promote_types(torch.float32, torch.get_default_dtype())
    # as published: any failure retried in float64 with a larger jitter, and no third attempt
    d_q = protected_eigh(factor.float(), [(first, 1e-30), (torch.float64, 1e-10)], errors=(RuntimeError,))
    if d_q is None:
        raise torch.linalg.LinAlgError(f"DyKAF: the first eigendecomposition of a {tuple(factor.shape)} "
                                       "factor failed in float32 and in float64")
    return torch.flip(d_q[1], [1]).to(factor.dtype)


def refresh_basis(factor: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power step and QR in float32 (as published, whatever the dtype), after sorting the
    basis by the estimated eigenvalues diag(Q^T L Q), descending. Returns the new basis (in the
    factor's dtype) and the permutation, which the second moment must follow."""
    m, o = factor.float(), basis.float()
    estimate = torch.diag(o.T @ m @ o)
    order = torch.argsort(estimate, descending=True)
    o = o[:, order]
    Q, _ = torch.linalg.qr(m @ o)
    return Q.to(factor.dtype), order


def _rotate(x: torch.Tensor, bases: Sequence[torch.Tensor | None], back: bool) -> torch.Tensor:
    """Each mode k of x multiplied by its basis Q_k (Q_k^T x_(k), or Q_k x_(k) when `back`): one
    GEMM per mode on the unfolding with that mode in front, whose result has it at the back, so
    that the next mode comes to the front (a mode without a basis is moved there as it is). The
    result has x's shape."""
    shape = x.shape
    m = x.reshape(shape[0] if x.dim() else 1, -1)
    for k, Q in enumerate(bases):
        # (after a GEMM: its transposed unfolding at mode k, one view)
        m = _unfolded_t(m, shape[k]) if k else m.T
        if Q is not None:
            m = torch.mm(m, Q.T if back else Q)
    return m.reshape(shape)


def project(x: torch.Tensor, bases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Rotate every mode of x into its basis (a mode without a basis is left as it is)."""
    return _rotate(x, bases, back=False)


def project_back(x: torch.Tensor, bases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    return _rotate(x, bases, back=True)


def proj_split_batched(L: torch.Tensor, R: torch.Tensor, g: torch.Tensor, beta: float,
                       ops) -> tuple[torch.Tensor, torch.Tensor]:
    """`proj_split` over a stack of parameters of one shape ([B, m, m], [B, n, n], [B, m, n]):
    one batched GEMM per product, the elementwise work around them in two ops of `ops`
    (cafin.ops or cafin.reference). Equal to `proj_split` up to rounding, with fewer passes over
    the factors and none over g (below)."""
    def fro(x):
        return torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)

    bmm = torch.bmm  # not @: matmul wraps each product in reshapes and views
    left_norm, right_norm = fro(L), fro(R)
    # sqrt(beta) L / |sqrt(beta) L| is L / |L|: beta enters sigma only.
    sigma = (left_norm * right_norm * beta).reshape(-1)
    L, R = L / left_norm, R / right_norm
    # The published step scales g by sqrt(1 - beta) (unless beta = 1): U = g R g^T and
    # V = g^T L g (of the unscaled g here) then carry one factor 1 - beta, which the basis step's
    # normalisation removes when sigma is divided by it, and which the weight's last term takes
    # as a scalar.
    shrink = 1 - beta if beta != 1 else 1.0
    basis_sigma = sigma / shrink
    gt = g.mT
    U = bmm(bmm(g, R), gt)
    V = bmm(bmm(gt, L), g)
    # The weight needs <U, g V g^T> only. With U = K / |K|, K = s L + g R g^T, and
    # V = M / |M|, M = s R + g^T L g (s = basis_sigma), a Gram matrix of the thin side replaces a
    # product over the long one: g V g^T = (s g R g^T + W L W) / |M| with W = g g^T (m x m), and
    # <U, g V g^T> = <V, g^T U g> with g^T U g = (s g^T L g + Z R Z) / |K|, Z = g^T g.
    # Taken when it needs fewer multiply-adds (one side over sqrt(2) x the other); equal up to
    # rounding.
    m, n = g.shape[-2:]
    direct, wide, tall = m * n * (m + n), m * m * (n + 2 * m), n * n * (m + 2 * n)
    s = basis_sigma.reshape(-1, 1, 1)
    C, swapped = None, False
    if wide < min(direct, tall):
        C = _gram_term(bmm(g, gt), L, U, s, shrink)
    elif tall < direct:
        C, swapped = _gram_term(bmm(gt, g), R, V, s, shrink), True
    ops.dykaf_split_normalize_([U], [V], [L], [R], [basis_sigma])
    if C is None:
        C = bmm(bmm(g, V), gt)
        if shrink != 1:
            C.mul_(shrink)
    if swapped:  # the same weight, sides swapped
        ops.dykaf_split_scale_([V], [U], [R], [L], [C], [sigma])
    else:
        ops.dykaf_split_scale_([U], [V], [L], [R], [C], [sigma])
    return U, V


def _gram_term(W: torch.Tensor, F: torch.Tensor, X: torch.Tensor, s: torch.Tensor,
               shrink: float) -> torch.Tensor:
    """shrink (s X + W F W) / |s F' + X'| on the thin side (written into the product's own
    buffer), where X = g F' g^T and X' = g^T F g are the basis step's products of the two sides
    (wide: W = g g^T, F = L, X = U, F' = R, X' = V; tall: transposed). The norm over the long side
    comes from thin-side terms: |s F' + X'|^2 = s^2 |F'|^2 + 2 s <F', X'> + |X'|^2 with |F'| = 1,
    <F', X'> = <X, F> and |X'|^2 = tr((W F)^2) (all symmetric positive semi-definite)."""
    WF = torch.bmm(W, F)
    square = (WF * WF.mT).sum(dim=(-2, -1), keepdim=True)
    cross = torch.einsum("bij,bij->b", X, F).reshape(-1, 1, 1)
    C = torch.bmm(WF, W)
    C.addcmul_(s, X)
    return C.div_((s * s + 2 * s * cross + square).sqrt() / shrink)


def _dot(x: torch.Tensor, y: torch.Tensor) -> float:
    """<x, y> of two matrices of one shape (contiguous or transposed views alike), on the host,
    in double precision."""
    return torch.vdot(x.reshape(-1), y.reshape(-1)).item()


class _HostScalars:
    """`proj_split_matrix_`'s scalars on the host (Python floats): read without a sync from a
    CPU tensor, each scalar op free of a dispatch."""
    dot = staticmethod(_dot)
    sqrt = staticmethod(math.sqrt)

    @staticmethod
    def add_(K: torch.Tensor, L: torch.Tensor, c: float) -> torch.Tensor:
        return K.add_(L, alpha=c)  # K + c L

    @staticmethod
    def addmm_(F: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, c: float) -> torch.Tensor:
        return F.addmm_(a, b, beta=s * c, alpha=s)  # s (a b + c F), F its accumulator


class _TensorScalars:
    """`proj_split_matrix_`'s scalars as 0-dim float64 tensors, for a step that may not read a
    tensor on the host (a compiled one: a read would be data-dependent). The same GEMMs; where
    torch takes only a number (`alpha`, `beta`), the scale is an elementwise pass instead."""
    @staticmethod
    def dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.vdot(x.reshape(-1), y.reshape(-1)).to(torch.float64)

    sqrt = staticmethod(torch.sqrt)

    @staticmethod
    def add_(K: torch.Tensor, L: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return K.addcmul_(L, c)

    @staticmethod
    def addmm_(F: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: torch.Tensor,
               c: torch.Tensor) -> torch.Tensor:
        return F.mul_(s * c).addmm_(a.mul_(s), b)  # a is the thin side's product, scaled in place


def _thin_side_sums(L: torch.Tensor, R: torch.Tensor, g: torch.Tensor, c_left, c_right,
                    x=_HostScalars) -> tuple:
    """`proj_split_matrix_`'s wide case ([m, m], [n, n], [m, n] with m the thin side; its tall
    case is this one on (R, L, g^T)): the new left factor before its scaling, K = U' + c_L L with
    U' = g R g^T; g^T L, which makes the long side's factor; P = <L, U'>, |U'|^2, |V'|^2 =
    <L, W L W> (W = g g^T) and T = <W L W, K> + c_R (|U'|^2 + c_L P). `x`: where the scalars
    live (_HostScalars or _TensorScalars)."""
    K = torch.mm(torch.mm(g, R), g.T)  # U'
    gtL = torch.mm(g.T, L)
    W = torch.mm(g, g.T)
    WLW = torch.mm(W, torch.mm(L, W))
    P, uu, vv = x.dot(L, K), x.dot(K, K), x.dot(L, WLW)
    x.add_(K, L, c_left)
    return K, gtL, P, uu, vv, x.dot(WLW, K) + c_right * (uu + c_left * P)


def proj_split_matrix_(L: torch.Tensor, R: torch.Tensor, g: torch.Tensor,
                       beta: float, host: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`proj_split` of one matrix ([m, m], [n, n], [m, n]), the CPU's eager form, equal to it (and
    to `proj_split_batched`) up to rounding. Returns the new (L, R); on a tall or wide matrix the
    long side's new factor is written into its old one (L or R), the others are new tensors.

    Each new factor is written by its GEMM and touched once or twice more; every inner product
    over the long side is taken on the thin side or folded into a scalar; the scalars live on the
    host (a CPU's tensors are read without a sync; a scalar op on a tensor costs a dispatch).
    With a = |L|, b = |R|, shrink = 1 - beta (1 for beta = 1: g unscaled, as published) and
    U' = g R g^T, V' = g^T L g, the basis step's sums scaled by b and a are K = U' + c_L L and
    M = V' + c_R R (c_L = beta b^2 / shrink, c_R = beta a^2 / shrink): their directions are the
    published ones. Every inner product of the weight S comes from P = <L, U'> = <R, V'> (one
    trace, taken on the smaller side), q = beta a^2 b^2 / shrink and T = <K, g M g^T>:
    S = (beta (q + P)^2 + shrink T) / (|K| |M|), and the new factors are sqrt(S) K / |K| and
    sqrt(S) M / |M|, with |K|^2 = |U'|^2 + 2 c_L P + c_L^2 a^2 (and alike for M). Where the thin
    side's Gram matrix needs fewer multiply-adds (the rule of `proj_split_batched`) it gives T and
    the long side's squared norm, so that the long side's factor is needed only once, scaled, and
    is made in place by one GEMM with its old value as the accumulator:
    tall (Z = g^T g): T = <Z R Z, M> + c_L (|V'|^2 + c_R P), |U'|^2 = tr((R Z)^2) = <R, Z R Z>,
    new L = s (g R) g^T + s c_L L;
    wide (W = g g^T): T = <W L W, K> + c_R (|U'|^2 + c_L P), |V'|^2 = tr((L W)^2) = <L, W L W>,
    new R = s (g^T L) g + s c_R R;
    otherwise T = <K g, g M>.

    `host=False`: the scalars stay 0-dim tensors (float64), for a step that may not read a
    tensor on the host (a compiled one); the same GEMMs, equal up to rounding."""
    x = _HostScalars if host else _TensorScalars
    m, n = g.shape
    shrink = 1 - beta if beta != 1 else 1.0
    a2, b2 = x.dot(L, L), x.dot(R, R)
    c_left, c_right = beta * b2 / shrink, beta * a2 / shrink
    gt = g.T
    direct, wide, tall = m * n * (m + n), m * m * (n + 2 * m), n * n * (m + 2 * n)
    K = M = None  # the new factors once made: K on the left, M on the right
    if wide < min(direct, tall):
        K, gtL, P, uu, vv, T = _thin_side_sums(L, R, g, c_left, c_right, x)
    elif tall < direct:  # the wide case of g^T, the sides swapped
        M, gR, P, vv, uu, T = _thin_side_sums(R, L, gt, c_right, c_left, x)
    else:
        K = torch.mm(torch.mm(g, R), gt)
        M = torch.mm(torch.mm(gt, L), g)
        P = x.dot(R, M) if n <= m else x.dot(L, K)
        uu, vv = x.dot(K, K), x.dot(M, M)
        x.add_(K, L, c_left)
        x.add_(M, R, c_right)
        T = x.dot(torch.mm(K, g), torch.mm(g, M))
    kk = uu + 2 * c_left * P + c_left * c_left * a2
    mm = vv + 2 * c_right * P + c_right * c_right * b2
    root = x.sqrt((beta * (a2 * c_left + P) ** 2 + shrink * T) / x.sqrt(kk * mm))
    s_left, s_right = root / x.sqrt(kk), root / x.sqrt(mm)
    K = x.addmm_(L, gR, gt, s_left, c_left) if K is None else K.mul_(s_left)
    M = x.addmm_(R, gtL, g, s_right, c_right) if M is None else M.mul_(s_right)
    return K, M


def proj_split_from_zero(g: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """proj_split from zero factors (init="zeros"): with sigma = 0 only the unit directions
    I/||I|| of the "eps" start matter, so this is that start's limit as its scale goes to 0."""
    m, n = g.shape
    L = torch.eye(m, dtype=g.dtype, device=g.device)
    R = torch.eye(n, dtype=g.dtype, device=g.device)
    L, R = L / L.norm(), R / R.norm()
    if beta != 1:
        g = g * (1 - beta) ** 0.5
    U = g @ R @ g.T
    V = g.T @ L @ g
    U, V = U / U.norm(), V / V.norm()
    root = (U * (g @ V @ g.T)).sum() ** 0.5
    return U * root, V * root


# ----------------------------------------------------------------------------------- merge_dims
def merged_shape(shape, merge_dims: bool, limit: int, data_format: str) -> tuple[int, ...] | None:
    """The shape merge_dims gives a tensor (the published rule: consecutive dims multiplied while
    the product stays <= limit; a 4-D channels_last tensor read as (0, 3, 1, 2) first), or None
    when the tensor keeps its own dims in their own order."""
    if not merge_dims or len(shape) < 2:
        return None
    dims = list(shape)
    if data_format == "channels_last" and len(dims) == 4:
        dims = [dims[0], dims[3], dims[1], dims[2]]
    merged, current = [], 1
    for sh in dims:
        if current * sh > limit:
            if current > 1:
                merged.append(current)
                current = sh
            else:
                merged.append(sh)
                current = 1
        else:
            current *= sh
    if current > 1 or not merged:
        merged.append(current)
    if tuple(merged) == tuple(shape) and dims == list(shape):
        return None
    return tuple(merged)


def to_merged(x: torch.Tensor, shape, data_format: str) -> torch.Tensor:
    if data_format == "channels_last" and x.dim() == 4:
        x = x.permute(0, 3, 1, 2)
    return x.reshape(shape)


def from_merged(x: torch.Tensor, shape, data_format: str) -> torch.Tensor:
    if data_format == "channels_last" and len(shape) == 4:
        return x.reshape(shape[0], shape[3], shape[1], shape[2]).permute(0, 2, 3, 1)
    return x.reshape(shape)
