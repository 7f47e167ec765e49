"""Models for the bench and the tests, written here so nothing needs torchvision.

- `resnet18`: the CIFAR variant (3x3 stem, no max-pool), about 11M parameters at width 64;
  `width`/`blocks` shrink it for tests.
- `gpt`: a GPT-style stack (token + position embedding, pre-LayerNorm blocks of causal
  self-attention written with Linear layers on [B, T, C], an MLP, a tied decoder).
- `mlp`: Linear/ReLU layers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.inplace = True  # see `relu_in_place`
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=self.inplace)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=self.inplace)


class ResNet(nn.Module):
    def __init__(self, blocks=(2, 2, 2, 2), width: int = 64, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.inplace = True
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, stride=2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=self.inplace)
        out = self.layers(out)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def resnet18(num_classes: int = 10, width: int = 64, blocks=(2, 2, 2, 2)) -> ResNet:
    return ResNet(blocks, width, num_classes)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, depth: int = 4, heads: int = 4,
                 context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied decoder: the Linear's curvature applies
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def gpt(**kwargs) -> GPT:
    return GPT(**kwargs)


def mlp(sizes=(784, 512, 256, 10)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch_for(name: str, model: nn.Module, batch_size: int, generator=None, device="cpu"):
    """A random (input, target) batch of the shape each model takes."""
    g = dict(generator=generator, device=device)
    if name == "resnet18":
        return (torch.randn(batch_size, 3, 32, 32, **g),
                torch.randint(0, model.fc.out_features, (batch_size,), **g))
    if name == "gpt":
        vocab, context = model.tok.num_embeddings, model.pos.shape[0]
        idx = torch.randint(0, vocab, (batch_size, context + 1), **g)
        return idx[:, :-1], idx[:, 1:]
    if name == "mlp":
        return (torch.randn(batch_size, model[0].in_features, **g),
                torch.randint(0, model[-1].out_features, (batch_size,), **g))
    raise ValueError(f"unknown model {name!r}; choose resnet18, gpt or mlp")


def loss_for(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.cross_entropy(output, target)


def relu_in_place(model: nn.Module, flag: bool) -> nn.Module:
    """Turn the ResNet's in-place ReLUs on or off. The published AdaFisher takes gradient
    statistics with full backward hooks, which raise when a hooked module's output is then
    modified in place; a comparison with it runs every optimizer on the same not-in-place model."""
    for module in model.modules():
        if isinstance(module, (ResNet, BasicBlock)):
            module.inplace = flag
    return model


MODELS = {"resnet18": resnet18, "gpt": gpt, "mlp": mlp}
