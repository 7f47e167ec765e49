"""Time AdaFisher's Conv3d input statistic on the CPU, one thread: the fused path (depth taps into
channels, then the fused Conv2d op), the reference backend's path (the same, then the plain
PyTorch Conv2d statistic, which unfolds), and an unfold of the whole 3-D patch.

    python tools/adafisher_conv3d_timing.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import cafin
from cafin.layers import layer_type_of


def main() -> None:
    torch.set_num_threads(1)
    module = nn.Conv3d(16, 32, 3, padding=1)
    x = torch.randn(4, 16, 16, 32, 32)
    kind = layer_type_of(module)

    def whole_patch_unfold(stat):
        patches = F.pad(x, (1,) * 6).unfold(2, 3, 1).unfold(3, 3, 1).unfold(4, 3, 1)
        stat[:-2] += (patches * patches).sum(dim=(0, 2, 3, 4)).flatten()

    variants = [("fused", lambda stat: kind.input_stats(cafin.ops, stat, module, x, None, 1)),
                ("reference", lambda stat: kind.input_stats(cafin.reference, stat, module, x, None, 1)),
                ("whole-patch unfold", whole_patch_unfold)]
    print(f"Conv3d(16, 32, 3, padding=1), input {tuple(x.shape)}, one CPU thread")
    for name, run in variants:
        stat = torch.zeros(kind.h_size(module) + 1)
        run(stat)  # warm-up
        repeats = 3
        start = time.perf_counter()
        for _ in range(repeats):
            run(stat)
        print(f"  {name}: {(time.perf_counter() - start) / repeats * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
