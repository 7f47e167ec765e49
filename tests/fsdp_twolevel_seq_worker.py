"""One rank of the 2-process CPU/gloo run of tests/test_twolevel.py's FSDP2 sequence test.

Started by tests/two_ranks.py's `launch` as `python tests/fsdp_twolevel_seq_worker.py OUTDIR`.
TwoLevelKFAC (+ SGD) trains a model of a Linear on [B, T, D] inputs, a transformers-style Conv1D
(weight [in, out]: its rows, the ones a rank holds, are on the input side) and a Linear head on
2-D inputs, in float64, twice on the same per-rank batches: under DDP and with `fully_shard` on
every layer and the root (dim 0 of 5, 7 and 3 rows shards unevenly). The full parameters of both
runs go to `rank{r}.pt`.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import two_ranks
from stand_ins import Conv1D

STEPS = 5  # curvature steps at k = 0, 2, 4
TCOV = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.proj = Conv1D(3, 7)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))  # [B, T, 5]
        h = torch.tanh(self.proj(torch.cat([h, h[..., :2] ** 2], -1)))  # [B, T, 3]
        return self.head(h.mean(1))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)


def train(net, model, rank, coarse_space):
    import cafin
    pre = cafin.TwoLevelKFAC(net, damping=0.01, T_cov=TCOV, T_inv=TCOV, coarse_space=coarse_space)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k in range(STEPS):
        opt.zero_grad(set_to_none=True)
        pre.update_stats = True
        x, t = batch(k, rank)
        F.cross_entropy(net(x), t).backward()
        pre.step(update_params=True)
        opt.step()


def main() -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    outdir = sys.argv[1]
    rank, _ = two_ranks.join(outdir)
    result = {"initial": two_ranks.full_params(make_model())}
    for coarse_space in ("nicolaides", "residual"):
        model = make_model()
        train(DDP(model), model, rank, coarse_space)
        result[f"ddp-{coarse_space}"] = two_ranks.full_params(model)
        model = make_model()
        for module in (model.inp, model.proj, model.head):
            fully_shard(module)
        fully_shard(model)
        train(model, model, rank, coarse_space)
        result[f"fsdp-{coarse_space}"] = two_ranks.full_params(model)
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    two_ranks.leave()


if __name__ == "__main__":
    main()
