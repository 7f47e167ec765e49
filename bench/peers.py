"""The published implementations the bench runs beside cafin's members when they are installed
(cafin neither ships nor fetches them): heavyball's SOAP (DyKAF's closest peer), kfac-pytorch
(K-FAC's published code) and singd (SINGD's). Each loader returns None, or says why not, when its
package does not import. Also torch's own Muon (torch.optim.Muon) with AdamW on the parameters
Muon's documentation gives to AdamW, as one optimizer (`MuonAdamW`), and the step-phase rows of
`python -m bench` for both peers (`step_rows`)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

_SOAP_COMPILE_MODE: list = []  # heavyball's own compile mode, saved at the first call


def soap_available() -> tuple[bool, str]:
    try:
        import heavyball  # noqa: F401
    except Exception as exc:  # ImportError, or a heavyball that fails on this torch
        return False, (f"heavyball is not importable ({type(exc).__name__}: {exc}); "
                       "`pip install heavyball` adds SOAP, DyKAF's closest peer")
    return True, ""


def soap(params, eager: bool, lr: float = 3e-3, precondition_frequency: int | None = None):
    """heavyball.SOAP with its defaults (lr 3e-3, betas (0.9, 0.95), shampoo_beta 0.95, weight
    decay 0.01, precondition_frequency 2). heavyball wraps its building blocks in torch.compile
    (mode max-autotune-no-cudagraphs); eager=True runs them eagerly through heavyball's own
    module switch, `heavyball.utils.compile_mode = None`, which its decorators read on every call
    (the switch is process-wide: the last SOAP built decides for all)."""
    import heavyball
    import heavyball.utils
    if not _SOAP_COMPILE_MODE:
        _SOAP_COMPILE_MODE.append(heavyball.utils.compile_mode)
    heavyball.utils.compile_mode = None if eager else _SOAP_COMPILE_MODE[0]
    kwargs = {}
    if precondition_frequency is not None:
        kwargs["precondition_frequency"] = precondition_frequency
    return heavyball.SOAP(params, lr=lr, **kwargs)


def kfac_pytorch():
    """kfac-pytorch's module when the user has it installed, else None."""
    try:
        import kfac
        import kfac.preconditioner  # noqa: F401
    except ImportError:
        return None
    return kfac


def singd_class():
    """singd's SINGD when the package is importable, else None."""
    try:
        from singd.optim.optimizer import SINGD
    except ImportError:
        return None
    return SINGD


# ------------------------------------------------------------------------------------------ Muon
# torch.optim.Muon's documented usage (its docstring's example, after Keller Jordan's Muon, whose
# README gives the same values): lr 0.02, momentum 0.95, Nesterov on, 5 Newton-Schulz steps; the
# weight decay is torch's default, 0.1 (decoupled, multiplied by lr as in AdamW); the lr is scaled
# per matrix by torch's default adjust_lr_fn ("original": sqrt(max(1, rows / cols))).
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1)
MUON_TEXT = "torch.optim.Muon lr 0.02, momentum 0.95, nesterov, ns_steps 5, wd 0.1"
WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.EmbeddingBag)
MUON_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def muon_routes(model: nn.Module, adamw_layers: Sequence[str] | None = None) -> dict[str, str]:
    """Which optimizer takes each trainable parameter of `model`: "muon" or "adamw", by name (a
    parameter shared by several modules appears once, under its first name).

    The rule of Muon's documentation (torch.optim.Muon: "an optimizer for 2D parameters of neural
    network hidden layers"; Keller Jordan's README: embeddings, classifier heads and gains/biases
    to AdamW, a ConvNet's filters to Muon except the first layer's): Muon takes the `weight` of
    every Linear and Conv1d/2d/3d layer except the input and output layers; a convolution's filter
    goes to Muon flattened to [out_channels, in_channels x kernel]. Everything else goes to
    AdamW: embeddings, biases, norms' gains and shifts, bare parameters (a position table), and
    the input and output layers. `adamw_layers` names those two explicitly (module names); by
    default they are the first and the last layer with a weight (Linear, Conv, Embedding) in
    registration order: a GPT's token embedding and its head, a CNN's stem and its classifier.
    A parameter that an AdamW layer also holds (a decoder tied to the embedding) goes to AdamW."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, WEIGHT_LAYERS)
              and isinstance(getattr(m, "weight", None), nn.Parameter)]
    if adamw_layers is None:
        outer = {layers[0][0], layers[-1][0]} if layers else set()
    else:
        known = {name for name, _ in model.named_modules()}
        unknown = [n for n in adamw_layers if n not in known]
        if unknown:
            raise ValueError(f"adamw_layers names no module of the model: {unknown}")
        outer = set(adamw_layers)
    to_adamw: set[int] = set()  # parameters that some AdamW-side holder keeps on AdamW
    to_muon: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, WEIGHT_LAYERS) or not isinstance(getattr(module, "weight", None),
                                                                   nn.Parameter):
            continue
        if name in outer or not isinstance(module, MUON_LAYERS):
            to_adamw.add(id(module.weight))
        else:
            to_muon.add(id(module.weight))
    routes = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            routes[name] = "muon" if id(p) in to_muon and id(p) not in to_adamw else "adamw"
    return routes


class MuonAdamW:
    """torch.optim.Muon on a model's hidden matrices and torch.optim.AdamW on every other
    parameter, stepped as one optimizer (`zero_grad`, `step`, `state_dict`, `load_state_dict`,
    `param_groups`), as Muon's documentation prescribes (`muon_routes` says which goes where).

    torch's Muon takes 2-D parameters only; a convolution's filter is handed to it as a 2-D view
    [out, in x kernel] of the same storage, whose `.grad` is the filter's gradient viewed the same
    way just before each step, so Muon's update lands in the filter itself."""

    def __init__(self, model: nn.Module, adamw: dict, muon: dict | None = None,
                 adamw_layers: Sequence[str] | None = None) -> None:
        self.routes = muon_routes(model, adamw_layers)
        named = dict(model.named_parameters())
        self._params = [named[n] for n in self.routes]
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its 2-D view)
        muon_params, adamw_params = [], []
        for name, route in self.routes.items():
            p = named[name]
            if route == "adamw":
                adamw_params.append(p)
            elif p.ndim == 2:
                muon_params.append(p)
            else:
                try:
                    view = p.detach().view(p.shape[0], -1)
                except RuntimeError as exc:
                    raise ValueError(f"{name}: Muon takes a filter as a 2-D view of its storage, "
                                     f"and this {tuple(p.shape)} tensor has none ({exc}); make "
                                     "it contiguous or name its layer in adamw_layers") from exc
                self._views.append((p, view))
                muon_params.append(view)
        if not muon_params:
            raise ValueError("no hidden Linear or Conv weight for Muon in this model (the first "
                             "and the last layer go to AdamW): Muon would be AdamW under "
                             "another name")
        self.muon = torch.optim.Muon(muon_params, **{**MUON, **(muon or {})})
        self.adamw = torch.optim.AdamW(adamw_params, **adamw) if adamw_params else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.muon] + ([self.adamw] if self.adamw is not None else [])

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        # the model's own parameters: a filter's gradient lives on the filter, not on its view
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, view in self._views:
            view.grad = None if p.grad is None else p.grad.reshape(view.shape)
        try:
            for opt in self.optimizers:
                opt.step()
        finally:
            for _, view in self._views:
                view.grad = None
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(),
                "adamw": None if self.adamw is None else self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"muon", "adamw"}:
            raise ValueError("not a MuonAdamW state_dict: expected the keys 'muon' and 'adamw', "
                             f"got {sorted(state) if isinstance(state, dict) else type(state)}")
        if (state["adamw"] is None) != (self.adamw is None):
            raise ValueError("the state_dict's AdamW side does not match this model's routing")
        self.muon.load_state_dict(state["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state["adamw"])


def muon_adamw(model: nn.Module, adamw: dict, **kwargs) -> MuonAdamW:
    """Muon (MUON's settings) on the hidden matrices, AdamW with `adamw` on the rest."""
    return MuonAdamW(model, adamw, **kwargs)


# ------------------------------------------------------------------ the speed bench's step rows
PEER_VARIANTS = ("muon", "soap")  # the --variants names of the peers' step rows
# The models whose CPU run times the peers without being asked: ResNet-18's 512 x 4608 filters
# take Muon's bfloat16 Newton-Schulz (and SOAP's eigenbases) seconds per step on a CPU.
PEER_CPU_MODELS = ("gpt", "mlp")
MUON_VARIANT = "hidden matrices; AdamW the rest"
SOAP_VARIANT = "heavyball (eager)"


def _timed_step(ctx, make) -> object:
    """The optimizer `make(model)` builds on a copy of the bench's model, after one step on one
    real backward (its state exists); the callable steps it on those same gradients again. SOAP
    drops `.grad` after a step: the same gradients are handed back before every call."""
    import copy

    from .models import loss_for
    model = copy.deepcopy(ctx.base)
    opt = make(model)
    loss_for(ctx.run.model, model(ctx.x), ctx.y).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad.detach().clone() for p in params]
    opt.step()

    def step():
        for p, g in zip(params, grads):
            p.grad = g
        return opt.step()
    step.optimizer = opt
    return step


def wanted_peers(requested: set[str], model: str, device_type: str) -> list[str]:
    """The peers a run times: those --variants names, or with no --variants every peer (on the
    CPU only on PEER_CPU_MODELS)."""
    if requested:
        return [v for v in PEER_VARIANTS if v in requested]
    if device_type == "cpu" and model not in PEER_CPU_MODELS:
        return []
    return list(PEER_VARIANTS)


def step_rows(ctx) -> None:
    """The peers' rows of the step table, beside AdamW: torch.optim.Muon + AdamW (MuonAdamW, its
    AdamW side with the bench's AdamW: lr 1e-3, fused where this device has it) and heavyball's
    SOAP (its defaults, eager, no eigenbasis refresh in the timed steps, as every member's step
    row times a step without curvature work; DyKAF's own phase adds SOAP's refresh and amortised
    rows, and times this row itself when DyKAF is in the run)."""
    from .measure import Skip, adamw_fused_supported, measure
    run = ctx.run
    wanted = wanted_peers(ctx.requested, run.model, run.device.type)
    if not ctx.requested and not wanted:
        run.skipped.append(Skip(run.model, "step", "muon, soap", "not in the default "
                                f"{run.model} run on the CPU (seconds per step here): "
                                "--variants ...,muon,soap adds them", optimizer="peers"))
    if "muon" in wanted:
        kind = "fused" if adamw_fused_supported(run.device) else "foreach"
        measure(run, ctx.progress, "step", "muon", MUON_VARIANT.replace("AdamW", f"AdamW({kind})"),
                lambda: _timed_step(ctx, lambda m: muon_adamw(m, dict(lr=1e-3, **{kind: True}))))
    if "soap" in wanted and "dykaf" not in {m.name for m in ctx.members}:
        ok, why = soap_available()
        if not ok:
            run.skipped.append(Skip(run.model, "step", SOAP_VARIANT, why, optimizer="soap"))
        else:
            measure(run, ctx.progress, "step", "soap", SOAP_VARIANT,
                    lambda: _timed_step(ctx, lambda m: soap(m.parameters(), eager=True,
                                                            precondition_frequency=10**9)))
