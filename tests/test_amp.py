"""cafin.core.amp: what torch.amp.GradScaler hands the members that unscale themselves, and the
refusal when statistics taken from scaled gradients cannot be unscaled."""
import pytest
import torch
from torch import nn

import cafin
from cafin.core import amp


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


MEMBERS = {
    "AdaFisher": lambda m, **kw: cafin.AdaFisher(m, lr=1e-3, TCov=1, **kw),
    "SINGD": lambda m, **kw: cafin.SINGD(m, lr=1e-3, T=1, warn_unsupported=False, **kw),
}


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_unscaled_before_step_without_the_scaler_is_refused_writing_nothing(name):
    model = _model()
    opt = MEMBERS[name](model)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=f"pass grad_scaler=scaler to {name}"):
        scaler.step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_unscaled_before_step_with_the_scaler_steps(name):
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = MEMBERS[name](model, grad_scaler=scaler)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_current_scale_of_a_scaler_and_of_a_callable():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert amp.current_scale(scaler) is None  # no scale() yet
    scaler.scale(torch.ones(()))
    assert float(amp.current_scale(scaler)) == 8.0
    assert amp.current_scale(lambda: 2.5) == 2.5


def test_handed_over_reads_what_the_scaler_set():
    class Stub:
        pass

    opt = Stub()
    assert amp.handed_over(opt) == (None, None)
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
    assert amp.handed_over(opt) == (opt.grad_scale, opt.found_inf)
