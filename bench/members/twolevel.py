"""Two-level K-FAC (cafin.TwoLevelKFAC) with the SGD its published training loops run after it:
`update_stats = True` before the forward pass, `step(update_params=True)` after backward, then
SGD (`bench.measure.PreconditionedSGD` with `stats_flag=True`).

Its `details` phase times what the member adds to K-FAC on a curvature step: the coarse matrix,
assembled the cheap way (fused: one N x L matrix of per-sample projections, F_c = U^T U / B) and
the published way (reference: cafin.maths.twolevel.coarse_matrix_pairwise, entry by entry, each Conv2d
projection through an N' x N' matrix). It runs on a small CNN of its own whatever --model is
(the statistics of every layer are stored per location), and shows in a table of its own,
"coarse assembly", as "two-level" (a short label: a longer one makes the table wrap)."""
from __future__ import annotations


import torch
from torch import nn

from ..measure import PreconditionedSGD, measure
from . import Member

# The details' network: 3 Conv2d and 2 Linear on 3 x 8 x 8 inputs, batch 16.
BATCH, CHANNELS, SIDE = 16, 8, 8
COARSE_SPACES = ("nicolaides", "spectral", "residual", "tselepidis")
KRYLOV_SPACES = ("nicolaides", "residual")  # krylov=True is defined for these only


def sgd(model: nn.Module, lr: float, coarse_space: str | None = "nicolaides", krylov: bool = False,
        restore_grads: bool = False, **kwargs) -> PreconditionedSGD:
    """SGD (momentum 0.9, fused) after cafin.TwoLevelKFAC(model, coarse_space, krylov, **kwargs);
    coarse_space None: the same K-FAC with the coarse correction off ("none")."""
    import cafin
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True)  # as K-FAC's (members/kfac.py)
    pre = cafin.TwoLevelKFAC(preconditioned(model), coarse_space=coarse_space or "none",
                             krylov=krylov, **kwargs)
    return PreconditionedSGD(pre, opt, stats_flag=True, restore_grads=restore_grads)


def preconditioned(model: nn.Module) -> nn.Module:
    """What two-level K-FAC is built on: the model, or, where it holds an Embedding (which
    two-level refuses: its input factor would be vocabulary x vocabulary), its children that
    hold none and share no parameter with one, as the refusal's message advises (on the bench's
    GPT: the transformer blocks; the tied head is the embedding's weight). SGD still updates
    every parameter."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return model
    shared = {id(p) for m in embeddings for p in m.parameters()}
    return nn.ModuleList([child for child in model.children()
                          if not any(isinstance(m, nn.Embedding) for m in child.modules())
                          and not any(id(p) in shared for p in child.parameters())])


def label(coarse_space: str | None, krylov: bool = False) -> str:
    if coarse_space is None:
        return "K-FAC (two-level's, coarse off)"
    return f"two-level K-FAC ({coarse_space}{' + krylov' if krylov else ''})"


def _build(model, backend: str, curvature_every: int) -> PreconditionedSGD:
    # The published clipping on (constraint_norm), and damping 1e-2: without them the bench
    # models diverge within a few steps and eigh fails on the non-finite factors.
    return sgd(model, 0.05, damping=1e-2, T_cov=curvature_every, T_inv=curvature_every,
               constraint_norm=True, backend=backend, restore_grads=True)


def _coarse_inputs(device):
    """A preconditioner with the statistics of one curvature step, and its coarse vectors:
    nicolaides' (the default coarse space), all ones over each layer's weight-and-bias matrix."""
    import torch.nn.functional as F
    import cafin
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    c = CHANNELS
    net = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(c, c, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                        nn.Linear(c * (SIDE // 2) ** 2, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)
    pre = cafin.TwoLevelKFAC(net, T_cov=1, T_inv=1)
    x = torch.randn(BATCH, 3, SIDE, SIDE, generator=gen).to(device)
    t = torch.randint(0, 10, (BATCH,), generator=gen).to(device)
    pre.update_stats = True
    F.cross_entropy(net(x), t).backward()
    pre.step()
    states = [pre.state[g["params"][0]] for g in pre.param_groups]
    vectors = []
    for group in pre.param_groups:
        weight = group["params"][0]
        columns = weight[0].numel() + (len(group["params"]) == 2)  # the bias: one more column
        vectors.append([torch.ones(weight.shape[0], columns, dtype=weight.dtype, device=device)])
    return pre, states, vectors


def details(ctx) -> None:
    if "statistics" not in ctx.phases:
        return
    import cafin
    pre, states, vectors = _coarse_inputs(ctx.run.device)
    flat = [v for vs in vectors for v in vs]

    def published():
        return lambda: cafin.maths.twolevel.coarse_matrix_pairwise(
            [s["x"] for s in states], [s["gy"] for s in states], [s["num_locations"] for s in states],
            flat, pre.batch_size, pre.damping)

    def cheap():
        return lambda: pre.coarse_matrix(vectors)
    # A phase of its own: beside AdaFisher's statistics its floor and totals would mean nothing.
    measure(ctx.run, ctx.progress, "coarse assembly", "twolevel", "reference", published)
    measure(ctx.run, ctx.progress, "coarse assembly", "twolevel", "fused", cheap)


MEMBER = Member(
    name="twolevel", label="two-level",
    build=_build,
    backends=("fused", "reference"), compiles=False, captures=False,
    # A plain run shows only the coarse assembly (details); the step rows on request
    # (--optimizers twolevel --variants fused).
    default_variants=(), details=details, order=40)
