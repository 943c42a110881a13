"""ops/_grad.py on the CPU: outputs of a kernel without backward fail loudly in backward(), never silently."""

from __future__ import annotations

import pytest
import torch

from attnjit.ops._grad import grad_off, guard, refuse_in_place, set_grad


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


def test_k_v_and_tensor_parameters_are_inputs_too_even_inside_a_tuple_or_dict():
    """A (k, v) cache tuple, a learned sink in run()'s variant parameters: any of them requiring grad ties the
    output to a backward that raises; plain floats and None among the inputs are skipped."""
    out = torch.zeros(2, 3)
    q, k = torch.randn(2, 3), torch.randn(4, 3)
    v = torch.randn(4, 3, requires_grad=True)
    got = guard("op", out, q, (k, v), {"cap": 30.0}, None, 1.0)
    assert got.requires_grad
    with pytest.raises(RuntimeError, match="no backward pass"):
        got.sum().backward()
    sinks = torch.zeros(4, requires_grad=True)
    got = guard("op", out, q, k, {"sinks": sinks, "cap": 30.0})
    with pytest.raises(RuntimeError, match="no backward pass"):
        got.sum().backward()
    assert sinks.grad is None
    assert guard("op", out, q, (k, k), {"cap": 1.0}, [None]) is out


def test_an_in_place_op_refuses_inputs_that_require_grad_while_grad_mode_is_on():
    v = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="writes in place.*; v_other does"):
        refuse_in_place("merge_state_in_place", v=torch.zeros(2, 3), v_other=v)
    refuse_in_place("merge_state_in_place", v=torch.zeros(2, 3), v_other=v.detach())
    with torch.no_grad():
        refuse_in_place("merge_state_in_place", v=v)


def test_op_bodies_restore_grad_mode_when_the_eager_code_raises():
    """The torch.ops.attnjit bodies turn grad mode off around the eager code (grad_off / set_grad) and restore it
    on the way out: here the eager code raises attnjit's NoGPUError (no GPU), with grad mode on and off."""
    from attnjit.errors import NoGPUError

    q = torch.randn(4, 2, 64, dtype=torch.float16)
    k = torch.randn(8, 2, 64, dtype=torch.float16)
    for start in (True, False):
        with torch.set_grad_enabled(start):
            with pytest.raises(NoGPUError):
                torch.ops.attnjit.single_prefill(q, k, k.clone(), True, "NHD", None, -1, None, "NONE", False)
            assert torch.is_grad_enabled() is start


# a toy op like attnjit's: a torch.library op with a fake implementation and no autograd kernel, its body under
# grad_off (defined once per process: a Library namespace cannot be defined twice)
_TOY = torch.library.Library("attnjit_grad_test", "DEF")
_TOY.define("double(Tensor x) -> Tensor")


def _toy_body(x):
    previous = grad_off()
    try:
        return x * 2
    finally:
        set_grad(previous)


_TOY.impl("double", _toy_body, "CPU")
torch.library.register_fake("attnjit_grad_test::double", lambda x: torch.empty_like(x), lib=_TOY)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_the_guard_holds_inside_torch_compile_around_an_op_without_autograd(fullgraph):
    """The compiled paths call guard() around their torch.ops.attnjit op (which registers no autograd kernel and
    alone would give only a warning and no gradient). Compiled with aot_eager on the CPU, fullgraph=True included
    (the backward's raise is the attnjit::no_backward op, which the compiler traces with its fake implementation):
    the forward compiles and runs, backward raises; without grad the output is a plain tensor."""
    def fn(x, w):
        h = x @ w
        # h three times (q, and a (k, v) pair of one tensor): torch.compile takes an autograd.Function's tensor once
        return guard("double", (torch.ops.attnjit_grad_test.double(h), None), h, (h, h), {"p": w})

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    y, none = compiled(x, w)
    assert none is None and y.requires_grad and torch.equal(y.detach(), (x @ w.detach()) * 2)
    with pytest.raises(RuntimeError, match="no backward pass.*double"):
        y.sum().backward()
    assert w.grad is None
    with torch.no_grad():
        assert not compiled(x, w)[0].requires_grad


def test_a_none_in_a_result_tuple_stays_in_place():
    q = torch.randn(2, 3, requires_grad=True)
    out = torch.zeros(2, 3)
    got = guard("op", (out, None), q)
    assert got[1] is None and got[0].requires_grad
    nothing = (None, None)
    assert guard("op", nothing, q) is nothing and guard("op", None, q) is None
    with pytest.raises(RuntimeError, match="no backward pass"):
        got[0].sum().backward()


def test_append_refuses_tokens_that_require_grad():
    """append_paged_kv_cache writes the cache in place: tokens that require grad are refused (before any check of
    the rest), under no_grad they pass on to the usual checks."""
    import attnjit

    key = torch.randn(2, 1, 64, dtype=torch.float16, requires_grad=True)
    i32 = torch.zeros(2, dtype=torch.int32)
    cache = torch.zeros(1, 2, 16, 1, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="append_paged_kv_cache writes in place"):
        attnjit.append_paged_kv_cache(key, key.detach(), i32, i32, cache, i32[:1], i32, i32[:1])
    with pytest.raises(RuntimeError, match="append_paged_kv_cache writes in place.*paged_kv_cache does"):
        attnjit.append_paged_kv_cache(key.detach(), key.detach(), i32, i32, cache.clone().requires_grad_(), i32[:1],
                                      i32, i32[:1])
    with torch.no_grad(), pytest.raises(Exception) as info:
        attnjit.append_paged_kv_cache(key, key.detach(), i32, i32, cache, i32[:1], i32, i32[:1])
    assert "writes in place" not in str(info.value)
