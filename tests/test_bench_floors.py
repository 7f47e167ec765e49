"""The members' step floors of the speed bench (bench/floors.py): FLOP and byte counts against
hand counts on tiny models, and the GEMM-rate measurement they are priced at."""
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import floors  # noqa: E402
from bench.kfac_phases import precondition_flops  # noqa: E402
from bench.measure import sgemm_rate  # noqa: E402
from bench.models import gpt  # noqa: E402


def _tiny():
    # Linear 5 -> 3 with bias (d_a 6, d_g 3), Linear 3 -> 2 without (d_a 3, d_g 2): 24 parameters
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2, bias=False))


def test_kfac_floor_hand_count():
    f = floors.kfac(_tiny())
    # 4 d_g d_a (d_g + d_a): 4*3*6*9 + 4*2*3*5
    assert f.flop == 648 + 120
    # 20 B per gradient-matrix element (18 + 6), SGD 20 B and the restore 16 B per parameter (24)
    assert f.bytes == 20 * 24 + 36 * 24
    assert precondition_flops(_tiny()) == f.flop


def test_kfac_floor_diagonal_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 2))
    f = floors.kfac(model)
    # the Embedding (d_a 7, d_g 4, A diagonal: the two Q_G products) + Linear (d_a 5, d_g 2)
    assert f.flop == 4 * 4 * 7 * 4 + 4 * 2 * 5 * 7
    assert f.bytes == 20 * (28 + 10) + 36 * (28 + 10)


def test_singd_floor_hand_count():
    diagonal = floors.singd(_tiny())
    assert diagonal.flop == 0  # diagonal K and C: elementwise
    # SGD 20 B per parameter; K and C read once: 4 B x (d_k + d_c) per layer
    assert diagonal.bytes == 20 * 24 + 4 * (6 + 3) + 4 * (3 + 2)
    dense = floors.singd(_tiny(), "dense")
    # two products per side, 2 x d^2 x (the other side) each: K 6x6 on 3 columns, C 3x3 on 6, ...
    assert dense.flop == 2 * 2 * (36 * 3 + 9 * 6 + 9 * 2 + 4 * 3)
    assert dense.flop == floors.kfac(_tiny()).flop  # the same four dense GEMMs per layer
    assert dense.bytes == 20 * 24 + 8 * (18 + 6)  # the natural gradient written and read


def test_dykaf_floor_hand_count():
    f = floors.dykaf(_tiny())
    # 10 mn(m + n) per matrix: [3, 5] and [2, 3]
    assert f.flop == 10 * 15 * 8 + 10 * 6 * 5
    # 20 B per parameter; the factors (8 B x (m^2 + n^2)); the bias's full second moment (8 B)
    assert f.bytes == 20 * 24 + 8 * (9 + 25) + 8 * (4 + 9) + 8 * 3
    assert floors.dykaf(_tiny(), max_precond_dim=4).flop == 10 * 6 * 5  # [3, 5] over the limit


def test_twolevel_floor_hand_count():
    f = floors.twolevel(_tiny())
    assert f.flop == 648 + 120 + 2 * 2 * 2  # the first level and the 2 x 2 coarse solve
    assert f.bytes == 20 * 24 + 36 * 24


def test_floor_ms_and_json():
    f = floors.Floor("kfac", 2 * 10**9, 10**9)
    assert f.ms(1e11, 1e10) == pytest.approx(20 + 100)
    assert f.to_json(1e11, 1e10) == {"optimizer": "kfac", "step_floor_ms": pytest.approx(120),
                                     "flop": 2 * 10**9, "bytes": 10**9}


def test_member_floors_on_gpt():
    model = gpt()
    got, failed = floors.member_floors(model, ["adafisher", "kfac", "singd", "dykaf", "twolevel"])
    assert [f.optimizer for f in got] == ["kfac", "singd", "dykaf", "twolevel"] and not failed
    kfac, twolevel = got[0], got[3]
    # the Embedding (d_a 256, d_g 128, diagonal) and per block qkv, proj, fc, out
    shapes = ((129, 384), (129, 128), (129, 512), (513, 128))
    per_block = sum(4 * g * a * (g + a) for a, g in shapes)
    assert kfac.flop == 4 * 128 * 256 * 128 + 4 * per_block
    # two-level on the blocks only (it refuses the Embedding, and the head is its weight): their
    # 16 layers and the 16 x 16 coarse solve; SGD and the restore still over every parameter
    assert twolevel.flop == 4 * per_block + 2 * 16 * 16
    params = sum(p.numel() for p in model.parameters())
    assert twolevel.bytes == 20 * 4 * sum(a * g for a, g in shapes) + 36 * params


def test_a_member_that_refuses_the_model_is_said_not_raised():
    got, failed = floors.member_floors(nn.Sequential(nn.Embedding(5, 3)), ["kfac", "twolevel"])
    assert [f.optimizer for f in got] == ["kfac"]
    assert set(failed) == {"twolevel"} and failed["twolevel"].startswith("ValueError: ")


def test_sgemm_rate():
    rate = sgemm_rate(64, torch.device("cpu"), repeats=3)
    assert math.isfinite(rate) and rate > 1e6


@pytest.mark.parametrize("name", ["kfac", "twolevel"])
def test_eigenbasis_products_alone_do_the_floors_gemm_flops(name):
    """The bench's "GEMMs alone" row runs exactly the products the member's floor counts (the
    coarse solve aside): its one `kfac_eigen_products_` call, whose products the reference op
    runs as torch products that the flop counter sees (the same multiply-adds in another
    association), and its results are the reference's."""
    from torch.utils.flop_counter import FlopCounterMode
    from cafin import reference
    model = gpt(vocab=32, dim=16, depth=2, heads=2, context=8)
    layers = floors.EIGENBASIS_LAYERS[name](model)
    run = floors.eigenbasis_products(layers, torch.device("cpu"))
    grads = run.args[0]
    want_grads = [g.clone() for g in grads]
    with FlopCounterMode(display=False) as counter:
        reference.kfac_eigen_products_(want_grads, *run.args[1:])
    run()
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    want = sum(floors.eigenbasis_flops(*layer) for layer in layers)
    assert counter.get_total_flops() == want
    floor = floors.FLOORS[name](model)
    assert floor.flop - want == (2 * len(layers) ** 2 if name == "twolevel" else 0)
