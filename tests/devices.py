"""The CUDA side of the tests. Every test that runs on CUDA carries the `cuda` marker, so
tools/gpu_check.sh selects them all with `pytest -m cuda`; without a GPU (or without cafin's CUDA
kernels) they skip with the reason. Their sources are still compiled (tests/test_cuda_sources.py)."""
import pytest
import torch

import cafin

CUDA = torch.cuda.is_available() and cafin.cuda_kernels_built()
CUDA_SKIP = ("no CUDA device" if not torch.cuda.is_available() else "cafin built without CUDA kernels") + \
    ": CUDA kernels only compiled here (tests/test_cuda_sources.py)"
# Marks of a CUDA test: a whole module (`pytestmark = CUDA_MARKS`), a test, or one parameter.
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason=CUDA_SKIP)]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]
