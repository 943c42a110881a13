"""Deferred-merge plans (scheduler.defer_merges, the cascade's prefix levels): every item writes a partial state to
its own slots, no record asks its CTA to merge, and the merge table finds each query row's chunks. Checked by
executing the plan in float64 on the host the way the kernels address it (work.cuh partial_row, merge_state.cuh
merge_partials_body): each record's rows and keys as a state in its slot, then every row's chunks merged through
the table into a starting state, against one softmax over all of the row's keys."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attnjit.families import tiles_for
from attnjit.ops import scheduler
from attnjit.ops.cascade import MultiLevelCascadeAttentionWrapper
from attnjit.specs import AttentionSpec
from tests.helpers import make_cascade

TILE = tiles_for(AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", group_size=4, mask="causal",
                               family="sm90"))[0]   # kv128
H_KV = 2


def _plan(qo, kv, *, group, causal, chunk=None, max_slots=1 << 20, slots=64):
    offsets = np.concatenate([[0], np.cumsum(qo)[:-1]]).astype(np.int64)
    work = scheduler.plan_work(qo_lens=qo, kv_lens=kv, qo_offsets=offsets, kv_bases=[0] * len(qo), group=group,
                               tile=TILE, causal=causal, num_kv_heads=H_KV, slots=slots, max_slots=max_slots,
                               fixed_chunk=chunk, merge_in_kernel=False)
    return scheduler.defer_merges(work, int(sum(qo)), max_slots), offsets


def _execute(plan, qo, kv, offsets, *, group, causal, seed):
    """Run the deferred plan in float64 as the kernels would (one value per head: D = 1 suffices for addressing),
    merge through the table into a random starting state, and return (merged, expected) per (row, head)."""
    gen = np.random.default_rng(seed)
    hq, total_q = H_KV * group, int(sum(qo))
    logits = [gen.normal(size=(q, hq, k)) * 3 for q, k in zip(qo, kv)]
    values = [gen.normal(size=(k, H_KV)) for k in kv]
    slots = plan.num_slots
    tmp_o, tmp_lse = np.full((max(slots, 1) * hq,), np.nan), np.full((max(slots, 1) * hq,), np.nan)
    written = np.zeros(max(slots, 1) * hq, dtype=int)
    for r in plan.records.tolist():
        req, qt, kb, ke, slot0, c, nc, grp = r[:8]
        assert (nc, grp) == (1, -1) and slot0 >= 0   # no CTA merges; every item writes a partial state
        q, k = qo[req], kv[req]
        for h in range(H_KV):
            for pr in range(qt * TILE.cta_q, min((qt + 1) * TILE.cta_q, q * group)):
                tok, head = pr // group, h * group + pr % group
                stop = min(ke, k - q + tok + 1) if causal else ke
                s = logits[req][tok, head, kb:max(kb, stop)] * np.log2(np.e)
                row = (slot0 + c * q + tok) * hq + head   # work.cuh: (pslot + tok) * H_q + head
                if len(s):
                    m = s.max()
                    w = np.exp2(s - m)
                    tmp_o[row], tmp_lse[row] = (w @ values[req][kb:stop, h]) / w.sum(), m + np.log2(w.sum())
                else:
                    tmp_o[row], tmp_lse[row] = 0.0, -np.inf
                written[row] += 1
    assert written.max() <= 1, "two items wrote the same partial slot"
    table = plan.merge_table
    assert table.shape == (total_q, 3) and table.dtype == np.int32
    start_o, start_lse = gen.normal(size=(total_q, hq)), gen.normal(size=(total_q, hq)) * 3
    merged = np.zeros((total_q, hq))
    expected = np.zeros((total_q, hq))
    for req, (q, k) in enumerate(zip(qo, kv)):
        for tok in range(q):
            row = offsets[req] + tok
            first, stride, count = table[row].tolist()
            for head in range(hq):
                states = [(start_o[row, head], start_lse[row, head])]
                states += [(tmp_o[(first + i * stride) * hq + head], tmp_lse[(first + i * stride) * hq + head])
                           for i in range(count)]
                ls = np.array([s[1] for s in states])
                assert not np.isnan(ls).any(), "the table points at a slot no item wrote"
                m = ls.max()
                w = np.exp2(ls - m)
                merged[row, head] = sum(wi * s[0] for wi, s in zip(w, states) if wi) / w.sum()
                stop = k - q + tok + 1 if causal else k
                s = np.concatenate([[start_lse[row, head]], logits[req][tok, head, :stop] * np.log2(np.e)])
                vals = np.concatenate([[start_o[row, head]], values[req][:stop, head // group]])
                w = np.exp2(s - s.max())
                expected[row, head] = (w @ vals) / w.sum()
    return merged, expected


def _batch(rng: random.Random, causal: bool):
    n = rng.randint(1, 5)
    kv = [rng.choice([0, 1, rng.randint(1, 200), rng.randint(200, 1500)]) for _ in range(n)]
    qo = [rng.choice([1, rng.randint(1, 40)]) for _ in range(n)]
    if causal:
        qo = [max(0, min(q, k)) for q, k in zip(qo, kv)]
    return qo, kv


@pytest.mark.parametrize("seed", range(40))
def test_deferred_plan_merges_to_the_softmax_over_every_key(seed):
    rng = random.Random(seed)
    causal, group = rng.random() < 0.5, rng.choice([1, 4, 7])
    qo, kv = _batch(rng, causal)
    chunk = rng.choice([None, 256, 384])
    plan, offsets = _plan(qo, kv, group=group, causal=causal, chunk=chunk)
    assert plan.num_groups == 0 and plan.decision(H_KV)["merge"] == "deferred"
    merged, expected = _execute(plan, qo, kv, offsets, group=group, causal=causal, seed=seed)
    np.testing.assert_allclose(merged, expected, rtol=1e-9, atol=1e-9)


def test_deferred_chunks_are_not_limited_by_the_in_kernel_merge():
    """The cascade's prefix: 16 query rows (64 packed) over 8192 keys, 8 KV heads, 132 slots. The in-kernel merge
    caps a group at MERGE_ROWS packed rows x chunks (1024-token chunks, 64 CTAs); deferred, the chunk is the
    smallest that fills the GPU (512 tokens, 128 CTAs)."""
    args = dict(qo_lens=[16], kv_lens=[8192], qo_offsets=[0], kv_bases=[0], group=4, tile=TILE, causal=False,
                num_kv_heads=8, slots=132, max_slots=1 << 20)
    assert scheduler.plan_work(**args).chunk == 1024
    deferred = scheduler.plan_work(**args, merge_in_kernel=False)
    assert deferred.chunk == 512 and deferred.num_items * 8 == 128


def test_deferred_plan_that_does_not_fit_the_workspace_is_none():
    offsets = [0, 40]
    work = scheduler.plan_work(qo_lens=[40, 3], kv_lens=[100, 900], qo_offsets=offsets, kv_bases=[0, 0], group=4,
                               tile=TILE, causal=False, num_kv_heads=H_KV, slots=64, max_slots=12, fixed_chunk=256,
                               merge_in_kernel=False)
    assert work.num_slots == 12   # the split request's 4 chunks x 3 rows fit; the unsplit one's 40 rows do not
    assert scheduler.defer_merges(work, 43, max_slots=12) is None
    assert scheduler.defer_merges(work, 43, max_slots=52) is not None


def test_cascade_prefix_falls_back_to_in_kernel_merges_in_a_small_workspace():
    """A prefix level whose deferred partial states (one slot per query row, split or not) do not fit the workspace
    plans in-kernel merges (slots for split requests only), as before deferred merges: plan() does not fail."""
    b = make_cascade([1, 2, 1], [[(3, 40)], [(1, 5), (2, 9)]], page_size=4, num_qo_heads=8, num_kv_heads=2,
                     head_dim=128, dtype=torch.float16)
    slot = 8 * (128 + 1) * 4    # one partial state's bytes (H_q x (D + 1) floats)
    for slots, deferred in ((1, False), (4, True)):
        w = MultiLevelCascadeAttentionWrapper(2, torch.empty(slots * slot, dtype=torch.uint8))
        w.plan(*b.arrays("cpu"), 8, 2, 128, 4, q_data_type=torch.float16)
        assert (w.last_plan[0].get("merge") == "deferred") == deferred, slots
        assert (w._batch_prefill_wrappers[0]._plan.work.merge_table is not None) == deferred


def test_cascade_prefix_levels_plan_deferred_and_the_last_level_does_not():
    b = make_cascade([1, 2, 1], [[(3, 700)], [(1, 5), (2, 9)]], page_size=4, num_qo_heads=8, num_kv_heads=2,
                     head_dim=128, dtype=torch.float16)
    w = MultiLevelCascadeAttentionWrapper(2, torch.empty(64 << 20, dtype=torch.uint8))
    w.plan(*b.arrays("cpu"), 8, 2, 128, 4, q_data_type=torch.float16)
    prefix, suffix = (lw._plan.work for lw in w._batch_prefill_wrappers)
    assert prefix.merge_table is not None and suffix.merge_table is None
    assert w.last_plan[0]["merge"] == "deferred" and "merge" not in w.last_plan[1]
    assert (prefix.records[:, 6] == 1).all() and (prefix.records[:, 4] >= 0).all()


def test_level_0_fills_half_the_gpu_only_beside_an_unsplit_last_level(monkeypatch):
    """Level 0 runs beside the last level (cascade run()) only where that level is unsplit; then a level 0 that
    splits to fill the GPU fills half of it (ATTNJIT_NUM_SMS=132 here: 66 CTAs), else all of it."""
    monkeypatch.setenv("ATTNJIT_NUM_SMS", "132")
    ws = torch.empty(64 << 20, dtype=torch.uint8)
    ctas = {}
    for suffix in (40, 3000):   # 3000 keys split the last level (16 requests x 8 heads leave the GPU idle)
        b = make_cascade([1] * 16, [[(16, 8192)], [(1, suffix)] * 16], page_size=16, num_qo_heads=32,
                         num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
        w = MultiLevelCascadeAttentionWrapper(2, ws)
        w.plan(*b.arrays("cpu"), 32, 8, 128, 16, q_data_type=torch.bfloat16)
        level0 = w._batch_prefill_wrappers[0]
        assert level0._share_gpu == (suffix == 40) and w.last_plan[1]["split_kv"] == (suffix == 3000)
        assert w.last_plan[0]["merge"] == "deferred" and w.last_plan[0]["split_kv"]
        ctas[suffix] = w.last_plan[0]["ctas"]
    assert ctas[40] <= 66 < ctas[3000] <= 132


@pytest.mark.parametrize("seed", range(60))
def test_deferred_lists_agree_across_the_compiled_and_python_schedulers_and_both_defer_paths(seed, monkeypatch):
    """A deferred plan's records: the compiled scheduler (given the chunk plan_work chose without MERGE_ROWS) equals
    the Python one, and defer_merges' loop (short lists) equals its array form, record for record and slot for slot."""
    if scheduler._cplan is None:
        pytest.skip("attnjit._cplan is not built here (no C compiler when attnjit was installed)")
    rng = random.Random(1000 + seed)
    causal, group = rng.random() < 0.5, rng.choice([1, 4, 7])
    qo, kv = _batch(rng, causal)
    if rng.random() < 0.3:   # longer batches: the array paths
        qo, kv = qo * 6, kv * 6
    offsets = np.concatenate([[0], np.cumsum(qo)[:-1]]).astype(np.int64)
    args = dict(qo_lens=qo, kv_lens=kv, qo_offsets=offsets, kv_bases=[0] * len(qo), group=group, tile=TILE,
                causal=causal, num_kv_heads=H_KV, slots=rng.choice([16, 64, 132]), max_slots=1 << 20,
                merge_in_kernel=False)
    plans = {}
    for native in ("1", "0"):
        monkeypatch.setenv("ATTNJIT_NATIVE", native)
        plans[native] = scheduler.plan_work(**args)
    a, b = plans["1"], plans["0"]
    assert a.records.tolist() == b.records.tolist()
    assert (a.chunk, a.num_slots, a.num_groups, a.split_requests) == (b.chunk, b.num_slots, b.num_groups,
                                                                      b.split_requests)
    loop = scheduler._defer_loop(a, int(sum(qo)), 1 << 20)
    monkeypatch.setattr(scheduler, "SMALL_ITEMS", -1)   # the array form, whatever the length
    arrays = scheduler.defer_merges(a, int(sum(qo)), 1 << 20)
    assert loop.records.tolist() == arrays.records.tolist() and loop.num_slots == arrays.num_slots
    assert loop.merge_table.tolist() == arrays.merge_table.tolist()
