"""Device metadata read back to the host in one kernel launch: the fast path of ``MetadataBuffers.to_host``.

A plan() given its metadata on the device must see a few small int32 tensors on the host (the indptrs, the last
page lengths, the page ids or their range) before it can schedule. One ``cudaMemcpyAsync`` each costs the host
several microseconds and the copy engine runs them one after another (run 97: four copies and one synchronize,
32.5 us; one 8-byte copy and its synchronize, 9.1 us). Here one launch of a small gather kernel
(``attnjit/native/readback.cu``) writes up to ``SEGMENTS`` tensors into the pinned read-back buffer, which the
device addresses directly (unified addressing: a ``cudaHostAlloc`` pointer is valid on the device), and the plan
synchronizes once.

The package ships the kernel as PTX (``attnjit/native/readback.ptx``: nvcc's for ``compute_80``, its comment
header dropped and ``.version`` lowered to 7.0, CUDA 11's ISA, which has every instruction in it, so a driver
older than the compiler loads it too; tests/test_readback.py keeps the file and the source in step). The driver
compiles it at load, once per process and device: no compiler is needed at run time. Where it does not load (no
CuPy, a driver that refuses it) ``gather_for`` answers None and the copies serve, as they do for more than
``SEGMENTS`` tensors.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from pathlib import Path

PTX = Path(__file__).resolve().parents[1] / "native" / "readback.ptx"
KERNEL = "attnjit_readback"
SEGMENTS = 8                               # readback.cu's READBACK_SEGMENTS
ARGS = struct.Struct(f"<Q{SEGMENTS}Q{SEGMENTS}i")   # ReadbackArgs: dst, src[8], end[8] (cumulative counts)
THREADS = 256
MAX_BLOCKS = 64                            # the ids of a plan are at most planner.RAW_PAGE_IDS: 4 passes at most
MAX_TOTAL = (1 << 31) - 1                  # the kernel counts elements in int32


class Gather:
    """The read-back kernel loaded on one device: ``gather(dst, segments, stream)`` launches it."""

    def __init__(self, device_index: int):
        import cupy

        with cupy.cuda.Device(device_index):
            self._module = cupy.cuda.function.Module()
            self._module.load(PTX.read_bytes() + b"\0")   # PTX text, NUL-terminated for cuModuleLoadData
            self._fn = self._module.get_function(KERNEL)
        self._launch = cupy.cuda.driver.launchKernel
        self._buf = ctypes.create_string_buffer(ARGS.size)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._buf))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()   # the argument buffer is this object's: one launch packs it at a time
        self.launches = 0

    def gather(self, dst: int, segments: list[tuple[int, int]], stream: int) -> None:
        """Copy each (device pointer, int32 count) of ``segments`` (at most SEGMENTS, counts > 0, their sum at most
        MAX_TOTAL) one after another to the device-visible address ``dst``, on ``stream`` (asynchronously)."""
        n = len(segments)
        if not 0 < n <= SEGMENTS:
            raise ValueError(f"the read-back kernel takes 1 to {SEGMENTS} tensors, got {n}")
        srcs, ends, total = [], [], 0
        for ptr, count in segments:
            if count <= 0:
                raise ValueError(f"a read-back segment needs a positive count, got {count}")
            total += count
            srcs.append(ptr)
            ends.append(total)
        if total > MAX_TOTAL:
            raise ValueError(f"the read-back kernel counts in int32: {total} elements is too many")
        pad = SEGMENTS - n
        blocks = min(-(-total // THREADS), MAX_BLOCKS)
        with self._lock:
            ARGS.pack_into(self._buf, 0, dst, *srcs, *([srcs[-1]] * pad), *ends, *([total] * pad))
            self._launch(self._fn.ptr, blocks, 1, 1, THREADS, 1, 1, 0, stream, self._argv_ptr, 0)
            self.launches += 1


def device_address(runtime, host_ptr: int) -> int:
    """The device address of pinned host memory at ``host_ptr`` (cudaPointerGetAttributes; under unified
    addressing the same number), or 0 where the device cannot address it (then the copies serve)."""
    try:
        return int(runtime.pointerGetAttributes(host_ptr).devicePointer or 0)
    except Exception:  # noqa: BLE001 - not registered with CUDA: not addressable
        return 0


_gathers: dict[int, Gather | None] = {}
load_errors: dict[int, str] = {}   # why the kernel did not load on a device (where it did not): for diagnosis
_lock = threading.Lock()


def gather_for(device_index: int) -> Gather | None:
    """The read-back kernel on ``device_index``, loaded once per process; None where it cannot be loaded (no CuPy,
    a driver that refuses the PTX): the caller's copies serve."""
    g = _gathers.get(device_index, False)
    if g is not False:
        return g
    with _lock:
        if device_index not in _gathers:
            try:
                _gathers[device_index] = Gather(device_index)
            except Exception as e:  # noqa: BLE001 - any failure to load means: use the copies
                _gathers[device_index] = None
                load_errors[device_index] = f"{type(e).__name__}: {e}"
        return _gathers[device_index]
