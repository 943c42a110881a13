"""plan() on a CPU workspace: argument checking (every bad input names the argument, and the request where there is
one) and the split-KV scheduler. No GPU is needed: plan() validates and schedules anywhere; run() needs CUDA."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from attnjit.errors import NoGPUError
from attnjit.families import tiles_for
from attnjit.generator import PARAMS
from attnjit.ops.attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                                   BatchPrefillWithRaggedKVCacheWrapper)
from attnjit.ops.scheduler import MIN_CHUNK, choose_chunk, plan_work
from attnjit.specs import AttentionSpec
from tests.helpers import i32

WORKSPACE_BYTES = 32 << 20


def workspace(nbytes: int = WORKSPACE_BYTES) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


# The seed's batch (qo_indptr in query rows, kv_indptr in page ids).
SEED = dict(qo_indptr=[0, 3, 4, 8], paged_kv_indptr=[0, 2, 3, 6], paged_kv_indices=[7, 2, 11, 3, 14, 6],
            paged_kv_last_page_len=[2, 2, 1])
SEED_KV_LENS = [6, 2, 9]


def paged_args(**changes):
    """plan() arguments of the seed batch (32 q heads over 8 kv heads, D=128, page 4, causal), with changes;
    a list value becomes an int32 tensor."""
    args = dict(SEED, num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, page_size=4, causal=True,
                q_data_type=torch.float16)
    args.update(changes)
    return {k: i32(v) if isinstance(v, list) else v for k, v in args.items()}


def decode_args(**changes):
    args = dict(indptr=SEED["paged_kv_indptr"], indices=SEED["paged_kv_indices"],
                last_page_len=SEED["paged_kv_last_page_len"], num_qo_heads=32, num_kv_heads=8, head_dim=128,
                page_size=4, q_data_type=torch.bfloat16)
    args.update(changes)
    return {k: i32(v) if isinstance(v, list) else v for k, v in args.items()}


def ragged_args(**changes):
    args = dict(qo_indptr=SEED["qo_indptr"], kv_indptr=[0, 6, 8, 17], num_qo_heads=32, num_kv_heads=8,
                head_dim_qk=64, causal=True, q_data_type=torch.float16)
    args.update(changes)
    return {k: i32(v) if isinstance(v, list) else v for k, v in args.items()}


# --- work records ---------------------------------------------------------------------------------------------

_FIELDS = ("req", "qtile", "kv_begin", "kv_end", "slot0", "chunk", "chunks", "group", "q_row0", "q_rows", "kv_len",
           "kv_base")


def _starts(lengths) -> list[int]:
    out = [0]
    for n in lengths[:-1]:
        out.append(out[-1] + n)
    return out


def schedule(**kw):
    """plan_work with kv_bases of back-to-back (ragged) histories unless given."""
    kw.setdefault("kv_bases", _starts(kw["kv_lens"]))
    return plan_work(**kw)


def records(work) -> list[dict]:
    """The plan's work items as dicts (record layout: see scheduler.WorkPlan.records)."""
    return [dict(zip(_FIELDS, map(int, r), strict=True)) for r in work.records]


def check_work(work, *, qo_lens, kv_lens, group, tile, causal, max_slots, fixed=False, kv_bases=None):
    """Invariants every plan must hold; returns the items."""
    items = records(work)
    qo_offsets = _starts(qo_lens)
    kv_bases = _starts(kv_lens) if kv_bases is None else kv_bases
    by_tile = defaultdict(list)
    for it in items:
        assert 0 <= it["kv_begin"] <= it["kv_end"] <= kv_lens[it["req"]], it
        # a record carries its request's whole description (the kernel reads no indptr tables)
        i = it["req"]
        assert (it["q_row0"], it["q_rows"], it["kv_len"], it["kv_base"]) == \
            (qo_offsets[i], qo_lens[i], kv_lens[i], kv_bases[i]), it
        by_tile[it["req"], it["qtile"]].append(it)
    # one set of items per (request, q tile of CTA_Q packed rows); none for requests without queries
    want_tiles = {(i, t) for i, q in enumerate(qo_lens) for t in range(math.ceil(q * group / tile.cta_q))}
    assert set(by_tile) == want_tiles
    # every kv token is covered exactly once per (request, q tile)
    for (i, t), its in by_tile.items():
        its.sort(key=lambda it: it["kv_begin"])
        assert its[0]["kv_begin"] == 0 and its[-1]["kv_end"] == kv_lens[i]
        for a, b in zip(its, its[1:]):
            assert a["kv_end"] == b["kv_begin"], f"request {i} q tile {t}: gap or overlap at {a['kv_end']}"
        n = len(its)
        assert all(it["chunks"] == n for it in its) and [it["chunk"] for it in its] == list(range(n))
        if n == 1:
            assert its[0]["slot0"] == -1 and its[0]["group"] == -1
        else:
            assert work.chunk is not None and work.chunk % tile.cta_kv == 0
            assert fixed or work.chunk >= MIN_CHUNK
            assert all(it["kv_begin"] == it["chunk"] * work.chunk for it in its)
            assert all(it["kv_end"] - it["kv_begin"] <= work.chunk for it in its)
            assert len({it["group"] for it in its}) == 1 and its[0]["group"] >= 0
            assert len({it["slot0"] for it in its}) == 1 and its[0]["slot0"] >= 0
    # split groups are numbered 0..G-1, one per split (request, q tile)
    groups = {it["group"] for it in items if it["group"] >= 0}
    assert groups == set(range(work.num_groups))
    # a split request owns chunks x qo_len partial slots; requests never share a slot; all fit the workspace
    spans = {}
    for it in items:
        if it["slot0"] >= 0:
            spans[it["req"]] = (it["slot0"], it["slot0"] + it["chunks"] * qo_lens[it["req"]])
    taken = sorted(spans.values())
    assert all(a[1] <= b[0] for a, b in zip(taken, taken[1:])), "two requests share partial slots"
    assert work.num_slots == sum(b - a for a, b in taken) <= max_slots
    assert work.split_requests == len(spans)
    # order: each request's items form one run (they share its K/V in L2), runs ordered by their costliest item,
    # items within a run longest first; cost = packed rows x visible kv tokens
    costs = []
    for it in items:
        q, k = qo_lens[it["req"]], kv_lens[it["req"]]
        rows = min(tile.cta_q, q * group - it["qtile"] * tile.cta_q)
        last_token = (it["qtile"] * tile.cta_q + rows - 1) // group
        end = k - q + last_token + 1 if causal else k
        costs.append(rows * max(1, max(0, min(it["kv_end"], end) - it["kv_begin"])))
    runs: list[tuple[int, list[int]]] = []
    for it, c in zip(items, costs):
        if runs and runs[-1][0] == it["req"]:
            runs[-1][1].append(c)
        else:
            runs.append((it["req"], [c]))
    assert len(runs) == len({r for r, _ in runs}), "a request's work items are not contiguous"
    for r, cs in runs:
        assert cs == sorted(cs, reverse=True), f"request {r}'s work items are not ordered longest first"
    heads = [cs[0] for _r, cs in runs]
    assert heads == sorted(heads, reverse=True), "requests are not ordered by their costliest item"
    return items


DECODE_G4 = AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=4)
NARROW = tiles_for(DECODE_G4)[0]


# --- the seed batch plans -----------------------------------------------------------------------------------

def test_seed_batch_plans_for_paged_prefill():
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(**paged_args())
    plan = w._plan
    # 4 query rows x group 4 = 16 packed rows: a narrow batch, which runs on fa2 whatever the arch's default
    assert plan.spec == AttentionSpec(op="prefill", head_dim=128, page_size=4, dtype="fp16", mask="causal",
                                      group_size=4, family="fa2")
    assert (plan.batch_size, plan.total_q, plan.max_page) == (3, 8, 14)
    items = check_work(plan.work, qo_lens=[3, 1, 4], kv_lens=SEED_KV_LENS, group=4, tile=plan.work.tile,
                       causal=True, max_slots=10 ** 9, kv_bases=[0, 2, 3])
    assert sorted((it["req"], it["kv_end"]) for it in items) == [(0, 6), (1, 2), (2, 9)]
    d = w.last_plan
    assert d["split_kv"] is False and d["work_items"] == 3 and d["ctas"] == 3 * 8
    assert d["tile"] == tiles_for(plan.spec)[0].name  # 4 rows x group 4 = 16 packed rows: the narrow tile


def test_seed_batch_plans_for_decode_and_ragged():
    d = BatchDecodeWithPagedKVCacheWrapper(workspace())
    d.plan(**decode_args())
    assert d._plan.spec == AttentionSpec(op="decode", head_dim=128, page_size=4, dtype="bf16", group_size=4)
    check_work(d._plan.work, qo_lens=[1, 1, 1], kv_lens=SEED_KV_LENS, group=4, tile=d._plan.work.tile,
               causal=False, max_slots=10 ** 9, kv_bases=[0, 2, 3])
    r = BatchPrefillWithRaggedKVCacheWrapper(workspace())
    r.plan(**ragged_args())
    assert r._plan.spec == AttentionSpec(op="prefill", head_dim=64, dtype="fp16", kv="ragged", mask="causal",
                                         group_size=4, family="fa2")
    assert r._plan.total_kv == 17
    check_work(r._plan.work, qo_lens=[3, 1, 4], kv_lens=SEED_KV_LENS, group=4, tile=r._plan.work.tile,
               causal=True, max_slots=10 ** 9)


def test_hnd_layout_and_dtype_names_reach_the_spec():
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout="HND")
    w.plan(**paged_args(q_data_type="bfloat16", causal=False))
    assert w._plan.spec == AttentionSpec(op="prefill", head_dim=128, page_size=4, dtype="bf16", layout="HND",
                                         group_size=4, family="fa2")


@pytest.mark.parametrize("make,args,run_args", [
    (BatchPrefillWithPagedKVCacheWrapper, paged_args, lambda: (torch.zeros(8, 32, 128, dtype=torch.float16),
                                                                torch.zeros(15, 2, 4, 8, 128, dtype=torch.float16))),
    (BatchDecodeWithPagedKVCacheWrapper, decode_args, lambda: (torch.zeros(3, 32, 128, dtype=torch.bfloat16),
                                                               torch.zeros(15, 2, 4, 8, 128, dtype=torch.bfloat16))),
    (BatchPrefillWithRaggedKVCacheWrapper, ragged_args, lambda: (torch.zeros(8, 32, 64, dtype=torch.float16),
                                                                 torch.zeros(17, 8, 64, dtype=torch.float16),
                                                                 torch.zeros(17, 8, 64, dtype=torch.float16))),
], ids=["paged", "decode", "ragged"])
def test_run_after_a_cpu_plan_raises_no_gpu(make, args, run_args):
    w = make(workspace())
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        w.run(*run_args())
    w.plan(**args())
    with pytest.raises(NoGPUError, match="planned on cpu; kernels run on CUDA devices only"):
        w.run(*run_args())


# --- bad input: the error names the argument (and the request) --------------------------------------------------

I64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
F32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731

PAGED_BAD = {
    "int64 qo_indptr": (dict(qo_indptr=I64(SEED["qo_indptr"])), TypeError, r"qo_indptr must be int32, got torch.int64"),
    "int64 indices": (dict(paged_kv_indices=I64(SEED["paged_kv_indices"])), TypeError,
                      r"paged_kv_indices must be int32, got torch.int64"),
    "float last_page_len": (dict(paged_kv_last_page_len=F32([2, 2, 1])), TypeError,
                            r"paged_kv_last_page_len must be int32, got torch.float32"),
    "list metadata": (dict(paged_kv_indptr=None), TypeError, r"paged_kv_indptr must be a torch.Tensor"),
    "2-D metadata": (dict(qo_indptr=torch.tensor([[0, 3, 4, 8]], dtype=torch.int32)), ValueError,
                     r"qo_indptr must be 1-D"),
    "kv_indptr too short": (dict(paged_kv_indptr=[0, 2, 6]), ValueError,
                            r"paged_kv_indptr must have 4 elements, got 3"),
    "last_page_len too short": (dict(paged_kv_last_page_len=[2, 2]), ValueError,
                                r"paged_kv_last_page_len must have 3 elements, got 2"),
    "qo_indptr not monotone": (dict(qo_indptr=[0, 3, 2, 8]), ValueError,
                               r"qo_indptr must be non-decreasing: qo_indptr\[2\]=2 < qo_indptr\[1\]=3 \(request 1\)"),
    "kv_indptr not monotone": (dict(paged_kv_indptr=[0, 2, 1, 6]), ValueError,
                               r"paged_kv_indptr must be non-decreasing: .*\(request 1\)"),
    "qo_indptr[0] != 0": (dict(qo_indptr=[1, 3, 4, 8]), ValueError, r"qo_indptr\[0\] must be 0, got 1"),
    "kv_indptr[0] != 0": (dict(paged_kv_indptr=[1, 2, 3, 6]), ValueError, r"paged_kv_indptr\[0\] must be 0, got 1"),
    "last_page_len 0": (dict(paged_kv_last_page_len=[2, 0, 1]), ValueError,
                        r"paged_kv_last_page_len\[1\]=0 is outside 1..page_size=4 \(request 1"),
    "last_page_len > page_size": (dict(paged_kv_last_page_len=[2, 2, 5]), ValueError,
                                  r"paged_kv_last_page_len\[2\]=5 is outside 1..page_size=4 \(request 2"),
    "last_page_len without pages": (dict(paged_kv_indptr=[0, 2, 2, 5], paged_kv_last_page_len=[2, 3, 1],
                                         causal=False), ValueError,
                                    r"paged_kv_last_page_len\[1\]=3 but request 1 has no pages"),
    "negative page id": (dict(paged_kv_indices=[7, 2, 11, 3, -1, 6]), ValueError,
                         r"paged_kv_indices\[4\]=-1 is not a valid page id \(request 2\)"),
    "indptr past indices": (dict(paged_kv_indptr=[0, 2, 3, 7]), ValueError,
                            r"paged_kv_indices has 6 entries but paged_kv_indptr\[-1\]=7"),
    "causal qo_len > kv_len": (dict(qo_indptr=[0, 3, 6, 10]), ValueError,
                               r"qo_indptr: request 1 has 3 query rows but a KV length of 2 \(paged_kv_indptr/paged_kv_last_page_len\); "
                               r"with causal=True"),
    "H_q not a multiple of H_kv": (dict(num_qo_heads=30), ValueError,
                                   r"num_qo_heads=30 must be a multiple of num_kv_heads=8"),
    "zero kv heads": (dict(num_kv_heads=0), ValueError, r"num_kv_heads must be a positive int <= 1024, got 0"),
    "head_dim 96": (dict(head_dim_qk=96), ValueError,
                    r"head_dim_qk=96 is not supported: allowed head dims are 64, 128, 256"),
    "head_dim_vo differs": (dict(head_dim_vo=64), ValueError, r"head_dim_vo=64 must equal head_dim_qk=128"),
    "float32 q": (dict(q_data_type=torch.float32), TypeError,
                  r"q_data_type=torch.float32 is not supported: expected torch.float16 or torch.bfloat16"),
    "float32 kv": (dict(kv_data_type=torch.float32), TypeError, r"kv_data_type=torch.float32 is not supported"),
    "mixed q/kv": (dict(kv_data_type=torch.bfloat16), ValueError, r"kv_data_type=torch.bfloat16 must equal "
                                                                   r"q_data_type=torch.float16"),
    "page_size 0": (dict(page_size=0), ValueError, r"page_size=0 is not supported: expected an integer from 1 to 1024"),
    "page_size 1025": (dict(page_size=1025), ValueError, r"page_size=1025 is not supported"),
    "sm_scale negative": (dict(sm_scale=-1.0), ValueError, r"sm_scale must be a positive finite number, got -1.0"),
    "negative soft cap": (dict(logits_soft_cap=-30.0), ValueError, r"logits_soft_cap must be a positive finite number, got -30.0"),
    "bad window": (dict(window_left=-5), ValueError, r"window_left=-5 must be -1 \(no window\) or a non-negative int"),
    "unknown pos encoding": (dict(pos_encoding_mode="ROPE_NEOX"), NotImplementedError,
                             r"pos_encoding_mode='ROPE_NEOX' is not supported: expected one of NONE, ALIBI, ROPE_LLAMA"),
    "rope_theta negative": (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=-1.0), ValueError,
                            r"rope_theta must be a positive finite number, got -1.0"),
    "rope_scale a string": (dict(pos_encoding_mode="ROPE_LLAMA", rope_scale="2"), TypeError,
                            r"rope_scale must be a number"),
    "sinks not a flag": (dict(sinks=torch.ones(32)), TypeError, r"sinks must be True or False"),
    "custom mask length": (dict(custom_mask=torch.ones(5, dtype=torch.bool)), ValueError,
                           r"custom_mask has 5 elements; the batch needs sum\(qo_len \* kv_len\) = 56"),
    "packed mask length": (dict(packed_custom_mask=torch.ones(3, dtype=torch.uint8)), ValueError,
                           r"packed_custom_mask has 3 bytes; the batch needs 9"),
}


@pytest.mark.parametrize("name", list(PAGED_BAD))
def test_paged_prefill_plan_rejects(name):
    changes, exc, pattern = PAGED_BAD[name]
    args = paged_args(**changes)
    if args.get("paged_kv_indptr") is None:
        args["paged_kv_indptr"] = SEED["paged_kv_indptr"]  # a plain list, not a tensor
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    with pytest.raises(exc, match=pattern):
        w.plan(**args)
    assert w.last_plan is None, "a rejected plan() left a plan behind"


DECODE_BAD = {
    "int64 indptr": (dict(indptr=I64(SEED["paged_kv_indptr"])), TypeError, r"^indptr must be int32"),
    "float indices": (dict(indices=F32(SEED["paged_kv_indices"])), TypeError, r"^indices must be int32"),
    "last_page_len length": (dict(last_page_len=[2, 2, 1, 1]), ValueError, r"^last_page_len must have 3 elements"),
    "indptr not monotone": (dict(indptr=[0, 3, 2, 6]), ValueError, r"indptr must be non-decreasing.*\(request 1\)"),
    "last_page_len > page_size": (dict(last_page_len=[2, 9, 1]), ValueError,
                                  r"last_page_len\[1\]=9 is outside 1..page_size=4 \(request 1"),
    "negative page id": (dict(indices=[7, -2, 11, 3, 14, 6]), ValueError,
                         r"indices\[1\]=-2 is not a valid page id \(request 0\)"),
    "head_dim 96": (dict(head_dim=96), ValueError, r"head_dim=96 is not supported"),
    "group of 5 over 3": (dict(num_qo_heads=5, num_kv_heads=3), ValueError, r"num_qo_heads=5 must be a multiple"),
    "float32": (dict(q_data_type="float32"), TypeError, r"q_data_type='float32' is not supported"),
    "page_size 2048": (dict(page_size=2048), ValueError, r"page_size=2048"),
}


@pytest.mark.parametrize("name", list(DECODE_BAD))
def test_decode_plan_rejects(name):
    changes, exc, pattern = DECODE_BAD[name]
    with pytest.raises(exc, match=pattern):
        BatchDecodeWithPagedKVCacheWrapper(workspace()).plan(**decode_args(**changes))


RAGGED_BAD = {
    "int64 kv_indptr": (dict(kv_indptr=I64([0, 6, 8, 17])), TypeError, r"kv_indptr must be int32"),
    "kv_indptr length": (dict(kv_indptr=[0, 6, 17]), ValueError, r"kv_indptr must have 4 elements, got 3"),
    "kv_indptr not monotone": (dict(kv_indptr=[0, 6, 5, 17]), ValueError,
                               r"kv_indptr must be non-decreasing: kv_indptr\[2\]=5 < kv_indptr\[1\]=6 \(request 1\)"),
    "causal qo_len > kv_len": (dict(kv_indptr=[0, 6, 8, 11]), ValueError,
                               r"request 2 has 4 query rows but a KV length of 3"),
    "head_dim 96": (dict(head_dim_qk=96), ValueError, r"head_dim_qk=96 is not supported"),
    "float32": (dict(q_data_type=torch.float32), TypeError, r"q_data_type=torch.float32"),
}


@pytest.mark.parametrize("name", list(RAGGED_BAD))
def test_ragged_plan_rejects(name):
    changes, exc, pattern = RAGGED_BAD[name]
    with pytest.raises(exc, match=pattern):
        BatchPrefillWithRaggedKVCacheWrapper(workspace()).plan(**ragged_args(**changes))


def test_non_causal_allows_more_queries_than_keys():
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace())
    w.plan(**ragged_args(kv_indptr=[0, 6, 8, 11], causal=False))
    assert w._plan.total_kv == 11


def test_constructor_rejects_bad_workspaces_and_layouts():
    with pytest.raises(ValueError, match="float_workspace_buffer must be a contiguous 1-D tensor"):
        BatchPrefillWithPagedKVCacheWrapper(torch.empty(4, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float_workspace_buffer must be a torch.Tensor"):
        BatchDecodeWithPagedKVCacheWrapper(bytearray(16))
    with pytest.raises(ValueError, match="kv_layout='NDH' is not supported"):
        BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout="NDH")
    with pytest.raises(ValueError, match="kv_layout='HND' is not supported for ragged KV"):
        BatchPrefillWithRaggedKVCacheWrapper(workspace(), kv_layout="HND")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a wrapper over a CUDA workspace needs a CUDA device")
def test_host_metadata_is_accepted_by_a_cuda_wrapper():
    """As in FlashInfer, plan() takes its metadata on the host too (it reads it on the host anyway); the page ids
    travel to the device with the plan. (tests/gpu/test_attention.py runs such a plan against the reference.)"""
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"))
    w.plan(**paged_args())
    assert w.last_plan["work_items"] == 3


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


# --- kernel families: which one a plan runs on ------------------------------------------------------------------

def test_plan_picks_the_family_by_arch_batch_and_backend():
    """On sm_90a a wide prefill batch runs on sm90 and a narrow one (decode-like rows) on fa2; backend= forces one
    (FlashInfer's names: 'fa3' is attnjit's sm90); decode runs on fa2 whatever the backend; the record names it."""
    wide = dict(qo_indptr=i32([0, 300]), paged_kv_indptr=i32([0, 19]), paged_kv_indices=i32(list(range(19))),
                paged_kv_last_page_len=i32([12]), num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, page_size=16,
                causal=True, q_data_type=torch.bfloat16)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(**wide)
    assert w._plan.spec.family == "sm90" and w.last_plan["family"] == "sm90"
    assert w.last_plan["tile"] == tiles_for(w._plan.spec)[0].name
    assert w._plan.attn_values[PARAMS["attention"].index["work_count"]] == 0  # no GPU: pointers stay 0
    w.plan(**paged_args())                    # 16 packed rows: fa2's narrow tile
    assert w._plan.spec.family == "fa2"
    for backend, family in (("fa2", "fa2"), ("fa3", "sm90"), ("sm90", "sm90"), ("auto", "sm90")):
        f = BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=backend)
        f.plan(**wide)
        assert f._plan.spec.family == family, backend
    f = BatchPrefillWithPagedKVCacheWrapper(workspace(), backend="fa3")
    f.plan(**paged_args())                    # forced: even a narrow batch
    assert f._plan.spec.family == "sm90"
    d = BatchDecodeWithPagedKVCacheWrapper(workspace(), backend="fa3")
    d.plan(**decode_args())
    assert d._plan.spec.family == "fa2"
    for bad in ("fa4", "cudnn", None, 3):
        with pytest.raises(ValueError, match="backend=.* is not supported"):
            BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=bad)


def test_sm90_is_not_chosen_off_hopper(monkeypatch):
    monkeypatch.setenv("ATTNJIT_ARCH", "sm_80")
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(qo_indptr=i32([0, 300]), paged_kv_indptr=i32([0, 19]), paged_kv_indices=i32(list(range(19))),
           paged_kv_last_page_len=i32([12]), num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, page_size=16,
           causal=True, q_data_type=torch.bfloat16)
    assert w._plan.spec.family == "fa2" and w._plan.spec.arch == "sm_80"
    f = BatchPrefillWithPagedKVCacheWrapper(workspace(), backend="fa3")
    with pytest.raises(ValueError, match="backend='fa3' cannot run this plan: the sm90 family needs arch sm_90a"):
        f.plan(**paged_args())
