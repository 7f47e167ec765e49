"""AdaFisher's fused update against torch's AdamW(fused=True) on ResNet-18's parameters, and the
Python side of an eager AdaFisher step:

    OMP_NUM_THREADS=1 python -m bench.adafisher_update_speed --threads 1 --reps 50

Rows: `adamw` (AdamW(fused=True).step), `op` (adafisher_step_ with updated factors, as after the
first curvature step), `op_F1` (the same without factors, F = 1), `step` (the eager
AdaFisher.step around `op`) and `python` (that step with the kernel replaced by a no-op: the
Python side alone). The rows are timed in turn within every repetition, so the ratios (medians of
per-repetition ratios) hold on a shared machine whose load drifts.
"""
from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from .models import resnet18


def _without_kernel(step):
    """`step` with cafin's adafisher_step_ doing nothing: the step's Python side alone."""
    import cafin.ops

    def run():
        with mock.patch.object(cafin.ops, "adafisher_step_", lambda *args, **kwargs: None):
            step()
    return run


def _op_arguments(model: torch.nn.Module, opt) -> tuple[list, ...]:
    """The lists AdaFisher's step hands its op, from its public state: per parameter its
    gradient, moment, step count, and its layer's S and H (empty outside the layers) with its
    offset into H."""
    import cafin
    params = list(model.parameters())
    owner = {}
    for layer in cafin.layers.discover(model, params):
        offsets = layer.kind.h_offsets(layer.module)
        for name, p in layer.params.items():
            owner[p] = (layer.anchor, offsets[name])
    state, empty = opt.state, torch.empty(0)
    return (params, [p.grad for p in params], [state[p]["exp_avg"] for p in params],
            [state[p]["step"] for p in params],
            [state[owner[p][0]]["fisher_S"] if p in owner else empty for p in params],
            [state[owner[p][0]]["fisher_H"] if p in owner else empty for p in params],
            [owner[p][1] if p in owner else 0 for p in params])


def _with_gradients(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def measure(reps: int) -> dict[str, float]:
    """Median milliseconds of each row, and the median ratios to `adamw`."""
    import cafin
    torch.manual_seed(0)
    model = _with_gradients(resnet18())
    opt = cafin.AdaFisher(model, lr=1e-3, TCov=10**9)
    for layer in cafin.layers.discover(model, list(model.parameters())):  # updated factors: >= 0
        opt.state[layer.anchor]["fisher_S"].uniform_(0.5, 1.5)
        opt.state[layer.anchor]["fisher_H"].uniform_(0.5, 1.5)
    opt.step()
    params, grads, exp_avgs, steps, fisher_S, fisher_H, offsets = _op_arguments(model, opt)
    group = opt.param_groups[0]  # the settings as the op reads them: 0-dim tensors
    scalars = [group[name] for name in ("lr", "beta", "weight_decay", "Lambda")]
    no_factors = [torch.empty(0)] * len(params)
    python_only = cafin.AdaFisher(_with_gradients(resnet18()), lr=1e-3, TCov=10**9)
    adamw = torch.optim.AdamW(_with_gradients(resnet18()).parameters(), lr=1e-3, fused=True)
    rows = {
        "adamw": adamw.step,
        "op": lambda: torch.ops.cafin.adafisher_step_(params, grads, exp_avgs, steps, fisher_S, fisher_H,
                                                      offsets, *scalars, False, None, None),
        "op_F1": lambda: torch.ops.cafin.adafisher_step_(params, grads, exp_avgs, steps, no_factors,
                                                         no_factors, offsets, *scalars, False, None, None),
        "step": opt.step,
        "python": _without_kernel(python_only.step),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(3):
        for fn in rows.values():
            fn()
    for _ in range(reps):
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    result = {f"{name}_ms": statistics.median(t) * 1e3 for name, t in times.items()}
    for name in ("op", "op_F1", "step"):
        result[f"{name}_vs_adamw"] = statistics.median(a / b for a, b in zip(times[name], times["adamw"]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.reps)
    print(f"threads={args.threads} " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
