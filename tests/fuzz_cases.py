"""The fuzzer's cases (tests/test_fuzz.py): mostly valid calls of every op, with zero to two fields made wrong, drawn
from a seeded random.Random. What is valid is not decided here: tests/fuzz_oracle.py says."""

from __future__ import annotations

import random

import numpy as np
import torch

from attnjit.ops.attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                                   BatchPrefillWithRaggedKVCacheWrapper)
from tests import fuzz_oracle as O

CPU = torch.device("cpu")
WORKSPACE = torch.empty(256 << 20, dtype=torch.uint8)  # a CPU plan never touches it: virtual memory only
NAN, INF = float("nan"), float("inf")

# --- tensors in every layout ----------------------------------------------------------------------------------

def laid_out(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t's values as: contiguous | column (1-D: column 0 of an [n, 2] table) | offsetN (storage offset N) | padded
    / odd (last dim padded by 8 / 1) | transposed (dims 0, 1 swapped in memory) | expanded (one row repeated)."""
    if kind == "contiguous":
        return t.clone()
    if kind == "column":
        view = torch.zeros(t.shape[0], 2, dtype=t.dtype)[:, 0]
    elif kind.startswith("offset"):
        off = int(kind[6:])
        view = torch.empty(t.numel() + off, dtype=t.dtype)[off:].view(t.shape)
    elif kind in ("padded", "odd"):
        view = torch.empty(*t.shape[:-1], t.shape[-1] + (8 if kind == "padded" else 1), dtype=t.dtype)[..., :t.shape[-1]]
    elif kind == "transposed":
        view = torch.empty(t.shape[1], t.shape[0], *t.shape[2:], dtype=t.dtype).transpose(0, 1)
    elif kind == "expanded":
        return torch.zeros(1, *t.shape[1:], dtype=t.dtype).expand(t.shape)
    else:
        raise AssertionError(kind)
    view.copy_(t)
    return view


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def retyped(t: torch.Tensor, how: str):
    """A metadata tensor made wrong in type: int64, float32, 2-D, a list, on the meta device."""
    return {"int64": lambda: t.to(torch.int64), "float32": lambda: t.to(torch.float32),
            "2d": lambda: t.reshape(1, -1), "list": lambda: t.tolist(),
            "meta": lambda: torch.empty(t.shape, dtype=torch.int32, device="meta")}[how]()


# --- plan() calls ---------------------------------------------------------------------------------------------

VALID_OPTIONS = {"sm_scale": [None, None, 0.125, 1, np.float32(0.05), 3.0],
                 "logits_soft_cap": [None, None, 0, 0.0, 30.0, 1.5],
                 "window_left": [-1, -1, None, 0, 3, 100, 2 ** 31 - 1],
                 "pos_encoding_mode": ["NONE", "NONE", "ALIBI"],
                 "fixed_split_size": [None, None, None, 1, 64, 100, 2 ** 30],
                 "disable_split_kv": [False, False, True, None], "non_blocking": [True, False]}
SCALAR_MUTATIONS = {     # (some of these values are valid on purpose: the oracle decides)
    "head_dim": [96, 0, 512, "128", 128.0, True, np.int64(128)],
    "page_size": [0, 3, 256, 1025, -16, "16", 16.0, True, np.int64(16)],
    "q_data_type": [torch.float32, torch.int32, "float8", 3, None, " FP16 "],
    "o_data_type": [torch.float32, "float64", 7, "bf16"],
    "causal": ["yes", 1, None, np.bool_(True)],
    "sm_scale": [0, -1.0, NAN, INF, True, "0.1", 1e39, 1e-45, 1e-30, np.float64(0.3)],
    "logits_soft_cap": [-1.0, NAN, INF, True, "30", 1e39, 1e-39, 1e-37, 1e38],
    "window_left": [-2, 2 ** 31, True, 4.0, "4", 2 ** 31 - 1],
    "pos_encoding_mode": ["ROPE_LLAMA", "ROPE_GPTJ", 0, None, "alibi"],
    "fixed_split_size": [0, -1, True, 128.0, 2 ** 31, "64", np.int64(64)],
    "disable_split_kv": ["no", 1, 0.0, np.bool_(False)],
    "non_blocking": ["yes", None, 0],
}
EXTRA_OPTIONS = [{"rope_scale": 1.0}, {"rope_theta": 1e4}, {"rope_theta": -1.0}, {"rope_scale": "2"},
                 {"use_fp16_qk_reduction": True}, {"unknown_option": 3},
                 {"unknown_option": None}, {"rope_scale": None}, {"use_fp16_qk_reduction": np.bool_(False)}]
_COMMON = ["heads", "head_dim", "q_data_type", "kv_data_type", "o_data_type", "sm_scale", "logits_soft_cap",
           "window_left", "pos_encoding_mode", "fixed_split_size", "disable_split_kv", "non_blocking", "extra",
           "kv_type", "kv_values", "huge"]
MUTATIONS = {
    "paged": _COMMON + ["head_dim_vo", "page_size", "causal", "qo_type", "qo_values", "ids_type", "ids_values",
                        "last_type", "last_values", "causal_violation", "mask"],
    "decode": _COMMON + ["page_size", "data_type", "ids_type", "ids_values", "last_type", "last_values",
                         "empty_history"],
    "ragged": _COMMON + ["head_dim_vo", "causal", "qo_type", "qo_values", "causal_violation", "mask"],
}
META_LAYOUTS = ["contiguous", "contiguous", "contiguous", "column", "offset3"]


def draw_plan(rng: random.Random, kind: str) -> dict:
    """plan() keyword arguments of one mostly valid call of ``kind``."""
    mutate = set(rng.sample(MUTATIONS[kind], rng.choice([1, 2]))) if rng.random() < 0.5 else set()
    hkv = rng.choice([1, 2, 4, 8])
    hq = hkv * rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 64])
    hd = rng.choice([64, 128, 256])
    ps = rng.choice([1, 2, 4, 8, 16, 32, 64, 128]) if kind != "ragged" else None
    q_dt = rng.choice([torch.float16, torch.bfloat16, "float16", "bfloat16", "bf16", "half", "torch.bfloat16"])
    causal = rng.random() < 0.5 if kind != "decode" else False
    batch = rng.randint(1 if kind == "decode" else 0, 8) if rng.random() < 0.8 else rng.randint(17, 60)  # both
    # of plan()'s metadata paths: lists up to planner.SMALL requests, numpy arrays above
    lo = 1 if kind == "decode" else 0
    kv_lens = [rng.randint(lo, 700) if rng.random() < 0.8 else rng.choice([1, 2, 15, 16, 17, 2000, 5000])
               for _ in range(batch)]
    qo_lens = [1] * batch if kind == "decode" else [rng.randint(0, min(k, 200) if causal else 200) for k in kv_lens]
    a: dict = {"num_qo_heads": hq, "num_kv_heads": hkv, ("head_dim" if kind == "decode" else "head_dim_qk"): hd,
               "q_data_type": q_dt}
    if ps is not None:
        a["page_size"] = ps
    for name, values in VALID_OPTIONS.items():
        a[name] = rng.choice(values)
    a["kv_data_type"] = rng.choice([None, O.dtype_of(q_dt)])
    a["o_data_type"] = rng.choice([None, None, torch.float16, torch.bfloat16])
    if kind != "decode":
        a["causal"] = causal
    if "heads" in mutate:
        a["num_qo_heads"], a["num_kv_heads"] = rng.choice([
            (hq + 1, hkv) if hkv > 1 else (3, 2), (hq, 0), (-4, 1), (2048, 2048), (130, 2), (float(hq), hkv),
            (hq, True), ("32", 8), (np.int64(hq), np.int32(hkv)), (1024, 16), (1025, 1)])
    for name, values in SCALAR_MUTATIONS.items():
        key = ("head_dim" if kind == "decode" else "head_dim_qk") if name == "head_dim" else name
        if name in mutate and key in a:
            a[key] = rng.choice(values)
    if "head_dim_vo" in mutate:
        a["head_dim_vo"] = rng.choice([None, hd, 64 if hd != 64 else 128, "x"])
    if "kv_data_type" in mutate:
        other = torch.bfloat16 if O.dtype_of(q_dt) == torch.float16 else torch.float16
        a["kv_data_type"] = rng.choice([other, torch.float32, "x", 5])
    if "data_type" in mutate:
        a["kv_data_type"] = None
        a["data_type"] = rng.choice([torch.bfloat16, "float16", torch.float32, "x"])
    if "extra" in mutate:
        a.update(rng.choice(EXTRA_OPTIONS + ([{"block_tables": i32([1])}, {"seq_lens": None}]
                                             if kind == "decode" else [])))
    if "causal_violation" in mutate and batch:
        a["causal"] = True
        i = rng.randrange(batch)
        qo_lens[i] = kv_lens[i] + rng.randint(1, 3)
    if "empty_history" in mutate:
        kv_lens[rng.randrange(batch)] = 0
    _metadata(rng, kind, a, qo_lens, kv_lens, ps, mutate)
    if "huge" in mutate:
        a["fixed_split_size"] = None  # an auto split of 2**30 keys always fits; a fixed one might not
    if "mask" in mutate:
        _mask(rng, a, qo_lens, kv_lens)
    _fit_the_workspace(kind, a)
    return a


def _metadata(rng, kind, a, qo_lens, kv_lens, ps, mutate) -> None:
    n_qo, n_indptr, n_indices, n_last = O.NAMES[kind]
    qo = [0]
    for q in qo_lens:
        qo.append(qo[-1] + q)
    if kind == "ragged":
        kvp = [0]
        for k in kv_lens:
            kvp.append(kvp[-1] + k)
        if "huge" in mutate:
            qo, kvp = [0, 1], [0, rng.choice([O.MAX_KV_LEN, O.MAX_KV_LEN + 1, 2 ** 31 - 1])]
        tensors = {n_qo: qo, n_indptr: kvp}
    else:
        pages = [-(-k // ps) if k else 0 for k in kv_lens]
        spare = rng.randint(0, 3)
        ids = list(range(sum(pages) + spare))
        rng.shuffle(ids)
        kvp, last = [0], []
        for n, k in zip(pages, kv_lens):
            kvp.append(kvp[-1] + n)
            last.append(k - ps * (n - 1) if n else 0)
        tensors = {n_indptr: kvp, n_indices: ids, n_last: last}
        if n_qo is not None:
            tensors[n_qo] = qo
        if "huge" in mutate:  # one request of MAX_KV_LEN (+1) keys; its page ids an expanded view (no memory)
            a["page_size"] = 128
            n = O.MAX_KV_LEN // 128 + rng.choice([0, 1])
            tensors.update({n_indptr: [0, n], n_last: [128]})
            if n_qo is not None:
                tensors[n_qo] = [0, 1]
            a[n_indices] = torch.zeros(1, dtype=torch.int32).expand(n)
            tensors.pop(n_indices)
    for mut, name in (("qo_values", n_qo), ("kv_values", n_indptr), ("ids_values", n_indices),
                      ("last_values", n_last)):
        if mut in mutate and name in tensors:
            tensors[name] = _bad_values(rng, mut, tensors[name], a.get("page_size"))
    for name, values in tensors.items():
        a[name] = laid_out(i32(values), rng.choice(META_LAYOUTS)) if values else i32(values)
    for mut, name in (("qo_type", n_qo), ("kv_type", n_indptr), ("ids_type", n_indices), ("last_type", n_last)):
        if mut in mutate and name is not None and isinstance(a.get(name), torch.Tensor):
            a[name] = retyped(a[name], rng.choice(["int64", "float32", "2d", "list", "meta"]))


def _bad_values(rng, mut: str, v: list[int], ps) -> list[int]:
    v = list(v)
    how = rng.choice(["first", "drop", "extra", "decrease", "negative", "big"])
    if how == "first" and v:
        v[0] = 1 if v[0] == 0 else 0
    elif how == "drop" and v:
        v.pop()
    elif how == "extra":
        v.append(v[-1] if v else 0)
    elif how == "decrease" and len(v) >= 2:
        v[-1], v[-2] = v[-2] - 1, v[-1]
    elif how == "negative" and v:
        v[rng.randrange(len(v))] = -1
    elif how == "big" and v:
        if mut == "last_values":
            v[rng.randrange(len(v))] = (ps if O.is_int(ps) else 1) + rng.choice([0, 1])
        elif mut == "qo_values":
            v[1:] = [2 ** 31 - 1] * (len(v) - 1)
        elif mut == "ids_values":
            v.append(-5)   # a negative id past the used entries: never read, valid
        else:
            v[-1] = min(v[-1] + rng.randint(1, 3), O.INT32_MAX)
    return v


def _fit_the_workspace(kind, a) -> None:
    """Keep a fixed split within the workspace and the work-item limit, by bounds that do not depend on the tile
    (chunks are at least 32 tokens, q tiles at least 16 packed rows): the oracle has no tile to predict them by."""
    f = a.get("fixed_split_size")
    hq, hkv = a["num_qo_heads"], a["num_kv_heads"]
    hd = a.get("head_dim", a.get("head_dim_qk"))
    lengths: dict = {}
    O.plan_violations(kind, a, CPU, lengths)
    if not (O.is_int(f) and f >= 1 and O.is_int(hq) and O.is_int(hkv) and hkv > 0 and O.is_int(hd) and lengths):
        return
    chunk = max(int(f), 32)
    qo_lens, kv_lens = lengths["qo_lens"], lengths["kv_lens"]
    slots = sum(q * -(-k // chunk) for q, k in zip(qo_lens, kv_lens) if k > chunk)
    group = max(1, hq // hkv)
    items = sum(-(-(q * group) // 16) * max(1, -(-k // chunk)) for q, k in zip(qo_lens, kv_lens) if q)
    if slots * hq * (hd + 1) * 4 > WORKSPACE.numel() or items > O.MAX_WORK_ITEMS:
        a["fixed_split_size"] = None


def _mask(rng, a, qo_lens, kv_lens) -> None:
    sizes = [q * k for q, k in zip(qo_lens, kv_lens)]
    n = sum(sizes)
    if n > 200_000:
        return
    how = rng.choice(["bool", "bool_column", "packed", "wrong_size", "uint8_as_bool", "meta"])
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    if how == "bool":
        a["custom_mask"] = mask
    elif how == "bool_column":
        a["custom_mask"] = torch.stack([mask, ~mask], 1)[:, 0]
    elif how == "packed":
        a["packed_custom_mask"] = torch.zeros(sum((s + 7) // 8 for s in sizes), dtype=torch.uint8)
    elif how == "wrong_size":
        a["custom_mask"] = torch.ones(n + 1, dtype=torch.bool)
    elif how == "uint8_as_bool":
        a["custom_mask"] = mask.to(torch.uint8)
    else:
        a["custom_mask"] = torch.empty(n, dtype=torch.bool, device="meta")


WRAPPERS = {"paged": BatchPrefillWithPagedKVCacheWrapper, "decode": BatchDecodeWithPagedKVCacheWrapper,
            "ragged": BatchPrefillWithRaggedKVCacheWrapper}


def dense_copy(a: dict) -> dict:
    """Every CPU tensor argument as a fresh dense tensor of its values (expanded page ids stay as they are)."""
    return {k: v.clone(memory_format=torch.contiguous_format) if isinstance(v, torch.Tensor)
            and v.device.type == "cpu" and v.stride() != (0,) else v for k, v in a.items()}


def plan_facts(kind: str, a: dict, layout: str) -> dict:
    """What run() must be given, from the (valid) plan arguments alone."""
    q = O.dtype_of(a["q_data_type"])
    hd = int(a["head_dim" if kind == "decode" else "head_dim_qk"])
    rows = a["indptr"].numel() - 1 if kind == "decode" else a["qo_indptr"].tolist()[-1]
    facts = {"q_shape": (rows, int(a["num_qo_heads"]), hd), "q_dtype": q, "kv_dtype": q,
             "o_dtype": O.dtype_of(a["o_data_type"]) if a.get("o_data_type") is not None else q,
             "num_kv_heads": int(a["num_kv_heads"]), "layout": layout}
    if kind == "ragged":
        facts["total_kv"] = a["kv_indptr"].tolist()[-1]
    else:
        n_indptr, n_indices = ("indptr", "indices") if kind == "decode" else ("paged_kv_indptr", "paged_kv_indices")
        used = int(a[n_indptr][-1])
        facts["page_size"] = int(a["page_size"])
        facts["max_page"] = int(a[n_indices][:used].max()) if used else -1
    return facts


RUN_LAYOUTS = ["contiguous", "contiguous", "padded", "transposed", "offset8", "odd", "offset1"]


def draw_run(rng, kind: str, f: dict) -> dict | None:
    """run() arguments for a valid plan (small ones only: these tensors are allocated)."""
    n, hq, hd = f["q_shape"]
    if n * hq * hd > 1 << 18:
        return None
    r: dict = {"q": laid_out(torch.empty(n, hq, hd, dtype=f["q_dtype"]), rng.choice(RUN_LAYOUTS))}
    if rng.random() < 0.1:
        r["q"] = r["q"].to(torch.float32 if rng.random() < 0.5 else f["q_dtype"])[: max(n - 1, 0)]
    out = rng.choice([None, None] + RUN_LAYOUTS + ["expanded"])
    if out is not None:
        r["out"] = laid_out(torch.empty(n, hq, hd, dtype=f["o_dtype"]), out)
    lse = rng.choice([None, "contiguous", "transposed", "offset1", "short"])
    if lse == "short":
        r["lse"] = torch.empty(max(n - 1, 0), hq)
    elif lse is not None:
        r["lse"] = laid_out(torch.empty(n, hq), lse)
    r["return_lse"] = rng.choice([False, False, True, "yes"])
    hkv = f["num_kv_heads"]
    if kind == "ragged":
        rows = f["total_kv"] + rng.randint(0, 2)
        if rows * hkv * hd > 1 << 18:
            return None
        lk, lv = rng.choice(RUN_LAYOUTS), rng.choice(RUN_LAYOUTS + ["same"] * 6)
        r["k"] = laid_out(torch.empty(rows, hkv, hd, dtype=f["kv_dtype"]), lk)
        r["v"] = laid_out(torch.empty(rows, hkv, hd, dtype=f["kv_dtype"]), lk if lv == "same" else lv)
        return r
    ps = f["page_size"]
    pages = f["max_page"] + 1 + rng.randint(0 if f["max_page"] >= 0 else 1, 2)
    if rng.random() < 0.1:
        pages = max(f["max_page"], 1)          # one page too few (or just small)
    if pages * 2 * ps * hkv * hd > 1 << 18:
        return None
    inner = (ps, hkv) if f["layout"] == "NHD" else (hkv, ps)
    dt = f["kv_dtype"] if rng.random() < 0.9 else rng.choice([torch.float32, torch.float16, torch.bfloat16])
    cache = torch.empty(pages, 2, *inner, hd, dtype=dt)
    how = rng.choice(["contiguous", "contiguous", "offset8", "offset1", "strided", "tuple", "padded"])
    if how == "strided":
        cache = torch.empty(2 * pages, 2, *inner, hd, dtype=dt)[::2]
    elif how == "tuple":
        cache = (cache[:, 0].clone(), cache[:, 1].clone())
    elif how != "contiguous":
        cache = laid_out(cache, how)
    r["paged_kv_cache"] = cache
    return r


# --- append and merge -----------------------------------------------------------------------------------------

CACHE_OK = ["contiguous", "contiguous", "offset8", "strided", "padded_inner", "tuple", "tuple_views"]
CACHE_KINDS = CACHE_OK + ["offset1", "padded", "tuple_same", "expanded", "float32", "page_size_3", "head_dim_96"]


def _append_cache(rng, layout, dtype, pages, ps, heads, dim, kinds):
    kind = rng.choice(kinds)
    ps = 3 if kind == "page_size_3" else ps
    dim = 96 if kind == "head_dim_96" else dim
    inner = (ps, heads) if layout == "NHD" else (heads, ps)
    shape = (pages, 2, *inner, dim)
    base = torch.zeros(shape, dtype=torch.float32 if kind == "float32" else dtype)
    if kind in ("contiguous", "float32", "page_size_3", "head_dim_96"):
        return base
    if kind in ("offset8", "offset1", "padded", "expanded"):
        return laid_out(base, kind)
    if kind == "strided":
        return torch.zeros(2 * pages, *shape[1:], dtype=dtype)[::2]
    if kind == "padded_inner":
        return torch.zeros(pages, 2, inner[0] + 1, inner[1], dim, dtype=dtype)[:, :, :inner[0]]
    if kind == "tuple":
        return base[:, 0].clone(), base[:, 1].clone()
    if kind == "tuple_views":
        return base[:, 0], base[:, 1]
    k = base[:, 0].clone()
    return k, k  # tuple_same: keys and values in one memory


APPEND_MUTATIONS = ["none"] * 10 + ["b_range", "pos_range", "indptr", "page_id", "last", "len", "meta_layout",
                                    "kv_layout", "check", "keys", "cache"]


def draw_append(rng: random.Random) -> dict:
    """append_paged_kv_cache arguments: valid layouts and values, one field (or none) drawn from its bad list."""
    layout = rng.choice(["NHD", "HND"])
    dtype = rng.choice([torch.float16, torch.bfloat16])
    ps, heads, dim = rng.choice([1, 2, 4, 8]), rng.choice([1, 2]), rng.choice([64, 64, 128])
    batch = rng.randint(1, 4)
    kv_lens = [rng.randint(0, 3 * ps) for _ in range(batch)]
    pages = [-(-k // ps) for k in kv_lens]
    total = sum(pages) + rng.randint(0, 2)
    ids = list(range(total))
    rng.shuffle(ids)
    kvp, last = [0], []
    for n, k in zip(pages, kv_lens):
        kvp.append(kvp[-1] + n)
        last.append(k - ps * (n - 1) if n else 0)
    tokens = [(b, p) for b, k in enumerate(kv_lens) for p in range(k) if rng.random() < 0.3]
    meta = {"batch_indices": [b for b, _ in tokens], "positions": [p for _, p in tokens], "kv_indptr": kvp,
            "kv_indices": ids[:kvp[-1]], "kv_last_page_len": last}
    mutate = rng.choice(APPEND_MUTATIONS)
    if mutate == "b_range" and tokens:
        meta["batch_indices"][0] = batch + rng.randint(0, 2)
    elif mutate == "pos_range" and tokens:
        meta["positions"][-1] = kv_lens[meta["batch_indices"][-1]] + rng.randint(0, 2)
    elif mutate == "indptr":
        meta["kv_indptr"][-1] += rng.randint(1, 2)
    elif mutate == "page_id" and meta["kv_indices"]:
        meta["kv_indices"][0] = total + rng.randint(0, 3)
    elif mutate == "last":
        meta["kv_last_page_len"][0] = ps + 1
    elif mutate == "len":
        name = rng.choice(["batch_indices", "positions", "kv_last_page_len"])
        meta[name] = meta[name] + [0]
    bad_meta = rng.choice(list(meta)) if mutate == "meta_layout" else None
    a: dict = {}
    for name, values in meta.items():
        t = i32(values)
        how = rng.choice(["column", "offset3", "int64"] if name == bad_meta else ["contiguous"] * 4 + ["offset3"])
        a[name] = t.to(torch.int64) if how == "int64" else laid_out(t, how) if values else t
    nnz = len(tokens)
    for name in ("append_key", "append_value"):
        t = torch.zeros(nnz, heads, dim, dtype=dtype)
        how = rng.choice(RUN_LAYOUTS + ["float32", "heads"] if mutate == "keys" else
                         ["contiguous", "contiguous", "padded", "transposed", "offset8"])
        a[name] = (t.float() if how == "float32" else torch.zeros(nnz, heads + 1, dim, dtype=dtype) if how == "heads"
                   else laid_out(t, how) if nnz else t)
    a["paged_kv_cache"] = _append_cache(rng, layout, dtype, max(total, 1), ps, heads, dim,
                                        CACHE_KINDS if mutate == "cache" else CACHE_OK)
    a["kv_layout"] = "NDH" if mutate == "kv_layout" else layout
    a["check"] = rng.choice([True, False, "yes", 1] if mutate == "check" else [True, True, False])
    return a


def draw_merge(rng: random.Random) -> tuple[str, dict]:
    op = rng.choice(["merge_state", "merge_state_in_place", "merge_states"])
    rows, heads, dim = rng.randint(0, 5), rng.randint(1, 3), rng.choice([64, 128, 128, 128, 96])
    dtype = rng.choice([torch.float16, torch.bfloat16] * 4 + [torch.float32])
    v_layouts = ["contiguous"] * 8 + ["padded", "transposed", "offset8", "odd", "offset1", "expanded"]
    s_layouts = ["contiguous"] * 8 + ["transposed", "offset1", "expanded", "short", "float16"]

    def v_of(shape):
        return laid_out(torch.zeros(shape, dtype=dtype), rng.choice(v_layouts))

    def s_of(shape):
        how = rng.choice(s_layouts)
        if how == "short":
            return torch.zeros(max(shape[0] - 1, 0), *shape[1:])
        if how == "float16":
            return torch.zeros(shape, dtype=torch.float16)
        return laid_out(torch.zeros(shape), how)
    if op == "merge_states":
        n = rng.randint(1, 3)
        return op, {"v": v_of((rows, n, heads, dim)), "s": s_of((rows, n, heads))}
    names = ("v_a", "s_a", "v_b", "s_b") if op == "merge_state" else ("v", "s", "v_other", "s_other")
    other_heads = heads if rng.random() < 0.9 else heads + 1
    a = {names[0]: v_of((rows, heads, dim)), names[1]: s_of((rows, heads)), names[2]: v_of((rows, other_heads, dim)),
         names[3]: s_of((rows, heads))}
    if op == "merge_state_in_place":
        how = rng.choice([None, None, "contiguous", "column", "offset3", "short", "uint8"])
        if how is not None and rows:
            m = torch.ones(rows, dtype=torch.bool)
            a["mask"] = (torch.ones(rows - 1, dtype=torch.bool) if how == "short" else m.to(torch.uint8)
                         if how == "uint8" else laid_out(m, how))
    return op, a
