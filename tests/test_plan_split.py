"""The split-KV scheduler on CPU plans: when it splits and when not, chunk sizes against the workspace and the GPU's
slots, causal prefill items, grouped rows, the work list's fast path and order."""

from __future__ import annotations

import math

import pytest
import torch

from attnjit.errors import NoGPUError
from attnjit.families import tiles_for
from attnjit.ops.attention import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from attnjit.ops.scheduler import MIN_CHUNK, choose_chunk
from attnjit.specs import AttentionSpec
from tests.helpers import i32
from tests.plan_support import NARROW, check_work, schedule, workspace


# --- the split-KV scheduler -----------------------------------------------------------------------------------

def test_no_split_when_the_items_fill_the_gpu():
    kv = [1 + (i * 37) % 2000 for i in range(300)]
    assert choose_chunk([1] * 300, kv, cta_kv=NARROW.cta_kv, num_kv_heads=8, slots=264, slot_rows=[1] * 300,
                        max_slots=10 ** 6) is None
    work = schedule(qo_lens=[1] * 300, kv_lens=kv, qo_offsets=list(range(300)), group=4, tile=NARROW, causal=False,
                     num_kv_heads=8, slots=264, max_slots=10 ** 6)
    assert work.chunk is None and work.num_items == 300 and work.num_slots == 0
    check_work(work, qo_lens=[1] * 300, kv_lens=kv, group=4, tile=NARROW, causal=False, max_slots=10 ** 6)


def test_no_split_when_every_history_is_short():
    assert choose_chunk([1], [MIN_CHUNK], cta_kv=64, num_kv_heads=8, slots=264, slot_rows=[1],
                        max_slots=10 ** 6) is None


def test_one_long_decode_is_split_into_the_smallest_chunk_that_fits_one_wave():
    # 1 x 32768 tokens, group 4, 8 KV heads, 264 CTA slots (132 SMs x 2)
    assert NARROW.cta_kv == 64
    chunk = choose_chunk([1], [32768], cta_kv=64, num_kv_heads=8, slots=264, slot_rows=[1], max_slots=10 ** 6)
    assert chunk == 1024
    assert math.ceil(32768 / chunk) * 8 <= 264 < math.ceil(32768 / (chunk - 64)) * 8  # smallest that fits
    work = schedule(qo_lens=[1], kv_lens=[32768], qo_offsets=[0], group=4, tile=NARROW, causal=False,
                     num_kv_heads=8, slots=264, max_slots=10 ** 6)
    items = check_work(work, qo_lens=[1], kv_lens=[32768], group=4, tile=NARROW, causal=False, max_slots=10 ** 6)
    assert work.chunk == 1024 and work.num_items == 32 and work.split_requests == 1 and work.num_slots == 32
    assert {it["kv_end"] - it["kv_begin"] for it in items} == {1024}


def test_cpu_plan_of_the_long_decode_targets_the_deep_tile_slots(monkeypatch):
    """One long request cannot fill the GPU: plan() takes the deep-pipeline decode tile (one CTA per SM, 132 slots)
    and cuts 32768 tokens into 16 chunks of 2048 (8 KV heads x 16 = 128 CTAs)."""
    monkeypatch.setenv("ATTNJIT_NUM_SMS", "132")
    w = BatchDecodeWithPagedKVCacheWrapper(workspace())
    pages = 32768 // 16
    w.plan(indptr=i32([0, pages]), indices=i32(list(range(pages))), last_page_len=i32([16]), num_qo_heads=32,
           num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16)
    d = w.last_plan
    assert (d["gpu_slots"], d["split_kv"], d["chunk_kv"], d["work_items"], d["ctas"]) == (132, True, 2048, 16, 128)
    assert d["tile"] == "q16_kv64_w1x4_deep"
    w.plan(indptr=i32([0, pages]), indices=i32(list(range(pages))), last_page_len=i32([16]), num_qo_heads=32,
           num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16, disable_split_kv=True)
    assert w.last_plan["split_kv"] is False and w.last_plan["work_items"] == 1
    assert w.last_plan["tile"] == "q16_kv64_w1x4"   # nothing to split: the standard tile
    w.plan(indptr=i32([0, pages]), indices=i32(list(range(pages))), last_page_len=i32([16]), num_qo_heads=32,
           num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16, fixed_split_size=1000)
    assert w.last_plan["chunk_kv"] == 1024 and w.last_plan["work_items"] == 32
    # fewer SMs: fewer slots, bigger chunks
    monkeypatch.setenv("ATTNJIT_NUM_SMS", "16")
    w.plan(indptr=i32([0, pages]), indices=i32(list(range(pages))), last_page_len=i32([16]), num_qo_heads=32,
           num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16)
    assert w.last_plan["gpu_slots"] == 16 and w.last_plan["chunk_kv"] == 16384
    # a batch that fills the GPU by itself keeps the standard tile (two CTAs per SM)
    monkeypatch.setenv("ATTNJIT_NUM_SMS", "132")
    w.plan(indptr=i32([p * 256 for p in range(65)]), indices=i32(list(range(64 * 256))),
           last_page_len=i32([16] * 64), num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
           q_data_type=torch.bfloat16)
    assert w.last_plan["tile"] == "q16_kv64_w1x4" and w.last_plan["split_kv"] is False


def test_mixed_lengths_split_only_the_long_requests():
    kv = [5000, 3000, 100, 1]
    work = schedule(qo_lens=[1] * 4, kv_lens=kv, qo_offsets=[0, 1, 2, 3], group=4, tile=NARROW, causal=False,
                     num_kv_heads=8, slots=264, max_slots=10 ** 6)
    items = check_work(work, qo_lens=[1] * 4, kv_lens=kv, group=4, tile=NARROW, causal=False, max_slots=10 ** 6)
    chunks = {it["req"]: it["chunks"] for it in items}
    assert chunks[0] > 1 and chunks[1] > 1 and chunks[2] == 1 and chunks[3] == 1
    assert work.num_items * 8 <= 264
    assert items[0]["req"] in (0, 1) and items[-1]["req"] == 3  # heaviest first, the 1-token request last


def test_a_small_workspace_forces_bigger_chunks_or_no_split():
    kw = dict(cta_kv=64, num_kv_heads=8, slots=264, slot_rows=[1])
    assert choose_chunk([1], [32768], max_slots=10 ** 6, **kw) == 1024
    assert choose_chunk([1], [32768], max_slots=8, **kw) == 4096   # 8 partial states of 4096 tokens
    assert choose_chunk([1], [32768], max_slots=1, **kw) is None    # no room for any split
    work = schedule(qo_lens=[1], kv_lens=[32768], qo_offsets=[0], group=4, tile=NARROW, causal=False,
                     num_kv_heads=8, slots=264, max_slots=8)
    check_work(work, qo_lens=[1], kv_lens=[32768], group=4, tile=NARROW, causal=False, max_slots=8)
    assert work.num_slots == 8


def test_the_workspace_size_bounds_the_plan(monkeypatch):
    monkeypatch.setenv("ATTNJIT_NUM_SMS", "132")
    slot_bytes = 32 * (128 + 1) * 4  # one partial state: H_q x (D + lse) floats
    pages = 32768 // 16
    args = dict(indptr=i32([0, pages]), indices=i32(list(range(pages))), last_page_len=i32([16]), num_qo_heads=32,
                num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16)
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(8 * slot_bytes))
    w.plan(**args)
    assert w.last_plan["chunk_kv"] == 4096 and w._plan.work.num_slots <= 8
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(slot_bytes))
    w.plan(**args)
    assert w.last_plan["split_kv"] is False
    with pytest.raises(ValueError, match=r"needs 32 partial-state slots but the workspace holds 1.*fixed_split_size"):
        w.plan(**args, fixed_split_size=1024)


def test_fixed_chunk_is_honoured_and_rounded_to_the_kv_tile():
    kv = [1000, 130, 129]
    work = schedule(qo_lens=[1, 1, 1], kv_lens=kv, qo_offsets=[0, 1, 2], group=4, tile=NARROW, causal=False,
                     num_kv_heads=8, slots=264, max_slots=10 ** 6, fixed_chunk=100)
    assert work.chunk == 128  # ceil(100 / 64) * 64
    items = check_work(work, qo_lens=[1, 1, 1], kv_lens=kv, group=4, tile=NARROW, causal=False,
                       max_slots=10 ** 6, fixed=True)
    assert {it["req"]: it["chunks"] for it in items} == {0: 8, 1: 2, 2: 2}
    # a fixed chunk splits even when the GPU is already full, and never with a non-positive size
    full = schedule(qo_lens=[1] * 300, kv_lens=[1000] * 300, qo_offsets=list(range(300)), group=4, tile=NARROW,
                     causal=False, num_kv_heads=8, slots=264, max_slots=10 ** 6, fixed_chunk=256)
    assert full.chunk == 256 and full.split_requests == 300
    with pytest.raises(ValueError, match="fixed_split_size must be positive, got 0"):
        schedule(qo_lens=[1], kv_lens=[10], qo_offsets=[0], group=4, tile=NARROW, causal=False, num_kv_heads=8,
                  slots=264, max_slots=10, fixed_chunk=0)


def test_causal_prefill_items_cover_every_q_tile_and_weigh_visible_keys():
    spec = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4)
    wide = tiles_for(spec)[-1]
    qo, kv = [100, 1, 0, 7], [3000, 5000, 10, 7]
    work = schedule(qo_lens=qo, kv_lens=kv, qo_offsets=[0, 100, 101, 101], group=4, tile=wide, causal=True,
                     num_kv_heads=8, slots=264, max_slots=10 ** 6)
    items = check_work(work, qo_lens=qo, kv_lens=kv, group=4, tile=wide, causal=True, max_slots=10 ** 6)
    assert work.chunk is not None, "few tiles over long histories: the scheduler should split"
    assert not any(it["req"] == 2 for it in items), "a request without queries got work"
    # q tile t of request 0 sees keys < 3000 - 100 + (last token of the tile) + 1
    for t in range(math.ceil(100 * 4 / wide.cta_q)):
        rows = min(wide.cta_q, 400 - t * wide.cta_q)
        end = 3000 - 100 + (t * wide.cta_q + rows - 1) // 4 + 1
        its = [it for it in items if it["req"] == 0 and it["qtile"] == t]
        visible = sum(max(0, min(it["kv_end"], end) - it["kv_begin"]) for it in its)
        assert visible == end
    # the request whose queries are its whole history sees a triangle: all 7 keys for its last row
    (short,) = [it for it in items if it["req"] == 3]
    assert (short["kv_begin"], short["kv_end"]) == (0, 7)


def test_grouped_rows_pack_into_q_tiles():
    # group 7 (28 q heads over 4): a token's 7 rows are packed; 2 tokens = 14 rows fit the 16-row narrow tile,
    # 3 tokens = 21 rows do not
    spec = AttentionSpec(op="prefill", head_dim=128, dtype="fp16", kv="ragged", group_size=7, family="fa2")
    narrow, wide = tiles_for(spec)
    assert narrow.cta_q == 16 < wide.cta_q
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend="fa2")
    w.plan(qo_indptr=i32([0, 2]), kv_indptr=i32([0, 40]), num_qo_heads=28, num_kv_heads=4, head_dim_qk=128,
           q_data_type=torch.float16)
    assert w._plan.work.tile == narrow and w.last_plan["work_items"] == 1
    w.plan(qo_indptr=i32([0, 3]), kv_indptr=i32([0, 40]), num_qo_heads=28, num_kv_heads=4, head_dim_qk=128,
           q_data_type=torch.float16)
    assert w._plan.work.tile == wide
    w.plan(qo_indptr=i32([0, 100]), kv_indptr=i32([0, 100]), num_qo_heads=28, num_kv_heads=4, head_dim_qk=128,
           q_data_type=torch.float16, causal=True)
    assert w._plan.work.tile == wide
    check_work(w._plan.work, qo_lens=[100], kv_lens=[100], group=7, tile=wide, causal=True, max_slots=10 ** 9)


def test_work_list_fast_path_equals_the_general_one():
    """Batches of one q tile per request and no split take a shortcut; it must list the same items in the same
    (longest first, stable) order as the general loop, which a huge fixed chunk forces."""
    import random

    from attnjit.families import tiles_for
    from attnjit.ops.scheduler import plan_work
    from attnjit.specs import AttentionSpec

    rng = random.Random(7)
    for op, causal in (("decode", False), ("prefill", True), ("prefill", False)):
        spec = AttentionSpec(op=op, head_dim=128, page_size=16, dtype="bf16", group_size=4,
                             **({"mask": "causal" if causal else "none"} if op == "prefill" else {}))
        tile = tiles_for(spec)[0]
        for _ in range(20):
            batch = rng.randint(1, 40)
            qo = [rng.randint(1, tile.cta_q // 4) if op == "prefill" else 1 for _ in range(batch)]
            kv = [q + rng.choice([0, 1, 5, 100, 3000]) for q in qo]
            kw = dict(qo_lens=qo, kv_lens=kv, qo_offsets=[sum(qo[:i]) for i in range(batch)],
                      kv_bases=[rng.randint(0, 999) for _ in range(batch)], group=4, tile=tile, causal=causal,
                      num_kv_heads=8, slots=1, max_slots=10**6)
            fast = plan_work(**kw)
            general = plan_work(**kw, fixed_chunk=10**9)
            assert fast.chunk is None and general.chunk is None
            assert fast.records.tolist() == general.records.tolist()


def test_loaded_module_is_one_lookup_and_no_gpu_is_still_reported():
    """dispatch.module(): a module already loaded on cuda:N comes back from memory without touching CUDA (plan()
    and append ask every step); anything else still needs a GPU and says so."""
    from attnjit import dispatch

    spec = AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=4)
    sentinel = object()
    dispatch._modules[(spec, 0)] = sentinel
    try:
        assert dispatch.module(spec, torch.device("cuda", 0)) is sentinel
        assert dispatch.module(spec, "cuda:0") is sentinel
    finally:
        dispatch.clear_memory()
    with pytest.raises(NoGPUError, match="run on CUDA devices; got device cpu"):
        dispatch.module(spec, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(NoGPUError, match="no CUDA device is available"):
            dispatch.module(spec, "cuda:0")


def test_work_order_keeps_a_requests_q_tiles_together():
    """Causal prefill of 64 and 256 tokens (group 4, 128-row q tiles): the longer request's 8 q tiles come first,
    last tile first, then the shorter one's 2; a global longest-first order would interleave the two requests and
    make each wave of CTAs re-read both requests' K/V."""
    from attnjit.families import tiles_for
    from attnjit.ops.scheduler import plan_work
    from attnjit.specs import AttentionSpec

    spec = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", group_size=4, mask="causal")
    wide = tiles_for(spec)[-1]
    assert wide.cta_q == 128
    work = plan_work(qo_lens=[64, 256], kv_lens=[64, 256], qo_offsets=[0, 64], kv_bases=[0, 4], group=4,
                     tile=wide, causal=True, num_kv_heads=8, slots=16, max_slots=0, allow_split=False)
    assert [(r[0], r[1]) for r in work.records.tolist()] == [(1, t) for t in range(7, -1, -1)] + [(0, 1), (0, 0)]


def test_a_split_groups_merge_stays_under_merge_rows():
    """A split group's last CTA merges its packed rows x chunks alone: the chunk doubles until that is at most
    MERGE_ROWS. A cascade's level 0 (16 requests' rows x group 4 = 64 packed rows over an 8192-token prefix, one
    128-row tile per KV head) gets 1024-token chunks (8 per group; run 62 measured 16 of 512 slower); decode's few
    packed rows keep the small chunks that fill the GPU."""
    from attnjit.ops.scheduler import MERGE_ROWS

    kw = dict(cta_kv=128, num_kv_heads=8, slots=132, max_slots=10 ** 6)
    assert choose_chunk([1], [8192], slot_rows=[16], **kw) == 512           # the rule off (no cta_q): 16 chunks
    assert choose_chunk([1], [8192], slot_rows=[16], group=4, cta_q=128, **kw) == 1024
    assert 64 * (8192 // 1024) <= MERGE_ROWS < 64 * (8192 // 512)
    decode = dict(cta_kv=64, num_kv_heads=8, slots=264, max_slots=10 ** 6)
    assert choose_chunk([1], [32768], slot_rows=[1], group=4, cta_q=16, **decode) == \
        choose_chunk([1], [32768], slot_rows=[1], **decode)
