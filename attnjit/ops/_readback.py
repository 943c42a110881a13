"""Device metadata read back to the host in as few copies as it safely can (``MetadataBuffers.to_host``).

Each device-to-host ``cudaMemcpyAsync`` costs the H200 host 2-4 us of API time whatever its size (RESULTS.md, run
108: the prefill read-back of four small tensors, one copy 41.0 us, four 47.5), so tensors that lie close together
in one device allocation (an engine's metadata slices of one buffer, or small tensors the caching allocator placed
side by side in one segment) come back as one copy of the bytes that span them. The bytes between them are read
and dropped; nothing is written.

Safety: a span is copied only if the driver says one allocation holds all of it (``cuMemGetAddressRange`` on the
run's first byte, whose range must reach the run's last byte), so a copy never touches unmapped memory, whatever
the tensors' origin (torch's allocator, a DLPack import, host-mapped memory: an address the driver does not know
is copied alone). And were the driver to answer with a whole virtual reservation (torch's expandable segments map
2 MB granules into one), a span still holds only live tensors' bytes and gaps of at most GAP (64 KB) between them,
so no unmapped granule can lie inside it. Where the driver cannot be asked, every tensor is its own copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Callable, Sequence

# Tensors up to this many bytes apart (in one allocation) share a copy: copying the gap costs about what another
# copy's call does (64 KB over PCIe is ~3 us at 25 GB/s).
GAP = 64 << 10

Allocation = Callable[[int], "tuple[int, int] | None"]   # device pointer -> (base, size) of its allocation


def copy_runs(spans: Sequence[tuple[int, int]], allocation: Allocation | None,
              gap: int = GAP) -> list[tuple[int, int, list[int]]]:
    """Group device byte ranges into copies.

    spans: [start, end) byte ranges, non-empty. Returns (start, end, members) per copy, in address order, members
    the indices of the spans it covers. Two spans share a copy when they are at most ``gap`` bytes apart, both
    4-byte aligned (the host views are int32) and inside the allocation ``allocation(start)`` reports for the
    copy's first span; ``allocation`` None (or answering None) keeps every span apart.
    """
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    runs: list[tuple[int, int, list[int]]] = []
    limit: int | None = None     # the end of the current run's allocation (None: not asked yet or unknown)
    asked = False
    for i in order:
        s, e = spans[i]
        if e <= s:
            raise ValueError(f"copy_runs: empty span {spans[i]}")
        aligned = s % 4 == 0 and e % 4 == 0
        if runs and aligned and allocation is not None:
            rs, re_, members = runs[-1]
            if rs % 4 == 0 and re_ % 4 == 0 and s - re_ <= gap:
                if not asked:
                    found = allocation(rs)
                    limit = found[0] + found[1] if found is not None and found[0] <= rs else None
                    asked = True
                if limit is not None and max(e, re_) <= limit:
                    runs[-1] = (rs, max(e, re_), members + [i])
                    continue
        runs.append((s, e, [i]))
        limit, asked = None, False
    return runs


class _Driver:
    """cuMemGetAddressRange through ctypes (CuPy does not bind it); loaded on first use."""

    def __init__(self):
        name = "nvcuda.dll" if os.name == "nt" else "libcuda.so.1"
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cuMemGetAddressRange_v2
        except (OSError, AttributeError):
            try:
                found = ctypes.util.find_library("cuda")
                fn = ctypes.CDLL(found).cuMemGetAddressRange_v2 if found else None
            except (OSError, AttributeError):
                fn = None
        if fn is not None:
            fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
            fn.restype = ctypes.c_int
        self.fn = fn

    def allocation(self, ptr: int) -> tuple[int, int] | None:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()   # per call: plans may run on several threads
        if self.fn is None or self.fn(ctypes.byref(base), ctypes.byref(size), ptr) != 0:   # CUDA_SUCCESS is 0
            return None
        return base.value, size.value


_DRIVER: _Driver | None = None


def driver_allocation() -> Allocation | None:
    """The driver's allocation query for the current context, or None where libcuda cannot be loaded."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER.allocation if _DRIVER.fn is not None else None
