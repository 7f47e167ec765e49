"""HuggingFace `transformers.Trainer` integration (needs `transformers` and `accelerate`:
``pip install "cafin[integrations]"``).

- `CafinTrainer`: a `Trainer` that builds a cafin member from the standard
  ``optimizer_cls_and_kwargs=(cafin.AdaFisher, {...})``, giving the model first to the members
  whose constructor takes it (AdaFisher, AdaFisherW, SINGD) and parameter groups to the others
  (DyKAF), and that hands its checkpoints to `PreconditionerCallback`s when it resumes.
- `PreconditionerCallback`: runs a `cafin.KFACPreconditioner` or `cafin.TwoLevelKFAC` on the
  gradients before every optimizer step, and saves its state into every checkpoint.

Recipes: docs/integrations.md.
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.training_args import ParallelMode

from ..core.preconditioner import Preconditioner
from .preconditioning import check_preconditioner, prepare, unscale

__all__ = ["CafinTrainer", "PreconditionerCallback", "PRECONDITIONER_NAME"]

PRECONDITIONER_NAME = "cafin_preconditioner.pt"


def _takes_model(optimizer_cls: type) -> bool:
    """Whether the constructor's first argument is the model (AdaFisher, SINGD), not parameters."""
    try:
        first = next(iter(inspect.signature(optimizer_cls).parameters))
    except (StopIteration, TypeError, ValueError):
        return False
    return first in ("model", "net")


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer accelerate's wrapper steps (the one its GradScaler keys its state by)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class PreconditionerCallback(TrainerCallback):
    r"""Runs a K-FAC or two-level K-FAC preconditioner inside a `transformers.Trainer`.

    The preconditioner is built on the model before the Trainer (it hooks its layers); any torch
    optimizer then steps on the preconditioned gradients (SGD with momentum, as kfac-pytorch
    recommends). On ``on_pre_optimizer_step`` (after Trainer's gradient clipping, before
    ``optimizer.step()``) it calls ``preconditioner.step()``, which rewrites every hooked
    layer's ``.grad``.

    fp16 mixed precision: the gradients are unscaled first when Trainer has not already done
    it to clip them (``accelerate``'s GradScaler then skips its own unscale, and still skips the
    optimizer step on inf/NaN gradients), and the Trainer's GradScaler is handed to a
    `KFACPreconditioner` built without one, so that its gradient-side statistics are unscaled
    too. `TwoLevelKFAC` takes no GradScaler and is refused under fp16.

    Checkpoints: the preconditioner's ``state_dict()`` is written to
    ``checkpoint-N/cafin_preconditioner.pt`` by the process that saves. `CafinTrainer` loads it
    when it resumes (``trainer.train(resume_from_checkpoint=...)``); with a plain
    `transformers.Trainer`, call ``callback.load(checkpoint_dir)`` before resuming (the Trainer
    tells its callbacks nothing about the checkpoint it resumes from): a resume without either
    raises.

    Args:
        preconditioner (KFACPreconditioner or TwoLevelKFAC): the preconditioner, built on the
            model the Trainer trains. K-FAC's ``accumulation_steps`` must equal
            ``TrainingArguments.gradient_accumulation_steps``; a `TwoLevelKFAC` gets
            ``update_stats = True`` (the empirical Fisher of the published loop).
    """

    def __init__(self, preconditioner: Preconditioner) -> None:
        self.preconditioner = check_preconditioner(preconditioner)
        self._loaded = False  # state loaded from a checkpoint for the coming train()

    def save(self, checkpoint_dir: str | os.PathLike) -> None:
        """Write the preconditioner's state into a checkpoint directory."""
        torch.save(self.preconditioner.state_dict(), os.path.join(checkpoint_dir, PRECONDITIONER_NAME))

    def load(self, checkpoint_dir: str | os.PathLike) -> None:
        """Load the preconditioner's state from a checkpoint directory written by `save`."""
        path = os.path.join(checkpoint_dir, PRECONDITIONER_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no preconditioner state in checkpoint {checkpoint_dir!s} (expected "
                                    f"{PRECONDITIONER_NAME}, written by PreconditionerCallback)")
        self.preconditioner.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self._loaded = True

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step > 0 and not self._loaded:
            raise RuntimeError(
                f"resuming at step {state.global_step} without the preconditioner's state: train with "
                "cafin.integrations.huggingface.CafinTrainer (it loads it), or call "
                "callback.load(checkpoint_dir) before trainer.train(resume_from_checkpoint=checkpoint_dir)")
        prepare(self.preconditioner, getattr(optimizer, "scaler", None), args.gradient_accumulation_steps,
                "TrainingArguments.gradient_accumulation_steps")

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        unscale(getattr(optimizer, "scaler", None), _torch_optimizer(optimizer))
        self.preconditioner.step()

    def on_train_end(self, args, state, control, **kwargs):
        self._loaded = False

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:
            return
        checkpoint_dir = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(checkpoint_dir):
            raise RuntimeError(f"PreconditionerCallback: the checkpoint {checkpoint_dir} the Trainer "
                               "just saved is not there (hyperparameter search runs save elsewhere)")
        self.save(checkpoint_dir)


def _check_model_member(trainer: Trainer, name: str) -> None:
    """What a member built on the model cannot go with, refused before training with what to do."""
    if trainer.is_fsdp_enabled or getattr(trainer, "is_fsdp_xla_enabled", False) or trainer.is_deepspeed_enabled:
        raise ValueError(f"CafinTrainer cannot build {name} under FSDP or DeepSpeed: they replace the "
                         "parameters it hooks after it is built. Shard the model with "
                         "torch.distributed.fsdp.fully_shard, build the optimizer after it and train in "
                         "your own loop (docs/distributed.md), or train with DDP (torchrun)")
    if trainer.args.parallel_mode == ParallelMode.NOT_DISTRIBUTED:
        raise ValueError(f"CafinTrainer cannot build {name} under nn.DataParallel ({trainer.args.n_gpu} GPUs "
                         "in one process): launch with torchrun for DDP, or make one GPU visible")
    if trainer.args.weight_decay != 0:
        raise ValueError(f"TrainingArguments.weight_decay={trainer.args.weight_decay} does not reach {name} "
                         "(it is built on the model, not on the Trainer's parameter groups): give "
                         "weight_decay in optimizer_cls_and_kwargs's kwargs and leave "
                         "TrainingArguments.weight_decay at 0")


class CafinTrainer(Trainer):
    r"""A `transformers.Trainer` that trains with a cafin member.

    Takes the standard ``optimizer_cls_and_kwargs=(cls, kwargs)``:

    - members whose constructor takes the model (`cafin.AdaFisher`, `cafin.AdaFisherW`,
      `cafin.SINGD`) are built as ``cls(model, **kwargs)`` on the model the Trainer trains,
      when the Trainer creates its optimizer. DDP and ``torch_compile`` wrap that same model
      (the same modules), so the member's hooks see every forward. Under fp16 the Trainer's
      GradScaler is passed as ``grad_scaler=`` (unless given), so that the statistics are
      unscaled when Trainer unscales the gradients to clip them. ``TrainingArguments``'
      ``weight_decay`` (and its no-decay groups) does not apply to them: give ``weight_decay``
      in ``kwargs``; ``learning_rate`` neither: give ``lr``.
    - members that take parameters (`cafin.DyKAF`) and torch optimizers go through the
      Trainer as usual (its parameter groups, with and without weight decay).
    - `cafin.KFACPreconditioner` and `cafin.TwoLevelKFAC` are not optimizers here: pass a torch
      optimizer and ``callbacks=[PreconditionerCallback(preconditioner)]``.

    Resuming (``train(resume_from_checkpoint=...)``) also loads the state of every
    `PreconditionerCallback` from the checkpoint. Refused, with what to do: FSDP and DeepSpeed
    (they replace the parameters a member has hooked; Trainer also refuses optimizers passed
    in under FSDP: shard with ``torch.distributed.fsdp.fully_shard`` in your own loop, see
    docs/distributed.md), and ``nn.DataParallel`` (several GPUs without torchrun: its replicas
    would feed one layer's statistics from several threads; launch with torchrun for DDP).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.optimizer_cls_and_kwargs is None:
            return
        optimizer_cls, _ = self.optimizer_cls_and_kwargs
        if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Preconditioner):
            raise TypeError(f"optimizer_cls_and_kwargs: {optimizer_cls.__name__} is a preconditioner, not an "
                            "optimizer: give a torch optimizer (e.g. torch.optim.SGD) and "
                            f"callbacks=[PreconditionerCallback({optimizer_cls.__name__}(model, ...))]")
        if not _takes_model(optimizer_cls):
            return
        _check_model_member(self, optimizer_cls.__name__)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is not None or self.optimizer_cls_and_kwargs is None:
            return super().create_optimizer(model)
        optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        if not _takes_model(optimizer_cls):
            return super().create_optimizer(model)
        kwargs = dict(optimizer_kwargs)
        scaler = getattr(self.accelerator, "scaler", None)
        if (scaler is not None and scaler.is_enabled() and "grad_scaler" not in kwargs
                and "grad_scaler" in inspect.signature(optimizer_cls).parameters):
            kwargs["grad_scaler"] = scaler
        self.optimizer = optimizer_cls(self.model if model is None else model, **kwargs)
        return self.optimizer

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, PreconditionerCallback):
                callback.load(checkpoint)
