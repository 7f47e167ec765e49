"""cafin.maths.finite.all_finite against torch.isfinite(t).all(), tensor by tensor."""
import pytest
import torch

from cafin.maths.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_each_tensor_is_judged_on_its_own(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 5, generator=g).to(dtype) for _ in range(6)]
    tensors[1][3, 2] = float("nan")
    tensors[2][0, 0] = float("inf")
    tensors[3][6, 4] = -float("inf")
    tensors[4].fill_(torch.finfo(dtype).max)  # finite, though any sum of it overflows
    got = all_finite(tensors)
    assert got.dtype == torch.bool and got.tolist() == [bool(torch.isfinite(t).all()) for t in tensors]
    assert got.tolist() == [True, False, False, False, True, True]


def test_mixed_dtypes_empty_tensors_and_an_empty_list():
    nan = torch.tensor([1.0, float("nan")])
    assert all_finite([nan, torch.ones(3, dtype=torch.float64), torch.empty(0, 4)]).tolist() == [False, True, True]
    assert all_finite([]).numel() == 0
