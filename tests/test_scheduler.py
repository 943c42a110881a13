"""The vectorized scheduler against the loop version it replaced (tests/_old_scheduler.py, kept verbatim as the
oracle): the same work records, split decisions, slot and group numbering on thousands of random valid plans, both
called directly and through every wrapper's plan() (issue 13: a faster planner that plans the same work)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attnjit import reference
from attnjit.families import tiles_for
from attnjit.ops import scheduler
from attnjit.ops.attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                                   BatchPrefillWithRaggedKVCacheWrapper)
from attnjit.specs import AttentionSpec
from tests import _old_scheduler as old
from tests.helpers import i32

SPECS = [AttentionSpec(op=op, head_dim=d, page_size=16, dtype="bf16", group_size=g,
                       **({"mask": "causal"} if op == "prefill" else {}))
         for op in ("decode", "prefill") for d in (64, 128, 256) for g in (1, 4, 7, 64)]
TILES = sorted({t for s in SPECS for t in tiles_for(s)}, key=lambda t: t.name)


def _lengths(rng: random.Random, batch: int, causal: bool) -> tuple[list[int], list[int]]:
    kv = [rng.choice([0, 1, 2, rng.randint(1, 300), rng.randint(1, 3000), rng.randint(3000, 40000)])
          for _ in range(batch)]
    qo = [rng.choice([0, 1, 1, rng.randint(1, 16), rng.randint(1, 300)]) for _ in range(batch)]
    if causal:
        qo = [min(q, k) for q, k in zip(qo, kv)]
    return qo, kv


def _same(new: scheduler.WorkPlan, ref: old.WorkPlan) -> None:
    assert new.records.dtype == np.int32 and new.records.shape == (len(ref.records), 12)
    assert [tuple(r) for r in new.records.tolist()] == ref.records
    assert (new.num_groups, new.chunk, new.num_slots, new.split_requests, new.slots_target) == \
        (ref.num_groups, ref.chunk, ref.num_slots, ref.split_requests, ref.slots_target)


# (SMALL_BATCH, SMALL_ITEMS) of the Python paths; "native": the compiled scheduler (attnjit._cplan)
PATHS = {"auto": None, "loop": (10 ** 9, 10 ** 9), "arrays": (-1, -1), "native": None}


def use_path(path: str, monkeypatch) -> None:
    """Plan through one path: the compiled scheduler (which must be built here), or Python with it turned off."""
    if path == "native":
        if scheduler._cplan is None:
            pytest.skip("attnjit._cplan is not built here (no C compiler when attnjit was installed)")
        monkeypatch.setenv("ATTNJIT_NATIVE", "1")
        return
    monkeypatch.setenv("ATTNJIT_NATIVE", "0")
    if PATHS.get(path):
        monkeypatch.setattr(scheduler, "SMALL_BATCH", PATHS[path][0])
        monkeypatch.setattr(scheduler, "SMALL_ITEMS", PATHS[path][1])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("part", range(2))
def test_the_vectorized_scheduler_plans_what_the_loop_planned(part, path, monkeypatch):
    """1,500 random batches per path (empty requests, decode rows, long histories; auto, fixed and no split;
    workspaces from roomy to too small) over every tile the decode and prefill modules hold; the loop and the array
    paths each forced, the size-based choice, and the compiled scheduler."""
    use_path(path, monkeypatch)
    rng = random.Random(1000 + part)
    outcomes = {"same": 0, "both_raise": 0, "split": 0}
    for _ in range(750):
        tile = rng.choice(TILES)
        group = rng.choice([1, 2, 4, 7, 8, 64])
        causal = rng.random() < 0.5
        batch = rng.choice([0, 1, 2, 3, rng.randint(1, 40), rng.randint(1, 300)])
        qo, kv = _lengths(rng, batch, causal)
        kw = dict(qo_lens=qo, kv_lens=kv, qo_offsets=[sum(qo[:i]) for i in range(batch)],
                  kv_bases=[rng.randint(0, 10 ** 6) for _ in range(batch)], group=group, tile=tile, causal=causal,
                  num_kv_heads=rng.choice([1, 2, 8]), slots=rng.choice([16, 132, 264, 528]),
                  max_slots=rng.choice([0, 8, 100, 10 ** 4, 10 ** 7]), allow_split=rng.random() < 0.8,
                  fixed_chunk=rng.choice([None, None, None, 1, 64, 100, 1000, 4096]))
        if kw["fixed_chunk"] is not None:  # keep the loop version's list small (it has no work-item bound)
            items = sum(-(-(q * group) // tile.cta_q) * max(1, -(-k // max(kw["fixed_chunk"], tile.cta_kv)))
                        for q, k in zip(qo, kv) if q)
            if items > 20000:
                kw["fixed_chunk"] = None
        try:
            ref = old.plan_work(**kw)
        except ValueError as exc:
            with pytest.raises(ValueError, match="partial-state slots"):
                scheduler.plan_work(**kw)
            assert "partial-state slots" in str(exc)
            outcomes["both_raise"] += 1
            continue
        new = scheduler.plan_work(**{k: (np.asarray(v) if isinstance(v, list) and rng.random() < 0.5 else v)
                                     for k, v in kw.items()})
        _same(new, ref)
        outcomes["same"] += 1
        outcomes["split"] += ref.chunk is not None
    assert outcomes["same"] > 600 and outcomes["split"] > 100 and outcomes["both_raise"] > 5, outcomes
    if path in ("loop", "native"):
        with pytest.raises(ValueError, match="would need 2000000 work items"):  # the count is checked first here too
            scheduler.plan_work(qo_lens=[1], kv_lens=[2000000 * 64], qo_offsets=[0], kv_bases=[0], group=1,
                                tile=next(t for t in TILES if t.cta_kv == 64), causal=False, num_kv_heads=1,
                                slots=1, max_slots=10 ** 9,
                                fixed_chunk=1)


def test_choose_chunk_agrees_with_the_loop_version():
    rng = random.Random(7)
    for _ in range(2000):
        batch = rng.randint(1, 30)
        tiles = [rng.choice([0, 1, 1, 2, 5]) for _ in range(batch)]
        kv = [rng.choice([0, rng.randint(1, 600), rng.randint(1, 50000)]) for _ in range(batch)]
        rows = [rng.randint(1, 64) for _ in range(batch)]
        kw = dict(cta_kv=rng.choice([32, 64]), num_kv_heads=rng.choice([1, 4, 8]), slots=rng.choice([16, 132, 264]),
                  slot_rows=rows, max_slots=rng.choice([1, 10, 1000, 10 ** 6]), group=rng.choice([1, 4, 8]),
                  cta_q=rng.choice([0, 16, 64, 128]))
        assert scheduler.choose_chunk(np.asarray(tiles), np.asarray(kv), **kw) == old.choose_chunk(tiles, kv, **kw)


def test_item_costs_is_the_loop_versions_item_cost():
    rng = random.Random(3)
    tile = TILES[-1]
    for causal in (True, False):
        qo, kv = _lengths(rng, 50, causal)
        work = old.plan_work(qo_lens=qo, kv_lens=kv, qo_offsets=[0] * 50, kv_bases=[0] * 50, group=4, tile=tile,
                             causal=causal, num_kv_heads=8, slots=10 ** 6, max_slots=10 ** 9, fixed_chunk=500)
        recs = np.asarray(work.records, dtype=np.int32)
        want = [old.item_cost(r, cta_q=tile.cta_q, group=4, causal=causal) for r in work.records]
        assert scheduler.item_costs(recs, cta_q=tile.cta_q, group=4, causal=causal).tolist() == want


KINDS = {"paged": BatchPrefillWithPagedKVCacheWrapper, "decode": BatchDecodeWithPagedKVCacheWrapper,
         "ragged": BatchPrefillWithRaggedKVCacheWrapper}


@pytest.mark.parametrize("path", ["auto", "native"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_plan_records_equal_the_loop_planners_on_random_batches(kind, path, monkeypatch):
    """1,200 random plans through plan() (host metadata, strided views among them), in Python and through the
    compiled scheduler: the work list equals the loop version's, fed lengths computed independently
    (reference.kv_lengths) with the tile and slots plan() chose."""
    use_path(path, monkeypatch)
    rng = random.Random({"paged": 1, "decode": 2, "ragged": 3}[kind])
    ws = torch.empty(1 << 30, dtype=torch.uint8)  # never touched by a CPU plan
    checked = too_big = 0
    for _ in range(400):
        hkv = rng.choice([1, 2, 8])
        group = rng.choice([1, 4, 5, 8])
        hd = rng.choice([64, 128, 256])
        ps = rng.choice([1, 4, 16, 128])
        batch = rng.randint(1, 64) if kind == "decode" else rng.randint(0, 64)
        causal = kind != "decode" and rng.random() < 0.5
        qo, kv = _lengths(rng, batch, causal)
        if kind == "decode":
            qo, kv = [1] * batch, [max(k, 1) for k in kv]
        qo_indptr = [0]
        for q in qo:
            qo_indptr.append(qo_indptr[-1] + q)
        fixed = rng.choice([None, None, 128, 1000, 5000])
        opts = dict(num_qo_heads=hkv * group, num_kv_heads=hkv, q_data_type=torch.bfloat16, fixed_split_size=fixed,
                    disable_split_kv=rng.random() < 0.2)
        w = KINDS[kind](ws)
        try:
            bases = _plan(w, kind, qo, kv, qo_indptr, hd, ps, causal, opts)
        except ValueError as exc:  # a fixed split larger than the workspace: the direct test compares those
            assert fixed is not None and "partial-state slots" in str(exc), exc
            too_big += 1
            continue
        work = w._plan.work
        slot_bytes = hkv * group * (hd + 1) * 4
        ref = old.plan_work(qo_lens=qo, kv_lens=kv, qo_offsets=qo_indptr[:-1], kv_bases=bases, group=group,
                            tile=work.tile, causal=w._plan.spec.mask == "causal", num_kv_heads=hkv,
                            slots=work.slots_target, max_slots=ws.numel() // slot_bytes,
                            allow_split=not opts["disable_split_kv"], fixed_chunk=fixed)
        _same(work, ref)
        checked += 1
    assert checked > 300 and checked + too_big == 400, (checked, too_big)


def _plan(w, kind, qo, kv, qo_indptr, hd, ps, causal, opts) -> list[int]:
    """plan() the batch (page ids as a strided view); returns the requests' KV bases (page-table offsets or rows)."""
    if kind == "ragged":
        kv_indptr = [0]
        for k in kv:
            kv_indptr.append(kv_indptr[-1] + k)
        w.plan(i32(qo_indptr), i32(kv_indptr), head_dim_qk=hd, causal=causal, **opts)
        return kv_indptr[:-1]
    pages = [-(-k // ps) if k else 0 for k in kv]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    last = [k - ps * (n - 1) if n else 0 for k, n in zip(kv, pages)]
    assert reference.kv_lengths(indptr, last, ps) == kv
    ids = torch.stack([torch.arange(indptr[-1], dtype=torch.int32)] * 2, 1)[:, 0]  # a strided view
    if kind == "decode":
        w.plan(i32(indptr), ids, i32(last), head_dim=hd, page_size=ps, **opts)
    else:
        w.plan(i32(qo_indptr), i32(indptr), ids, i32(last), head_dim_qk=hd, page_size=ps, causal=causal, **opts)
    return indptr[:-1]


@pytest.mark.parametrize("path", ["auto", "arrays", "native"])
def test_split_batches_of_one_q_tile_per_request_plan_what_the_loop_planned(path, monkeypatch):
    """The array path's shortcut for split batches whose requests are each one q tile (split decode; short prefill
    rows): the old scheduler's records on 1,500 random such batches (empty histories, ties, fixed and auto split,
    small workspaces), and the compiled scheduler's."""
    use_path(path, monkeypatch)
    rng = random.Random(77)
    splits = 0
    for _ in range(1500):
        tile = rng.choice(TILES)
        group = rng.choice([1, 2, 4, 7, 8])
        rows = max(1, tile.cta_q // group)
        batch = rng.randint(1, 60)
        qo = [rng.randint(1, rows) if rng.random() < 0.3 else 1 for _ in range(batch)]
        kv = [rng.choice([0, 1, tile.cta_kv, rng.randint(1, 3000), rng.randint(1, 40000), 2048]) for _ in range(batch)]
        causal = rng.random() < 0.5
        if causal:
            kv = [max(k, q) for q, k in zip(qo, kv)]
        kw = dict(group=group, tile=tile, causal=causal, num_kv_heads=rng.choice([1, 8]),
                  slots=rng.choice([132, 264, 1056]), max_slots=rng.choice([10 ** 6, 4000, 64]),
                  fixed_chunk=rng.choice([None, None, 256, 1000]))
        offsets = list(np.cumsum([0] + qo[:-1]))
        bases = [rng.randint(0, 10 ** 5) for _ in range(batch)]
        try:
            ref = old.plan_work(qo_lens=qo, kv_lens=kv, qo_offsets=offsets, kv_bases=bases, **kw)
        except ValueError as exc:
            with pytest.raises(ValueError, match=str(exc)[:40].replace("(", r"\(").replace(")", r"\)")):
                scheduler.plan_work(qo_lens=qo, kv_lens=kv, qo_offsets=offsets, kv_bases=bases, **kw)
            continue
        _same(scheduler.plan_work(qo_lens=qo, kv_lens=kv, qo_offsets=offsets, kv_bases=bases, **kw), ref)
        splits += ref.split_requests > 0
    assert splits > 300
