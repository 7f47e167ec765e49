"""Builds the cafin._C extension: C++ CPU kernels always, CUDA kernels when torch and nvcc can.

CUDA is built when torch was built with CUDA and a CUDA toolkit is found (FORCE_CUDA=1 insists,
FORCE_CUDA=0 refuses). A GPU need not be visible at build time. A torch outside the supported
releases is refused before anything compiles.
"""
import glob
import os
import re

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

# The torch releases cafin builds and is tested on: (first supported, first unsupported) minor.
# pyproject.toml and README.md state the same range; tests/test_torch_headers.py compiles every
# source against the headers of the oldest and the newest.
TORCH_RANGE = ((2, 11), (2, 16))


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as 2.15.0+cu132, 2.13.0+cpu or 2.16.0a0+git1234."""
    match = re.match(r"(\d+)\.(\d+)", version.split("+")[0])
    if match is None:
        raise RuntimeError(f"cafin: cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str) -> None:
    (lo_major, lo_minor), (hi_major, hi_minor) = TORCH_RANGE
    if not TORCH_RANGE[0] <= torch_release(version) < TORCH_RANGE[1]:
        raise RuntimeError(
            f"cafin supports torch >= {lo_major}.{lo_minor}, < {hi_major}.{hi_minor} "
            f"({lo_major}.{lo_minor} to {hi_major}.{hi_minor - 1}); found torch {version}. "
            "Install a torch in that range first.")


check_torch(torch.__version__)
here = os.path.dirname(os.path.abspath(__file__))
force = os.environ.get("FORCE_CUDA")
use_cuda = torch.version.cuda is not None and CUDA_HOME is not None
if force is not None:
    use_cuda = force == "1"

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
# -fno-math-errno: sqrt never sets errno, so loops with a sqrt vectorise (its result is unchanged)
cxx_flags = ["-O3", "-fopenmp", "-fno-math-errno"] if os.name != "nt" else ["/O2"]
extra = {"cxx": cxx_flags}
if use_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    extra["cxx"] = cxx_flags + ["-DCAFIN_WITH_CUDA"]
    extra["nvcc"] = ["-O3", "--expt-relaxed-constexpr", "-DCAFIN_WITH_CUDA"]
    ext = CUDAExtension("cafin._C", sources, extra_compile_args=extra,
                        include_dirs=[os.path.join(here, "csrc")], extra_link_args=["-fopenmp"])
else:
    ext = CppExtension("cafin._C", sources, extra_compile_args=extra,
                       include_dirs=[os.path.join(here, "csrc")], extra_link_args=["-fopenmp"])

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension})
