"""The physical floor of each member's step in the speed bench: the floating-point operations of
its GEMMs at the rate a large product of the member's precision reaches in the same run
(`gemm_size`: 512^3 on the CPU, 4096^3 on a GPU, where a 512^3 product is launch-bound), plus
the bytes of its elementwise passes at the copy bandwidth measured in the same run, plus its
launches at the cost of one launch measured in the same run (`launch_cost`). A floor above the
measured time is an error of the floor, never a member beating it (`check`).

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

The launches are the fewest kernels the step needs: one per pass the maths cannot merge, each
over every layer at once (a multi-tensor launch), and one per stage of GEMMs (every layer's
product of that stage as one grouped launch). A step that launches one kernel per layer pays
the difference; on the CPU the term is microseconds, on a GPU it is what a captured step saves.
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


# The fewest launches of each member's step (see the module's docstring): GEMM stages, then
# elementwise passes.
SGD_LAUNCHES = 1  # torch's fused SGD: one multi-tensor pass
RESTORE_LAUNCHES = 2  # the bench's gradient restore: a copy out, a copy back
# K-FAC: Q_G^T V, V Q_A, W Q_A^T, Q_G W; the scaling (merged into a product's epilogue at best),
# the KL-clip sum, the write.
KFAC_LAUNCHES = 4 + 2 + SGD_LAUNCHES + RESTORE_LAUNCHES
# Two-level: K-FAC's, plus the coarse right-hand side and the coarse solve.
TWOLEVEL_LAUNCHES = KFAC_LAUNCHES + 2
# DyKAF: the rotations in and out (2 stages each), the split's three two-sided products (2 each),
# the update.
DYKAF_LAUNCHES = 4 + 6 + 1


def gemm_size(device: torch.device) -> int:
    """The side of the square product whose rate prices a floor's GEMMs on `device`: a size at
    which the device reaches its attainable rate. On the CPU 512 (MKL is at its rate there and
    the members' products are of that order); on a GPU 4096 (a 512^3 product there is a few
    microseconds, mostly launch, and its rate would price the GEMMs several times too high)."""
    return 4096 if device.type == "cuda" else 512


def launch_cost(device: torch.device, calls: int = 200, repeats: int = 7) -> float:
    """Seconds per launch of the cheapest op: `t.add_(1)` on one element, `calls` back to back
    then one synchronisation, the median over `repeats` batches (CUDA: a kernel launch; CPU: one
    op's dispatch)."""
    import statistics
    import time
    t = torch.zeros(1, device=device)
    cuda = device.type == "cuda"
    samples = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            t.add_(1)
        if cuda:
            torch.cuda.synchronize(device)
        if i:  # the first batch warms up
            samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


@dataclass(frozen=True)
class Floor:
    """A member's step floor: `flop` of GEMMs in `dtype`, `bytes` of elementwise passes and
    `launches` (the fewest kernels the step needs)."""
    optimizer: str
    flop: int
    bytes: int
    launches: int = 0
    dtype: str = "float32"

    def ms(self, gemm_flop_s: float, bandwidth_b_s: float, launch_s: float = 0.0) -> float:
        """Milliseconds at the GEMM rate (FLOP/s), copy bandwidth (B/s) and cost of one launch
        (s) of this run."""
        return (self.flop / gemm_flop_s + self.bytes / bandwidth_b_s + self.launches * launch_s) * 1e3

    def to_json(self, gemm_flop_s: float, bandwidth_b_s: float, launch_s: float = 0.0) -> dict:
        return {"optimizer": self.optimizer,
                "step_floor_ms": self.ms(gemm_flop_s, bandwidth_b_s, launch_s),
                "flop": self.flop, "bytes": self.bytes, "launches": self.launches,
                "dtype": self.dtype, "gemm_ms": self.flop / gemm_flop_s * 1e3,
                "bytes_ms": self.bytes / bandwidth_b_s * 1e3, "launch_ms": self.launches * launch_s * 1e3}


def check(measured_ms: float, floor: dict, gemms_alone_ms: float | None = None) -> dict:
    """`measured_ms` against a floor (`Floor.to_json`'s dict): the ratio, and where the floor is
    above the measured time, `floor_error` with a note saying which term is wrong, since no step
    runs under its floor; the floor is then not a target the member has met. With the member's
    GEMMs-alone time measured in the same run, the floor is also priced with it in place of the
    GEMM term (`x_floor_gemms_alone`), the rate these very shapes reach."""
    floor_ms = floor["step_floor_ms"]
    out = {"measured_ms": measured_ms, "floor_ms": floor_ms, "x_floor": measured_ms / floor_ms,
           "floor_error": floor_ms > measured_ms}
    if gemms_alone_ms is not None:
        alone = gemms_alone_ms + floor.get("bytes_ms", 0.0) + floor.get("launch_ms", 0.0)
        out["floor_ms_gemms_alone"] = alone
        out["x_floor_gemms_alone"] = measured_ms / alone
    if out["floor_error"]:
        terms = {k: floor[k] for k in ("gemm_ms", "bytes_ms", "launch_ms") if k in floor}
        big = max(terms, key=terms.get) if terms else "step_floor_ms"
        out["note"] = (f"floor error: the floor ({floor_ms:.4g} ms) is above the measured "
                       f"{measured_ms:.4g} ms; its largest term is {big} ({terms.get(big, floor_ms):.4g} "
                       "ms), priced too high for this device")
    return out


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
    return Floor("kfac", flop, KFAC_BYTES * elements + (SGD_BYTES + RESTORE_BYTES) * params,
                 KFAC_LAUNCHES)


def singd(model: nn.Module, structure: str = "diagonal") -> Floor:
    """SINGD with `structure` for K and C (the bench's step rows: "diagonal"), a step that
    updates no preconditioner: C C^T G K K^T per layer, each structured product with M [d, n]
    costing 2 x (stored entries of the structure) x n FLOPs, two per side; none for a diagonal
    side, whose scaling is part of the elementwise update. Elementwise: SGD over every parameter,
    and for a layer whose products are GEMMs the natural gradient written and read (2 x 4 B per
    element); diagonal factors read once per layer."""
    import cafin
    from cafin.optim.singd.structures import Diagonal, structure as structure_class
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
    # One elementwise update, and four grouped GEMM stages where a side is not diagonal.
    return Floor("singd", flop, SGD_BYTES * _numel(_trainable(model)) + extra,
                 1 + (4 if flop else 0))


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
    return Floor("dykaf", flop, nbytes, DYKAF_LAUNCHES)


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
    return Floor("twolevel", flop,
                 TWOLEVEL_BYTES * elements + (SGD_BYTES + RESTORE_BYTES) * params, TWOLEVEL_LAUNCHES)


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


def check_floors(run, gemms_alone_variant: str) -> None:
    """Each member floor of a speed-bench run (`run.floor["members"]`) against the member's
    fused step row, with its GEMMs-alone row where it has one: `check`'s dict as the floor's
    "check" entry."""
    for f in run.floor.get("members", []):
        r = run.result("step", "fused", f["optimizer"])
        alone = run.result("step", gemms_alone_variant, f["optimizer"])
        if r is not None:
            f["check"] = check(r.median_ms, f, alone.median_ms if alone else None)


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
