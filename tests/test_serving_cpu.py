"""Issue 14 on a CPU workspace: FlashInfer's remaining semantics (empty decode histories, use_tensor_cores, ROPE_LLAMA,
the wrapper aliases), attention sinks (plan, run checks, the variant rules) and their specs, keys and compiles.
The numbers are pinned by tests/gpu/test_serving.py against float64 references."""

from __future__ import annotations

import math

import pytest
import torch

import attnjit
from attnjit import reference
from attnjit import variants as V
from attnjit.generator import PARAMS, render
from attnjit.ops.attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                                   BatchPrefillWithRaggedKVCacheWrapper)
from attnjit.ops.sinks import BatchAttentionWithAttentionSinkWrapper
from attnjit.specs import AttentionSpec
from tests.gpu.cases import GAINS
from tests.cpu_support import assert_no_spills, compile_kernel
from tests.helpers import i32

H_Q, H_KV, D, PS = 32, 8, 128, 4
SEED = dict(qo_indptr=[0, 3, 4, 8], paged_kv_indptr=[0, 2, 3, 6], paged_kv_indices=[7, 2, 11, 3, 14, 6],
            paged_kv_last_page_len=[2, 2, 1])
_SCALE = PARAMS["attention"].index["sm_scale_log2"]


def ws() -> torch.Tensor:
    return torch.empty(32 << 20, dtype=torch.uint8)


def plan_prefill(w, **kw):
    args = dict(causal=True, q_data_type=torch.float16)
    args.update(kw)
    w.plan(i32(SEED["qo_indptr"]), i32(SEED["paged_kv_indptr"]), i32(SEED["paged_kv_indices"]),
           i32(SEED["paged_kv_last_page_len"]), H_Q, H_KV, D, PS, **args)
    return w


def inputs():
    return torch.randn(8, H_Q, D, dtype=torch.float16), torch.randn(15, 2, PS, H_KV, D, dtype=torch.float16)


# --- empty decode histories, use_tensor_cores ---------------------------------------------------------------------

def test_decode_plans_requests_with_an_empty_history():
    w = BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(i32([0, 2, 2, 5]), i32([7, 2, 3, 14, 6]), i32([2, 0, 1]), H_Q, H_KV, D, PS, q_data_type=torch.bfloat16)
    records = {int(r[0]): [int(x) for x in r] for r in w._plan.work.records}
    assert sorted(records) == [0, 1, 2], "every request has a work item (the empty one writes zeros and -inf)"
    assert records[1][2:4] == [0, 0] and records[1][10] == 0  # kv range [0, 0), kv length 0
    assert w._plan.total_q == 3
    with pytest.raises(ValueError, match=r"last_page_len\[1\]=3 but request 1 has no pages"):
        w.plan(i32([0, 2, 2, 5]), i32([7, 2, 3, 14, 6]), i32([2, 3, 1]), H_Q, H_KV, D, PS)


@pytest.mark.parametrize("flag", [False, True])
def test_use_tensor_cores_is_an_argument_an_attribute_and_a_recorded_decision(flag):
    w = BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=flag)
    assert w.use_tensor_cores is flag
    w.plan(i32([0, 2, 3, 6]), i32(SEED["paged_kv_indices"]), i32([2, 2, 1]), H_Q, H_KV, D, PS)
    assert w.last_plan["use_tensor_cores"] is flag and w.last_plan["tensor_cores"] is True
    assert w._plan.spec.op == "decode"  # the same decode kernels either way (they are mma.sync kernels)
    with pytest.raises(TypeError, match=r"use_tensor_cores must be True or False, got str"):
        BatchDecodeWithPagedKVCacheWrapper(ws(), use_tensor_cores="yes")
    q = torch.zeros(3, H_Q, D, dtype=torch.float16)
    k = torch.zeros(5, H_KV, D, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"use_tensor_cores must be True or False, got str"):
        attnjit.single_decode_with_kv_cache(q[0], k, k, use_tensor_cores="yes")
    with pytest.raises(TypeError, match=r"enable_pdl must be True or False, got str"):
        w.run(q, torch.zeros(8, 2, PS, H_KV, D, dtype=torch.float16), enable_pdl="x")


# --- ROPE_LLAMA ---------------------------------------------------------------------------------------------------

def test_rope_llama_is_a_builtin_variant_with_flashinfer_frequencies():
    w = plan_prefill(BatchPrefillWithPagedKVCacheWrapper(ws()), pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0,
                     rope_theta=5e5)
    spec = w._plan.spec
    assert [p.name for p in spec.variant.parts] == ["rope_llama"]
    freqs = w._plan.binding.bound["rope_freqs"]
    want = torch.tensor([5e5 ** (-2.0 * f / D) / 2.0 for f in range(D // 2)], dtype=torch.float64)
    assert freqs.dtype == torch.float32 and freqs.shape == (D // 2,)
    assert torch.allclose(freqs.double(), want, rtol=1e-6)
    assert w._plan.binding.required == []  # nothing for run() to pass
    src = render(spec).source
    assert "HAS_KEY_TRANSFORM = true" in src and "HAS_QUERY_TRANSFORM = true" in src
    d = BatchDecodeWithPagedKVCacheWrapper(ws())
    d.plan(i32([0, 2, 3, 6]), i32(SEED["paged_kv_indices"]), i32([2, 2, 1]), H_Q, H_KV, D, PS,
           pos_encoding_mode="ROPE_LLAMA")
    assert [p.name for p in d._plan.spec.variant.parts] == ["rope_llama"]
    assert torch.allclose(d._plan.binding.bound["rope_freqs"].double(),
                          torch.tensor(V.rope_freqs(D, 1.0, 1e4), dtype=torch.float64), rtol=1e-6)


@pytest.mark.parametrize("mode", ["NONE", "ROPE_LLAMA", "ALIBI"])
@pytest.mark.parametrize("rope", [{}, dict(rope_scale=2.5, rope_theta=5e5), dict(rope_scale=8.0)])
@pytest.mark.parametrize("sm_scale", [None, 0.3])
def test_the_logit_scale_is_the_same_whatever_the_position_encoding(mode, rope, sm_scale):
    """A RoPE range check once reused the name of the logit scale: every ROPE_LLAMA plan then ran with sm_scale =
    rope_scale (1.0, not 1/sqrt(D)), a silent wrong answer on the GPU the CPU tests did not see. The plan's logit
    scale is sm_scale (default 1/sqrt(D)) times log2(e), whatever pos_encoding_mode, rope_scale and rope_theta."""
    expect = (0.3 if sm_scale is not None else 1.0 / math.sqrt(D)) * math.log2(math.e)
    w = BatchPrefillWithPagedKVCacheWrapper(ws())
    plan_prefill(w, pos_encoding_mode=mode, sm_scale=sm_scale, **rope)
    assert w._plan.sm_scale_log2 == pytest.approx(expect, rel=1e-12)
    d = BatchDecodeWithPagedKVCacheWrapper(ws())
    d.plan(i32([0, 2, 3, 6]), i32(SEED["paged_kv_indices"]), i32([2, 2, 1]), H_Q, H_KV, D, PS,
           pos_encoding_mode=mode, sm_scale=sm_scale, **rope)
    assert d._plan.sm_scale_log2 == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("changes,named", [(dict(rope_scale=1e-40), "rope_scale=1e-40"),
                                           (dict(rope_theta=1e-300), "rope_theta=1e-300")])
def test_rope_frequencies_beyond_float32_are_refused(changes, named):
    """theta^(-2f/D) / rope_scale as float32 inf (or pos * freq overflowing) would rotate q and k by NaN."""
    w = BatchPrefillWithPagedKVCacheWrapper(ws())
    with pytest.raises(ValueError, match=rf"{named}.*RoPE frequencies up to 2\*\*\d+.*float32"):
        plan_prefill(w, pos_encoding_mode="ROPE_LLAMA", **changes)
    assert w.last_plan is None
    plan_prefill(w, **changes)  # without ROPE_LLAMA the values are unused


def test_rope_rotates_before_a_user_query_transform_and_each_part_sees_the_transformed_pair():
    w = plan_prefill(BatchPrefillWithPagedKVCacheWrapper(ws(), variant=GAINS), pos_encoding_mode="ROPE_LLAMA")
    assert [p.name for p in w._plan.spec.variant.parts] == ["rope_llama", "gains"]
    src = render(w._plan.spec).source
    body = src.split("void query_transform_pair(")[1].split("\n  }\n")[0]
    assert body.index("rope_llama_.query_transform(a, b,") < body.index("gains_.query_transform(a, b,")
    assert "const float b2 = gains_.query_transform(b, a," in body  # the pair is the predecessor's output


def test_a_key_transform_variant_declares_its_hook_and_variables():
    v = attnjit.Variant("kscale", params={"s": float}, key_transform="return k * s + 0.f * k_pair;")
    assert v.hook("key_transform") and V.HOOK_RETURNS["key_transform"] == "float"
    assert V.HOOK_VARIABLES["key_transform"][:3] == ("k", "k_pair", "dim")
    spec = AttentionSpec(op="decode", head_dim=64, page_size=16, dtype="bf16", group_size=4, variant=v)
    assert "kscale_.key_transform(a, b, dim_a" in render(spec).source


# --- attention sinks ----------------------------------------------------------------------------------------------

def test_sinks_are_a_plan_choice_and_run_requires_them():
    q, cache = inputs()
    w = plan_prefill(BatchPrefillWithPagedKVCacheWrapper(ws()), sinks=True, window_left=3)
    assert [p.name for p in w._plan.spec.variant.parts] == ["sliding_window", "attention_sink"]
    assert "HAS_SINK = true" in render(w._plan.spec).source
    with pytest.raises(TypeError, match=r"variant 'sliding_window_attention_sink' needs parameter 'sinks'"):
        w.run(q, cache)
    with pytest.raises(ValueError, match=r"one value per qo_head: 32 elements expected, got 8"):
        w.run(q, cache, sinks=torch.zeros(8))
    with pytest.raises(TypeError, match=r"must be a torch.float32 tensor"):
        w.run(q, cache, sinks=torch.zeros(H_Q, dtype=torch.float16))
    with pytest.raises(attnjit.NoGPUError):  # valid: it gets as far as needing a GPU
        w.run(q, cache, sinks=torch.zeros(H_Q))


@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
def test_sinks_given_to_a_plan_without_them_are_an_error_not_ignored(kind):
    q, cache = inputs()
    if kind == "paged":
        w = plan_prefill(BatchPrefillWithPagedKVCacheWrapper(ws()))
        call = lambda **kw: w.run(q, cache, **kw)  # noqa: E731
    elif kind == "decode":
        w = BatchDecodeWithPagedKVCacheWrapper(ws())
        w.plan(i32([0, 2, 3, 6]), i32(SEED["paged_kv_indices"]), i32([2, 2, 1]), H_Q, H_KV, D, PS,
               q_data_type=torch.float16)
        call = lambda **kw: w.run(q[:3], cache, **kw)  # noqa: E731
    else:
        w = BatchPrefillWithRaggedKVCacheWrapper(ws())
        w.plan(i32(SEED["qo_indptr"]), i32([0, 6, 8, 17]), H_Q, H_KV, D, causal=True, q_data_type=torch.float16)
        k = torch.randn(17, H_KV, D, dtype=torch.float16)
        call = lambda **kw: w.run(q, k, k.clone(), **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"run\(sinks=\.\.\.\): this plan has no attention sink.*sinks=True"):
        call(sinks=torch.zeros(H_Q))
    with pytest.raises(attnjit.NoGPUError):
        call()


def test_the_sink_wrapper_takes_sinks_and_sm_scale_as_flashinfer_does():
    q, cache = inputs()
    w = plan_prefill(BatchAttentionWithAttentionSinkWrapper(ws(), window_left=7), window_left=7, sm_scale=0.5)
    assert w._plan.spec.variant.hook("sink") is None  # a composition: its parts hold the hooks
    assert any(p.hook("sink") for p in w._plan.spec.variant.parts)
    with pytest.raises(TypeError, match=r"needs the sinks"):
        w.run(q, cache)
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache, torch.zeros(H_Q), 0.25)
    assert math.isclose(w._plan.attn_values[_SCALE], 0.25 * math.log2(math.e), rel_tol=1e-12)
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache, sinks=torch.zeros(H_Q))  # no sm_scale: the plan's again
    assert math.isclose(w._plan.attn_values[_SCALE], 0.5 * math.log2(math.e), rel_tol=1e-12)
    with pytest.raises(ValueError, match=r"sm_scale must be a positive finite number"):
        w.run(q, cache, torch.zeros(H_Q), -1.0)
    with pytest.raises(ValueError, match=r"every plan has the sink"):
        plan_prefill(w, sinks=False)


@pytest.mark.parametrize("sm_scale", [1e39, 1e-45])
def test_the_sink_wrappers_run_sm_scale_must_fit_float32_as_plans_does(sm_scale):
    q, cache = inputs()
    w = plan_prefill(BatchAttentionWithAttentionSinkWrapper(ws()), sm_scale=0.5)
    with pytest.raises(ValueError, match=r"^sm_scale=.* is outside the float32 range"):
        w.run(q, cache, torch.zeros(H_Q), sm_scale)
    assert math.isclose(w._plan.sm_scale_log2, 0.5 * math.log2(math.e), rel_tol=1e-12)


def test_a_failed_replan_leaves_the_sink_wrappers_last_plan_and_its_scale_whole():
    q, cache = inputs()
    w = plan_prefill(BatchAttentionWithAttentionSinkWrapper(ws()), sm_scale=0.5)
    with pytest.raises(ValueError, match=r"sm_scale"):
        plan_prefill(w, sm_scale=-3.0)
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache, sinks=torch.zeros(H_Q))  # the last good plan's scale, not a TypeError
    assert math.isclose(w._plan.attn_values[_SCALE], 0.5 * math.log2(math.e), rel_tol=1e-12)


def test_variant_rules_for_sinks():
    other = attnjit.Variant("other_sink", params={"s2": float}, sink="return s2;")
    with pytest.raises(ValueError, match=r"both declare a sink"):
        V.compose(V.SINK, other)
    with pytest.raises(ValueError, match=r"a sink joins the softmax denominator"):
        attnjit.Variant("bad", sink="return 0.f;", logits_transform="return logit;", use_softmax=False)
    with pytest.raises(ValueError, match=r"declares a sink.*use_softmax=False part"):
        V.compose(V.SINK, V.SIGMOID)


def test_reference_sink_is_a_zero_value_key_in_the_softmax():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 2, 8, generator=gen, dtype=torch.float64) for n in (3, 5, 5))
    sinks = torch.tensor([0.7, -1.5], dtype=torch.float64)
    o, lse = reference.attention(q, k, v, causal=True, hooks=reference.Hooks(sink=lambda p: sinks))
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(8)
    s = s.masked_fill(~reference.causal_visible(3, 5)[None], -math.inf)
    denom = s.exp().sum(-1) + sinks.exp()[:, None]                    # [H, Q]
    want = torch.einsum("hqk,khd->qhd", s.exp() / denom[..., None], v)
    assert torch.allclose(o, want) and torch.allclose(lse, (denom.log() / math.log(2)).T)
    # a row with no visible key: o = 0, lse = the sink (log2); and the state merges exactly with one over more keys
    o0, lse0 = reference.attention(q, k[:0], v[:0], causal=False, hooks=reference.Hooks(sink=lambda p: sinks))
    assert torch.equal(o0, torch.zeros_like(o0)) and torch.allclose(lse0, (sinks / math.log(2)).expand(3, 2))
    o_rest, lse_rest = reference.attention(q, k, v, causal=False)
    merged, merged_lse = reference.merge_state(o0, lse0, o_rest, lse_rest)
    full, full_lse = reference.attention(q, k, v, causal=False, hooks=reference.Hooks(sink=lambda p: sinks))
    assert torch.allclose(merged, full) and torch.allclose(merged_lse, full_lse)


# --- FlashInfer's aliases -----------------------------------------------------------------------------------------

class _Calls:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "ran"


@pytest.mark.parametrize("make", [BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper,
                                  BatchPrefillWithRaggedKVCacheWrapper, BatchAttentionWithAttentionSinkWrapper])
def test_flashinfer_aliases_exist_on_every_wrapper(make):
    for name in ("plan", "run", "begin_forward", "run_return_lse", "forward", "forward_return_lse", "end_forward",
                 "is_cuda_graph_enabled"):
        assert hasattr(make, name), name
    w = make(ws())
    assert w.end_forward() is None
    with pytest.raises(RuntimeError, match=r"forward\(\) called before plan\(\)"):
        w.forward(None, None)


def test_begin_forward_is_plan_and_run_return_lse_is_run_with_lse():
    q, cache = inputs()
    w = BatchPrefillWithPagedKVCacheWrapper(ws())
    w.begin_forward(i32(SEED["qo_indptr"]), i32(SEED["paged_kv_indptr"]), i32(SEED["paged_kv_indices"]),
                    i32(SEED["paged_kv_last_page_len"]), H_Q, H_KV, D, PS, causal=True, q_data_type=torch.float16)
    assert w._plan is not None and w._plan.spec.mask == "causal"
    w.run = _Calls()
    assert w.run_return_lse(q, cache) == "ran"
    assert w.run.calls[-1] == ((q, cache), {"return_lse": True})
    assert w.forward_return_lse(q, cache, causal=True) == "ran"
    assert w.run.calls[-1] == ((q, cache), {"return_lse": True})


def test_forward_takes_the_plans_options_and_rejects_others():
    q, cache = inputs()
    w = plan_prefill(BatchPrefillWithPagedKVCacheWrapper(ws()), logits_soft_cap=30.0, window_left=4)
    w.run = _Calls()
    assert w.forward(q, cache, causal=True, window_left=4, logits_soft_cap=30.0, pos_encoding_mode="NONE",
                     sm_scale=1 / math.sqrt(D), use_fp16_qk_reduction=False, k_scale=None) == "ran"
    assert w.run.calls[-1] == ((q, cache), {"k_scale": None})
    for name, value in (("causal", False), ("window_left", -1), ("logits_soft_cap", 0.0), ("sm_scale", 0.1),
                        ("pos_encoding_mode", "ROPE_LLAMA"), ("use_fp16_qk_reduction", True)):
        with pytest.raises(ValueError, match=rf"forward\({name}=.*differs from the plan's {name}=.*pass {name} to "
                                             r"plan\(\)"):
            w.forward(q, cache, **{name: value})


# --- compiles (real nvcc) -----------------------------------------------------------------------------------------

def _compile(tmp_path, spec) -> str:
    return compile_kernel(tmp_path, spec)[0]


@pytest.mark.nvcc
@pytest.mark.parametrize("family,op,variant", [("sm90", "prefill", "rope"), ("sm90", "prefill", "sink_window"),
                                               ("fa2", "decode", "rope_sink")])
def test_rope_and_sink_kernels_compile_without_spills(tmp_path, family, op, variant):
    """The key transform and the sink in both families compile for sm_90a; the sm90 kernels and the decode kernels
    do not spill (fa2's wide prefill tile, at 255 registers already, is the one that may)."""
    v = {"rope": V.ROPE_LLAMA, "sink_window": V.compose(V.SLIDING_WINDOW, V.SINK),
         "rope_sink": V.compose(V.ROPE_LLAMA, V.SINK)}[variant]
    kw = dict(mask="causal") if op == "prefill" else {}
    spec = AttentionSpec(op=op, head_dim=128, page_size=16, dtype="bf16", group_size=4, family=family, variant=v,
                         **kw)
    assert_no_spills(_compile(tmp_path, spec))


# --- cascade: plan() validation -----------------------------------------------------------------------------------

from attnjit.ops.cascade import MultiLevelCascadeAttentionWrapper  # noqa: E402
from tests.helpers import make_cascade  # noqa: E402


def _cascade(levels=(((3, 40),), ((1, 5), (2, 9))), qo=(1, 2, 1)):
    return make_cascade(list(qo), [list(lv) for lv in levels], page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV,
                        head_dim=D, dtype=torch.float16)


def test_cascade_plans_each_level_with_causal_on_the_last_only():
    b = _cascade()
    w = MultiLevelCascadeAttentionWrapper(2, ws(), "NHD")
    w.plan(*b.arrays("cpu"), H_Q, H_KV, D, PS, causal=True, q_data_type=torch.float16)
    prefix, suffix = w._batch_prefill_wrappers
    assert prefix._plan.spec.mask == "none" and suffix._plan.spec.mask == "causal"
    assert prefix._plan.batch_size == 1 and suffix._plan.batch_size == 2
    assert [r[10] for r in prefix._plan.work.records] == [40]  # one group: the prefix read once
    assert len(w.last_plan) == 2 and w.num_levels == 2 and not w.is_cuda_graph_enabled
    o, lse = w._scratch[0]
    assert o.shape == (4, H_Q, D) and o.dtype == torch.float16 and lse.shape == (4, H_Q)
    with pytest.raises(attnjit.NoGPUError):  # checked against the plan: it gets as far as needing a GPU
        w.run(torch.randn(4, H_Q, D).half(), b.cache)
    with pytest.raises(ValueError, match=r"q must be torch.float16 \[4, 32, 128\]"):
        w.run(torch.randn(5, H_Q, D).half(), b.cache)


def test_cascade_three_levels_plan():
    b = _cascade(levels=(((4, 33),), ((2, 8), (2, 17)), ((1, 3), (1, 1), (1, 6), (1, 2))), qo=(1, 1, 1, 1))
    w = MultiLevelCascadeAttentionWrapper(3, ws())
    w.plan(*b.arrays("cpu"), H_Q, H_KV, D, PS, q_data_type=torch.float16)
    assert [lw._plan.batch_size for lw in w._batch_prefill_wrappers] == [1, 2, 4]
    assert len(w._scratch) == 2


CASCADE_BAD = {
    "not a list": (dict(qo_indptr_arr=i32([0, 3])), TypeError, r"qo_indptr_arr must be a list of 2 tensors"),
    "wrong level count": (dict(paged_kv_indptr_arr=[i32([0, 10])]), ValueError,
                          r"paged_kv_indptr_arr has 1 entries; this wrapper has num_levels=2"),
    "rows differ": (dict(qo_indptr_arr=[i32([0, 3]), i32([0, 1, 4])]), ValueError,
                    r"qo_indptr_arr\[0\]\[-1\]=3 but qo_indptr_arr\[1\]\[-1\]=4"),
    "window": (dict(window_left=8), NotImplementedError, r"window_left=8 with 2 cascade levels"),
    "rope": (dict(pos_encoding_mode="ROPE_LLAMA"), NotImplementedError,
             r"pos_encoding_mode='ROPE_LLAMA' with 2 cascade levels"),
    "sinks": (dict(sinks=True), NotImplementedError, r"sinks is not supported by the cascade wrapper"),
    "custom mask": (dict(custom_mask=torch.ones(32, dtype=torch.bool)), NotImplementedError,
                    r"custom_mask is not supported by the cascade wrapper"),
    "a one-element mask equal to False": (dict(packed_custom_mask=torch.zeros(1, dtype=torch.uint8)),
                                          NotImplementedError, r"packed_custom_mask is not supported by the cascade"),
    "window tensor": (dict(window_left=torch.tensor([3, 4])), TypeError, r"window_left must be an int, got Tensor"),
    "level error names the level": (dict(paged_kv_last_page_len=[i32([9]), i32([1, 1])]), ValueError,
                                    r"cascade level 0: paged_kv_last_page_len\[0\]=9 is outside 1..page_size=4"),
    "causal suffix shorter than queries": (dict(qo_indptr_arr=[i32([0, 3]), i32([0, 1, 3])],
                                                paged_kv_last_page_len=[i32([4]), i32([1, 1])],
                                                paged_kv_indptr_arr=[i32([0, 10]), i32([0, 1, 2])], causal=True),
                                           ValueError, r"cascade level 1: qo_indptr: request 1 has 2 query rows"),
}


@pytest.mark.parametrize("name", list(CASCADE_BAD))
def test_cascade_plan_rejects(name):
    changes, exc, pattern = CASCADE_BAD[name]
    b = _cascade()
    qo, kvp, idx, last = b.arrays("cpu")
    args = dict(qo_indptr_arr=qo, paged_kv_indptr_arr=kvp, paged_kv_indices_arr=idx, paged_kv_last_page_len=last,
                num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, page_size=PS, q_data_type=torch.float16)
    args.update(changes)
    w = MultiLevelCascadeAttentionWrapper(2, ws())
    with pytest.raises(exc, match=pattern):
        w.plan(**args)
    assert w.last_plan is None


def test_cascade_constructor_checks():
    with pytest.raises(ValueError, match=r"num_levels must be 1..16, got 0"):
        MultiLevelCascadeAttentionWrapper(0, ws())
    with pytest.raises(TypeError, match=r"num_levels must be an int"):
        MultiLevelCascadeAttentionWrapper(2.0, ws())
    with pytest.raises(ValueError, match=r"fixed buffers are for use_cuda_graph=True"):
        MultiLevelCascadeAttentionWrapper(2, ws(), qo_indptr_buf_arr=[i32([0, 1]), i32([0, 1])])
    with pytest.raises(ValueError, match=r"qo_indptr_buf_arr has 1 entries"):
        MultiLevelCascadeAttentionWrapper(2, ws(), use_cuda_graph=True, qo_indptr_buf_arr=[i32([0, 1])])
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        MultiLevelCascadeAttentionWrapper(2, ws()).run(torch.zeros(1, H_Q, D), None)
    assert attnjit.MultiLevelCascadeAttentionWrapper is MultiLevelCascadeAttentionWrapper


# --- any page size (1..1024) --------------------------------------------------------------------------------------

from attnjit.families import fa2 as fa2_family  # noqa: E402


@pytest.mark.parametrize("page_size", [1, 3, 5, 48, 100, 528, 1000, 1024])
def test_any_page_size_is_a_spec_and_plans(page_size):
    for op, kw in (("prefill", dict(mask="causal")), ("decode", {})):
        spec = AttentionSpec(op=op, head_dim=128, page_size=page_size, dtype="bf16", group_size=4, **kw)
        assert spec.page_size == page_size and f"p{page_size}-" in spec.short_name()
    AttentionSpec(op="append_kv", head_dim=128, page_size=page_size, dtype="bf16")
    kv_lens = [1, page_size, page_size + 1, 3 * page_size - 1]
    pages = [-(-k // page_size) for k in kv_lens]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    last = [k - page_size * (n - 1) for k, n in zip(kv_lens, pages)]
    w = BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(i32(indptr), i32(list(range(indptr[-1]))), i32(last), H_Q, H_KV, D, page_size, disable_split_kv=True)
    assert sorted(r[10] for r in w._plan.work.records) == sorted(kv_lens)
    assert w._plan.spec.page_size == page_size


@pytest.mark.parametrize("cta_kv,page_size,want", [(64, 16, 4), (64, 1, 64), (64, 64, 1), (64, 128, 1), (64, 1024, 1),
                                                   (64, 48, 3), (64, 3, 23), (64, 528, 2), (128, 48, 4), (32, 96, 1)])
def test_pages_a_tile_can_touch(cta_kv, page_size, want):
    """A tile of cta_kv tokens from a multiple of cta_kv: the most pages it touches, checked by brute force."""
    assert fa2_family.pages_per_tile_of(cta_kv, page_size) == want
    worst = max(len({j // page_size for j in range(t * cta_kv, (t + 1) * cta_kv)}) for t in range(4 * page_size))
    assert worst <= want


@pytest.mark.nvcc
@pytest.mark.parametrize("family,op,page_size,layout", [("fa2", "prefill", 48, "HND"), ("sm90", "prefill", 528, "NHD"),
                                                         ("sm90", "prefill", 3, "NHD"), ("fa2", "decode", 5, "NHD"),
                                                         ("fa2", "decode", 1024, "HND")])
def test_non_power_of_two_pages_compile(tmp_path, family, op, page_size, layout):
    """Kernels for pages that do not nest with the KV tile compile for sm_90a (the template's static_asserts check
    the Python tile's shared-memory size against the traits, page ids per tile included); the sm90 and decode
    kernels do not spill."""
    kw = dict(mask="causal") if op == "prefill" else {}
    spec = AttentionSpec(op=op, head_dim=128, page_size=page_size, dtype="bf16", group_size=4, family=family,
                         layout=layout, **kw)
    log = _compile(tmp_path, spec)
    if family == "sm90" or op == "decode":
        assert_no_spills(log)
    _compile(tmp_path, AttentionSpec(op="append_kv", head_dim=128, page_size=page_size, dtype="bf16", layout=layout))
