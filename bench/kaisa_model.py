"""The cost model of K-FAC's KAISA strategies (docs/distributed.md), evaluated for ResNet-50 and a
GPT-2-small-sized model at 8, 64 and 512 ranks: `python -m bench distributed --predict`.

Per strategy, with the factor sizes of every layer, per rank and step:
- decompose: the slowest rank's decompositions per inverse step, c * sum of n^3 over its
  factors (the greedy assignment of cafin.core.distribution.kaisa; c measured by `measure_c`);
- factors: the factor all-reduce, sum of d_A^2 + d_G^2 (half of it with symmetry_aware), every
  factor update; a ring all-reduce moves 2 (W-1)/W of it over each rank's link;
- second-order: the exchange of decompositions inside a gradient worker column, on inverse
  steps, d_A^2 + d_G^2 + d_A d_G per layer (eigenbases and the eigenvalue outer product): a
  padded all_gather ((column size - 1) times the largest share) or one broadcast per rank with
  a share (`received`);
- gradients: the exchange of preconditioned gradients inside a row (MEM_OPT, HYBRID_OPT), every
  step, d_A d_G per layer, the same way;
- memory: the second-order data a rank holds.
Times are bytes (float32) over a link bandwidth: NVLink within a node of 8, InfiniBand between
nodes (nominal figures, below); nothing here overlaps communication with compute.
"""
from __future__ import annotations

import time

import torch

from cafin.core.distribution.kaisa import KaisaAssignment, factor_costs

NVLINK_GBS = 450.0  # per GPU and direction, H100 NVLink 4 (nominal)
IB_GBS = 50.0  # per GPU, one 400 Gb/s NDR link (nominal)
BYTES = 4


def resnet50_factors() -> dict[str, tuple[int, int, int]]:
    """torchvision's ResNet-50: (groups, d_A, d_G) of every Conv2d (no bias) and of the fc."""
    out = {"conv1": (1, 3 * 49, 64)}
    cin = 64
    for stage, (blocks, w) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
        for b in range(blocks):
            name = f"layer{stage + 1}.{b}"
            out[name + ".conv1"] = (1, cin, w)
            out[name + ".conv2"] = (1, 9 * w, w)
            out[name + ".conv3"] = (1, w, 4 * w)
            if b == 0:
                out[name + ".downsample"] = (1, cin, 4 * w)
            cin = 4 * w
    out["fc"] = (1, 2049, 1000)
    return out


def gpt2_small_factors() -> dict[str, tuple[int, int, int]]:
    """GPT-2 small's Linear layers (12 blocks, width 768, biases); the tied 50257-way decoder is
    skipped (skip_layers), as a 50257 x 50257 G factor cannot be decomposed."""
    out = {}
    for b in range(12):
        out[f"h.{b}.attn.c_attn"] = (1, 769, 2304)
        out[f"h.{b}.attn.c_proj"] = (1, 769, 768)
        out[f"h.{b}.mlp.c_fc"] = (1, 769, 3072)
        out[f"h.{b}.mlp.c_proj"] = (1, 3073, 768)
    return out


def measure_c(n: int = 512, repeats: int = 3) -> float:
    """Seconds per n^3 of one float32 eigh on this machine, one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(n, n)
    a = a @ a.T + torch.eye(n)
    torch.linalg.eigh(a)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.linalg.eigh(a)
    torch.set_num_threads(before)
    return (time.perf_counter() - start) / repeats / n ** 3


def received(shares: list[int]) -> int:
    """Elements the member that receives most gets from `exchange`: the padded all_gather
    ((n - 1) times the largest share) or, when that more than doubles the data, one broadcast
    per member with a share (everything but its own)."""
    if len(shares) < 2 or max(shares) == 0:
        return 0
    if len(shares) * max(shares) <= 2 * sum(shares):
        return (len(shares) - 1) * max(shares)
    return sum(shares) - min(shares)


def predict(sizes: dict[str, tuple[int, int, int]], world: int, fraction: float, c: float) -> dict:
    """The model's numbers for one strategy (grad_worker_fraction `fraction`) at `world` ranks."""
    work = factor_costs(sizes, "compute")
    a = KaisaAssignment(work, rank=0, world=world, grad_worker_fraction=fraction, colocate_factors=True)
    load = [0.0] * world
    second = [0] * world  # elements each rank computes and shares
    for name, (g, d_a, d_g) in sizes.items():
        rank = a.inv_worker(name, "A")
        load[rank] += g * (d_a ** 3 + d_g ** 3)
        second[rank] += g * (d_a * d_a + d_g * d_g + d_a * d_g)
    total_second = sum(second)
    factors = sum(g * (d_a * d_a + d_g * d_g) for g, d_a, d_g in sizes.values())
    grads = {name: g * d_a * d_g for name, (g, d_a, d_g) in sizes.items()}
    columns = len(a.columns)
    # each rank of a column receives the other members' shares (cafin.core.distribution.kaisa.exchange)
    gather_second = max(received([second[r] for r in col]) for col in a.columns)
    # a rank receives the gradients of the layers outside its column, from its row
    gather_grads = received([sum(grads[n] for n in sizes if a.column(n) == c) for c in range(columns)])
    memory = max(sum(second[r] for r in col) for col in a.columns)
    link = NVLINK_GBS if world <= 8 else IB_GBS
    ring = 2 * (world - 1) / world
    return dict(world=world, fraction=fraction, decompose_s=c * max(load), decompose_1rank_s=c * sum(load),
                factor_bytes=factors * BYTES, factor_ms=ring * factors * BYTES / link / 1e6,
                second_bytes=gather_second * BYTES, second_ms=gather_second * BYTES / link / 1e6,
                grad_bytes=gather_grads * BYTES, grad_ms=gather_grads * BYTES / link / 1e6,
                memory_bytes=memory * BYTES, memory_1rank_bytes=total_second * BYTES)


def render(c: float) -> str:
    lines = [f"c = {c:.3g} s per n^3 (float32 eigh, one CPU thread, measured now); links: NVLink "
             f"{NVLINK_GBS:.0f} GB/s up to 8 ranks, InfiniBand {IB_GBS:.0f} GB/s beyond (nominal)",
             f"{'model':12} {'W':>4} {'strategy':10} {'decomp/rank':>11} {'of 1 rank':>9} "
             f"{'factors ms':>10} {'2nd-order ms':>12} {'grads ms':>9} {'2nd-order MB/rank':>17}"]
    for model, sizes in (("resnet50", resnet50_factors()), ("gpt2-small", gpt2_small_factors())):
        for world in (8, 64, 512):
            for strategy, fraction in (("COMM_OPT", 1.0), ("HYBRID 1/8", 1 / 8), ("MEM_OPT", 1 / world)):
                if strategy.startswith("HYBRID") and world == 8:
                    continue
                p = predict(sizes, world, fraction, c)
                lines.append(f"{model:12} {world:4d} {strategy:10} {p['decompose_s']:10.2f}s "
                             f"{p['decompose_s'] / p['decompose_1rank_s']:9.3f} {p['factor_ms']:10.2f} "
                             f"{p['second_ms']:12.2f} {p['grad_ms']:9.2f} {p['memory_bytes'] / 1e6:17.1f}")
    return "\n".join(lines)
