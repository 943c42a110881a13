"""Argument checking shared by the ops: every bad input fails here, with the argument's name and the rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import dtypes
from ..errors import NoGPUError
from ..specs import HEAD_DIMS, MAX_PAGE_SIZE, AttentionSpec

SPEC_DTYPE = {t.torch: t.name for t in dtypes.TYPES.values()}   # torch dtype -> spec name (attnjit/dtypes.py)
COMPUTE_DTYPES = tuple(dtypes.of(n).torch for n in dtypes.COMPUTE)  # q and o
KV_DTYPES = tuple(dtypes.of(n).torch for n in dtypes.COMPUTE + dtypes.FP8)  # a KV cache


def _names(allowed: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d) for d in allowed)


def as_dtype(value: Any, name: str, allowed: tuple[torch.dtype, ...] = COMPUTE_DTYPES) -> torch.dtype:
    """A torch dtype or a name of one (``float16``, ``bf16``, ``e4m3``, ``float8_e4m3fn``...) -> the torch dtype, if
    in ``allowed``; anything else is a TypeError naming the argument."""
    t = dtypes.lookup(value)
    if t is not None and t.torch in allowed:
        return t.torch
    raise TypeError(f"{name}={value!r} is not supported: expected {_names(allowed)} (or their names)")


def check_tensor(name: str, t: Any, *, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
                 dim: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            raise TypeError(f"{name} must be {' or '.join(str(d) for d in allowed)}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}; everything must be on one device")
    return t


def check_metadata(name: str, t: Any, device: torch.device, length: int | None = None, *,
                   host_ok: bool = False, dense: bool = False) -> torch.Tensor:
    """int32, 1-D, on ``device`` (no silent conversion: int64 metadata is a TypeError). ``host_ok``: plan()
    metadata may also be a CPU tensor (as in FlashInfer), which spares plan() a device-to-host copy. ``dense``:
    a kernel reads the tensor through its data pointer, so a strided view (``table[:, 0]``) is an error."""
    if isinstance(t, torch.Tensor) and t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}; convert it with .to(torch.int32) "
                        "(attnjit never converts metadata silently)")
    host = host_ok and isinstance(t, torch.Tensor) and t.device.type == "cpu"
    check_tensor(name, t, dtype=torch.int32, dim=1, device=None if host else device)
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} elements, got {t.numel()}")
    if dense and t.stride(0) != 1 and t.numel() > 1:
        raise ValueError(f"{name} must be contiguous: the kernel reads it as a dense int32 array, and this view has "
                         f"stride {t.stride(0)} (e.g. a column of a table); pass {name}.contiguous()")
    return t


def check_vectors(name: str, t: torch.Tensor, dims: tuple[int, ...]) -> None:
    """The kernels move ``t`` 16 bytes at a time: its data pointer and its strides along ``dims`` (where the dim has
    more than one element) must be whole multiples of 16 bytes."""
    off = t.data_ptr() % 16
    if off:
        raise ValueError(f"{name} must start on a 16-byte boundary (the kernels read and write it 16 bytes at a "
                         f"time); this view starts {off} bytes past one (storage offset {t.storage_offset()} "
                         f"elements). Pass {name}.contiguous() or a view at a multiple of {16 // t.element_size()} "
                         "elements")
    es = t.element_size()
    for d in dims:
        if t.shape[d] > 1 and (t.stride(d) * es) % 16:
            raise ValueError(f"{name}.stride({d})={t.stride(d)} elements is not a multiple of {16 // es} (16 bytes), "
                             f"which the kernels' 16-byte accesses need; got shape {tuple(t.shape)} strides "
                             f"{t.stride()}. Pass {name}.contiguous()")


def _overlap_free(dims: list[tuple[int, int]]) -> bool:
    """(stride, size) pairs: True when no two index tuples share an address (sorted-stride test: each stride
    reaches past everything the smaller strides span). Sufficient, not necessary: exotic interleavings fail it."""
    extent = 1
    for stride, size in sorted((st, sz) for st, sz in dims if sz > 1):
        if stride < extent:
            return False
        extent += stride * (size - 1)
    return True


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) of the bytes a tensor's elements occupy; (0, 0) for an empty one."""
    if t.numel() == 0:
        return 0, 0
    lo = t.data_ptr()
    if t.is_contiguous():
        return lo, lo + t.numel() * t.element_size()
    return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


Span = tuple[str, tuple[int, int]]   # (name, byte_span)


def plan_spans(bound: dict[str, Any], page_ids: tuple[int, int] | None) -> tuple[Span, ...]:
    """(name, byte_span) of what a plan's kernel reads besides q and the KV operand: the tensors plan() bound (a
    caller's packed_custom_mask among them) and ``page_ids``, the bytes of the page ids it reads (a caller's device
    tensor where the kernel reads it in place, else the wrapper's copy or graph mode's fixed buffer), if any."""
    out = tuple((f"plan()'s {n}", byte_span(t)) for n, t in bound.items() if isinstance(t, torch.Tensor))
    return out + (("the plan's page ids", page_ids),) if page_ids is not None else out


def tensor_spans(params: dict | None, k_scale: Any, v_scale: Any) -> tuple[Span, ...]:
    """(name, byte_span) of the tensors among run()'s variant parameters (sinks, a user variant's tensors) and
    dequantization scales: the kernel reads them while it writes out, lse and the workspace."""
    out = tuple((f"variant parameter {n!r}", byte_span(t)) for n, t in (params or {}).items()
                if isinstance(t, torch.Tensor))
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(t, torch.Tensor):
            out += ((name, byte_span(t)),)
    return out


def first_shared(these: tuple[Span, ...], those: tuple[Span, ...]) -> tuple[Span, Span] | None:
    """The first pair (one of ``these``, one of ``those``) whose byte spans overlap, or None. An empty span, (0, 0),
    overlaps nothing."""
    for a in these:
        lo, hi = a[1]
        for b in those:
            olo, ohi = b[1]
            if olo < hi and lo < ohi:
                return a, b
    return None


def check_written_apart(out: torch.Tensor, lse: torch.Tensor | None, read: tuple[Span, ...]) -> None:
    """run()'s out and lse (the tensors its kernel writes) share no byte with each other nor with the spans it reads
    ((name, byte_span) of q and the KV operand): an ``out`` that is a view into the KV cache would be written while
    other CTAs read the pages under it (results that depend on timing, and a corrupted cache); an ``out`` over q
    (in-place attention) is written before a cascade's next level reads q again, and within one kernel its result
    would rest on the order in which CTAs read q and write out, which no kernel promises. A test of spans: tensors
    that interleave without sharing an element count as overlapping. (~1 us: run() calls it only for a caller's
    out or lse.)"""
    written = (("out", byte_span(out)),) if lse is None else (("out", byte_span(out)), ("lse", byte_span(lse)))
    for i, mine in enumerate(written):
        found = first_shared((mine,), written[i + 1:] + read)
        if found:
            (name, (lo, hi)), (other, (olo, ohi)) = found
            raise ValueError(f"run(): {name} shares memory with {other} (bytes {lo:#x}..{hi:#x} and "
                             f"{olo:#x}..{ohi:#x}); the kernel writes {name} while it reads {other}: pass a "
                             f"{name} of its own")


def check_apart_from(written: Span, read: tuple[Span, ...], where: str = "run()") -> None:
    """run()'s inputs ((name, byte_span) of q and the KV operand) share no byte with the workspace its kernels write
    partial states into (``written``): a q or cache carved out of float_workspace_buffer would be overwritten."""
    found = first_shared(read, (written,))
    if found:
        (other, (olo, ohi)), (name, (lo, hi)) = found
        raise ValueError(f"{where}: {other} shares memory with {name} (bytes {olo:#x}..{ohi:#x} and {lo:#x}..{hi:#x})"
                         f"; the kernels write partial states into {name}: give {other} memory of its own")


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """A tensor a kernel writes may not have two elements at one address (expand(), as_strided())."""
    if t.is_contiguous() or _overlap_free([(t.stride(d), t.shape[d]) for d in range(t.dim())]):
        return
    raise ValueError(f"{name} is written by the kernel but its elements overlap in memory (shape {tuple(t.shape)} "
                     f"strides {t.stride()}, e.g. from expand()); pass a tensor whose elements are distinct")


def require_cuda(op: str, name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA devices only: a tensor elsewhere is attnjit's NoGPUError, after its arguments checked."""
    if t.device.type != "cuda":
        raise NoGPUError(f"{op}: {name} is on {t.device}; attnjit kernels run on CUDA devices only")


def check_head_dim(name: str, value: Any) -> int:
    if type(value) is not int or value not in HEAD_DIMS:
        raise ValueError(f"{name}={value!r} is not supported: allowed head dims are {', '.join(map(str, HEAD_DIMS))}")
    return value


def check_page_size(value: Any) -> int:
    if type(value) is not int or value < 1 or value > MAX_PAGE_SIZE:
        raise ValueError(f"page_size={value!r} is not supported: expected an integer from 1 to {MAX_PAGE_SIZE}")
    return value


def check_layout(value: Any) -> str:
    if value not in ("NHD", "HND"):
        raise ValueError(f"kv_layout={value!r} is not supported: expected 'NHD' or 'HND'")
    return value


def unsupported(**features: Any) -> None:
    """FlashInfer arguments attnjit accepts for compatibility but does not implement: any non-default value is a
    NotImplementedError naming the argument."""
    defaults = {"use_fp16_qk_reduction": False}  # every other such argument defaults to None
    for name, value in features.items():
        default = defaults.get(name)
        if value is None and default is None or default is False and value is False:
            continue
        shown = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else repr(value)
        raise NotImplementedError(f"{name}={shown} is not supported by attnjit{_INSTEAD.get(name, '')}")


# what to use instead, where attnjit has it in its own terms
_INSTEAD = {n: " (FlashInfer's JIT variant arguments: declare the variant with attnjit.Variant and pass the wrapper "
               "variant=; README, \"Declare your own attention variant\")" for n in ("jit_args", "jit_kwargs")}


@dataclass(frozen=True)
class PagedCache:
    """A paged KV cache as two views with identical strides. Shapes: NHD [P, page, H, D]; HND [P, H, page, D]."""

    k: torch.Tensor
    v: torch.Tensor
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    stride_page: int   # elements between pages
    stride_inner: int  # slot stride (NHD) / head stride (HND)
    k_ptr: int = 0
    v_ptr: int = 0
    spans: tuple = ()  # ((name, byte_span), ...) of k and v: what run() keeps out and lse away from


def unpack_paged_cache(name: str, cache: Any, layout: str, *, written: bool = False) -> PagedCache:
    """Accept one [P, 2, ...] tensor or a (k, v) tuple, NHD or HND, and check what the kernels assume: fp16/bf16/fp8,
    the last dim contiguous and the next one D apart, 16-byte aligned pages. ``written`` (append): no two elements
    of the pages may share memory, so a write lands in the page it names and nowhere else."""
    if isinstance(cache, torch.Tensor):
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise ValueError(f"{name} must be [num_pages, 2, page_size, H_kv, D] (NHD) or [num_pages, 2, H_kv, "
                             f"page_size, D] (HND), or a (k, v) tuple; got shape {tuple(cache.shape)}")
        k, v = cache[:, 0], cache[:, 1]
    elif isinstance(cache, (tuple, list)) and len(cache) == 2:
        k, v = cache
        check_tensor(f"{name}[0] (k)", k, dim=4)
        check_tensor(f"{name}[1] (v)", v, dim=4)
        if k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"{name}: k and v must have one shape, strides, dtype and device; got k {tuple(k.shape)} "
                             f"{k.stride()} {k.dtype} {k.device} and v {tuple(v.shape)} {v.stride()} {v.dtype} {v.device}")
    else:
        raise TypeError(f"{name} must be a 5-D tensor or a (k, v) tuple of 4-D tensors, got {type(cache).__name__}")
    if k.dtype not in KV_DTYPES:
        raise TypeError(f"{name} must be {_names(KV_DTYPES)}, got {k.dtype}")
    if layout == "NHD":
        num_pages, page_size, heads, dim = k.shape
    else:
        num_pages, heads, page_size, dim = k.shape
    # axis 1 (slots for NHD, heads for HND) has a run-time stride; axis 2 must be D apart, axis 3 contiguous
    if k.stride(3) != 1 or (k.stride(2) != dim and k.shape[2] > 1):
        what = "heads" if layout == "NHD" else "slots"
        raise ValueError(f"{name}: the last dim must be contiguous and consecutive {what} {dim} elements apart "
                         f"({layout} layout); got strides {k.stride()}. Use a contiguous cache.")
    check_vectors(f"{name} (k pages)", k, (0, 1, 2))
    check_vectors(f"{name} (v pages)", v, (0, 1, 2))
    if written:
        _check_pages_distinct(name, cache, k, v)
    return PagedCache(k=k, v=v, num_pages=num_pages, page_size=page_size, num_kv_heads=heads, head_dim=dim,
                      stride_page=k.stride(0), stride_inner=k.stride(1), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(),
                      spans=((f"{name} (k)", byte_span(k)), (f"{name} (v)", byte_span(v))))


def _check_pages_distinct(name: str, cache: Any, k: torch.Tensor, v: torch.Tensor) -> None:
    if isinstance(cache, torch.Tensor):
        check_no_overlap(name, cache)
        return
    check_no_overlap(f"{name}[0] (k)", k)
    check_no_overlap(f"{name}[1] (v)", v)
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return
    delta = abs(v.data_ptr() - k.data_ptr()) // k.element_size()
    dims = [(k.stride(d), k.shape[d]) for d in range(4)] + [(delta, 2)]
    if delta == 0 or not _overlap_free(dims):
        raise ValueError(f"{name}: k and v share memory (v starts {delta} elements after k, strides {k.stride()}); "
                         "appending would write keys and values over each other")


_specs: dict[tuple, AttentionSpec] = {}


def spec_for(**fields: Any) -> AttentionSpec:
    """AttentionSpec(**fields), memoized: plan() and append run every step and a spec validates itself on
    construction."""
    key = tuple(fields.items())
    spec = _specs.get(key)
    if spec is None:
        spec = AttentionSpec(**fields)
        if len(_specs) > 256:   # variants composed per plan would otherwise grow it without bound
            _specs.clear()
        _specs[key] = spec
    return spec


_with_family: dict[tuple, AttentionSpec] = {}


def with_family(spec: AttentionSpec, family: str) -> AttentionSpec:
    """``spec`` on another kernel family (memoized like spec_for: plan() asks every step)."""
    key = (spec, family)
    out = _with_family.get(key)
    if out is None:
        out = spec.replace(family=family)
        if len(_with_family) > 256:
            _with_family.clear()
        _with_family[key] = out
    return out
