"""A plan's device metadata: work count, work records, split-group tickets and page ids, in one host-to-device copy;
and the read-back of metadata an engine passed on the device (``MetadataBuffers.to_host``).

Host metadata never needs a device-to-host read: the values are written into a pinned host buffer that the wrapper
keeps (``Staging``) and copied once, asynchronously. A staging buffer is written again only once the event recorded
after its last copy has completed, so a plan never overwrites the bytes a previous plan's copy may still be reading;
a wrapper keeps two (a plan while the other's copy is in flight), and when both are busy one plan takes a fresh
buffer from torch's caching host allocator (which holds it until its copy has run). Page ids already on the device
are used where they lie (a strided view is made dense first: the kernels read them as a dense array).

On a CUDA device the copies and events go through CuPy's CUDA runtime bindings on the raw current stream
(``RawCuda``: cudaMemcpyAsync, cudaEventRecord, cudaEventQuery), a few microseconds a plan where torch's ``copy_``
and ``torch.cuda.Event`` cost tens on a slow host (RESULTS.md, runs 61-63); torch's path serves where CuPy is
missing and with ATTNJIT_NATIVE=0. A one-off staging buffer (both kept ones busy) always goes through torch's
copy, whose host allocator then holds it until the copy has run.

Layout (int32): ``[work_count, 0, 0, 0][records: W x 12][tickets][page ids given on the host]``; the records start
16 bytes in, as the kernels read them as int4. With ``use_cuda_graph`` every buffer a kernel reads keeps its
address across plans: the regions are sized by the first plan (or ``max_work_items``) and later plans write the
part they use; a plan that needs more is an error that says which constructor argument to raise. The wrapper's own
page-id buffer (when the engine passed none) lies in the same allocation, after the tickets, so a graph-mode plan
with host page ids is one copy too.
"""

from __future__ import annotations

import weakref
from typing import Callable

import numpy as np
import torch

from .. import dispatch, knobs
from ._readback import copy_runs, driver_allocation
from .planner import MAX_KV_LEN, dense_page_ids, to_host
from .scheduler import MAX_WORK_ITEMS, RECORD_FIELDS, WorkPlan, _cplan

RECORD = len(RECORD_FIELDS)  # ints per work record
_HEAD = 4    # work_count, padded to 16 bytes
_SLOTS = 2   # staging buffers a wrapper keeps, and device buffers (MetadataBuffers._device_buffer)


class _Lease:
    """Held by a plan (its ``keep``) for as long as it may run on a kept device buffer (_device_buffer): the buffer
    is free once the lease is gone."""

    __slots__ = ("__weakref__",)


class Staging:
    """One reusable host buffer (pinned for a CUDA device) and the event recorded after its last copy.

    ``new_event`` makes the event (``torch.cuda.Event`` for a CUDA device; None: copies complete when issued, as
    to a CPU "device"); anything with ``record()`` and ``query()`` serves, so the reuse rule is testable anywhere.
    """

    __slots__ = ("tensor", "host", "size", "event")

    def __init__(self, size: int, pinned: bool, new_event: Callable[[], object] | None):
        # zeros: a graph-mode copy also carries the unused part between the regions (never uninitialized memory)
        self.tensor = torch.zeros(size, dtype=torch.int32, pin_memory=pinned)
        self.host = self.tensor.numpy()
        self.size = size
        self.event = new_event() if new_event is not None else None

    def free(self) -> bool:
        """True when no copy from this buffer may still be in flight."""
        return self.event is None or self.event.query()

    def copied(self, stream: int | None = None) -> None:
        """Called after the copies from this buffer were issued (on the current stream; ``stream``: its handle,
        given only with a RawEvent)."""
        if self.event is not None:
            if stream is None:
                self.event.record()
            else:
                self.event.record(stream)


def _cuda_event():
    return torch.cuda.Event()


class RawCuda:
    """Host-to-device copies and their events on one device through CuPy's runtime bindings (thin Cython calls on
    the raw current stream; torch's own stream state is not touched: the stream is the one torch would use)."""

    def __init__(self, device_index: int):
        import cupy
        from cupy.cuda import runtime

        for name in ("memcpyAsync", "memcpyHostToDevice", "memcpyDeviceToHost", "streamSynchronize",
                     "streamIsCapturing", "eventCreateWithFlags", "eventDisableTiming", "eventRecord", "eventQuery",
                     "eventDestroy"):
            getattr(runtime, name)   # an older CuPy without one: AttributeError, and torch's path serves
        self.rt, self.index = runtime, device_index
        self._device = cupy.cuda.Device(device_index)

    def stream(self) -> int:
        return dispatch.current_stream(self.index)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, self.rt.memcpyHostToDevice, stream)

    def copy_back(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, self.rt.memcpyDeviceToHost, stream)

    def allocation(self, ptr: int) -> tuple[int, int] | None:
        """(base, size) of the device allocation holding ptr (cuMemGetAddressRange), or None."""
        query = driver_allocation()
        return query(ptr) if query is not None else None

    def holds(self, start: int, end: int) -> bool:
        """Whether one device allocation holds the bytes [start, end)."""
        found = self.allocation(start)
        return found is not None and found[0] <= start and end <= found[0] + found[1]

    def sync(self, stream: int) -> None:
        self.rt.streamSynchronize(stream)

    def capturing(self, stream: int) -> bool:
        return self.rt.streamIsCapturing(stream) != 0   # cudaStreamCaptureStatus: 0 = not capturing

    def event(self) -> "RawEvent":
        with self._device:
            return RawEvent(self, self.rt.eventCreateWithFlags(self.rt.eventDisableTiming))


class RawEvent:
    """A CUDA event of RawCuda's device: ``record()`` on the current stream, ``query()`` True once it has run."""

    __slots__ = ("cuda", "ptr")

    def __init__(self, cuda: RawCuda, ptr: int):
        self.cuda, self.ptr = cuda, ptr

    def record(self, stream: int | None = None) -> None:
        self.cuda.rt.eventRecord(self.ptr, self.cuda.stream() if stream is None else stream)

    def query(self) -> bool:
        return self.cuda.rt.eventQuery(self.ptr) == 0

    def __del__(self):
        try:
            self.cuda.rt.eventDestroy(self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the runtime may be gone already
            pass


def raw_cuda(device: torch.device) -> RawCuda | None:
    """RawCuda for a CUDA device where CuPy imports and ATTNJIT_NATIVE is not 0, else None (torch's path)."""
    if device.type != "cuda" or not knobs.NATIVE.get():
        return None
    try:
        return RawCuda(device.index if device.index is not None else torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no CuPy (or no runtime binding): torch's copies serve
        return None


class MetadataBuffers:
    """The device metadata of one wrapper's plans."""

    def __init__(self, device: torch.device, use_cuda_graph: bool, max_work_items: int | None, *,
                 new_event: Callable[[], object] | None = None):
        self.device = device
        self.graph = use_cuda_graph
        self.max_work_items = max_work_items
        self.fixed_meta: torch.Tensor | None = None      # graph mode: count, records, tickets (and own page ids)
        self.caps: tuple[int, int] | None = None         # graph mode: (work records, tickets) the buffer holds
        self.fixed_page_ids: torch.Tensor | None = None  # graph mode: the page-id buffer the kernels read
        self.ids_at: int | None = None                   # graph mode: where fixed_page_ids starts in fixed_meta
        self.batch: int | None = None                    # graph mode: the batch size of every plan (the first's)
        self._pinned = device.type == "cuda"
        self.raw = None if new_event is not None else raw_cuda(device)   # a test's fake events go with torch's copy
        if new_event is None and self._pinned:
            new_event = self.raw.event if self.raw is not None else _cuda_event
        self._new_event = new_event
        self.staging: list[Staging] = []                 # reused host buffers, at most _SLOTS
        self._dev: list[tuple] = []   # plans' device buffers: (buffer, its last copy's stream, its lease's
                                      # weakref) (_device_buffer; not graph mode)
        self._readback: torch.Tensor | None = None      # pinned: device metadata read back by to_host (RawCuda)
        self._readback_memo: tuple | None = None         # to_host's last (key, copies, views)

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """planner.to_host (device metadata -> host, the one synchronization such a plan makes) through RawCuda:
        the device tensors copied into a pinned read-back buffer, those lying close together in one allocation as
        one copy (_readback.copy_runs), then one stream synchronize; no concatenation kernel, no pageable copy.
        The host tensors returned are views of that buffer, valid until the next call (plan() reads them into
        arrays of its own before it returns); an engine passing the same tensors every step gets the same views
        back (slicing a tensor costs 3-4 us on the H200 host), the copies re-planned only when an address or a
        size changes and the joined spans' allocation asked again every call. Without RawCuda, or for a tensor
        that is not a dense int32 one (planner.to_host takes any), planner.to_host."""
        if all(t.is_cpu for t in tensors):   # host metadata, the common case: nothing to copy
            return list(tensors)
        raw = self.raw
        if raw is None or any(not t.is_cpu and (t.dtype is not torch.int32 or not t.is_contiguous())
                              for t in tensors):
            return to_host(*tensors)
        key = tuple(None if t.is_cpu else (t.data_ptr(), t.numel()) for t in tensors)
        memo = self._readback_memo
        if memo is None or memo[0] != key or not all(raw.holds(src, end) for _, src, end, join in memo[1] if join):
            memo = self._readback_memo = (key, *self._readback_plan(key))
        _, runs, views = memo
        stream = raw.stream()
        for dst, src, end, _ in runs:
            raw.copy_back(dst, src, end - src, stream)
        raw.sync(stream)
        return [t if v is None else v for t, v in zip(tensors, views)]

    def _readback_plan(self, key: tuple) -> tuple[list, list]:
        """to_host's copies for tensors at ``key``'s (pointer, numel) and the host views they land in: the copies
        as (host dst, device src, device end, joined) and one view (None for a host tensor) per tensor."""
        spans, which = [], []
        for i, k in enumerate(key):
            if k is not None and k[1]:
                spans.append((k[0], k[0] + 4 * k[1]))
                which.append(i)
        runs = copy_runs(spans, self.raw.allocation if len(spans) > 1 else None)
        total = sum((e - s) // 4 for s, e, _ in runs)
        buf = self._readback
        if buf is None or buf.numel() < total:
            buf = self._readback = torch.empty(max(total, 1024), dtype=torch.int32, pin_memory=True)
        base, at = buf.data_ptr(), 0
        empty = buf[:0]   # one view for every empty device tensor (slicing costs the H200 host 3-4 us)
        views: list[torch.Tensor | None] = [empty if k is not None and not k[1] else None for k in key]
        copies = []
        for s, e, members in runs:
            copies.append((base + 4 * at, s, e, len(members) > 1))
            for m in members:
                first = at + (spans[m][0] - s) // 4   # runs of more than one span are 4-byte aligned
                views[which[m]] = buf[first:first + key[which[m]][1]]  # 1-D, a 0-d tensor as one element
            at += (e - s) // 4
        return copies, views

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (never, for a CPU workspace)."""
        if not self._pinned:
            return False
        raw = self.raw
        if raw is not None:
            return raw.capturing(raw.stream())
        return torch.cuda.is_current_stream_capturing()

    def refuse_capture(self, what: str) -> None:
        """Raise if the current stream is capturing a CUDA graph. A plan's copies would be recorded into the graph
        (each replay copying whatever a staging buffer holds then) and reading device metadata back synchronizes,
        which invalidates a capture: either way a wrong answer or a failed capture far from its cause."""
        if self.capturing():
            raise RuntimeError(
                f"{what} was called while the current CUDA stream is capturing a graph. Planning copies metadata "
                "to the device outside the graph's fixed buffers: call plan() before the capture and capture "
                "only run(); with use_cuda_graph=True, re-plan between replays (plan() or fast_plan()).")

    def check_batch(self, batch: int) -> None:
        if self.graph and self.batch is not None and batch != self.batch:
            raise ValueError(f"this wrapper was built with use_cuda_graph=True and first planned for batch size "
                             f"{self.batch}; plan() got batch size {batch}. Use one wrapper per batch size.")

    def _slot(self, size: int) -> Staging:
        """A staging buffer of at least ``size`` ints that no copy is reading: a kept one, else a kept one grown,
        else a new one (kept while fewer than _SLOTS are, else used once)."""
        slots = self.staging
        for s in slots:
            if s.size >= size and s.free():
                return s
        for i, s in enumerate(slots):
            if s.free():  # too small: replace it (torch's host allocator keeps the old one until its copy ran)
                slots[i] = Staging(max(size, 2 * s.size), self._pinned, self._new_event)
                return slots[i]
        kept = len(slots) < _SLOTS
        s = Staging(max(size, 1024), self._pinned, self._new_event if kept or self.raw is None else _cuda_event)
        if kept:
            slots.append(s)
        return s

    def _device_buffer(self, size: int, stream: int | None) -> tuple[torch.Tensor, "_Lease"]:
        """A device buffer of at least ``size`` ints for a plan's metadata (not graph mode) and the lease the plan
        keeps with it. One of the two kept buffers where no plan holds its lease any more and its last copy went on
        this stream: the copy then lands after, in stream order, every kernel of the plans that used it, as the
        caching allocator's reuse of a freed block would; a kept one too small is replaced. Else (both leased,
        another stream, or torch's copy path on a CUDA device: ``stream`` None) a fresh allocation. A device
        allocation costs the GPU hosts 3-5 us a plan (RESULTS.md, twenty-second session). A plan that fails after
        its upload cannot touch the current plan's buffer: the current plan holds that lease."""
        lease = _Lease()
        kept = self._dev
        if stream is not None or not self._pinned:
            for i, (buf, on, held) in enumerate(kept):
                if held() is None and on == stream:
                    if buf.numel() < size:
                        buf = torch.empty(max(size, 2 * buf.numel()), dtype=torch.int32, device=self.device)
                    kept[i] = (buf, stream, weakref.ref(lease))
                    return buf, lease
            if len(kept) < _SLOTS:
                buf = torch.empty(max(size, 1024), dtype=torch.int32, device=self.device)
                kept.append((buf, stream, weakref.ref(lease)))
                return buf, lease
        return torch.empty(size, dtype=torch.int32, device=self.device), lease

    def _copy(self, dst: torch.Tensor, slot: Staging, start: int, count: int, stream: int | None = None) -> None:
        """``count`` ints of ``slot`` from ``start`` into ``dst`` (a device tensor of at least that many), on the
        current stream (``stream``, where the caller has it). A kept buffer's copy goes through RawCuda where it is
        set; a one-off one through torch."""
        if self.raw is not None and type(slot.event) is RawEvent:
            if dst.numel() < count or slot.size < start + count or not dst.is_contiguous():  # raw: unchecked
                raise AssertionError(f"metadata copy of {count} ints at {start} into {dst.numel()} "
                                     f"({slot.size} staged)")
            raw = self.raw
            raw.copy(dst.data_ptr(), slot.tensor.data_ptr() + 4 * start, 4 * count,
                     raw.stream() if stream is None else stream)
        else:
            dst[:count].copy_(slot.tensor[start:start + count], non_blocking=True)

    def upload(self, records: np.ndarray, *, num_groups: int, num_kv_heads: int, page_ids: torch.Tensor | None,
               used: int, keep: list) -> dict[str, int]:
        """Copy a plan's metadata to the device; return the device pointer of each part.

        records: [W, 12] int32; num_groups x num_kv_heads tickets start at zero; page_ids: the plan's page-id tensor
        (host or device; the kernels read its first ``used`` entries), or None (ragged). ``keep`` receives the
        tensors the kernels read, which live as long as the plan.
        """
        items, tickets = records.shape[0], num_groups * num_kv_heads
        if self.graph:
            return self._upload_graph(records, items, tickets, num_kv_heads, page_ids, used, keep)
        host_ids = page_ids is not None and page_ids.device.type == "cpu"
        head = _HEAD + records.size
        end = head + tickets
        total = end + (used if host_ids else 0)
        slot = self._slot(total)
        host = slot.host
        host[:_HEAD] = (items, 0, 0, 0)
        host[_HEAD:head] = records.reshape(-1)
        host[head:end] = 0
        if host_ids and used:
            host[end:total] = page_ids.numpy()[:used]
        raw = self.raw if type(slot.event) is RawEvent else None
        stream = raw.stream() if raw is not None else None
        dev, lease = self._device_buffer(total, stream)
        self._copy(dev, slot, 0, total, stream)
        slot.copied(stream)
        keep += (dev, lease)
        base = dev.data_ptr()
        ptr = {"work_count": base, "work": base + 4 * _HEAD, "merge_counters": base + 4 * head}
        if page_ids is not None:
            if host_ids:
                ptr["kv_indices"] = base + 4 * end
            else:
                t = dense_page_ids(page_ids)
                keep.append(t)
                ptr["kv_indices"] = t.data_ptr()
        return ptr

    def fast_decode(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, *,
                    page_size: int, sched: dict, num_pages: int | None) -> tuple[WorkPlan, int] | None:
        """Graph mode's decode re-plan (fast_plan()) in one compiled call and one copy: the host page table read and
        checked, the page ids ranged (against ``num_pages``, the cache a replay reads, where known), the work list
        scheduled with ``sched`` (plan_work's arguments), all written into a staging buffer as the image of the
        fixed buffers, then copied (one copy; two where the engine passed its own page-id buffer). Returns (the work
        plan, the largest page id), or None where this path does not apply (metadata that is not dense int32 on the
        host, no compiled core, ATTNJIT_NATIVE=0, no plan uploaded yet) or where the table breaks a rule or does not
        fit: then nothing was copied and the caller plans through the full path (read_paged, plan_work, upload),
        which raises the error in its words. Both paths write the same bytes (tests/test_fast_plan.py)."""
        caps, batch, fixed_ids = self.caps, self.batch, self.fixed_page_ids
        if caps is None or batch is None or fixed_ids is None or _cplan is None or not knobs.NATIVE.get():
            return None
        for t in (indptr, indices, last_page_len):
            if type(t) is not torch.Tensor or t.dtype is not torch.int32 or t.dim() != 1 or not t.is_cpu \
                    or not t.is_contiguous():
                return None
        fixed_chunk = sched["fixed_chunk"]
        if indptr.numel() != batch + 1 or last_page_len.numel() != batch or \
                (fixed_chunk is not None and fixed_chunk < 1):
            return None
        fixed, n_ids = self.fixed_meta, indices.numel()
        at_tickets = _HEAD + RECORD * caps[0]
        own = self.ids_at is not None   # the wrapper's page-id buffer, in fixed_meta: one copy; else the engine's: two
        ids_at = self.ids_at if own else -(-(at_tickets + caps[1]) // 4) * 4
        ids_cap = min(fixed.numel() - ids_at if own else fixed_ids.numel(), n_ids)
        slot = self._slot(ids_at + ids_cap)
        tile = sched["tile"]
        status, count, chunk, groups, slots, split, used, max_page, total = _cplan.fast_decode(
            indptr.data_ptr(), last_page_len.data_ptr(), indices.data_ptr(), batch, n_ids, page_size, MAX_KV_LEN,
            -1 if num_pages is None else num_pages, slot.host, caps[0], at_tickets, caps[1], ids_at, ids_cap,
            sched["group"], tile.cta_q, tile.cta_kv, sched["causal"], sched["num_kv_heads"], sched["slots"],
            sched["max_slots"], sched["allow_split"], -1 if fixed_chunk is None else fixed_chunk, MAX_WORK_ITEMS)
        if status:
            return None
        if own:
            self._copy(fixed, slot, 0, total)
        else:
            tickets = groups * sched["num_kv_heads"]
            self._copy(fixed, slot, 0, at_tickets + tickets if tickets else _HEAD + RECORD * count)
            if used:
                self._copy(fixed_ids, slot, ids_at, used)
        slot.copied()
        records = slot.host[_HEAD:_HEAD + RECORD * count].reshape(count, RECORD).copy()
        return WorkPlan(tile=tile, records=records, num_groups=groups, chunk=None if chunk < 0 else chunk,
                        num_slots=slots, split_requests=split, slots_target=sched["slots"]), max_page

    def _upload_graph(self, records: np.ndarray, items: int, tickets: int, num_kv_heads: int,
                      page_ids: torch.Tensor | None, used: int, keep: list) -> dict[str, int]:
        """Graph mode: the regions of the fixed buffers this plan uses, rewritten in place."""
        self._check_caps(items, tickets, num_kv_heads, page_ids, used)
        head = _HEAD + RECORD * items
        at_tickets = _HEAD + RECORD * self.caps[0]
        end = at_tickets + tickets if tickets else head   # what the kernels read of fixed_meta, ids aside
        host_ids = page_ids is not None and page_ids.device.type == "cpu"
        own_ids = host_ids and self.ids_at is not None    # staged at their place in fixed_meta: one copy
        total = self.ids_at + used if own_ids and used else end
        slot = self._slot(total + (used if host_ids and not own_ids else 0))
        host = slot.host
        host[:_HEAD] = (items, 0, 0, 0)
        host[_HEAD:head] = records.reshape(-1)
        if tickets:
            host[at_tickets:end] = 0
        if host_ids and used:
            at = self.ids_at if own_ids else total
            host[at:at + used] = page_ids.numpy()[:used]
        dev = self.fixed_meta
        self._copy(dev, slot, 0, total)   # the gaps hold zeros or an older plan's records
        fixed = self.fixed_page_ids
        if page_ids is not None and used and not own_ids:
            if host_ids:
                self._copy(fixed, slot, total, used)
            # the engine may have written the page ids into the fixed buffer itself (FlashInfer's pattern)
            elif not (page_ids.data_ptr() == fixed.data_ptr() and page_ids[:used].is_contiguous()):
                fixed[:used].copy_(page_ids[:used], non_blocking=True)
        slot.copied()
        keep.append(dev)
        base = dev.data_ptr()
        ptr = {"work_count": base, "work": base + 4 * _HEAD, "merge_counters": base + 4 * at_tickets}
        if page_ids is not None:
            keep.append(fixed)
            ptr["kv_indices"] = fixed.data_ptr()
        return ptr

    def _check_caps(self, items: int, tickets: int, num_kv_heads: int, page_ids: torch.Tensor | None,
                    used: int) -> None:
        if self.caps is None:  # the first plan sizes the fixed buffers
            cap = max(self.max_work_items or 0, 2 * items, 64)
            self.caps = (cap, max(cap * num_kv_heads, tickets))
            size = _HEAD + RECORD * cap + self.caps[1]
            own_ids = page_ids is not None and self.fixed_page_ids is None
            if own_ids:
                size = -(-size // 4) * 4  # the page ids start on 16 bytes too
                self.ids_at, size = size, size + max(2 * used, 64)
            self.fixed_meta = torch.zeros(size, dtype=torch.int32, device=self.device)
            if own_ids:
                self.fixed_page_ids = self.fixed_meta[self.ids_at:]
        if page_ids is not None and self.fixed_page_ids is None:  # a first plan without page ids: a buffer of their own
            self.fixed_page_ids = torch.zeros(max(2 * used, 64), dtype=torch.int32, device=self.device)
        self.check_fits(items, tickets, page_ids is not None, used)

    def check_fits(self, items: int, tickets: int, has_ids: bool, used: int) -> None:
        """Graph mode: a plan's work list, split tickets and page ids fit the fixed buffers (once sized by a first
        plan); checked before a plan writes anything."""
        if has_ids:
            fixed = self.fixed_page_ids
            if fixed is not None and fixed.numel() < used:
                raise ValueError(f"use_cuda_graph: the plan uses {used} page ids, more than the {fixed.numel()} of "
                                 "the wrapper's fixed page-id buffer; pass a large enough paged_kv_indices buffer to "
                                 "the constructor")
        if self.caps is None:
            return
        for what, need, have in (("work items", items, self.caps[0]), ("split tickets", tickets, self.caps[1])):
            if need > have:
                raise ValueError(f"use_cuda_graph: this plan needs {need} {what} but the wrapper's fixed buffers hold "
                                 f"{have}; build the wrapper with a larger max_work_items")
