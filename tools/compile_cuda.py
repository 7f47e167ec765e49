"""Compile every csrc/cuda/*.cu with nvcc, without a GPU, with exactly the command line the real
build (`pip install -e .`, i.e. setup.py's CUDAExtension under torch's BuildExtension) gives nvcc:
the same torch nvcc flags (-D__CUDA_NO_HALF_OPERATORS__ and friends), setup.py's own flags (-O3,
-DCAFIN_WITH_CUDA), the same -std, defines and include directories. Exits non-zero if a file fails.

    python tools/compile_cuda.py [--jobs N] [--print-flags] [files...]

How: setup.py is loaded (FORCE_CUDA=1) and BuildExtension runs up to the point where it hands the
composed nvcc flags to ninja; the flags are taken there and nothing is built. So a flag torch or
setup.py adds reaches this check by construction. The only departures, each forced by the machine:
- TORCH_CUDA_ARCH_LIST defaults to 9.0 (the H200 of tools/gpu_check.sh) when unset: without a GPU
  torch cannot pick the architectures;
- a CPU wheel of torch has no CUDA toolkit configured (CUDA_HOME) and lacks the generated
  c10/cuda/impl/cuda_cmake_macros.h: the toolkit is found as torch would find it (CUDA_HOME,
  CUDA_PATH, nvcc on PATH, /usr/local/cuda), and -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE is added only
  when that header is missing;
- nvcc's dependency-file flags (ninja bookkeeping) are left out.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARCH = "9.0"


class _Composed(Exception):
    """Raised from inside BuildExtension once the nvcc flags are composed: nothing gets built."""

    def __init__(self, pre: list[str], post: list[str]):
        super().__init__("nvcc flags composed")
        self.pre, self.post = pre, post


def find_cuda_home() -> str | None:
    """The CUDA toolkit torch builds with; on a CPU wheel (no CUDA_HOME in torch), the same search
    torch makes, resolving an nvcc that is a wrapper script outside its toolkit."""
    import torch.utils.cpp_extension as cpp

    candidates = [cpp.CUDA_HOME, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and \
                os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


def build_flags(cuda_home: str) -> tuple[list[str], list[str]]:
    """(flags before `-c SOURCE -o OBJECT`, flags after it), as BuildExtension writes them into
    its ninja file for setup.py's extension, split the way the shell that runs ninja splits them."""
    import setuptools  # noqa: F401  (before distutils: setuptools' own copy)
    import torch.utils.cpp_extension as cpp
    from distutils.core import run_setup

    saved = {k: os.environ.get(k) for k in ("FORCE_CUDA", "TORCH_CUDA_ARCH_LIST")}
    saved_home, saved_compose = cpp.CUDA_HOME, cpp._write_ninja_file_and_compile_objects
    saved_cwd, saved_argv = os.getcwd(), sys.argv[:]

    def compose(*args, **kwargs):
        if args or "cuda_post_cflags" not in kwargs:
            raise RuntimeError("compile_cuda: this torch's BuildExtension passes its nvcc flags in a way "
                               "this tool does not know; update build_flags()")
        if not kwargs.get("with_cuda"):
            raise RuntimeError("compile_cuda: setup.py gave BuildExtension no CUDA sources")
        split = lambda flags: shlex.split(" ".join(flags or []))  # noqa: E731
        raise _Composed(split(kwargs["cuda_cflags"]), split(kwargs["cuda_post_cflags"]))

    os.environ["FORCE_CUDA"] = "1"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH)
    cpp.CUDA_HOME = cuda_home
    cpp._write_ninja_file_and_compile_objects = compose
    log = io.StringIO()
    try:
        os.chdir(ROOT)
        with tempfile.TemporaryDirectory(prefix="cafin_flags_") as tmp, \
                contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            dist = run_setup(str(ROOT / "setup.py"), script_args=["build_ext"], stop_after="init")
            cmd = dist.get_command_obj("build_ext")
            cmd.build_temp = cmd.build_lib = tmp
            cmd.inplace, cmd.force = False, True
            cmd.ensure_finalized()
            cmd.use_ninja = True  # the flags are composed before ninja itself would be needed
            try:
                cmd.run()
            except _Composed as composed:
                return composed.pre, composed.post
    finally:
        os.chdir(saved_cwd)
        sys.argv[:] = saved_argv
        cpp.CUDA_HOME, cpp._write_ninja_file_and_compile_objects = saved_home, saved_compose
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    raise RuntimeError("compile_cuda: BuildExtension never composed nvcc flags\n" + log.getvalue())


def machine_flags() -> list[str]:
    """Flags this machine needs and the real build on a CUDA wheel does not (see the docstring)."""
    import torch

    macros = Path(torch.__file__).parent / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    return [] if macros.exists() else ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]


def nvcc_command(nvcc: str, pre: list[str], post: list[str], source: Path, output: Path) -> list[str]:
    return [nvcc, *pre, *machine_flags(), "-c", str(source), "-o", str(output), *post]


def compile_one(command: list[str], source: Path) -> tuple[Path, int, str, float]:
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True)
    return source, proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="default: every csrc/cuda/*.cu")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--print-flags", action="store_true",
                        help="print the nvcc command of one source as JSON and compile nothing")
    args = parser.parse_args(argv)

    cuda_home = find_cuda_home()
    if cuda_home is None:
        print("compile_cuda: no CUDA toolkit found (CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda)",
              file=sys.stderr)
        return 2
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    sources = [s.resolve() for s in args.files] or sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    if not sources:
        print("compile_cuda: no .cu files", file=sys.stderr)
        return 2
    pre, post = build_flags(cuda_home)
    if args.print_flags:
        print(json.dumps(nvcc_command(nvcc, pre, post, sources[0], Path("OUT.o"))))
        return 0
    print("nvcc " + " ".join(shlex.quote(a) for a in [*pre, *machine_flags(), "-c", "SOURCE", "-o", "OUT", *post]))
    failed = 0
    with tempfile.TemporaryDirectory(prefix="cafin_nvcc_") as outdir, \
            ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        jobs = [pool.submit(compile_one, nvcc_command(nvcc, pre, post, s, Path(outdir) / f"{i}_{s.stem}.o"), s)
                for i, s in enumerate(sources)]
        for job in jobs:
            source, code, log, seconds = job.result()
            status = "ok" if code == 0 else f"FAILED (exit {code})"
            shown = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
            print(f"{shown}: {status}, {seconds:.0f} s")
            if code != 0 or log.strip():
                print(log.rstrip())
            failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
