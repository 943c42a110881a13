"""Input rules of every op that a CPU can check (issue 10): plan() bounds and scalars, strided / offset views of
every tensor argument (read right or rejected by name), and no-GPU errors that are attnjit's own.

plan() runs on a CPU workspace (it validates and schedules without a GPU); run(), append and merge check every
argument before they need a GPU, so an accepted argument shows as attnjit's NoGPUError here."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest
import torch

import attnjit
from attnjit.errors import NoGPUError
from attnjit.ops import planner
from attnjit.ops.attention import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from attnjit.ops.scheduler import MAX_WORK_ITEMS
from tests.helpers import i32
from tests.plan_support import WRAPPERS, column_view, decode_args, paged_args, workspace
from tests.plan_support import planned as _planned, run_inputs as _run_inputs


def _rejects(kind: str, exc, pattern: str, **changes) -> None:
    """plan() with ``changes`` raises ``exc`` matching ``pattern``, fast, and leaves no plan behind."""
    make, args = WRAPPERS[kind]
    w = make(workspace())
    t0 = time.perf_counter()
    with pytest.raises(exc, match=pattern):
        w.plan(**args(**changes))
    assert time.perf_counter() - t0 < 1.0, "a rejected plan() took over a second"
    assert w.last_plan is None


# --- bounds: named errors before any allocation proportional to the values ----------------------------------

def _huge(n: int) -> torch.Tensor:
    """n int32 page ids without n * 4 bytes of memory (an expanded view)."""
    return torch.zeros(1, dtype=torch.int32).expand(n)


@pytest.mark.parametrize("kind,changes,pattern", [
    ("paged", dict(num_qo_heads=2 ** 31 - 1, num_kv_heads=1, pos_encoding_mode="ALIBI"),
     r"num_qo_heads must be a positive int <= 1024, got 2147483647"),
    ("decode", dict(num_qo_heads=2048, num_kv_heads=2048), r"num_qo_heads must be a positive int <= 1024"),
    ("ragged", dict(num_qo_heads=130, num_kv_heads=2),
     r"num_qo_heads=130 / num_kv_heads=2 = 65 query heads per KV head; the kernels support groups up to 64"),
    ("paged", dict(qo_indptr=[0, 2 ** 31 - 1, 2 ** 31 - 1, 2 ** 31 - 1], causal=False),
     r"qo_indptr\[-1\]=2147483647 query rows is more than one plan takes \(16777216\)"),
    ("ragged", dict(qo_indptr=[0, 1, 1, 1], kv_indptr=[0, 2 ** 31 - 1, 2 ** 31 - 1, 2 ** 31 - 1]),
     r"kv_indptr: request 0 has a KV length of 2147483647, more than the 1073741824 tokens"),
])
def test_plan_bounds(kind, changes, pattern):
    _rejects(kind, ValueError, pattern, **changes)


def test_a_kv_length_beyond_int32_is_a_named_error():
    """2**24 + 1 pages of 128 tokens: 2**31 + 128 keys; rejected before the kernels' int32 could overflow."""
    pages = 2 ** 24 + 1
    _rejects("decode", ValueError, r"^indptr: request 0 has a KV length of 2147483776, more than the 1073741824",
             indptr=[0, pages], indices=_huge(pages), last_page_len=[128], page_size=128)


def test_the_work_list_is_counted_before_it_is_built():
    """2**30 keys cut into chunks of 64: 2**24 work items would be a 2 GB list; the count is refused first."""
    pages = 2 ** 30 // 128
    _rejects("decode", ValueError, r"would need 16777216 work items .*fixed_split_size=1\); one plan takes at most "
             rf"{MAX_WORK_ITEMS}", indptr=[0, pages], indices=_huge(pages), last_page_len=[128], page_size=128,
             fixed_split_size=1)


# --- scalars: named errors, never a silent conversion ------------------------------------------------------

NAN, INF = float("nan"), float("inf")
SCALARS = [
    ("logits_soft_cap", NAN, ValueError, r"logits_soft_cap must be a positive finite number, got nan"),
    ("logits_soft_cap", INF, ValueError, r"logits_soft_cap must be a positive finite number, got inf"),
    ("logits_soft_cap", -1.0, ValueError, r"logits_soft_cap must be a positive finite number, got -1.0"),
    ("logits_soft_cap", 1e39, ValueError, r"logits_soft_cap=1e\+39 is outside the float32 range"),
    ("logits_soft_cap", True, TypeError, r"logits_soft_cap must be a number, got bool True"),
    ("logits_soft_cap", "30", TypeError, r"logits_soft_cap must be a number, got str '30'"),
    ("window_left", 2 ** 31, ValueError, r"window_left=2147483648 must be -1 \(no window\) or a non-negative int32"),
    ("window_left", -2, ValueError, r"window_left=-2 must be -1"),
    ("window_left", True, TypeError, r"window_left must be an int, got bool"),
    ("window_left", 4.0, TypeError, r"window_left must be an int, got float"),
    ("sm_scale", True, TypeError, r"sm_scale must be a number, got bool"),
    ("sm_scale", NAN, ValueError, r"sm_scale must be a positive finite number, got nan"),
    ("sm_scale", 0.0, ValueError, r"sm_scale must be a positive finite number, got 0.0"),
    ("sm_scale", 1e39, ValueError, r"sm_scale=1e\+39 is outside the float32 range"),
    ("sm_scale", 1e-45, ValueError, r"sm_scale=1e-45 is outside the float32 range"),
    ("sm_scale", "0.1", TypeError, r"sm_scale must be a number, got str"),
    ("fixed_split_size", True, TypeError, r"fixed_split_size must be an int, got bool"),
    ("fixed_split_size", 0, ValueError, r"fixed_split_size must be a positive number of KV tokens"),
    ("fixed_split_size", 128.0, TypeError, r"fixed_split_size must be an int, got float"),
    ("disable_split_kv", "no", TypeError, r"disable_split_kv must be True or False, got str 'no'"),
    ("disable_split_kv", 1, TypeError, r"disable_split_kv must be True or False, got int"),
    ("non_blocking", "yes", TypeError, r"non_blocking must be True or False"),
    ("pos_encoding_mode", 0, TypeError, r"pos_encoding_mode must be a string"),
    ("pos_encoding_mode", "ROPE_GPTJ", NotImplementedError, r"pos_encoding_mode='ROPE_GPTJ' is not supported"),
    ("rope_theta", 0.0, ValueError, r"rope_theta must be a positive finite number"),
    ("sm_scale", 10 ** 400, ValueError, r"sm_scale must be a finite number, got an int of 1329 bits"),
    ("logits_soft_cap", -10 ** 400, ValueError, r"logits_soft_cap must be a finite number, got an int of 1329 bits"),
    ("rope_scale", 10 ** 400, ValueError, r"rope_scale must be a finite number, got an int of 1329 bits"),
    ("num_qo_heads", 32.0, TypeError, r"num_qo_heads must be an int, got float"),
    ("num_kv_heads", True, TypeError, r"num_kv_heads must be an int, got bool"),
    ("page_size", "16", TypeError, r"page_size must be an int, got str"),
    ("q_data_type", "float8", TypeError, r"q_data_type='float8' is not supported"),
]


SCALAR_CASES = [(kind, *s) for kind in ("paged", "decode", "ragged") for s in SCALARS
                if not (kind == "ragged" and s[0] == "page_size")]  # the ragged wrapper has no page_size


@pytest.mark.parametrize("kind,name,value,exc,pattern", SCALAR_CASES,
                         ids=[f"{c[0]}-{c[1]}={c[2]!r:.24}" for c in SCALAR_CASES])
def test_plan_scalars(kind, name, value, exc, pattern):
    _rejects(kind, exc, pattern, **{name: value})


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("value,exc,pattern", [
    (128.0, TypeError, r"head_dim_vo must be an int, got float"),
    (torch.tensor([128, 128]), TypeError, r"head_dim_vo must be an int, got Tensor"),
    (True, TypeError, r"head_dim_vo must be an int, got bool"),
])
def test_head_dim_vo_is_an_int_like_head_dim_qk(kind, value, exc, pattern):
    _rejects(kind, exc, pattern, head_dim_vo=value, head_dim_qk=128)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_causal_must_be_a_bool(kind):
    _rejects(kind, TypeError, r"causal must be True or False, got str 'yes'", causal="yes")


def test_numpy_scalars_and_engine_defaults_are_accepted():
    """numpy ints/floats are numbers; SGLang passes disable_split_kv=None (meaning False); soft-cap 0 is off."""
    w = BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(**decode_args(num_qo_heads=np.int64(32), num_kv_heads=np.int32(8), head_dim=np.int64(128),
                         page_size=np.int64(4), sm_scale=np.float32(0.125), disable_split_kv=None,
                         logits_soft_cap=0.0, window_left=np.int64(-1)))
    assert w._plan.spec.variant is None and w._plan.num_qo_heads == 32
    assert w._plan.attn_values[w._plan.layout.index["sm_scale_log2"]] == pytest.approx(0.125 * 1.4426950408889634)


# --- strided, offset and non-contiguous metadata: read right ------------------------------------------------

def _offset(values: list[int]) -> torch.Tensor:
    """values at storage offset 3 of a larger buffer (a view that is contiguous but not at the buffer's start)."""
    buf = i32([-9, -9, -9] + list(values) + [-9])
    return buf[3:3 + len(values)]


def _records(w) -> list:
    return [tuple(int(x) for x in r) for r in w._plan.work.records]


@pytest.mark.parametrize("view", [column_view, _offset])
@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
def test_metadata_views_plan_like_contiguous_metadata(kind, view):
    make, args = WRAPPERS[kind]
    ref = make(workspace())
    base = args()
    ref.plan(**base)
    w = make(workspace())
    viewed = {k: view(v.tolist()) if isinstance(v, torch.Tensor) else v for k, v in base.items()}
    w.plan(**viewed)
    assert _records(w) == _records(ref)
    assert (w._plan.max_page, w._plan.total_kv, w._plan.q_shape) == (ref._plan.max_page, ref._plan.total_kv,
                                                                      ref._plan.q_shape)


def test_strided_page_ids_are_made_dense_for_the_kernels():
    ids = column_view([7, 2, 11, 3, 14, 6])
    dense = planner.dense_page_ids(ids)
    assert dense.is_contiguous() and dense.tolist() == [7, 2, 11, 3, 14, 6]
    contiguous = i32([1, 2])
    assert planner.dense_page_ids(contiguous) is contiguous  # no copy when there is nothing to fix


def test_custom_masks_as_views_plan_like_contiguous_ones():
    gen = torch.Generator().manual_seed(3)
    sizes = [3 * 6, 1 * 2, 4 * 9]
    mask = torch.rand(sum(sizes), generator=gen) < 0.5
    strided = torch.stack([mask, ~mask], dim=1)[:, 0]
    packed = {}
    for name, m in (("dense", mask), ("strided", strided)):
        w = BatchPrefillWithPagedKVCacheWrapper(workspace())
        w.plan(**paged_args(custom_mask=m, causal=False))
        packed[name] = w._plan.binding.bound["packed_custom_mask"]
    assert torch.equal(packed["dense"], packed["strided"])
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(**paged_args(packed_custom_mask=torch.stack([packed["dense"], packed["dense"]], 1)[:, 1], causal=False))
    assert torch.equal(w._plan.binding.bound["packed_custom_mask"], packed["dense"])


def test_graph_buffers_must_be_dense():
    ws = workspace()
    with pytest.raises(ValueError, match=r"paged_kv_indices_buffer must be contiguous: the kernel reads it"):
        BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, paged_kv_indices_buffer=column_view(list(range(8))))
    with pytest.raises(ValueError, match=r"qo_indptr_buf must be contiguous"):
        BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True, qo_indptr_buf=column_view([0, 1, 2]))


def test_workspace_must_be_aligned_and_on_a_real_device():
    with pytest.raises(ValueError, match=r"float_workspace_buffer must start on a 16-byte boundary"):
        BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match=r"float_workspace_buffer must be on a CUDA device \(or the CPU"):
        BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="meta"))
    with pytest.raises(TypeError, match=r"use_cuda_graph must be True or False"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph="no")
    with pytest.raises(ValueError, match=r"max_work_items must be 1\.\."):
        BatchDecodeWithPagedKVCacheWrapper(workspace(), max_work_items=0)


# --- run(): views of q, out, lse and the caches ------------------------------------------------------------

def _view(shape, dtype, kind):
    """A tensor of ``shape`` laid out as ``kind``: contiguous, padded (last-dim padding of 8: aligned strides),
    odd (padding of 1), transposed (first two dims swapped in memory), offset8 / offset1 (storage offset)."""
    n = math.prod(shape)
    if kind == "contiguous":
        return torch.zeros(shape, dtype=dtype)
    if kind in ("padded", "odd"):
        pad = 8 if kind == "padded" else 1
        return torch.zeros(*shape[:-1], shape[-1] + pad, dtype=dtype)[..., :shape[-1]]
    if kind == "transposed":
        return torch.zeros(shape[1], shape[0], *shape[2:], dtype=dtype).transpose(0, 1)
    off = 8 if kind == "offset8" else 1
    return torch.zeros(n + off, dtype=dtype)[off:].view(shape)


VIEWS_OK = ["contiguous", "padded", "transposed", "offset8"]
VIEWS_BAD = {"odd": r"\.stride\(\d\)=\d+ elements is not a multiple of 8",
             "offset1": r" must start on a 16-byte boundary"}


@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
@pytest.mark.parametrize("arg", ["q", "out"])
@pytest.mark.parametrize("layout", VIEWS_OK + list(VIEWS_BAD))
def test_run_q_and_out_views(kind, arg, layout):
    w, plan = _planned(kind)
    inputs = _run_inputs(kind, plan)
    dtype = plan.q_dtype if arg == "q" else plan.o_dtype
    inputs[arg] = _view(tuple(plan.q_shape), dtype, layout)
    if layout in VIEWS_BAD:
        with pytest.raises(ValueError, match=rf"^{arg}" + VIEWS_BAD[layout]):
            w.run(**inputs)
    else:
        with pytest.raises(NoGPUError):  # every check passed
            w.run(**inputs)


def test_run_rejects_an_out_whose_elements_overlap_and_a_strided_lse():
    w, plan = _planned("paged")
    inputs = _run_inputs("paged", plan)
    n, h, d = plan.q_shape
    overlapping = torch.zeros(1, h, d, dtype=plan.o_dtype).expand(n, h, d)
    with pytest.raises(ValueError, match=r"^out is written by the kernel but its elements overlap"):
        w.run(**inputs, out=overlapping)
    with pytest.raises(ValueError, match=r"lse must be a contiguous float32 \[8, 32\] tensor .* dense array"):
        w.run(**inputs, lse=torch.zeros(h, n).t())
    with pytest.raises(NoGPUError):
        w.run(**inputs, lse=torch.zeros(n * h + 1)[1:].view(n, h))  # an offset lse is fine: 4-byte loads
    with pytest.raises(TypeError, match=r"return_lse must be True or False"):
        w.run(**inputs, return_lse="yes")


def test_run_window_left_is_an_int():
    w, plan = _planned("paged")
    with pytest.raises(TypeError, match=r"^window_left must be an int, got Tensor"):
        w.run(**_run_inputs("paged", plan), window_left=torch.tensor([5, 5]))


@pytest.mark.parametrize("layout", VIEWS_OK + list(VIEWS_BAD))
def test_run_ragged_kv_views(layout):
    w, plan = _planned("ragged")
    inputs = _run_inputs("ragged", plan)
    inputs["k"] = _view((17, 8, 64), plan.kv_dtype, layout)
    inputs["v"] = _view((17, 8, 64), plan.kv_dtype, layout)
    if layout in VIEWS_BAD:
        with pytest.raises(ValueError, match=r"^k(\.stride| must start)"):
            w.run(**inputs)
    else:
        with pytest.raises(NoGPUError):
            w.run(**inputs)


def _cache_view(kind, dtype=torch.float16, pages=15):
    shape = (pages, 2, 4, 8, 128)
    full = math.prod(shape)
    if kind == "contiguous":
        return torch.zeros(shape, dtype=dtype)
    if kind == "offset8":
        return torch.zeros(full + 8, dtype=dtype)[8:].view(shape)
    if kind == "offset1":
        return torch.zeros(full + 1, dtype=dtype)[1:].view(shape)
    if kind == "strided_pages":
        return torch.zeros(2 * pages, *shape[1:], dtype=dtype)[::2]
    if kind == "padded_slots":  # each page has room for 5 slots, 4 used: slot stride stays H * D
        return torch.zeros(pages, 2, 5, 8, 128, dtype=dtype)[:, :, :4]
    if kind == "tuple":
        return (torch.zeros(shape[:1] + shape[2:], dtype=dtype), torch.zeros(shape[:1] + shape[2:], dtype=dtype))
    if kind == "padded_heads":  # heads D + 8 apart: NHD needs heads D apart
        return torch.zeros(pages, 2, 4, 8, 136, dtype=dtype)[..., :128]
    if kind == "tuple_odd_offset":
        k = torch.zeros(pages * 4 * 8 * 128 + 1, dtype=dtype)[1:].view(pages, 4, 8, 128)
        return (k, torch.zeros(pages, 4, 8, 128, dtype=dtype))
    raise AssertionError(kind)


@pytest.mark.parametrize("layout,error", [
    ("contiguous", None), ("offset8", None), ("strided_pages", None), ("padded_slots", None), ("tuple", None),
    ("offset1", r"paged_kv_cache \(k pages\) must start on a 16-byte boundary"),
    ("tuple_odd_offset", r"paged_kv_cache \(k pages\) must start on a 16-byte boundary"),
    ("padded_heads", r"paged_kv_cache: the last dim must be contiguous and consecutive heads 128 elements apart"),
])
def test_run_paged_cache_views(layout, error):
    w, plan = _planned("paged")
    inputs = _run_inputs("paged", plan)
    inputs["paged_kv_cache"] = _cache_view(layout)
    if error:
        with pytest.raises(ValueError, match=error):
            w.run(**inputs)
    else:
        with pytest.raises(NoGPUError):
            w.run(**inputs)


def test_run_variant_tensor_parameters_must_be_dense():
    from tests.gpu.cases import HEAD_SCALE

    w = BatchPrefillWithPagedKVCacheWrapper(workspace(), variant=HEAD_SCALE)
    w.plan(**paged_args())
    inputs = _run_inputs("paged", w._plan)
    with pytest.raises(ValueError, match=r"variant 'head_scale': parameter 'head_scale' must be contiguous"):
        w.run(**inputs, head_scale=torch.ones(64)[::2])
    with pytest.raises(TypeError, match=r"parameter 'head_scale' must be a torch.float32 tensor, got torch.float64"):
        w.run(**inputs, head_scale=torch.ones(32, dtype=torch.float64))
    with pytest.raises(NoGPUError):
        w.run(**inputs, head_scale=torch.ones(33)[1:])  # an offset view: the kernel reads it one float at a time


def test_run_variant_float_parameters_beyond_any_float_are_named():
    from tests.gpu.cases import USER_SIGMOID

    w = BatchPrefillWithPagedKVCacheWrapper(workspace(), variant=USER_SIGMOID)
    w.plan(**paged_args())
    with pytest.raises(ValueError, match=r"^variant 'user_sigmoid': parameter 'scale' must be a finite number, got "
                                         r"an int of 1329 bits"):
        w.run(**_run_inputs("paged", w._plan), scale=10 ** 400, bias=0.0)


@pytest.mark.parametrize("name,good,bad,pattern", [("causal", True, 1, r"causal must be True or False, got int"),
                                                    ("window_left", 1, True, r"window_left must be an int, got bool")])
def test_a_cached_single_plan_is_not_reused_for_an_equal_value_of_another_type(name, good, bad, pattern):
    """single_prefill caches its plan per options: True == 1, so the key holds the types too."""
    q, k = torch.zeros(4, 8, 64, dtype=torch.float16), torch.zeros(6, 2, 64, dtype=torch.float16)
    with pytest.raises(NoGPUError):
        attnjit.single_prefill_with_kv_cache(q, k, k, **{name: good})
    with pytest.raises(TypeError, match=pattern):
        attnjit.single_prefill_with_kv_cache(q, k, k, **{name: bad})


# --- append and merge: checked on the host, then attnjit's own no-GPU error ---------------------------------

_SHARED = torch.zeros(6, 2, 4, 2, 64, dtype=torch.float16)   # a cache an append_key is carved from


def _append_args(**changes):
    cache = torch.zeros(6, 2, 4, 2, 64, dtype=torch.float16)
    args = dict(append_key=torch.zeros(3, 2, 64, dtype=torch.float16),
                append_value=torch.zeros(3, 2, 64, dtype=torch.float16), batch_indices=i32([0, 0, 1]),
                positions=i32([4, 5, 0]), paged_kv_cache=cache, kv_indices=i32([3, 1, 4]), kv_indptr=i32([0, 2, 3]),
                kv_last_page_len=i32([2, 1]))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,exc,pattern", [
    (dict(batch_indices=column_view([0, 0, 1])), ValueError, r"^batch_indices must be contiguous: the kernel reads it"),
    (dict(positions=column_view([4, 5, 0])), ValueError, r"^positions must be contiguous"),
    (dict(kv_indices=column_view([3, 1, 4])), ValueError, r"^kv_indices must be contiguous"),
    (dict(kv_indptr=column_view([0, 2, 3])), ValueError, r"^kv_indptr must be contiguous"),
    (dict(append_key=torch.zeros(3 * 2 * 64 + 1, dtype=torch.float16)[1:].view(3, 2, 64)), ValueError,
     r"^append_key must start on a 16-byte boundary"),
    (dict(append_value=torch.zeros(3, 2, 65, dtype=torch.float16)[..., :64]), ValueError,
     r"^append_value.stride\(0\)=130 elements is not a multiple of 8"),
    (dict(paged_kv_cache=torch.zeros(1, 2, 4, 2, 64, dtype=torch.float16).expand(6, 2, 4, 2, 64)), ValueError,
     r"^paged_kv_cache is written by the kernel but its elements overlap"),
    (dict(paged_kv_cache=(lambda c: (c, c))(torch.zeros(6, 4, 2, 64, dtype=torch.float16))), ValueError,
     r"^paged_kv_cache: k and v share memory"),
    (dict(paged_kv_cache=torch.zeros(6, 2, 4, 2, 64)), TypeError, r"^paged_kv_cache must be torch.float16 or "),
    (dict(paged_kv_cache=torch.zeros(6, 2, 1025, 2, 64, dtype=torch.float16)), ValueError,
     r"^paged_kv_cache has page_size=1025 \(NHD layout\); expected an integer from 1 to 1024"),
    (dict(batch_indices=i32([0, 0, 2])), ValueError, r"^batch_indices\[2\]=2 is outside 0..1"),
    (dict(positions=i32([4, 6, 0])), ValueError, r"^positions\[1\]=6 is outside request 0's KV length 6"),
    (dict(kv_indptr=i32([0, 2, 4])), ValueError, r"^kv_indices has 3 entries but kv_indptr\[-1\]=4"),
    (dict(kv_indptr=i32([0, 3, 2])), ValueError, r"^kv_indptr must be non-decreasing"),
    (dict(kv_indices=i32([3, 1, 6])), ValueError, r"^kv_indices holds page ids outside 0..5"),
    (dict(check="yes"), TypeError, r"^check must be True or False"),
    (dict(positions=i32([4, 4, 0])), ValueError,
     r"^tokens 0 and 1 \(batch_indices 0 / 0, positions 4 / 4\) are both written to page 1 slot 0"),
    (dict(kv_indices=i32([3, 1, 1])), ValueError, r"^tokens 0 and 2 .* are both written to page 1 slot 0"),
    (dict(append_key=_SHARED[0, 0, :3], paged_kv_cache=_SHARED), ValueError,
     r"^append_key shares memory with paged_kv_cache \(k\) "),
])
def test_append_rejects(changes, exc, pattern):
    check = changes.pop("check", True)
    with pytest.raises(exc, match=pattern):
        attnjit.append_paged_kv_cache(**_append_args(**changes), check=check)


@pytest.mark.parametrize("changes", [
    {}, dict(positions=_offset([4, 5, 0])), dict(kv_last_page_len=column_view([2, 1])),
    dict(paged_kv_cache=torch.zeros(12, 2, 4, 2, 64, dtype=torch.float16)[::2]),
    dict(paged_kv_cache=(lambda c: (c[:, 0], c[:, 1]))(torch.zeros(6, 2, 4, 2, 64, dtype=torch.float16))),
    dict(append_key=torch.zeros(3, 2, 72, dtype=torch.float16)[..., :64]),
])
def test_append_accepts_views_it_reads_right(changes):
    with pytest.raises(NoGPUError, match=r"append_paged_kv_cache: paged_kv_cache is on cpu"):
        attnjit.append_paged_kv_cache(**_append_args(**changes), check=True)


@pytest.mark.parametrize("indptr,seq_lens,nnz,pattern", [
    ([0, 2, 3], [6, 1], 5, r"^nnz=5 must equal append_indptr\[-1\]=3"),
    ([0, 3, 2], [6, 1], 2, r"^append_indptr must be non-decreasing"),
    ([1, 2, 3], [6, 1], 3, r"^append_indptr\[0\] must be 0, got 1"),
    ([0, 2, 3], [1, 1], 3, r"^seq_lens\[0\]=1 is less than the 2 tokens request 0 appends"),
    ([], [], 0, r"^append_indptr must have batch_size \+ 1 >= 1 elements, got an empty tensor"),
])
def test_batch_indices_positions_checks_host_metadata(indptr, seq_lens, nnz, pattern):
    with pytest.raises(ValueError, match=pattern):
        attnjit.get_batch_indices_positions(i32(indptr), i32(seq_lens), nnz)


def _state(rows=5, heads=2, dim=64, layout="contiguous"):
    return _view((rows, heads, dim), torch.float16, layout), torch.zeros(rows, heads)


@pytest.mark.parametrize("layout", VIEWS_OK + list(VIEWS_BAD))
def test_merge_state_views(layout):
    va, sa = _state(layout=layout)
    vb, sb = _state()
    sb = torch.zeros(2, 5).t()  # lse is read through its strides: any view
    if layout in VIEWS_BAD:
        with pytest.raises(ValueError, match=r"^v_a(\.stride| must start)"):
            attnjit.merge_state(va, sa, vb, sb)
        with pytest.raises(ValueError, match=r"^v(\.stride| must start)"):
            attnjit.merge_state_in_place(va, sa, vb, sb)
    else:
        with pytest.raises(NoGPUError, match=r"merge_state: v_a is on cpu"):
            attnjit.merge_state(va, sa, vb, sb)
        with pytest.raises(NoGPUError, match=r"merge_state_in_place: v is on cpu"):
            attnjit.merge_state_in_place(va, sa, vb, sb)


def test_merge_in_place_outputs_must_not_overlap_and_masks_must_be_dense():
    v, s = _state()
    vb, sb = _state()
    with pytest.raises(ValueError, match=r"^v is written by the kernel but its elements overlap"):
        attnjit.merge_state_in_place(torch.zeros(1, 2, 64, dtype=torch.float16).expand(5, 2, 64), s, vb, sb)
    with pytest.raises(ValueError, match=r"^s is written by the kernel but its elements overlap"):
        attnjit.merge_state_in_place(v, torch.zeros(1, 2).expand(5, 2), vb, sb)
    with pytest.raises(ValueError, match=r"^mask must be a contiguous bool \[seq=5\] tensor"):
        attnjit.merge_state_in_place(v, s, vb, sb, mask=torch.ones(10, dtype=torch.bool)[::2])


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset1"])
def test_merge_states_views(layout):
    v = _view((4, 3, 2, 64), torch.bfloat16, layout)
    s = torch.zeros(3, 4, 2).transpose(0, 1)
    if layout == "offset1":
        with pytest.raises(ValueError, match=r"^v must start on a 16-byte boundary"):
            attnjit.merge_states(v, s)
    else:
        with pytest.raises(NoGPUError, match=r"merge_states: v is on cpu"):
            attnjit.merge_states(v, s)


def test_the_work_item_and_row_limits_hold_on_the_one_item_a_request_path():
    """A batch of one-row requests (decode, or prefill with a single token each) takes the scheduler's one-item-per-
    request path: it refuses more than MAX_WORK_ITEMS items as the split path does, and decode more than MAX_QO_ROWS
    requests, each by name (before the work list or the reader's arrays are built)."""
    from attnjit.ops.planner import MAX_QO_ROWS
    from attnjit.ops.scheduler import MAX_WORK_ITEMS

    ws = torch.zeros(32 << 20, dtype=torch.uint8)
    z = torch.zeros(1, dtype=torch.int32)
    n = MAX_WORK_ITEMS + 1
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    with pytest.raises(ValueError, match=rf"would need {n} work items"):
        w.plan(torch.arange(n + 1, dtype=torch.int32), z.expand(n), torch.ones(1, dtype=torch.int32).expand(n), 32, 8,
               128, 4, q_data_type=torch.float16)
    big = MAX_QO_ROWS + 1
    with pytest.raises(ValueError, match=rf"a batch of {big} requests"):
        w.plan(torch.zeros(1, dtype=torch.int32).expand(big + 1), z.expand(1), z.expand(big), 32, 8, 128, 4,
               q_data_type=torch.float16)
    w.plan(i32([0, 1]), i32([0]), i32([1]), 32, 8, 128, 4, q_data_type=torch.float16)   # still plans


def test_single_prefill_checks_the_mask_shape_and_lengths_by_name():
    q = torch.zeros(4, 8, 64, dtype=torch.float16)
    k = torch.zeros(6, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"custom_mask must be \[qo_len, kv_len\] = \[4, 6\] .* got \[6, 4\]"):
        attnjit.single_prefill_with_kv_cache(q, k, k, custom_mask=torch.ones(6, 4, dtype=torch.bool))
    for mask in (torch.ones(4, 6, dtype=torch.bool), torch.ones(24, dtype=torch.bool)):
        with pytest.raises(NoGPUError):
            attnjit.single_prefill_with_kv_cache(q, k, k, custom_mask=mask)
    huge = torch.zeros(1, 2, 64, dtype=torch.float16).expand(2 ** 31, 2, 64)
    with pytest.raises(ValueError, match=r"^k has 2147483648 tokens: more than one request takes"):
        attnjit.single_prefill_with_kv_cache(q, huge, huge)
    with pytest.raises(ValueError, match=r"^q has 2147483648 tokens"):
        attnjit.single_prefill_with_kv_cache(torch.zeros(1, 8, 64, dtype=torch.float16).expand(2 ** 31, 8, 64), k, k)
