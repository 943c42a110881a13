"""ops/_grad.py on the CPU: outputs of a kernel without backward fail loudly in backward(), never silently."""

from __future__ import annotations

import pytest
import torch

from attnjit.ops._grad import guard


def test_no_grad_needed_returns_the_outputs_themselves():
    out, lse = torch.zeros(3, 2), torch.zeros(3)
    q = torch.ones(3, 2)
    assert guard("op", out, q) is out
    pair = (out, lse)
    assert guard("op", pair, q) is pair
    with torch.no_grad():
        assert guard("op", out, q.requires_grad_()) is out
    with torch.inference_mode():
        assert guard("op", out, torch.ones(2, requires_grad=True)) is out


def test_backward_through_a_guarded_output_raises_with_the_op_and_the_remedy():
    q = torch.randn(4, 2, requires_grad=True)
    out = torch.full((4, 2), 7.0)
    got = guard("merge_state", out, q, None, 3.0)
    assert got.requires_grad and torch.equal(got, out)
    assert got.data_ptr() == out.data_ptr()   # an alias: no copy
    with pytest.raises(RuntimeError, match=r"no backward pass.*merge_state.*torch.no_grad\(\)"):
        (got * 2).sum().backward()
    assert q.grad is None


def test_tuples_keep_their_shape_and_a_wrapper_class_is_named_by_its_run():
    class BatchDecodeWithPagedKVCacheWrapper:
        pass

    q = torch.randn(2, 3, requires_grad=True)
    out, lse = torch.zeros(2, 3), torch.zeros(2)
    got = guard(BatchDecodeWithPagedKVCacheWrapper, (out, lse), q)
    assert isinstance(got, tuple) and len(got) == 2 and got[1].shape == (2,)
    one = guard("op", (out,), q)
    assert isinstance(one, tuple) and len(one) == 1
    with pytest.raises(RuntimeError, match=r"BatchDecodeWithPagedKVCacheWrapper\.run\(\)"):
        got[0].sum().backward()
