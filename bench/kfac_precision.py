"""`python -m bench.kfac_precision`: the accuracy of K-FAC's reduced-precision options
(`factor_dtype`, `inv_dtype`) against float32, the table of docs/kfac.md "Reduced precision".

Two small models, float32 master weights, fixed seeds, on the CPU:
- "cnn": three 3x3 convolutions (3->16->32->32 channels, strides 1, 2, 2) and two Linear layers
  (512->64->10), ReLU, on 16x16 inputs of 10 classes (a fixed random template per class plus
  Gaussian noise of standard deviation 3), batch 32; SGD lr 0.01, K-FAC damping 0.03;
- "mlp": a transformer-style MLP language model: token and position Embeddings (vocabulary 64,
  width 64, context 32), two pre-LayerNorm residual MLP blocks (64->256->64, GELU) and a Linear
  head, trained on next-token prediction of sequences drawn from a fixed random Markov chain
  (each token has 4 likely successors), batch 16; SGD lr 0.1, K-FAC damping 3e-3.

K-FAC: factors every step, eigendecompositions every 5 steps, kl_clip 1e-3, factor_decay 0.95,
its lr the SGD's (momentum 0.9, weight decay 5e-4). The CNN's lr and damping are lower than
kfac-pytorch's CIFAR example (0.1, 3e-3): with those (and with lr 0.03), this BatchNorm-free
CNN's loss, after falling near 0, climbs back up within 200 steps at every precision, float64
included. The loss column stops at 50 steps, in the descent: later the CNN's loss spikes.

Preconditioned gradient error: a float32 run and a run with the option share every weight
(the option's model is overwritten with the float32 run's weights before each step), so both see
the same gradients and activations and differ only in the option's rounding. Per registered
layer and step, ||V_opt - V_32|| / ||V_32|| over the layer's preconditioned weight and bias
gradients (KL clipping included), over steps 50-59 (decompositions at steps 50 and 55: the factors'
moving averages have long forgotten their identity start, and their rounding has settled); the table
gives the median and the maximum over layers of each layer's largest error over those steps.
The row "float64" (factors, decompositions and products in float64) shows float32's own error.
A row with its own factor_decay is compared with float32 at that decay.

Training loss: each option trains on its own for `--steps` steps (the same data and initial
weights as float32's run of the seed); the loss is the mean of the last 10 steps' training
losses, averaged over SEEDS, and "|vs float32|" the mean over the seeds of its distance from
float32's loss of the seed. The float64 row's distance is the run-to-run divergence that
rounding alone causes (training is chaotic: any rounding difference grows).
"""
from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import cafin

OPTIONS = {
    "float32": dict(),
    "float64": dict(factor_dtype=torch.float64, inv_dtype=torch.float64, decompose_dtype=torch.float64),
    "inv bf16": dict(inv_dtype=torch.bfloat16),
    "factor bf16": dict(factor_dtype=torch.bfloat16),
    "both bf16": dict(factor_dtype=torch.bfloat16, inv_dtype=torch.bfloat16),
    "inv fp16": dict(inv_dtype=torch.float16),
    "factor fp16": dict(factor_dtype=torch.float16),
    # a slower moving average: bfloat16's rounding of each fold weighs more against its update
    "factor bf16, decay 0.99": dict(factor_dtype=torch.bfloat16, factor_decay=0.99),
}
KFAC = dict(factor_update_steps=1, inv_update_steps=5, kl_clip=1e-3, factor_decay=0.95)
MEASURED_STEPS = range(50, 60)
SEEDS = (0, 1, 2)


class TinyLM(nn.Module):
    def __init__(self, vocab=64, width=64, context=32, blocks=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def cnn_batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 3, 16, 16, generator=g)
    out = []
    for _ in range(steps):
        y = torch.randint(0, 10, (32,), generator=g)
        out.append((templates[y] + 3.0 * torch.randn(32, 3, 16, 16, generator=g), y))
    return out


def lm_batches(steps: int, seed: int = 1, vocab: int = 64, context: int = 32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab, vocab), -4.0)
    logits.scatter_(1, torch.randint(0, vocab, (vocab, 4), generator=g), 2.0)
    probs = logits.softmax(1)
    out = []
    for _ in range(steps):
        seq = [torch.randint(0, vocab, (16,), generator=g)]
        for _ in range(context):
            seq.append(torch.multinomial(probs[seq[-1]], 1, generator=g).squeeze(1))
        seq = torch.stack(seq, 1)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


# model, its batches, SGD's (and K-FAC's) lr, K-FAC's damping
MODELS = {"cnn": (cnn, cnn_batches, 0.01, 0.03), "mlp": (TinyLM, lm_batches, 0.1, 3e-3)}


def loss_of(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make(kind: str, option: str, seed: int = 0, like: str | None = None):
    """Model, preconditioner and SGD of `option`; `like`: with that option's factor_decay."""
    torch.manual_seed(seed)
    model = MODELS[kind][0]()
    _, _, lr, damping = MODELS[kind]
    kw = {**KFAC, **OPTIONS[option]}
    if like is not None and "factor_decay" in OPTIONS[like]:
        kw["factor_decay"] = OPTIONS[like]["factor_decay"]
    pre = cafin.KFACPreconditioner(model, lr=lr, damping=damping, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    return model, pre, opt


def layer_grads(pre) -> dict[str, torch.Tensor]:
    out = {}
    for layer in pre._layers:
        m = layer.module
        parts = [m.weight.grad.reshape(-1)] + ([m.bias.grad] if getattr(m, "bias", None) is not None else [])
        out[layer.name] = torch.cat(parts).double()
    return out


def lockstep_errors(ref, other, batches, ref_opt, loss=loss_of, measured=range(10**9)) -> dict[str, float]:
    """Each layer's largest relative error ||V - V_ref|| / ||V_ref|| of the preconditioned
    gradient of `other` against `ref` (each a (model, preconditioner)) over the steps in
    `measured`, `other`'s model put on `ref`'s weights before every step (the same gradients:
    only the rounding differs); `ref_opt` steps `ref`'s model."""
    (ref_model, ref_pre), (model, pre) = ref, other
    worst: dict[str, float] = {}
    for k, (x, y) in enumerate(batches):
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters()):
                p.copy_(q)
        for m, p in ((ref_model, ref_pre), (model, pre)):
            m.zero_grad()
            loss(m, x, y).backward()
            p.step()
        if k in measured:
            want, got = layer_grads(ref_pre), layer_grads(pre)
            for name in want:
                err = ((got[name] - want[name]).norm() / want[name].norm()).item()
                worst[name] = max(worst.get(name, 0.0), err)
        ref_opt.step()
    return worst


def gradient_errors(kind: str, option: str) -> dict[str, float]:
    """Each layer's largest relative error of its preconditioned gradient against float32's over
    MEASURED_STEPS, both runs on the float32 run's weights."""
    ref_model, ref_pre, ref_opt = make(kind, "float32", like=option)
    model, pre, _ = make(kind, option)
    return lockstep_errors((ref_model, ref_pre), (model, pre),
                           MODELS[kind][1](MEASURED_STEPS.stop), ref_opt, measured=MEASURED_STEPS)


def final_loss(kind: str, option: str, steps: int, seed: int, like: str | None = None) -> float:
    model, pre, opt = make(kind, option, seed, like)
    losses = []
    for x, y in MODELS[kind][1](steps, seed + 1):
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        pre.step()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps of the loss column")
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--per-layer", action="store_true", help="print every layer's error")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"| model | option | median layer error | max layer error | loss after {args.steps} steps "
          "| \\|vs float32\\| |")
    print("|---|---|---|---|---|---|")
    for kind in args.models.split(","):
        bases: dict[float, list[float]] = {}  # float32's losses per factor_decay
        for option in OPTIONS:
            decay = OPTIONS[option].get("factor_decay", KFAC["factor_decay"])
            if decay not in bases:
                bases[decay] = [final_loss(kind, "float32", args.steps, seed, option) for seed in SEEDS]
            base = bases[decay]
            errs = gradient_errors(kind, option) if option != "float32" else {}
            losses = base if option == "float32" else [final_loss(kind, option, args.steps, seed) for seed in SEEDS]
            gap = statistics.mean(abs(a - b) for a, b in zip(losses, base))
            med = f"{statistics.median(errs.values()):.1e}" if errs else "-"
            top = f"{max(errs.values()):.1e}" if errs else "-"
            print(f"| {kind} | {option} | {med} | {top} | {statistics.mean(losses):.3f} | {gap:.3f} |", flush=True)
            if args.per_layer and errs:
                print("    " + ", ".join(f"{n}: {e:.1e}" for n, e in errs.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
