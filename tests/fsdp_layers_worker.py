"""One rank of the 2-process CPU/gloo run of tests/test_adafisher_layers.py's FSDP2 test.

Started by tests/two_ranks.py's `launch` as `python tests/fsdp_layers_worker.py OUTDIR`. AdaFisher
trains a model of the layers whose weight is stored with its rows on the activation side (an
Embedding, a transformers-style Conv1D) and a Conv1d, in float64, twice on the same per-rank
batches: under DDP and with `fully_shard` on every layer and the root (dim 0 of 7 and 5 rows
shards unevenly: 4 + 3, 3 + 2). The full parameters of both runs go to `rank{r}.pt`.
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
        self.emb = nn.Embedding(7, 5)
        self.proj = Conv1D(3, 5)
        self.conv = nn.Conv1d(3, 2, 3, padding=1)

    def forward(self, idx):
        h = torch.tanh(self.proj(self.emb(idx)))  # [B, T, 3]
        return self.conv(h.transpose(1, 2))  # [B, 2, T]


def make_model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 7, (3, 6), generator=g), torch.randn(3, 2, 6, generator=g, dtype=torch.float64)


def train(net, opt, rank):
    for k in range(STEPS):
        opt.zero_grad(set_to_none=True)
        idx, target = batch(k, rank)
        F.mse_loss(net(idx), target).backward()
        opt.step()


def main() -> None:
    import cafin
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    outdir = sys.argv[1]
    rank, _ = two_ranks.join(outdir)
    result = {}
    model = make_model()
    net = DDP(model)
    train(net, cafin.AdaFisher(net, lr=1e-3, TCov=TCOV, weight_decay=1e-2), rank)
    result["ddp"] = two_ranks.full_params(model)
    model = make_model()
    for module in (model.emb, model.proj, model.conv):
        fully_shard(module)
    fully_shard(model)
    train(model, cafin.AdaFisher(model, lr=1e-3, TCov=TCOV, weight_decay=1e-2), rank)
    result["fsdp"] = two_ranks.full_params(model)
    result["initial"] = two_ranks.full_params(make_model())
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    two_ranks.leave()


if __name__ == "__main__":
    main()
