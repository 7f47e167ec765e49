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
