"""Builds the cafin._C extension: C++ CPU kernels always, CUDA kernels when torch and nvcc can.

CUDA is built when torch was built with CUDA and a CUDA toolkit is found (FORCE_CUDA=1 insists,
FORCE_CUDA=0 refuses). A GPU need not be visible at build time.
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

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
