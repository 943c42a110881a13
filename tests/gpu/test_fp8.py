"""FP8 KV cache on the GPU beyond the matrix (tests/gpu/cases.py FP8 runs every format, scale kind, q type, split
mode and kv kind against the float64 reference): the scales are really applied, a 16-bit plan takes float scales
as FlashInfer does, plan() runs fp8 prefill on sm90 by itself, and the single-request helpers read fp8."""

from __future__ import annotations

import math

import pytest
import torch

import attnjit
from attnjit import reference

from ..helpers import (assert_close, assert_lse_close, fp8_scales, i32, make_paged, make_ragged, poisoned, quantize,
                       quantize_cache)
from .cases import DEC_MED, MIXED_KV, MIXED_QO

DEV = "cuda"
H_Q, H_KV, D, PS = 32, 8, 128, 16


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(128 << 20, dtype=torch.uint8, device=DEV)


def _decode(workspace, kv="e4m3", dtype=torch.bfloat16, split=True):
    b = make_paged((1,) * len(DEC_MED), DEC_MED, page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=dtype, device=DEV, seed=5)
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
    w.plan(*(i32(x, DEV) for x in (b.kv_indptr, b.kv_indices, b.last_page_len)), H_Q, H_KV, D, PS, q_data_type=dtype,
           kv_data_type=kv, disable_split_kv=not split)
    return b, w


def _run(w, b, cache, **scales):
    out, lse = poisoned(b.q.shape, b.q.dtype, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
    w.run(b.q, cache, out=out, lse=lse, **scales)
    torch.cuda.synchronize()
    return out, lse


def _ref(b, cache, **scales):
    return reference.batch_decode(b.q, cache, b.kv_indptr, b.kv_indices, b.last_page_len, page_size=PS, **scales)


@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_v_scale_scales_the_output_and_k_scale_the_logits(workspace, split):
    b, w = _decode(workspace, split=split)
    cache = quantize_cache(b.cache, 1 / 32, 1 / 32, "NHD", torch.float8_e4m3fn)
    o1, lse1 = _run(w, b, cache, k_scale=1 / 32, v_scale=1 / 32)
    o2, lse2 = _run(w, b, cache, k_scale=1 / 32, v_scale=3 / 32)
    assert_close(o2, o1.double() * 3, torch.bfloat16, "out with v_scale x3")
    assert torch.equal(lse1, lse2)   # v_scale does not touch lse
    o3, lse3 = _run(w, b, cache, k_scale=1 / 16, v_scale=1 / 32)
    assert not torch.allclose(lse3, lse1) and not torch.allclose(o3.float(), o1.float(), atol=1e-2)
    ref_o, ref_lse = _ref(b, cache, k_scale=1 / 16, v_scale=1 / 32)
    assert_close(o3, ref_o, torch.bfloat16)
    assert_lse_close(lse3, ref_lse)
    # per-head tensors: each KV head's own scales (heads 0 and 1 differ), and the defaults (1) without scales
    ks, vs = fp8_scales("tensor", H_KV, DEV)
    o4, lse4 = _run(w, b, cache, k_scale=ks, v_scale=vs)
    ref_o, ref_lse = _ref(b, cache, k_scale=ks, v_scale=vs)
    assert_close(o4, ref_o, torch.bfloat16)
    assert_lse_close(lse4, ref_lse)
    o5, lse5 = _run(w, b, cache)
    ref_o, ref_lse = _ref(b, cache)
    # unscaled, the cache holds 32x the data, so the output is 32x larger: compare on the data's scale (dividing by
    # a power of two is exact), where the bf16 tolerances hold
    assert_close(o5.double() / 32, ref_o / 32, torch.bfloat16)
    assert_lse_close(lse5, ref_lse)


def test_a_16_bit_plan_applies_float_scales_as_flashinfer(workspace):
    """FlashInfer applies k_scale (in sm_scale) and v_scale (out *= v_scale) whatever the cache type."""
    b, w = _decode(workspace, kv=None)
    out, lse = _run(w, b, b.cache, k_scale=0.5, v_scale=2.0)
    ref_o, ref_lse = _ref(b, b.cache, k_scale=0.5, v_scale=2.0)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("op", ["decode", "prefill-fa2", "prefill-sm90"])
def test_bf16_q_of_any_magnitude_over_fp8(workspace, op):
    """A bf16 q runs the fp8 kernels' fp16 mma through a per-row power-of-two rescale (fa2/fp8_frags.cuh): heads whose
    q spans 1e-30 .. 1e6 (past fp16's 65504 and far below its subnormals), sharing one CTA's packed rows, each match
    the float64 reference. Without the rescale the large rows overflow to inf and the small ones flush to zero.
    (The top keeps the softmax's logits, in log2 units, well under 2^31 (here ~3e7). Beyond about 2^31 the fp32
    online softmax loses the max key: exp2 of its rounding residual, s * scale - round(s * scale), over- or
    underflows. Measured here at q ~ 5e8 (lse 2.5e9: non-finite rows); the 16-bit kernels' softmax computes the
    same way, so it is a limit of the fp32 softmax, not of the fp8 path.)"""
    op, _, family = op.partition("-")
    qo = (1,) * len(DEC_MED) if op == "decode" else MIXED_QO
    b = make_paged(qo, DEC_MED if op == "decode" else MIXED_KV, page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV,
                   head_dim=D, dtype=torch.bfloat16, device=DEV, seed=31)
    order = torch.randperm(H_Q, generator=torch.Generator().manual_seed(3))
    mag = torch.logspace(-30, 6, H_Q, dtype=torch.float64)[order]
    q = (b.q.double() * mag.to(DEV)[None, :, None]).to(torch.bfloat16)
    ks, vs = fp8_scales("float", H_KV, DEV)
    cache = quantize_cache(b.cache, ks, vs, "NHD", torch.float8_e4m3fn)
    meta = (b.kv_indptr, b.kv_indices, b.last_page_len)
    if op == "decode":
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
        w.plan(*(i32(x, DEV) for x in meta), H_Q, H_KV, D, PS, q_data_type=torch.bfloat16, kv_data_type="e4m3")
    else:
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, backend={"sm90": "fa3"}.get(family, family))
        w.plan(*b.tensors(DEV), H_Q, H_KV, D, PS, causal=True, q_data_type=torch.bfloat16, kv_data_type="e4m3")
        assert w.last_plan["family"] == family
    out, lse = poisoned(q.shape, torch.bfloat16, DEV), poisoned(q.shape[:2], torch.float32, DEV)
    w.run(q, cache, out=out, lse=lse, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference.batch_paged(q, cache, b.qo_indptr, *meta, page_size=PS, causal=op == "prefill",
                                           k_scale=ks, v_scale=vs)
    assert_close(out, ref_o, torch.bfloat16)
    # lse grows with |q| (up to ~3e7 here): its error is relative to it
    err = (lse.double() - ref_lse.to(DEV)).abs()
    assert (err <= 5e-3 + 1e-3 * ref_lse.to(DEV).abs()).all(), err.max()


def test_fp8_prefill_runs_on_sm90_by_itself(workspace):
    """On sm_90a a wide batch over an fp8 cache runs on sm90 (its producer converts the cache), as a bf16 one does."""
    b = make_paged(MIXED_QO, MIXED_KV, page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=torch.bfloat16, device=DEV, seed=9)
    ks, vs = fp8_scales("float", H_KV, DEV)
    cache = quantize_cache(b.cache, ks, vs, "NHD", torch.float8_e4m3fn)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
    w.plan(*b.tensors(DEV), H_Q, H_KV, D, PS, causal=True, q_data_type=torch.bfloat16, kv_data_type="e4m3")
    with attnjit.recording() as rec:
        out = w.run(b.q, cache, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    assert w.last_plan["family"] == "sm90" and rec[0].plan["family"] == "sm90"
    assert w._plan.spec.dtype_kv == "e4m3"
    ref_o, _ = reference.batch_paged(b.q, cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                     page_size=PS, causal=True, k_scale=ks, v_scale=vs)
    assert_close(out, ref_o, torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
def test_single_request_helpers_read_fp8(causal):
    qo, kv_indptr, q, k, v = make_ragged((1 if not causal else 40,), (300,), num_qo_heads=H_Q, num_kv_heads=H_KV,
                                         head_dim=D, dtype=torch.bfloat16, device=DEV, seed=3)
    ks, vs = fp8_scales("tensor", H_KV, DEV)
    k8, v8 = quantize(k, ks, 1, torch.float8_e4m3fn), quantize(v, vs, 1, torch.float8_e4m3fn)
    ref_o, ref_lse = reference.attention(q, k8, v8, causal=causal, k_scale=ks, v_scale=vs)
    if causal:
        out, lse = attnjit.single_prefill_with_kv_cache(q, k8, v8, causal=True, k_scale=ks, v_scale=vs,
                                                        return_lse=True)
    else:
        out, lse = attnjit.single_decode_with_kv_cache(q[0], k8, v8, k_scale=ks, v_scale=vs, return_lse=True)
        out, lse = out[None], lse[None]
    torch.cuda.synchronize()
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse)
    assert math.isfinite(out.float().abs().max().item())


@pytest.mark.parametrize("kind", ["float", "tensor"])
def test_fp8_scales_inside_torch_compile_equal_eager(workspace, kind):
    """run(k_scale=, v_scale=) inside torch.compile(fullgraph=True): the scales travel through torch.ops.attnjit
    (floats specialized by the compiler, tensors read at run time) and the result equals the eager call's.
    (torch.library.opcheck cannot take an fp8 cache: its schema check multiplies the inputs, "mul_cuda not
    implemented for 'Float8_e4m3fn'"; the 16-bit ops pass it in test_compile.py.)"""
    b, w = _decode(workspace)
    ks, vs = fp8_scales(kind, H_KV, DEV)
    cache = quantize_cache(b.cache, ks, vs, "NHD", torch.float8_e4m3fn)
    q = b.q.contiguous()
    want, want_lse = w.run(q, cache, k_scale=ks, v_scale=vs, return_lse=True)
    step = torch.compile(lambda q, c: w.run(q, c, k_scale=ks, v_scale=vs, return_lse=True), fullgraph=True)
    got, got_lse = step(q, cache)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
