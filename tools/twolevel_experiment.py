"""The two-level seed paper's experiment, small: a deep MLP autoencoder on sklearn's bundled digits.

K-FAC (the same published conventions, no coarse correction) vs two-level K-FAC with each coarse
space vs SGD and Adam; several seeds; train loss against steps and against wall-clock time.

    python tools/twolevel_experiment.py --steps 300 --seeds 3 --out docs/twolevel_autoencoder.png
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch import nn

import cafin


class KFACOnly(cafin.TwoLevelKFAC):
    """The same K-FAC (factors, damping, schedule, conventions) with the coarse correction off."""

    def _two_level(self, raws, pres):
        return pres


DAMPING = 1e-1

METHODS = {
    "SGD": None, "Adam": None, "K-FAC": (KFACOnly, {}),
    "nicolaides": (cafin.TwoLevelKFAC, dict(coarse_space="nicolaides")),
    "spectral": (cafin.TwoLevelKFAC, dict(coarse_space="spectral")),
    "residual": (cafin.TwoLevelKFAC, dict(coarse_space="residual")),
    "tselepidis": (cafin.TwoLevelKFAC, dict(coarse_space="tselepidis")),
    "nicolaides+krylov": (cafin.TwoLevelKFAC, dict(coarse_space="nicolaides", krylov=True)),
    "residual+krylov": (cafin.TwoLevelKFAC, dict(coarse_space="residual", krylov=True)),
}


def autoencoder():
    sizes = [64, 128, 64, 16, 64, 128, 64]
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers, nn.Sigmoid())


def run(method, seed, data, steps, batch, lr):
    torch.manual_seed(seed)
    net = autoencoder()
    pre = None
    if method == "Adam":
        opt = torch.optim.Adam(net.parameters(), lr=lr["Adam"])
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr["SGD" if method == "SGD" else "KFAC"], momentum=0.9)
        if METHODS[method] is not None:
            cls, kw = METHODS[method]
            pre = cls(net, damping=DAMPING, T_cov=10, T_inv=10, alpha=0.95, constraint_norm=True, clipping=1e-2, **kw)
    g = torch.Generator().manual_seed(seed)
    losses, times, t0 = [], [], time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, data.shape[0], (batch,), generator=g)
        x = data[idx]
        opt.zero_grad()
        if pre is not None:
            pre.update_stats = True
        loss = nn.functional.mse_loss(net(x), x)
        loss.backward()
        if pre is not None:
            pre.step(update_params=True)
        opt.step()
        with torch.no_grad():
            losses.append(float(nn.functional.mse_loss(net(data), data)))
        times.append(time.perf_counter() - t0)
    return losses, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default="docs/twolevel_autoencoder.png")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=1, help="tiny matrices: more threads only contend")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sklearn.datasets import load_digits
    data = torch.tensor(load_digits().data / 16.0, dtype=torch.float32)
    lr = {"SGD": 0.5, "Adam": 3e-3, "KFAC": 0.3}
    results = {}
    for m in METHODS:
        runs = [run(m, s, data, args.steps, args.batch, lr) for s in range(args.seeds)]
        L = np.array([r[0] for r in runs])
        T = np.array([r[1] for r in runs])
        results[m] = {"loss_mean": L.mean(0).tolist(), "loss_std": L.std(0).tolist(), "time": T.mean(0).tolist()}
        print(f"{m:18s} final full-data loss {L[:, -1].mean():.5f} ± {L[:, -1].std():.5f}   "
              f"at step {args.steps // 3}: {L[:, args.steps // 3 - 1].mean():.5f}   "
              f"time/step {T[:, -1].mean() / args.steps * 1e3:.2f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for m, r in results.items():
        mean = np.array(r["loss_mean"])
        ax[0].plot(np.arange(1, len(mean) + 1), mean, label=m)
        ax[1].plot(r["time"], mean, label=m)
    for a, xl in zip(ax, ("step", "seconds (CPU)")):
        a.set_yscale("log")
        a.set_xlabel(xl)
        a.set_ylabel("train MSE (full data)")
    ax[0].legend(fontsize=7)
    fig.suptitle(f"digits autoencoder 64-128-64-16-64-128-64, batch {args.batch}, mean of {args.seeds} seeds")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
