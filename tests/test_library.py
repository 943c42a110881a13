"""torch.ops.attnjit (issue 13 item 2) on the CPU: every op is registered with its schema, the fake implementations
give the right shapes and dtypes, and torch.compile(fullgraph=True) traces each public op into one graph of attnjit
ops (no graph break), whose real implementations then run the eager code (here: attnjit's NoGPUError after the
checks). tests/gpu/test_compile.py runs them for real, with opcheck and reduce-overhead."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnjit
from attnjit.ops import library
from attnjit.errors import NoGPUError
from tests.helpers import i32
from tests.plan_support import decode_args, paged_args, ragged_args, workspace

OPS = ["batch_run", "batch_run_out", "single_prefill", "single_decode", "merge_state", "merge_state_in_place",
       "merge_states", "no_backward", "append_paged_kv_cache"]


def test_every_op_is_registered_with_its_schema():
    assert library.ops() == OPS
    for name in OPS:
        op = getattr(torch.ops.attnjit, name).default
        assert str(op._schema) == f"attnjit::{library.SCHEMAS[name]}", name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), name
    mutating = {name for name in OPS if any(a.alias_info is not None and a.alias_info.is_write
                                            for a in getattr(torch.ops.attnjit, name).default._schema.arguments)}
    assert mutating == {"batch_run_out", "merge_state_in_place", "append_paged_kv_cache"}


def test_fake_implementations_propagate_shapes_and_dtypes():
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(**paged_args(o_data_type=torch.bfloat16))     # q fp16, out bf16
    with FakeTensorMode():
        q = torch.empty(8, 32, 128, dtype=torch.float16)
        cache = torch.empty(15, 2, 4, 8, 128, dtype=torch.float16)
        out, lse = torch.ops.attnjit.batch_run(w._handle, q, cache, None, True)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((8, 32, 128), torch.bfloat16, (8, 32), torch.float32)
        _, no_lse = torch.ops.attnjit.batch_run(w._handle, q, cache, None, False)
        assert no_lse.shape == (0,)
        q3, k, v = (torch.empty(37, 32, 128, dtype=torch.bfloat16), torch.empty(90, 8, 128, dtype=torch.bfloat16),
                    torch.empty(90, 8, 128, dtype=torch.bfloat16))
        o, lse = torch.ops.attnjit.single_prefill(q3, k, v, True, "NHD", None, -1, None, "NONE", True)
        assert (o.shape, o.dtype, lse.shape) == ((37, 32, 128), torch.bfloat16, (37, 32))
        o, lse = torch.ops.attnjit.single_decode(q3[0], k, v, "NHD", None, -1, 30.0, "NONE", True)
        assert (o.shape, lse.shape) == ((32, 128), (32,))
        va = torch.empty(5, 64, 72, dtype=torch.float16)[..., :64]   # a strided [5, 64, 64]
        v, s = torch.ops.attnjit.merge_state(va, torch.empty(5, 64), va, torch.empty(5, 64))
        assert (v.shape, v.dtype, v.is_contiguous(), s.shape, s.dtype) == ((5, 64, 64), torch.float16, True, (5, 64),
                                                                           torch.float32)
        v, s = torch.ops.attnjit.merge_states(torch.empty(5, 3, 4, 128, dtype=torch.bfloat16), torch.empty(5, 3, 4))
        assert (v.shape, v.dtype, s.shape) == ((5, 4, 128), torch.bfloat16, (5, 4))
        assert torch.ops.attnjit.merge_state_in_place(va, torch.empty(5, 64), va, torch.empty(5, 64), None) is None


def test_a_fake_run_needs_a_plan_and_a_live_wrapper():
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace())
    with FakeTensorMode():
        q = torch.empty(3, 32, 128, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=r"the wrapper has no plan; call plan\(\) before"):
            torch.ops.attnjit.batch_run(w._handle, q, torch.empty(1), None, False)
        with pytest.raises(RuntimeError, match=r"handle 999999 names no live wrapper"):
            torch.ops.attnjit.batch_run(999999, q, torch.empty(1), None, False)


def _compile_and_capture(fn):
    """torch.compile(fn, fullgraph=True) through AOT (fake tensors, functionalization); returns (compiled fn, the
    forward graphs it produced)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=record)), graphs


def _ops_in(graphs) -> set[str]:
    """The operators the graphs call (those a higher-order op such as auto_functionalized wraps included)."""
    names = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            for t in (node.target, *node.args):
                if isinstance(t, torch._ops.OpOverload):
                    names.add(t.name())
    return names


@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
def test_wrappers_run_traces_into_one_graph(kind):
    make = {"paged": attnjit.BatchPrefillWithPagedKVCacheWrapper, "decode": attnjit.BatchDecodeWithPagedKVCacheWrapper,
            "ragged": attnjit.BatchPrefillWithRaggedKVCacheWrapper}[kind]
    args = {"paged": paged_args, "decode": decode_args, "ragged": ragged_args}[kind]()
    w = make(workspace())
    w.plan(**args)
    q = torch.randn(tuple(w._plan.q_shape)).to(w._plan.q_dtype)
    if kind == "ragged":
        kv = (torch.randn(17, 8, 64).half(), torch.randn(17, 8, 64).half())
    else:
        kv = (torch.randn(15, 2, 4, 8, 128).to(w._plan.kv_dtype),)

    def step(q, *kv):
        out, lse = w.run(q * 2, *kv, return_lse=True)
        return out.float().sum() + lse.sum()

    compiled, graphs = _compile_and_capture(step)
    with pytest.raises(NoGPUError, match="kernels run on CUDA devices only"):
        compiled(q, *kv)
    assert "attnjit::batch_run" in _ops_in(graphs)

    def step_out(q, *kv):
        out = torch.empty(q.shape, dtype=w._plan.o_dtype)
        return w.run(q, *kv, out=out)

    compiled, graphs = _compile_and_capture(step_out)
    with pytest.raises(NoGPUError):
        compiled(q, *kv)
    assert "attnjit::batch_run_out" in _ops_in(graphs)


def test_merge_append_and_single_ops_trace_into_one_graph():
    def merges(va, sa, vb, sb, v4, s4):
        v, s = attnjit.merge_state(va, sa, vb, sb)
        attnjit.merge_state_in_place(v, s, vb, sb)
        v2, s2 = attnjit.merge_states(v4, s4)
        return v.float().sum() + s.sum() + v2.float().sum() + s2.sum()

    compiled, graphs = _compile_and_capture(merges)
    args = (torch.randn(5, 2, 64).half(), torch.randn(5, 2), torch.randn(5, 2, 64).half(), torch.randn(5, 2),
            torch.randn(5, 3, 2, 64).half(), torch.randn(5, 3, 2))
    with pytest.raises(NoGPUError, match="merge_state: v_a is on cpu"):
        compiled(*args)
    assert {"attnjit::merge_state", "attnjit::merge_states", "attnjit::merge_state_in_place"} <= _ops_in(graphs)

    def append(k, v, cache):
        attnjit.append_paged_kv_cache(k, v, i32([0, 0, 1]), i32([4, 5, 0]), cache, i32([3, 1, 4]), i32([0, 2, 3]),
                                      i32([2, 1]))
        return cache.float().sum()

    compiled, graphs = _compile_and_capture(append)
    with pytest.raises(NoGPUError, match="append_paged_kv_cache: paged_kv_cache is on cpu"):
        compiled(torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half(), torch.zeros(6, 2, 4, 2, 64).half())
    assert "attnjit::append_paged_kv_cache" in _ops_in(graphs)

    def singles(q, k, v):
        o = attnjit.single_prefill_with_kv_cache(q, k, v, causal=True)
        od, lse = attnjit.single_decode_with_kv_cache(q[0], k, v, return_lse=True, logits_soft_cap=30.0)
        return o.float().sum() + od.float().sum() + lse.sum()

    compiled, graphs = _compile_and_capture(singles)
    with pytest.raises(NoGPUError):
        compiled(torch.randn(7, 8, 64).half(), torch.randn(9, 2, 64).half(), torch.randn(9, 2, 64).half())
    assert {"attnjit::single_prefill", "attnjit::single_decode"} <= _ops_in(graphs)


def test_compiled_calls_refuse_what_the_ops_cannot_carry():
    from tests.gpu.cases import HEAD_SCALE

    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), variant=HEAD_SCALE)
    w.plan(**paged_args())
    q, cache = torch.randn(8, 32, 128).half(), torch.randn(15, 2, 4, 8, 128).half()

    def with_params(q, cache, scale):
        return w.run(q, cache, head_scale=scale)

    compiled, _ = _compile_and_capture(with_params)
    with pytest.raises(Exception, match=r"run-time variant parameters \(\['head_scale'\]\) are not supported inside"):
        compiled(q, cache, torch.ones(32))


def test_eager_calls_do_not_go_through_the_dispatcher():
    """Outside torch.compile the public functions run the eager code directly (no dispatcher cost): the error comes
    from merge_state_eager without passing through the op's registered implementation."""
    import traceback

    with pytest.raises(NoGPUError) as info:
        attnjit.merge_state(torch.randn(5, 2, 64).half(), torch.randn(5, 2), torch.randn(5, 2, 64).half(),
                            torch.randn(5, 2))
    frames = [(f.filename.rsplit("/", 1)[-1], f.name) for f in traceback.extract_tb(info.value.__traceback__)]
    assert ("merge.py", "merge_state_eager") in frames and not any(f == "library.py" for f, _ in frames), frames
