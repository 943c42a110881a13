"""Graph mode's decode re-plan through the compiled core (MetadataBuffers.fast_decode, cplan.c fast_decode) held to
the full path it replaces (planner.read_paged, plan_work, MetadataBuffers.upload) on thousands of random page
tables, valid and broken, with a CPU "device" (the code a GPU fast_plan() runs): the same work plan, the same bytes
in every region the kernels read, and for a broken table no copy at all and the full path's error."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attnjit.ops import planner as P
from attnjit.ops import scheduler
from attnjit.ops._upload import _HEAD, RECORD, MetadataBuffers
from attnjit.ops.attention import BatchDecodeWithPagedKVCacheWrapper
from attnjit.ops.scheduler import plan_work
from tests.helpers import i32
from tests.plan_support import workspace

pytestmark = pytest.mark.skipif(scheduler._cplan is None, reason="attnjit._cplan is not built (no C compiler)")

NAMES = ("indptr", "indices", "last_page_len")


def _sched(batch: int, page_size: int, heads: tuple[int, int], **opts) -> dict:
    """A real decode plan's scheduling arguments (tile, slots, split policy) from a CPU graph-mode wrapper."""
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True)
    indptr, ids, last = _table(random.Random(0), batch, page_size, 64)
    w.plan(indptr, ids, last, heads[0], heads[1], 128, page_size, q_data_type=torch.bfloat16, **opts)
    return w._plan.sched


def _table(rng: random.Random, batch: int, page_size: int, max_kv: int, pool: int | None = None):
    kv = [0 if rng.random() < 0.1 else rng.randint(1, max_kv) for _ in range(batch)]
    pages = [-(-k // page_size) for k in kv]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    pool = pool or int(indptr[-1]) + 8
    ids = np.array(rng.sample(range(pool), int(indptr[-1])) if pool >= indptr[-1] else
                   [rng.randrange(pool) for _ in range(indptr[-1])], dtype=np.int32)
    last = np.array([k - page_size * (p - 1) if p else 0 for k, p in zip(kv, pages)], dtype=np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(ids), torch.from_numpy(last)


def _break(rng: random.Random, table, page_size: int, num_pages: int):
    """One broken rule (or none), as an engine's bug would break it."""
    indptr, ids, last = (t.clone() for t in table)
    b = last.numel()
    what = rng.choice(["none", "none", "first", "decreasing", "last", "last0", "negative", "past_cache", "short",
                       "long_kv"])
    if what == "first":
        indptr[0] = 1
    elif what == "decreasing" and b > 1:
        indptr[1] = indptr[2] + 1
    elif what == "last":
        last[rng.randrange(b)] = rng.choice([page_size + 1, -1, 2**31 - 1])
    elif what == "last0":
        i = rng.randrange(b)
        last[i] = 0 if indptr[i + 1] > indptr[i] else 1
    elif what == "negative" and ids.numel():
        ids[rng.randrange(ids.numel())] = rng.choice([-1, -(2**31)])
    elif what == "past_cache" and ids.numel():
        ids[rng.randrange(ids.numel())] = rng.choice([num_pages, 2**31 - 1])
    elif what == "short" and ids.numel():
        ids = ids[:-1].clone()
    elif what == "long_kv":
        indptr[1:] += (1 << 27)   # a history past MAX_KV_LEN (indices is then too short as well)
    return indptr, ids, last


def _slow(meta: MetadataBuffers, sched: dict, table, page_size: int, num_pages: int | None):
    """The full path: fast_plan()'s read, check, schedule and upload."""
    indptr, ids, last = table
    batch = P.read_paged(NAMES, np.arange(indptr.numel(), dtype=np.int64), indptr, ids, last, page_size=page_size)
    meta.check_batch(batch.batch_size)
    if num_pages is not None and batch.max_page >= num_pages:
        raise ValueError("page id past the cache")
    work = plan_work(qo_lens=batch.qo_lens, kv_lens=batch.kv_lens, qo_offsets=batch.qo_indptr[:-1],
                     kv_bases=batch.kv_bases, **sched)
    meta.upload(work.records, num_groups=work.num_groups, num_kv_heads=sched["num_kv_heads"], page_ids=ids,
                used=batch.num_page_ids, keep=[])
    return work, batch.max_page, batch.num_page_ids


def _regions(meta: MetadataBuffers, work, used: int, heads: int) -> list:
    """What the kernels read of the fixed buffer: count, records, tickets, page ids."""
    f = meta.fixed_meta
    at = _HEAD + RECORD * meta.caps[0]
    return [f[:_HEAD].tolist(), f[_HEAD:_HEAD + RECORD * work.num_items].tolist(),
            f[at:at + work.num_groups * heads].tolist(), meta.fixed_page_ids[:used].tolist()]


def _lengths(page_size: int) -> list[int]:
    return [4, 64, 700, 5000, 40000] if page_size >= 16 else [4, 64, 700, 3000]


def _pair(sched: dict, batch: int, page_size: int, engine_ids: bool = False):
    """Two graph-mode buffers sized by the same first plan (every request at the longest history drawn: the later
    tables fit, as an engine's do; test_fast_decode_refuses_more_than_the_fixed_buffers_hold covers the rest).
    engine_ids: each with a page-id buffer of its own, as an engine passes paged_kv_indices_buffer."""
    longest = max(_lengths(page_size))
    pages = -(-longest // page_size)
    first = (i32([i * pages for i in range(batch + 1)]), i32(list(range(batch * pages))),
             i32([longest - page_size * (pages - 1)] * batch))
    metas = []
    for _ in range(2):
        m = MetadataBuffers(torch.device("cpu"), use_cuda_graph=True, max_work_items=None)
        if engine_ids:
            m.fixed_page_ids = torch.zeros(2 * first[1].numel() + 5, dtype=torch.int32)
        _slow(m, sched, first, page_size, None)
        assert (m.ids_at is None) == engine_ids
        m.batch = batch
        metas.append(m)
    return metas


@pytest.mark.parametrize("batch,page_size,heads,opts,engine_ids", [
    (1, 16, (32, 8), {}, False), (7, 1, (32, 8), {}, False), (33, 5, (8, 8), {}, False),
    (130, 16, (32, 4), {}, False), (3, 16, (32, 8), {"fixed_split_size": 512}, False),
    (1, 16, (32, 8), {}, True), (33, 5, (8, 8), {}, True),
])
def test_fast_decode_equals_the_full_path(batch, page_size, heads, opts, engine_ids):
    rng = random.Random(batch * 1000 + page_size)
    sched = _sched(batch, page_size, heads, **opts)
    fast, slow = _pair(sched, batch, page_size, engine_ids)
    num_pages = 5000
    agreed = refused = 0
    for step in range(400):
        max_kv = rng.choice(_lengths(page_size))
        table = _break(rng, _table(rng, batch, page_size, max_kv, pool=rng.choice([None, num_pages])), page_size,
                       num_pages)
        limit = rng.choice([None, num_pages])
        before = fast.fixed_meta.clone(), fast.fixed_page_ids.clone()
        got = fast.fast_decode(*table, page_size=page_size, sched=sched, num_pages=limit)
        try:
            want = _slow(slow, sched, table, page_size, limit)
        except ValueError:
            assert got is None, f"step {step}: the full path refuses this table, the fast one planned it"
            assert torch.equal(fast.fixed_meta, before[0]) and torch.equal(fast.fixed_page_ids, before[1]), \
                "a refused table must not be copied"
            refused += 1
            continue
        assert got is not None, f"step {step}: the fast path refused a table the full path plans"
        work, max_page = got
        w, mp, used = want
        assert max_page == mp and work.records.tolist() == w.records.tolist()
        assert (work.num_groups, work.chunk, work.num_slots, work.split_requests, work.slots_target, work.tile) == \
            (w.num_groups, w.chunk, w.num_slots, w.split_requests, w.slots_target, w.tile)
        assert _regions(fast, work, used, heads[1]) == _regions(slow, w, used, heads[1])
        agreed += 1
    assert agreed >= 40 and refused >= 40   # both outcomes were exercised (400 tables)


def test_fast_decode_declines_what_it_does_not_handle():
    """Device-style inputs it cannot read in place (strided views, other dtypes, another batch size), no compiled
    core or ATTNJIT_NATIVE=0, and a buffer never uploaded: None, so the full path plans (and checks) them."""
    sched = _sched(4, 16, (32, 8))
    fast, _ = _pair(sched, 4, 16)
    indptr, ids, last = _table(random.Random(3), 4, 16, 100)
    ok = dict(page_size=16, sched=sched, num_pages=None)
    assert fast.fast_decode(indptr, ids, last, **ok) is not None
    wide = torch.zeros(2 * ids.numel(), dtype=torch.int32)
    wide[::2] = ids
    assert fast.fast_decode(indptr, wide[::2], last, **ok) is None
    assert fast.fast_decode(indptr.long(), ids, last, **ok) is None
    assert fast.fast_decode(i32([0, 1]), ids, i32([1]), **ok) is None
    assert fast.fast_decode(indptr.reshape(1, -1), ids, last, **ok) is None
    fresh = MetadataBuffers(torch.device("cpu"), use_cuda_graph=True, max_work_items=None)
    assert fresh.fast_decode(indptr, ids, last, **ok) is None
    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setenv("ATTNJIT_NATIVE", "0")
        assert fast.fast_decode(indptr, ids, last, **ok) is None


@pytest.mark.parametrize("engine_ids", [False, True])
def test_fast_decode_refuses_more_than_the_fixed_buffers_hold(engine_ids):
    """A table with more page ids than the first plan sized: no copy; the full path says which constructor
    argument to raise."""
    sched = _sched(2, 16, (32, 8))
    fast, slow = _pair(sched, 2, 16, engine_ids)
    indptr, ids, last = i32([0, 6000, 12000]), i32(list(range(12000))), i32([16, 16])   # the first: 2 x 2500
    before = fast.fixed_meta.clone()
    assert fast.fast_decode(indptr, ids, last, page_size=16, sched=sched, num_pages=None) is None
    assert torch.equal(fast.fixed_meta, before)
    with pytest.raises(ValueError, match="page-id buffer|fixed buffers hold"):
        _slow(slow, sched, (indptr, ids, last), 16, None)


def test_the_compiled_re_plan_survives_garbage():
    """Arbitrary int32 tables (extremes included) straight into _cplan.fast_decode with real buffers: every call
    returns a status; a refused one writes nothing past the staging regions' bounds, an accepted one only within
    them, and never past the guard at the end."""
    rng = np.random.default_rng(11)
    cplan = scheduler._cplan
    extremes = np.array([0, 1, -1, 2 ** 31 - 1, -2 ** 31, 16, 17], dtype=np.int64)
    for _ in range(3000):
        b = int(rng.integers(1, 20))
        if rng.random() < 0.5:
            ind = np.cumsum(rng.integers(0, 4, b + 1)).astype(np.int32) - int(rng.integers(0, 2))
        else:
            ind = rng.choice(extremes, b + 1).astype(np.int32)
        last = (rng.integers(0, 18, b) if rng.random() < 0.7 else rng.choice(extremes, b)).astype(np.int32)
        ids = rng.integers(-3, 200, int(rng.integers(0, 60))).astype(np.int32)
        rec_cap, ticket_cap, ids_cap = int(rng.integers(0, 40)), int(rng.integers(0, 80)), int(rng.integers(0, 60))
        at_tickets = 4 + 12 * rec_cap
        ids_at = at_tickets + ticket_cap
        staging = np.full(ids_at + ids_cap + 16, -7, dtype=np.int32)
        view = staging[:-16]
        status, count, *_, used, max_page, total = cplan.fast_decode(
            ind.ctypes.data, last.ctypes.data, ids.ctypes.data if ids.size else 0, b, ids.size, 16, 1 << 30,
            int(rng.choice([-1, 100, 2 ** 31 - 1])), view, rec_cap, at_tickets, ticket_cap, ids_at, ids_cap,
            int(rng.choice([1, 4])), 16, 64, bool(rng.random() < 0.5), 8, int(rng.choice([16, 132])), 10 ** 6,
            True, -1, 1 << 20)
        assert (staging[-16:] == -7).all()
        assert status in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 15)
        if status == 0:
            assert 0 <= count <= rec_cap and 0 <= used <= min(ids.size, ids_cap) and total <= view.size
            assert staging[0] == count and staging[ids_at:ids_at + used].tolist() == ids[:used].tolist()


def test_the_compiled_re_plan_refuses_inconsistent_regions():
    """Regions that overlap, a staging buffer shorter than they need, null tables: refused before any read."""
    cplan = scheduler._cplan
    ind, last, ids = (np.array(v, dtype=np.int32) for v in ([0, 1], [16], [3]))
    ok = [ind.ctypes.data, last.ctypes.data, ids.ctypes.data, 1, 1, 16, 1 << 30, -1]
    tail = [16, 64, False, 8, 132, 10 ** 6, True, -1, 1 << 20]
    staging = np.zeros(4 + 12 * 4 + 32 + 8, dtype=np.int32)
    regions = [4, 4 + 12 * 4, 32, 4 + 12 * 4 + 32, 8]   # rec_cap, at_tickets, ticket_cap, ids_at, ids_cap
    status = cplan.fast_decode(*ok, staging, *regions, 4, *tail)[0]
    assert status == 0 and staging[0] == 1 and staging[4 + 12 * 4 + 32] == 3
    with pytest.raises(ValueError, match="out of range"):
        cplan.fast_decode(*ok, staging, 4, 4 + 12 * 4, 32, 4 + 12 * 4 + 31, 8, 4, *tail)  # ids over the tickets
    with pytest.raises(ValueError, match="out of range"):
        cplan.fast_decode(0, *ok[1:], staging, *regions, 4, *tail)                          # a null indptr
    with pytest.raises(TypeError, match="at least ids_at \\+ ids_cap"):
        cplan.fast_decode(*ok, staging[:-1], *regions, 4, *tail)
