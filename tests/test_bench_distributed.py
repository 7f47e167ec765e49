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


def test_fsdp_bytes_owner_scheme_against_the_all_gather(tmp_path, capsys):
    """Under FSDP2 the owner scheme receives what the all-gather receives at two ranks (both
    (W - 1) / W of the gradients) and less at four (about 2 / W of it when the owners balance),
    and every rank holds fewer whole gradients at once."""
    path = tmp_path / "fsdp_bytes.json"
    assert main(["fsdp-bytes", "--worlds", "2,4", "--steps", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert "owner recv" in capsys.readouterr().out
    members = {"kfac-comm_opt", "kfac-mem_opt", "singd-dense"}
    for world in (2, 4):
        at = [r for r in rows if r["world"] == world]
        assert {(r["model"], r["member"], r["rank"]) for r in at} == {
            (m, member, rank) for m in ("gpt", "mlp") for member in members for rank in range(world)}
        for r in at:  # (the MLP's three layers leave a rank of four without a layer to own)
            assert 0 <= r["held_owner"] < r["held_all_gather"], r
            if world == 2:
                assert r["owner"] == r["all_gather"] > 0, r
        for m in ("gpt", "mlp"):
            for member in members:
                assert sum(r["held_owner"] for r in at if (r["model"], r["member"]) == (m, member)) > 0
    for member in members:  # the busiest rank of the GPT at W=4 receives less than the all-gather
        gpt4 = [r for r in rows if r["world"] == 4 and r["model"] == "gpt" and r["member"] == member]
        assert max(r["owner"] for r in gpt4) < min(r["all_gather"] for r in gpt4), gpt4
