"""Views of every tensor argument of every op (issue 10): a strided, offset or non-contiguous view either gives
exactly the contiguous result (torch.equal) or raises a ValueError that names the argument, and append writes no
byte outside the pages it names. Each case states which of the two it expects (the rules: tensors the kernels move
16 bytes at a time need 16-byte aligned starts and strides; tensors a kernel indexes as dense arrays must be dense,
except plan() metadata, which plan() reads on the host and makes dense itself).

Specs: cases.VIEW_SPECS (all in specs/gpu-tests.toml).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import attnjit

from ..helpers import i32, make_paged, make_ragged, poisoned
from .cases import HEAD_SCALE

DEV = "cuda"
H_Q, H_KV, D, PS = 32, 8, 128, 16
DT = torch.bfloat16
QO, KV = (5, 1, 9, 0, 3), (40, 17, 300, 7, 3)   # a request without queries, non-full pages, a split-able history


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(128 << 20, dtype=torch.uint8, device=DEV)


def _fill(shape, like: torch.Tensor) -> torch.Tensor:
    """A fresh buffer holding a sentinel (what a view that is read as dense would pick up)."""
    if like.dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool, device=like.device)
    if like.dtype.is_floating_point:
        return torch.full(shape, 3.0, dtype=like.dtype, device=like.device)
    return torch.full(shape, -1 if like.dtype.is_signed else 0x55, dtype=like.dtype, device=like.device)


def layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t's values in a view of kind: contiguous | padded (last dim padded by 8: aligned strides) | odd (padded by
    1) | transposed (dims 0 and 1 swapped in memory) | offsetN (storage offset of N elements) | column (1-D: column
    0 of an [n, 2] table)."""
    shape = tuple(t.shape)
    if kind == "contiguous":
        return t.clone()
    if kind in ("padded", "odd"):
        view = _fill((*shape[:-1], shape[-1] + (8 if kind == "padded" else 1)), t)[..., :shape[-1]]
    elif kind == "transposed":
        view = _fill((shape[1], shape[0], *shape[2:]), t).transpose(0, 1)
    elif kind.startswith("offset"):
        off = int(kind[6:])
        view = _fill((t.numel() + off,), t)[off:].view(shape)
    elif kind == "column":
        view = _fill((shape[0], 2), t)[:, 0]
    else:
        raise AssertionError(kind)
    view.copy_(t)
    return view


VECTOR_OK = ("contiguous", "padded", "transposed", "offset8")   # 16-byte aligned starts and strides
VECTOR_BAD = ("odd", "offset1")


def _named_error(arg: str, call) -> None:
    with pytest.raises(ValueError, match=rf"^(run\(\): )?(variant .*)?{re.escape(arg)}"):
        call()


def _equal(got, want) -> None:
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), f"max difference {(g.float() - w.float()).abs().nan_to_num(1e9).max().item()}"


# --- the batch wrappers ---------------------------------------------------------------------------------------

def _paged(kind: str, seed: int = 0):
    qo = QO if kind == "prefill" else (1,) * len(KV)
    b = make_paged(qo, KV, page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, dtype=DT, device=DEV,
                   seed=seed)
    meta = dict(zip(("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"), b.tensors(DEV)))
    return b, meta


def _plan_paged(kind, workspace, meta, split, variant=None, **extra):
    if kind == "prefill":
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, variant=variant)
        w.plan(meta["qo_indptr"], meta["paged_kv_indptr"], meta["paged_kv_indices"], meta["paged_kv_last_page_len"],
               H_Q, H_KV, D, PS, causal=extra.pop("causal", True), q_data_type=DT, **split, **extra)
    else:
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
        w.plan(meta["paged_kv_indptr"], meta["paged_kv_indices"], meta["paged_kv_last_page_len"], H_Q, H_KV, D, PS,
               q_data_type=DT, **split, **extra)
    return w


def _run(w, q, cache, out=None, lse=None, **params):
    out = poisoned(q.shape, DT, DEV) if out is None else out
    lse = poisoned(q.shape[:2], torch.float32, DEV) if lse is None else lse
    w.run(q, cache, out=out, lse=lse, **params)
    return out, lse


SPLITS = {"auto": {}, "split": {"fixed_split_size": 64}}
META_CASES = [(kind, arg, where, view) for kind in ("prefill", "decode")
              for arg in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
              if not (kind == "decode" and arg == "qo_indptr")
              for where in ("cuda", "cpu") for view in ("column", "offset3")]


@pytest.mark.parametrize("kind,arg,where,view", META_CASES, ids=["-".join(c) for c in META_CASES])
def test_paged_plan_metadata_views_give_the_contiguous_result(kind, arg, where, view, workspace):
    """plan() reads indptr/last_page_len on the host and makes page ids dense: every view of them is read right."""
    b, meta = _paged(kind, seed=1)
    ref_w = _plan_paged(kind, workspace, meta, SPLITS["split"])
    ref = _run(ref_w, b.q, b.cache)
    viewed = dict(meta)
    viewed[arg] = layout(meta[arg].to(where), view)
    w = _plan_paged(kind, workspace, viewed, SPLITS["split"])
    got = _run(w, b.q, b.cache)
    assert w.last_plan == ref_w.last_plan  # after both ran: the record holds the run's TMA copies too
    _equal(got, ref)


RUN_CASES = ([("q", v, True) for v in VECTOR_OK] + [("q", v, False) for v in VECTOR_BAD]
             + [("out", v, True) for v in VECTOR_OK] + [("out", v, False) for v in VECTOR_BAD]
             + [("lse", "offset1", True), ("lse", "transposed", False)])


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("arg,view,ok", RUN_CASES, ids=[f"{a}-{v}" for a, v, _ in RUN_CASES])
def test_paged_run_q_out_lse_views(kind, split, arg, view, ok, workspace):
    b, meta = _paged(kind, seed=2)
    w = _plan_paged(kind, workspace, meta, SPLITS[split])
    ref = _run(w, b.q, b.cache)
    args = {"q": b.q, "cache": b.cache, "out": poisoned(b.q.shape, DT, DEV),
            "lse": poisoned(b.q.shape[:2], torch.float32, DEV)}
    args[arg] = layout(args[arg], view)
    if not ok:
        _named_error(arg, lambda: _run(w, **args))
        return
    _equal(_run(w, **args), ref)


def _cache_views(cache: torch.Tensor, kind: str):
    """A paged cache [P, 2, ...] as kind: its backing buffers hold sentinels outside the pages."""
    p = cache.shape[0]
    if kind == "contiguous":
        return cache.clone()
    if kind in ("offset8", "offset1"):
        return layout(cache, kind)
    if kind == "strided_pages":
        view = _fill((2 * p, *cache.shape[1:]), cache)[::2]
    elif kind == "padded_inner":   # dim 2 (slots for NHD, heads for HND) padded by one: a run-time stride
        view = _fill((*cache.shape[:2], cache.shape[2] + 1, *cache.shape[3:]), cache)[:, :, :cache.shape[2]]
    elif kind == "padded_last":    # D padded by 8: the next dim is no longer D apart
        view = layout(cache, "padded")
        return view
    elif kind == "tuple":
        return cache[:, 0].clone(), cache[:, 1].clone()
    elif kind == "tuple_views":
        c = cache.clone()
        return c[:, 0], c[:, 1]
    elif kind == "tuple_strided":
        k = _fill((2 * p, *cache.shape[2:]), cache)[::2]
        v = _fill((2 * p, *cache.shape[2:]), cache)[1::2]
        k.copy_(cache[:, 0])
        v.copy_(cache[:, 1])
        return k, v
    else:
        raise AssertionError(kind)
    view.copy_(cache)
    return view


CACHE_OK = ("contiguous", "offset8", "strided_pages", "padded_inner", "tuple", "tuple_views", "tuple_strided")
CACHE_BAD = ("offset1", "padded_last")


@pytest.mark.parametrize("layout_", ["NHD", "HND"])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("view", CACHE_OK + CACHE_BAD)
def test_paged_run_cache_views(kind, layout_, view, workspace):
    if layout_ == "HND" and kind == "decode":
        b = make_paged((1,) * len(KV), KV, page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                       dtype=DT, layout="HND", device=DEV, seed=3)
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND")
        _, kvp, idx, last = b.tensors(DEV)
        w.plan(kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT)
    elif layout_ == "HND":
        b = make_paged(QO, KV, page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, dtype=DT,
                       layout="HND", device=DEV, seed=3)
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="HND")
        w.plan(*b.tensors(DEV), H_Q, H_KV, D, PS, causal=True, q_data_type=DT)
    else:
        b, meta = _paged(kind, seed=3)
        w = _plan_paged(kind, workspace, meta, {})
    ref = _run(w, b.q, b.cache)
    cache = _cache_views(b.cache, view)
    if view in CACHE_BAD:
        _named_error("paged_kv_cache", lambda: _run(w, b.q, cache))
        return
    _equal(_run(w, b.q, cache), ref)


@pytest.mark.parametrize("arg,view,ok", [(a, v, True) for a in ("q", "k", "v", "out") for v in VECTOR_OK]
                         + [(a, v, False) for a in ("q", "k", "v", "out") for v in VECTOR_BAD]
                         + [("lse", "offset1", True), ("lse", "transposed", False)])
def test_ragged_run_views(arg, view, ok, workspace):
    qo_indptr, kv_indptr, q, k, v = make_ragged(QO, KV, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, dtype=DT,
                                                device=DEV, seed=4)
    w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    w.plan(i32(qo_indptr), i32(kv_indptr), H_Q, H_KV, D, causal=True, q_data_type=DT, fixed_split_size=64)
    args = {"q": q, "k": k, "v": v, "out": poisoned(q.shape, DT, DEV), "lse": poisoned(q.shape[:2], torch.float32, DEV)}
    ref = (args["out"].clone(), args["lse"].clone())
    w.run(q, k, v, out=ref[0], lse=ref[1])
    args[arg] = layout(args[arg], view)
    if arg in ("k", "v"):  # k and v share strides: view both alike
        args["k" if arg == "v" else "v"] = layout(args["k" if arg == "v" else "v"], view)

    def call():
        w.run(args["q"], args["k"], args["v"], out=args["out"], lse=args["lse"])
        return args["out"], args["lse"]
    if not ok:
        _named_error(arg if arg not in ("k", "v") else "k", call)
        return
    _equal(call(), ref)


@pytest.mark.parametrize("arg", ["qo_indptr", "kv_indptr"])
@pytest.mark.parametrize("where", ["cuda", "cpu"])
@pytest.mark.parametrize("view", ["column", "offset3"])
def test_ragged_plan_metadata_views(arg, where, view, workspace):
    qo_indptr, kv_indptr, q, k, v = make_ragged(QO, KV, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, dtype=DT,
                                                device=DEV, seed=5)
    meta = {"qo_indptr": i32(qo_indptr, DEV), "kv_indptr": i32(kv_indptr, DEV)}
    ref_w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    ref_w.plan(meta["qo_indptr"], meta["kv_indptr"], H_Q, H_KV, D, causal=True, q_data_type=DT)
    ref = ref_w.run(q, k, v)
    meta[arg] = layout(meta[arg].to(where), view)
    w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    w.plan(meta["qo_indptr"], meta["kv_indptr"], H_Q, H_KV, D, causal=True, q_data_type=DT)
    _equal(w.run(q, k, v), ref)


@pytest.mark.parametrize("view,ok", [("offset1", True), ("column", False)])
def test_variant_tensor_parameter_views(view, ok, workspace):
    b, meta = _paged("prefill", seed=6)
    w = _plan_paged("prefill", workspace, meta, {}, variant=HEAD_SCALE)
    scale = (torch.rand(H_Q, generator=torch.Generator().manual_seed(6)) + 0.5).to(DEV)
    ref = _run(w, b.q, b.cache, head_scale=scale)
    viewed = layout(scale, view)
    if not ok:
        _named_error("head_scale", lambda: _run(w, b.q, b.cache, head_scale=viewed))
        return
    _equal(_run(w, b.q, b.cache, head_scale=viewed), ref)


@pytest.mark.parametrize("arg", ["custom_mask", "packed_custom_mask"])
@pytest.mark.parametrize("view", ["column", "offset3"])
def test_custom_mask_views(arg, view, workspace):
    b, meta = _paged("prefill", seed=7)
    gen = torch.Generator().manual_seed(7)
    mask = torch.cat([(torch.rand(q * k, generator=gen) < 0.6) for q, k in zip(QO, KV)]).to(DEV)
    if arg == "packed_custom_mask":
        from attnjit.ops._variants import pack_mask_bits

        mask, _ = pack_mask_bits(mask, [q * k for q, k in zip(QO, KV)])
    ref = _run(_plan_paged("prefill", workspace, meta, {}, causal=False, **{arg: mask}), b.q, b.cache)
    got = _run(_plan_paged("prefill", workspace, meta, {}, causal=False, **{arg: layout(mask, view)}), b.q, b.cache)
    _equal(got, ref)


def test_cuda_graph_replay_with_strided_device_page_ids(workspace):
    """Graph mode copies page ids into its fixed buffer: a strided device view is copied right (and replayed)."""
    b, meta = _paged("decode", seed=8)
    results = {}
    for name in ("dense", "column"):
        ws = torch.empty(32 << 20, dtype=torch.uint8, device=DEV)
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True)
        ids = meta["paged_kv_indices"] if name == "dense" else layout(meta["paged_kv_indices"], "column")
        w.plan(meta["paged_kv_indptr"], ids, meta["paged_kv_last_page_len"], H_Q, H_KV, D, PS, q_data_type=DT)
        out = torch.empty_like(b.q)
        w.run(b.q, b.cache, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            w.run(b.q, b.cache, out=out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        results[name] = out.clone()
    _equal(results["column"], results["dense"])


# --- single-request helpers: they copy what the kernels cannot read -------------------------------------------

@pytest.mark.parametrize("arg", ["q", "k", "v"])
@pytest.mark.parametrize("view", VECTOR_OK + VECTOR_BAD)
def test_single_prefill_and_decode_views(arg, view):
    gen = torch.Generator().manual_seed(9)
    t = {"q": torch.randn(37, H_Q, D, generator=gen), "k": torch.randn(90, H_KV, D, generator=gen),
         "v": torch.randn(90, H_KV, D, generator=gen)}
    t = {k_: x.to(DT).to(DEV) for k_, x in t.items()}
    ref = attnjit.single_prefill_with_kv_cache(t["q"], t["k"], t["v"], causal=True, return_lse=True)
    ref_d = attnjit.single_decode_with_kv_cache(t["q"][0], t["k"], t["v"])
    viewed = dict(t)
    viewed[arg] = layout(t[arg], view)
    _equal(attnjit.single_prefill_with_kv_cache(viewed["q"], viewed["k"], viewed["v"], causal=True, return_lse=True),
           ref)
    q0 = layout(t["q"][0], view) if arg == "q" else t["q"][0]
    _equal(attnjit.single_decode_with_kv_cache(q0, viewed["k"], viewed["v"]), ref_d)


# --- merge ----------------------------------------------------------------------------------------------------

def _states(rows=77, heads=8, n=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, heads) if n is None else (rows, n, heads)
    v = torch.randn(*shape, D, generator=gen)
    s = torch.randn(*shape, generator=gen) * 8
    s[torch.rand(*shape, generator=gen) < 0.2] = -math.inf
    return v.to(DT).to(DEV), s.to(DEV)


MERGE_V = [(v, True) for v in VECTOR_OK] + [(v, False) for v in VECTOR_BAD]
MERGE_S = [("transposed", True), ("offset1", True)]   # lse is read and written through its strides


@pytest.mark.parametrize("arg,view,ok", [(a, v, ok) for a in ("v_a", "v_b") for v, ok in MERGE_V]
                         + [(a, v, ok) for a in ("s_a", "s_b") for v, ok in MERGE_S])
def test_merge_state_views(arg, view, ok):
    va, sa = _states(seed=1)
    vb, sb = _states(seed=2)
    args = {"v_a": va, "s_a": sa, "v_b": vb, "s_b": sb}
    ref = attnjit.merge_state(**args)
    args[arg] = layout(args[arg], view)
    if not ok:
        _named_error(arg, lambda: attnjit.merge_state(**args))
        return
    _equal(attnjit.merge_state(**args), ref)


@pytest.mark.parametrize("arg,view,ok", [(a, v, ok) for a in ("v", "v_other") for v, ok in MERGE_V]
                         + [(a, v, ok) for a in ("s", "s_other") for v, ok in MERGE_S]
                         + [("mask", "offset3", True), ("mask", "column", False)])
def test_merge_state_in_place_views(arg, view, ok):
    va, sa = _states(seed=3)
    vb, sb = _states(seed=4)
    mask = (torch.rand(va.shape[0], generator=torch.Generator().manual_seed(5)) < 0.5).to(DEV)
    ref_v, ref_s = va.clone(), sa.clone()
    attnjit.merge_state_in_place(ref_v, ref_s, vb, sb, mask=mask)
    args = {"v": va.clone(), "s": sa.clone(), "v_other": vb, "s_other": sb, "mask": mask}
    args[arg] = layout(args[arg], view)
    if not ok:
        _named_error(arg, lambda: attnjit.merge_state_in_place(**args))
        return
    attnjit.merge_state_in_place(**args)
    _equal((args["v"], args["s"]), (ref_v, ref_s))


@pytest.mark.parametrize("arg,view,ok", [("v", v, ok) for v, ok in MERGE_V] + [("s", v, ok) for v, ok in MERGE_S])
def test_merge_states_views(arg, view, ok):
    v, s = _states(n=5, seed=6)
    ref = attnjit.merge_states(v, s)
    args = {"v": v, "s": s}
    args[arg] = layout(args[arg], view)
    if not ok:
        _named_error(arg, lambda: attnjit.merge_states(**args))
        return
    _equal(attnjit.merge_states(**args), ref)


# --- append: never a byte outside the named pages -------------------------------------------------------------

APPEND_SEQ, APPEND_NEW = (7, 1, 40, 16), (3, 1, 17, 16)   # KV length after the append, new tokens per request


def _append_inputs(layout_: str, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-k // PS) for k in APPEND_SEQ]
    total = sum(pages) + 5
    ids = torch.randperm(total, generator=gen).tolist()
    kv_indptr, kv_indices, pos = [0], [], 0
    for n in pages:
        kv_indices += ids[pos:pos + n]
        pos += n
        kv_indptr.append(len(kv_indices))
    last = [k - PS * (n - 1) for k, n in zip(APPEND_SEQ, pages)]
    shape = (total, 2, PS, 4, D) if layout_ == "NHD" else (total, 2, 4, PS, D)
    cache = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    append_indptr = [0]
    for a in APPEND_NEW:
        append_indptr.append(append_indptr[-1] + a)
    nnz = append_indptr[-1]
    key = torch.randn(nnz, 4, D, generator=gen).to(dtype).to(DEV)
    value = torch.randn(nnz, 4, D, generator=gen).to(dtype).to(DEV)
    b_idx, positions = attnjit.get_batch_indices_positions(i32(append_indptr, DEV), i32(APPEND_SEQ, DEV), nnz)
    return dict(append_key=key, append_value=value, batch_indices=b_idx, positions=positions, paged_kv_cache=cache,
                kv_indices=i32(kv_indices, DEV), kv_indptr=i32(kv_indptr, DEV), kv_last_page_len=i32(last, DEV))


def _backing(arg) -> list[torch.Tensor]:
    """The whole buffers behind a cache argument (one tensor or a (k, v) tuple)."""
    parts = arg if isinstance(arg, tuple) else (arg,)
    out, seen = [], set()
    for t in parts:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(torch.empty(0, dtype=t.dtype, device=t.device).set_(st))  # the storage as a 1-D tensor
    return out


def _mirror(arg, backing: list[torch.Tensor], clones: list[torch.Tensor]):
    """The same view of the cache over clones of its backing buffers."""
    def one(t):
        for b, c in zip(backing, clones):
            if t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                return c.as_strided(t.shape, t.stride(), t.storage_offset())
        raise AssertionError("no backing buffer")
    return tuple(one(t) for t in arg) if isinstance(arg, tuple) else one(arg)


def _expected_append(cache_arg, inputs, layout_):
    """Write each appended token where the contract says, through the view (advanced-index writes land in the
    backing buffer), so the whole backing buffer is what append must leave."""
    ck, cv = cache_arg if isinstance(cache_arg, tuple) else (cache_arg[:, 0], cache_arg[:, 1])
    b = inputs["batch_indices"].long()
    pos = inputs["positions"].long()
    page = inputs["kv_indices"].long()[inputs["kv_indptr"].long()[b] + pos // PS]
    slot = pos % PS
    if layout_ == "NHD":
        ck[page, slot] = inputs["append_key"]
        cv[page, slot] = inputs["append_value"]
    else:
        ck[page, :, slot] = inputs["append_key"]
        cv[page, :, slot] = inputs["append_value"]


APPEND_CASES = ([("append_key", v, True) for v in VECTOR_OK] + [("append_key", v, False) for v in VECTOR_BAD]
                + [("append_value", v, True) for v in VECTOR_OK] + [("append_value", v, False) for v in VECTOR_BAD]
                + [(a, "offset3", True) for a in ("batch_indices", "positions", "kv_indices", "kv_indptr")]
                + [(a, "column", False) for a in ("batch_indices", "positions", "kv_indices", "kv_indptr")]
                + [("kv_last_page_len", "column", True), ("kv_last_page_len", "offset3", True)]
                + [("paged_kv_cache", v, True) for v in CACHE_OK] + [("paged_kv_cache", v, False) for v in CACHE_BAD])


@pytest.mark.parametrize("layout_,dtype", [("NHD", torch.bfloat16), ("HND", torch.float16)])
@pytest.mark.parametrize("arg,view,ok", APPEND_CASES, ids=[f"{a}-{v}" for a, v, _ in APPEND_CASES])
def test_append_views_write_only_the_named_pages(layout_, dtype, arg, view, ok):
    inputs = _append_inputs(layout_, dtype, seed=11)
    if arg == "paged_kv_cache":
        inputs[arg] = _cache_views(inputs[arg], view)
    else:
        inputs[arg] = layout(inputs[arg], view)
    backing = _backing(inputs["paged_kv_cache"])
    before = [b.clone() for b in backing]
    if not ok:
        _named_error(arg, lambda: attnjit.append_paged_kv_cache(**inputs, kv_layout=layout_))
        torch.cuda.synchronize()
        assert all(torch.equal(b, c) for b, c in zip(backing, before)), "a rejected append wrote into the cache"
        return
    expected = [b.clone() for b in backing]
    _expected_append(_mirror(inputs["paged_kv_cache"], backing, expected), inputs, layout_)
    attnjit.append_paged_kv_cache(**inputs, kv_layout=layout_)
    torch.cuda.synchronize()
    for b, e in zip(backing, expected):
        changed = int((b != e).sum())
        assert changed == 0, f"{changed} elements of the cache's buffers differ from the contract's writes"
