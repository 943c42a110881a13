"""plan() inputs: every argument checked and the metadata read once on the host, with explicit bounds.

The wrappers' plan() call these before anything else: scalar options become checked Python values
(``PlanOptions``), metadata tensors become numpy arrays of request lengths (``Batch``). Every rule fails with a
``ValueError``/``TypeError`` (``NotImplementedError`` for FlashInfer features attnjit lacks) that names the
argument, the rule and what was received, before any allocation proportional to the input's values.

Metadata is read where it lies: a CPU tensor through ``numpy()`` (no copy, strided views included), device
tensors with one device-to-host copy for all of them (device page ids contribute their min and max, reduced on the
device: ``device_page_range``). Only the page ids are read by a kernel later, so they alone must become
dense: ``dense_page_ids`` does that (a copy only for a strided view).

Bounds (``LIMITS``), each checked before the work it bounds:
  heads          num_qo_heads, num_kv_heads <= 1024; H_q / H_kv <= AttentionSpec's MAX_GROUP_SIZE
  query rows     qo_indptr[-1] <= 2**24 per plan
  KV length      <= 2**30 tokens per request (kernels index tokens with int32)
  work items     <= 2**20 per plan (the scheduler counts them before building the list)
  window_left    -1 or 0..2**31-1; sm_scale and logits_soft_cap positive, finite as float32
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import knobs
from ..specs import MAX_GROUP_SIZE
from ._common import KV_DTYPES, as_dtype, check_head_dim, check_metadata, check_page_size
from .scheduler import MAX_WORK_ITEMS, _cplan

MAX_HEADS = 1024
MAX_QO_ROWS = 1 << 24
MAX_KV_LEN = 1 << 30
INT32_MAX = (1 << 31) - 1
LIMITS = {"heads": MAX_HEADS, "group": MAX_GROUP_SIZE, "qo_rows": MAX_QO_ROWS, "kv_len": MAX_KV_LEN,
          "work_items": MAX_WORK_ITEMS}

_LOG2E = 1.4426950408889634
POS_ENCODINGS = ("NONE", "ALIBI", "ROPE_LLAMA")
_F32_MAX = 3.4028234663852886e38
_F32_TINY = 2.0 ** -126  # smallest normal float32: below it a scale flushes to 0 in the kernel


# --- scalars ---------------------------------------------------------------------------------------------

def as_int(name: str, value: Any) -> int:
    """A Python or numpy integer (never a bool, a float or a string) -> int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def as_real(name: str, value: Any) -> float:
    """A Python or numpy real number (never a bool or a string) -> float; an int beyond any float is a ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got an int of {int(value).bit_length()} bits") from None


def as_flag(name: str, value: Any, *, none: bool | None = None) -> bool:
    """True/False (numpy bools too). ``none``: what None means, where an engine may pass it (else an error)."""
    if value is None and none is not None:
        return none
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _f32_positive(name: str, value: float, scaled: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if not _F32_TINY <= scaled <= _F32_MAX:
        raise ValueError(f"{name}={value!r} is outside the float32 range the kernels compute in "
                         f"({_F32_TINY:.3g} .. {_F32_MAX:.3g})")


def check_heads(num_qo_heads: Any, num_kv_heads: Any) -> int:
    """(H_q, H_kv) -> the GQA group size H_q / H_kv."""
    num_qo_heads, num_kv_heads = as_int("num_qo_heads", num_qo_heads), as_int("num_kv_heads", num_kv_heads)
    for name, n in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
        if not 1 <= n <= MAX_HEADS:
            raise ValueError(f"{name} must be a positive int <= {MAX_HEADS}, got {n}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)")
    group = num_qo_heads // num_kv_heads
    if group > MAX_GROUP_SIZE:
        raise ValueError(f"num_qo_heads={num_qo_heads} / num_kv_heads={num_kv_heads} = {group} query heads per KV "
                         f"head; the kernels support groups up to {MAX_GROUP_SIZE}")
    return group


def check_head_dims(name: str, head_dim: Any, head_dim_vo: Any = None) -> int:
    head_dim = check_head_dim(name, as_int(name, head_dim))
    if head_dim_vo is not None and as_int("head_dim_vo", head_dim_vo) != head_dim:
        raise ValueError(f"head_dim_vo={head_dim_vo!r} must equal {name}={head_dim} (not supported yet)")
    return int(head_dim)


def plan_page_size(value: Any) -> int:
    return check_page_size(as_int("page_size", value))


def plan_dtypes(q_data_type: Any, kv_data_type: Any, o_data_type: Any, *,
                kv_name: str = "kv_data_type") -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(q, kv, o) torch dtypes: q and o fp16/bf16; kv q's type or fp8 (torch.float8_e4m3fn / float8_e5m2), whose
    cache is dequantized in the kernel's load path (run()'s k_scale / v_scale)."""
    q = as_dtype(q_data_type, "q_data_type")
    kv = as_dtype(kv_data_type, kv_name, KV_DTYPES) if kv_data_type is not None else q
    o = as_dtype(o_data_type, "o_data_type") if o_data_type is not None else q
    if kv != q and kv.itemsize != 1:
        raise ValueError(f"{kv_name}={kv} must equal q_data_type={q} or be an fp8 type (torch.float8_e4m3fn, "
                         "torch.float8_e5m2): a 16-bit cache of another type than q is not supported")
    return q, kv, o


@dataclass(slots=True, frozen=True)
class PlanOptions:
    """plan()'s scalar options, checked: what the binding, the scheduler and the launch use."""

    sm_scale: float                 # already defaulted to 1/sqrt(head_dim)
    logits_soft_cap: float | None   # None: off
    window_left: int | None         # None: no window
    pos_encoding_mode: str          # NONE | ALIBI | ROPE_LLAMA
    causal: bool
    fixed_split_size: int | None
    disable_split_kv: bool
    rope_scale: float = 1.0         # ROPE_LLAMA: positions are divided by it (FlashInfer's default 1)
    rope_theta: float = 1e4         # ROPE_LLAMA: the frequency base (FlashInfer's default 1e4)


def plan_scalars(args: dict[str, Any]) -> tuple:
    """A plan()'s scalar arguments (``args``: its keywords: heads, ``head_dim`` or ``head_dim_qk`` (and
    ``head_dim_vo``), ``page_size`` where the wrapper is paged, the dtypes (decode: FlashInfer's older ``data_type``
    too) and the options of plan_options), checked in that order: (group, head_dim, page size or None, (q, kv, o)
    dtypes, PlanOptions)."""
    a = dict(args)
    group = check_heads(a.pop("num_qo_heads"), a.pop("num_kv_heads"))
    name = "head_dim" if "head_dim" in a else "head_dim_qk"
    head_dim = check_head_dims(name, a.pop(name), a.pop("head_dim_vo", None))
    page = plan_page_size(a.pop("page_size")) if "page_size" in a else None
    q, kv, o, older = a.pop("q_data_type"), a.pop("kv_data_type"), a.pop("o_data_type"), a.pop("data_type", None)
    if older is not None and kv is None:  # FlashInfer's older name for the KV (and q) type
        dtypes = plan_dtypes(q, older, o, kv_name="data_type")
    else:
        dtypes = plan_dtypes(q, kv, o)
    return group, head_dim, page, dtypes, plan_options(head_dim=head_dim, **a)


def plan_options(*, head_dim: int, sm_scale: Any = None, logits_soft_cap: Any = None, window_left: Any = -1,
                 pos_encoding_mode: Any = "NONE", causal: Any = False, fixed_split_size: Any = None,
                 disable_split_kv: Any = False, non_blocking: Any = True, rope_scale: Any = None,
                 rope_theta: Any = None) -> PlanOptions:
    if sm_scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        scale = as_real("sm_scale", sm_scale)
        _f32_positive("sm_scale", scale, scale * _LOG2E)
    cap = None
    if logits_soft_cap is not None:
        cap = as_real("logits_soft_cap", logits_soft_cap)
        if cap == 0:
            cap = None  # FlashInfer: 0 turns the soft-cap off
        else:
            _f32_positive("logits_soft_cap", cap, cap)
            if 1.0 / cap < _F32_TINY:
                raise ValueError(f"logits_soft_cap={cap!r} is too large for float32 (1/cap flushes to 0)")
    window = None
    if window_left is not None:
        w = as_int("window_left", window_left)
        if w != -1:
            if not 0 <= w <= INT32_MAX:
                raise ValueError(f"window_left={w} must be -1 (no window) or a non-negative int32 (<= {INT32_MAX})")
            window = w
    if not isinstance(pos_encoding_mode, str):
        raise TypeError(f"pos_encoding_mode must be a string ('NONE', 'ALIBI' or 'ROPE_LLAMA'), got "
                        f"{pos_encoding_mode!r}")
    if pos_encoding_mode not in POS_ENCODINGS:
        raise NotImplementedError(f"pos_encoding_mode={pos_encoding_mode!r} is not supported: expected one of "
                                  f"{', '.join(POS_ENCODINGS)} (other rotary layouts: apply them to q and k before "
                                  "attention, or declare a query_transform/key_transform variant)")
    rope = {}
    for name, value, default in (("rope_scale", rope_scale, 1.0), ("rope_theta", rope_theta, 1e4)):
        x = default if value is None else as_real(name, value)
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        rope[name] = x
    if pos_encoding_mode == "ROPE_LLAMA":  # freqs theta^(-2f/D) / scale (f < D/2); the kernel's angle pos * freq
        r_scale, theta = rope["rope_scale"], rope["rope_theta"]   # is float32, for positions up to MAX_KV_LEN
        top = max(0.0, -(head_dim - 2) / head_dim * math.log2(theta)) - math.log2(r_scale)
        if top > math.log2(_F32_MAX / MAX_KV_LEN):
            raise ValueError(f"rope_scale={r_scale!r} with rope_theta={theta!r} gives RoPE frequencies up to "
                             f"2**{top:.0f}: the angle position x frequency (positions up to {MAX_KV_LEN}) overflows "
                             "float32; rope_scale and rope_theta must keep every frequency <= "
                             f"{_F32_MAX / MAX_KV_LEN:.3g}")
    split = None
    if fixed_split_size is not None:
        split = as_int("fixed_split_size", fixed_split_size)
        if not 1 <= split <= MAX_KV_LEN:
            raise ValueError(f"fixed_split_size must be a positive number of KV tokens <= {MAX_KV_LEN}, got {split}")
    as_flag("non_blocking", non_blocking)
    return PlanOptions(sm_scale=scale, logits_soft_cap=cap, window_left=window, pos_encoding_mode=pos_encoding_mode,
                       causal=as_flag("causal", causal), fixed_split_size=split,
                       disable_split_kv=as_flag("disable_split_kv", disable_split_kv, none=False), **rope)


# --- metadata ----------------------------------------------------------------------------------------------
#
# Each rule has a fast "all fine?" test, on Python lists for small batches (a numpy call costs about a microsecond,
# more than a short loop) and on numpy arrays for large ones, and one _explain_* function that finds the first
# request breaking it and raises the error: the rule's only statement of what went wrong.

SMALL = 16  # requests: up to this many, plain Python over lists is cheaper than numpy


@dataclass(slots=True)
class Batch:
    """A plan's requests, read from its metadata (numpy int64; B requests)."""

    qo_indptr: np.ndarray   # [B+1] query rows
    qo_lens: np.ndarray     # [B]
    kv_lens: np.ndarray     # [B] keys per request (paged: page_size * (pages - 1) + last_page_len)
    kv_bases: np.ndarray    # [B] first page-table entry (paged) or first KV row (ragged) of each request
    max_page: int = -1      # largest page id the plan uses (-1: none); run() checks it against the cache
    num_page_ids: int = 0   # paged: indptr[-1], the page-table entries the kernels read
    total_kv: int = 0       # ragged: kv_indptr[-1]
    max_qo_len: int | None = None   # the longest request's query rows, where the reader computed it
    causal_ok: bool | None = None   # every qo_len <= kv_len, where the reader checked it (check_causal)

    def longest_qo(self) -> int:
        return self.max_qo_len if self.max_qo_len is not None else int(self.qo_lens.max(initial=0))

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    @property
    def total_q(self) -> int:
        return int(self.qo_indptr[-1])


def check_meta(name: str, t: Any, device: torch.device, length: int | None = None) -> torch.Tensor:
    """plan() metadata: int32, 1-D, on the host or on ``device``, ``length`` elements when given."""
    if (type(t) is torch.Tensor and t.dtype is torch.int32 and t.dim() == 1 and (t.is_cpu or t.device == device)
            and (length is None or t.numel() == length)):
        return t    # the common case, without building the messages' arguments
    return check_metadata(name, t, device, length, host_ok=True)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Checked metadata -> host tensors: CPU ones as they are, device ones in one device-to-host copy (the one
    synchronization plan() makes for device metadata; 0-d tensors come back as one element)."""
    on_device = [t for t in tensors if t.device.type != "cpu"]
    if not on_device:
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in on_device]).cpu()
    parts = iter(torch.split(flat, [t.numel() for t in on_device]))
    return [t if t.device.type == "cpu" else next(parts) for t in tensors]


_ARANGE: dict[torch.device, torch.Tensor] = {}  # device -> 0, 1, 2, ... (int32), grown when needed


def device_page_range(indices: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """What the host needs to range the page ids a plan uses, ``indices[:indptr[-1]]``, as tensors on indices'
    device, so that the one device-to-host copy of the metadata (to_host) carries them: the page ids themselves,
    ``(ids,)``, up to RAW_PAGE_IDS of them, else their (min, max) as 0-d tensors; None where there is nothing
    to range over (no entries or an empty indptr: the checks that follow say what is wrong). With indptr on the
    device its last entry is not known on the host yet: the entries past it are masked to ``indices[0]`` (a used
    entry whenever any is used), so garbage past the used part never counts. Any int32 values are safe here: they
    are checked on the host afterwards (read_paged), and the range is read only for 0 < indptr[-1] <= numel."""
    n = indices.numel()
    if n == 0 or indptr.numel() == 0:
        return None
    if indptr.device.type == "cpu":
        used = min(int(indptr[-1]), n)
        if used <= 0:
            return None
        if used <= RAW_PAGE_IDS:
            return (indices[:used],)
        return torch.aminmax(indices[:used])
    if n <= RAW_PAGE_IDS:
        return (indices,)
    return masked_range(indices, indptr[-1])


# Up to this many device page ids travel to the host themselves, in the one copy of the metadata, and are ranged
# there (no reduction on the device: each torch call costs the host more than copying 256 KiB); more are reduced
# to their min and max on the device first.
RAW_PAGE_IDS = 1 << 16


def masked_range(indices: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of ``indices[:end]`` for a 0-d ``end`` on indices' device, 0 < end <= numel, without reading
    ``end`` (no synchronization): the entries past it count as ``indices[0]``."""
    n = indices.numel()
    arange = _ARANGE.get(indices.device)
    if arange is None or arange.numel() < n:
        arange = _ARANGE[indices.device] = torch.arange(max(n, 1024), dtype=torch.int32, device=indices.device)
    return torch.aminmax(torch.where(arange[:n] < end, indices, indices[:1]))


def _explain_indptr(name: str, v: list[int]) -> None:
    if not v or v[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {v[0] if v else 'an empty tensor'}")
    for i in range(len(v) - 1):
        if v[i + 1] < v[i]:
            raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}]={v[i + 1]} < {name}[{i}]={v[i]} "
                             f"(request {i})")


def check_indptr(name: str, values) -> None:
    """indptr[0] == 0 and non-decreasing (a list or a numpy array)."""
    if isinstance(values, np.ndarray):
        ok = values.size > 0 and values[0] == 0 and not (values[1:] < values[:-1]).any()
    else:
        ok = bool(values) and values[0] == 0 and all(a <= b for a, b in zip(values, values[1:]))
    if not ok:
        _explain_indptr(name, values.tolist() if isinstance(values, np.ndarray) else list(values))


def _values(t: torch.Tensor):
    """A host int32 tensor's values: a list (small) or an int64 array (strided views read right either way)."""
    return t.tolist() if t.numel() <= SMALL + 1 else t.numpy().astype(np.int64)


def _array(v) -> np.ndarray:
    return v if isinstance(v, np.ndarray) else np.array(v, dtype=np.int64)


def read_qo_indptr(name: str, t: torch.Tensor) -> np.ndarray:
    """A host qo_indptr (checked by check_meta) -> its values."""
    if t.numel() < 1:
        raise ValueError(f"{name} must have batch_size + 1 >= 1 elements, got an empty tensor")
    qo = _values(t)
    check_indptr(name, qo)
    if qo[-1] > MAX_QO_ROWS:
        raise ValueError(f"{name}[-1]={int(qo[-1])} query rows is more than one plan takes ({MAX_QO_ROWS}); plan "
                         "the batch in parts")
    return _array(qo)


def _explain_kv_lens(name: str, kv_lens: list[int]) -> None:
    i = next(i for i, k in enumerate(kv_lens) if k > MAX_KV_LEN)
    raise ValueError(f"{name}: request {i} has a KV length of {kv_lens[i]}, more than the {MAX_KV_LEN} tokens a "
                     "request may have (the kernels index tokens with int32)")


def _explain_last(n_last: str, kvp: list[int], last: list[int], page_size: int) -> None:
    for i, l in enumerate(last):
        pages = kvp[i + 1] - kvp[i]
        if not pages and l != 0:
            raise ValueError(f"{n_last}[{i}]={l} but request {i} has no pages; it must be 0 there (an empty history)")
        if pages and not 1 <= l <= page_size:
            raise ValueError(f"{n_last}[{i}]={l} is outside 1..page_size={page_size} (request {i} has {pages} pages)")
    raise AssertionError("no request breaks the last_page_len rule")


def _paged_lengths(names: tuple[str, str, str], kvp, last, page_size: int):
    """(kv lengths, the KV length rule holds) of a valid indptr and a last_page_len, lists or arrays."""
    n_indptr, _, n_last = names
    if isinstance(kvp, np.ndarray):
        last = np.asarray(last, dtype=np.int64)
        pages = kvp[1:] - kvp[:-1]
        some = pages > 0                                   # a request with pages needs 1 <= last <= page_size,
        if ((last < some) | (last > page_size * some)).any():   # one without pages last == 0
            _explain_last(n_last, kvp.tolist(), last.tolist(), page_size)
        kv_lens = page_size * (pages - some) + last
        # a request's KV length is at most page_size x indptr[-1] (indptr checked): only then is the max needed
        if page_size * int(kvp[-1]) > MAX_KV_LEN and kv_lens.max() > MAX_KV_LEN:
            _explain_kv_lens(n_indptr, kv_lens.tolist())
        return kv_lens
    kv_lens = []
    for i, l in enumerate(last):
        pages = kvp[i + 1] - kvp[i]
        if (not 1 <= l <= page_size) if pages else l:
            _explain_last(n_last, kvp, last, page_size)
        kv_lens.append(page_size * (pages - 1) + l if pages else 0)
    if kv_lens and max(kv_lens) > MAX_KV_LEN:
        _explain_kv_lens(n_indptr, kv_lens)
    return np.array(kv_lens, dtype=np.int64)


def _page_id_range(n_indices: str, indices: torch.Tensor, used: int, kvp, page_range=None) -> int:
    """The largest page id of the first ``used`` entries (-1: none); a negative one is an error. Host page ids are
    read without a copy; device ones through ``page_range`` (device_page_range's min and max, copied to the host
    with the rest of the metadata), else with a synchronizing read of their min and max."""
    if not used:
        return -1
    if page_range is not None:  # device page ids' (min, max)
        lo, hi = int(page_range[0]), int(page_range[1])
    elif indices.device.type == "cpu":
        ids = indices[:used]
        if used <= 4 * SMALL:
            ids = ids.tolist()
            lo, hi = min(ids), max(ids)
        else:
            ids = ids.numpy()
            lo, hi = int(ids.min()), int(ids.max())
    else:
        lo, hi = (int(x) for x in torch.stack(torch.aminmax(indices[:used])).tolist())
    if lo < 0:
        ids = indices[:used].tolist()
        k = next(j for j, p in enumerate(ids) if p < 0)
        req = next(i for i in range(len(kvp) - 1) if kvp[i] <= k < kvp[i + 1])
        raise ValueError(f"{n_indices}[{k}]={ids[k]} is not a valid page id (request {req}); page ids must be >= 0 "
                         "and < the number of pages in the cache")
    return hi


def _host_ids(indices: torch.Tensor, page_range):
    """(indices, page_range) with device page ids that device_page_range copied to the host themselves taken as
    host page ids (page_range None); a (min, max) range stays as it is."""
    if page_range is not None and len(page_range) == 1:
        return page_range[0], None
    return indices, page_range


def read_paged(names: tuple[str, str, str], qo: np.ndarray, indptr: torch.Tensor, indices: torch.Tensor,
               last_page_len: torch.Tensor, *, page_size: int, page_range=None) -> Batch:
    """A page table (indptr [B+1] and last_page_len [B] on the host, indices anywhere; all checked by check_meta)
    and the query rows qo [B+1] -> the Batch. ``page_range``: device_page_range's result, copied to the host:
    the page ids themselves (then read as host ones) or their (min, max). Host page ids are read by the compiled
    reader where it is built (the same checks; a table it refuses is read again here, for the message)."""
    b = indptr.numel() - 1
    indices, page_range = _host_ids(indices, page_range)
    if page_range is None and indices.device.type == "cpu" and b >= 0 and knobs.NATIVE.get() and _cplan is not None:
        kv_lens, kv_bases = np.empty(b, dtype=np.int64), np.empty(b, dtype=np.int64)
        status, used, max_page = _cplan.read_paged(indptr.numpy(), last_page_len.numpy(), indices.numpy(), page_size,
                                                   MAX_KV_LEN, kv_lens, kv_bases)
        if not status:  # else a rule is broken: the reader below says which, in its words
            return Batch(qo_indptr=qo, qo_lens=qo[1:] - qo[:-1], kv_lens=kv_lens, kv_bases=kv_bases,
                         max_page=max_page, num_page_ids=used)
    n_indptr, n_indices, _ = names
    kvp = _values(indptr)
    check_indptr(n_indptr, kvp)
    used = int(kvp[-1])
    if used > indices.numel():
        raise ValueError(f"{n_indices} has {indices.numel()} entries but {n_indptr}[-1]={used}")
    kv_lens = _paged_lengths(names, kvp, _values(last_page_len), page_size)
    max_page = _page_id_range(n_indices, indices, used, kvp, page_range)
    kvp = _array(kvp)
    return Batch(qo_indptr=qo, qo_lens=qo[1:] - qo[:-1], kv_lens=kv_lens, kv_bases=kvp[:-1], max_page=max_page,
                 num_page_ids=used)


def read_prefill(qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                 *, page_size: int, page_range=None) -> Batch | None:
    """A prefill plan's host metadata (qo_indptr, then the page table) in one compiled call (cplan.c read_prefill):
    read_qo_indptr's and read_paged's checks, the longest request and the causal rule read on the way. None where
    the compiled core is not built or off, where the page ids are reduced on the device, or where a rule is broken:
    the caller then reads through read_qo_indptr and read_paged, which raise the error in their words."""
    indices, page_range = _host_ids(indices, page_range)
    if page_range is not None or _cplan is None or indices.device.type != "cpu" or not knobs.NATIVE.get():
        return None
    b = qo_indptr.numel() - 1
    if b < 0:
        return None
    qo, qo_lens = np.empty(b + 1, dtype=np.int64), np.empty(b, dtype=np.int64)
    kv_lens, kv_bases = np.empty(b, dtype=np.int64), np.empty(b, dtype=np.int64)
    status, used, max_page, max_qo, causal_ok = _cplan.read_prefill(
        qo_indptr.numpy(), indptr.numpy(), last_page_len.numpy(), indices.numpy(), page_size, MAX_KV_LEN, MAX_QO_ROWS,
        qo, qo_lens, kv_lens, kv_bases)
    if status:
        return None
    return Batch(qo_indptr=qo, qo_lens=qo_lens, kv_lens=kv_lens, kv_bases=kv_bases, max_page=max_page,
                 num_page_ids=used, max_qo_len=max_qo, causal_ok=bool(causal_ok))


def read_ragged(name: str, qo: np.ndarray, kv_indptr: torch.Tensor) -> Batch:
    kvp = _values(kv_indptr)
    check_indptr(name, kvp)
    kvp = _array(kvp)
    kv_lens = kvp[1:] - kvp[:-1]
    if kv_lens.size and kv_lens.max() > MAX_KV_LEN:
        _explain_kv_lens(name, kv_lens.tolist())
    return Batch(qo_indptr=qo, qo_lens=qo[1:] - qo[:-1], kv_lens=kv_lens, kv_bases=kvp[:-1], total_kv=int(kvp[-1]))


def check_causal(qo_name: str, kv_names: str, batch: Batch) -> None:
    """causal=True: every request's query rows are among its keys (qo_len <= kv_len)."""
    if batch.causal_ok:
        return
    if batch.batch_size and (batch.qo_lens > batch.kv_lens).any():
        i = int(np.flatnonzero(batch.qo_lens > batch.kv_lens)[0])
        raise ValueError(f"{qo_name}: request {i} has {int(batch.qo_lens[i])} query rows but a KV length of "
                         f"{int(batch.kv_lens[i])} ({kv_names}); with causal=True the KV length must include the "
                         "query tokens (qo_len <= kv_len)")


def dense_page_ids(indices: torch.Tensor) -> torch.Tensor:
    """The page ids as the kernels read them: dense int32 (a strided view is copied; plan() may copy)."""
    return indices if indices.is_contiguous() else indices.contiguous()
