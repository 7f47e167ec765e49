"""The physical floor of each member's step in the speed bench: the floating-point operations of
its GEMMs at the single-precision GEMM rate measured in the same run, plus the bytes of its
elementwise passes at the copy bandwidth measured in the same run.

One function per member, counting from the shapes of the model the bench builds it on (the
layers the member itself registers), for the step its "step" rows time (a step that updates no
factors and decomposes nothing, followed by its torch optimizer where it has one):

- `kfac`: K-FAC's eigenbasis products, then SGD (momentum, weight decay);
- `singd`: SINGD's structured products (none for diagonal K and C: elementwise), then its SGD;
- `dykaf`: DyKAF's rotations into and out of the eigenbases and its factor split, then its update;
- `twolevel`: two-level K-FAC's first-level products and its coarse product, then SGD.

The elementwise bytes count each tensor a pass must read or write once, in float32 (4 B), for
the passes the maths cannot merge (a reduction, such as a clip factor, must finish before the
pass that uses it). GEMM operands are not counted as bytes: the GEMM rate includes them.
K-FAC and two-level rewrite the gradients, so the bench restores them after every step
(`PreconditionedSGD(restore_grads=True)`: a clone and a copy back, 16 B per gradient element);
their floors include that, since their rows time it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

F32 = 4  # bytes per element
SGD_BYTES = 5 * F32  # read theta, g, momentum buffer; write theta, buffer
RESTORE_BYTES = 4 * F32  # the bench's gradient restore: clone (read, write), copy back (read, write)
# K-FAC, per gradient-matrix element: read the eigenvalue scaling (dgda); the KL-clip sum
# <v, g> (read v, g); the write (read v, write g).
KFAC_BYTES = 5 * F32
# Two-level K-FAC (nicolaides), per gradient-matrix element: read g (its sum, the coarse
# right-hand side <c ones, g>); the clip norm <v + c y, g> (read v, g); the write of
# (v + c y) times the clip factor (read v, write g). Its eigenvalue scaling reads two vectors,
# the correction c y is one number per layer (no per-element bytes).
TWOLEVEL_BYTES = 5 * F32
# DyKAF, per parameter element: read g; read and write theta; the first moment (read, write):
# 5 x 4 B. A full second moment (parameters without a rank-one one): read and write, 2 x 4 B.
DYKAF_BYTES, DYKAF_SECOND_MOMENT_BYTES = 5 * F32, 2 * F32


@dataclass(frozen=True)
class Floor:
    """A member's step floor: `flop` of GEMMs and `bytes` of elementwise passes."""
    optimizer: str
    flop: int
    bytes: int

    def ms(self, gemm_flop_s: float, bandwidth_b_s: float) -> float:
        """Milliseconds at the GEMM rate (FLOP/s) and copy bandwidth (B/s) of this run."""
        return (self.flop / gemm_flop_s + self.bytes / bandwidth_b_s) * 1e3

    def to_json(self, gemm_flop_s: float, bandwidth_b_s: float) -> dict:
        return {"optimizer": self.optimizer, "step_floor_ms": self.ms(gemm_flop_s, bandwidth_b_s),
                "flop": self.flop, "bytes": self.bytes}


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device: the members register their layers on it without
    allocating their factors (ResNet-18's would take seconds and gigabytes). Tied parameters
    stay tied (one meta parameter each)."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]  # tied parameters once


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def eigenbasis_flops(groups: int, d_a: int, d_g: int, diagonal_a: bool = False) -> int:
    """The GEMMs of Q_G (Q_G^T V Q_A (.) S) Q_A^T on one layer's [groups, d_g, d_a] gradient
    matrix: 4 d_g d_a (d_g + d_a) per group (Q_G^T V and Q_G W: 2 d_g^2 d_a each; V Q_A and
    W Q_A^T: 2 d_g d_a^2 each); a diagonal A (Q_A = I) leaves the two Q_G products, 4 d_g^2 d_a."""
    return groups * 4 * d_g * d_a * (d_g if diagonal_a else d_g + d_a)


def kfac_layers(model: nn.Module) -> list[tuple[int, int, int, bool]]:
    """(groups, d_a, d_g, diagonal A) of each layer KFACPreconditioner registers on `model`."""
    import cafin
    from cafin import factors
    pre = cafin.KFACPreconditioner(_meta_copy(model), backend="reference")
    return [(*factors.factor_sizes(layer.module), factors.diagonal_input(layer.module))
            for layer in pre.layers]


def kfac(model: nn.Module) -> Floor:
    """K-FAC + SGD (the bench's "kfac" step): the eigenbasis products of every registered layer,
    KFAC_BYTES per gradient-matrix element, SGD and the gradient restore over every parameter."""
    flop = elements = 0
    for groups, d_a, d_g, diagonal in kfac_layers(model):
        flop += eigenbasis_flops(groups, d_a, d_g, diagonal)
        elements += groups * d_a * d_g
    params = _numel(_trainable(model))
    return Floor("kfac", flop, KFAC_BYTES * elements + (SGD_BYTES + RESTORE_BYTES) * params)


def singd(model: nn.Module, structure: str = "diagonal") -> Floor:
    """SINGD with `structure` for K and C (the bench's step rows: "diagonal"), a step that
    updates no preconditioner: C C^T G K K^T per layer, each structured product with M [d, n]
    costing 2 x (stored entries of the structure) x n FLOPs, two per side; none for a diagonal
    side, whose scaling is part of the elementwise update. Elementwise: SGD over every parameter,
    and for a layer whose products are GEMMs the natural gradient written and read (2 x 4 B per
    element); diagonal factors read once per layer."""
    import cafin
    from cafin.structures import Diagonal, structure as structure_class
    work = _meta_copy(model)
    opt = cafin.SINGD(work, structures=(structure, structure), warn_unsupported=False)
    flop = extra = 0
    seen = set()
    for module in work.modules():
        weight = getattr(module, "weight", None)
        if weight is None or id(weight) in seen or "K.0" not in opt.state.get(weight, {}):
            continue
        seen.add(id(weight))
        d_k, d_c = cafin.SINGD.dims(module)
        sk = Diagonal if isinstance(module, nn.Embedding) else structure_class(structure)
        sc = structure_class(structure)
        for kind, d, other in ((sk, d_k, d_c), (sc, d_c, d_k)):
            stored = sum(torch.Size(s).numel() for s in kind.shapes(d))
            if kind is Diagonal:
                extra += F32 * stored
            else:
                flop += 2 * 2 * stored * other
        if not (sk is Diagonal and sc is Diagonal):
            extra += 2 * F32 * d_k * d_c
    return Floor("singd", flop, SGD_BYTES * _numel(_trainable(model)) + extra)


def dykaf(model: nn.Module, max_precond_dim: int = 10000) -> Floor:
    """DyKAF's plain step (no eigenbasis refresh) with its defaults (no merge_dims, no
    precondition_1d, the rank-one second moment). Per 2-D parameter [m, n] with both sides <=
    max_precond_dim: the rotation of the gradient Q_L^T G Q_R and back Q_L U Q_R^T (2 mn(m + n)
    each), and the factor split's three two-sided products G R G^T, G^T L G and G V G^T
    (2 mn(m + n) each): 10 mn(m + n); its factors L, R read and written (8 (m^2 + n^2) B).
    4-D parameters: the rotations of every mode (2 x 2 numel d_k per mode), their split not
    counted (a lower bound). Every other parameter: Adam's elementwise update with a full second
    moment, no GEMM."""
    flop = nbytes = 0
    for p in _trainable(model):
        nbytes += DYKAF_BYTES * p.numel()
        if p.dim() == 2 and max(p.shape) <= max_precond_dim:
            m, n = p.shape
            flop += 10 * m * n * (m + n)
            nbytes += 2 * F32 * (m * m + n * n)
        elif p.dim() == 4 and max(p.shape) <= max_precond_dim:
            flop += sum(2 * 2 * p.numel() * d for d in p.shape)
            nbytes += DYKAF_SECOND_MOMENT_BYTES * p.numel()
        else:
            nbytes += DYKAF_SECOND_MOMENT_BYTES * p.numel()
    return Floor("dykaf", flop, nbytes)


def twolevel(model: nn.Module) -> Floor:
    """Two-level K-FAC + SGD (the bench's "twolevel" step, nicolaides coarse space, a step that
    assembles no coarse matrix, on the layers `members.twolevel.preconditioned` picks): per
    layer the first level's eigenbasis products on its [d_out,
    d_in (+1)] gradient matrix, the coarse solve F_c^-1 r (2 L^2 for L layers) and
    TWOLEVEL_BYTES per gradient-matrix element; SGD and the gradient restore over every
    parameter."""
    flop = elements = 0
    layers = twolevel_layers(model)
    for groups, d_a, d_g, diagonal in layers:
        flop += eigenbasis_flops(groups, d_a, d_g, diagonal)
        elements += d_a * d_g
    flop += 2 * len(layers) * len(layers)
    params = _numel(_trainable(model))
    return Floor("twolevel", flop, TWOLEVEL_BYTES * elements + (SGD_BYTES + RESTORE_BYTES) * params)


FLOORS = {"kfac": kfac, "singd": singd, "dykaf": dykaf, "twolevel": twolevel}


def twolevel_layers(model: nn.Module) -> list[tuple[int, int, int, bool]]:
    """(groups, d_a, d_g, diagonal A) of each layer two-level K-FAC registers on `model`."""
    import cafin
    from .members.twolevel import preconditioned
    pre = cafin.TwoLevelKFAC(preconditioned(_meta_copy(model)))
    out = []
    for group in pre.param_groups:
        w = group["params"][0]
        transposed = group["layer_type"] == "Conv1D"
        d_g = w.shape[1] if transposed else w.shape[0]
        d_a = (w.shape[0] if transposed else w[0].numel()) + (len(group["params"]) == 2)
        out.append((1, d_a, d_g, False))
    return out


# The members whose step GEMMs are the eigenbasis products of their layers.
EIGENBASIS_LAYERS = {"kfac": kfac_layers, "twolevel": twolevel_layers}


def eigenbasis_products(layers, device: torch.device) -> partial:
    """The eigenbasis products of `layers` ((groups, d_a, d_g, diagonal A) each) and little else:
    random float32 operands (orthogonal bases) in kept, row-aligned buffers, one
    `kfac_eigen_products_` call over every layer's matrices, as the members' eager steps run them
    (in the right-multiplication form; on the CPU the layers shared out over the threads), with
    a scaling by ones, one elementwise pass per layer; the call's arguments are its `.args`.
    Timed in the bench next to the member's step, it measures what the device's GEMMs give at
    these shapes, which the floor's 512^3 rate does not model."""
    from cafin import ops
    from cafin.maths import kfac as kfac_maths
    gen = torch.Generator().manual_seed(0)

    def kept(*shape, orthogonal=False):
        values = torch.rand(shape, generator=gen)
        if orthogonal:  # the products repeat on their own results: keep them bounded
            values = torch.linalg.qr(values)[0]
        return kfac_maths.aligned_empty(shape, dtype=torch.float32, device=device).copy_(values)

    entries = []
    for groups, d_a, d_g, diagonal in layers:
        for _ in range(groups):
            qg, grad = kept(d_g, d_g, orthogonal=True), kept(d_g, d_a)
            qa = None if diagonal else kept(d_a, d_a, orthogonal=True)
            work = kept(d_g, d_a) if diagonal else kept(d_a, d_g)
            entries.append((grad, work, None, qa, qg, torch.ones_like(grad)))
    return partial(ops.kfac_eigen_products_, *(list(column) for column in zip(*entries)))


def member_floors(model: nn.Module, names) -> tuple[list[Floor], dict[str, str]]:
    """The floors of the members named (those with a floor function), and why any could not be
    counted on this model (name -> the error), e.g. a member that refuses the model."""
    out, failed = [], {}
    for name in names:
        if name not in FLOORS:
            continue
        try:
            out.append(FLOORS[name](model))
        except (TypeError, ValueError, RuntimeError) as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return out, failed
