"""Two-level K-FAC (cafin.TwoLevelKFAC) with the SGD its published training loops run after it.

Its `details` phase times what the member adds to K-FAC on a curvature step: the coarse matrix,
assembled the cheap way (fused: one N x L matrix of per-sample projections, F_c = U^T U / B) and
the published way (reference: cafin.maths.twolevel.coarse_matrix_pairwise, entry by entry, each Conv2d
projection through an N' x N' matrix). It runs on a small CNN of its own whatever --model is
(the statistics of every layer are stored per location), and shows in a table of its own,
"coarse assembly", as "two-level" (a short label: a longer one makes the table wrap)."""
from __future__ import annotations

from . import Member, PreconditionerWithSGD

# The details' network: 3 Conv2d and 2 Linear on 3 x 8 x 8 inputs, batch 16.
BATCH, CHANNELS, SIDE = 16, 8, 8


def _build(model, backend: str, curvature_every: int) -> PreconditionerWithSGD:
    import torch
    import cafin
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # The published clipping on (constraint_norm), and damping 1e-2: without them the bench
    # models diverge within a few steps and eigh fails on the non-finite factors.
    pre = cafin.TwoLevelKFAC(model, damping=1e-2, T_cov=curvature_every, T_inv=curvature_every,
                             constraint_norm=True, backend=backend)
    pre.update_stats = True  # the hooks keep each pass's statistics; T_cov steps use them
    return PreconditionerWithSGD(params, pre, opt)


def _coarse_inputs(device):
    """A preconditioner with the statistics of one curvature step, and its coarse vectors."""
    import torch
    import torch.nn.functional as F
    from torch import nn
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
    raws = [pre._grad_matrix(g) for g in pre.param_groups]
    vectors = [pre._coarse_vectors(s, r, None) for s, r in zip(states, raws)]
    return pre, states, vectors


def details(ctx) -> None:
    if "statistics" not in ctx.phases:
        return
    import cafin
    from ..speed import measure
    pre, states, vectors = _coarse_inputs(ctx.run.device)
    flat = [v for vs in vectors for v in vs]

    def published():
        return lambda: cafin.maths.twolevel.coarse_matrix_pairwise(
            [s["x"] for s in states], [s["gy"] for s in states], [s["num_locations"] for s in states],
            flat, pre.batch_size, pre.damping)

    def cheap():
        return lambda: pre._assemble(vectors)
    # A phase of its own: beside AdaFisher's statistics its floor and totals would mean nothing.
    measure(ctx.run, ctx.progress, "coarse assembly", "twolevel", "reference", published)
    measure(ctx.run, ctx.progress, "coarse assembly", "twolevel", "fused", cheap)


MEMBER = Member(
    name="twolevel", label="two-level",
    build=_build,
    backends=("fused", "reference"), compiles=False, captures=False,
    # A plain run shows only the coarse assembly (details); the step rows on request
    # (--optimizers twolevel --variants fused): GPT's 3-D Linear inputs are not supported.
    default_variants=(), details=details, order=40)
