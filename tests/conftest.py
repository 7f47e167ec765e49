"""Fixtures several test files share."""
import pytest
import torch
from torch._dynamo.utils import counters


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty before and after: a test counts its own compiles."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """One intra-op thread: CPU kernels may split reductions by thread (results then depend on
    the count), and small models gain nothing from threads on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """A test that runs on a CUDA device carries the `cuda` marker (tests/devices.py: DEVICES,
    CUDA_MARKS), which tools/gpu_check.sh selects with `pytest -m cuda`: a "cuda" parameter
    without it would never run on the GPU check. Such a test is an error of its file."""
    unmarked = []
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or item.get_closest_marker("cuda") is not None:
            continue
        if any((isinstance(v, str) and v == "cuda") or (isinstance(v, torch.device) and v.type == "cuda")
               for v in spec.params.values()):
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError("tests run on CUDA without the `cuda` marker (use tests/devices.py's "
                                "DEVICES or CUDA_MARKS): " + ", ".join(unmarked[:10]))
