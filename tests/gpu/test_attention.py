"""Attention kernels against the float64 reference: the whole matrix of tests/gpu/cases.py, plus CUDA graphs."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import attnjit
from attnjit import dtypes, reference

from ..helpers import (assert_close, assert_lse_close, fp8_kwargs, i32, make_paged, make_ragged, page_tables, poisoned,
                       quantize, quantize_cache)
from .cases import BACKEND, MATRIX, TILE_MATRIX, Case

DEV = "cuda"
WORKSPACE_BYTES = 256 << 20


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)


def _split_kwargs(case: Case) -> dict:
    return {"force": {"fixed_split_size": 128}, "off": {"disable_split_kv": True}}.get(case.split, {})


def _cache_arg(cache: torch.Tensor, as_tuple: bool):
    """The 5-D cache, or (k, v) as two separately allocated tensors (other page strides)."""
    return (cache[:, 0].contiguous(), cache[:, 1].contiguous()) if as_tuple else cache


def plan_case(case: Case, workspace, seed: int, family: str = "fa2", tile: str | None = None, device=DEV):
    """The case's inputs on ``device`` and a wrapper planned for them: (wrapper, inputs). The plan half of run_case,
    also run on the host by tests/test_case_plans.py (every case must plan within this module's workspace)."""
    hq, hkv = case.heads
    d = case.head_dim
    kv_plan, scales = fp8_kwargs(case.kv, case.scale, case.heads[1], device)
    kv_dtype = dtypes.lookup(case.kv).torch if case.kv else None
    if case.kind == "ragged":
        qo_indptr, kv_indptr, q, k, v = make_ragged(case.qo_lens, case.kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                                                    head_dim=d, dtype=case.dtype, device=device, seed=seed,
                                                    offset=case.offset, ramp=case.ramp)
        if kv_dtype is not None:
            k, v = quantize(k, scales["k_scale"], 1, kv_dtype), quantize(v, scales["v_scale"], 1, kv_dtype)
        w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend=BACKEND[family], tile=tile)
        w.plan(i32(qo_indptr, device), i32(kv_indptr, device), hq, hkv, d, causal=case.causal,
               q_data_type=case.dtype, **kv_plan, **_split_kwargs(case))
        return w, dict(scales=scales, q=q, k=k, v=v, qo_indptr=qo_indptr, kv_indptr=kv_indptr)
    qo_lens = (1,) * len(case.kv_lens) if case.kind == "decode" else case.qo_lens
    b = make_paged(qo_lens, case.kv_lens, page_size=case.page_size, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                   dtype=case.dtype, layout=case.layout, device=device, shared_prefix=case.shared_prefix, seed=seed,
                   offset=case.offset)
    qo_t, kvp_t, idx_t, last_t = b.tensors(device)
    if case.kind == "decode":
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout=case.layout, backend=BACKEND[family])
        w.plan(kvp_t, idx_t, last_t, hq, hkv, d, case.page_size, q_data_type=case.dtype, **kv_plan,
               **_split_kwargs(case))
    else:
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout=case.layout, backend=BACKEND[family],
                                                        tile=tile)
        w.plan(qo_t, kvp_t, idx_t, last_t, hq, hkv, d, case.page_size, causal=case.causal, q_data_type=case.dtype,
               **kv_plan, **_split_kwargs(case))
    return w, dict(scales=scales, paged=b, kv_dtype=kv_dtype)


def run_case(case: Case, workspace, seed: int, family: str = "fa2", tile: str | None = None):
    w, x = plan_case(case, workspace, seed, family, tile)
    scales = x["scales"]
    if case.kind == "ragged":
        q, k, v = x["q"], x["k"], x["v"]
        out, lse = poisoned(q.shape, case.dtype, DEV), poisoned(q.shape[:2], torch.float32, DEV)
        w.run(q, k, v, out=out, lse=lse, **scales)
        ref_o, ref_lse = reference.batch_ragged(q, k, v, x["qo_indptr"], x["kv_indptr"], causal=case.causal,
                                                **scales)
        return w, out, lse, ref_o, ref_lse
    b, kv_dtype = x["paged"], x["kv_dtype"]
    full = b.cache if kv_dtype is None else quantize_cache(b.cache, scales["k_scale"], scales["v_scale"], case.layout,
                                                          kv_dtype)
    cache = _cache_arg(full, as_tuple=case.dtype == torch.float16)
    out, lse = poisoned(b.q.shape, case.dtype, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
    w.run(b.q, cache, out=out, lse=lse, **scales)
    ref_o, ref_lse = reference.batch_paged(b.q, full, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                           page_size=case.page_size, causal=case.causal and case.kind != "decode",
                                           layout=case.layout, **scales)
    return w, out, lse, ref_o, ref_lse


@pytest.mark.parametrize("case,family", MATRIX, ids=[f"{c.name}-{f}" for c, f in MATRIX])
def test_matches_reference(case: Case, family: str, workspace):
    w, out, lse, ref_o, ref_lse = run_case(case, workspace, seed=zlib.crc32(case.name.encode()) % 1000,
                                           family=family)
    torch.cuda.synchronize()
    assert w.last_plan["family"] == family and w._plan.spec == case.spec(family)
    assert_close(out, ref_o, torch.bfloat16 if case.kv else case.dtype)  # fp8: within the bf16 tolerance
    assert_lse_close(lse, ref_lse)
    decision = w.last_plan
    if family == "sm90":  # what the run copied by TMA: all it can (these tensors are contiguous and aligned)
        assert decision["tma"] == _expected_tma(w._plan), decision
        assert decision["work_order"] == "claimed", decision  # ATTNJIT_WORK_CLAIMS's default
    if case.split == "force" and max(case.kv_lens) > 128:
        assert decision["split_kv"], decision
    if case.split == "off":
        assert not decision["split_kv"], decision
    if case.name.endswith("autosplit") or case.name == "decode-128k":
        assert decision["split_kv"], decision


def _expected_tma(plan) -> str:
    """The TMA copies a contiguous run of ``plan`` takes: Q where its kernel has a Q box and the batch holds a box of
    tokens, K/V where its kernel has a K/V box (a ragged cache of at least one tile's tokens; K alone where it gathers
    V), O where its kernel has an output box and the batch holds a box of tokens."""
    from attnjit.families import sm90

    q_box, kv_rows, o_box = sm90.tma_boxes(plan.spec, plan.work.tile)
    used = []
    if q_box is not None and plan.total_q >= q_box[1] // q_box[0]:
        used.append("q")
    if kv_rows and (plan.spec.kv == "paged" or plan.total_kv >= kv_rows):
        used.append("k" if sm90.tma_v_gather(plan.spec, plan.work.tile) else "kv")  # V gathered: K's box only
    if o_box is not None and plan.total_q >= o_box[1] // o_box[0]:
        used.append("o")
    return "+".join(used)


# the same cases with the TMA copies off (ATTNJIT_TMA=0): the cp.async copies of the same kernels, still correct
NO_TMA = [(c, f) for c, f in MATRIX if f == "sm90" and c.kind != "decode" and not c.kv][:12]


@pytest.mark.parametrize("case,family", NO_TMA, ids=[f"{c.name}-{f}-notma" for c, f in NO_TMA])
def test_sm90_without_tma_matches_reference(case: Case, family: str, workspace, monkeypatch):
    monkeypatch.setenv("ATTNJIT_TMA", "0")
    w, out, lse, ref_o, ref_lse = run_case(case, workspace, seed=zlib.crc32(case.name.encode()) % 1000 + 7,
                                           family=family)
    torch.cuda.synchronize()
    assert w.last_plan["tma"] == "", w.last_plan
    assert_close(out, ref_o, case.dtype)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("case,tile", TILE_MATRIX, ids=[f"{c.name}-sm90-{t}" for c, t in TILE_MATRIX])
def test_sm90_tile_configurations_match_reference(case: Case, tile: str, workspace):
    """The sm90 family's other tile configurations (what attnjit tune chooses among) compute the same attention."""
    w, out, lse, ref_o, ref_lse = run_case(case, workspace, seed=zlib.crc32(case.name.encode()) % 1000 + 1,
                                           family="sm90", tile=tile)
    torch.cuda.synchronize()
    assert w._plan.spec == case.spec("sm90").replace(tile=tile) and w.last_plan["family"] == "sm90"
    assert_close(out, ref_o, case.dtype)
    assert_lse_close(lse, ref_lse)


def test_tuning_record_picks_the_tile_plan_runs(workspace, tmp_path, monkeypatch):
    """attnjit tune on this GPU writes a record; a fresh wrapper's plan() then runs the recorded tile, and the
    dispatch record names it."""
    from attnjit import families, tuning
    from attnjit.cache import Cache
    from attnjit.families import tiles_for
    from attnjit.tune import tune

    monkeypatch.setenv("ATTNJIT_CACHE_DIR", str(tmp_path / "cache"))
    tuning.clear_memo()
    spec = Case("t", "paged", (1,), (1,)).spec("sm90")
    said = []
    outcome = tune(spec, batch=2, length=512, reps=3, cache=Cache(tmp_path / "cache"), say=said.append)
    names = families.tunable_names(spec)
    # progress before each tile is planned (a cold cache compiles there), then the timing, then one line a tile
    assert [m for m in said if "planning tile" in m] == [
        f"  {spec.short_name()}: planning tile {n} ({i}/{len(names)}; compiles it unless it is cached)"
        for i, n in enumerate(names, 1)]
    assert said.index(next(m for m in said if "interleaved" in m)) == len(names)
    assert outcome.best in names and set(outcome.ms) == set(names) and len(names) >= 3
    b = make_paged((300,), (400,), page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=torch.bfloat16, device=DEV, seed=12)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
    w.plan(*b.tensors(DEV), 32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16)
    assert w._plan.spec.tile == (None if outcome.best == "kv128" else outcome.best)
    with attnjit.recording() as rec:
        out = w.run(b.q, b.cache)
    assert rec[0].plan["tile"] == tiles_for(w._plan.spec)[0].name
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   page_size=16, causal=True)
    assert_close(out, ref, torch.bfloat16)
    tuning.clear_memo()


def test_fresh_inputs_reuse_plan(workspace):
    """Two runs of one plan with different inputs: both right (no state leaks between runs)."""
    b = make_paged((5, 1, 9), (40, 17, 300), page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=torch.bfloat16, device=DEV, seed=1)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
    w.plan(*b.tensors(DEV), 32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16, fixed_split_size=64)
    for seed in (2, 3):
        q = torch.randn(b.q.shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEV)
        out = w.run(q, b.cache)
        ref, _ = reference.batch_paged(q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                       page_size=16, causal=True)
        assert_close(out, ref, torch.bfloat16)


def test_empty_batch(workspace):
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
    w.plan(i32([0], DEV), i32([0], DEV), i32([], DEV), i32([], DEV), 32, 8, 128, 16, causal=True,
           q_data_type=torch.bfloat16)
    cache = torch.randn(2, 2, 16, 8, 128, device=DEV, dtype=torch.bfloat16)
    out, lse = w.run(torch.empty(0, 32, 128, device=DEV, dtype=torch.bfloat16), cache, return_lse=True)
    assert out.shape == (0, 32, 128) and lse.shape == (0, 32)


def test_noncausal_row_with_empty_history(workspace):
    """A non-causal request with queries but no keys: o = 0, lse = -inf (a fully masked row)."""
    b = make_paged((2, 3), (0, 20), page_size=16, num_qo_heads=8, num_kv_heads=8, head_dim=128,
                   dtype=torch.float16, device=DEV, seed=4)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
    w.plan(*b.tensors(DEV), 8, 8, 128, 16, causal=False, q_data_type=torch.float16)
    out, lse = w.run(b.q, b.cache, out=poisoned(b.q.shape, torch.float16, DEV),
                     lse=poisoned(b.q.shape[:2], torch.float32, DEV), return_lse=True)
    assert torch.equal(out[:2].float(), torch.zeros_like(out[:2].float()))
    assert torch.isinf(lse[:2]).all() and (lse[:2] < 0).all()
    ref_o, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                           page_size=16, causal=False)
    assert_close(out, ref_o, torch.float16)
    assert_lse_close(lse, ref_lse)


def test_single_prefill_and_decode():
    gen = torch.Generator().manual_seed(7)
    for layout in ("NHD", "HND"):
        q = torch.randn(37, 32, 128, generator=gen).to(torch.float16).to(DEV)
        k = torch.randn(90, 8, 128, generator=gen).to(torch.float16).to(DEV)
        v = torch.randn(90, 8, 128, generator=gen).to(torch.float16).to(DEV)
        kk, vv = (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()) if layout == "HND" else (k, v)
        for causal in (True, False):
            o, lse = attnjit.single_prefill_with_kv_cache(q, kk, vv, causal=causal, kv_layout=layout,
                                                          return_lse=True)
            ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
            assert_close(o, ref_o, torch.float16)
            assert_lse_close(lse, ref_lse)
        od = attnjit.single_decode_with_kv_cache(q[0], kk, vv, kv_layout=layout)
        ref_o, _ = reference.attention(q[:1], k, v, causal=False)
        assert_close(od, ref_o[0], torch.float16)


def _replay(graph, w, q_buf, cache, out_buf):
    """Capture w.run into a graph the first time (after a warm-up run), then replay it into a poisoned out_buf."""
    if graph is None:
        w.run(q_buf, cache, out=out_buf)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            w.run(q_buf, cache, out=out_buf)
    out_buf.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _graph_pool(page_size, pages, dtype):
    return torch.randn(pages, 2, page_size, 8, 128, generator=torch.Generator().manual_seed(11)).to(dtype).to(DEV)


def test_cuda_graph_decode_replays_after_replan(workspace):
    """Capture run() once; re-plan with other lengths and page tables of the same batch size; replay is right."""
    ps, pool, dtype = 16, 3000, torch.bfloat16
    cache = _graph_pool(ps, pool, dtype)
    indices_buf = torch.zeros(pool, dtype=torch.int32, device=DEV)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, paged_kv_indices_buffer=indices_buf)
    batch = 6
    q_buf = torch.zeros(batch, 32, 128, dtype=dtype, device=DEV)
    out_buf = torch.zeros(batch, 32, 128, dtype=dtype, device=DEV)
    graph = None
    decisions = []
    for step, kv_lens in enumerate([(5, 17, 64, 100, 1, 33), (9000, 20, 1, 700, 4100, 16), (300, 301, 302, 1, 2, 3)]):
        indptr, indices, last = page_tables(kv_lens, ps, pool, seed=step)
        w.plan(i32(indptr, DEV), i32(indices, DEV), i32(last, DEV), 32, 8, 128, ps, q_data_type=dtype)
        decisions.append(w.last_plan["split_kv"])
        q = torch.randn(batch, 32, 128, generator=torch.Generator().manual_seed(100 + step)).to(dtype).to(DEV)
        q_buf.copy_(q)
        graph = _replay(graph, w, q_buf, cache, out_buf)
        ref, _ = reference.batch_decode(q, cache, indptr, indices, last, page_size=ps)
        assert_close(out_buf, ref, dtype, what=f"replay {step}")
    assert decisions[1] and not decisions[0], "the second plan should split (long history), the first not"


@pytest.mark.parametrize("family", ["fa2", "sm90"])
def test_cuda_graph_prefill_replays_after_replan(workspace, family):
    ps, pool, dtype = 16, 400, torch.float16
    cache = _graph_pool(ps, pool, dtype)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True, backend=BACKEND[family],
                                                    paged_kv_indices_buf=torch.zeros(pool, dtype=torch.int32,
                                                                                     device=DEV))
    total = 40
    q_buf = torch.zeros(total, 32, 128, dtype=dtype, device=DEV)
    out_buf = torch.zeros(total, 32, 128, dtype=dtype, device=DEV)
    graph = None
    for step, (qo, kv) in enumerate([((30, 1, 9), (30, 50, 900)), ((1, 38, 1), (2000, 38, 5))]):
        indptr, indices, last = page_tables(kv, ps, pool, seed=step)
        qo_indptr = [0, qo[0], qo[0] + qo[1], total]
        w.plan(i32(qo_indptr, DEV), i32(indptr, DEV), i32(indices, DEV), i32(last, DEV), 32, 8, 128, ps,
               causal=True, q_data_type=dtype)
        q = torch.randn(total, 32, 128, generator=torch.Generator().manual_seed(200 + step)).to(dtype).to(DEV)
        q_buf.copy_(q)
        graph = _replay(graph, w, q_buf, cache, out_buf)
        assert w.last_plan["family"] == family
        ref, _ = reference.batch_paged(q, cache, qo_indptr, indptr, indices, last, page_size=ps, causal=True)
        assert_close(out_buf, ref, dtype, what=f"replay {step}")


def test_cuda_graph_replan_that_does_not_fit_the_capture_is_refused_and_the_graph_still_replays():
    """After a capture over 40 query rows: a re-plan of 24 rows replays into the first 24 (the rest untouched); one
    of 48 rows (past the captured q and out) or with another sm_scale (which the captured struct carries) is refused
    before anything is written, and the graph then still replays the 24-row plan right."""
    ps, pool, dtype = 16, 400, torch.float16
    cache = _graph_pool(ps, pool, dtype)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True)
    q_buf = torch.zeros(40, 32, 128, dtype=dtype, device=DEV)
    out_buf = torch.zeros(40, 32, 128, dtype=dtype, device=DEV)

    def plan(qo, kv, seed, **opts):
        indptr, indices, last = page_tables(kv, ps, pool, seed=seed)
        qo_indptr = [0, qo[0], qo[0] + qo[1], sum(qo)]
        w.plan(i32(qo_indptr, DEV), i32(indptr, DEV), i32(indices, DEV), i32(last, DEV), 32, 8, 128, ps,
               causal=True, q_data_type=dtype, **opts)
        return qo_indptr, indptr, indices, last

    plan((30, 1, 9), (30, 50, 900), 0)
    graph = _replay(None, w, q_buf, cache, out_buf)
    meta = plan((10, 4, 10), (700, 4, 10), 1)
    q = torch.randn(40, 32, 128, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEV)
    q_buf.copy_(q)
    for attempt in range(2):
        _replay(graph, w, q_buf, cache, out_buf)
        ref, _ = reference.batch_paged(q[:24], cache, *meta, page_size=ps, causal=True)
        assert_close(out_buf[:24], ref, dtype, what=f"replay {attempt}")
        assert torch.isnan(out_buf[24:].float()).all(), "the replay wrote rows past the plan's"
        if attempt == 0:
            with pytest.raises(ValueError, match="48 query rows but q and out of the captured run"):
                plan((16, 16, 16), (16, 16, 16), 2)
            with pytest.raises(ValueError, match="sm_scale"):
                plan((10, 4, 10), (700, 4, 10), 1, sm_scale=0.05)


def test_run_rejects_tensors_that_do_not_match_the_plan(workspace):
    b = make_paged((3, 1), (10, 5), page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=torch.bfloat16, device=DEV, seed=5)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
    w.plan(*b.tensors(DEV), 32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be"):
        w.run(b.q[:3], b.cache)
    with pytest.raises(ValueError, match="q must be"):
        w.run(b.q.half(), b.cache)
    with pytest.raises(ValueError, match="paged_kv_cache must be"):
        w.run(b.q, b.cache.half())
    small = b.cache[:1]
    if max(b.kv_indices) >= 1:
        with pytest.raises(ValueError, match="page id"):
            w.run(b.q, small)
    assert math.isfinite(w.run(b.q, b.cache).float().sum().item())


@pytest.mark.parametrize("kv_lens,tile", [((20000,), "q16_kv64_w1x4_deep"), ((3000, 9), "q16_kv64_w1x4_deep"),
                                          ((700,) * 40, "q16_kv64_w1x4")])
def test_decode_takes_the_deep_tile_only_when_the_batch_cannot_fill_the_gpu(workspace, kv_lens, tile):
    """head_dim 128: a batch whose requests x KV heads cannot fill the GPU runs the deep-pipeline tile (split-KV,
    one CTA per SM); a batch that fills it keeps the standard tile. Both against the reference."""
    b = make_paged((1,) * len(kv_lens), kv_lens, page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=torch.bfloat16, device=DEV, seed=len(kv_lens))
    _, kvp, idx, last = b.tensors(DEV)
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
    w.plan(kvp, idx, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    out, lse = poisoned(b.q.shape, torch.bfloat16, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
    w.run(b.q, b.cache, out=out, lse=lse)
    assert w.last_plan["tile"] == tile
    assert w.last_plan["split_kv"] == (tile.endswith("deep") and max(kv_lens) > 512)
    ref_o, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                           page_size=16, causal=False)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("kv_lens,tile", [((20000,), "q16_kv128_w1x8_deep"), ((3000, 9), "q16_kv128_w1x8_deep"),
                                          ((700,) * 40, "q16_kv64_w1x4")])
def test_fp8_decode_takes_its_deep_tile_only_when_the_batch_cannot_fill_the_gpu(workspace, kv_lens, tile):
    """An e4m3 cache at head_dim 128 (bf16 q, scale 1/8): a batch that cannot fill the GPU runs the fp8 deep tile
    (eight warps, one CTA an SM: fa2.deep_fp8_decode_tile), a full one the narrow tile; both against the float64
    reference of the dequantized cache."""
    b = make_paged((1,) * len(kv_lens), kv_lens, page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=torch.bfloat16, device=DEV, seed=7 + len(kv_lens))
    _, kvp, idx, last = b.tensors(DEV)
    cache8 = (b.cache.float() * 8).to(torch.float8_e4m3fn)
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
    w.plan(kvp, idx, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    out, lse = poisoned(b.q.shape, torch.bfloat16, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
    w.run(b.q, cache8, out=out, lse=lse, k_scale=0.125, v_scale=0.125)
    assert w.last_plan["tile"] == tile
    assert w.last_plan["split_kv"] == (tile.endswith("deep") and max(kv_lens) > 512)
    ref_o, ref_lse = reference.batch_paged(b.q, cache8, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                           page_size=16, causal=False, k_scale=0.125, v_scale=0.125)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("indices_on_host", [False, True])
def test_plan_takes_host_metadata(workspace, indices_on_host):
    """qo_indptr / kv indptr / last_page_len on the host (FlashInfer accepts both; it spares plan() a device-to-host
    copy), page ids on the host or the device: the same results as the reference, for prefill and decode."""
    b = make_paged((5, 1, 9), (40, 17, 300), page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=torch.bfloat16, device=DEV, seed=11)
    qo, kvp, idx, last = (i32(x, "cpu") for x in (b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len))
    if not indices_on_host:
        idx = idx.to(DEV)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
    w.plan(qo, kvp, idx, last, 32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16)
    out = poisoned(b.q.shape, torch.bfloat16, DEV)
    w.run(b.q, b.cache, out=out)
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   page_size=16, causal=True)
    assert_close(out, ref, torch.bfloat16)
    d = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
    d.plan(kvp, idx, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    q = b.q[:3].contiguous()
    out = poisoned(q.shape, torch.bfloat16, DEV)
    d.run(q, b.cache, out=out)
    ref, _ = reference.batch_decode(q, b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, page_size=16)
    assert_close(out, ref, torch.bfloat16)
