"""What the distributed bench phases share: the models they train on gloo ranks (with their
global batch) and the count of the bytes handed to collectives."""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from .models import batch_for, gpt, loss_for, mlp

FULL_MODELS = {
    "gpt": (lambda: gpt(), 16),
    "mlp": (lambda: mlp(), 128),
    "mlp-deep": (lambda: mlp((784, 512, 512, 512, 10)), 128),
}
TINY_MODELS = {
    "gpt": (lambda: gpt(vocab=32, dim=16, depth=1, heads=2, context=8), 4),
    "mlp": (lambda: mlp((12, 8, 6, 4)), 8),
}


def count_bytes(counter: list) -> None:
    """Add the payload of every all_reduce / all_gather / broadcast to counter[0] while
    counter[1] is set."""
    import torch.distributed as dist
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def wrapper(*args, __original=original, __name=name, **kwargs):
            if counter[1]:
                t = args[1] if __name.startswith("all_gather") else args[0]
                counter[0] += t.numel() * t.element_size()
            return __original(*args, **kwargs)
        setattr(dist, name, wrapper)


def forward_backward(kind: str, model, opt, generator, global_batch: int, world: int,
                     rank: int) -> tuple[float, float]:
    """This rank's share of the next global batch through the model, the gradients averaged as
    DDP does (one flat all_reduce); returns the wall and CPU clocks at the step's start (after a
    barrier, so that the ranks start together)."""
    import torch.distributed as dist
    x, y = batch_for(kind, model, global_batch, generator=generator)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    dist.barrier()
    start = time.perf_counter(), time.thread_time()
    opt.zero_grad()
    loss_for(kind, model(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if world > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(world)
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])
    return start


@contextlib.contextmanager
def timed_calls(module, names: tuple[str, ...], spent: list, count_stacks: bool = False):
    """While inside, every call of `module.<name>` (for each of `names`; the first argument a
    matrix) adds its wall and CPU seconds to spent[0] and spent[1] and the matrices it handles
    to spent[2] (one per call, or with `count_stacks` n for an [n, d, d] stack)."""
    originals = {name: getattr(module, name) for name in names}

    def timed(fn):
        def run(matrix, *args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            out = fn(matrix, *args, **kwargs)
            spent[0] += time.perf_counter() - start
            spent[1] += time.thread_time() - cpu
            spent[2] += matrix.shape[0] if count_stacks and matrix.dim() == 3 else 1
            return out
        return run
    for name, fn in originals.items():
        setattr(module, name, timed(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


def medians(name: str, samples) -> dict[str, float]:
    """`{name}_s` and `{name}_cpu_s`: the medians of (wall seconds, CPU seconds) pairs."""
    samples = list(samples)
    return {f"{name}_s": statistics.median(t[0] for t in samples),
            f"{name}_cpu_s": statistics.median(t[1] for t in samples)}


def against_one_rank(one: dict, rows: list[dict], work: str, bytes_key: str, count: str) -> dict:
    """A summary row: the ranks of a two-rank run (`rows`) against a one-rank run (`one`) for the
    work a member shares out (`work`: its `<work>_cpu_s` and `<work>_s` per rank) and the whole
    step: per rank CPU times, the slowest rank's ratios (CPU, wall), the bytes of the rank that
    sends most (`bytes_key`), the matrices of each rank and the total (`count`)."""
    def slowest(key: str) -> float:
        return max(r[key] for r in rows)

    return {f"{work}_1rank_cpu_s": one[f"{work}_cpu_s"],
            f"{work}_per_rank_cpu_s": [r[f"{work}_cpu_s"] for r in rows],
            f"{work}_ratio": slowest(f"{work}_cpu_s") / one[f"{work}_cpu_s"],
            f"{work}_wall_ratio": slowest(f"{work}_s") / one[f"{work}_s"],
            "step_1rank_cpu_s": one["step_cpu_s"], "step_cpu_s": slowest("step_cpu_s"),
            "step_ratio": slowest("step_cpu_s") / one["step_cpu_s"],
            "step_wall_ratio": slowest("step_s") / one["step_s"],
            f"{bytes_key}_1rank": one[bytes_key], bytes_key: slowest(bytes_key),
            "matrices": [r["matrices"] for r in rows], count: one[count]}


def render(summary: list[dict], work: str, bytes_key: str, count: str,
           extra: tuple = ()) -> str:
    """The table of `against_one_rank` rows (model, strategy when there is one, then `extra`:
    (title, width, row -> text) columns before the step's)."""
    strategy = any("strategy" in s for s in summary)
    short = {"decompose": "decomp"}.get(work, work)
    head = (f"{'model':9} " + (f"{'strategy':15} " if strategy else "")
            + f"{short + ' 1 rank':>14} {short + '/rank @2':>15} {'ratio':>6} {'(wall)':>6} "
            + "".join(f"{title:>{width}} " for title, width, _ in extra)
            + f"{'step 1':>7} {'step @2':>7} {'ratio':>6} {'(wall)':>6} {'MB/step':>8} {'matrices/rank':>14}")
    lines = [head, "-" * len(head)]
    for s in summary:
        per_rank = "/".join(f"{t * 1e3:.0f}" for t in s[f"{work}_per_rank_cpu_s"])
        lines.append(f"{s['model']:9} " + (f"{s.get('strategy', ''):15} " if strategy else "")
                     + f"{s[f'{work}_1rank_cpu_s'] * 1e3:11.0f} ms {per_rank:>12} ms "
                     f"{s[f'{work}_ratio']:6.2f} {s[f'{work}_wall_ratio']:6.2f} "
                     + "".join(f"{fn(s):>{width}} " for _, width, fn in extra)
                     + f"{s['step_1rank_cpu_s'] * 1e3:5.0f}ms {s['step_cpu_s'] * 1e3:5.0f}ms "
                     f"{s['step_ratio']:6.2f} {s['step_wall_ratio']:6.2f} {s[bytes_key] / 1e6:8.3f} "
                     f"{'+'.join(map(str, s['matrices'])) + ' of ' + str(s[count]):>14}")
    return "\n".join(lines)
