"""Shared pieces of the CPU plan() tests (test_plan_cpu.py, test_plan_split.py): a CPU workspace, the seed's batch
and argument builders, the scheduler's work records as dicts, and check_work(), the invariants every work list
keeps."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from attnjit.families import tiles_for
from attnjit.ops.attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                                   BatchPrefillWithRaggedKVCacheWrapper)
from attnjit.ops.scheduler import MIN_CHUNK, plan_work
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


# each wrapper kind with the builder of its seed plan() arguments
WRAPPERS = {"paged": (BatchPrefillWithPagedKVCacheWrapper, paged_args),
            "decode": (BatchDecodeWithPagedKVCacheWrapper, decode_args),
            "ragged": (BatchPrefillWithRaggedKVCacheWrapper, ragged_args)}


def column_view(values: list[int]) -> torch.Tensor:
    """values as column 0 of a [n, 2] int32 table: a strided view (stride 2)."""
    table = torch.stack([i32(values), i32([-7] * len(values))], dim=1)
    view = table[:, 0]
    assert view.stride() == (2,) or len(values) <= 1
    return view


def planned(kind):
    """A wrapper of ``kind`` (WRAPPERS) planned on the CPU with its seed arguments, and its plan."""
    make, args = WRAPPERS[kind]
    w = make(workspace())
    w.plan(**args())
    return w, w._plan


def run_inputs(kind, plan):
    """run()'s q and KV operand (zeros) for a plan of ``kind``: a ragged k and v, else a 15-page paged cache."""
    shape, dt = plan.q_shape, plan.q_dtype
    if kind == "ragged":
        return dict(q=torch.zeros(shape, dtype=dt), k=torch.zeros(17, 8, 64, dtype=dt),
                    v=torch.zeros(17, 8, 64, dtype=dt))
    return dict(q=torch.zeros(shape, dtype=dt), paged_kv_cache=torch.zeros(15, 2, 4, 8, 128, dtype=dt))
