"""Runtime: load cubins with CuPy, launch on torch's current stream, and record every dispatch.

Loading happens in plan() (``module(spec, device)``, memoized per (key, device)), from the cubin bytes the cache
verified; run() only calls a prepared ``Launch``: it packs the kernel's parameter struct into a preallocated buffer
and calls ``cuLaunchKernel`` on the current stream. Nothing is compiled, loaded or allocated there, so a run() can
be captured in a CUDA graph.

Every dispatch is recorded: op, canonical spec, cache key, kernel, where the binary came from (``memory``, or
``disk``/``built`` for the first launch after loading, with compile ms), grid, block, the plan's decisions
(split-KV) and the toolchain that built the cubin. ``ATTNJIT_LOG=path.jsonl`` streams records;
``with attnjit.recording() as rec:`` collects them.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from . import knobs
from .cache import Cache, touch
from .errors import NoGPUError
from .generator import KernelInfo, ParamLayout, render
from .jit import Binary, ensure
from .specs import AttentionSpec

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


# --- records --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DispatchRecord:
    op: str
    spec: str                    # canonical spec JSON
    key: str
    kernel: str
    binary: str                  # memory | disk | built
    compile_ms: float | None     # set when binary == "built"
    load_ms: float | None        # set when binary != "memory"
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    plan: dict[str, Any] | None  # the plan's decisions (tile, split-KV, work items)
    time: float = field(default_factory=time.time)
    built_by: str | None = None  # the toolchain that built the cubin (its manifest's), e.g. "nvcc 13.0 V13.0.88"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class Recording(list):
    """The dispatch records of a ``recording()`` block, in order."""

    def specs(self) -> list[AttentionSpec]:
        out: list[AttentionSpec] = []
        for r in self:
            s = AttentionSpec.from_dict(json.loads(r.spec))
            if s not in out:
                out.append(s)
        return out


_recorders: list[Recording] = []
_log_lock = threading.Lock()
_log_state: dict[str, Any] = {"raw": None, "file": None}


@contextmanager
def recording() -> Iterator[Recording]:
    """Collect the dispatch records of the block: ``with attnjit.recording() as rec: ...``."""
    rec = Recording()
    _recorders.append(rec)
    try:
        yield rec
    finally:
        _recorders.remove(rec)


try:  # the process environment as a plain dict: a lookup per dispatch costs ~50 ns instead of ~1.5 us
    _ENV, _LOG_KEY = os.environ._data, os.environ.encodekey(knobs.LOG.name)  # type: ignore[attr-defined]
except AttributeError:  # not CPython's posix environ
    _ENV, _LOG_KEY = os.environ, knobs.LOG.name


def _log_file():
    raw = _ENV.get(_LOG_KEY) or None
    if raw is not None and isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    if raw != _log_state["raw"]:
        with _log_lock:
            if _log_state["file"] is not None:
                _log_state["file"].close()
            _log_state["file"], _log_state["raw"] = None, None
            _log_state["file"] = _open_log(raw) if raw else None
            _log_state["raw"] = raw
    return _log_state["file"]


def _open_log(raw: str):
    """ATTNJIT_LOG opened for appending, line-buffered. Opened non-blocking, so a FIFO with no reader is an error
    at once instead of a process hung in open(); a FIFO with a reader (a shell's process substitution) works and is
    written with blocking writes as a file is. Any path that cannot be appended to is a ValueError naming the
    variable, raised where the first record would be written."""
    path = knobs.LOG.value_of(raw)   # the knob's parse: a path of blanks only is refused, as for the other paths
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        hint = " (a FIFO with no reader)" if exc.errno == errno.ENXIO else ""
        raise ValueError(f"environment variable {knobs.LOG.name}={raw!r} is invalid: it cannot be opened to append "
                         f"the dispatch record: {exc.strerror}{hint}; point it at a writable file or unset it") from None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


def _emit(record: DispatchRecord) -> None:
    for rec in _recorders:
        rec.append(record)
    f = _log_file()
    if f is not None:
        with _log_lock:
            f.write(record.to_json() + "\n")


# --- devices --------------------------------------------------------------------------------------------

def _torch():
    import torch

    return torch


_device_facts: dict[tuple[str, int | None], object] = {}  # (fact, device index) -> arch / SM count: plan() asks
                                                          # every step and they never change


def _device_index(torch, device) -> int:
    index = torch.device(device).index if not isinstance(device, int) else device
    return torch.cuda.current_device() if index is None else index


def device_arch(device) -> str:
    """The nvcc arch for a CUDA device: its own (sm_90a on Hopper, else sm_XY) unless ATTNJIT_ARCH_OVERRIDE forces
    one (``arch`` holds the rule); ATTNJIT_ARCH never overrides a present GPU. The capability is asked once per
    device (plan() and append ask every step)."""
    from .arch import runtime_arch

    torch = _torch()
    key = ("capability", _device_index(torch, device))
    cap = _device_facts.get(key)
    if cap is None:
        cap = _device_facts[key] = torch.cuda.get_device_capability(key[1])
    return runtime_arch(*cap)


def num_sms(device) -> int:
    torch = _torch()
    if device is not None and torch.device(device).type == "cuda":
        key = ("sms", _device_index(torch, device))
        sms = _device_facts.get(key)
        if sms is None:
            sms = _device_facts[key] = torch.cuda.get_device_properties(key[1]).multi_processor_count
        return sms
    return knobs.NUM_SMS.get() or 132


_raw_stream = None


def current_stream(device_index: int) -> int:
    global _raw_stream
    if _raw_stream is None:
        torch = _torch()
        fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = fn if fn is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)
    return _raw_stream(device_index)


# --- modules and launches -------------------------------------------------------------------------------

class Module:
    """One cubin loaded on one device."""

    def __init__(self, binary: Binary, device_index: int):
        import cupy

        self.binary = binary
        self.spec = binary.spec
        self.key = binary.entry.key
        self.device_index = device_index
        t0 = time.perf_counter()
        with cupy.cuda.Device(device_index):
            # the bytes the cache verified (sha256, owner, mode), not the path again: no check-then-use window
            self.raw = cupy.cuda.function.Module()
            self.raw.load(binary.entry.image)
            self.kernels: dict[str, Kernel] = {}
            for name, info in render(self.spec).kernels.items():
                fn = self.raw.get_function(name)  # cupy.cuda.Function, loaded on this device
                if info.smem:  # static shared memory counts too: always raise the dynamic limit to what we use
                    cupy.cuda.driver.funcSetAttribute(fn.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                      info.smem)
                self.kernels[name] = Kernel(self, info, fn)
        self.load_ms = binary.lookup_ms + (time.perf_counter() - t0) * 1e3
        self._first_source: str | None = binary.how
        self.launches = 0
        touch(binary.entry)

    def take_source(self) -> tuple[str, float | None, float | None]:
        """(binary source, compile ms, load ms) for a dispatch: the first reports disk/built, later ones memory."""
        how = self._first_source
        if how is None:
            return "memory", None, None
        self._first_source = None
        return how, self.binary.compile_ms, self.load_ms


class Kernel:
    def __init__(self, module: Module, info: KernelInfo, fn):
        self.module, self.info, self.fn = module, info, fn
        self.ptr = fn.ptr
        self.layout: ParamLayout = info.layout
        self._occupancy: dict[tuple[int, int], int] = {}

    def occupancy(self, threads: int | None = None, smem: int | None = None) -> int:
        """Resident CTAs per SM (memoized: plan() asks every step)."""
        key = (threads or self.info.threads, self.info.smem if smem is None else smem)
        if key not in self._occupancy:
            import cupy

            with cupy.cuda.Device(self.module.device_index):
                self._occupancy[key] = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(self.ptr, *key)
        return self._occupancy[key]


class Launch:
    """A prepared launch: kernel, grid, block and a parameter buffer. Calling it packs and launches, nothing more."""

    def __init__(self, op: str, kernel: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int] | None = None,
                 smem: int | None = None):
        self.op, self.kernel, self.grid = op, kernel, tuple(int(g) for g in grid)
        self.block = block or (kernel.info.threads, 1, 1)
        self.smem = kernel.info.smem if smem is None else smem
        self.decide: Any = None  # a function giving the plan's decisions for the record, asked only when one is made
        self.layout = kernel.layout
        self._buf = ctypes.create_string_buffer(self.layout.size)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._buf))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._device_index = kernel.module.device_index
        import cupy

        self._launch = cupy.cuda.driver.launchKernel

    def __call__(self, values: list) -> None:
        self.layout.struct.pack_into(self._buf, 0, *values)
        gx, gy, gz = self.grid
        if gx and gy and gz:
            bx, by, bz = self.block
            self._launch(self.kernel.ptr, gx, gy, gz, bx, by, bz, self.smem, current_stream(self._device_index),
                         self._argv_ptr, 0)
        module = self.kernel.module
        module.launches += 1
        if module._first_source is None and not _recorders and _log_file() is None:
            return  # the common case: a memory hit nobody is recording
        how, compile_ms, load_ms = module.take_source()
        if _recorders or _log_file() is not None:
            _emit(DispatchRecord(op=self.op, spec=module.spec.canonical(), key=module.key, kernel=self.kernel.info.name,
                                 binary=how, compile_ms=compile_ms, load_ms=load_ms, grid=self.grid,
                                 block=tuple(self.block), smem=self.smem,
                                 plan=None if self.decide is None else self.decide(),
                                 built_by=module.binary.entry.toolchain))


_modules: dict[tuple[AttentionSpec, int], Module] = {}
_modules_lock = threading.Lock()


def module(spec: AttentionSpec, device, cache: Cache | None = None) -> Module:
    """The spec's module loaded on ``device`` (memoized per spec and device; built or read from disk once)."""
    torch = _torch()
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type != "cuda":
        raise NoGPUError(f"attnjit kernels run on CUDA devices; got device {dev}")
    if dev.index is not None:  # a memory hit is one dict lookup: plan() asks for its module every step
        mod = _modules.get((spec, dev.index))
        if mod is not None:
            return mod
    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA device is available (torch.cuda.is_available() is False)")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    memo = (spec, index)
    with _modules_lock:
        mod = _modules.get(memo)
        if mod is None:
            mod = Module(ensure(spec, cache), index)
            _modules[memo] = mod
    return mod


_module_memos: list[dict] = []


def module_memo() -> dict:
    """A dict an op keeps of things made from loaded modules (its Launches): clear_memory() empties it too."""
    memo: dict = {}
    _module_memos.append(memo)
    return memo


def clear_memory() -> None:
    """Forget loaded modules, and what ops made from them (tests; a process that changed its cache)."""
    _modules.clear()
    for memo in _module_memos:
        memo.clear()
