"""cafin's KFACPreconditioner beside kfac-pytorch 0.4.2 on the same models, batches and SGD.

    python tools/kfac_side_by_side.py          # needs kfac-pytorch importable (`import kfac`)

kfac-pytorch is not on the package registry at 0.4.2: install it from its git tag v0.4.2 (or put
a checkout on PYTHONPATH). Each run is 8 steps of `torch.optim.SGD(lr=0.05, momentum=0.9,
weight_decay=5e-4)` after the preconditioner; the error is max |theta_cafin - theta_kfac| over
every parameter divided by max |theta_8 - theta_0|. float64 runs pass inv_dtype=torch.float64 to
both (kfac-pytorch's float32 default would compute float64 products in float32); both decompose
in float32, kfac-pytorch's only choice and cafin's default. The float32 column also gives each
library's distance from its own float64 run, which tells whose float32 rounding a gap comes from.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import cafin

STEPS = 8


def mlp():  # Linear layers with and without bias, on [batch, sequence, features] inputs
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 8, bias=False), nn.Tanh(), nn.Linear(8, 4))


def cnn():  # a padded Conv2d, a strided Conv2d without bias, Linear layers
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2, bias=False),
                         nn.ReLU(), nn.Flatten(), nn.Linear(72, 10), nn.Tanh(), nn.Linear(10, 4))


def stacked():  # three equal Conv2d and three equal Linear layers (cafin stacks their work)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.Tanh())],
                         nn.Flatten(), nn.Linear(144, 12), nn.Tanh(),
                         *[m for _ in range(3) for m in (nn.Linear(12, 12), nn.Tanh())], nn.Linear(12, 4))


def digits_cnn():  # 28x28 inputs, two conv-pool blocks, a 1568-wide Linear (A is 1569 x 1569)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(1568, 64), nn.ReLU(), nn.Linear(64, 10))


def _batches(shape, classes, labels_shape):
    def make(g):
        return torch.randn(*shape, generator=g), torch.randint(0, classes, labels_shape, generator=g)
    return make


MODELS = {"MLP": (mlp, _batches((6, 5, 7), 4, (6, 5))),
          "CNN": (cnn, _batches((6, 3, 8, 8), 4, (6,))),
          "stacked": (stacked, _batches((6, 4, 6, 6), 4, (6,))),
          "digits CNN": (digits_cnn, _batches((32, 1, 28, 28), 10, (32,)))}
CONFIGS = {"defaults (eigen, kl_clip 1e-3)": {},
           '`compute_method="inverse"`': dict(compute_method="inverse"),
           "`kl_clip=1e-6, lr=1.0` (clipping active)": dict(kl_clip=1e-6, lr=1.0),
           'clipping active, `"inverse"`': dict(kl_clip=1e-6, lr=1.0, compute_method="inverse"),
           "factor every 2, inverse every 4": dict(factor_update_steps=2, inv_update_steps=4)}


def train(library, make, data, dtype, config):
    torch.manual_seed(0)
    model = make().to(dtype)
    start = [p.detach().clone() for p in model.parameters()]
    kw = {**dict(factor_update_steps=1, inv_update_steps=1, damping=1e-3, factor_decay=0.95, kl_clip=1e-3,
                 lr=0.1), **config}
    if dtype == torch.float64:
        kw["inv_dtype"] = torch.float64
    pre = library.KFACPreconditioner(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for x, y in data:
        opt.zero_grad()
        out = model(x.to(dtype))
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        pre.step()
        opt.step()
    return start, [p.detach().clone() for p in model.parameters()]


def error(got, want, start) -> float:
    num = max(float((p.double() - q.double()).abs().max()) for p, q in zip(got, want))
    return num / max(float((q.double() - s.double()).abs().max()) for q, s in zip(want, start))


def main() -> None:
    import kfac.preconditioner
    warnings.simplefilter("ignore")
    print("| model | configuration | float64 | float32 | float32 vs float64: cafin / kfac-pytorch |")
    print("|---|---|---|---|---|")
    for name, (make, batch) in MODELS.items():
        g = torch.Generator().manual_seed(1)
        data = [batch(g) for _ in range(STEPS)]
        for label, config in CONFIGS.items():
            runs = {(lib, dt): train(module, make, data, dt, config)
                    for lib, module in (("cafin", cafin), ("kfac", kfac.preconditioner))
                    for dt in (torch.float64, torch.float32)}
            start = runs["cafin", torch.float64][0]
            cells = [error(runs["cafin", dt][1], runs["kfac", dt][1], start)
                     for dt in (torch.float64, torch.float32)]
            own = [error(runs[lib, torch.float32][1], runs[lib, torch.float64][1], start)
                   for lib in ("cafin", "kfac")]
            print(f"| {name} | {label} | {cells[0]:.1e} | {cells[1]:.1e} | {own[0]:.1e} / {own[1]:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
