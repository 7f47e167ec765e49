"""An independent float64 oracle of AdaFisher / AdaFisherW, written from the published algorithm.

It imports nothing from cafin on purpose: it is the specification turned into the most direct
code, to run side by side with cafin. Statistics are computed from the module inputs and the
gradients of the module outputs, both captured here: a forward hook records the input and returns
a clone of the output (so an in-place activation downstream modifies the clone, not the tensor we
differentiate with respect to), and one `torch.autograd.grad` call returns the parameter gradients
and the output gradients together. The Conv2d statistic is a loop over kernel offsets over an
explicitly padded input (honouring padding_mode, string padding and dilation), checked against the
module's own output. Beyond the published layer types it takes nn.Embedding, as a Linear without
bias on the explicit one-hot input whose weight is stored transposed; `published_layers=True` takes
the published layer types only (Linear, Conv2d, BatchNorm2d, LayerNorm), and a parameter then
gets curvature only from the first module that registers it, when that module is of one of them:
the published code walks `model.parameters()`, which lists a parameter where it is first
registered, beside its list of hooked layers, so a decoder tied to an Embedding (listed as the
Embedding's weight) takes F~ = 1.

Usage: `oracle = Oracle(model64, decoupled=..., TCov=..., lr=..., ...)`, then once per step
`oracle.step(lambda: loss_of(model64, batch))`. `oracle.factors[module]` holds {"S": ..., "H": ...},
`oracle.state[param]` holds {"step": int, "exp_avg": tensor}.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

PUBLISHED = (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm)
SUPPORTED = PUBLISHED + (nn.Embedding,)
MINMAX_EPS = 1e-6


# ------------------------------------------------------------------------------ raw statistics
def linear_stats(m: nn.Linear, x: torch.Tensor, g: torch.Tensor | None):
    """x viewed [N, d_in], g viewed [N, d_out]: h[i] = sum_n x^2 / N (+ a 1 for the bias),
    s[j] = sum_n g^2 / N."""
    xv = x.reshape(-1, m.in_features)
    n = xv.shape[0]
    h = (xv * xv).sum(dim=0) / n
    if m.bias is not None:
        h = torch.cat([h, h.new_tensor([n / n])])
    s = None
    if g is not None:
        gv = g.reshape(-1, m.out_features)
        s = (gv * gv).sum(dim=0) / gv.shape[0]
    return h, s


def embedding_stats(m: nn.Embedding, x: torch.Tensor, g: torch.Tensor | None):
    """A Linear without bias on the explicit one-hot input (divided by its token's count in the
    batch with scale_grad_by_freq): h[v] = sum_n onehot^2 / N, s[j] = sum_n g^2 / N."""
    onehot = F.one_hot(x.reshape(-1), m.num_embeddings).to(torch.float64)
    if m.scale_grad_by_freq:
        onehot = onehot / onehot.sum(dim=0).clamp_min(1)
    h = (onehot * onehot).sum(dim=0) / onehot.shape[0]
    s = None
    if g is not None:
        gv = g.reshape(-1, m.embedding_dim)
        s = (gv * gv).sum(dim=0) / gv.shape[0]
    return h, s


def conv_padded_input(m: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The input as the convolution sees it once padded (zeros or the module's padding_mode)."""
    kh, kw = m.kernel_size
    dh, dw = m.dilation
    if isinstance(m.padding, str):
        if m.padding == "valid":
            top = bottom = left = right = 0
        elif m.padding == "same":
            th, tw = dh * (kh - 1), dw * (kw - 1)
            top, left = th // 2, tw // 2
            bottom, right = th - top, tw - left
        else:
            raise ValueError(m.padding)
    else:
        ph, pw = m.padding
        top = bottom = ph
        left = right = pw
    pads = (left, right, top, bottom)
    if m.padding_mode == "zeros":
        return F.pad(x, pads, mode="constant", value=0.0)
    return F.pad(x, pads, mode=m.padding_mode)


def conv_stats(m: nn.Conv2d, x: torch.Tensor, g: torch.Tensor | None, output: torch.Tensor | None = None):
    """h[(c,i,j)] = sum_{b,q,p,r} x_pad[b, q*C/G + c, p*sh + i*dh, r*sw + j*dw]^2 / (B*oh*ow*D),
    bias entry G/D; s[o] = sum_{b,p,r} g^2 / (B*oh*ow)."""
    if x.dim() == 3:
        x = x.unsqueeze(0)
        g = None if g is None else g.unsqueeze(0)
        output = None if output is None else output.unsqueeze(0)
    xp = conv_padded_input(m, x)
    if output is not None:  # the padding above is the convolution's padding
        again = F.conv2d(xp, m.weight, m.bias, m.stride, 0, m.dilation, m.groups)
        assert again.shape == output.shape, (again.shape, output.shape)
        assert torch.allclose(again, output, rtol=1e-9, atol=1e-9), "oracle conv padding is wrong"
    b, c_in = xp.shape[0], xp.shape[1]
    groups = m.groups
    cg = c_in // groups
    kh, kw = m.kernel_size
    sh, sw = m.stride
    dh, dw = m.dilation
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    d = cg * kh * kw
    acc = xp.new_zeros(cg, kh, kw)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + (oh - 1) * sh + 1, sh)
            cols = slice(j * dw, j * dw + (ow - 1) * sw + 1, sw)
            window = xp[:, :, rows, cols]  # [B, C_in, oh, ow]: entry (c, i, j) of every patch
            assert window.shape[2:] == (oh, ow)
            per_channel = (window * window).sum(dim=(0, 2, 3))  # [C_in]
            acc[:, i, j] = per_channel.view(groups, cg).sum(dim=0)  # groups share one vector
    h = acc.flatten() / (b * oh * ow * d)
    if m.bias is not None:
        h = torch.cat([h, h.new_tensor([groups / d])])
    s = None
    if g is not None:
        assert g.shape[2:] == (oh, ow)
        s = (g * g).sum(dim=(0, 2, 3)) / (b * oh * ow)
    return h, s


def _norm_h(x: torch.Tensor) -> torch.Tensor:
    """u[t] = sum of x over every dim but 1 / (prod of the dims other than 0 and 1)^2;
    h = [sum_t u[t]^2 / B^2, T / B^2]."""
    b, t = x.shape[0], x.shape[1]
    rest = math.prod(x.shape[2:])
    u = torch.stack([x[:, i].sum() for i in range(t)]) / (rest * rest)
    return torch.stack([(u * u).sum() / (b * b), x.new_tensor(t / (b * b))])


def batchnorm_stats(m: nn.BatchNorm2d, x, g):
    h = _norm_h(x)
    s = None
    if g is not None:  # s[c] = (sum_{b,h,w} g)^2 / B
        total = g.sum(dim=(0, 2, 3))
        s = total * total / g.shape[0]
    return h, s


def layernorm_stats(m: nn.LayerNorm, x, g):
    h = _norm_h(x)
    s = None
    if g is not None:  # sum over the leading, non-normalised dims, squared, / B; flattened
        width = math.prod(m.normalized_shape)
        total = g.reshape(-1, width).sum(dim=0)
        s = total * total / g.shape[0]
    return h, s


def raw_statistics(m: nn.Module, x, g, output=None):
    if isinstance(m, nn.Linear):
        return linear_stats(m, x, g)
    if isinstance(m, nn.Conv2d):
        return conv_stats(m, x, g, output)
    if isinstance(m, nn.BatchNorm2d):
        return batchnorm_stats(m, x, g)
    if isinstance(m, nn.LayerNorm):
        return layernorm_stats(m, x, g)
    if isinstance(m, nn.Embedding):
        return embedding_stats(m, x, g)
    raise TypeError(type(m))


def takes_statistics(m: nn.Module, x: torch.Tensor) -> bool:
    if isinstance(m, nn.LayerNorm):  # needs a batch dim in front of the normalised dims
        return x.dim() >= 2 and x.dim() > len(m.normalized_shape)
    return x.numel() > 0


def normalise(z: torch.Tensor) -> torch.Tensor:
    """Min-max with an absolute eps of 1e-6 (of a finite statistic: a non-finite one is dropped)."""
    return (z - z.min()) / (z.max() - z.min() + MINMAX_EPS)


# ------------------------------------------------------------------------------ the optimizer
def adafisher_update(p, g, st, f_tilde, lr, beta, wd, decoupled):
    """One AdaFisher (coupled L2) or AdaFisherW (decoupled) step of p in place; st holds the
    parameter's step count and exp_avg, both updated."""
    st["step"] += 1
    bc = 1 - beta ** st["step"]
    if decoupled:
        st["exp_avg"] = beta * st["exp_avg"] + (1 - beta) * g
        p.copy_(p - lr * (st["exp_avg"] / (bc * f_tilde) + wd * p))
    else:
        g = g + wd * p
        st["exp_avg"] = beta * st["exp_avg"] + (1 - beta) * g
        p.copy_(p - lr / bc * st["exp_avg"] / f_tilde)


class Oracle:
    def __init__(self, model: nn.Module, groups=None, *, decoupled: bool, lr=1e-3, beta=0.9,
                 Lambda=1e-3, gamma=0.8, TCov=100, weight_decay=0.0, published_layers=False):
        self.model = model
        self.published_layers = published_layers
        self.decoupled = decoupled
        self.gamma = gamma
        self.TCov = TCov
        self.defaults = dict(lr=lr, beta=beta, Lambda=Lambda, weight_decay=weight_decay)
        self.groups: list[dict] = []
        if groups is None:
            groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        for group in groups:
            self.add_group(group)
        self.state: dict[nn.Parameter, dict] = {}
        self.factors: dict[nn.Module, dict[str, torch.Tensor]] = {}
        self.k = 0
        self.skipped = 0
        self.last_raw: dict[nn.Module, tuple] = {}

    def add_group(self, group: dict) -> None:
        full = dict(self.defaults)
        full.update(group)
        full["params"] = list(full["params"])
        self.groups.append(full)

    def owners(self) -> dict[int, tuple[nn.Module, str]]:
        """id(param) -> (module, "weight" | "bias"): the first supported module in
        model.modules() order that holds the (optimised) parameter; with published_layers, the
        first module of any type that registers it, if it is of a published type."""
        optimised = {id(p) for g in self.groups for p in g["params"]}
        owner: dict[int, tuple[nn.Module, str]] = {}
        if self.published_layers:
            first: dict[int, tuple[nn.Module, str]] = {}
            for m in self.model.modules():
                for role, p in m._parameters.items():
                    if p is not None and id(p) in optimised and id(p) not in first:
                        first[id(p)] = (m, role)
            return {i: (m, role) for i, (m, role) in first.items()
                    if isinstance(m, PUBLISHED) and role in ("weight", "bias")}
        for m in self.model.modules():
            if not isinstance(m, SUPPORTED):
                continue
            for role in ("weight", "bias"):
                p = m._parameters.get(role)
                if p is not None and id(p) in optimised and id(p) not in owner:
                    owner[id(p)] = (m, role)
        return owner

    def preconditioner(self, p: torch.Tensor, owner, damping: float) -> torch.Tensor:
        if id(p) not in owner:
            return torch.ones_like(p)
        m, role = owner[id(p)]
        f = self.factors.get(m, {})
        S, H = f.get("S"), f.get("H")
        if S is None or H is None:  # the owner's hooks never ran
            return torch.ones_like(p)
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            col = H[0] if role == "weight" else H[1]
            return (S * col + damping).view(p.shape)
        if isinstance(m, nn.Embedding):  # [num_embeddings, dim]: rows on the one-hot side
            return (H[:, None] * S[None, :] + damping).view(p.shape)
        cols = p.numel() // S.numel()
        if role == "weight":
            assert cols == H.numel() - (m.bias is not None)
            return (S[:, None] * H[None, :cols] + damping).view(p.shape)
        return S * H[-1] + damping

    def _fold_statistic(self, m: nn.Module, key: str, z: torch.Tensor) -> None:
        if not torch.isfinite(z).all():
            self.skipped += 1
            return
        z_hat = normalise(z)
        slot = self.factors.setdefault(m, {})
        base = slot.get(key)
        if base is None:
            base = torch.ones_like(z_hat)
        slot[key] = (0.1 * self.gamma) * base + (0.01 * self.gamma) * z_hat

    def step(self, loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One step: loss_fn() runs the model forward and returns the loss."""
        owner = self.owners()
        curvature = self.k % self.TCov == 0
        self.last_raw = {}
        modules = []
        for m, _ in owner.values():
            if all(m is not n for n in modules):
                modules.append(m)
        captured: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
        handles = []
        if curvature:
            def hook(mod, inputs, output):
                if not torch.is_grad_enabled() or not isinstance(inputs[0], torch.Tensor):
                    return None
                x = inputs[0].detach()
                if not takes_statistics(mod, x):
                    return None
                captured.append((mod, x, output))
                return output.clone()

            handles = [m.register_forward_hook(hook) for m in modules]
        try:
            with torch.enable_grad():
                loss = loss_fn()
        finally:
            for h in handles:
                h.remove()
        params = [p for g in self.groups for p in g["params"] if p.requires_grad]
        outs = [o for _, _, o in captured if o.requires_grad]
        grads = torch.autograd.grad(loss, params + outs, allow_unused=True)
        param_grads = {id(p): g for p, g in zip(params, grads[:len(params)])}
        out_grads = {id(o): g for o, g in zip(outs, grads[len(params):])}
        seen = set()
        for m, x, out in captured:
            if id(m) in seen:
                raise NotImplementedError("the oracle takes one forward per module per step")
            seen.add(id(m))
            g = out_grads.get(id(out))
            h, s = raw_statistics(m, x, None if g is None else g.detach(), out.detach())
            self.last_raw[m] = (h, s)
            self._fold_statistic(m, "H", h)
            if s is not None:
                self._fold_statistic(m, "S", s)
        with torch.no_grad():
            for group in self.groups:
                lr, beta, wd = group["lr"], group["beta"], group["weight_decay"]
                for p in group["params"]:
                    g = param_grads.get(id(p))
                    if g is None:
                        continue
                    st = self.state.setdefault(p, {"step": 0, "exp_avg": torch.zeros_like(p)})
                    f_tilde = self.preconditioner(p, owner, group["Lambda"])
                    adafisher_update(p, g, st, f_tilde, lr, beta, wd, self.decoupled)
        self.k += 1
        return loss.detach()
