import torch

from epmoe.tensors import as_contiguous


def test_as_contiguous_returns_the_same_tensor_when_nothing_changes():
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    assert as_contiguous(t) is t
    assert as_contiguous(t, torch.int64) is t


def test_as_contiguous_converts_dtype_and_layout():
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    f = as_contiguous(t, torch.float32)
    assert f.dtype == torch.float32 and torch.equal(f, t.float())
    tt = as_contiguous(t.t())
    assert tt.is_contiguous() and torch.equal(tt, t.t())
    both = as_contiguous(t.t(), torch.int32)
    assert both.is_contiguous() and both.dtype == torch.int32 and torch.equal(both, t.t().int())
