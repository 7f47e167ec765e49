"""`python -m bench --quick` runs end to end and writes well-formed JSON. No timing assertions:
the numbers depend on the machine; only their presence, shape and finiteness are checked."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cafin  # noqa: F401  (registers the ops, so the kernel check below sees them)

ROOT = Path(__file__).resolve().parents[1]


def _fused_on_cpu() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("cafin::adafisher_step_", "CPU")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    # A fresh process: the extension is loaded once per process, as a user's run loads it.
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--model", "mlp",
                           "--device", "cpu", "--json", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(path.read_text()), proc.stdout


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_environment_and_floor(quick_run):
    data, _ = quick_run
    env = data["environment"]
    assert env["torch"] == torch.__version__
    assert env["device"] == "cpu" and isinstance(env["device_name"], str)
    assert isinstance(env["threads"], int) and env["threads"] >= 1
    assert isinstance(env["cuda_kernels_built"], bool)
    floor = data["floor"]
    for key in ("copy_bandwidth_gb_s", "bytes_per_step", "step_floor_ms", "statistics_floor_ms"):
        assert _finite(floor[key]) and floor[key] > 0, key
    assert floor["bytes_per_step"] == 20 * floor["parameters"]


def test_results(quick_run):
    data, _ = quick_run
    results = data["results"]
    assert results, "no measurement"
    for r in results:
        assert set(r) >= {"model", "phase", "variant", "median_ms", "allocated_bytes"}
        assert r["model"] == "mlp"
        assert r["phase"] in ("step", "statistics")
        assert _finite(r["median_ms"]) and r["median_ms"] > 0
        assert isinstance(r["allocated_bytes"], int) and r["allocated_bytes"] >= 0
    measured = {(r["phase"], r["variant"]) for r in results}
    expected = {("step", "reference"), ("step", "adamw-foreach"), ("statistics", "reference")}
    if _fused_on_cpu():
        expected |= {("step", "fused"), ("step", "fused-compiled"), ("statistics", "fused")}
    assert expected <= measured, expected - measured
    assert not [s for s in data["skipped"] if s["error"]], data["skipped"]
    assert len(measured) == len(results), "a variant was measured twice"


def test_agreement(quick_run):
    data, _ = quick_run
    if not _fused_on_cpu():
        assert data["agreement"] == []
        return
    assert [a["model"] for a in data["agreement"]] == ["mlp"]
    assert _finite(data["agreement"][0]["max_rel_diff"])


def test_console_report(quick_run):
    data, stdout = quick_run
    assert "targets" in stdout and "step: mlp" in stdout
    assert {t["verdict"] for t in data["targets"]} <= {"met", "missed", "n/a"}
