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
    f = floors.Floor("kfac", 2 * 10**9, 10**9, launches=9)
    assert f.ms(1e11, 1e10) == pytest.approx(20 + 100)  # no launch cost given: none counted
    # 9 launches at 5 us each: 0.045 ms on top of the GEMMs' 20 ms and the bytes' 100 ms
    assert f.ms(1e11, 1e10, 5e-6) == pytest.approx(120.045)
    assert f.to_json(1e11, 1e10, 5e-6) == {
        "optimizer": "kfac", "step_floor_ms": pytest.approx(120.045), "flop": 2 * 10**9,
        "bytes": 10**9, "launches": 9, "dtype": "float32", "gemm_ms": pytest.approx(20),
        "bytes_ms": pytest.approx(100), "launch_ms": pytest.approx(0.045)}


def test_each_floor_counts_its_launches():
    model = _tiny()
    assert floors.kfac(model).launches == floors.KFAC_LAUNCHES == 9
    assert floors.twolevel(model).launches == floors.KFAC_LAUNCHES + 2
    assert floors.singd(model).launches == 1  # diagonal: one elementwise update
    assert floors.singd(model, "dense").launches == 5  # and four grouped GEMM stages
    assert floors.dykaf(model).launches == floors.DYKAF_LAUNCHES


def test_a_floor_above_the_measured_time_is_the_floors_error():
    """A floor priced above what the step measured is flagged as an error of the floor with a
    note naming its largest term, never read as the member beating it."""
    floor = floors.Floor("kfac", 4 * 10**9, 10**6, launches=9).to_json(1e11, 1e10, 2e-6)
    # 40 ms of GEMMs + 0.1 ms of bytes + 0.018 ms of launches, against a step measured at 10 ms
    got = floors.check(10.0, floor)
    assert got["floor_error"] and got["x_floor"] == pytest.approx(10 / 40.118)
    assert got["note"].startswith("floor error") and "gemm_ms" in got["note"]
    fine = floors.check(50.0, floor)
    assert not fine["floor_error"] and "note" not in fine and fine["x_floor"] > 1
    # With the GEMMs measured alone at these shapes (8 ms) the floor is 8.118 ms: under 10 ms
    alone = floors.check(10.0, floor, gemms_alone_ms=8.0)
    assert alone["floor_ms_gemms_alone"] == pytest.approx(8.118)
    assert alone["x_floor_gemms_alone"] == pytest.approx(10 / 8.118)


def test_gemm_size_is_large_on_a_gpu():
    assert floors.gemm_size(torch.device("cpu")) == 512
    assert floors.gemm_size(torch.device("cuda")) == 4096  # no CUDA call: the size only


def test_launch_cost():
    cost = floors.launch_cost(torch.device("cpu"), calls=50, repeats=3)
    assert math.isfinite(cost) and 0 < cost < 1e-2  # one tiny op's dispatch: microseconds


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


def test_the_report_flags_a_floor_error_and_gives_no_verdict():
    """The speed bench's floor check and target row: a member floor priced above its fused step
    (here a GEMM rate 100x too low) gets `floor_error` and a note in the JSON, a target row whose
    measured column is that note with no verdict, and "floor err" in the step table's x-floor
    cell; a floor under the step gets the ordinary ratio and verdict."""
    from rich.console import Console
    from bench import report
    from bench.measure import QUICK, Result, Run
    run = Run(model="gpt", device=torch.device("cpu"), batch_size=2, steps=1, quick=True,
              budget=QUICK)
    for name, ms in (("kfac", 5.0), ("singd", 1.2)):
        run.results.append(Result("gpt", "step", "fused", ms, 0, 3, 0.0, 0.0, ms, optimizer=name))
    too_high = floors.Floor("kfac", 10**9, 0, 9).to_json(1e10, 1e10, 1e-6)  # 100 ms of GEMMs
    fine = floors.Floor("singd", 0, 10**7, 1).to_json(1e10, 1e10, 1e-6)  # 1.001 ms
    run.floor = {"sgemm_gflop_s": 10.0, "members": [too_high, fine]}
    floors.check_floors(run, "products-alone")
    assert too_high["check"]["floor_error"] and not fine["check"]["floor_error"]
    rows = {r["target"].split(" fused")[0]: r for r in report.targets(run)
            if "vs its floor" in r["target"]}
    assert rows["kfac"]["verdict"] == "n/a" and rows["kfac"]["measured"].startswith("floor error")
    assert rows["singd"]["verdict"] == "met" and rows["singd"]["measured"].endswith("the floor")
    console = Console(record=True, width=200)
    console.print(report._phase_table(run, "step", None, "", {}))
    text = console.export_text()
    rows = [line for line in text.splitlines() if "floor:" not in line]  # not the floors' own
    kfac_line = next(line for line in rows if "kfac" in line)
    singd_line = next(line for line in rows if "singd" in line)
    assert "floor err" in kfac_line and "floor err" not in singd_line
