"""Modules of optional libraries, written to their contract so that tests run without them."""
import torch
from torch import nn


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D (GPT-2's projections): weight [nx, nf], x @ weight + bias.
    cafin recognises it by its class name and this shape contract."""

    def __init__(self, nf: int, nx: int, bias: bool = True, weight_scale: float = 0.3,
                 bias_scale: float = 0.1) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * weight_scale)
        self.bias = nn.Parameter(torch.randn(nf) * bias_scale) if bias else None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        out = flat @ self.weight if self.bias is None else torch.addmm(self.bias, flat, self.weight)
        return out.reshape(*x.shape[:-1], self.nf)
