"""plan() on the GPU host (issue 13 item 1): with host metadata it never synchronizes with the device; device
metadata plans the same work; graph-mode decode replays right after the fast re-plan.

Specs: the decode / paged prefill / ragged prefill bf16 head_dim 128 group 4 specs of cases.py (and the soft-cap and
ALiBi decode variants), all in specs/gpu-tests.toml.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import attnjit
from attnjit import reference

from ..helpers import assert_close, i32, make_paged, make_ragged, page_tables

DEV = "cuda"
H_Q, H_KV, D, PS = 32, 8, 128, 16
DT = torch.bfloat16


@contextlib.contextmanager
def no_device_sync():
    """torch raises on any synchronizing CUDA call inside the block (cudaMemcpy, stream/device synchronize, .item()
    and the like): plan() with host metadata must not make one."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _host_tables(b):
    return tuple(i32(x, "cpu") for x in (b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len))


def test_plan_with_host_metadata_never_synchronizes():
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    b = make_paged((5, 1, 9), (40, 17, 3000), page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=DT, device=DEV, seed=1)
    qo, kvp, idx, last = _host_tables(b)
    prefill = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
    decode = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    graph = attnjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=DEV),
                                                       use_cuda_graph=True)
    qo_r, kv_r, q_r, k_r, v_r = make_ragged((5, 1, 9), (40, 17, 300), num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                                            dtype=DT, device=DEV, seed=2)
    ragged = attnjit.BatchPrefillWithRaggedKVCacheWrapper(ws)
    q_dec = b.q[:3].contiguous()

    def plans():
        prefill.plan(qo, kvp, idx, last, H_Q, H_KV, D, PS, causal=True, q_data_type=DT)
        prefill.run(b.q, b.cache)
        decode.plan(kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT)
        decode.run(q_dec, b.cache)
        decode.plan(kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT, logits_soft_cap=30.0)
        decode.run(q_dec, b.cache)
        decode.plan(kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT, pos_encoding_mode="ALIBI")
        decode.run(q_dec, b.cache)
        graph.plan(kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT)
        graph.run(q_dec, b.cache)
        graph.fast_plan(kvp, idx, last)
        ragged.plan(i32(qo_r, "cpu"), i32(kv_r, "cpu"), H_Q, H_KV, D, causal=True, q_data_type=DT)
        ragged.run(q_r, k_r, v_r)

    plans()  # loads the modules and sizes the fixed buffers (which may allocate and synchronize once)
    with no_device_sync():
        for _ in range(3):
            plans()
    torch.cuda.synchronize()


def test_device_metadata_plans_the_same_work_as_host_metadata():
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    b = make_paged((5, 1, 9, 0, 40), (40, 17, 3000, 5, 40), page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV,
                   head_dim=D, dtype=DT, device=DEV, seed=3)
    plans = []
    for where in ("cpu", DEV):
        tables = tuple(i32(x, where) for x in (b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len))
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
        w.plan(*tables, H_Q, H_KV, D, PS, causal=True, q_data_type=DT)
        plans.append((w._plan.work.records.tolist(), w._plan.max_page, w.last_plan))
        out = w.run(b.q, b.cache)
        ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                       page_size=PS, causal=True)
        assert_close(out, ref, DT, what=f"metadata on {where}")
    assert plans[0] == plans[1]


def test_device_metadata_is_read_in_one_synchronizing_copy(monkeypatch):
    """Metadata on the device: plan() reads it in one synchronization (the page ids, or their min and max reduced on
    the device, carried with it), for decode and paged prefill, page ids past indptr[-1] being garbage. The syncs
    counted are torch's (its sync debug mode) and RawCuda's stream synchronizes (CuPy's calls, which torch does not
    see)."""
    import warnings

    from attnjit.ops._upload import RawCuda

    raw_syncs = []
    real_sync = RawCuda.sync
    monkeypatch.setattr(RawCuda, "sync", lambda self, stream: (raw_syncs.append(stream), real_sync(self, stream)))

    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    b = make_paged((5, 1, 9), (40, 17, 3000), page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=DT, device=DEV, seed=4)
    qo, kvp, idx, last = (i32(x, DEV) for x in (b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len))
    idx = torch.cat([idx, torch.full((7,), -5, dtype=torch.int32, device=DEV)])  # past the used part: ignored
    decode = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    prefill = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
    for _ in range(2):  # the first round loads the modules
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                raw_syncs.clear()
                decode.plan(kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT)
                n_decode = sum("synchroniz" in str(w.message) for w in caught) + len(raw_syncs)
                prefill.plan(qo, kvp, idx, last, H_Q, H_KV, D, PS, causal=True, q_data_type=DT)
                n_prefill = sum("synchroniz" in str(w.message) for w in caught) + len(raw_syncs) - n_decode
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert (n_decode, n_prefill) == (1, 1)
    assert decode._plan.max_page == prefill._plan.max_page == max(i32(b.kv_indices, "cpu").tolist())


def _graph_decode(pool: int, seed: int, engine_ids: bool = True):
    """A random paged cache of ``pool`` pages and a use_cuda_graph=True decode wrapper with a page-id buffer as long
    (engine_ids; else the wrapper's own, sized by the first plan)."""
    cache = torch.randn(pool, 2, PS, H_KV, D, generator=torch.Generator().manual_seed(seed)).to(DT).to(DEV)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    ids = torch.zeros(pool, dtype=torch.int32, device=DEV) if engine_ids else None
    return cache, attnjit.BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, paged_kv_indices_buffer=ids)


@pytest.mark.parametrize("engine_ids", [True, False], ids=["engine-ids", "own-ids"])
def test_cuda_graph_decode_replays_after_fast_plan(engine_ids, monkeypatch):
    """Capture run() once after plan(); each later step only calls fast_plan() with host metadata (other lengths and
    page tables, a split and an unsplit step among them) and replays: every replay matches the reference. Each
    fast_plan() takes the compiled path (MetadataBuffers.fast_decode), with the engine's page-id buffer or the
    wrapper's own (sized by the first plan: the longest step comes first there)."""
    from attnjit.ops._upload import MetadataBuffers

    fast = []
    real = MetadataBuffers.fast_decode
    monkeypatch.setattr(MetadataBuffers, "fast_decode", lambda *a, **k: fast.append(real(*a, **k)) or fast[-1])
    pool = 3000
    cache, w = _graph_decode(pool, seed=11, engine_ids=engine_ids)
    batch = 6
    q_buf = torch.zeros(batch, H_Q, D, dtype=DT, device=DEV)
    out_buf = torch.zeros(batch, H_Q, D, dtype=DT, device=DEV)
    steps = [(5, 17, 64, 100, 1, 33), (9000, 20, 1, 700, 4100, 16), (300, 301, 302, 1, 2, 3), (1, 1, 1, 1, 1, 1)]
    if not engine_ids:
        steps[:2] = steps[1::-1]
    graph, splits = None, []
    for step, kv_lens in enumerate(steps):
        indptr, indices, last = page_tables(kv_lens, PS, pool, seed=step)
        host = (i32(indptr), i32(indices), i32(last))
        if graph is None:
            w.plan(*host, H_Q, H_KV, D, PS, q_data_type=DT)
        else:
            w.fast_plan(*host)
        splits.append(w.last_plan["split_kv"])
        q = torch.randn(batch, H_Q, D, generator=torch.Generator().manual_seed(100 + step)).to(DT).to(DEV)
        q_buf.copy_(q)
        if graph is None:
            w.run(q_buf, cache, out=out_buf)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q_buf, cache, out=out_buf)
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference.batch_decode(q, cache, indptr, indices, last, page_size=PS)
        assert_close(out_buf, ref, DT, what=f"replay {step}")
    assert any(splits) and not all(splits), splits
    assert len(fast) == len(steps) - 1 and all(f is not None for f in fast), "a fast_plan() took the full path"


def test_plan_inside_a_graph_capture_is_refused_by_name():
    """plan() and fast_plan() while the stream captures a graph raise a RuntimeError naming the call; the capture
    ends cleanly and the wrapper still plans and runs afterwards."""
    pool = 64
    cache, w = _graph_decode(pool, seed=3)
    indptr, indices, last = page_tables((40, 7), PS, pool, seed=1)
    host = (i32(indptr), i32(indices), i32(last))
    w.plan(*host, H_Q, H_KV, D, PS, q_data_type=DT)
    torch.cuda.synchronize()
    for call, what in ((lambda: w.plan(*host, H_Q, H_KV, D, PS, q_data_type=DT), r"\.plan\(\)"),
                       (lambda: w.fast_plan(*host), r"\.fast_plan\(\)")):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match=what + r" was called while the current CUDA stream is capturing"):
            with torch.cuda.graph(graph):
                call()
    w.plan(*host, H_Q, H_KV, D, PS, q_data_type=DT)
    q = torch.randn(2, H_Q, D, generator=torch.Generator().manual_seed(4)).to(DT).to(DEV)
    out = w.run(q, cache)
    ref, _ = reference.batch_decode(q, cache, indptr, indices, last, page_size=PS)
    assert_close(out, ref, DT, what="after the refused captures")


def test_metadata_copies_go_through_the_runtime_and_match_torchs(monkeypatch):
    """On a GPU the metadata copies and events go through CuPy's runtime calls (RawCuda); ATTNJIT_NATIVE=0 gives
    torch's. Both put the same ints on the device, and behind a busy stream a kept staging buffer is not rewritten
    while its copy is in flight (the third plan takes a one-off buffer, copied by torch)."""
    import numpy as np

    from attnjit.ops._upload import MetadataBuffers, RawEvent

    dev = torch.device("cuda", torch.cuda.current_device())
    raw = MetadataBuffers(dev, False, None)
    assert raw.raw is not None
    monkeypatch.setenv("ATTNJIT_NATIVE", "0")
    plain = MetadataBuffers(dev, False, None)
    assert plain.raw is None
    records = np.arange(5 * 12, dtype=np.int32).reshape(5, 12)
    ids = i32(list(range(40, 80)), "cpu")
    kept: list[list] = [[], [], [], []]
    torch.cuda._sleep(200_000_000)   # the copies queue behind ~0.1 s of GPU time
    for i in range(3):
        raw.upload(records + 100 * i, num_groups=1, num_kv_heads=2, page_ids=ids, used=40, keep=kept[i])
    assert len(raw.staging) == 2 and not any(s.free() for s in raw.staging)
    assert all(type(s.event) is RawEvent for s in raw.staging)
    plain.upload(records, num_groups=1, num_kv_heads=2, page_ids=ids, used=40, keep=kept[3])
    torch.cuda.synchronize()
    assert all(s.free() for s in raw.staging)
    n = kept[3][0].numel()   # the plan's ints: a kept device buffer (the first two plans) may be longer
    assert n == 106 and kept[0][0][:n].tolist() == kept[3][0].tolist()
    # both kept device buffers leased (the plans hold kept[0], kept[1]): the third plan's is a fresh one
    assert kept[0][0].data_ptr() != kept[1][0].data_ptr() and kept[2][0].numel() == n
    for i in range(3):
        got = kept[i][0][:n].cpu()
        assert got[:4].tolist() == [5, 0, 0, 0] and got[4:64].tolist() == (records + 100 * i).reshape(-1).tolist()
        assert got[64:66].tolist() == [0, 0] and got[66:].tolist() == list(range(40, 80))


def test_read_back_of_device_metadata_matches_planner_to_host():
    """MetadataBuffers.to_host (pinned read-back through RawCuda) gives planner.to_host's values for host, dense,
    empty and 0-d device tensors; a strided view goes to planner.to_host; the buffer grows for a longer batch."""
    from attnjit.ops import planner
    from attnjit.ops._upload import MetadataBuffers

    meta = MetadataBuffers(torch.device("cuda", torch.cuda.current_device()), False, None)
    assert meta.raw is not None
    host = i32([3, 1, 4], "cpu")
    dense = torch.arange(7, dtype=torch.int32, device=DEV) * 3
    empty = torch.empty(0, dtype=torch.int32, device=DEV)
    lo, hi = torch.aminmax(dense)
    longer = torch.arange(5000, dtype=torch.int32, device=DEV)
    for args in ((host, dense, empty, lo, hi), (dense[::2], host), (longer,)):
        got = meta.to_host(*args)
        want = planner.to_host(*args)
        assert [g.shape for g in got] == [w.shape for w in want] and all(g.device.type == "cpu" for g in got)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert meta._readback.numel() >= 5000 and meta._readback.is_pinned()
    # the same sizes again, as every engine step: fresh values each time (the buffer is reused)
    a, b, c = (torch.arange(n, dtype=torch.int32, device=DEV) for n in (3, 1, 129))
    for step in range(4):
        for t in (a, b, c):
            t.add_(step * 1000 + 1)
        args = (a, host, b, c, empty, a[0])
        got = meta.to_host(*args)
        assert [g.tolist() for g in got] == [w.tolist() for w in planner.to_host(*args)], step


def test_read_back_joins_neighbours_of_one_allocation_and_only_those(monkeypatch):
    """Device metadata that lies close together in one allocation (slices of one buffer, or small tensors the
    caching allocator placed side by side) comes back in one copy; tensors in separate allocations and tensors too
    far apart each in their own; every value equals planner.to_host's either way, also when
    the bytes between the tensors change between calls."""
    from attnjit.ops import planner
    from attnjit.ops._upload import MetadataBuffers, RawCuda

    copies = []
    real = RawCuda.copy_back
    monkeypatch.setattr(RawCuda, "copy_back", lambda self, dst, src, n, stream: (copies.append(n),
                                                                                 real(self, dst, src, n, stream)))
    meta = MetadataBuffers(torch.device("cuda", torch.cuda.current_device()), False, None)
    assert meta.raw.allocation(torch.empty(4, dtype=torch.int32, device=DEV).data_ptr()) is not None
    whole = torch.arange(4096, dtype=torch.int32, device=DEV)
    qo, kv, last, ids = whole[0:3], whole[100:103], whole[200:202], whole[1000:1128]
    big_a = torch.full((3 << 20,), 7, dtype=torch.int32, device=DEV)   # 12 MB each: their own segments
    big_b = torch.full((3 << 20,), 9, dtype=torch.int32, device=DEV)
    cases = [((qo, kv, last, ids), 1), ((ids, qo, last), 1), ((qo, big_a[:4], big_b[-4:], kv), 3),
             ((whole[:2], whole[-2:]), 1), ((big_a[:2], big_a[-2:]), 2)]
    for step in range(3):
        whole.add_(step * 5000)
        big_a.add_(1)
        for args, n in cases:
            copies.clear()
            got = meta.to_host(*args)
            assert [g.tolist() for g in got] == [w.tolist() for w in planner.to_host(*args)], (step, n)
            assert len(copies) == n, (step, n, copies)
