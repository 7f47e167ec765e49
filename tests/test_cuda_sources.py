"""The CUDA sources compile with nvcc, GPU or not, with the real build's flags (tools/compile_cuda.py).

CI has nvcc and no GPU: this is where a .cu file that the real `pip install` would reject fails CI.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "compile_cuda.py"
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc not found: the CUDA sources are not compiled")

# Adds two __half with the operator torch's nvcc flags remove (-D__CUDA_NO_HALF_OPERATORS__).
HALF_OPERATOR = "#include <cuda_fp16.h>\n__global__ void add(__half* a) { a[0] = a[0] + a[1]; }\n"


def run_tool(*args, timeout=1800):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_kernel_sources_compile_with_nvcc():
    """Every csrc/cuda/*.cu compiles (sm_90) with the command line of the real build."""
    proc = run_tool()
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    for source in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
        assert f"csrc/cuda/{source.name}: ok" in proc.stdout, proc.stdout[-6000:]


def test_flags_are_the_real_builds():
    """The command holds torch's own nvcc flags and setup.py's, as BuildExtension composes them."""
    proc = run_tool("--print-flags", timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    command = json.loads(proc.stdout)
    for flag in cpp.COMMON_NVCC_FLAGS + ["-O3", "-DCAFIN_WITH_CUDA", "-DTORCH_API_INCLUDE_EXTENSION_H",
                                         "-DTORCH_EXTENSION_NAME=_C", "-gencode=arch=compute_90,code=sm_90",
                                         f"-I{ROOT / 'csrc'}"]:
        assert flag in command, (flag, command)
    stds = [f for f in command if f.startswith("-std=")]
    assert len(stds) == 1 and stds[0] in ("-std=c++17", "-std=c++20"), stds


def test_a_source_the_build_rejects_fails_the_check(tmp_path):
    """Control: a kernel using an operator that torch's flags switch off compiles with bare nvcc
    but fails this check, so the check cannot pass where the build fails."""
    source = tmp_path / "half_operator.cu"
    source.write_text(HALF_OPERATOR)
    bare = subprocess.run(["nvcc", "-c", str(source), "-o", str(tmp_path / "bare.o")],
                          capture_output=True, text=True, timeout=300)
    assert bare.returncode == 0, bare.stderr
    proc = run_tool(source, timeout=300)
    assert proc.returncode == 1, proc.stdout
    assert "FAILED" in proc.stdout and 'no operator "+"' in proc.stdout, proc.stdout[-3000:]


def test_collection_refuses_a_cuda_parameter_without_the_cuda_marker():
    """tests/conftest.py stops a run whose tests take a "cuda" parameter without the `cuda`
    marker (tools/gpu_check.sh would never select them), and lets a marked one through."""
    import types

    import conftest

    def item(nodeid, value, marked):
        return types.SimpleNamespace(nodeid=nodeid, callspec=types.SimpleNamespace(params={"device": value}),
                                     get_closest_marker=lambda name: object() if marked else None)

    ok = [item("t::a[cpu]", "cpu", False), item("t::a[cuda]", "cuda", True),
          item("t::b[dev]", torch.device("cuda"), True)]
    conftest.pytest_collection_modifyitems(None, ok)
    for bad in ("cuda", torch.device("cuda")):
        with pytest.raises(pytest.UsageError, match=r"t::c\[cuda\]"):
            conftest.pytest_collection_modifyitems(None, ok + [item("t::c[cuda]", bad, False)])
