"""`python -m bench distributed` runs on tiny models: 1 and 2 gloo ranks started by
torch.multiprocessing, a row per model and strategy (K-FAC) and per model (DyKAF's refresh
owners), each rank decomposing or refreshing a share."""
from __future__ import annotations

import json
import math

from bench.__main__ import main


def test_distributed_phase_runs_on_tiny_models(tmp_path, capsys):
    path = tmp_path / "kaisa.json"
    assert main(["distributed", "--tiny", "--steps", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    out = json.loads(path.read_text())
    summary = out["summary"]
    assert {(s["model"], s["strategy"]) for s in summary} == {
        (m, s) for m in ("gpt", "mlp") for s in ("comm_opt", "comm_opt_split", "mem_opt")}
    for s in summary:
        assert s["model"] in printed and s["strategy"] in printed
        assert sum(s["matrices"]) == s["factors"] and min(s["matrices"]) > 0  # shares, every factor once
        assert s["kfac_bytes_1rank"] == 0 < s["kfac_bytes"]  # one rank sends nothing
        assert math.isfinite(s["decompose_ratio"]) and s["decompose_ratio"] > 0
        assert len(s["decompose_per_rank_cpu_s"]) == 2
    assert {s["model"] for s in out["dykaf"]} == {"gpt", "mlp"}
    for s in out["dykaf"]:
        assert s["model"] in printed
        assert sum(s["matrices"]) == s["factors"] and min(s["matrices"]) > 0  # every basis once
        assert s["bytes_1rank"] == 0 < s["bytes"]
        assert math.isfinite(s["refresh_ratio"]) and s["refresh_ratio"] > 0
        assert len(s["refresh_per_rank_cpu_s"]) == 2
    ones = [r for r in out["rows"] if r["world"] == 1]
    assert {r["member"] for r in ones} == {"kfac", "dykaf"}
    assert all(r["matrices"] == r["factors"] for r in ones)


def test_cost_model_predictions():
    from bench.kaisa_model import gpt2_small_factors, predict, received, resnet50_factors
    sizes = resnet50_factors()
    assert len(sizes) == 54 and sizes["fc"] == (1, 2049, 1000)  # 53 convolutions and the fc
    one = predict(sizes, 1, 1.0, 1.0)
    assert one["decompose_s"] == one["decompose_1rank_s"] and one["second_bytes"] == one["grad_bytes"] == 0
    for world in (8, 64):
        comm, mem = predict(sizes, world, 1.0, 1.0), predict(sizes, world, 1.0 / world, 1.0)
        # the largest layer (a 3x3 convolution of width 512: 4608^3 + 512^3) bounds the split;
        # MEM_OPT moves gradients, not decompositions
        assert comm["decompose_s"] == mem["decompose_s"] == 4608 ** 3 + 512 ** 3
        assert comm["grad_bytes"] == 0 < comm["second_bytes"] and mem["second_bytes"] == 0 < mem["grad_bytes"]
        assert mem["memory_bytes"] < comm["memory_bytes"] == comm["memory_1rank_bytes"]
    assert received([5, 5, 5, 5]) == 15 and received([10, 1, 1, 0]) == 12 - 0
    assert len(gpt2_small_factors()) == 48


def test_predict_prints_every_model_and_world(capsys):
    assert main(["distributed", "--predict"]) == 0
    out = capsys.readouterr().out
    for model in ("resnet50", "gpt2-small"):
        for world in (8, 64, 512):
            assert any(line.startswith(model) and f" {world} " in line for line in out.splitlines())


def test_twolevel_phase_runs_on_tiny_models(tmp_path, capsys):
    path = tmp_path / "twolevel.json"
    assert main(["distributed", "--member", "twolevel", "--tiny", "--steps", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    out = json.loads(path.read_text())["twolevel"]
    summary = {(s["model"], s["strategy"]): s for s in out["summary"]}
    assert set(summary) == {(m, s) for m in ("gpt", "mlp") for s in ("owners", "every_rank")}
    for (model, strategy), s in summary.items():
        assert model in printed and strategy in printed
        assert math.isfinite(s["decompose_ratio"]) and s["decompose_ratio"] > 0
        # the statistics' all_reduce runs at every world size; the owners' exchange adds to it
        if strategy == "owners":  # shares: every factor and the coarse matrix once
            assert sum(s["matrices"]) == s["total_matrices"] and min(s["matrices"]) > 0
            assert s["bytes"] > s["bytes_1rank"] > 0
        else:
            assert s["matrices"] == [s["total_matrices"]] * 2
            assert s["bytes"] == s["bytes_1rank"] > 0
    assert all(r["matrices"] == r["total_matrices"] for r in out["rows"] if r["world"] == 1)
