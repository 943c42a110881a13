"""The fuzzer's oracle: which arguments of a call break the contracts (the seed's metadata rules, DESIGN.md, the
documented limits), written from those rules alone: plain Python over ``tolist()`` values, no attnjit code.

Each function returns the set of argument names that break a rule: empty means the call is valid. An invalid call
must raise an error naming one of them; a valid one must succeed (plan) or get as far as needing a GPU (run,
append, merge). Where a rule depends on an argument that is itself broken (a length checked against a batch size
that cannot be read), the dependent rule is skipped: the broken argument is already in the set.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

# The documented limits (attnjit.ops.planner's docstring; a test checks they match the implementation's).
MAX_HEADS, MAX_GROUP, MAX_QO_ROWS, MAX_KV_LEN, MAX_WORK_ITEMS = 1024, 64, 1 << 24, 1 << 30, 1 << 20
INT32_MAX = (1 << 31) - 1
HEAD_DIMS = (64, 128, 256)
F32_TINY, F32_MAX = 2.0 ** -126, 3.4028234663852886e38
DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# --- values -------------------------------------------------------------------------------------------------

def is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_real(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def is_flag(v: Any) -> bool:
    return isinstance(v, (bool, np.bool_))


def dtype_of(v: Any) -> torch.dtype | None:
    """The 16-bit float type a dtype argument names, or None."""
    if isinstance(v, torch.dtype):
        return v if v in (torch.float16, torch.bfloat16) else None
    if isinstance(v, str):
        return DTYPE_NAMES.get(v.strip().lower().removeprefix("torch."))
    return None


def int32_meta(t: Any, device: torch.device) -> bool:
    """An int32 1-D tensor on the host or on ``device``."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1
            and t.device.type in ("cpu", device.type) and (t.device.type == "cpu" or t.device == device))


def dense(t: torch.Tensor) -> bool:
    return t.numel() <= 1 or t.stride(0) == 1


def indptr_ok(v: list[int]) -> bool:
    return len(v) >= 1 and v[0] == 0 and all(b >= a for a, b in zip(v, v[1:]))


def distinct_addresses(t: torch.Tensor) -> bool:
    """Every element of t at its own address. Exact: a dim of stride 0 and more than one element repeats; strides
    that, sorted, each reach past everything the smaller ones span cannot repeat; otherwise the addresses are
    counted (small tensors)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    if any(st == 0 for st, _ in dims):
        return False
    extent, nested = 1, True
    for st, sz in dims:
        nested = nested and st >= extent
        extent += st * (sz - 1)
    if nested:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets[..., None] + torch.arange(size, dtype=torch.int64) * stride
    flat = offsets.reshape(-1)
    return flat.unique().numel() == flat.numel()


def vectors_ok(t: torch.Tensor) -> bool:
    """Last dim contiguous; data pointer and the strides of dims with more than one element 16-byte multiples."""
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(t.stride(d) * es % 16 == 0 for d in range(t.dim() - 1) if t.shape[d] > 1))


# --- plan() ---------------------------------------------------------------------------------------------------

def _scalars(a: dict, kind: str, bad: set) -> None:
    hq, hkv = a["num_qo_heads"], a["num_kv_heads"]
    if not (is_int(hq) and 1 <= hq <= MAX_HEADS):
        bad.add("num_qo_heads")
    if not (is_int(hkv) and 1 <= hkv <= MAX_HEADS):
        bad.add("num_kv_heads")
    if not bad & {"num_qo_heads", "num_kv_heads"} and (hq % hkv or hq // hkv > MAX_GROUP):
        bad |= {"num_qo_heads", "num_kv_heads"}
    dim_name = "head_dim" if kind == "decode" else "head_dim_qk"
    hd = a[dim_name]
    if not (is_int(hd) and hd in HEAD_DIMS):
        bad.add(dim_name)
    if a.get("head_dim_vo") is not None and a["head_dim_vo"] != hd:
        bad.add("head_dim_vo")
    if kind != "ragged":
        ps = a["page_size"]
        if not (is_int(ps) and 1 <= ps <= 1024):  # any size (issue 14), not only powers of two
            bad.add("page_size")
    q = dtype_of(a.get("q_data_type", "float16"))
    if q is None:
        bad.add("q_data_type")
    kv_name, kv = "kv_data_type", a.get("kv_data_type")
    if kv is None and a.get("data_type") is not None:
        kv_name, kv = "data_type", a["data_type"]
    if kv is not None and (dtype_of(kv) is None or (q is not None and dtype_of(kv) != q)):
        bad.add(kv_name)
    if a.get("o_data_type") is not None and dtype_of(a["o_data_type"]) is None:
        bad.add("o_data_type")
    if "causal" in a and not is_flag(a["causal"]):
        bad.add("causal")
    s = a.get("sm_scale")
    if s is not None and not (is_real(s) and math.isfinite(s) and s > 0 and F32_TINY <= s * 1.4426950408889634
                              <= F32_MAX):
        bad.add("sm_scale")
    cap = a.get("logits_soft_cap")
    if cap is not None and not (is_real(cap) and (cap == 0 or (math.isfinite(cap) and F32_TINY <= cap <= F32_MAX
                                                                and 1 / cap >= F32_TINY))):
        bad.add("logits_soft_cap")
    w = a.get("window_left", -1)
    if w is not None and not (is_int(w) and (w == -1 or 0 <= w <= INT32_MAX)):
        bad.add("window_left")
    mode = a.get("pos_encoding_mode", "NONE")
    if mode not in ("NONE", "ALIBI", "ROPE_LLAMA") or not isinstance(mode, str):
        bad.add("pos_encoding_mode")
    for name in ("rope_scale", "rope_theta"):  # checked whatever the mode (FlashInfer ignores them without RoPE)
        x = a.get(name)
        if x is not None and not (is_real(x) and math.isfinite(x) and x > 0):
            bad.add(name)
    f = a.get("fixed_split_size")
    if f is not None and not (is_int(f) and 1 <= f <= MAX_KV_LEN):
        bad.add("fixed_split_size")
    d = a.get("disable_split_kv", False)
    if d is not None and not is_flag(d):
        bad.add("disable_split_kv")
    if not is_flag(a.get("non_blocking", True)):
        bad.add("non_blocking")
    for name in ("block_tables", "seq_lens", "unknown_option"):
        if a.get(name) is not None:
            bad.add(name)
    if a.get("use_fp16_qk_reduction", False) is not False:
        bad.add("use_fp16_qk_reduction")


NAMES = {"paged": ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
         "decode": (None, "indptr", "indices", "last_page_len"),
         "ragged": ("qo_indptr", "kv_indptr", None, None)}


def plan_violations(kind: str, a: dict, device: torch.device, lengths: dict | None = None) -> set[str]:
    """kind: paged | decode | ragged; a: plan()'s keyword arguments. ``lengths`` (optional) receives the query
    and KV lengths of the requests where they can be read."""
    bad: set[str] = set()
    _scalars(a, kind, bad)
    n_qo, n_indptr, n_indices, n_last = NAMES[kind]
    ps = a.get("page_size") if "page_size" not in bad else None
    # the batch size: qo_indptr (prefill) or indptr (decode)
    qo = None
    if n_qo is not None:
        if int32_meta(a[n_qo], device) and a[n_qo].numel() >= 1:
            qo = a[n_qo].tolist()
            if not indptr_ok(qo) or qo[-1] > MAX_QO_ROWS:
                bad.add(n_qo)
                qo = None
        else:
            bad.add(n_qo)
    batch = len(qo) - 1 if qo is not None else None
    kvp = None
    if int32_meta(a[n_indptr], device) and a[n_indptr].numel() >= 1:
        kvp = a[n_indptr].tolist()
        if kind == "decode":
            batch = len(kvp) - 1
        if (batch is not None and len(kvp) != batch + 1) or not indptr_ok(kvp):
            bad.add(n_indptr)
            kvp = None
    else:
        bad.add(n_indptr)
    kv_lens = None
    if kind == "ragged":
        if kvp is not None:
            kv_lens = [b - a_ for a_, b in zip(kvp, kvp[1:])]
    else:
        last = None
        if int32_meta(a[n_last], device) and (batch is None or a[n_last].numel() == batch):
            last = a[n_last].tolist()
        else:
            bad.add(n_last)
        ids_ok = int32_meta(a[n_indices], device)
        if not ids_ok:
            bad.add(n_indices)
        if kvp is not None and ids_ok and kvp[-1] > a[n_indices].numel():
            bad |= {n_indices, n_indptr}
        elif kvp is not None and ids_ok and kvp[-1] and int(a[n_indices][:kvp[-1]].min()) < 0:
            bad.add(n_indices)
        if kvp is not None and last is not None and ps is not None and len(last) == len(kvp) - 1:
            kv_lens = []
            for i in range(len(last)):
                pages = kvp[i + 1] - kvp[i]
                if (pages == 0 and last[i] != 0) or (pages > 0 and not 1 <= last[i] <= ps):
                    bad.add(n_last)
                kv_lens.append(ps * (pages - 1) + last[i] if pages else 0)
    if kv_lens is not None and any(k > MAX_KV_LEN for k in kv_lens):
        bad |= {n_indptr, n_last} - {None}
    # a decode request with an empty history is valid (its rows are 0, lse -inf), as in FlashInfer (issue 14)
    masks = [m for m in ("custom_mask", "packed_custom_mask") if a.get(m) is not None]
    if kind == "decode" and kv_lens is not None:
        qo = list(range(len(kv_lens) + 1))
    if qo is not None and kv_lens is not None and len(kv_lens) == len(qo) - 1:
        q_lens = [b - a_ for a_, b in zip(qo, qo[1:])]
        if lengths is not None:
            lengths.update(qo_lens=q_lens, kv_lens=kv_lens)
        sizes = [q * k for q, k in zip(q_lens, kv_lens)]
        if a.get("custom_mask") is not None:
            m = a["custom_mask"]
            if not (isinstance(m, torch.Tensor) and m.dtype == torch.bool and m.numel() == sum(sizes)
                    and m.device == device):
                bad.add("custom_mask")
        elif a.get("packed_custom_mask") is not None:
            m = a["packed_custom_mask"]
            if not (isinstance(m, torch.Tensor) and m.dtype == torch.uint8
                    and m.numel() == sum((s + 7) // 8 for s in sizes) and m.device == device):
                bad.add("packed_custom_mask")
        if is_flag(a.get("causal")) and a["causal"] and not masks and any(q > k for q, k in zip(q_lens, kv_lens)):
            bad |= {"causal", n_qo}
    return bad


# --- run() ----------------------------------------------------------------------------------------------------

def run_violations(kind: str, plan: dict, r: dict) -> set[str]:
    """plan: what the plan fixed (q_shape, q/kv/o dtype, page_size, H_kv, D, max_page, total_kv, layout); r: run()'s
    arguments (q, out, lse, return_lse and paged_kv_cache, or k and v)."""
    bad: set[str] = set()
    n, hq, d = plan["q_shape"]
    if not is_flag(r.get("return_lse", False)) or type(r.get("return_lse", False)) is not bool:
        bad.add("return_lse")
    for name, dt in (("q", plan["q_dtype"]), ("out", plan["o_dtype"])):
        t = r.get(name)
        if t is None and name == "out":
            continue
        if not (isinstance(t, torch.Tensor) and t.dtype == dt and tuple(t.shape) == (n, hq, d) and vectors_ok(t)):
            bad.add(name)
        elif name == "out" and not distinct_addresses(t):
            bad.add(name)
    lse = r.get("lse")
    if lse is not None and not (isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
                                and tuple(lse.shape) == (n, hq) and lse.is_contiguous()):
        bad.add("lse")
    if kind == "ragged":
        k, v = r["k"], r["v"]
        for name, t in (("k", k), ("v", v)):
            if not (isinstance(t, torch.Tensor) and t.dtype == plan["kv_dtype"] and t.dim() == 3
                    and t.shape[0] >= plan["total_kv"] and tuple(t.shape[1:]) == (plan["num_kv_heads"], d)
                    and vectors_ok(t)):
                bad.add(name)
        if not bad & {"k", "v"} and k.stride() != v.stride():
            bad |= {"k", "v"}
        return bad
    c = r["paged_kv_cache"]
    if isinstance(c, torch.Tensor):
        if c.dim() != 5 or c.shape[1] != 2:
            bad.add("paged_kv_cache")
            return bad
        k, v = c[:, 0], c[:, 1]
    else:
        k, v = c
        if not (k.shape == v.shape and k.stride() == v.stride() and k.dtype == v.dtype):
            bad.add("paged_kv_cache")
            return bad
    ps, heads = (k.shape[1], k.shape[2]) if plan["layout"] == "NHD" else (k.shape[2], k.shape[1])
    if not (k.dtype == plan["kv_dtype"] and ps == plan["page_size"] and heads == plan["num_kv_heads"]
            and k.shape[3] == d and (k.shape[2] <= 1 or k.stride(2) == d) and vectors_ok(k) and vectors_ok(v)
            and k.shape[0] > plan["max_page"]):
        bad.add("paged_kv_cache")
    return bad


# --- append and merge -----------------------------------------------------------------------------------------

def cache_violations(c: Any, layout: str, written: bool) -> tuple[set[str], tuple | None]:
    """A paged cache argument -> (violations, (k, v, page_size, heads, dim) when readable)."""
    if isinstance(c, torch.Tensor):
        if c.dim() != 5 or c.shape[1] != 2:
            return {"paged_kv_cache"}, None
        k, v = c[:, 0], c[:, 1]
        whole = c
    elif isinstance(c, tuple) and len(c) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in c):
        k, v = c
        if not (k.shape == v.shape and k.stride() == v.stride() and k.dtype == v.dtype and k.device == v.device):
            return {"paged_kv_cache"}, None
        whole = None
    else:
        return {"paged_kv_cache"}, None
    ps, heads = (k.shape[1], k.shape[2]) if layout == "NHD" else (k.shape[2], k.shape[1])
    dim = k.shape[3]
    ok = (k.dtype in (torch.float16, torch.bfloat16) and (k.shape[2] <= 1 or k.stride(2) == dim)
          and vectors_ok(k) and vectors_ok(v))
    if ok and written:
        if whole is not None:
            ok = distinct_addresses(whole)
        else:
            ok = distinct_addresses(k) and distinct_addresses(v) and not _shared(k, v)
    return (set() if ok else {"paged_kv_cache"}), (k, v, ps, heads, dim)


def _shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage have an element address in common."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    def addresses(t):
        offsets = torch.full((), t.storage_offset(), dtype=torch.int64)
        for size, stride in zip(t.shape, t.stride()):
            offsets = offsets[..., None] + torch.arange(size, dtype=torch.int64) * stride
        return set(offsets.reshape(-1).tolist())
    return bool(addresses(a) & addresses(b))


def append_violations(a: dict) -> set[str]:
    layout = a.get("kv_layout", "NHD")
    if layout not in ("NHD", "HND"):
        return {"kv_layout"}
    bad, parts = cache_violations(a["paged_kv_cache"], layout, written=True)
    if parts is None:
        return bad
    k, v, ps, heads, dim = parts
    if dim not in HEAD_DIMS:
        bad.add("paged_kv_cache")
    if not 1 <= ps <= 1024:
        bad.add("paged_kv_cache")
    if bad:
        return bad
    nnz = None
    for name in ("append_key", "append_value"):
        t = a[name]
        if not (isinstance(t, torch.Tensor) and t.dtype == k.dtype and t.dim() == 3
                and tuple(t.shape[1:]) == (heads, dim) and vectors_ok(t)):
            bad.add(name)
        elif name == "append_key":
            nnz = t.shape[0]
        elif nnz is not None and t.shape[0] != nnz:
            bad.add(name)
    dev = k.device
    for name in ("batch_indices", "positions"):
        t = a[name]
        if not (int32_meta(t, dev) and t.device == dev and dense(t) and (nnz is None or t.numel() == nnz)):
            bad.add(name)
    for name in ("kv_indptr", "kv_indices"):
        t = a[name]
        if not (int32_meta(t, dev) and t.device == dev and dense(t)) or (name == "kv_indptr" and t.numel() < 1):
            bad.add(name)
    last = a["kv_last_page_len"]
    batch = a["kv_indptr"].numel() - 1 if "kv_indptr" not in bad else None
    if not (int32_meta(last, dev) and last.device == dev and (batch is None or last.numel() == batch)):
        bad.add("kv_last_page_len")
    check = a.get("check", False)
    if type(check) is not bool:
        bad.add("check")
    if bad or not check or not nnz:
        return bad
    indptr = a["kv_indptr"].tolist()
    if not indptr_ok(indptr):
        return {"kv_indptr"}
    if indptr[-1] > a["kv_indices"].numel():
        return {"kv_indices", "kv_indptr"}
    lasts = last.tolist()
    lengths = []
    for i in range(batch):
        pages = indptr[i + 1] - indptr[i]
        if pages and not 1 <= lasts[i] <= ps:
            bad.add("kv_last_page_len")
        lengths.append(ps * (pages - 1) + lasts[i] if pages else 0)
    for b, p in zip(a["batch_indices"].tolist(), a["positions"].tolist()):
        if not 0 <= b < batch:
            bad.add("batch_indices")
        elif not 0 <= p < lengths[b]:
            bad.add("positions")
    used = a["kv_indices"].tolist()[:indptr[-1]]
    if used and (min(used) < 0 or max(used) >= k.shape[0]):
        bad.add("kv_indices")
    return bad


def _state_ok(v: Any, dims: int) -> bool:
    return (isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) and v.dim() == dims
            and v.shape[-1] in HEAD_DIMS and vectors_ok(v))


def merge_violations(op: str, a: dict) -> set[str]:
    """op: merge_state (v_a, s_a, v_b, s_b) | merge_state_in_place (v, s, v_other, s_other, mask) | merge_states."""
    bad: set[str] = set()
    if op == "merge_states":
        v, s = a["v"], a["s"]
        if not _state_ok(v, 4):
            return {"v"}
        if not (isinstance(s, torch.Tensor) and s.dtype == torch.float32 and tuple(s.shape) == tuple(v.shape[:3])
                and s.device == v.device):
            bad.add("s")
        return bad
    names = ("v_a", "s_a", "v_b", "s_b") if op == "merge_state" else ("v", "s", "v_other", "s_other")
    va, sa, vb, sb = (a[n] for n in names)
    if not _state_ok(va, 3):
        return {names[0]}
    if not (_state_ok(vb, 3) and vb.shape == va.shape and vb.dtype == va.dtype and vb.device == va.device):
        bad.add(names[2])
    for name, s in ((names[1], sa), (names[3], sb)):
        if not (isinstance(s, torch.Tensor) and s.dtype == torch.float32 and tuple(s.shape) == tuple(va.shape[:2])
                and s.device == va.device):
            bad.add(name)
    if op == "merge_state_in_place" and not bad:
        m = a.get("mask")
        if m is not None and not (isinstance(m, torch.Tensor) and m.dtype == torch.bool and m.dim() == 1
                                  and m.shape[0] == va.shape[0] and m.is_contiguous() and m.device == va.device):
            bad.add("mask")
        if not distinct_addresses(va):
            bad.add("v")
        if not distinct_addresses(sa):
            bad.add("s")
    return bad
