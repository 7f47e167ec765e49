"""The family's table, as torch's `optim_db`: one entry per member, saying how it is built on a
model, how a training step drives it, and which of its settings a user may get wrong. Every
contract test in tests/test_contract.py runs over every entry.

A `Run` is one member on one model with the torch optimizer that follows it, when it is a
preconditioner (K-FAC and two-level K-FAC rewrite `.grad`; SGD with momentum then steps), stepped
the way its users step it. Intervals are 1 so that every step exercises every path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import cafin

DELETE = object()  # a `bad_checkpoint` value: remove that entry


class Run:
    """A member on `model`: `step(x, y)` is one training step, `checkpoint()`/`restore()` the
    state a user saves, `curvature` the cafin object."""

    def __init__(self, member: "Member", model: nn.Module, **kwargs) -> None:
        self.member, self.model = member, model
        self.curvature = member.build(model, **kwargs)
        self.follower = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                         if member.preconditioner else None)

    def objects(self) -> list:
        return [self.curvature] + ([self.follower] if self.follower is not None else [])

    def backward(self, x, y, model=None) -> torch.Tensor:
        model = self.model if model is None else model
        model.zero_grad(set_to_none=True)
        if self.member.name == "TwoLevelKFAC":
            self.curvature.update_stats = True
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def step(self, x, y, model=None) -> None:
        self.backward(x, y, model)
        self.update()

    def update(self) -> None:
        """What follows backward: the member's step (and the follower's)."""
        if self.member.name == "TwoLevelKFAC":
            self.curvature.step(update_params=True)
        else:
            self.curvature.step()
        if self.follower is not None:
            self.follower.step()

    def checkpoint(self) -> list[dict]:
        return [o.state_dict() for o in self.objects()]

    def restore(self, checkpoint: list[dict]) -> None:
        for o, sd in zip(self.objects(), checkpoint):
            o.load_state_dict(sd)


@dataclass(frozen=True)
class Member:
    name: str
    build: Callable[..., Any]          # (model, **kwargs) -> the cafin object
    preconditioner: bool = False       # rewrites .grad; a torch optimizer steps
    hooked: bool = True                # takes statistics through module hooks
    closure: bool = True               # step(closure) as torch.optim
    last_pass_statistics: bool = False  # statistics of the step's last pass only (not summed)
    # group settings a user may assign a plain float to between steps (optimizers)
    float_settings: tuple[str, ...] = ()
    # (label, setter(run)) assignments a user may make between steps that must be refused
    bad_between_steps: tuple = ()
    # constructor keywords that take a callable of the step (kfac-pytorch style) ->
    # (a good value, values bad for this keyword beyond -1, nan, inf and a string)
    callables: dict = field(default_factory=dict)
    # (label, path into checkpoint()[0], value or DELETE) that load_state_dict must refuse
    bad_checkpoint: tuple = ()
    # (keyword, value) the constructor must refuse, naming the keyword: every numeric argument
    # just outside its range, at each end that has one
    out_of_range: tuple = ()


def _group_setter(name, value, index=0):
    def set_(run):
        run.curvature.param_groups[index][name] = value
    return set_


def _attr_setter(name, value):
    def set_(run):
        setattr(run.curvature, name, value)
    return set_


_BAD_NUMBERS = (("nan", math.nan), ("-1", -1.0), ("inf", math.inf), ("str", "0.1"), ("bool", True))


def _bad_group(names):
    return tuple((f"{n}={label}", _group_setter(n, v)) for n in names for label, v in _BAD_NUMBERS)


def _bad_attrs(names):
    return tuple((f"{n}={label}", _attr_setter(n, v)) for n in names for label, v in _BAD_NUMBERS)


def _bad_values(setter, values):
    """Out-of-range values (name, value) assigned by `setter` between steps."""
    return tuple((f"{name}={value!r}", setter(name, value)) for name, value in values)


def _bad_groups_in_checkpoint(names):
    return tuple((f"{n}={label}", ("param_groups", 0, n), v) for n in names
                 for label, v in _BAD_NUMBERS)


MEMBERS = [
    Member(
        "AdaFisher",
        lambda model, **kw: cafin.AdaFisher(model, **{"lr": 1e-2, "TCov": 1, **kw}),
        float_settings=("lr", "weight_decay", "beta"),
        bad_between_steps=_bad_group(("lr", "beta", "Lambda", "weight_decay")) + _bad_values(
            _group_setter, (("beta", 1.0), ("Lambda", 0.0))) + _bad_values(
            _attr_setter, (("gamma", 0.0), ("gamma", 10.5), ("TCov", 0), ("TCov", 1.5))),
        bad_checkpoint=_bad_groups_in_checkpoint(("lr", "beta", "Lambda", "weight_decay")),
        out_of_range=(("lr", -1e-3), ("beta", -0.1), ("beta", 1.0), ("Lambda", 0.0),
                      ("weight_decay", -1e-3), ("gamma", 0.0), ("gamma", 10.5), ("TCov", 0)),
    ),
    Member(
        "KFACPreconditioner",
        lambda model, **kw: cafin.KFACPreconditioner(
            model, **{"factor_update_steps": 1, "inv_update_steps": 1, "damping": 1e-2, **kw}),
        preconditioner=True, closure=False,
        bad_between_steps=_bad_attrs(("damping", "factor_decay", "kl_clip", "lr")) + _bad_values(
            _attr_setter, (("damping", 0.0), ("factor_decay", 0.0), ("factor_decay", 1.5),
                           ("kl_clip", 0.0))),
        callables={"damping": (1e-2, ()), "factor_decay": (0.95, (2.0,)), "kl_clip": (1e-3, ()),
                   "lr": (0.1, ()), "factor_update_steps": (1, (0,)), "inv_update_steps": (1, (0,))},
        bad_checkpoint=(("damping=-1", ("damping",), -1.0),
                        ("factor_update_steps=0", ("factor_update_steps",), 0),
                        ("inv_update_steps=str", ("inv_update_steps",), "1"),
                        ("steps=-1", ("steps",), -1),
                        ("no steps", ("steps",), DELETE)),
        out_of_range=(("damping", 0.0), ("factor_decay", 0.0), ("factor_decay", 1.5),
                      ("kl_clip", 0.0), ("lr", -0.1), ("factor_update_steps", 0),
                      ("inv_update_steps", 0), ("accumulation_steps", 0),
                      ("allreduce_bucket_cap_mb", -1.0), ("grad_worker_fraction", -0.5),
                      ("grad_worker_fraction", 1.5)),
    ),
    Member(
        "TwoLevelKFAC",
        lambda model, **kw: cafin.TwoLevelKFAC(model, **{"T_cov": 1, "T_inv": 1, "damping": 1e-2, **kw}),
        preconditioner=True, closure=False, last_pass_statistics=True,
        bad_between_steps=_bad_attrs(("damping", "alpha", "clipping")) + _bad_values(
            _attr_setter, (("damping", 0.0), ("alpha", 1.5), ("T_cov", 0), ("T_inv", 0),
                           ("T_cov", 2.0))),
        bad_checkpoint=(("no iteration_counter", ("twolevel", "iteration_counter"), DELETE),
                        ("iteration_counter=-1", ("twolevel", "iteration_counter"), -1)),
        out_of_range=(("damping", 0.0), ("alpha", -0.1), ("alpha", 1.5), ("clipping", -1e-2),
                      ("T_cov", 0), ("T_inv", 0), ("batch_size", 0)),
    ),
    Member(
        "SINGD",
        lambda model, **kw: cafin.SINGD(model, **{"lr": 1e-2, "T": 1, **kw}),
        float_settings=("lr", "weight_decay", "momentum", "damping"),
        bad_between_steps=_bad_group(("lr", "momentum", "damping", "weight_decay")) + _bad_values(
            _group_setter, (("momentum", 1.0), ("momentum", 1.5), ("alpha1", 1.0), ("alpha1", 2.0),
                            ("alpha1", -0.5), ("lr_cov", -1e-2), ("lr_cov", math.inf), ("T", 0))),
        callables={"lr_cov": (1e-2, ())},
        bad_checkpoint=_bad_groups_in_checkpoint(("lr", "momentum", "damping", "weight_decay")) + (
            ("T=0", ("param_groups", 0, "T"), 0),
            ("structures=bogus", ("param_groups", 0, "structures"), ("bogus", "dense")),
            ("loss_average=mean", ("param_groups", 0, "loss_average"), "mean")),
        out_of_range=(("lr", -1e-3), ("momentum", -0.1), ("momentum", 1.0), ("momentum", 1.5),
                      ("damping", -1e-3), ("alpha1", -0.1), ("alpha1", 1.0), ("alpha1", 2.0),
                      ("weight_decay", -1e-3), ("T", 0), ("lr_cov", -1e-2),
                      ("init_grad_scale", 0.0)),
    ),
    Member(
        "DyKAF",
        lambda model, **kw: cafin.DyKAF(model.parameters(), **{"lr": 1e-2, "precondition_frequency": 1, **kw}),
        hooked=False,
        float_settings=("lr", "weight_decay"),
        bad_between_steps=_bad_group(("lr", "weight_decay", "eps")) + _bad_values(
            _group_setter, (("betas", (1.0, 0.9)), ("betas", (0.9, -0.1)), ("shampoo_beta", 1.5),
                            ("eps", 0.0), ("precondition_frequency", 0), ("max_precond_dim", 0))
        ) + _bad_values(_attr_setter, (("rank_one_eps", -1.0), ("rank_one_eps", math.inf))),
        bad_checkpoint=_bad_groups_in_checkpoint(("lr", "weight_decay", "eps")) + (
            ("betas=(1.5, 0.9)", ("param_groups", 0, "betas"), (1.5, 0.9)),
            ("precondition_frequency=0", ("param_groups", 0, "precondition_frequency"), 0),
            ("kind=bogus", ("state", 0, "kind"), "bogus")),
        out_of_range=(("lr", -1e-3), ("betas", (-0.1, 0.9)), ("betas", (1.0, 0.9)),
                      ("betas", (0.9, 1.0)), ("shampoo_beta", 1.5), ("eps", 0.0),
                      ("weight_decay", -1e-3), ("precondition_frequency", 0),
                      ("max_precond_dim", 0), ("rank_one_eps", -1.0), ("seed", -1)),
    ),
]

IDS = [m.name for m in MEMBERS]
HOOKED = [m for m in MEMBERS if m.hooked]
OPTIMIZERS = [m for m in MEMBERS if not m.preconditioner]
