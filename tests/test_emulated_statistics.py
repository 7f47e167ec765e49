"""The CUDA code of AdaFisher's statistics, run on the CPU (tools/cuda_emulator): the kernels and
host code of csrc/cuda/adafisher_statistics.cu as they are, over every read path of the channel
statistics and several Conv2d inputs, against the reference, with kept workspaces, blocks in any
order and the step gate. And the same
cases find a bug planted in that code. Each run is a subprocess: the emulated extension is built
there, and a barrier that hangs ends that process, not the test session."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "cuda_emulator" / "statistics.py"
KERNELS = {"column_stats_kernel", "run_stats_kernel", "walk_stats_kernel", "batch_squares_kernel",
           "patch_sums_kernel"}


def run(directory: pathlib.Path, *extra: str) -> tuple[int, list[dict], str]:
    done = subprocess.run([sys.executable, str(SCRIPT), str(directory), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, results, done.stderr[-3000:]


def test_the_cuda_statistics_code_matches_the_reference(tmp_path):
    code, results, err = run(tmp_path / "build")
    failed = [r for r in results if not r["ok"]]
    assert code == 0 and not failed, (code, failed, err)
    assert len(results) >= 20
    assert set().union(*(r["kernels"] for r in results)) == KERNELS


def test_the_cases_find_a_planted_bug(tmp_path):
    """The last arrival no longer sets its counter back to zero: the next call on the kept
    workspace miscounts, which the cases see."""
    code, results, err = run(tmp_path / "planted", "--plant", "*counter = 0u;=>")
    assert code == 1, (code, err)
    assert any("counters" in why for r in results for why in r["why"])
