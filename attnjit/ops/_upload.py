"""A plan's device metadata: work count, work records, split-group tickets and page ids, in one host-to-device copy.

Host metadata never needs a device-to-host read: the values are written into one pinned host buffer (torch's
caching host allocator keeps it until its asynchronous copy has run) and copied once. Page ids already on the
device are used where they lie (a strided view is made dense first: the kernels read them as a dense array).

Layout (int32): ``[work_count, 0, 0, 0][records: W x 12][tickets][page ids given on the host]``; the records start
16 bytes in, as the kernels read them as int4. With ``use_cuda_graph`` every buffer a kernel reads keeps its
address across plans: the regions are sized by the first plan (or ``max_work_items``) and later plans write the
part they use; a plan that needs more is an error that says which constructor argument to raise.
"""

from __future__ import annotations

import numpy as np
import torch

from .planner import dense_page_ids
from .scheduler import RECORD_FIELDS

RECORD = len(RECORD_FIELDS)  # ints per work record
_HEAD = 4    # work_count, padded to 16 bytes


class MetadataBuffers:
    """The device metadata of one wrapper's plans."""

    def __init__(self, device: torch.device, use_cuda_graph: bool, max_work_items: int | None):
        self.device = device
        self.graph = use_cuda_graph
        self.max_work_items = max_work_items
        self.fixed_meta: torch.Tensor | None = None      # graph mode: count, records and tickets
        self.caps: tuple[int, int] | None = None         # graph mode: (work records, tickets) the buffer holds
        self.fixed_page_ids: torch.Tensor | None = None  # graph mode: the page-id buffer the kernels read
        self.batch: int | None = None                    # graph mode: the batch size of every plan (the first's)

    def check_batch(self, batch: int) -> None:
        if self.graph and self.batch is not None and batch != self.batch:
            raise ValueError(f"this wrapper was built with use_cuda_graph=True and first planned for batch size "
                             f"{self.batch}; plan() got batch size {batch}. Use one wrapper per batch size.")

    def upload(self, records: np.ndarray, *, num_groups: int, num_kv_heads: int, page_ids: torch.Tensor | None,
               used: int, keep: list) -> dict[str, int]:
        """Copy a plan's metadata to the device; return the device pointer of each part.

        records: [W, 12] int32; num_groups x num_kv_heads tickets start at zero; page_ids: the plan's page-id tensor
        (host or device; the kernels read its first ``used`` entries), or None (ragged). ``keep`` receives the
        tensors the kernels read, which live as long as the plan.
        """
        items, tickets = records.shape[0], num_groups * num_kv_heads
        host_ids = page_ids is not None and page_ids.device.type == "cpu"
        head = _HEAD + records.size
        if self.graph:
            self._check_caps(items, tickets, num_kv_heads)
        staging = torch.empty(head + tickets + (used if host_ids else 0), dtype=torch.int32,
                              pin_memory=self.device.type == "cuda")  # (a CPU device: the tests of this layout)
        host = staging.numpy()
        host[0], host[1:_HEAD] = items, 0
        host[_HEAD:head] = records.reshape(-1)
        host[head:head + tickets] = 0
        if host_ids and used:
            host[head + tickets:] = page_ids.numpy()[:used]
        if self.graph:
            dev = self.fixed_meta
            at_tickets = _HEAD + RECORD * self.caps[0]
            dev[:head].copy_(staging[:head], non_blocking=True)
            if tickets:
                dev[at_tickets:at_tickets + tickets].copy_(staging[head:head + tickets], non_blocking=True)
        else:
            dev = staging.to(self.device, non_blocking=True)
            at_tickets = head
        keep.append(dev)
        base = dev.data_ptr()
        ptr = {"work_count": base, "work": base + 4 * _HEAD, "merge_counters": base + 4 * at_tickets}
        if page_ids is not None:
            ptr["kv_indices"] = self._page_ids(page_ids, used, staging[head + tickets:] if host_ids else None,
                                               dev, head + tickets, keep)
        return ptr

    def _check_caps(self, items: int, tickets: int, num_kv_heads: int) -> None:
        if self.caps is None:
            cap = max(self.max_work_items or 0, 2 * items, 64)
            self.caps = (cap, max(cap * num_kv_heads, tickets))
            self.fixed_meta = torch.zeros(_HEAD + RECORD * cap + self.caps[1], dtype=torch.int32, device=self.device)
        for what, need, have in (("work items", items, self.caps[0]), ("split tickets", tickets, self.caps[1])):
            if need > have:
                raise ValueError(f"use_cuda_graph: this plan needs {need} {what} but the wrapper's fixed buffers hold "
                                 f"{have}; build the wrapper with a larger max_work_items")

    def _page_ids(self, page_ids: torch.Tensor, used: int, staged: torch.Tensor | None, dev: torch.Tensor,
                  at: int, keep: list) -> int:
        if not self.graph:
            if staged is not None:
                return dev.data_ptr() + 4 * at
            t = dense_page_ids(page_ids)
            keep.append(t)
            return t.data_ptr()
        fixed = self.fixed_page_ids
        if fixed is None:
            fixed = self.fixed_page_ids = torch.zeros(max(2 * used, 64), dtype=torch.int32, device=self.device)
        elif fixed.numel() < used:
            raise ValueError(f"use_cuda_graph: the plan uses {used} page ids, more than the {fixed.numel()} of the "
                             "wrapper's fixed page-id buffer; pass a large enough paged_kv_indices buffer to the "
                             "constructor")
        src = staged if staged is not None else page_ids[:used]
        # the engine may have written the page ids into the fixed buffer itself (FlashInfer's pattern)
        in_place = staged is None and src.data_ptr() == fixed.data_ptr() and src.is_contiguous()
        if used and not in_place:
            fixed[:used].copy_(src, non_blocking=True)
        keep.append(fixed)
        return fixed.data_ptr()
