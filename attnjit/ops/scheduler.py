"""The split-KV scheduler: turns request lengths into a work list that fills the GPU. Pure host code (numpy).

A work item is (request, q tile of CTA_Q packed rows, KV range). Without splitting there is one item per
(request, q tile); the grid's y dimension adds the KV heads. When those items cannot fill the GPU
(``items * H_kv < slots``, slots = SMs x resident CTAs per SM), long histories are cut into equal chunks, the
smallest chunk (a multiple of the KV tile, at least ``MIN_CHUNK`` tokens) for which the items still fit in one
wave of slots. Each chunk of a split request writes an fp32 partial state per (token, head) to a workspace slot;
the last CTA of each split group (request, q tile, KV head) merges them.

Order: requests heaviest first (by their costliest item), and within a request its items longest first. Pure
longest-first (LPT) over the whole batch would start the last q tile of every request together, so each wave of
CTAs would read every request's K/V once more: with a batch's K/V larger than L2 (32 x 512 tokens at H_kv 8,
head_dim 128 is 67 MB) that re-reads it from DRAM wave after wave. Keeping a request's q tiles together lets them
share its K/V in L2, and the tail of the list is still the cheapest items.

Large batches are built with array operations over all items at once (plan() runs every step, and a loop costs
microseconds per item); small ones by a loop, which is cheaper than numpy's per-call cost there.
tests/test_scheduler.py holds the loop-only version this replaced and checks that both paths give its records on
thousands of random plans. Where the optional C accelerator was built (``attnjit._cplan``, setup.py), it computes the
same work list in one call instead (tests/test_native_plan.py holds it to this module's records); ATTNJIT_NATIVE=0
turns it off, and a plan it refuses is planned here again, for the error's message.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .. import knobs

try:  # the optional compiled scheduler (attnjit/native/cplan.c)
    from .. import _cplan
except ImportError:  # not built here (no C compiler at install time): plan in Python
    _cplan = None

MIN_CHUNK = 256           # kv tokens: below this a chunk's partial-state traffic stops being small against its KV
MAX_WORK_ITEMS = 1 << 20  # work records per plan: counted before the list is built
SMALL_BATCH, SMALL_ITEMS = 8, 40  # up to this many requests and items, a loop builds the list faster than numpy
# The last CTA of a split group merges the group's chunks alone (split.cuh): packed rows x chunks is its work. Past
# this many, that merge costs more than the wave more chunks fill (run 62, a cascade's level 0 of 64 packed rows:
# 8 chunks 0.034 ms, 16 chunks 0.040), so the chunk doubles until every split group is under it.
MERGE_ROWS = 512
RECORD_FIELDS = ("request", "q_tile", "kv_begin", "kv_end", "slot0", "chunk", "chunks", "group", "q_row0", "q_rows",
                 "kv_len", "kv_base")
_EMPTY = np.zeros((0, len(RECORD_FIELDS)), dtype=np.int32)


@dataclass(slots=True)
class WorkPlan:
    tile: Any                      # the kernel family's tile (cta_q, cta_kv, name)
    # [W, 12] int32, one row per work item (the kernel's AttentionCTA::setup; RECORD_FIELDS): request, q tile, kv
    # begin, kv end, chunk-0 partial slot or -1, chunk, chunks, group or -1, first query row, query rows, kv length,
    # kv base
    records: np.ndarray = field(default_factory=lambda: _EMPTY)
    num_groups: int = 0            # split groups (request, q tile); each has one ticket counter per KV head
    chunk: int | None = None       # kv tokens per chunk of split requests; None = nothing split
    num_slots: int = 0             # partial-state slots used
    split_requests: int = 0
    slots_target: int = 0          # SMs x CTAs per SM the plan aimed to fill
    # a deferred-merge plan (defer_merges): [total_q, 3] int32, each query row's first partial slot, the slot stride
    # between its chunks and its chunks; the kernels then merge nothing (merge_partials does, after them)
    merge_table: np.ndarray | None = None

    @property
    def num_items(self) -> int:
        return len(self.records)

    def decision(self, num_kv_heads: int) -> dict:
        out = {"tile": self.tile.name, "work_items": self.num_items, "ctas": self.num_items * num_kv_heads,
               "gpu_slots": self.slots_target, "split_kv": self.chunk is not None, "chunk_kv": self.chunk,
               "split_requests": self.split_requests, "split_groups": self.num_groups}
        if self.merge_table is not None:
            out["merge"] = "deferred"
        return out


def _ceil(a, b):
    return -(-a // b)


def choose_chunk(tiles, kv_lens, *, cta_kv: int, num_kv_heads: int, slots: int, slot_rows, max_slots: int,
                 group: int = 1, cta_q: int = 0) -> int | None:
    """The smallest chunk (multiple of cta_kv, >= MIN_CHUNK) whose items fit in ``slots`` CTAs, doubled while the
    partial states would not fit in the workspace (``max_slots``) or, with ``cta_q``, while a split group's merge
    (its q tile's packed rows, at most cta_q of slot_rows x group, times its chunks) is past MERGE_ROWS; or None.

    None when the unsplit items already fill the GPU, when no history is longer than the minimum chunk, or when
    the doubling reaches the longest history. Lists or numpy arrays.
    """
    total = int(tiles.sum()) if isinstance(tiles, np.ndarray) else sum(tiles)
    if total * num_kv_heads >= slots:
        return None
    # the requests with work are fewer than slots / H_kv here: few, so plain Python over them is cheapest
    t, k, r = (x.tolist() if isinstance(x, np.ndarray) else x for x in (tiles, kv_lens, slot_rows))
    active = [(ti, kk, rr) for ti, kk, rr in zip(t, k, r) if ti]
    max_kv = max((kk for _, kk, _ in active), default=0)
    min_chunk = max(MIN_CHUNK, 2 * cta_kv)
    if max_kv <= min_chunk:
        return None

    def items(c: int) -> int:
        return sum([ti * -(-kk // c) for ti, kk, _ in active if kk]) * num_kv_heads

    def partial_slots(c: int) -> int:
        return sum([rows * -(-kk // c) for _, kk, rows in active if kk > c])

    def merge_rows(c: int) -> int:  # the largest merge one group's last CTA does
        return max([min(cta_q, rows * group) * -(-kk // c) for _, kk, rows in active if kk > c], default=0)

    lo, hi = _ceil(min_chunk, cta_kv), _ceil(max_kv, cta_kv)  # in units of cta_kv
    while lo < hi:  # smallest c with items(c) <= slots (items is non-increasing in c)
        mid = (lo + hi) // 2
        if items(mid * cta_kv) <= slots:
            hi = mid
        else:
            lo = mid + 1
    chunk = lo * cta_kv
    while chunk < max_kv and (partial_slots(chunk) > max_slots or (cta_q and merge_rows(chunk) > MERGE_ROWS)):
        chunk *= 2
    return chunk if chunk < max_kv else None


def defer_merges(plan: WorkPlan, total_q: int, max_slots: int) -> WorkPlan | None:
    """The plan with every merge left to a second kernel (merge_partials, ops/merge.py): every item writes an fp32
    partial state (unsplit requests get slots too, as one-chunk groups), no record asks its CTA to merge (chunks 1,
    group -1; the kernels merge only when chunks > 1), and ``merge_table`` says where each query row's chunks lie.
    For batches where a split group's merge by its last CTA would cost more than the second launch: a cascade's
    shared prefix, many query rows over one long history (run 62: 16 chunks of 64 rows cost more than they fill).
    None when those partial states do not fit in the workspace's ``max_slots`` (the caller plans in-kernel merges,
    which need slots for split requests only)."""
    if len(plan.records) <= SMALL_ITEMS:
        return _defer_loop(plan, total_q, max_slots)
    recs = plan.records.copy()
    next_slot = plan.num_slots
    if len(recs):
        unsplit = recs[:, 4] < 0
        if unsplit.any():   # each unsplit request: qo_len slots of its own (its q tiles share them, by token)
            reqs, first, inverse = np.unique(recs[unsplit, 0], return_index=True, return_inverse=True)
            rows = recs[unsplit, 9][first].astype(np.int64)
            bases = next_slot + np.cumsum(rows) - rows
            recs[unsplit, 4] = bases[inverse]
            recs[unsplit, 5] = 0
            next_slot += int(rows.sum())
    if next_slot > max_slots:
        return None
    table = np.zeros((total_q, 3), dtype=np.int32)
    heads = recs[(recs[:, 1] == 0) & (recs[:, 5] == 0)] if len(recs) else recs   # one record per request
    if len(heads):
        q = heads[:, 9].astype(np.int64)
        owner = np.repeat(np.arange(len(heads)), q)
        tok = np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q)
        rows = heads[owner, 8] + tok
        table[rows, 0] = heads[owner, 4] + tok
        table[rows, 1] = heads[owner, 9]
        table[rows, 2] = heads[owner, 6]
    recs[:, 6] = 1
    recs[:, 7] = -1
    return WorkPlan(tile=plan.tile, records=recs, num_groups=0, chunk=plan.chunk, num_slots=next_slot,
                    split_requests=plan.split_requests, slots_target=plan.slots_target, merge_table=table)


def _defer_loop(plan: WorkPlan, total_q: int, max_slots: int) -> WorkPlan | None:
    """defer_merges for a short work list, record by record (a numpy call costs more than a short loop); the same
    slots (unsplit requests in request order after the split ones) and table."""
    recs = plan.records.tolist()
    next_slot, bases = plan.num_slots, {}
    for req, rows in sorted({r[0]: r[9] for r in recs if r[4] < 0}.items()):
        bases[req] = next_slot
        next_slot += rows
    if next_slot > max_slots:
        return None
    table = np.zeros((total_q, 3), dtype=np.int32)
    for r in recs:
        if r[4] < 0:
            r[4], r[5] = bases[r[0]], 0
        if r[1] == 0 and r[5] == 0:   # one record per request: its rows' slots, stride and chunks
            row0, rows = r[8], r[9]
            table[row0:row0 + rows, 0] = np.arange(r[4], r[4] + rows)
            table[row0:row0 + rows, 1] = rows
            table[row0:row0 + rows, 2] = r[6]
        r[6], r[7] = 1, -1
    records = np.array(recs, dtype=np.int32).reshape(-1, len(RECORD_FIELDS)) if recs else _EMPTY
    return WorkPlan(tile=plan.tile, records=records, num_groups=0, chunk=plan.chunk, num_slots=next_slot,
                    split_requests=plan.split_requests, slots_target=plan.slots_target, merge_table=table)


def item_costs(records: np.ndarray, *, cta_q: int, group: int, causal: bool) -> np.ndarray:
    """What the work order sorts by, per record: packed rows x KV tokens the item visits (at least 1)."""
    r = records.astype(np.int64, copy=False)
    qt, kv_begin, kv_end, q, k = r[:, 1], r[:, 2], r[:, 3], r[:, 9], r[:, 10]
    return _costs(qt, kv_begin, kv_end, q, k, cta_q=cta_q, group=group, causal=causal)


def _costs(qt, kv_begin, kv_end, q, k, *, cta_q: int, group: int, causal: bool) -> np.ndarray:
    rows = np.minimum(cta_q, q * group - qt * cta_q)
    end = k - q + (qt * cta_q + rows - 1) // group + 1 if causal else k
    return rows * np.maximum(1, np.minimum(kv_end, end) - kv_begin)


def _check_count(count: int, cta_q: int, chunk: int | None, fixed_chunk: int | None) -> None:
    if count > MAX_WORK_ITEMS:
        raise ValueError(f"this plan would need {count} work items (the query rows of qo_indptr in q tiles of "
                         f"{cta_q} packed rows, times KV chunks of {chunk} tokens with fixed_split_size="
                         f"{fixed_chunk}); one plan takes at most {MAX_WORK_ITEMS}: plan fewer rows or a larger "
                         "fixed_split_size")


def _check_slots(needed: int, max_slots: int) -> None:
    if needed > max_slots:
        raise ValueError(f"the split-KV plan needs {needed} partial-state slots but the workspace holds {max_slots}; "
                         "pass a larger float_workspace_buffer or a larger fixed_split_size")


def _list(x) -> list[int]:
    return x.tolist() if isinstance(x, np.ndarray) else [int(v) for v in x]


def plan_work(*, qo_lens: Sequence[int], kv_lens: Sequence[int], qo_offsets: Sequence[int],
              kv_bases: Sequence[int], group: int, tile: Any, causal: bool, num_kv_heads: int, slots: int,
              max_slots: int, allow_split: bool = True, fixed_chunk: int | None = None,
              merge_in_kernel: bool = True) -> WorkPlan:
    """Work list for one batch. ``qo_offsets[i]`` is request i's first query row (qo_indptr[i]); ``kv_bases[i]``
    its first page-table entry (paged) or first kv row (ragged). Sequences or numpy arrays.

    Small batches (at most SMALL_BATCH requests and SMALL_ITEMS items) are built by a loop, larger ones with array
    operations: a numpy call costs about a microsecond, more than a short loop (tests/test_scheduler.py holds both
    to the same records).

    merge_in_kernel=False: the chunks are chosen without MERGE_ROWS's limit (no CTA merges a group alone) and the
    caller makes the list deferred (defer_merges)."""
    cta_q = tile.cta_q
    if fixed_chunk is not None and fixed_chunk < 1:
        raise ValueError(f"fixed_split_size must be positive, got {fixed_chunk}")
    native = knobs.NATIVE.get() and _cplan is not None  # (the knob is read, and checked, either way)
    # the compiled scheduler caps an automatic chunk by MERGE_ROWS: without one (a fixed chunk, or no split) it
    # serves deferred plans too; with one, a deferred plan's chunk is chosen below and the list built by it
    if native and (merge_in_kernel or fixed_chunk is not None or not allow_split):
        plan = _native_plan(qo_lens, kv_lens, qo_offsets, kv_bases, group=group, tile=tile, causal=causal,
                            num_kv_heads=num_kv_heads, slots=slots, max_slots=max_slots, allow_split=allow_split,
                            fixed_chunk=fixed_chunk)
        if plan is not None:
            return plan
    small = len(qo_lens) <= SMALL_BATCH
    if small:
        q, k = _list(qo_lens), _list(kv_lens)
        tiles = [_ceil(x * group, cta_q) if x else 0 for x in q]
    else:
        q, k = np.asarray(qo_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
        tiles = np.where(q > 0, _ceil(q * group, cta_q), 0)
    if fixed_chunk is not None:
        chunk = _ceil(fixed_chunk, tile.cta_kv) * tile.cta_kv
    elif allow_split:
        chunk = choose_chunk(tiles, k, cta_kv=tile.cta_kv, num_kv_heads=num_kv_heads, slots=slots, slot_rows=q,
                             max_slots=max_slots, group=group, cta_q=cta_q if merge_in_kernel else 0)
    else:
        chunk = None
    if native and not merge_in_kernel and fixed_chunk is None and allow_split:
        # a deferred plan: its chunk chosen here (without MERGE_ROWS), its list built by the compiled scheduler
        plan = _native_plan(qo_lens, kv_lens, qo_offsets, kv_bases, group=group, tile=tile, causal=causal,
                            num_kv_heads=num_kv_heads, slots=slots, max_slots=max_slots,
                            allow_split=chunk is not None, fixed_chunk=chunk)
        if plan is not None:
            return plan
    plan = WorkPlan(tile=tile, slots_target=slots)
    if small:
        n = [_ceil(kk, chunk) if chunk is not None and kk > chunk else 1 for kk in k]
        count = sum(t * c for t, c in zip(tiles, n))
        _check_count(count, cta_q, chunk, fixed_chunk)
        if count <= SMALL_ITEMS:
            return _plan_loop(plan, q, k, tiles, n, _list(qo_offsets), _list(kv_bases), chunk=chunk, group=group,
                              cta_q=cta_q, causal=causal, max_slots=max_slots)
        q, k, tiles = np.asarray(q, dtype=np.int64), np.asarray(k, dtype=np.int64), np.asarray(tiles)
    return _plan_arrays(plan, q, k, tiles, np.asarray(qo_offsets, dtype=np.int64),
                        np.asarray(kv_bases, dtype=np.int64), chunk=chunk, group=group, cta_q=cta_q, causal=causal,
                        max_slots=max_slots, fixed_chunk=fixed_chunk)


_OUT = threading.local()  # each thread's record buffer for the compiled scheduler (grown as plans need)
_KEEP_ROWS = 1 << 14      # ... up to this many records (768 KiB); a longer list is written into its own array


def _native_plan(qo_lens, kv_lens, qo_offsets, kv_bases, *, group: int, tile: Any, causal: bool, num_kv_heads: int,
                 slots: int, max_slots: int, allow_split: bool, fixed_chunk: int | None) -> WorkPlan | None:
    """plan_work through attnjit._cplan, or None where it refuses the plan (the Python path then raises the error)."""
    out = getattr(_OUT, "buf", None)
    if out is None:
        out = _OUT.buf = np.empty((1024, len(RECORD_FIELDS)), dtype=np.int32)
    rest = (group, tile.cta_q, tile.cta_kv, causal, num_kv_heads, slots, max_slots, allow_split,
            -1 if fixed_chunk is None else fixed_chunk, MAX_WORK_ITEMS)
    args = (qo_lens, kv_lens, qo_offsets, kv_bases)  # plan()'s: contiguous int64 arrays, taken as they are
    try:
        status, count, chunk, groups, used, split = _cplan.plan_work(*args, out, *rest)
    except (TypeError, ValueError, BufferError):  # lists, views, other dtypes: converted once
        args = tuple(np.ascontiguousarray(a, dtype=np.int64) for a in args)
        status, count, chunk, groups, used, split = _cplan.plan_work(*args, out, *rest)
    own = False  # out is this plan's own array (not the thread's buffer, which the next plan reuses)
    if status == 3:  # more records than the buffer holds: grow it, up to _KEEP_ROWS; a larger list gets its own
        own = count > _KEEP_ROWS
        out = np.empty((count, len(RECORD_FIELDS)), dtype=np.int32) if own else \
            np.empty((max(count, min(2 * len(out), _KEEP_ROWS)), len(RECORD_FIELDS)), dtype=np.int32)
        if not own:
            _OUT.buf = out
        status, count, chunk, groups, used, split = _cplan.plan_work(*args, out, *rest)
    if status:
        return None
    plan = WorkPlan(tile=tile, slots_target=slots, num_groups=groups, chunk=None if chunk < 0 else chunk,
                    num_slots=used, split_requests=split)
    plan.records = out if own else out[:count].copy() if count else _EMPTY
    return plan


def _plan_loop(plan: WorkPlan, q: list[int], k: list[int], tiles: list[int], n: list[int], qo_offsets: list[int],
               kv_bases: list[int], *, chunk, group: int, cta_q: int, causal: bool, max_slots: int) -> WorkPlan:
    """The work list of a small batch, item by item (the order and numbering _plan_arrays produces; the cost is
    item_costs' formula, written out inline)."""
    requests = []  # (costliest item, its records longest first, flattened) of each request with work
    next_slot = 0
    for i, t in enumerate(tiles):
        if not t:
            continue
        qq, kk, nc, off, base_kv = q[i], k[i], n[i], qo_offsets[i], kv_bases[i]
        costs = []   # item j is (q tile j // nc, chunk j % nc)
        for qt in range(t):
            rows = min(cta_q, qq * group - qt * cta_q)
            end = kk - qq + (qt * cta_q + rows - 1) // group + 1 if causal else kk
            costs += [rows * max(1, min(kk, end, (c + 1) * chunk) - c * chunk) for c in range(nc)] if nc > 1 else \
                [rows * max(1, min(kk, end))]
        order = sorted(range(len(costs)), key=costs.__getitem__, reverse=True)  # stable: ties keep tile/chunk order
        flat = []
        if nc == 1:   # the common case: one item per q tile, the whole history
            for qt in order:
                flat += (i, qt, 0, kk, -1, 0, 1, -1, off, qq, kk, base_kv)
        else:
            slot0, g0 = next_slot, plan.num_groups
            next_slot += nc * qq
            plan.split_requests += 1
            plan.num_groups += t
            for j in order:
                qt, c = divmod(j, nc)
                flat += (i, qt, c * chunk, min(kk, (c + 1) * chunk), slot0, c, nc, g0 + qt, off, qq, kk, base_kv)
        requests.append((costs[order[0]], flat))
    _check_slots(next_slot, max_slots)
    requests.sort(key=lambda r: r[0], reverse=True)   # heaviest request first; stable: ties keep request order
    flat = [x for _, f in requests for x in f] if len(requests) > 1 else requests[0][1] if requests else []
    plan.records = np.array(flat, dtype=np.int32).reshape(-1, 12) if flat else _EMPTY
    plan.chunk = chunk if plan.split_requests else None
    plan.num_slots = next_slot
    return plan


def _plan_arrays(plan: WorkPlan, q: np.ndarray, k: np.ndarray, tiles: np.ndarray, qo_offsets: np.ndarray,
                 kv_bases: np.ndarray, *, chunk, group: int, cta_q: int, causal: bool, max_slots: int,
                 fixed_chunk) -> WorkPlan:
    """The work list of a large batch, with array operations over all items at once."""
    if chunk is None and len(tiles) and bool((tiles == 1).all()):
        # fast path (every decode batch, most small prefills): one item per request, the whole history; with one q
        # tile per request the causal end is the history's end, so the cost is rows x kv length
        _check_count(len(q), cta_q, chunk, fixed_chunk)
        order = np.argsort(-(q * np.maximum(k, 1)), kind="stable")
        recs = np.empty((len(q), 12), dtype=np.int32)
        recs[:, 0] = order
        recs[:, 1:3] = 0
        recs[:, 3] = recs[:, 10] = k[order]
        recs[:, 4], recs[:, 5], recs[:, 6], recs[:, 7] = -1, 0, 1, -1
        recs[:, 8] = qo_offsets[order]
        recs[:, 9] = q[order]
        recs[:, 11] = kv_bases[order]
        plan.records = recs
        return plan
    if chunk is not None and len(tiles) and bool((tiles == 1).all()):
        return _plan_split_rows(plan, q, k, qo_offsets, kv_bases, chunk=chunk, group=group, cta_q=cta_q,
                                max_slots=max_slots, fixed_chunk=fixed_chunk)
    active = np.flatnonzero(tiles)
    t, q, k = tiles[active], q[active], k[active]
    n = np.where(k > chunk, _ceil(k, chunk), 1) if chunk is not None else np.ones_like(k)
    per = t * n                       # items of each request with work
    count = int(per.sum())
    _check_count(count, cta_q, chunk, fixed_chunk)
    split = n > 1
    slot_need = np.where(split, n * q, 0)               # a split request owns chunks x qo_len partial slots
    plan.num_slots = int(slot_need.sum())
    _check_slots(plan.num_slots, max_slots)
    group_need = np.where(split, t, 0)                  # one split group per (split request, q tile)
    plan.num_groups = int(group_need.sum())
    plan.split_requests = int(split.sum())
    plan.chunk = chunk if plan.split_requests else None
    if not count:
        return plan
    # one row per item, in generation order: request by request, q tile by q tile, chunk by chunk
    start = np.cumsum(per) - per
    owner = np.repeat(np.arange(len(active)), per)     # index into the active requests
    j = np.arange(count) - start[owner]
    n_i, k_i, q_i = n[owner], k[owner], q[owner]
    qt, c = j // n_i, j % n_i
    split_i = split[owner]
    kv_begin = c * chunk if chunk is not None else np.zeros_like(c)
    kv_end = np.minimum(k_i, (c + 1) * chunk) if chunk is not None else k_i
    cost = _costs(qt, kv_begin, kv_end, q_i, k_i, cta_q=cta_q, group=group, causal=causal)
    heaviest = np.maximum.reduceat(cost, start)        # each request's costliest item
    # heaviest request first (ties: request order), its items longest first (ties: generation order)
    order = np.lexsort((-cost, owner, -heaviest[owner]))
    recs = np.empty((count, 12), dtype=np.int32)
    recs[:, 0] = active[owner]
    recs[:, 1] = qt
    recs[:, 2] = kv_begin
    recs[:, 3] = kv_end
    recs[:, 4] = np.where(split_i, (np.cumsum(slot_need) - slot_need)[owner], -1)
    recs[:, 5] = c
    recs[:, 6] = n_i
    recs[:, 7] = np.where(split_i, (np.cumsum(group_need) - group_need)[owner] + qt, -1)
    recs[:, 8] = qo_offsets[active][owner]
    recs[:, 9] = q_i
    recs[:, 10] = k_i
    recs[:, 11] = kv_bases[active][owner]
    plan.records = recs[order]
    return plan


def _plan_split_rows(plan: WorkPlan, q: np.ndarray, k: np.ndarray, qo_offsets: np.ndarray, kv_bases: np.ndarray, *,
                     chunk: int, group: int, cta_q: int, max_slots: int, fixed_chunk) -> WorkPlan:
    """_plan_arrays for a split batch whose every request is one q tile (split decode, short prefill rows): the
    same records with fewer array operations. With one q tile the causal end is the history's end, so an item's
    cost is rows x its chunk's length, and within a request chunk 0..n-1 is already longest first (every chunk
    but the last is whole); requests go heaviest first (their chunk 0), ties in request order."""
    n = np.where(k > chunk, _ceil(k, chunk), 1)
    count = int(n.sum())
    _check_count(count, cta_q, chunk, fixed_chunk)
    split = n > 1
    slot_need = np.where(split, n * q, 0)
    plan.num_slots = int(slot_need.sum())
    _check_slots(plan.num_slots, max_slots)
    plan.split_requests = plan.num_groups = int(split.sum())   # one split group per split request (its q tile)
    plan.chunk = chunk if plan.split_requests else None
    heaviest = np.minimum(cta_q, q * group) * np.maximum(1, np.minimum(k, chunk))
    order = np.argsort(-heaviest, kind="stable")
    slot0 = np.where(split, np.cumsum(slot_need) - slot_need, -1)
    group0 = np.where(split, np.cumsum(split) - 1, -1)
    n_o = n[order]
    owner = np.repeat(order, n_o)
    c = np.arange(count) - np.repeat(np.cumsum(n_o) - n_o, n_o)
    k_i = k[owner]
    recs = np.empty((count, 12), dtype=np.int32)
    recs[:, 0] = owner
    recs[:, 1] = 0
    recs[:, 2] = c * chunk
    recs[:, 3] = np.minimum(k_i, (c + 1) * chunk)
    recs[:, 4] = slot0[owner]
    recs[:, 5] = c
    recs[:, 6] = n[owner]
    recs[:, 7] = group0[owner]
    recs[:, 8] = qo_offsets[owner]
    recs[:, 9] = q[owner]
    recs[:, 10] = k_i
    recs[:, 11] = kv_bases[owner]
    plan.records = recs
    return plan
