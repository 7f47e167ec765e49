"""What the distributed bench phases share: the models they train on gloo ranks (with their
global batch) and the count of the bytes handed to collectives."""
from __future__ import annotations

from .models import gpt, mlp

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
