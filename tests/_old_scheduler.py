"""The work-list scheduler as it was before it was vectorized (commit b4b25fc, attnjit/ops/scheduler.py), kept
verbatim as the oracle of tests/test_scheduler.py: the new planner must produce the same work records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from attnjit.families.fa2 import Tile

MIN_CHUNK = 256  # kv tokens: below this a chunk's partial-state traffic stops being small against its KV


@dataclass
class WorkPlan:
    tile: Tile
    # one record per work item (12 ints, the kernel's AttentionCTA::setup): request, q tile, kv begin, kv end,
    # chunk-0 partial slot or -1, chunk, chunks, group, first query row, query rows, kv length, kv base
    records: list[tuple[int, ...]] = field(default_factory=list)
    num_groups: int = 0            # split groups (request, q tile); each has one ticket counter per KV head
    chunk: int | None = None       # kv tokens per chunk of split requests; None = nothing split
    num_slots: int = 0             # partial-state slots used
    split_requests: int = 0
    slots_target: int = 0          # SMs x CTAs per SM the plan aimed to fill

    @property
    def num_items(self) -> int:
        return len(self.records)

    def decision(self, num_kv_heads: int) -> dict:
        return {"tile": self.tile.name, "work_items": self.num_items, "ctas": self.num_items * num_kv_heads,
                "gpu_slots": self.slots_target, "split_kv": self.chunk is not None, "chunk_kv": self.chunk,
                "split_requests": self.split_requests, "split_groups": self.num_groups}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def choose_chunk(tiles: Sequence[int], kv_lens: Sequence[int], *, cta_kv: int, num_kv_heads: int, slots: int,
                 slot_rows: Sequence[int], max_slots: int, group: int = 1, cta_q: int = 0) -> int | None:
    """The smallest chunk (multiple of cta_kv, >= MIN_CHUNK) whose items fit in ``slots`` CTAs, or None.

    None when the unsplit items already fill the GPU, when no history is longer than the minimum chunk, or when
    the partial states would not fit in the workspace (``max_slots``).
    """
    base = sum(t for t in tiles) * num_kv_heads
    max_kv = max((k for t, k in zip(tiles, kv_lens) if t), default=0)
    min_chunk = max(MIN_CHUNK, 2 * cta_kv)
    if base >= slots or max_kv <= min_chunk:
        return None

    def items(c: int) -> int:
        return sum(t * _ceil(k, c) for t, k in zip(tiles, kv_lens) if t and k) * num_kv_heads

    def partial_slots(c: int) -> int:
        return sum(rows * _ceil(k, c) for t, k, rows in zip(tiles, kv_lens, slot_rows) if t and k > c)

    lo, hi = _ceil(min_chunk, cta_kv), _ceil(max_kv, cta_kv)  # in units of cta_kv
    while lo < hi:  # smallest c with items(c) <= slots (items is non-increasing in c)
        mid = (lo + hi) // 2
        if items(mid * cta_kv) <= slots:
            hi = mid
        else:
            lo = mid + 1
    def merge_rows(c: int) -> int:  # a split group's last CTA merges its packed rows x chunks alone
        return max((min(cta_q, rows * group) * _ceil(k, c) for t, k, rows in zip(tiles, kv_lens, slot_rows)
                    if t and k > c), default=0)

    chunk = lo * cta_kv
    while chunk < max_kv and (partial_slots(chunk) > max_slots or (cta_q and merge_rows(chunk) > 512)):
        chunk *= 2
    return chunk if chunk < max_kv else None


def item_cost(rec: Sequence[int], *, cta_q: int, group: int, causal: bool) -> int:
    """What the work order sorts by: packed rows x KV tokens the item visits (at least 1) of one work record."""
    _req, qt, kv_begin, kv_end = rec[:4]
    q, k = rec[9], rec[10]
    rows = min(cta_q, q * group - qt * cta_q)
    end = k - q + (qt * cta_q + rows - 1) // group + 1 if causal else k
    return rows * max(1, min(kv_end, end) - kv_begin)


def plan_work(*, qo_lens: Sequence[int], kv_lens: Sequence[int], qo_offsets: Sequence[int],
              kv_bases: Sequence[int], group: int, tile: Tile, causal: bool, num_kv_heads: int, slots: int,
              max_slots: int, allow_split: bool = True, fixed_chunk: int | None = None) -> WorkPlan:
    """Work list for one batch. ``qo_offsets[i]`` is request i's first query row (qo_indptr[i]); ``kv_bases[i]``
    its first page-table entry (paged) or first kv row (ragged)."""
    cta_q = tile.cta_q
    tiles = [-(-(q * group) // cta_q) if q else 0 for q in qo_lens]
    if fixed_chunk is not None:
        if fixed_chunk < 1:
            raise ValueError(f"fixed_split_size must be positive, got {fixed_chunk}")
        chunk = _ceil(fixed_chunk, tile.cta_kv) * tile.cta_kv
    elif allow_split:
        chunk = choose_chunk(tiles, kv_lens, cta_kv=tile.cta_kv, num_kv_heads=num_kv_heads, slots=slots,
                             slot_rows=qo_lens, max_slots=max_slots, group=group, cta_q=tile.cta_q)
    else:
        chunk = None
    plan = WorkPlan(tile=tile, slots_target=slots)
    if chunk is None and all(t == 1 for t in tiles):
        # fast path (every decode batch, most small prefills): one item per request, the whole history; with one q
        # tile per request the causal end is the history's end, so the cost is rows x kv length
        order = sorted(range(len(tiles)), key=lambda i: -(qo_lens[i] * max(kv_lens[i], 1)))
        plan.records = [(i, 0, 0, kv_lens[i], -1, 0, 1, -1, qo_offsets[i], qo_lens[i], kv_lens[i], kv_bases[i])
                        for i in order]
        return plan
    per_request: list[list[tuple[int, tuple[int, ...]]]] = []  # (cost, record) of each request with work
    next_slot = 0
    for i, (t, q, k) in enumerate(zip(tiles, qo_lens, kv_lens)):
        if not t:
            continue
        n_chunks = _ceil(k, chunk) if chunk is not None and k > chunk else 1
        qo_off, kv_base = qo_offsets[i], kv_bases[i]
        if n_chunks == 1:   # the common case: one item per q tile, the whole history
            recs = [(i, qt, 0, k, -1, 0, 1, -1, qo_off, q, k, kv_base) for qt in range(t)]
        else:
            base = next_slot
            next_slot += n_chunks * q
            plan.split_requests += 1
            recs = []
            for qt in range(t):
                group_id = plan.num_groups
                plan.num_groups += 1
                recs += [(i, qt, c * chunk, min(k, (c + 1) * chunk), base, c, n_chunks, group_id, qo_off, q, k, kv_base)
                         for c in range(n_chunks)]
        costs = [(item_cost(r, cta_q=cta_q, group=group, causal=causal), r) for r in recs]
        costs.sort(key=lambda cr: -cr[0])   # longest first; stable, so ties keep q tile / chunk order
        per_request.append(costs)
    if next_slot > max_slots:
        raise ValueError(f"the split-KV plan needs {next_slot} partial-state slots but the workspace holds "
                         f"{max_slots}; pass a larger float_workspace_buffer or a larger fixed_split_size")
    per_request.sort(key=lambda costs: -costs[0][0])   # heaviest request first; stable: ties keep request order
    plan.records = [rec for costs in per_request for _cost, rec in costs]
    plan.chunk = chunk if plan.split_requests else None
    plan.num_slots = next_slot
    return plan
