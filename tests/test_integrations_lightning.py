"""cafin inside PyTorch Lightning: a cafin optimizer from configure_optimizers under automatic
optimization (closures) and K-FAC through PreconditionerCallback train exactly as a plain loop
does, and a resume from a Lightning checkpoint continues bit-identically. Every test runs under both
namespaces, `lightning.pytorch` and `pytorch_lightning`, each with its own callback class."""
import importlib
from types import SimpleNamespace

import pytest
import torch

import cafin

REASON = "the integrations extra is not installed (pip install -e '.[integrations]')"


NAMESPACES = {"lightning.pytorch": "cafin.integrations.lightning",
              "pytorch_lightning": "cafin.integrations.pytorch_lightning"}


@pytest.fixture(scope="module", params=list(NAMESPACES))
def pl(request):
    """The namespace's Trainer, callbacks and LightningModule, with cafin's callback for it."""
    pytest.importorskip(request.param, reason=REASON)
    namespace = importlib.import_module(request.param)
    callbacks = importlib.import_module(f"{request.param}.callbacks")
    callback = importlib.import_module(NAMESPACES[request.param]).PreconditionerCallback
    return SimpleNamespace(Trainer=namespace.Trainer, LightningModule=namespace.LightningModule,
                           ModelCheckpoint=callbacks.ModelCheckpoint, Callback=callbacks.Callback,
                           PreconditionerCallback=callback)


def batches():
    """Three fixed batches of 8 (one epoch), the same order every epoch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 6, generator=g)
    y = torch.tanh(x @ torch.randn(6, 3, generator=g))
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)]


def network():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_optimizer(kind, model):
    if kind == "adafisher":
        return cafin.AdaFisher(model, lr=1e-3, TCov=1)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def module(pl, kind):
    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()
            self.losses, self.forwards = [], 0

        def forward(self, x):
            self.forwards += 1
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return make_optimizer(kind, self)

    return Regression()


def trainer(pl, steps, callbacks=(), **kwargs):
    settings = dict(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                    enable_checkpointing=False, enable_model_summary=False)
    settings.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **settings)


def loader():
    x, y = (torch.cat(t) for t in zip(*batches()))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def preconditioner(kind, model):
    if kind == "kfac":
        return cafin.KFACPreconditioner(model, lr=0.1)
    if kind == "twolevel":
        return cafin.TwoLevelKFAC(model, damping=0.1, T_cov=1, T_inv=2, constraint_norm=True, clipping=0.1,
                                  batch_size=8)
    return None


def plain_loop(kind, steps):
    """The same training written by hand: the reference the Lightning runs must equal."""
    model = network()
    opt = make_optimizer(kind, model)
    pre = preconditioner(kind, model)
    data = batches()
    for k in range(steps):
        x, y = data[k % len(data)]
        opt.zero_grad()
        if kind == "twolevel":
            pre.update_stats = True
        torch.nn.functional.mse_loss(model(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()
    return model.state_dict()


def assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def fit(pl, kind, steps, ckpt_path=None, extra=(), **kwargs):
    mod = module(pl, kind)
    pre = preconditioner(kind, mod)
    callbacks = [pl.PreconditionerCallback(pre)] if pre is not None else []
    run = trainer(pl, steps, callbacks + list(extra), **kwargs)
    run.fit(mod, loader(), ckpt_path=ckpt_path)
    return run, mod, callbacks


@pytest.mark.parametrize("kind", ["adafisher", "kfac", "twolevel"])
def test_trains_exactly_as_a_plain_loop(pl, kind):
    _, mod, callbacks = fit(pl, kind, 10)
    assert mod.forwards == 10  # the closure runs once per step: one pass of statistics
    assert len(mod.losses) == 10 and sum(mod.losses[-3:]) < 0.8 * sum(mod.losses[:3]), mod.losses
    assert_equal({"net." + k: v for k, v in plain_loop(kind, 10).items()}, mod.state_dict())
    if kind == "kfac":
        assert callbacks[0].preconditioner.steps == 10


@pytest.mark.parametrize("kind", ["adafisher", "kfac", "twolevel"])
def test_resume_is_bit_identical(pl, kind, tmp_path):
    """6 steps straight, saving a checkpoint at step 3 (ModelCheckpoint: a checkpoint written
    during training carries the loops' state), then a new Trainer on a new model resumes it."""
    saver = pl.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    _, straight, first = fit(pl, kind, 6, extra=[saver], enable_checkpointing=True)
    path = str(tmp_path / "epoch=0-step=3.ckpt")
    saved = torch.load(path, weights_only=True)["callbacks"]
    if first:
        assert f"PreconditionerCallback[{type(first[0].preconditioner).__name__}]" in saved
    _, resumed, second = fit(pl, kind, 6, ckpt_path=path)
    assert resumed.forwards == 3
    assert_equal(resumed.state_dict(), straight.state_dict())
    if kind == "kfac":
        assert second[0].preconditioner.steps == 6
        for name, factors in first[0].preconditioner.state_dict()["layers"].items():
            for key, value in factors.items():
                assert torch.equal(value, second[0].preconditioner.state_dict()["layers"][name][key]), (name, key)


def test_the_callback_is_the_namespace_s_own(pl):
    """Each namespace's Trainer takes only its own Callbacks: the class for it derives from it."""
    callback = pl.PreconditionerCallback(cafin.KFACPreconditioner(network()))
    assert isinstance(callback, pl.Callback)
    assert callback.state_key == "PreconditionerCallback[KFACPreconditioner]"


def test_clear_errors(pl):
    PreconditionerCallback = pl.PreconditionerCallback
    with pytest.raises(TypeError, match="preconditioner"):
        PreconditionerCallback(cafin.AdaFisher(network()))
    mod = module(pl, "kfac")
    run = trainer(pl, 2, [PreconditionerCallback(cafin.KFACPreconditioner(mod))], accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="accumulation_steps=2"):
        run.fit(mod, loader())
    # two-level K-FAC cannot unscale its statistics: refused under a GradScaler ("16-mixed")
    callback = PreconditionerCallback(cafin.TwoLevelKFAC(network()))
    fp16 = type("Run", (), {"precision_plugin": type("Plugin", (), {"scaler": torch.amp.GradScaler("cpu")})(),
                            "accumulate_grad_batches": 1})()
    with pytest.raises(ValueError, match="TwoLevelKFAC"):
        callback.on_fit_start(fp16, None)


@pytest.mark.parametrize("namespace, other", [("lightning.pytorch", "cafin.integrations.pytorch_lightning"),
                                              ("pytorch_lightning", "cafin.integrations.lightning")])
def test_a_missing_namespace_names_the_other_module(namespace, other, monkeypatch):
    """Without the namespace's package, the error names it and the module for the other one."""
    from cafin.integrations import lightning_callback

    package = lightning_callback.NAMESPACES[namespace][0]

    def missing(name):
        raise ModuleNotFoundError(f"No module named {package!r}", name=package)

    monkeypatch.setattr(lightning_callback.importlib, "import_module", missing)
    with pytest.raises(ModuleNotFoundError, match=f"needs the `{package}` package") as info:
        lightning_callback.callback_base(namespace)
    assert f"{other}.PreconditionerCallback" in str(info.value)
