"""An `nn.Embedding`'s `padding_idx` row, whose gradient is always zero, without weight decay:
every member that gives the Embedding curvature keeps it bit for bit (its update is zero row by
row), two-level K-FAC refuses the Embedding, and DyKAF moves it, as docs/dykaf.md says: its
update is rotated by the left eigenbasis, which mixes the rows (as in the published code), unless
the vocabulary is over max_precond_dim (that side then not rotated)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from members import IDS, MEMBERS, Run

PAD = 0
STEPS = 5


class Bag(nn.Module):
    """Token ids [B, T] -> class logits: an Embedding averaged over the sequence, a Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 6, padding_idx=PAD)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 9, (8, 5), generator=g)
    x[:, -2:] = PAD  # padded sequences: the padding token in every batch
    return x, torch.randint(0, 4, (8,), generator=g)


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_padding_row(member):
    torch.manual_seed(0)
    model = Bag().double()
    before = model.emb.weight[PAD].clone()
    kw = {} if member.preconditioner else {"weight_decay": 0.0}
    if member.name == "TwoLevelKFAC":
        with pytest.raises(ValueError, match="Embedding"):
            Run(member, model, **kw)
        return
    run = Run(member, model, **kw)
    for step in range(STEPS):
        x, y = batch(step)
        run.backward(x, y)
        assert not model.emb.weight.grad[PAD].any()  # the row's gradient is zero
        run.update()
    moved = (model.emb.weight[PAD] - before).abs().max().item()
    torch.manual_seed(0)
    assert (model.emb.weight[1:] != Bag().double().emb.weight[1:]).any()  # the others trained
    if member.name == "DyKAF":
        assert moved > 1e-4, moved  # documented in docs/dykaf.md
    else:
        assert moved == 0.0, moved


def test_dykaf_keeps_the_padding_row_when_the_vocabulary_side_is_not_rotated():
    """A vocabulary over max_precond_dim (an LLM's, under the default 10000) leaves the rows
    unrotated: each row's update is its own, and the padding row's is zero."""
    import cafin
    torch.manual_seed(0)
    model = Bag().double()
    before = model.emb.weight.detach().clone()
    opt = cafin.DyKAF(model.parameters(), lr=1e-2, precondition_frequency=1, weight_decay=0.0,
                      max_precond_dim=8)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.state[model.emb.weight]["factors"][0] is None  # 9 rows > 8: not rotated
    assert torch.equal(model.emb.weight[PAD], before[PAD])
    assert (model.emb.weight[1:] != before[1:]).any()
