"""Every C++ and CUDA source builds on the oldest and on the newest supported torch.

A user builds cafin against whatever supported torch they have, and the releases' headers differ in
what they include transitively (torch 2.13's headers bring at::AutoDispatchBelowADInplaceOrView along,
2.11's do not) and in the C++ standard they build extensions with (2.11: C++17, 2.15: C++20). So
every source is compiled against the headers of the first and the last supported release, with that
release's own flags (tools/compile_cuda.py --all --torch VERSION): C++ sources with -fsyntax-only,
CUDA sources with nvcc to sm_90. The headers come from the release's CUDA wheel, downloaded once
(`pip download --no-deps`) into a cache and cut down to torch/include and the file that composes the
flags; nothing of it is installed. Without the network the download fails and so do these tests:
they never skip for it, only for a missing nvcc.
"""
import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "compile_cuda.py"
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc not found: the sources are not compiled against other torches")


def torch_range():
    """setup.py's TORCH_RANGE, ((major, minor) first supported, (major, minor) first unsupported),
    read without running setup.py (running it builds)."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["TORCH_RANGE"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no TORCH_RANGE")


(LO, HI) = torch_range()
OLDEST = f"{LO[0]}.{LO[1]}.0"
NEWEST = f"{HI[0]}.{HI[1] - 1}.0"
# The C++ standard each release's BuildExtension compiles extensions with.
STANDARD = {"2.11.0": "c++17", "2.15.0": "c++20"}

# Uses a name that the old ops.cpp used with these includes: torch 2.15's headers declare it through
# them, torch 2.11's do not.
TRANSITIVE = """#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>
void below() { at::AutoDispatchBelowADInplaceOrView guard; }
"""


def run_tool(*args, timeout=2400):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def sources():
    return sorted([*(ROOT / "csrc").glob("*.cpp"), *(ROOT / "csrc" / "cpu").glob("*.cpp"),
                   *(ROOT / "csrc" / "cuda").glob("*.cu")])


@pytest.fixture(scope="module")
def headers():
    """version -> the cached root of that release's headers, fetched once for the module; a failed
    download fails the test with pip's message."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        import compile_cuda
    finally:
        sys.path.remove(str(TOOL.parent))
    roots = {}

    def get(version):
        if version not in roots:
            try:
                roots[version] = compile_cuda.fetch_torch(version, log=lambda line: print(line))
            except RuntimeError as error:
                pytest.fail(f"the headers of torch {version} could not be fetched (network?):\n{error}")
        return roots[version]
    return get


def test_range_is_the_one_everywhere():
    """pyproject (build and run requirements) and the README state setup.py's range."""
    spec = f"torch>={LO[0]}.{LO[1]},<{HI[0]}.{HI[1]}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'requires = ["setuptools>=64", "{spec}"]' in pyproject
    assert f'dependencies = ["{spec}"]' in pyproject
    readme = (ROOT / "README.md").read_text()
    assert f"supported: torch ≥ {LO[0]}.{LO[1]}, < {HI[0]}.{HI[1]}" in readme
    assert f"torch {LO[0]}.{LO[1]}–{HI[0]}.{HI[1] - 1}" in readme
    for version in (OLDEST, NEWEST):
        assert version in STANDARD, f"say which C++ standard torch {version} builds extensions with"


@pytest.mark.parametrize("version", ["2.10.2", f"{HI[0]}.{HI[1]}.0+cu130", "3.0.0", f"{HI[0]}.{HI[1]}.0a0+git1"])
def test_unsupported_torch_is_refused_at_build_time(version):
    """setup.py, run as pip runs it, refuses a torch outside the range before compiling anything,
    naming the range and the version found."""
    code = (f"import torch; torch.__version__ = {version!r}; import sys; sys.argv = ['setup.py', 'build_ext']; "
            f"import runpy; runpy.run_path('setup.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"cafin supports torch >= {LO[0]}.{LO[1]}, < {HI[0]}.{HI[1]}" in proc.stderr, proc.stderr[-3000:]
    assert f"found torch {version}" in proc.stderr, proc.stderr[-3000:]
    assert "building" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("version", [OLDEST, "2.13.0+cpu", f"{HI[0]}.{HI[1] - 1}.0+cu132"])
def test_supported_torch_passes_the_check(version):
    """The same check lets every supported release through (setup.py then asks for a command)."""
    code = (f"import torch; torch.__version__ = {version!r}; import sys; sys.argv = ['setup.py', '--name']; "
            f"import runpy; runpy.run_path('setup.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cafin" in proc.stdout.splitlines(), proc.stdout[-3000:]


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_flags_are_the_releases_own(headers, version):
    """The commands compile against the fetched headers (never the installed torch's), with the C++
    standard of that release and the real build's own flags, for a C++ and a CUDA source."""
    import torch

    root = headers(version)
    installed = str(Path(torch.__file__).parent / "include")
    for source in (ROOT / "csrc" / "ops.cpp", ROOT / "csrc" / "cuda" / "kfac.cu"):
        proc = run_tool("--torch-root", root, "--print-flags", source, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        command = json.loads(proc.stdout)
        includes = [f for f in command if f.startswith("-I")]
        assert f"-I{root / 'torch' / 'include'}" in includes, command
        assert not any(f.startswith(f"-I{installed}") for f in includes), command
        assert [f for f in command if f.startswith("-std=")] == [f"-std={STANDARD[version]}"], command
        for flag in ("-O3", "-DCAFIN_WITH_CUDA", "-DTORCH_EXTENSION_NAME=_C", f"-I{ROOT / 'csrc'}"):
            assert flag in command, (flag, command)
        if source.suffix == ".cu":
            assert "-gencode=arch=compute_90,code=sm_90" in command and "-D__CUDA_NO_HALF_OPERATORS__" in command
        else:
            assert "-fsyntax-only" in command and "-fopenmp" in command


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_source_compiles(headers, version):
    """Every csrc/*.cpp, csrc/cpu/*.cpp and csrc/cuda/*.cu compiles against torch VERSION's headers;
    a failure shows the compiler's message."""
    root = headers(version)
    proc = run_tool("--all", "--torch-root", root, "--jobs", 2)
    print(proc.stdout[-2000:])
    assert proc.returncode == 0, f"torch {version}:\n{proc.stdout[-8000:]}{proc.stderr[-3000:]}"
    for source in sources():
        assert f"{source.relative_to(ROOT)}: ok" in proc.stdout, proc.stdout[-8000:]


def test_a_name_only_included_transitively_fails_on_the_oldest(headers, tmp_path):
    """Control: a source that names at::AutoDispatchBelowADInplaceOrView without including
    ATen/core/LegacyTypeDispatch.h, as ops.cpp once did, compiles against the newest headers and
    fails against the oldest with the compiler's message: the check catches what broke the 2.11 build."""
    source = tmp_path / "transitive.cpp"
    source.write_text(TRANSITIVE)
    newest = run_tool("--torch-root", headers(NEWEST), source, timeout=600)
    assert newest.returncode == 0, newest.stdout[-4000:]
    oldest = run_tool("--torch-root", headers(OLDEST), source, timeout=600)
    assert oldest.returncode == 1, oldest.stdout[-4000:]
    assert "transitive.cpp: FAILED" in oldest.stdout
    assert re.search(r"AutoDispatchBelowADInplaceOrView.*is not a member of .at.", oldest.stdout), \
        oldest.stdout[-4000:]
