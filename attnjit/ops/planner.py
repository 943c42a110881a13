"""plan() inputs: every argument checked and the metadata read once on the host, with explicit bounds.

The wrappers' plan() call these before anything else: scalar options become checked Python values
(``PlanOptions``), metadata tensors become numpy arrays of request lengths (``Batch``). Every rule fails with a
``ValueError``/``TypeError`` (``NotImplementedError`` for FlashInfer features attnjit lacks) that names the
argument, the rule and what was received, before any allocation proportional to the input's values.

Metadata is read where it lies: a CPU tensor through ``numpy()`` (no copy, strided views included), a device
tensor with one device-to-host copy. Only the page ids are read by a kernel later, so they alone must become
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

from ..specs import MAX_GROUP_SIZE
from ._common import as_dtype, check_head_dim, check_metadata, check_page_size
from .scheduler import MAX_WORK_ITEMS

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
    """A Python or numpy real number (never a bool or a string) -> float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


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
    check_head_dim(name, as_int(name, head_dim))
    if head_dim_vo is not None and head_dim_vo != head_dim:
        raise ValueError(f"head_dim_vo={head_dim_vo!r} must equal {name}={head_dim} (not supported yet)")
    return int(head_dim)


def plan_page_size(value: Any) -> int:
    return check_page_size(as_int("page_size", value))


def plan_dtypes(q_data_type: Any, kv_data_type: Any, o_data_type: Any) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    q = as_dtype(q_data_type, "q_data_type")
    kv = as_dtype(kv_data_type, "kv_data_type") if kv_data_type is not None else q
    o = as_dtype(o_data_type, "o_data_type") if o_data_type is not None else q
    if kv != q:
        raise ValueError(f"kv_data_type={kv} must equal q_data_type={q} (mixed q/kv types are not supported yet)")
    return q, kv, o


@dataclass(frozen=True)
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

@dataclass(frozen=True)
class Batch:
    """A plan's requests, read from its metadata (numpy int64; B requests)."""

    qo_indptr: np.ndarray   # [B+1] query rows
    kv_lens: np.ndarray     # [B] keys per request (paged: page_size * (pages - 1) + last_page_len)
    kv_bases: np.ndarray    # [B] first page-table entry (paged) or first KV row (ragged) of each request
    max_page: int = -1      # largest page id the plan uses (-1: none); run() checks it against the cache
    num_page_ids: int = 0   # paged: indptr[-1], the page-table entries the kernels read
    total_kv: int = 0       # ragged: kv_indptr[-1]

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    @property
    def qo_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr)

    @property
    def total_q(self) -> int:
        return int(self.qo_indptr[-1])


def host_values(name: str, t: Any, device: torch.device, length: int | None = None) -> np.ndarray:
    """A 1-D int32 metadata tensor on the host or on ``device`` -> its values (int64; strided views read right)."""
    check_metadata(name, t, device, length, host_ok=True)
    if t.device.type == "cpu":
        return t.numpy().astype(np.int64)
    return t.cpu().numpy().astype(np.int64)  # device metadata: one device-to-host copy (it synchronizes)


def check_indptr(name: str, values: np.ndarray, what: str = "entries") -> None:
    """indptr[0] == 0, non-decreasing, indptr[-1] <= INT32_MAX (it is int32 already)."""
    if values.size == 0 or values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(values[0]) if values.size else 'an empty tensor'}")
    drops = np.flatnonzero(values[1:] < values[:-1])
    if drops.size:
        i = int(drops[0])
        raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}]={int(values[i + 1])} < {name}[{i}]="
                         f"{int(values[i])} (request {i})")


def read_qo_indptr(name: str, t: Any, device: torch.device) -> np.ndarray:
    qo = host_values(name, t, device)
    if qo.size < 1:
        raise ValueError(f"{name} must have batch_size + 1 >= 1 elements, got an empty tensor")
    check_indptr(name, qo)
    if qo[-1] > MAX_QO_ROWS:
        raise ValueError(f"{name}[-1]={int(qo[-1])} query rows is more than one plan takes ({MAX_QO_ROWS}); plan "
                         "the batch in parts")
    return qo


def _check_kv_lens(name: str, kv_lens: np.ndarray) -> None:
    over = np.flatnonzero(kv_lens > MAX_KV_LEN)
    if over.size:
        i = int(over[0])
        raise ValueError(f"{name}: request {i} has a KV length of {int(kv_lens[i])}, more than the {MAX_KV_LEN} "
                         "tokens a request may have (the kernels index tokens with int32)")


def read_paged(names: tuple[str, str, str], indptr: Any, indices: Any, last_page_len: Any, *, page_size: int,
               batch: int, device: torch.device) -> Batch:
    """Validate a page table (indptr [B+1], indices, last_page_len [B]) -> its Batch (qo_indptr left empty)."""
    n_indptr, n_indices, n_last = names
    kvp = host_values(n_indptr, indptr, device, batch + 1)
    check_metadata(n_indices, indices, device, host_ok=True)
    last = host_values(n_last, last_page_len, device, batch)
    check_indptr(n_indptr, kvp)
    used = int(kvp[-1])
    if used > indices.numel():
        raise ValueError(f"{n_indices} has {indices.numel()} entries but {n_indptr}[-1]={used}")
    pages = np.diff(kvp)
    has_pages = pages > 0
    bad = np.flatnonzero(~has_pages & (last != 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{n_last}[{i}]={int(last[i])} but request {i} has no pages; it must be 0 there (an empty "
                         "history)")
    bad = np.flatnonzero(has_pages & ((last < 1) | (last > page_size)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{n_last}[{i}]={int(last[i])} is outside 1..page_size={page_size} (request {i} has "
                         f"{int(pages[i])} pages)")
    kv_lens = np.where(has_pages, page_size * (pages - 1) + last, 0)
    _check_kv_lens(n_indptr, kv_lens)
    max_page = -1
    if used:
        if indices.device.type == "cpu":
            ids = indices.numpy()[:used]
            lo, max_page = int(ids.min()), int(ids.max())
        else:
            lo, max_page = torch.aminmax(indices[:used])
            lo, max_page = int(lo), int(max_page)   # device page ids: one synchronizing read
            ids = None
        if lo < 0:
            ids = ids if ids is not None else indices[:used].cpu().numpy()
            k = int(np.flatnonzero(ids < 0)[0])
            req = int(np.searchsorted(kvp, k, side="right") - 1)
            raise ValueError(f"{n_indices}[{k}]={int(ids[k])} is not a valid page id (request {req}); page ids "
                             "must be >= 0 and < the number of pages in the cache")
    return Batch(qo_indptr=np.zeros(0, np.int64), kv_lens=kv_lens, kv_bases=kvp[:-1], max_page=max_page,
                 num_page_ids=used)


def read_ragged(name: str, kv_indptr: Any, *, batch: int, device: torch.device) -> Batch:
    kvp = host_values(name, kv_indptr, device, batch + 1)
    check_indptr(name, kvp)
    kv_lens = np.diff(kvp)
    _check_kv_lens(name, kv_lens)
    return Batch(qo_indptr=np.zeros(0, np.int64), kv_lens=kv_lens, kv_bases=kvp[:-1], total_kv=int(kvp[-1]))


def check_causal(qo_name: str, kv_names: str, qo_indptr: np.ndarray, kv_lens: np.ndarray) -> None:
    qo_lens = np.diff(qo_indptr)
    bad = np.flatnonzero(qo_lens > kv_lens)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{qo_name}: request {i} has {int(qo_lens[i])} query rows but a KV length of "
                         f"{int(kv_lens[i])} ({kv_names}); with causal=True the KV length must include the query "
                         "tokens (qo_len <= kv_len)")


def dense_page_ids(indices: torch.Tensor) -> torch.Tensor:
    """The page ids as the kernels read them: dense int32 (a strided view is copied; plan() may copy)."""
    return indices if indices.is_contiguous() else indices.contiguous()
