"""K-FAC's preconditioning: each active layer's gradient through its decompositions (one batched
chain per stack of equal-shaped layers), the fused step's kept product buffers (`_Chain`), and
the KL-clipped write of the preconditioned gradients into `.grad`."""
from __future__ import annotations

from collections import defaultdict

import torch

from ... import factors
from ...core import Layer, check_gradient, route
from ...maths import kfac as kfac_maths
from .compat import ComputeMethod


class Preconditioning:
    """The preconditioning part of `KFACPreconditioner`."""

    def _check_grads(self) -> None:
        """Every registered gradient as its parameter is (dtype, shape, device, dense), or an
        error naming it before the step writes anything."""
        for layer in self._layers:
            for name, p in layer.module.named_parameters(recurse=False):
                check_gradient(p, "KFACPreconditioner", f"KFACPreconditioner: layer '{layer.name}', {name}")

    def _grads(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's weight and bias gradients: the full ones gathered this step when sharded."""
        m = layer.module
        if layer.name in self._gathered:
            return self._gathered[layer.name]
        return m.weight.grad, None if getattr(m, "bias", None) is None else m.bias.grad

    def _grad(self, layer: Layer) -> torch.Tensor:
        return factors.grad_matrix(layer.module, *self._grads(layer))

    def _active_layers(self) -> list[Layer]:
        """The layers whose gradients the step rewrites: statistics taken, gradients present,
        decomposed at least once (kfac-pytorch raises otherwise; cafin leaves them as they are)."""
        active = []
        for layer in self._layers:
            m = layer.module
            if not self._live(layer) or m.weight.grad is None or (
                    getattr(m, "bias", None) is not None and m.bias.grad is None):
                continue  # never ran (or unused this step): its gradient is left as it is
            if not (self._state[layer.name].decomposed or self._steps.device_gated):
                continue  # not decomposed yet (kfac-pytorch raises): left as it is
            active.append(layer)
        return active

    def _precondition(self, grad: torch.Tensor, s: dict[str, torch.Tensor], device) -> torch.Tensor:
        """The preconditioned gradient [groups, d_g, d_a] (in grad's dtype) of one layer, or of a
        stack of layers sharing second-order shapes."""
        work = grad.to(self.inv_dtype)
        if self.compute_method is ComputeMethod.EIGEN:
            if self.compute_eigenvalue_outer_product:
                v = kfac_maths.eigen_precondition(work, s.get("qa"), s["qg"], dgda=s["dgda"])
            else:
                damping = self._settings_on(device)["damping"]
                v = kfac_maths.eigen_precondition(
                    work, s.get("qa"), s["qg"], da=s["da"], dg=s["dg"], damping=damping,
                    scale_=self._impl_for(device, self.inv_dtype).kfac_eigen_scale_)
        else:
            v = kfac_maths.inverse_precondition(work, s["a_inv"], s["g_inv"])
        return v.to(grad.dtype).contiguous()

    def _precondition_grads(self, active: list[Layer]) -> dict[str, torch.Tensor]:
        """The preconditioned gradients of the active layers this rank is a gradient worker of:
        layers stacked by second-order shape in one product chain, the others one by one."""
        precond: dict[str, torch.Tensor] = {}
        names = {layer.name for layer in active if self.assignment.is_grad_worker(layer.name)}
        chained = self._chained()
        chains: list[_Chain] = []  # their pieces go into precond now; `_run_chains` fills them
        for members, stacked in self._stacks:
            if not all(layer.name in names for layer in members):
                continue
            if len({self._grads(layer)[0].dtype for layer in members}) > 1:
                continue
            if chained:
                chains.append(self._chain(members, stacked))
                pieces = chains[-1].pieces
            else:
                v = self._precondition(torch.cat([self._grad(layer) for layer in members]), stacked,
                                       members[0].module.weight.device)
                pieces = v.split([self._state[layer.name].A.shape[0] for layer in members])
            for layer, piece in zip(members, pieces):
                precond[layer.name] = piece
        for layer in active:
            if layer.name in names and layer.name not in precond:
                second = self._state[layer.name].second
                if chained:
                    chains.append(self._chain([layer], second))
                    precond[layer.name] = chains[-1].pieces[0]
                else:
                    precond[layer.name] = self._precondition(self._grad(layer), second,
                                                             layer.module.weight.device)
        self._run_chains(chains)
        return precond

    def _chained(self) -> bool:
        """Whether this step's products run through kept buffers (`_chain`): the fused backend's
        eager steps with eigenbases and the eigenvalue outer product (the default). A compiled
        or captured step keeps the plain products, whose memory the compiler or the graph's
        pool plans."""
        return (self._route.fused and self.compute_method is ComputeMethod.EIGEN
                and self.compute_eigenvalue_outer_product and route.eager())

    def _chain(self, layers: list[Layer], s: dict[str, torch.Tensor]) -> _Chain:
        """The kept buffers (`_Chain`) of `layers` (one, or a stack sharing the second-order data
        `s`); `_run_chains` copies the layers' gradients into its row-aligned matrices (no
        concatenation), then writes the products of `_precondition` into kept
        buffers (no allocation), and each chain's `pieces` are its layers' preconditioned
        gradients [groups, d_g, d_a] in their gradients' dtype."""
        w = self._grads(layers[0])[0]
        key = tuple(layer.name for layer in layers)
        chain = self._chains.get(key)
        if chain is None or not chain.fits(w, s):
            chain = _Chain(layers, [self._state[layer.name].A.shape[0] for layer in layers], s,
                           self.inv_dtype, w)
            self._chains[key] = chain
        return chain

    def _run_chains(self, chains: list[_Chain]) -> None:
        """The gradients copied in, the products of the chains, in the form `_per_layer_products`
        picks for the device (the per-layer ones in one `kfac_eigen_products_` call per device:
        on the CPU it shares the layers out over the threads), then their copies out. Each
        copy is one list op over every layer (one dispatch, not two per layer)."""
        into, grads_in = [], []
        for chain in chains:
            for layer, (w_dst, b_dst) in zip(chain.layers, chain.into):
                w, b = self._grads(layer)
                into.append(w_dst)
                grads_in.append(w)
                if b_dst is not None:
                    into.append(b_dst)
                    grads_in.append(b)
        if into:
            torch._foreach_copy_(into, grads_in)
        per_layer: dict[torch.device, list[tuple[torch.Tensor, ...]]] = defaultdict(list)
        for chain in chains:
            if chain.per_layer:
                per_layer[chain.grad.device].extend(chain.products)
                continue
            qa, qg, dgda = chain.sources
            kfac_maths.eigen_precondition_into(chain.grad, qa, qg, dgda, chain.work, chain.outs[0])
        for device, products in per_layer.items():
            grads, works, qa, qg, dgda = zip(*products)
            self._impl_for(device, self.inv_dtype).kfac_eigen_products_(
                grads, works, [None] * len(grads), qa, qg, dgda)
        outs = [dst for chain in chains for dst, _ in chain.copies]
        if outs:
            torch._foreach_copy_(outs, [src for chain in chains for _, src in chain.copies])

    def _update_grads(self, active: list[Layer], precond: dict[str, torch.Tensor]) -> None:
        """Write the KL-clipped preconditioned gradients into the gradients, one op call per
        device and dtype (one clip factor over all of them)."""
        buckets: dict[tuple, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
        for layer in active:
            w, b = self._grads(layer)
            w = factors.weight_grad_view(layer.module, w)  # [gradient side, input side], as the matrix
            ws, bs, vs = buckets[(w.device, w.dtype)]
            ws.append(w)
            bs.append(b if b is not None else _empty(w))
            vs.append(precond[layer.name])
        # A callable kl_clip returning None is a NaN tensor, which both backends read as "off".
        kl_off = self._values["kl_clip"] is None
        joint = None
        if self._owned_now and not kl_off:  # FSDP2 owner scheme: the owners' sums, all-reduced
            joint = self._owner_kl_scale(active, precond)
        elif len(buckets) > 1 and not kl_off:
            joint = self._joint_kl_scale(active, precond)
        for (device, dtype), (ws, bs, vs) in buckets.items():
            ts = self._settings_on(device)
            impl = self._impl_for(device, dtype)
            if joint is not None:  # the clip factor is applied here, the op only writes
                vs = [v * joint.to(device=device, dtype=v.dtype) for v in vs]
            kl = None if kl_off or joint is not None else ts["kl_clip"]
            if self._route.runs_kernels(device, dtype):
                _apply_contiguous(impl, ws, bs, vs, ts["lr"], kl)
            else:
                impl.kfac_precondition_apply_(ws, bs, vs, ts["lr"], kl)

    def _joint_kl_scale(self, active: list[Layer], precond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The KL-clip factor of layers of several dtypes or devices: one sum of <V, grad> over
        all of them (float64 when any gradient is, else float32), on the first layer's device."""
        acc = torch.float64 if any(precond[layer.name].dtype == torch.float64 for layer in active) else torch.float32
        device = active[0].module.weight.device
        vg = torch.zeros((), dtype=acc, device=device)
        for layer in active:
            v = precond[layer.name]
            vg = vg + (v.to(acc) * self._grad(layer).to(acc)).sum().to(device)
        ts = self._settings_on(device)
        return kfac_maths.kl_clip_scale(vg * ts["lr"].to(acc) ** 2, ts["kl_clip"])


def _per_layer_products(device: torch.device) -> bool:
    """The form of a chain's eigenbasis products in the eager fused step. On the CPU, per layer,
    each product a multiplication by an eigenbasis on the right
    (`eigen_precondition_right_into`): torch's CPU bmm is itself a loop of one GEMM per matrix
    (one product at a time over the stack), so a loop over the layers runs the same GEMMs with a
    layer's four products in a row, and written that way MKL runs them faster on bias-column
    widths. On other devices, one batched product (bmm) over the stack each, as they are
    (`eigen_precondition_into`)."""
    return not route.Route.batched_products(device)


class _Chain:
    """The kept buffers of one product chain (a layer, or a stack of layers sharing second-order
    shapes) over its groups, made on first use: the gradient matrix `grad` [groups, d_g, d_a] and
    the product buffer `work` in row-aligned storage (`aligned_empty`) in the decomposition's
    dtype, and the preconditioned gradients in the gradients' dtype. Each layer's views: `into`
    (where in grad its weight and bias gradients go, in their own shapes:
    `factors.grad_matrix_destinations`) and `pieces` ([groups, d_g, d_a] of the preconditioned
    gradients).

    Batched form (`per_layer` False): one `out` [groups, d_g, d_a] of the whole chain. Per-layer
    form: each layer's operands of `kfac_eigen_products_`, `products` (grad, work, qa, qg, dgda:
    its matrices for one group, else stacks), and any copy of its result out, `copies`; `work`
    is then [groups, d_a, d_g] with both eigenbases. Its piece is
    its rows of `grad` as they are where the gradients have the decomposition's dtype (the
    write reads row-aligned rows), else an output of its own: [groups, d_a, d_g] for a weight
    stored transposed (`factors.weight_is_transposed`: the kernel then writes it in that
    layout, no copy of the gradient), else [groups, d_g, d_a]."""

    def __init__(self, layers: list[Layer], sizes: list[int], s: dict[str, torch.Tensor],
                 inv_dtype: torch.dtype, like: torch.Tensor) -> None:
        _, d_a, d_g = factors.factor_sizes(layers[0].module)
        groups = sum(sizes)
        inv = dict(dtype=inv_dtype, device=like.device)
        out_like = dict(dtype=like.dtype, device=like.device)
        self.per_layer = _per_layer_products(like.device)
        transposed = self.per_layer and s.get("qa") is not None
        self.grad = kfac_maths.aligned_empty((groups, d_g, d_a), **inv)
        self.work = kfac_maths.aligned_empty((groups, d_a, d_g) if transposed else (groups, d_g, d_a), **inv)
        self.sources = (s.get("qa"), s["qg"], s["dgda"])
        self.outs = [] if self.per_layer else [torch.empty((groups, d_g, d_a), **out_like)]
        self.into: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.pieces: list[torch.Tensor] = []
        self.products: list[tuple[torch.Tensor, ...]] = []
        self.layers = layers
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source)
        offset = 0
        for layer, n in zip(layers, sizes):
            rows = slice(offset, offset + n)
            self.into.append(factors.grad_matrix_destinations(layer.module, self.grad[rows]))
            offset += n
            if not self.per_layer:
                self.pieces.append(self.outs[0][rows])
                continue
            pick = (lambda t, i=rows.start: t[i]) if n == 1 else (lambda t, r=rows: t[r])  # noqa: E731
            qa, qg, dgda, grad, work = (None if t is None else pick(t)
                                        for t in (*self.sources, self.grad, self.work))
            self.products.append((grad, work, qa, qg, dgda))
            if factors.weight_is_transposed(layer.module):
                out = torch.empty((n, d_a, d_g), **out_like)
                self.copies.append((out, self.grad[rows].mT))
                self.pieces.append(out.mT)
                self.outs.append(out)
            elif like.dtype == inv_dtype:  # the result as it lies (the write reads aligned rows)
                self.pieces.append(self.grad[rows])
            else:
                out = torch.empty((n, d_g, d_a), **out_like)
                self.copies.append((out, self.grad[rows]))
                self.pieces.append(out)
                self.outs.append(out)

    def fits(self, w: torch.Tensor, s: dict[str, torch.Tensor]) -> bool:
        """Whether these buffers serve gradients like `w` and the second-order tensors `s`."""
        return (self.pieces[0].dtype == w.dtype and self.pieces[0].device == w.device
                and all(a is b for a, b in zip(self.sources, (s.get("qa"), s["qg"], s["dgda"]))))

    def tensors(self) -> list[torch.Tensor]:
        return [self.grad, self.work, *self.outs]


def _apply_contiguous(impl, ws: list[torch.Tensor], bs: list[torch.Tensor], vs: list[torch.Tensor],
                      lr: torch.Tensor, kl: torch.Tensor | None) -> None:
    """`kfac_precondition_apply_` of the kernels, which take contiguous gradients and
    preconditioned gradients whose rows are equally spaced (a chain's row-aligned pieces). A
    transposed weight gradient (an Embedding's, a `Conv1D`'s) whose preconditioned gradient is
    kept transposed too (`_Chain`) is written in their own layout, as two entries without a bias
    column (weight rows, then the bias row: the same terms of the clip sum); any other layout
    goes through a contiguous copy."""
    kw: list[torch.Tensor] = []
    kb: list[torch.Tensor] = []
    kv: list[torch.Tensor] = []
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for w, b, v in zip(ws, bs, vs):
        if w.dim() == 2 and not w.is_contiguous() and w.mT.is_contiguous() and v.mT.is_contiguous():
            d_w = w.shape[1]
            kw.append(w.mT)
            kb.append(_empty(w))
            kv.append(v.mT[:, :d_w])
            if b.numel():
                kw.append(b)
                kb.append(_empty(w))
                kv.append(v.mT[:, d_w:])
            continue
        for t, into in ((w, kw), (b, kb)):
            if not t.is_contiguous():
                back.append((t, t.contiguous()))
                t = back[-1][1]
            into.append(t)
        kv.append(v if kfac_maths.rows_equally_spaced(v) else v.contiguous())
    impl.kfac_precondition_apply_(kw, kb, kv, lr, kl)
    for t, out in back:
        t.copy_(out)


_EMPTY: dict[tuple, torch.Tensor] = {}


def _empty(like: torch.Tensor) -> torch.Tensor:
    key = (like.device, like.dtype)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=like.dtype, device=like.device)
    return _EMPTY[key]
