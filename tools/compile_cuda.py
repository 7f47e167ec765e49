"""Compile cafin's C++ and CUDA sources without a GPU, with exactly the command lines the real build
(`pip install -e .`, i.e. setup.py's CUDAExtension under torch's BuildExtension) gives the compilers:
torch's own flags (-D__CUDA_NO_HALF_OPERATORS__ and friends, -std, -D_GLIBCXX_USE_CXX11_ABI),
setup.py's flags (-O3, -DCAFIN_WITH_CUDA), the same defines and include directories. Exits non-zero
if a file fails.

    python tools/compile_cuda.py [--all] [--torch VERSION | --torch-root DIR] [--jobs N]
                                 [--print-flags] [files...]

By default every csrc/cuda/*.cu is compiled with nvcc; --all adds every C++ source of the extension
(csrc/*.cpp, csrc/cpu/*.cpp). Given files are compiled by their suffix (.cu with nvcc, else C++).

Which torch: the installed one by default. --torch VERSION compiles against the headers of another
release instead: its CUDA wheel is fetched once with `pip download --no-deps torch==VERSION`, and only
its torch/include/ and the torch/utils/cpp_extension.py that composes its flags are kept, in a cache
(CAFIN_TORCH_CACHE, else $XDG_CACHE_HOME/cafin/torch, else ~/.cache/cafin/torch); nothing of it is
installed or imported except that file. --torch-root DIR names such a tree directly (DIR/torch/include,
DIR/torch/utils/cpp_extension.py). A release's flags come from its own cpp_extension.py: torch 2.11
compiles C++17 and 2.13 on C++20, and a source must build with the flags of each.

How: setup.py is loaded (FORCE_CUDA=1) and BuildExtension runs up to the point where it hands the
composed flags to ninja; the flags are taken there and nothing is built. So a flag torch or
setup.py adds reaches this check by construction. The only departures, each forced by the machine:
- TORCH_CUDA_ARCH_LIST defaults to 9.0 (the H200 of tools/gpu_check.sh) when unset: without a GPU
  torch cannot pick the architectures;
- a CPU wheel of torch has no CUDA toolkit configured (CUDA_HOME) and lacks the generated
  c10/cuda/impl/cuda_cmake_macros.h: the toolkit is found as torch would find it (CUDA_HOME,
  CUDA_PATH, nvcc on PATH, /usr/local/cuda), and -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE is added only
  when that header is missing from the headers compiled against;
- the compilers' dependency-file flags (ninja bookkeeping) are left out;
- a C++ source is checked with -fsyntax-only (--cpp-objects compiles it to an object): the C++ front
  end resolves every name and instantiates every template a file uses, which is what differs
  between torch releases, and skips the -O3 code generation, which does not depend on torch's
  headers and would make the check several times slower. A CUDA source is compiled to sm_90 code,
  since nvcc's device pass only runs when it generates code.
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
import types
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARCH = "9.0"


@dataclass
class Flags:
    """The flags BuildExtension composes for setup.py's extension, split the way the shell that runs
    ninja splits them: `cxx CFLAGS -c SOURCE -o OBJECT POST` and `nvcc CUDA_CFLAGS -c ... CUDA_POST`."""
    cxx: str
    cflags: list[str]
    post_cflags: list[str]
    cuda_cflags: list[str]
    cuda_post_cflags: list[str]
    include: Path  # the torch include directory these flags compile against


class _Composed(Exception):
    """Raised from inside BuildExtension once the flags are composed: nothing gets built."""

    def __init__(self, flags: Flags):
        super().__init__("compiler flags composed")
        self.flags = flags


def cache_dir() -> Path:
    if os.environ.get("CAFIN_TORCH_CACHE"):
        return Path(os.environ["CAFIN_TORCH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cafin" / "torch"


def _kept(name: str) -> bool:
    """The members of a torch wheel the check needs: the headers, and the file composing the flags."""
    return name.startswith("torch/include/") or name == "torch/utils/cpp_extension.py"


def fetch_torch(version: str, log=print) -> Path:
    """The root (ROOT/torch/include, ROOT/torch/utils/cpp_extension.py) of torch==VERSION's wheel,
    downloaded and cut down on first use, then reused from the cache. Raises RuntimeError with pip's
    own output when the wheel cannot be had (no network, no such release)."""
    root = cache_dir() / version
    if (root / "COMPLETE").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".fetch-{version}-", dir=root.parent) as tmp:
        tmp = Path(tmp)
        # A machine may cap torch through pip's config (a `constraint` file); the headers of a
        # release are wanted whatever this machine may install, so this one command has none.
        (tmp / "constraints.txt").write_text("")
        env = {**os.environ, "PIP_CONSTRAINT": str(tmp / "constraints.txt")}
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--progress-bar", "off", f"torch=={version}", "-d", str(tmp / "wheel")],
                              capture_output=True, text=True, env=env)
        wheels = sorted((tmp / "wheel").glob("torch-*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"compile_cuda: could not download torch=={version} "
                               f"(pip exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        fetched = time.monotonic() - start
        out = tmp / "root"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if _kept(m)]
            wheel.extractall(out, members)
        if not (out / "torch" / "include" / "torch" / "extension.h").exists() or \
                not (out / "torch" / "utils" / "cpp_extension.py").exists():
            raise RuntimeError(f"compile_cuda: {wheels[0].name} has no torch/include/torch/extension.h "
                               "or torch/utils/cpp_extension.py")
        (out / "COMPLETE").write_text(wheels[0].name + "\n")
        try:
            out.rename(root)
        except OSError:  # another run filled the cache meanwhile
            if not (root / "COMPLETE").exists():
                raise
        log(f"torch {version}: {wheels[0].name} fetched in {fetched:.0f} s, "
            f"{len(members)} files kept in {root}")
    return root


def load_cpp_extension(torch_root: Path) -> types.ModuleType:
    """The torch/utils/cpp_extension.py of the release at torch_root, loaded as a module whose
    include paths point into torch_root. It runs on the installed torch's Python code, from which it
    reads only what no header depends on (torch.version.cuda, the C++ ABI flag)."""
    import importlib.util

    import torch.utils  # noqa: F401  (the package its relative imports resolve in)

    path = Path(torch_root) / "torch" / "utils" / "cpp_extension.py"
    spec = importlib.util.spec_from_file_location("torch.utils.cpp_extension", path)
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get("torch.utils.cpp_extension")
    sys.modules["torch.utils.cpp_extension"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("torch.utils.cpp_extension", None)
        else:
            sys.modules["torch.utils.cpp_extension"] = saved
    module._TORCH_PATH = str(Path(torch_root) / "torch")
    module.TORCH_LIB_PATH = str(Path(torch_root) / "torch" / "lib")
    return module


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


def build_flags(cuda_home: str, torch_root: Path | None = None) -> Flags:
    """The flags BuildExtension writes into its ninja file for setup.py's extension, with the
    installed torch, or with the release whose cut-down wheel is at torch_root."""
    import setuptools  # noqa: F401  (before distutils: setuptools' own copy)
    import torch.utils
    import torch.utils.cpp_extension as installed
    from distutils.core import run_setup

    cpp = installed if torch_root is None else load_cpp_extension(torch_root)
    include = Path(cpp._TORCH_PATH) / "include"
    saved = {k: os.environ.get(k) for k in ("FORCE_CUDA", "TORCH_CUDA_ARCH_LIST")}
    saved_home, saved_compose = cpp.CUDA_HOME, cpp._write_ninja_file_and_compile_objects
    saved_cwd, saved_argv = os.getcwd(), sys.argv[:]

    def compose(*args, **kwargs):
        if args or not {"cflags", "post_cflags", "cuda_cflags", "cuda_post_cflags"} <= kwargs.keys():
            raise RuntimeError("compile_cuda: this torch's BuildExtension passes its flags in a way "
                               "this tool does not know; update build_flags()")
        if not kwargs.get("with_cuda"):
            raise RuntimeError("compile_cuda: setup.py gave BuildExtension no CUDA sources")
        split = lambda flags: shlex.split(" ".join(flags or []))  # noqa: E731
        raise _Composed(Flags(cpp.get_cxx_compiler(), split(kwargs["cflags"]), split(kwargs["post_cflags"]),
                              split(kwargs["cuda_cflags"]), split(kwargs["cuda_post_cflags"]), include))

    os.environ["FORCE_CUDA"] = "1"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH)
    cpp.CUDA_HOME = cuda_home
    cpp._write_ninja_file_and_compile_objects = compose
    # setup.py imports BuildExtension from torch.utils.cpp_extension: for another release, its own.
    sys.modules["torch.utils.cpp_extension"], torch.utils.cpp_extension = cpp, cpp
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
                return composed.flags
    finally:
        sys.modules["torch.utils.cpp_extension"], torch.utils.cpp_extension = installed, installed
        os.chdir(saved_cwd)
        sys.argv[:] = saved_argv
        cpp.CUDA_HOME, cpp._write_ninja_file_and_compile_objects = saved_home, saved_compose
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    raise RuntimeError("compile_cuda: BuildExtension never composed the flags\n" + log.getvalue())


def machine_flags(include: Path) -> list[str]:
    """Flags this machine needs and the real build on a CUDA wheel does not (see the docstring)."""
    macros = include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    return [] if macros.exists() else ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]


def is_cuda(source: Path) -> bool:
    return source.suffix == ".cu"


def command(nvcc: str, flags: Flags, source: Path, output: Path, cpp_objects: bool = False) -> list[str]:
    """The compiler command line of the real build for one source (without the dependency files)."""
    if is_cuda(source):
        return [nvcc, *flags.cuda_cflags, *machine_flags(flags.include), "-c", str(source), "-o", str(output),
                *flags.cuda_post_cflags]
    out = ["-c", str(source), "-o", str(output)] if cpp_objects else ["-fsyntax-only", str(source)]
    return [*shlex.split(flags.cxx), *flags.cflags, *out, *flags.post_cflags]


def compile_one(command: list[str], source: Path) -> tuple[Path, int, str, float]:
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True)
    return source, proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def cpp_sources() -> list[Path]:
    """The C++ sources of the extension, as setup.py lists them."""
    return sorted([*(ROOT / "csrc").glob("*.cpp"), *(ROOT / "csrc" / "cpu").glob("*.cpp")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="default: every csrc/cuda/*.cu (and with --all, "
                        "every csrc/*.cpp and csrc/cpu/*.cpp)")
    parser.add_argument("--all", action="store_true", help="every C++ and CUDA source of the extension")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--torch", metavar="VERSION", help="compile against this torch release's headers "
                       "(its wheel is fetched once into the cache)")
    which.add_argument("--torch-root", type=Path, help="compile against the torch tree at this root "
                       "(ROOT/torch/include, ROOT/torch/utils/cpp_extension.py)")
    parser.add_argument("--cpp-objects", action="store_true",
                        help="compile C++ sources to objects instead of -fsyntax-only")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--print-flags", action="store_true",
                        help="print the command of the first source as JSON and compile nothing")
    args = parser.parse_args(argv)

    cuda_home = find_cuda_home()
    if cuda_home is None:
        print("compile_cuda: no CUDA toolkit found (CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda)",
              file=sys.stderr)
        return 2
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    sources = [s.resolve() for s in args.files]
    if not sources:
        sources = [*(cpp_sources() if args.all else []), *sorted((ROOT / "csrc" / "cuda").glob("*.cu"))]
    if not sources:
        print("compile_cuda: no sources", file=sys.stderr)
        return 2
    torch_root = args.torch_root
    if args.torch is not None:
        try:
            torch_root = fetch_torch(args.torch)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 3
    flags = build_flags(cuda_home, torch_root)
    if args.print_flags:
        print(json.dumps(command(nvcc, flags, sources[0], Path("OUT.o"), args.cpp_objects)))
        return 0
    print(f"torch headers: {flags.include}")
    kinds = {is_cuda(s) for s in sources}
    for cuda in sorted(kinds):
        shown = command(nvcc, flags, Path("SOURCE.cu" if cuda else "SOURCE.cpp"), Path("OUT"), args.cpp_objects)
        print(" ".join(shlex.quote(a) for a in shown))
    failed = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cafin_compile_") as outdir, \
            ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        # The slowest (nvcc) first, so that two workers finish together.
        order = sorted(enumerate(sources), key=lambda item: not is_cuda(item[1]))
        jobs = {i: pool.submit(compile_one, command(nvcc, flags, s, Path(outdir) / f"{i}_{s.stem}.o",
                                                    args.cpp_objects), s) for i, s in order}
        for i in range(len(sources)):
            source, code, log, seconds = jobs[i].result()
            status = "ok" if code == 0 else f"FAILED (exit {code})"
            shown = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
            print(f"{shown}: {status}, {seconds:.0f} s", flush=True)
            if code != 0 or log.strip():
                print(log.rstrip())
            failed += code != 0
    print(f"{len(sources) - failed} of {len(sources)} compiled in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
