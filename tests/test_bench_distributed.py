"""`python -m bench distributed` runs on tiny models: 1 and 2 gloo ranks started by
torch.multiprocessing, a row per model and strategy, each rank decomposing a share."""
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
        assert len(s["decompose_per_rank_s"]) == 2
    ones = [r for r in out["rows"] if r["world"] == 1]
    assert all(r["matrices"] == r["factors"] for r in ones)
