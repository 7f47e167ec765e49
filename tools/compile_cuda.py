"""Compile every csrc/cuda/*.cu for sm_90 with nvcc, without a GPU, against the installed torch's
headers (a CPU wheel is enough): the CUDA kernels cannot run on the development machines, but they
must at least compile. Exits non-zero if any file fails.

    python tools/compile_cuda.py [--jobs N] [--std c++20] [files...]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def nvcc_command(nvcc: str, source: Path, output: Path, std: str) -> list[str]:
    import torch.utils.cpp_extension as cpp

    include = [arg for path in cpp.include_paths() for arg in ("-isystem", path)]
    return [
        nvcc, "-c", f"-std={std}",
        # The CPU wheel has no generated cuda_cmake_macros.h.
        "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DTORCH_API_INCLUDE_EXTENSION_H", "-DCAFIN_WITH_CUDA",
        *include, "-isystem", _python_include(), "-I", str(ROOT / "csrc"),
        "--expt-relaxed-constexpr", "-gencode=arch=compute_90,code=sm_90",
        "--compiler-options=-fPIC", "-o", str(output), str(source),
    ]


def _python_include() -> str:
    import sysconfig

    return sysconfig.get_paths()["include"]


def compile_one(nvcc: str, source: Path, outdir: Path, std: str) -> tuple[Path, int, str, float]:
    start = time.monotonic()
    command = nvcc_command(nvcc, source, outdir / (source.stem + ".o"), std)
    proc = subprocess.run(command, capture_output=True, text=True)
    return source, proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="default: every csrc/cuda/*.cu")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--std", default="c++20", help="torch 2.13 builds extensions with c++20")
    args = parser.parse_args(argv)

    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if "CUDA_HOME" in os.environ else None)
    if nvcc is None or not os.path.exists(nvcc):
        print("compile_cuda: nvcc not found (PATH, CUDA_HOME)", file=sys.stderr)
        return 2
    sources = args.files or sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    if not sources:
        print("compile_cuda: no .cu files", file=sys.stderr)
        return 2
    failed = 0
    with tempfile.TemporaryDirectory(prefix="cafin_nvcc_") as outdir, \
            ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        jobs = [pool.submit(compile_one, nvcc, Path(s), Path(outdir), args.std) for s in sources]
        for job in jobs:
            source, code, log, seconds = job.result()
            status = "ok" if code == 0 else f"FAILED (exit {code})"
            print(f"{source.relative_to(ROOT) if source.is_absolute() else source}: {status}, {seconds:.0f} s")
            if code != 0 or log.strip():
                print(log.rstrip())
            failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
