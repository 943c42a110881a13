"""plan()'s state on the CPU: the device-metadata layout and graph-mode capacity (the code a GPU plan runs, with a
CPU "device"), both metadata paths (lists for small batches, arrays for large ones) holding every rule, and the
graph-mode decode fast re-plan (issue 13 item 1)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from attnjit.errors import NoGPUError
from attnjit.ops import planner
from attnjit.ops.attention import BatchDecodeWithPagedKVCacheWrapper
from tests.helpers import i32
from tests.plan_support import WRAPPERS, column_view, workspace


# --- the device metadata layout (run here with a CPU "device": the same code a GPU plan runs) ---------------

def _work(n: int) -> np.ndarray:
    return np.arange(n * 12, dtype=np.int32).reshape(n, 12)


def test_metadata_upload_layout_and_page_ids():
    from attnjit.ops._upload import MetadataBuffers

    dev = torch.device("cpu")
    meta = MetadataBuffers(dev, use_cuda_graph=False, max_work_items=None)
    keep: list = []
    host_ids = column_view([7, 2, 11, 3, 99])
    ptr = meta.upload(_work(3), num_groups=2, num_kv_heads=4, page_ids=host_ids, used=4, keep=keep)
    buf = keep[0]
    base = buf.data_ptr()
    assert buf.tolist()[:4] == [3, 0, 0, 0]                            # work count, padded to 16 bytes
    assert ptr["work_count"] == base and ptr["work"] == base + 16
    assert buf[4:40].tolist() == list(range(36))                       # the records, row-major
    assert ptr["merge_counters"] == base + 4 * 40 and buf[40:48].tolist() == [0] * 8
    assert ptr["kv_indices"] == base + 4 * 48 and buf[48:52].tolist() == [7, 2, 11, 3]  # strided host ids, dense


def test_planning_during_a_graph_capture_is_refused_by_name(monkeypatch):
    """plan() and fast_plan() ask the stream whether it is capturing (RawCuda's cudaStreamIsCapturing, else torch's
    is_current_stream_capturing) and refuse by name; a stream that is not capturing plans. A CPU workspace has no
    stream to ask."""
    from attnjit.ops._upload import MetadataBuffers

    class Raw:   # RawCuda's two calls the check makes
        def __init__(self, capturing: bool):
            self.asked, self.state = [], capturing

        def stream(self) -> int:
            return 1234

        def capturing(self, stream: int) -> bool:
            self.asked.append(stream)
            return self.state

    meta = MetadataBuffers(torch.device("cpu"), use_cuda_graph=False, max_work_items=None)
    meta.refuse_capture("X.plan()")                  # CPU: nothing asked, nothing raised
    meta._pinned = True
    meta.raw = Raw(False)
    meta.refuse_capture("X.plan()")
    assert meta.raw.asked == [1234]
    meta.raw = Raw(True)
    with pytest.raises(RuntimeError, match=r"X\.plan\(\) was called while the current CUDA stream is capturing a "
                                           r"graph.*call plan\(\) before the capture and capture only run\(\)"):
        meta.refuse_capture("X.plan()")
    meta.raw = None                                  # no CuPy (or ATTNJIT_NATIVE=0): torch is asked
    for state in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda state=state: state)
        with pytest.raises(RuntimeError, match="capturing") if state else contextlib.nullcontext():
            meta.refuse_capture("X.plan()")


def test_graph_metadata_keeps_its_addresses_and_names_what_to_raise():
    from attnjit.ops._upload import MetadataBuffers

    dev = torch.device("cpu")
    fixed = torch.zeros(8, dtype=torch.int32)
    meta = MetadataBuffers(dev, use_cuda_graph=True, max_work_items=None)
    meta.fixed_page_ids = fixed
    keep: list = []
    p1 = meta.upload(_work(2), num_groups=1, num_kv_heads=2, page_ids=i32([4, 5, 6]), used=3, keep=keep)
    assert fixed[:3].tolist() == [4, 5, 6] and p1["kv_indices"] == fixed.data_ptr()
    p2 = meta.upload(_work(5), num_groups=0, num_kv_heads=2, page_ids=fixed[:2], used=2, keep=[])
    assert p2 == p1 and meta.fixed_meta[0].item() == 5                 # same addresses, new work count
    assert meta.fixed_meta[4:4 + 60].tolist() == list(range(60))
    meta.batch = 2
    with pytest.raises(ValueError, match=r"first planned for batch size 2; plan\(\) got batch size 3"):
        meta.check_batch(3)
    with pytest.raises(ValueError, match=r"needs 65 work items but the wrapper's fixed buffers hold 64; build the "
                                         r"wrapper with a larger max_work_items"):
        meta.upload(_work(65), num_groups=0, num_kv_heads=2, page_ids=None, used=0, keep=[])
    with pytest.raises(ValueError, match=r"uses 9 page ids, more than the 8 of the wrapper's fixed page-id buffer"):
        meta.upload(_work(1), num_groups=0, num_kv_heads=2, page_ids=i32(list(range(9))), used=9, keep=[])


# --- both metadata paths (lists for small batches, numpy arrays for large ones) hold every rule --------------

@pytest.mark.parametrize("path", ["lists", "arrays"])
def test_every_bad_input_is_caught_alike_by_both_metadata_paths(path, monkeypatch):
    from tests.test_plan_cpu import DECODE_BAD, PAGED_BAD, RAGGED_BAD, SEED

    monkeypatch.setattr(planner, "SMALL", 10 ** 9 if path == "lists" else -1)
    for kind, table in (("paged", PAGED_BAD), ("decode", DECODE_BAD), ("ragged", RAGGED_BAD)):
        make, args_of = WRAPPERS[kind]
        for name, (changes, exc, pattern) in table.items():
            args = args_of(**changes)
            if kind == "paged" and args.get("paged_kv_indptr") is None:
                args["paged_kv_indptr"] = SEED["paged_kv_indptr"]  # a plain list, not a tensor
            w = make(workspace())
            with pytest.raises(exc, match=pattern):
                w.plan(**args)
            assert w.last_plan is None, name


@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
def test_both_metadata_paths_plan_the_same_work(kind, monkeypatch):
    """Random valid batches of 1..40 requests, read as lists and as arrays: the same plan."""
    import random

    rng = random.Random(5)
    make, _ = WRAPPERS[kind]
    for _ in range(40):
        batch = rng.randint(1, 40)
        kv = [rng.randint(1, 3000) for _ in range(batch)]
        qo = [1] * batch if kind == "decode" else [rng.randint(0, k) for k in kv]
        qo_indptr, kv_indptr, pages = [0], [0], [0]
        for q, k in zip(qo, kv):
            qo_indptr.append(qo_indptr[-1] + q)
            kv_indptr.append(kv_indptr[-1] + k)
            pages.append(pages[-1] + -(-k // 16))
        last = [k - 16 * (-(-k // 16) - 1) for k in kv]
        ids = i32(rng.sample(range(pages[-1] + 10), pages[-1]))
        common = dict(num_qo_heads=32, num_kv_heads=8, q_data_type=torch.bfloat16)
        args = {"paged": dict(qo_indptr=i32(qo_indptr), paged_kv_indptr=i32(pages), paged_kv_indices=ids,
                              paged_kv_last_page_len=i32(last), head_dim_qk=128, page_size=16, causal=True, **common),
                "decode": dict(indptr=i32(pages), indices=ids, last_page_len=i32(last), head_dim=128, page_size=16,
                               **common),
                "ragged": dict(qo_indptr=i32(qo_indptr), kv_indptr=i32(kv_indptr), head_dim_qk=128, causal=True,
                               **common)}[kind]
        plans = []
        for small in (10 ** 9, -1):
            monkeypatch.setattr(planner, "SMALL", small)
            w = make(workspace())
            w.plan(**args)
            plans.append(w._plan)
        a, b = plans
        assert a.work.records.tolist() == b.work.records.tolist()
        assert (a.max_page, a.total_kv, a.q_shape) == (b.max_page, b.total_kv, b.q_shape)


# --- graph-mode decode: the fast re-plan -----------------------------------------------------------------

def _decode_tables(kv_lens, seed=0, page_size=16, pool=400):
    import random

    rng = random.Random(seed)
    need = sum(-(-k // page_size) for k in kv_lens)
    ids = rng.sample(range(max(pool, need + 8)), need)
    indptr, pos = [0], 0
    for k in kv_lens:
        pos += -(-k // page_size)
        indptr.append(pos)
    last = [k - page_size * (-(-k // page_size) - 1) for k in kv_lens]
    return i32(indptr), i32(ids), i32(last)


def test_fast_plan_plans_what_plan_plans():
    """fast_plan() of new lengths and page tables = a fresh plan() of them (same tile, same work list)."""
    opts = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16)
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True)
    w.plan(*_decode_tables([5, 17, 64, 100, 1, 33]), **opts)
    first_tile = w._plan.work.tile
    for step, lens in enumerate([(9000, 20, 1, 700, 4100, 16), (300, 301, 302, 1, 2, 3), (1, 1, 1, 1, 1, 1)]):
        tables = _decode_tables(lens, seed=step + 1)
        w.fast_plan(*tables)
        fresh = BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True)
        fresh.plan(*_decode_tables([5, 17, 64, 100, 1, 33]), **opts)  # the same first plan: the same fixed tile
        fresh.plan(*tables, **opts)
        assert w._plan.work.tile == first_tile
        assert w._plan.work.records.tolist() == fresh._plan.work.records.tolist()
        assert w.last_plan == fresh.last_plan and w._plan.max_page == fresh._plan.max_page
    assert w._plan.work.chunk is None


def test_fast_plan_checks_what_plan_checks():
    opts = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16)
    plain = BatchDecodeWithPagedKVCacheWrapper(workspace())
    with pytest.raises(ValueError, match=r"fast_plan\(\) rewrites the fixed buffers of a use_cuda_graph=True"):
        plain.fast_plan(*_decode_tables([5]))
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True)
    with pytest.raises(RuntimeError, match=r"fast_plan\(\) called before plan\(\)"):
        w.fast_plan(*_decode_tables([5]))
    w.plan(*_decode_tables([5, 40]), **opts)
    with pytest.raises(ValueError, match=r"first planned for batch size 2; plan\(\) got batch size 3"):
        w.fast_plan(*_decode_tables([5, 6, 7]))
    indptr, ids, last = _decode_tables([5, 40])
    with pytest.raises(ValueError, match=r"^last_page_len\[1\]=17 is outside 1..page_size=16"):
        w.fast_plan(indptr, ids, i32([5, 17]))
    with pytest.raises(ValueError, match=r"^last_page_len\[0\]=8 but request 0 has no pages"):
        w.fast_plan(i32([0, 0, 3]), ids, i32([8, 8]))
    w.fast_plan(i32([0, 0, 3]), ids, i32([0, 8]))  # an empty history is a valid decode request (issue 14)
    assert sorted(r[10] for r in w._plan.work.records) == [0, 40]
    with pytest.raises(TypeError, match=r"^indices must be int32"):
        w.fast_plan(indptr, ids.long(), last)
    # a replay reads the cache the last run() read: page ids past it are refused (run() checks it on CPU too)
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(NoGPUError):
        w.run(q, torch.zeros(400, 2, 16, 8, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"page table uses page id \d+ but the cache of the last run\(\) .* has 400"):
        w.fast_plan(indptr, i32([1, 2, 999, 3]), last)
    w.fast_plan(indptr, ids, last)  # still usable after the refusals


def test_a_refused_run_does_not_change_the_cache_a_replay_reads():
    """fast_plan() ranges page ids against the cache of the last run() that passed its checks (what the captured
    graph reads); a run() refused for another argument does not move that bound."""
    opts = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16)
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True)
    indptr, ids, last = _decode_tables([5, 40])
    w.plan(indptr, ids, last, **opts)
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(NoGPUError):
        w.run(q, torch.zeros(400, 2, 16, 8, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^run\(\): q must be"):
        w.run(q[:1], torch.zeros(1000, 2, 16, 8, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"page table uses page id 999 but the cache of the last run\(\) .* has 400"):
        w.fast_plan(indptr, i32([1, 2, 999, 3]), last)
