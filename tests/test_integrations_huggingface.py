"""cafin inside HuggingFace's Trainer: a tiny GPT-2 built from a config (no download) trains
through CafinTrainer (optimizer members) and PreconditionerCallback (K-FAC + SGD), and a resume
from a checkpoint continues bit-identically."""
import os
import subprocess
import sys

import pytest
import torch

import cafin

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REASON = "the integrations extra is not installed (pip install -e '.[integrations]')"


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers", reason=REASON)
    pytest.importorskip("accelerate", reason=REASON)
    from cafin.integrations import huggingface
    return huggingface


class Sequences(torch.utils.data.Dataset):
    """12 arithmetic token sequences mod 101: learnable in a few steps, 3 batches of 4 an epoch."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, 101, (12, 1), generator=g)
        stride = torch.randint(1, 4, (12, 1), generator=g)
        self.ids = (start + stride * torch.arange(16)) % 101

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16))


def arguments(output_dir, steps, **kwargs):
    from transformers import TrainingArguments
    settings = dict(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=4, report_to=[],
                    use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
    settings.update(kwargs)
    return TrainingArguments(**settings)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


ADAFISHER = (cafin.AdaFisher, dict(lr=1e-3, TCov=1))


def kfac_trainer(hf, output_dir, steps, trainer=None, **kwargs):
    """K-FAC in front of SGD with momentum, on a fresh GPT-2 (the same initial weights each time)."""
    model = gpt2()
    callback = hf.PreconditionerCallback(cafin.KFACPreconditioner(model, lr=0.1, kl_clip=0.01))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cls = trainer or hf.CafinTrainer
    return cls(model=model, args=arguments(output_dir, steps, **kwargs), train_dataset=Sequences(),
               callbacks=[callback], optimizers=(sgd, None)), callback


def test_import_cafin_does_not_import_the_frameworks():
    code = ("import sys, cafin, cafin.integrations; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "[]", out.stdout


def test_adafisher_trains_gpt2_through_cafin_trainer(hf, tmp_path):
    model = gpt2()
    trainer = hf.CafinTrainer(model=model, args=arguments(tmp_path, 10), train_dataset=Sequences(),
                              optimizer_cls_and_kwargs=ADAFISHER)
    trainer.train()
    opt = trainer.optimizer.optimizer  # accelerate's wrapper around the member
    assert isinstance(opt, cafin.AdaFisher) and opt.model is model
    loss = losses(trainer)
    assert len(loss) == 10 and sum(loss[-3:]) < sum(loss[:3]) - 0.2, loss


@pytest.mark.parametrize("member", [cafin.SINGD, cafin.DyKAF])
def test_members_by_model_and_by_params(hf, tmp_path, member):
    # SINGD trains the layers it supports (as the published code does): the others stay
    kwargs = dict(lr=1e-3, warn_unsupported=False) if member is cafin.SINGD else dict(lr=3e-3)
    model = gpt2()
    trainer = hf.CafinTrainer(model=model, args=arguments(tmp_path, 3), train_dataset=Sequences(),
                              optimizer_cls_and_kwargs=(member, kwargs))
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, member)
    trained = [p for group in opt.param_groups for p in group["params"]]
    assert trained and all(not torch.equal(p, gpt2().state_dict()[name]) for name, p in model.named_parameters()
                           if any(p is q for q in trained))


def test_kfac_trains_gpt2_through_the_callback(hf, tmp_path):
    trainer, callback = kfac_trainer(hf, tmp_path, 10)
    trainer.train()
    assert callback.preconditioner.steps == 10
    loss = losses(trainer)
    # SGD on GPT-2's small initial weights is slow: the loss goes down, not far
    assert len(loss) == 10 and sum(loss[-3:]) < sum(loss[:3]) - 0.2, loss


def parameters(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_adafisher_resume_is_bit_identical(hf, tmp_path):
    straight = hf.CafinTrainer(model=gpt2(), args=arguments(tmp_path / "a", 6, save_strategy="steps", save_steps=3),
                               train_dataset=Sequences(), optimizer_cls_and_kwargs=ADAFISHER)
    straight.train()
    resumed = hf.CafinTrainer(model=gpt2(), args=arguments(tmp_path / "b", 6), train_dataset=Sequences(),
                              optimizer_cls_and_kwargs=ADAFISHER)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert losses(resumed) == losses(straight)  # the first three from the checkpoint
    assert_equal(parameters(resumed.model), parameters(straight.model))


def test_kfac_resume_is_bit_identical(hf, tmp_path):
    straight, first = kfac_trainer(hf, tmp_path / "a", 6, save_strategy="steps", save_steps=3)
    straight.train()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert (checkpoint / hf.PRECONDITIONER_NAME).is_file()
    resumed, second = kfac_trainer(hf, tmp_path / "b", 6)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert second.preconditioner.steps == 6
    assert_equal(parameters(resumed.model), parameters(straight.model))
    for name, factors in first.preconditioner.state_dict()["layers"].items():
        for key, value in factors.items():
            assert torch.equal(value, second.preconditioner.state_dict()["layers"][name][key]), (name, key)


def test_plain_trainer_resume_needs_the_callback_loaded(hf, tmp_path):
    from transformers import Trainer
    straight, _ = kfac_trainer(hf, tmp_path / "a", 6, trainer=Trainer, save_strategy="steps", save_steps=3)
    straight.train()
    checkpoint = str(tmp_path / "a" / "checkpoint-3")
    resumed, callback = kfac_trainer(hf, tmp_path / "b", 6, trainer=Trainer)
    with pytest.raises(RuntimeError, match="callback.load"):
        resumed.train(resume_from_checkpoint=checkpoint)
    resumed, callback = kfac_trainer(hf, tmp_path / "c", 6, trainer=Trainer)
    callback.load(checkpoint)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_equal(parameters(resumed.model), parameters(straight.model))


def test_clear_errors(hf, tmp_path):
    model = gpt2()
    with pytest.raises(TypeError, match="preconditioner"):
        hf.PreconditionerCallback(cafin.AdaFisher(model))
    with pytest.raises(TypeError, match="PreconditionerCallback"):
        hf.CafinTrainer(model=model, args=arguments(tmp_path, 1), train_dataset=Sequences(),
                        optimizer_cls_and_kwargs=(cafin.KFACPreconditioner, {}))
    with pytest.raises(ValueError, match="weight_decay"):
        hf.CafinTrainer(model=model, args=arguments(tmp_path, 1, weight_decay=0.1), train_dataset=Sequences(),
                        optimizer_cls_and_kwargs=ADAFISHER)
    with pytest.raises(ValueError, match="weight_decay"):  # also when the kwargs give one
        hf.CafinTrainer(model=model, args=arguments(tmp_path, 1, weight_decay=0.1), train_dataset=Sequences(),
                        optimizer_cls_and_kwargs=(cafin.AdaFisher, dict(weight_decay=0.1)))
    trainer, _ = kfac_trainer(hf, tmp_path, 1, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="accumulation_steps=2"):
        trainer.train()
    with pytest.raises(FileNotFoundError, match="cafin_preconditioner.pt"):
        hf.PreconditionerCallback(cafin.KFACPreconditioner(model)).load(tmp_path)


def test_fsdp_deepspeed_and_data_parallel_are_refused(hf, tmp_path):
    """Placements a CPU test cannot start, checked on a Trainer that reports them."""
    from transformers.training_args import ParallelMode
    trainer = hf.CafinTrainer(model=gpt2(), args=arguments(tmp_path, 1), train_dataset=Sequences(),
                              optimizer_cls_and_kwargs=ADAFISHER)
    hf._check_model_member(trainer, "AdaFisher")  # plain CPU: accepted
    for flag in ("is_fsdp_enabled", "is_deepspeed_enabled"):
        setattr(trainer, flag, True)
        with pytest.raises(ValueError, match="fully_shard"):
            hf._check_model_member(trainer, "AdaFisher")
        setattr(trainer, flag, False)
    args = type("Args", (), {"parallel_mode": ParallelMode.NOT_DISTRIBUTED, "n_gpu": 2, "weight_decay": 0.0})()
    trainer.args = args
    with pytest.raises(ValueError, match="torchrun"):
        hf._check_model_member(trainer, "AdaFisher")


def test_gradscaler_gradients_are_unscaled_before_the_preconditioner(hf):
    """Under fp16, accelerate scales the loss: the callback unscales the gradients (unless Trainer
    already did, to clip them) and hands the scaler to K-FAC for its statistics. A power-of-two
    scale is exact, so the scaled run equals the float32 one bit for bit."""
    from transformers import TrainerControl, TrainerState

    class AcceleratedOptimizer:  # what Trainer hands its callbacks under fp16: accelerate's wrapper
        def __init__(self, optimizer, scaler):
            self.optimizer, self.scaler = optimizer, scaler

        def zero_grad(self):
            self.optimizer.zero_grad()

        def step(self):
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def run(scaled, clip_first):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        callback = hf.PreconditionerCallback(cafin.KFACPreconditioner(model, lr=0.1))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=scaled)
        opt = AcceleratedOptimizer(sgd, scaler)
        args, state, control = arguments("unused", 3, gradient_accumulation_steps=1), TrainerState(), TrainerControl()
        callback.on_train_begin(args, state, control, optimizer=opt)
        assert callback.preconditioner.grad_scaler is (scaler if scaled else None)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if clip_first:
                scaler.unscale_(sgd)
            callback.on_pre_optimizer_step(args, state, control, optimizer=opt)
            opt.step()
        return parameters(model)

    plain = run(False, False)
    assert_equal(run(True, False), plain)
    assert_equal(run(True, True), plain)
