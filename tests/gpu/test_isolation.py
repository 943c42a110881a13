"""What a request's output may depend on: its own keys and values, nothing else in the cache.

An engine allocates its KV cache with torch.empty and frees pages without clearing them, so the slots no request
uses (past the last page's length, the spare pages) hold whatever bits were there, NaN among them; and one request's
data may be NaN (a broken upstream layer) while its neighbours' is not. Kernels load whole tiles and hide the keys
they must not see by masking their logits, but a hidden key's value still meets its zero weight in P V, and 0 * NaN is
NaN: a hidden slot that is loaded, not zero-filled, turns a healthy request's row into NaN (attnjit/kv_load.cuh and
sm90/tma.cuh zero-fill every row past a request's end for this reason). Here the unused slots are NaN bits (all ones:
NaN in fp16, bf16 and both fp8 formats) and must not reach any output; and a NaN value in one request (paged: request
0's first key; ragged: request 1, whose keys start where request 0's 40 end, mid-tile, and rows of NaN past the last
request) makes that request's rows NaN (split plans merge it in, attnjit/merge_state.cuh) and leaves every other
request's rows as the reference's.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from attnjit import reference

from ..helpers import assert_close, assert_lse_close, poisoned, quantize_cache
from .cases import MATRIX
from .test_attention import DEV, _cache_arg, plan_case, workspace  # noqa: F401 (the fixture)

NAMES = ("base", "paged-p1", "paged-p48", "paged-p1024", "paged-hnd", "paged-split-forced", "paged-long-autosplit",
         "decode", "decode-med-split-forced", "decode-p1", "decode-p48", "decode-hnd", "fp8-decode-e4m3",
         "ragged", "ragged-split-forced")
CASES = [(c, f) for c, f in MATRIX if c.name in NAMES]


def _used_slots(b) -> torch.Tensor:
    """bool [pages, page_size]: the slots some request's page table covers."""
    used = torch.zeros(b.cache.shape[0], b.page_size, dtype=torch.bool)
    for i in range(len(b.kv_indptr) - 1):
        pages = b.kv_indices[b.kv_indptr[i]:b.kv_indptr[i + 1]]
        for j, p in enumerate(pages):
            used[p, :b.page_size if j < len(pages) - 1 else b.last_page_len[i]] = True
    return used


def _slot_major(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of the 5-D cache as [pages, page_size, 2, H_kv, D] (NHD or HND), writes reaching the cache."""
    return cache.transpose(1, 2) if layout == "NHD" else cache.permute(0, 3, 1, 2, 4)


def _nan_tail(t: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """``t`` as the first rows of a larger tensor whose rows past it are NaN (what a loader reading past the last
    request would meet)."""
    big = torch.full((t.shape[0] + rows, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
    big[:t.shape[0]] = t
    return big[:t.shape[0]]


@pytest.mark.parametrize("case,family", CASES, ids=[f"{c.name}-{f}" for c, f in CASES])
def test_nan_in_unused_slots_and_in_another_request_never_reaches_a_request(case, family, workspace):
    if case.kv and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 below sm_89 converts by bit tricks that read e4m3's NaN as -480 (attnjit/fp8.cuh)")
    w, x = plan_case(case, workspace, seed=zlib.crc32(case.name.encode()) % 1000, family=family)
    scales = x["scales"]
    bad = 1 if case.kind == "ragged" else 0   # the request whose value is NaN
    assert case.kind == "decode" or case.qo_lens[bad] <= case.kv_lens[bad]   # so each of its rows sees its key 0
    if case.kind == "ragged":   # no unused slots: request 1's values NaN, and NaN rows past the last request
        q, k, v = x["q"], x["k"], x["v"]
        ref_o, ref_lse = reference.batch_ragged(q, k, v, x["qo_indptr"], x["kv_indptr"], causal=case.causal, **scales)
        kvp, qo = x["kv_indptr"], x["qo_indptr"]
        assert kvp[bad] % 64 and kvp[bad + 1] > kvp[bad]   # it starts mid-tile, after request 0's keys
        k, v = _nan_tail(k), _nan_tail(v)
        v[kvp[bad]:kvp[bad + 1]] = float("nan")
        out, lse = poisoned(q.shape, case.dtype, DEV), poisoned(q.shape[:2], torch.float32, DEV)
        w.run(q, k, v, out=out, lse=lse, **scales)
        rows_bad = slice(qo[bad], qo[bad + 1])
    else:
        b, kv_dtype = x["paged"], x["kv_dtype"]
        full = b.cache if kv_dtype is None else quantize_cache(b.cache, scales["k_scale"], scales["v_scale"],
                                                              case.layout, kv_dtype)
        ref_o, ref_lse = reference.batch_paged(b.q, full, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                               page_size=case.page_size, causal=case.causal and case.kind != "decode",
                                               layout=case.layout, **scales)
        dirty = full.clone()
        unused = ~_used_slots(b).to(DEV)
        assert unused.any()   # every case has a short last page or spare pages
        slots = _slot_major(dirty.view(torch.uint8), case.layout)   # bytes, [pages, page_size, 2, H_kv, ...]
        slots[unused] = 0xFF   # NaN bits, keys and values
        # request 0's first value (slot 0 of its first page), every kv head: NaN
        p0 = b.kv_indices[b.kv_indptr[0]]
        slots[p0, 0, 1] = 0xFF
        assert _slot_major(dirty.view(torch.uint8), case.layout)[p0, 0, 1].eq(0xFF).all()   # written through the view
        out, lse = poisoned(b.q.shape, case.dtype, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
        w.run(b.q, _cache_arg(dirty, as_tuple=case.dtype == torch.float16), out=out, lse=lse, **scales)
        rows_bad = slice(b.qo_indptr[0], b.qo_indptr[1])   # decode: qo_indptr is 0, 1, 2, ...
    torch.cuda.synchronize()
    assert rows_bad.stop > rows_bad.start   # the request has query rows, and every one of them sees its key 0
    assert torch.isnan(out[rows_bad]).all(), out[rows_bad].isnan().float().mean().item()
    assert_lse_close(lse[rows_bad], ref_lse[rows_bad])   # NaN values leave the keys' lse as it was
    rest = torch.ones(out.shape[0], dtype=torch.bool, device=DEV)
    rest[rows_bad] = False
    assert_close(out[rest], ref_o[rest], torch.bfloat16 if case.kv else case.dtype)
    assert_lse_close(lse[rest], ref_lse[rest])
