"""`python -m bench.gpu_models` (the GPU check's table of every member on a ResNet-18 and a GPT-2)
in its tiny CPU mode: the table's structure, finite values, a member's failure kept as its row,
the missing-torchvision rows; and tools/gpu_check.sh's test groups (every test file in exactly
one group). No timing assertions: only the presence, shape and finiteness of the numbers."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_models  # noqa: E402

NUMBERS = ("eager_ms", "eager_curvature_ms", "eager_vs_adamw")
FIELDS = set(gpu_models._empty_row("m", "n"))


def tiny(tmp_path, *extra):
    out = tmp_path / "models.json"
    code = gpu_models.main(["--device", "cpu", "--tiny", "--out", str(out), *extra])
    table = json.loads(out.read_text())
    return code, table


def rows_of(table, model):
    return [r for r in table["rows"] if r["model"] == model]


def test_tiny_gpt2_every_member_finite(tmp_path):
    pytest.importorskip("transformers", reason="the integrations extra is not installed")
    # Curvature on every step and inverses on every other one: each member's curvature and
    # inverse paths in 4 iterations per run.
    code, table = tiny(tmp_path, "--models", "gpt2", "--steps", "3", "--warmup", "1",
                       "--curvature-every", "1", "--inverse-every", "2")
    cfg = table["config"]
    assert (cfg["curvature_every"], cfg["inverse_every"], cfg["steps"], cfg["warmup"]) == (1, 2, 3, 1)
    rows = rows_of(table, "gpt2")
    assert [r["member"] for r in rows] == list(gpu_models.MEMBERS)
    assert "GPT2LMHeadModel" in table["models"][0]["description"]
    for r in rows:
        assert FIELDS <= set(r), (r["member"], FIELDS - set(r))
        assert r["status"] == "ok", (r["member"], r["error"])
        assert r["timed_steps"] == 3
        for key in NUMBERS:
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (r["member"], key, r[key])
        assert r["finite_eager"] is True, (r["member"], r["not_finite"])
        # Captured: numbers, or the reason there are none.
        if r["captured_ms"] is None:
            assert isinstance(r["capture_error"], str) and r["capture_error"], r["member"]
        else:
            assert math.isfinite(r["captured_ms"]) and r["captured_ms"] > 0
            assert isinstance(r["captured_vs_eager_max_rel_error"], float), r
            assert r["finite_captured"] in (True, False)
        assert r["finite"] == all(f for f in (r["finite_eager"], r["finite_captured"]) if f is not None)
    adamw = rows[0]
    assert adamw["eager_vs_adamw"] == 1.0
    if table["config"]["capture"] is not None:
        # torch's own capturable AdamW through the stand-in: the two runs see the same batches
        # in the same order from the same weights, so they agree (to rounding: fused vs capturable).
        assert adamw["capture_error"] is None, adamw["capture_error"]
        assert adamw["captured_vs_eager_max_rel_error"] <= 1e-5
        assert adamw["finite_captured"] is True
    summary = table["summary"]
    assert summary["rows"] == len(rows) and summary["not_run"] == 0
    assert code == (1 if summary["problems"] else 0)
    assert summary["problems"] == sum(bool(r["problem"]) for r in rows)


def test_missing_torchvision_rows_say_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision raises ImportError
    code, table = tiny(tmp_path, "--models", "resnet18")
    assert table["models"] == [{"model": "resnet18", "description": None,
                                "error": table["models"][0]["error"]}]
    assert "torchvision is not installed" in table["models"][0]["error"]
    rows = rows_of(table, "resnet18")
    assert [r["member"] for r in rows] == list(gpu_models.MEMBERS)
    for r in rows:
        assert r["status"] == "not run" and "torchvision is not installed" in r["error"]
        assert r["eager_ms"] is None and r["problem"] is None
    assert table["summary"]["not_run"] == len(rows) and code == 0
    text = gpu_models.render(table)
    assert "torchvision is not installed" in text and "8 not run" in text


def test_a_failing_member_is_its_row(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the integrations extra is not installed")
    build = gpu_models.build_member

    def broken(name, model, cfg, captured):
        if name == "SINGD(dense)":
            raise RuntimeError("the planted failure")
        return build(name, model, cfg, captured)

    monkeypatch.setattr(gpu_models, "build_member", broken)
    monkeypatch.setattr(gpu_models, "_cpu_graph", lambda: None)  # eager only: capture needs CUDA
    code, table = tiny(tmp_path, "--models", "gpt2", "--members", "SINGD(dense),AdaFisher",
                       "--steps", "3", "--warmup", "1")
    rows = {r["member"]: r for r in table["rows"]}
    assert list(rows) == ["AdamW(fused)", "AdaFisher", "SINGD(dense)"]
    bad = rows["SINGD(dense)"]
    assert bad["status"] == "error" and "RuntimeError: the planted failure" in bad["error"]
    assert bad["problem"].startswith("error: ") and code == 1
    for name in ("AdamW(fused)", "AdaFisher"):
        r = rows[name]
        assert r["status"] == "ok" and r["finite"] is True and r["problem"] is None
        assert r["captured_ms"] is None and r["captured_via"] is None
        assert "capture needs CUDA" in r["capture_error"]
    assert math.isfinite(rows["AdaFisher"]["eager_vs_adamw"])
    printed = subprocess.run([sys.executable, "-m", "bench.gpu_models", "--print", str(tmp_path / "models.json")],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "the planted failure" in printed and "table: 3 rows, 2 ok, 1 problems, 0 not run" in printed


def test_problems_and_difference():
    a = [torch.tensor([1.0, 2.0]), torch.tensor([0.0])]
    assert gpu_models._max_relative_difference(a, a) == 0.0
    b = [torch.tensor([1.0, 2.2]), torch.tensor([0.0])]
    assert gpu_models._max_relative_difference(a, b) == pytest.approx(0.2 / 2.2)
    assert gpu_models._max_relative_difference([torch.tensor([0.5])], [torch.tensor([0.0])]) == math.inf
    assert math.isnan(gpu_models._max_relative_difference([torch.tensor([math.nan])], [torch.tensor([1.0])]))
    row = gpu_models._empty_row("gpt2", "DyKAF")
    row.update(status="ok", finite=True, captured_vs_eager_max_rel_error=0.2)
    assert "captured differs from eager: 0.2 > 0.001" == gpu_models.problems(row, 1e-3, True)
    row["captured_vs_eager_max_rel_error"] = math.nan
    assert gpu_models.problems(row, 1e-3, True).startswith("captured differs")
    row.update(captured_vs_eager_max_rel_error=None, capture_error="X: refused")
    assert gpu_models.problems(row, 1e-3, True) == "capture failed: X: refused"
    assert gpu_models.problems(row, 1e-3, False) is None  # no capture on this device
    row["member"] = "TwoLevelKFAC+SGD"  # may refuse, with its message
    assert gpu_models.problems(row, 1e-3, True) is None
    row.update(finite=False, not_finite=["eager: parameter w"])
    assert gpu_models.problems(row, 1e-3, True) == "not finite: eager: parameter w"


def test_gpu_check_groups_cover_every_test_file_once():
    listing = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--groups"],
                             capture_output=True, text=True, check=True).stdout.split("\n")
    pairs = [line.split() for line in listing if line.strip()]
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(f for _, f in pairs) == files  # each file once
    group = {f: g for g, f in pairs}
    assert set(group.values()) <= {"ops", "mixed", "others", "graphs", "members", "compile"}
    assert group["tests/test_adafisher_cuda_graphs.py"] == "graphs"
    for name, expected in (("test_cuda_graphs_members.py", "members"), ("test_dykaf_cuda_graphs.py", "graphs")):
        if (ROOT / "tests" / name).exists():
            assert group[f"tests/{name}"] == expected


def test_gpu_check_refuses_a_missing_published_file(tmp_path):
    # Refused before anything is built or written.
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(tmp_path / "logs"),
                           str(tmp_path / "AdaFisher.py")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "AdaFisher.py does not exist" in done.stderr
    assert not (tmp_path / "logs").exists()


def test_gpu_check_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_check.sh")]).returncode == 0
