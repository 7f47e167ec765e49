"""AdaFisher's fused ops in plain PyTorch, op for op, computed the way the published AdaFisher
code computes them: each function has the signature and in-place semantics of the op of the same
name in `cafin.ops` (schemas: csrc/ops.cpp). Preconditioners are materialised per parameter (an
outer product of the factors) and conv patches are unfolded, as published. No function reads a
tensor value on the host, so the reference step can be compiled and captured too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..maths import state_dtype

MINMAX_EPS = 1e-6  # absolute, as published; it matters against tiny gradient statistics


def _gate(step: torch.Tensor | None, interval: int, like: torch.Tensor) -> torch.Tensor | None:
    if step is None:
        return None
    return (torch.fmod(step, interval) == 0).to(like.device)


def _accumulate(stat: torch.Tensor, z: torch.Tensor, step, interval) -> None:
    """stat[:-1] += z and stat[-1] += 1, only when the (device) gate says so."""
    contribution = torch.cat([z.to(stat.dtype), z.new_ones(1, dtype=stat.dtype)])
    gate = _gate(step, interval, stat)
    if gate is not None:
        contribution = torch.where(gate, contribution, torch.zeros_like(contribution))
    stat.add_(contribution)


def _channels_view(x: torch.Tensor, start_dim: int, end_dim: int) -> torch.Tensor:
    """x viewed as [A, C, Bt]: dims before start_dim, dims [start_dim, end_dim), dims after."""
    shape = x.shape
    a = 1
    for s in shape[:start_dim]:
        a *= s
    c = 1
    for s in shape[start_dim:end_dim]:
        c *= s
    return x.reshape(a, c, -1)


def sumsq_stats_(stat, x, start_dim, end_dim, append_one, step=None, interval=1, workspace=None):
    """Mean square per channel: the Linear input/gradient side and the Conv2d gradient side.
    `workspace` is the CUDA kernels' scratch; the plain-PyTorch sums need none."""
    xv = _channels_view(x.to(stat.dtype), start_dim, end_dim)
    rows = xv.shape[0] * xv.shape[2]
    z = (xv * xv).sum(dim=(0, 2)) / rows
    if append_one:  # the constant bias input: (1/N) * sum of N ones
        z = torch.cat([z, z.new_ones(1)])
    _accumulate(stat, z, step, interval)


def conv2d_input_stats_(stat, x, kernel_size, stride, padding, dilation, groups, append_one,
                        step=None, interval=1, workspace=None):
    """Conv2d input side from unfolded patches, with the published divisor B*oh*ow*D
    (`workspace`: as sumsq_stats_)."""
    x = x.to(stat.dtype)
    top, bottom, left, right = padding
    x = F.pad(x, (left, right, top, bottom))
    batch, channels = x.shape[0], x.shape[1]
    patches = F.unfold(x, kernel_size, dilation=dilation, stride=stride)  # [B, C*kh*kw, L]
    d = channels // groups * kernel_size[0] * kernel_size[1]
    locations = patches.shape[-1]
    patches = patches.view(batch, groups, d, locations).transpose(2, 3)  # [B, G, L, D]
    if append_one:
        patches = torch.cat([patches, patches.new_ones(batch, groups, locations, 1)], dim=-1)
    z = (patches * patches).sum(dim=(0, 1, 2)) / (batch * locations * d)
    _accumulate(stat, z, step, interval)


def embedding_input_stats_(stat, indices, scale_grad_by_freq=False, step=None, interval=1):
    """Embedding input side: the mean square of the one-hot input per vocabulary row, i.e. each
    row's token count over the number of tokens N; with scale_grad_by_freq (the one-hot input
    divided by its token's count in the batch) 1/N for every row present. Counts are sums of
    ones, exact in any order, so this is the same on every device and under
    torch.use_deterministic_algorithms."""
    flat = indices.reshape(-1)
    counts = torch.zeros(stat.numel() - 1, dtype=stat.dtype, device=stat.device)
    counts.index_put_((flat,), torch.ones_like(flat, dtype=stat.dtype), accumulate=True)
    if scale_grad_by_freq:  # count * (1/count)^2 for every row present
        counts = torch.where(counts > 0, 1 / counts.clamp_min(1), torch.zeros_like(counts))
    _accumulate(stat, counts / flat.numel(), step, interval)


def norm_input_stats_(stat, x, step=None, interval=1, workspace=None):
    """BatchNorm2d/LayerNorm input side: a 2-vector [sum_t u[t]^2, T] / B^2 (`workspace`: as
    sumsq_stats_)."""
    x = x.to(stat.dtype)
    batch, t = x.shape[0], x.shape[1]
    rest = x.numel() // (batch * t)
    u = x.transpose(0, 1).reshape(t, -1).sum(dim=1) / (rest * rest)
    z = torch.stack([(u * u).sum(), u.new_tensor(float(t))]) / (batch * batch)
    _accumulate(stat, z, step, interval)


def norm_grad_stats_(stat, g, start_dim, end_dim, step=None, interval=1, workspace=None):
    """BatchNorm2d/LayerNorm gradient side: the squared batch-summed gradient over the batch size
    (`workspace`: as sumsq_stats_)."""
    gv = _channels_view(g.to(stat.dtype), start_dim, end_dim)
    s = gv.sum(dim=(0, 2))
    _accumulate(stat, s * s / g.shape[0], step, interval)


def fisher_average_(factors, stats, skipped, gamma, grad_side, grad_scale=None, found_inf=None):
    """Fold the mean of the accumulated statistics, min-max normalised, into each factor:
    F <- 0.1*gamma*F + 0.01*gamma*z_hat, starting from ones the first time (F < 0 marks that).
    A statistic holding NaN or inf is dropped and counted in `skipped` (the published code maps
    +inf to 1, which puts an overflowed entry among the smallest and rescales every other one);
    every statistic is emptied."""
    for factor, stat, scaled in zip(factors, stats, grad_side):
        count = stat[-1]
        z = stat[:-1] / torch.clamp(count, min=1)
        if scaled and grad_scale is not None:  # gradient statistics of scaled gradients
            z = z / (grad_scale.to(z) * grad_scale.to(z))
        bad = ~torch.isfinite(z).all()
        z_hat = (z - z.min()) / (z.max() - z.min() + MINMAX_EPS)
        base = torch.where(factor < 0, torch.ones_like(factor), factor)
        updated = base * (0.1 * gamma) + (0.01 * gamma) * z_hat
        apply = (count > 0) & ~bad
        dropped = (count > 0) & bad
        if found_inf is not None:
            ok = found_inf.to(factor.device) == 0
            apply, dropped = apply & ok, dropped & ok
        factor.copy_(torch.where(apply, updated, factor))
        skipped.add_(dropped.to(skipped.dtype))
        stat.zero_()


def _preconditioner(param, S, H, h_offset, damping):
    """F~ for one parameter, materialised like the published code: outer(S, H) + damping viewed as
    the parameter; 1 where there is no curvature or a factor was never updated (it holds -1)."""
    if S.numel() == 0:
        return torch.ones_like(param, dtype=state_dtype(param.dtype))
    rows = S.numel()
    cols = param.numel() // rows
    h = H[h_offset:h_offset + cols]
    fisher = torch.kron(h[:, None], S[None, :]).T + damping  # [rows, cols]
    missing = (S[:, None] < 0) | (h[None, :] < 0)
    return torch.where(missing, torch.ones_like(fisher), fisher).reshape(param.shape)


def adafisher_step_(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets, lr, beta,
                    weight_decay, damping, decoupled, grad_scale=None, found_inf=None):
    """AdaFisher (coupled L2) or AdaFisherW (decoupled) update of each parameter, in place."""
    for p, g, m, t, S, H, off in zip(params, grads, exp_avgs, steps, fisher_S, fisher_H, h_offsets):
        work = state_dtype(p.dtype)
        theta = p.to(work)
        g = g.to(work)
        if grad_scale is not None:
            g = g / grad_scale.to(work)
        # beta, weight_decay and damping are 0-dim float64 tensors (or numbers); per-tensor
        # coefficients are formed in float64 and rounded once to the op-math type, as the
        # kernels do.
        beta64, weight_decay, damping = (torch.as_tensor(v, dtype=torch.float64, device=p.device)
                                         for v in (beta, weight_decay, damping))
        b, one_minus_b = beta64.to(work), (1 - beta64).to(work)
        wd, damp = weight_decay.to(work), damping.to(work)
        f_tilde = _preconditioner(p, S, H, off, damp)
        bias_correction = 1 - torch.pow(beta64, t.to(torch.float64))
        lr_t = lr.to(torch.float64)
        if decoupled:
            m_new = b * m + one_minus_b * g
            update = m_new / (bias_correction.to(work) * f_tilde) + wd * theta
            theta_new = theta - lr_t.to(work) * update
        else:
            g = g + wd * theta
            m_new = b * m + one_minus_b * g
            theta_new = theta - (lr_t / bias_correction).to(work) * m_new / f_tilde
        if found_inf is not None:
            skip = found_inf.to(p.device) != 0
            m_new = torch.where(skip, m, m_new)
            theta_new = torch.where(skip, theta, theta_new)
        m.copy_(m_new)
        p.copy_(theta_new)
