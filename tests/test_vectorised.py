"""The CPU update loops vectorise: the run loop of the row-column skeleton (csrc/cpu/row_column.h),
instantiated with AdaFisher's and SINGD's per-element maths, is compiled with the build's flags and
GCC's vectoriser report, and the report must say the loop was vectorised.

A scalar loop here costs AdaFisher's step about 2.5x (docs/architecture.md, "Vectorised CPU
loops"); the control case (a select feeding the division) shows the report does tell the two apart.
"""
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
SKELETON = CSRC / "cpu" / "row_column.h"
COMPILER = shutil.which("g++")

SOURCE = """
#include "adafisher_math.h"
#include "singd_math.h"
#include "cpu/row_column.h"
using Op = {op};
void run(Op::scalar_t* theta, const Op::scalar_t* grad, Op::state_t* state, const Op::opmath_t* along,
         Op::opmath_t fixed, int64_t n, Op::Coeffs coeffs) {{
  cafin::row_column_run<Op, cafin::RowColumnFactors::{factors}, {rows_along}>(theta, grad, state, along,
                                                                            fixed, n, coeffs);
}}
"""

ADAFISHER = "cafin::AdaFisherElement<{t}, {t}, {decoupled}, {scaled}>"
SINGD = "cafin::SingdDiagElement<{t}, {t}, {momentum}>"

# (id, Op, factors, rows along): every combination the optimizers run, in float32, and float64.
CASES = [
    *[(f"adafisher-{'w' if d else 'l2'}-{'scaled' if s else 'unscaled'}",
       ADAFISHER.format(t="float", decoupled=str(d).lower(), scaled=str(s).lower()), "kFactors", "false")
      for d in (False, True) for s in (False, True)],
    ("adafisher-one-per-row", ADAFISHER.format(t="float", decoupled="false", scaled="false"), "kFactors", "true"),
    ("adafisher-no-factors", ADAFISHER.format(t="float", decoupled="true", scaled="false"), "kNone", "false"),
    ("adafisher-float64", ADAFISHER.format(t="double", decoupled="true", scaled="false"), "kFactors", "false"),
    ("singd-momentum", SINGD.format(t="float", momentum="true"), "kFactors", "false"),
    ("singd-plain", SINGD.format(t="float", momentum="false"), "kFactors", "false"),
    ("singd-no-factors", SINGD.format(t="float", momentum="true"), "kNone", "false"),
]
# The marker test per element: GCC (which assumes FP operations may trap) will not turn the
# select feeding a division into a vector blend, so this loop stays scalar.
CONTROL = ("adafisher-guarded", ADAFISHER.format(t="float", decoupled="false", scaled="false"), "kGuarded", "false")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="g++ not found: the report is GCC's")


def run_loop_line() -> int:
    """The line of row_column_run's element loop in the skeleton."""
    lines = SKELETON.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "void row_column_run(" in line)
    return next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("for (")) + 1


def report(tmp_path: Path, case) -> str:
    """GCC's vectoriser messages about the run loop, for one instantiation."""
    name, op, factors, rows_along = case
    source = tmp_path / f"{name}.cpp"
    source.write_text(SOURCE.format(op=op, factors=factors, rows_along=rows_along))
    # The build's flags (setup.py); the x86-64 clones include the AVX2 one (x86-64-v3).
    flags = ["-O3", "-fno-math-errno", "-std=c++20", "-fopt-info-vec-all"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=x86-64-v3")
    includes = [f"-I{p}" for p in [str(CSRC), *cpp.include_paths()]]
    proc = subprocess.run([COMPILER, *flags, *includes, "-c", str(source), "-o", str(tmp_path / f"{name}.o")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    where = f"row_column.h:{run_loop_line()}:"
    return "\n".join(line for line in proc.stderr.splitlines() if where in line)


def test_run_loops_are_vectorised(tmp_path):
    """Every instantiation's run loop is reported vectorised with no scalar version left for
    control flow; the guarded control keeps one (GCC vectorises only its copy for a marked row)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda case: report(tmp_path, case), CASES + [CONTROL]))
    for (name, *_), text in zip(CASES, reports):
        assert "optimized: loop vectorized" in text, f"{name}:\n{text}"
        assert "control flow in loop" not in text, f"{name}:\n{text}"
    control = reports[-1]
    assert "control flow in loop" in control, control
