"""run()'s and the in-place ops' refusals of tensors that share memory where a kernel writes: out and lse against q,
the KV cache, the workspace and each other; merge_state_in_place's written state against what it reads; the
checks ahead of any launch (a CPU workspace: an accepted call shows as attnjit's NoGPUError)."""

from __future__ import annotations

import re

import pytest
import torch

import attnjit
from attnjit.errors import NoGPUError
from tests.plan_support import planned as _planned, run_inputs as _run_inputs


@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
@pytest.mark.parametrize("gap", [-8, 0])
def test_run_refuses_an_out_or_lse_inside_the_kv_cache(kind, gap):
    """out (or lse) in the same buffer as the cache: where it reaches into the cache's bytes (gap -8: its first 8
    elements are the cache's last) run() refuses it before any launch (the kernel would write the pages other CTAs
    read); right after the cache (gap 0) it is accepted."""
    w, plan = _planned(kind)
    inputs = _run_inputs(kind, plan)
    n, h, d = plan.q_shape
    name = "v" if kind == "ragged" else "paged_kv_cache"
    cache = inputs[name]
    buf = torch.zeros(cache.numel() + gap + n * h * d, dtype=cache.dtype)
    inputs[name] = buf[:cache.numel()].view(cache.shape)
    out = buf[cache.numel() + gap:].view(n, h, d)
    what = "v" if kind == "ragged" else "paged_kv_cache (v)"
    if gap < 0:
        with pytest.raises(ValueError, match=rf"^run\(\): out shares memory with {re.escape(what)} "):
            w.run(**inputs, out=out)
    else:
        with pytest.raises(NoGPUError):
            w.run(**inputs, out=out)
    # an lse over the cache's bytes (float32 over 16-bit pages), and an lse inside out
    lse_buf = inputs[name].view(-1)[:2 * n * h].view(torch.float32).view(n, h)
    with pytest.raises(ValueError, match=r"^run\(\): lse shares memory with "):
        w.run(**inputs, out=torch.zeros(n, h, d, dtype=plan.o_dtype), lse=lse_buf)
    own = torch.zeros(n, h, d, dtype=plan.o_dtype)
    with pytest.raises(ValueError, match=r"^run\(\): out shares memory with lse "):
        w.run(**inputs, out=own, lse=own.view(-1)[:2 * n * h].view(torch.float32).view(n, h))


@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
def test_run_refuses_an_out_or_lse_over_q(kind):
    """In-place attention (out is q, or a view over part of it; an lse inside q) is refused before any launch; an
    out right after q in the same buffer is accepted."""
    w, plan = _planned(kind)
    inputs = _run_inputs(kind, plan)
    q = inputs["q"]
    n, h, d = plan.q_shape
    with pytest.raises(ValueError, match=r"^run\(\): out shares memory with q "):
        w.run(**inputs, out=q)
    buf = torch.zeros(2 * n * h * d - 8, dtype=q.dtype)   # out's first 8 elements are q's last 8
    inputs["q"] = buf[:n * h * d].view(n, h, d)
    with pytest.raises(ValueError, match=r"^run\(\): out shares memory with q "):
        w.run(**inputs, out=buf[n * h * d - 8:].view(n, h, d))
    with pytest.raises(ValueError, match=r"^run\(\): lse shares memory with q "):
        w.run(**inputs, out=torch.zeros(n, h, d, dtype=plan.o_dtype),
              lse=inputs["q"].view(-1)[:2 * n * h].view(torch.float32).view(n, h))
    after = torch.zeros(2 * n * h * d, dtype=q.dtype)
    inputs["q"] = after[:n * h * d].view(n, h, d)
    with pytest.raises(NoGPUError):
        w.run(**inputs, out=after[n * h * d:].view(n, h, d))


def test_run_checks_a_kv_tuple_cache_for_an_out_inside_it():
    w, plan = _planned("paged")
    inputs = _run_inputs("paged", plan)
    cache = inputs.pop("paged_kv_cache")
    k, v = cache[:, 0].clone(), cache[:, 1].clone()
    n, h, d = plan.q_shape
    out = k.view(-1)[:n * h * d].view(n, h, d)
    with pytest.raises(ValueError, match=r"^run\(\): out shares memory with paged_kv_cache \(k\) "):
        w.run(**inputs, paged_kv_cache=(k, v), out=out)
    with pytest.raises(NoGPUError):
        w.run(**inputs, paged_kv_cache=(k, v), out=torch.zeros(n, h, d, dtype=plan.o_dtype))


@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
def test_run_refuses_operands_inside_the_workspace(kind):
    """The kernels write split-KV partial states into float_workspace_buffer: an out or lse carved out of it, or a q
    or KV operand inside it, is a ValueError before any launch; a buffer right after the workspace is accepted."""
    w, plan = _planned(kind)
    inputs = _run_inputs(kind, plan)
    n, h, d = plan.q_shape
    ws = w._workspace
    inside = ws[:n * h * d * 2].view(plan.o_dtype).view(n, h, d)
    with pytest.raises(ValueError, match=r"^run\(\): out shares memory with float_workspace_buffer "):
        w.run(**inputs, out=inside)
    with pytest.raises(ValueError, match=r"^run\(\): lse shares memory with float_workspace_buffer "):
        w.run(**inputs, out=torch.zeros(n, h, d, dtype=plan.o_dtype),
              lse=ws[:n * h * 4].view(torch.float32).view(n, h))
    q = inputs["q"]
    with pytest.raises(ValueError, match=r"^run\(\): q shares memory with float_workspace_buffer "):
        w.run(**{**inputs, "q": ws[:q.numel() * q.element_size()].view(q.dtype).view(q.shape)})
    name = "v" if kind == "ragged" else "paged_kv_cache"
    cache = inputs[name]
    carved = ws[-cache.numel() * cache.element_size():].view(cache.dtype).view(cache.shape)
    with pytest.raises(ValueError, match=r"shares memory with float_workspace_buffer "):
        w.run(**{**inputs, name: carved})
    with pytest.raises(NoGPUError):
        w.run(**inputs, out=torch.zeros(n, h, d, dtype=plan.o_dtype))


def test_merge_state_in_place_refuses_a_written_state_that_shares_memory_with_what_it_reads():
    v, s = torch.zeros(5, 2, 64, dtype=torch.float16), torch.zeros(5, 2)
    vb, sb = torch.zeros_like(v), torch.zeros(5, 2)
    with pytest.raises(ValueError, match=r"^merge_state_in_place: v and s share memory"):
        attnjit.merge_state_in_place(v, v.view(-1)[:20].view(torch.float32).view(5, 2), vb, sb)
    buf = torch.zeros(768, dtype=torch.float16)   # v_other is v one row (of 2 x 64) later
    with pytest.raises(ValueError, match=r"^merge_state_in_place: v_other shares memory with v "):
        attnjit.merge_state_in_place(buf[:640].view(5, 2, 64), s, buf[128:].view(5, 2, 64), sb)
    with pytest.raises(ValueError, match=r"^merge_state_in_place: mask shares memory with s "):
        attnjit.merge_state_in_place(v, s, vb, sb, mask=s.view(torch.bool).view(-1)[:5])
    for other in ((vb, sb), (v, s), (v, sb)):   # apart, or the written state itself (element by element: safe)
        with pytest.raises(NoGPUError):
            attnjit.merge_state_in_place(v, s, *other)


def test_run_refuses_an_out_that_requires_grad_and_a_cascade_checks_return_lse():
    w, plan = _planned("paged")
    inputs = _run_inputs("paged", plan)
    out = torch.zeros(plan.q_shape, dtype=plan.o_dtype, requires_grad=True)
    with pytest.raises(ValueError, match=r"^run\(\): out requires grad"):
        w.run(**inputs, out=out)
    c = attnjit.MultiLevelCascadeAttentionWrapper(1, torch.zeros(32 << 20, dtype=torch.uint8))
    c._plan = plan   # planned: run() checks its own arguments first
    with pytest.raises(TypeError, match=r"return_lse must be True or False"):
        c.run(inputs["q"], inputs["paged_kv_cache"], return_lse="no")


def test_merge_state_in_place_tells_interleaved_views_of_one_table_apart():
    """States stored side by side in one [rows, states, heads, D] table: views one state apart share no element
    (accepted, though their byte spans overlap); a view shifted within the table so that elements coincide is
    refused."""
    from attnjit.ops.merge import _may_share

    table = torch.zeros(7, 3, 40, 64, dtype=torch.bfloat16)
    a, b = table[:, 0, :32], table[:, 2, 8:]
    assert not _may_share(a, b) and not _may_share(b, a)
    assert _may_share(table[:, 0, :32], table[:, 0, 1:33])        # one head apart: rows share elements
    assert _may_share(table[:, 0, :32], table[:, 0, :32])
    flat = torch.zeros(4096, dtype=torch.float16)
    assert not _may_share(flat[:1024].view(4, 4, 64), flat[1024:2048].view(4, 4, 64))
    s = torch.zeros(7, 32)
    with pytest.raises(NoGPUError):
        attnjit.merge_state_in_place(a, s, b, torch.zeros(7, 32))
    with pytest.raises(ValueError, match=r"^merge_state_in_place: v_other shares memory with v "):
        attnjit.merge_state_in_place(table[:, 0, :32], s, table[:, 0, 1:33], torch.zeros(7, 32))
