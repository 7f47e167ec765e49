"""An independent float64 oracle of the published TensorDyKAF (Vepricov/LIB), written from its
semantics for the DyKAF tests: one parameter at a time, plain tensors, no cafin code. It covers
init="eps" (and "kron" with given start vectors), 1-D/2-D/4-D parameters, the one-sided fallback
over max_precond_dim, rank-one on and off, precondition_1d, normalize_grads, weight decay and
bias correction. Start vectors of the power iterations come from `starts(sizes)`.
"""
from __future__ import annotations

import torch


def _normalise(x):
    return x / torch.linalg.vector_norm(x)


def _kron_start(g, start):
    right = start
    for _ in range(100):
        left = _normalise(torch.mv(g, right))
        right = _normalise(torch.mv(g.T, left))
    left = torch.mv(g, right)
    s = torch.linalg.vector_norm(left)
    left = left / s
    return torch.sqrt(s) * torch.outer(left, left), torch.sqrt(s) * torch.outer(right, right)


def _hopm(g, vs):
    letters = "ijkl"
    v = list(vs)
    for _ in range(100):
        for k in range(4):
            others = [t for t in range(4) if t != k]
            spec = "ijkl," + ",".join(letters[t] for t in others) + "->" + letters[k]
            v[k] = _normalise(torch.einsum(spec, g, *[v[t] for t in others]))
    weight = torch.einsum("ijkl,i,j,k,l->", g, *v)
    return [torch.outer(x, x) * torch.sqrt(weight) for x in v]


def _pair_split(L, R, g, beta):
    L, R, g = L * beta ** 0.5, R * beta ** 0.5, g * (1 - beta) ** 0.5
    a, b = torch.linalg.matrix_norm(L), torch.linalg.matrix_norm(R)
    Lh, Rh = L / a, R / b
    K = a * b * Lh + g @ Rh @ g.T
    M = a * b * Rh + g.T @ Lh @ g
    U = K / torch.linalg.matrix_norm(K)
    V = M / torch.linalg.matrix_norm(M)
    S = a * b * torch.sum(Lh * U) * torch.sum(Rh * V) + torch.sum(U * (g @ V @ g.T))
    return U * torch.sqrt(S), V * torch.sqrt(S)


def _four_split(F, g, beta):
    weight = torch.linalg.matrix_norm(F[0]) ** 4
    F = [f * beta ** 0.25 for f in F]
    g = g * (1 - beta) ** 0.5
    letters = "ijkl"
    for i in range(4):
        # C[x, y] = sum over the other modes of g[.. x ..] g[.. y ..] weighted by the other factors
        others = [t for t in range(4) if t != i]
        left = "".join(letters[t] if t != i else "x" for t in range(4))
        right = "".join(letters[t].upper() if t != i else "y" for t in range(4))
        spec = f"{left},{right}," + ",".join(letters[t] + letters[t].upper() for t in others) + "->xy"
        C = torch.einsum(spec, g, g, *[F[t] for t in others])
        F[i] = weight * F[i] + C
        s_hat = torch.linalg.matrix_norm(F[i])
        F[i] = F[i] / s_hat
        weight = s_hat - torch.linalg.matrix_norm(F[i] * C)
    return [f * weight ** 0.25 for f in F]


def _first_basis(F):
    m = F.float() + 1e-30 * torch.eye(F.shape[0])
    return torch.linalg.eigh(m)[1].flip(1).to(F.dtype)


def _power_qr(F, Q):
    F32, Q32 = F.float(), Q.float()
    order = torch.argsort(torch.diag(Q32.T @ F32 @ Q32), descending=True)
    return torch.linalg.qr(F32 @ Q32[:, order])[0].to(F.dtype), order


def _rotate(x, bases, back=False):
    for Q in bases:
        x = x.movedim(0, -1) if Q is None else torch.tensordot(x, Q, dims=([0], [1 if back else 0]))
    return x


class Oracle:
    def __init__(self, params, lr=3e-3, betas=(0.95, 0.95), eps=1e-8, weight_decay=0.01,
                 precondition_frequency=10, max_precond_dim=10000, precondition_1d=False,
                 normalize_grads=False, correct_bias=True, init="eps", adam_rank_one=True,
                 shampoo_beta=-1, starts=None):
        self.params = list(params)
        self.h = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, f=precondition_frequency,
                      max=max_precond_dim, p1d=precondition_1d, normalize=normalize_grads,
                      correct_bias=correct_bias, init=init, rank_one=adam_rank_one,
                      shampoo_beta=shampoo_beta)
        self.starts = starts
        self.state = {}

    def _start(self, p, g, st):
        h = self.h
        beta = h["shampoo_beta"] if h["shampoo_beta"] >= 0 else h["betas"][1]
        st.update(t=0, m=torch.zeros_like(p), beta=beta)
        big = [d > h["max"] for d in g.shape]
        if g.dim() == 2 and h["rank_one"]:
            st["l"] = torch.full((g.shape[0],), h["eps"])
            st["r"] = torch.full((g.shape[1],), h["eps"])
        else:
            st["v"] = torch.zeros_like(p)
        if g.dim() == 2:
            st["kind"] = "pair"
            if any(big):
                st["F"] = [None if b else torch.eye(d) * 1000 / d ** 0.5 + (g @ g.T if k == 0 else g.T @ g)
                           for k, (b, d) in enumerate(zip(big, g.shape))]
            else:
                if h["init"] == "eps":
                    L, R = (torch.eye(d) * 1e-3 / d ** 0.5 for d in g.shape)
                else:
                    L, R = _kron_start(g, self.starts([g.shape[1]])[0])
                st["F"] = list(_pair_split(L, R, g, beta))
        elif g.dim() == 4:
            st["kind"] = "four"
            st["F"] = _four_split(_hopm(g, self.starts(list(g.shape))), g, beta)
        else:
            st["kind"] = "ema"
            if g.dim() == 1 and not (h["p1d"] and g.shape[0] <= h["max"]):
                st["F"] = [None]
            else:
                st["F"] = [None if b else (1 - beta) * g[:, None] * g[None, :] for b in big]
        st["Q"] = [None if F is None else _first_basis(F) for F in st["F"]]

    def step(self):
        h = self.h
        b1, b2 = h["betas"]
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.clone()
            st = self.state.setdefault(p, {})
            if not st:
                self._start(p, g, st)
                continue
            gp = _rotate(g, st["Q"])
            st["t"] += 1
            st["m"] = b1 * st["m"] + (1 - b1) * g
            if "l" in st:
                l, r = st["l"], st["r"]
                a, b = torch.linalg.vector_norm(l), torch.linalg.vector_norm(r)
                lh, rh = l / a, r / b
                sq = gp * gp
                l1 = _normalise(b2 * a * b * lh + (1 - b2) * torch.mv(sq, rh))
                r1 = _normalise(b2 * a * b * rh + (1 - b2) * torch.mv(sq.T, lh))
                c = (b2 * torch.dot(l1, lh) * torch.dot(r1, rh) * a * b
                     + (1 - b2) * torch.dot(l1, torch.mv(sq, r1)))
                st["l"], st["r"] = l1 * torch.sqrt(c), r1 * torch.sqrt(c)
                denom = torch.sqrt(torch.outer(st["l"], st["r"]))
            else:
                st["v"] = b2 * st["v"] + (1 - b2) * gp * gp
                denom = torch.sqrt(st["v"]) + h["eps"]
            u = _rotate(_rotate(st["m"], st["Q"]) / denom, st["Q"], back=True)
            if h["normalize"]:
                u = u / (1e-30 + torch.sqrt(torch.mean(u * u)))
            size = h["lr"]
            if h["correct_bias"]:
                size = size * (1 - b2 ** st["t"]) ** 0.5 / (1 - b1 ** st["t"])
            with torch.no_grad():
                p.sub_(size * u)
                if h["weight_decay"] > 0:
                    p.sub_(h["lr"] * h["weight_decay"] * p)
            F, beta = st["F"], st["beta"]
            if st["kind"] == "pair":
                if F[0] is not None and F[1] is not None:
                    st["F"] = list(_pair_split(F[0], F[1], g, beta))
                else:
                    st["F"] = [None if F[0] is None else F[0] + g @ g.T,
                               None if F[1] is None else F[1] + g.T @ g]
            elif st["kind"] == "four":
                st["F"] = _four_split(F, g, beta)
            elif F[0] is not None:
                st["F"] = [beta * F[0] + (1 - beta) * g[:, None] * g[None, :]]
            if st["t"] % h["f"] == 0:
                for k, (Fk, Qk) in enumerate(zip(st["F"], st["Q"])):
                    if Fk is None:
                        continue
                    st["Q"][k], order = _power_qr(Fk, Qk)
                    if "l" in st:
                        key = "l" if k == 0 else "r"
                        st[key] = st[key][order]
                    else:
                        st["v"] = st["v"].index_select(k, order)
