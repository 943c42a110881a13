"""The sm90 family's work order (sm90/producer.cuh): CTAs claim work items from a counter in the plan's metadata
(ATTNJIT_WORK_CLAIMS=1, the default) or walk the list by grid stride (0). Both against the float64 reference; the
claims repeated back to back and the counters zero again after a run (what graph replays rely on)."""

from __future__ import annotations

import zlib

import cupy
import numpy as np
import pytest
import torch

from ..helpers import assert_close, assert_lse_close, poisoned, quantize_cache
from .cases import MATRIX, WALK_MATRIX, sm90_case
from .test_attention import DEV, _cache_arg, plan_case, run_case, workspace  # noqa: F401 (the fixture)

_NAMES = ("base", "paged-long-history", "paged-split-forced", "paged-p1", "paged-d256", "ragged",
          "ragged-long-autosplit", "fp8-paged-e4m3", "fp8-paged-e4m3-tensor-fp16-split-forced", "paged-long-autosplit")
CASES = {c.name: c for c, f in MATRIX if f == "sm90" and c.name in _NAMES}


def _head(w) -> np.ndarray:
    """The plan's metadata head as the kernel left it: [work_count, claims, finished CTAs, 0] (int32)."""
    from attnjit.ops._wrapper import _WC

    ptr = w._plan.attn_values[_WC]
    mem = cupy.cuda.UnownedMemory(ptr, 16, None)
    return cupy.asnumpy(cupy.ndarray((4,), cupy.int32, cupy.cuda.MemoryPointer(mem, 0)))


def test_the_matrix_names_its_cases():
    assert set(CASES) == set(_NAMES), set(_NAMES) - set(CASES)


@pytest.mark.parametrize("name", _NAMES)
def test_sm90_strided_order_matches_reference(name, workspace, monkeypatch):
    case = CASES[name]
    monkeypatch.setenv("ATTNJIT_WORK_CLAIMS", "0")
    w, out, lse, ref_o, ref_lse = run_case(case, workspace, seed=zlib.crc32(name.encode()) % 1000 + 3, family="sm90")
    torch.cuda.synchronize()
    assert w.last_plan["work_order"] == "strided", w.last_plan
    assert_close(out, ref_o, torch.bfloat16 if case.kv else case.dtype)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("name", _NAMES)
def test_sm90_claims_repeat_and_leave_the_counters_zero(name, workspace):
    """Five runs of one plan back to back (no sync between): every one bit-identical to the first and to the
    reference's tolerance; after them the claim and finish counters are zero."""
    case = CASES[name]
    w, out, lse, ref_o, ref_lse = run_case(case, workspace, seed=zlib.crc32(name.encode()) % 1000 + 5, family="sm90")
    torch.cuda.synchronize()
    assert w.last_plan["work_order"] == "claimed", w.last_plan
    assert_close(out, ref_o, torch.bfloat16 if case.kv else case.dtype)
    assert_lse_close(lse, ref_lse)
    head = _head(w)
    assert head[0] > 0 and head[1] == 0 and head[2] == 0, head
    _, x = plan_case(case, workspace, zlib.crc32(name.encode()) % 1000 + 5, "sm90")  # the same inputs again
    if case.kind == "ragged":
        args = (x["q"], x["k"], x["v"])
    else:
        b, kv_dtype, sc = x["paged"], x["kv_dtype"], x["scales"]
        full = b.cache if kv_dtype is None else quantize_cache(b.cache, sc["k_scale"], sc["v_scale"], case.layout,
                                                               kv_dtype)
        args = (b.q, _cache_arg(full, as_tuple=case.dtype == torch.float16))
    outs = []
    for _ in range(5):
        o, l_ = poisoned(out.shape, out.dtype, DEV), poisoned(lse.shape, torch.float32, DEV)
        w.run(*args, out=o, lse=l_, **x["scales"])
        outs.append((o, l_))
    torch.cuda.synchronize()
    for i, (o, l_) in enumerate(outs):
        assert torch.equal(o, out), f"run {i}: {(o.float() - out.float()).abs().max().item()}"
        assert torch.equal(l_, lse), f"run {i} lse"
    head = _head(w)
    assert head[1] == 0 and head[2] == 0, head


# Many items per CTA: the cases and why, tests/gpu/cases.py WALK_MATRIX.


@pytest.mark.parametrize("name,tile", WALK_MATRIX, ids=[n + (f"-{t}" if t else "") for n, t in WALK_MATRIX])
def test_sm90_many_items_per_cta_match_reference(name, tile, workspace, monkeypatch):
    from attnjit import dispatch

    monkeypatch.setattr(dispatch, "num_sms", lambda device=None: 2)
    case = sm90_case(name)
    w, out, lse, ref_o, ref_lse = run_case(case, workspace, seed=zlib.crc32(name.encode()) % 1000 + 7, family="sm90",
                                           tile=tile)
    torch.cuda.synchronize()
    plan = w._plan
    assert w.last_plan["family"] == "sm90" and plan.spec.tile == tile
    assert plan.attn.grid[0] <= 2 < plan.work.num_items * plan.num_kv_heads, (plan.attn.grid, plan.work.num_items)
    assert_close(out, ref_o, torch.bfloat16 if case.kv else case.dtype)
    assert_lse_close(lse, ref_lse)
