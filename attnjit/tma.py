"""CUtensorMap descriptors for the sm90 family's TMA copies (``templates/include/attnjit/sm90/tma.cuh``).

A kernel that can copy Q, or K and V, with the tensor-memory accelerator reads a descriptor per tensor from its
parameter struct (``sm90.PARAM_FIELDS``). run() describes each tensor here (``Copies.fill``): its address, its
dims in memory order with their byte strides, and the box one copy reads; where the tensor meets every TMA rule
the driver encodes it (``cuTensorMapEncodeTiled``, once per distinct tensor: kept by its description) and the run's
``tma_flags`` say so; where not (a stride that is not a multiple of 16 bytes, dims that do not nest or overlap, an
address off 16 bytes, no driver), the kernel copies that tensor with cp.async as it would without TMA. The same results
either way: a test runs both (``ATTNJIT_TMA=0``).

Dims (innermost first), as the kernel indexes them:
  q         [nnz_qo, H_q, D]          {D, H_q, nnz_qo}, box {64, GROUP, CTA_Q / GROUP}
  o         [nnz_qo, H_q, D]          {D, H_q, nnz_qo}, box {64, GROUP, 64 / GROUP}  (a store: one warpgroup's rows)
  k, v NHD  [pages, page, H_kv, D]    {D, H_kv, page, pages}, box {64, 1, rows, 1}
  k, v HND  [pages, H_kv, page, D]    {D, page, H_kv, pages}, box {64, rows, 1, 1}
  k, v      [nnz_kv, H_kv, D]         {D, H_kv, nnz_kv}, box {64, 1, rows}   (ragged)
  k, v NHD, interleaved tiles (sm90.kv_interleaved: pages of 16k tokens smaller than the tile)
            [pages, page, H_kv, D]    {64, 8, H_kv x D / 64, page / 8, pages}, box {64, 8, D / 64, page / 8, 1}
            (dims 1 and 2 do not nest: a slot's 8 rows, then its 64-column blocks, so that a box lands as the
            tile's 8-row groups with every column block; one box a page)
Every box lands in the 128-byte swizzle, which is the layout the kernel's wgmma read.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import Any

from . import knobs

FLAG_KV, FLAG_Q, FLAG_O = 1, 2, 4   # tma_flags bits (sm90/tma.cuh kTmaKV, kTmaQ, kTmaO)
MAP_BYTES = 128
_NONE = bytes(MAP_BYTES)
_DTYPE = {"bf16": 9, "fp16": 6}                 # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 / FLOAT16
_SWIZZLE_128B, _L2_128B, _L2_256B = 3, 2, 3      # CUtensorMapSwizzle, CUtensorMapL2promotion


@dataclass(frozen=True)
class MapArgs:
    """One descriptor's arguments: element type (CUtensorMapDataType), address, dims (elements, innermost first),
    byte strides of dims 1.., box (elements), L2 promotion."""

    dtype: int
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    l2: int = _L2_128B


def describe(dtype: int, elem: int, address: int, dims: tuple[int, ...], strides: tuple[int, ...],
             box: tuple[int, ...], l2: int = _L2_128B, nest: bool = True) -> MapArgs | str:
    """The descriptor's arguments (strides in elements, of dims 1..), or why the TMA unit cannot read this tensor.
    nest=False: the caller has checked that the dims address the tensor's own elements (kv_args, interleaved)."""
    if address % 16:
        return f"address {address:#x} is not 16-byte aligned"
    if any(d < 1 or d > 2 ** 32 for d in dims):
        return f"dims {dims} out of 1 .. 2^32"
    if any(b < 1 or b > 256 or b > d for b, d in zip(box, dims)) or box[0] * elem % 16:
        return f"box {box} does not fit dims {dims}"
    byte_strides = tuple(s * elem for s in strides)
    extent = dims[0] * elem
    for i, s in enumerate(byte_strides):
        if s % 16 or s >= 2 ** 40:
            return f"stride {s} B of dim {i + 1} is not a multiple of 16 below 2^40"
        if nest and s < extent:  # each dim's stride nests the dims below it
            return f"dims {dims} with byte strides {byte_strides} do not nest"
        extent = s * dims[i + 1]
    return MapArgs(dtype, address, dims, byte_strides, box, l2)


def q_args(q, dtype: str, group: int, cta_q: int) -> MapArgs | str:
    """q, or the output (same dims; its box a warpgroup's rows): [nnz_qo, H_q, D], box {64, group, cta_q / group}."""
    n, h, d = q.shape
    return describe(_DTYPE[dtype], 2, q.data_ptr(), (d, h, n), (q.stride(1), q.stride(0)),
                    (64, group, cta_q // group))


def kv_args(ptr: int, dtype: str, *, paged: bool, hnd: bool, rows: int, page_size: int, heads: int, head_dim: int,
            stride0: int, stride1: int, box_rows: int, interleaved: bool = False) -> MapArgs | str:
    """k or v: rows = pages (paged) or tokens (ragged); stride0 / stride1 as the kernel's kv_stride_0 / _1."""
    code = _DTYPE[dtype]
    if interleaved:  # paged NHD: a slot's heads x head_dim contiguous (the kernel's rule), slots stride1 apart
        if not paged or hnd or head_dim % 64 or page_size % 8 or box_rows != page_size:
            return f"no interleaved map for this cache (page {page_size}, box {box_rows}, {'HND' if hnd else 'NHD'})"
        if stride1 < heads * head_dim or stride0 < page_size * stride1:
            return f"slots {stride1} and pages {stride0} elements apart overlap [{page_size}, {heads}, {head_dim}]"
        blocks = head_dim // 64
        dims = (64, 8, heads * blocks, page_size // 8, rows)
        return describe(code, 2, ptr, dims, (stride1, 64, 8 * stride1, stride0), (64, 8, blocks, page_size // 8, 1),
                        _L2_256B, nest=False)
    if not paged and rows >= 2 ** 31:  # the kernel's token coordinate is an int32
        return f"{rows} ragged tokens: past the TMA coordinate's int32"
    if not paged:  # [tokens][H][D]: stride0 the token stride, stride1 the head stride
        return describe(code, 2, ptr, (head_dim, heads, rows), (stride1, stride0), (64, 1, box_rows), _L2_256B)
    if hnd:        # [pages][H][page][D]: slots D apart, heads stride1
        return describe(code, 2, ptr, (head_dim, page_size, heads, rows), (head_dim, stride1, stride0),
                        (64, box_rows, 1, 1), _L2_256B)
    return describe(code, 2, ptr, (head_dim, heads, page_size, rows), (head_dim, stride1, stride0),
                    (64, 1, box_rows, 1), _L2_256B)


@functools.lru_cache(maxsize=1)
def _encoder():
    """cuTensorMapEncodeTiled from the driver library, or None where there is none (no GPU)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32, u64, p = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    fn.argtypes = [p, ctypes.c_int, u32, p, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u32),
                   ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=1024)
def encode(args: MapArgs) -> bytes | None:
    """The 128-byte descriptor, or None where the driver refuses it (or there is no driver)."""
    fn = _encoder()
    if fn is None:
        return None
    rank = len(args.dims)
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    out = (ctypes.c_uint8 * (MAP_BYTES + 64))()  # 64-byte aligned inside
    base = ctypes.addressof(out)
    aligned = base + (-base % 64)
    err = fn(ctypes.c_void_p(aligned), args.dtype, rank, ctypes.c_void_p(args.address), (u64 * rank)(*args.dims),
             (u64 * max(rank - 1, 1))(*args.strides), (u32 * rank)(*args.box), (u32 * rank)(*([1] * rank)), 0,
             _SWIZZLE_128B, args.l2, 0)
    if err != 0:
        return None
    return ctypes.string_at(aligned, MAP_BYTES)


@dataclass(frozen=True)
class Copies:
    """What one kernel copies by TMA (sm90.tma_boxes): the Q box (GROUP, CTA_Q) or None, the K/V box rows or 0, the
    output box (GROUP, 64) or None, and where the struct holds flags and descriptors."""

    q_box: tuple[int, int] | None
    kv_rows: int
    dtype: str                 # the 16-bit element type of q and the cache
    paged: bool
    hnd: bool
    slots: tuple[int, ...]     # struct indices of tma_flags, tma_q, tma_k, tma_v, tma_o
    o_box: tuple[int, int] | None = None
    o_dtype: str = ""          # the output's 16-bit element type
    v_gather: bool = False     # V gathered by cp.async where K comes by TMA (sm90.tma_v_gather): K's box only, "k"
    interleaved: bool = False  # interleaved K/V tiles (sm90.kv_interleaved): the 5-D map, a box a page
    # the last runs' answers by their tensors' description (run() mostly repeats one): describing and looking up
    # three descriptors costs ~12 us of host a run, a hit ~1; the output's on its own
    memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    o_memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def fill(self, vals: list, q, k_ptr: int, v_ptr: int, *, rows: int, page_size: int, heads: int, head_dim: int,
             stride0: int, stride1: int, out=None) -> str:
        """Set the run's flags and descriptors in ``vals``; returns what the TMA copies ("q+kv+o", "q+kv", "q",
        "kv", "q+k+o" (V gathered), ..., "")."""
        on = knobs.TMA.get()
        key = (on, q.data_ptr(), tuple(q.shape), q.stride(), k_ptr, v_ptr, rows, page_size, heads, head_dim, stride0,
               stride1)
        hit = self.memo.get(key)
        if hit is None:
            if len(self.memo) >= 64:
                self.memo.clear()
            hit = self.memo[key] = self._fill(q, k_ptr, v_ptr, on, rows=rows, page_size=page_size, heads=heads,
                                              head_dim=head_dim, stride0=stride0, stride1=stride1)
        f, sq, sk, sv = self.slots[:4]
        vals[f], vals[sq], vals[sk], vals[sv], used = hit
        if len(self.slots) > 4:  # the output's descriptor, memoized on its own (an engine's out may move each step)
            od = None
            if on and self.o_box is not None and out is not None:
                okey = (out.data_ptr(), tuple(out.shape), out.stride())
                if okey in self.o_memo:
                    od = self.o_memo[okey]
                else:
                    if len(self.o_memo) >= 64:
                        self.o_memo.clear()
                    od = self.o_memo[okey] = _encoded(q_args(out, self.o_dtype, *self.o_box))
            vals[self.slots[4]] = od or _NONE
            if od:
                vals[f] |= FLAG_O
                used = f"{used}+o" if used else "o"
        return used

    def _fill(self, q, k_ptr: int, v_ptr: int, on: bool, *, rows: int, page_size: int, heads: int, head_dim: int,
              stride0: int, stride1: int) -> tuple:
        """(flags, q, k and v descriptors, what is copied by TMA) for these tensors."""
        qd = kd = vd = None
        if on and self.q_box is not None:
            qd = _encoded(q_args(q, self.dtype, *self.q_box))
        if on and self.kv_rows:
            kw: dict[str, Any] = dict(paged=self.paged, hnd=self.hnd, rows=rows, page_size=page_size, heads=heads,
                                      head_dim=head_dim, stride0=stride0, stride1=stride1, box_rows=self.kv_rows,
                                      interleaved=self.interleaved)
            kd = _encoded(kv_args(k_ptr, self.dtype, **kw))
            # V gathered: the kernel reads K's descriptor only; else k and v share one flag (both by TMA or neither)
            vd = None if self.v_gather else _encoded(kv_args(v_ptr, self.dtype, **kw))
            if kd is None or (vd is None and not self.v_gather):
                kd = vd = None
        flags = (FLAG_Q if qd else 0) | (FLAG_KV if kd else 0)
        used = "+".join(n for n, d in (("q", qd), ("k" if self.v_gather else "kv", kd)) if d)
        return flags, qd or _NONE, kd or _NONE, vd or _NONE, used


def _encoded(args: MapArgs | str) -> bytes | None:
    """The descriptor of a tensor TMA can read (describe's MapArgs), else None."""
    return encode(args) if isinstance(args, MapArgs) else None
