"""Variants against float64 references written independently in torch (reference.Hooks): every built-in
(soft-cap, sliding window, ALiBi, custom mask, sigmoid) and three user variants, on paged/ragged prefill (causal and
not) and decode, split-KV included."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import attnjit
from attnjit import dtypes, reference
from attnjit.reference import Hooks

from ..helpers import (assert_close, assert_lse_close, fp8_kwargs, i32, make_paged, make_ragged, poisoned, quantize,
                       quantize_cache)
from .cases import (BACKEND, DEC_MED, MIXED_KV, MIXED_QO, POS_PROBE, POS_PROBE_RUNS, VARIANT_MATRIX,
                    VARIANT_TILE_MATRIX, WALK_VARIANTS, VariantCase, pos_probe_spec)

DEV = "cuda"
H_Q, H_KV, D = 32, 8, 128
CAP, WINDOW, SIG_SCALE, SIG_BIAS, Q_GAIN, O_GAIN, LOGIT_GAIN = 2.0, 37, 0.7, -1.5, 1.3, 0.5, 1.6


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(256 << 20, dtype=torch.uint8, device=DEV)


def alibi_slopes_independent(n: int) -> torch.Tensor:
    # H = 32 is a power of two: slope_h = 2^(-8 (h + 1) / H)
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n) for h in range(n)], dtype=torch.float64)


def hooks_for(case: VariantCase, masks: list[torch.Tensor] | None, head_scale: torch.Tensor | None) -> Hooks:
    f = case.feature
    if f == "softcap":
        return Hooks(logits=lambda l, p: CAP * torch.tanh(l / CAP))
    if f == "window":
        return Hooks(mask=lambda p: (p.kv_pos[None, :] >= p.q_pos[:, None] - WINDOW)[None])
    if f == "alibi":
        slopes = alibi_slopes_independent(H_Q).to(DEV)
        return Hooks(logits=lambda l, p: l + slopes[:, None, None] * (p.kv_pos[None, :] - p.q_pos[:, None])[None])
    if f == "custom_mask":
        return Hooks(mask=lambda p: masks[p.batch_idx][None])
    if f in ("sigmoid", "user_sigmoid"):
        return Hooks(logits=lambda l, p: torch.sigmoid(l * SIG_SCALE + SIG_BIAS), use_softmax=False)
    if f == "head_scale":
        return Hooks(logits=lambda l, p: l * head_scale.double()[:, None, None])
    if f == "scaled_softcap":
        return Hooks(logits=lambda l, p: CAP * torch.tanh(l * head_scale.double()[:, None, None] / CAP))
    if f == "user_scaled":
        return Hooks(logits=lambda l, p: l * LOGIT_GAIN)
    if f == "softcap_alibi":
        slopes = alibi_slopes_independent(H_Q).to(DEV)
        return Hooks(logits=lambda l, p: CAP * torch.tanh(l / CAP)
                     + slopes[:, None, None] * (p.kv_pos[None, :] - p.q_pos[:, None])[None])
    if f == "gains":  # the transformed query is stored in the query's dtype (documented), as the kernel does
        return Hooks(query=lambda q, p: (q * Q_GAIN).to(case.dtype).double(), output=lambda o, p: o * O_GAIN)
    raise AssertionError(f)


def run_params(case: VariantCase, head_scale: torch.Tensor | None) -> dict:
    return {"sigmoid": dict(sigmoid_scale=SIG_SCALE, sigmoid_bias=SIG_BIAS),
            "user_sigmoid": dict(scale=SIG_SCALE, bias=SIG_BIAS),
            "head_scale": dict(head_scale=head_scale), "scaled_softcap": dict(head_scale=head_scale),
            "gains": dict(q_gain=Q_GAIN, o_gain=O_GAIN), "user_scaled": dict(logit_gain=LOGIT_GAIN)}.get(case.feature,
                                                                                                        {})


def plan_args(case: VariantCase, mask_flat: torch.Tensor | None) -> dict:
    return {"softcap": dict(logits_soft_cap=CAP), "scaled_softcap": dict(logits_soft_cap=CAP),
            "window": dict(window_left=WINDOW),
            "alibi": dict(pos_encoding_mode="ALIBI"), "custom_mask": dict(custom_mask=mask_flat),
            "softcap_alibi": dict(logits_soft_cap=CAP, pos_encoding_mode="ALIBI")}.get(case.feature, {})


@pytest.mark.parametrize("case,family", VARIANT_MATRIX, ids=[f"{c.name}-{f}" for c, f in VARIANT_MATRIX])
def test_variant_matches_reference(case: VariantCase, family: str, workspace):
    check_variant(case, family, workspace)


@pytest.mark.parametrize("case,tile", VARIANT_TILE_MATRIX, ids=[f"{c.name}-sm90-{t}" for c, t in VARIANT_TILE_MATRIX])
def test_variant_on_sm90_tile_configurations(case: VariantCase, tile: str, workspace):
    """The variant hooks on the sm90 tiles attnjit tune may pick (kv128t8's stale max: P up to 2^8) and on the
    chained walk (kv128c)."""
    w = check_variant(case, "sm90", workspace, tile=tile)
    assert w._plan.spec.tile == tile


# Many items per CTA, each hook: the cases and why, tests/gpu/cases.py WALK_VARIANTS.
@pytest.mark.parametrize("case,tile", WALK_VARIANTS, ids=[c.name + (f"-{t}" if t else "") for c, t in WALK_VARIANTS])
def test_variant_on_sm90_with_many_items_per_cta(case: VariantCase, tile: str | None, workspace, monkeypatch):
    from attnjit import dispatch

    monkeypatch.setattr(dispatch, "num_sms", lambda device=None: 2)
    w = check_variant(case, "sm90", workspace, tile=tile)
    plan = w._plan
    assert plan.spec.tile == tile
    assert plan.attn.grid[0] <= 2 < plan.work.num_items * plan.num_kv_heads, (plan.attn.grid, plan.work.num_items)


def check_variant(case: VariantCase, family: str, workspace, tile: str | None = None):
    """One variant case against the float64 reference on `family` (and `tile`); returns the wrapper."""
    backend = BACKEND[family]
    seed = zlib.crc32(case.name.encode()) % 1000
    gen = torch.Generator().manual_seed(seed)
    dtype = case.dtype
    qo_lens = (1,) * len(DEC_MED) if case.kind == "decode" else MIXED_QO
    kv_lens = DEC_MED if case.kind == "decode" else MIXED_KV
    masks = mask_flat = None
    if case.feature == "custom_mask":
        masks = [torch.rand(q, k, generator=gen) < 0.6 for q, k in zip(qo_lens, kv_lens)]
        mask_flat = torch.cat([m.reshape(-1) for m in masks]).to(DEV)
        masks = [m.to(DEV) for m in masks]
    scaled = case.feature in ("head_scale", "scaled_softcap")
    head_scale = (torch.rand(H_Q, generator=gen) * 1.5 + 0.25).to(DEV) if scaled else None
    split = {"force": {"fixed_split_size": 128}}.get(case.split, {})
    hooks = hooks_for(case, masks, head_scale)
    params = run_params(case, head_scale)
    fp8_plan, scales = fp8_kwargs(case.kv, "float", H_KV, DEV)  # an fp8 cache: quantized here for both
    fp8 = dtypes.of(case.kv).torch if case.kv else None
    if case.kind == "ragged":
        qo_indptr, kv_indptr, q, k, v = make_ragged(qo_lens, kv_lens, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                                                    dtype=dtype, device=DEV, seed=seed)
        if fp8 is not None:
            k, v = quantize(k, scales["k_scale"], 1, fp8), quantize(v, scales["v_scale"], 1, fp8)
        w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(workspace, variant=case.variant, backend=backend, tile=tile)
        w.plan(i32(qo_indptr, DEV), i32(kv_indptr, DEV), H_Q, H_KV, D, causal=case.causal, q_data_type=dtype,
               **fp8_plan, **plan_args(case, mask_flat), **split)
        out = poisoned(q.shape, dtype, DEV)
        lse = poisoned(q.shape[:2], torch.float32, DEV) if hooks.use_softmax else None
        w.run(q, k, v, out=out, lse=lse, **params, **scales)
        ref_o, ref_lse = reference.batch_ragged(q, k, v, qo_indptr, kv_indptr, causal=case.causal, hooks=hooks,
                                                **scales)
    else:
        b = make_paged(qo_lens, kv_lens, page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, dtype=dtype,
                       device=DEV, seed=seed)
        qo_t, kvp_t, idx_t, last_t = b.tensors(DEV)
        cache = b.cache if fp8 is None else quantize_cache(b.cache, scales["k_scale"], scales["v_scale"], "NHD", fp8)
        if case.kind == "decode":
            w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace, variant=case.variant, backend=backend)
            w.plan(kvp_t, idx_t, last_t, H_Q, H_KV, D, 16, q_data_type=dtype, **fp8_plan, **plan_args(case, None),
                   **split)
        else:
            w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, variant=case.variant, backend=backend,
                                                            tile=tile)
            w.plan(qo_t, kvp_t, idx_t, last_t, H_Q, H_KV, D, 16, causal=case.causal, q_data_type=dtype, **fp8_plan,
                   **plan_args(case, mask_flat), **split)
        q = b.q
        out = poisoned(q.shape, dtype, DEV)
        lse = poisoned(q.shape[:2], torch.float32, DEV) if hooks.use_softmax else None
        w.run(q, cache, out=out, lse=lse, **params, **scales)
        causal = case.causal and case.kind != "decode" and case.feature != "custom_mask"
        ref_o, ref_lse = reference.batch_paged(q, cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                               page_size=16, causal=causal, hooks=hooks, **scales)
    torch.cuda.synchronize()
    assert w._plan.spec.variant is not None and w.last_plan["family"] == family
    if case.split == "force":
        assert w.last_plan["split_kv"], w.last_plan
    if hooks.use_softmax:
        assert_close(out, ref_o, dtype)
        assert_lse_close(lse, ref_lse)
    else:  # unnormalized weighted sums: compare relative to the output's scale
        scale = ref_o.abs().max().clamp_min(1.0)
        assert_close(out.double() / scale, ref_o / scale, dtype)
    return w


def test_missing_variant_parameter_is_a_type_error_naming_variant_and_parameter(workspace):
    from .cases import HEAD_SCALE

    b = make_paged((2, 1), (20, 30), page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=torch.bfloat16, device=DEV, seed=9)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, variant=HEAD_SCALE)
    w.plan(*b.tensors(DEV), H_Q, H_KV, D, 16, causal=True, q_data_type=torch.bfloat16)
    with pytest.raises(TypeError, match=r"variant 'head_scale' needs parameter 'head_scale'"):
        w.run(b.q, b.cache)
    with pytest.raises(TypeError, match=r"parameter 'head_scale' must be a torch.float32 tensor"):
        w.run(b.q, b.cache, head_scale=torch.ones(H_Q, dtype=torch.float16, device=DEV))
    out = w.run(b.q, b.cache, head_scale=torch.ones(H_Q, device=DEV))
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   page_size=16, causal=True)
    assert_close(out, ref, torch.bfloat16)  # a scale of one is plain attention


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("family", ["fa2", "sm90"])
def test_a_logits_scale_that_is_not_positive_gives_nan_not_a_wrong_softmax(workspace, family, split):
    """The softmax folds logits_scale into its scale and takes each row's max before scaling, which holds only for a
    positive factor: a negative, zero, infinite or NaN one makes every output and lse NaN (documented), never a
    quietly wrong row, split items included; a positive one is the reference's."""
    from .cases import USER_SCALED

    b = make_paged((3, 1), (40, 300), page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=torch.bfloat16, device=DEV, seed=11)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, variant=USER_SCALED, backend=BACKEND[family])
    w.plan(*b.tensors(DEV), H_Q, H_KV, D, 16, causal=True, q_data_type=torch.bfloat16,
           **({"fixed_split_size": 128} if split else {"disable_split_kv": True}))
    assert w.last_plan["family"] == family and w.last_plan["split_kv"] == split, w.last_plan
    for gain in (-0.5, 0.0, float("inf"), float("nan")):
        out, lse = w.run(b.q, b.cache, logit_gain=gain, return_lse=True)
        assert torch.isnan(out).all(), (gain, out.isnan().float().mean().item())
        # NaN, not the -inf of a row with no visible key, which a split-KV merge skips (run 6 of the thirtieth
        # session: fa2's split items gave finite zeros here)
        assert torch.isnan(lse).all(), (gain, lse.isnan().float().mean().item())
    out = w.run(b.q, b.cache, logit_gain=LOGIT_GAIN)
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   page_size=16, causal=True, hooks=Hooks(logits=lambda l, p: l * LOGIT_GAIN))
    assert_close(out, ref, torch.bfloat16)


def test_single_prefill_with_a_variant():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(20, H_Q, D, generator=gen).to(torch.float16).to(DEV)
    k = torch.randn(50, H_KV, D, generator=gen).to(torch.float16).to(DEV)
    v = torch.randn(50, H_KV, D, generator=gen).to(torch.float16).to(DEV)
    o = attnjit.single_prefill_with_kv_cache(q, k, v, causal=True, logits_soft_cap=CAP)
    ref, _ = reference.attention(q, k, v, causal=True, hooks=Hooks(logits=lambda l, p: CAP * torch.tanh(l / CAP)))
    assert_close(o, ref, torch.float16)
    assert math.isfinite(o.float().sum().item())


@pytest.mark.parametrize("op,family", POS_PROBE_RUNS, ids=[f"{o}-{f}" for o, f in POS_PROBE_RUNS])
def test_hooks_see_only_the_requests_positions(op, family, workspace):
    """A tile's padding rows run the hooks too (their results are discarded); they must see a q_pos of the request,
    or a hook that reads by position (the custom mask's bits) reads past its tensor: a crash that depends on where
    the tensor was allocated (it killed the GPU suite once, several hundred tests in). The probe's mask records the
    largest q_pos per request: exactly kv_len - 1 (the last row), never more."""
    qo = (1,) * len(DEC_MED) if op == "decode" else MIXED_QO
    kv = DEC_MED if op == "decode" else MIXED_KV
    b = make_paged(qo, kv, page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, dtype=torch.bfloat16,
                   device=DEV, seed=21)
    if op == "decode":
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace, variant=POS_PROBE, backend=BACKEND[family])
        w.plan(*(i32(x, DEV) for x in (b.kv_indptr, b.kv_indices, b.last_page_len)), H_Q, H_KV, D, 16,
               q_data_type=torch.bfloat16)
    else:
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, variant=POS_PROBE, backend=BACKEND[family])
        w.plan(*b.tensors(DEV), H_Q, H_KV, D, 16, causal=False, q_data_type=torch.bfloat16)
    assert w.last_plan["family"] == family and w._plan.spec == pos_probe_spec(op, family)
    seen = torch.full((len(qo),), -1, dtype=torch.int32, device=DEV)
    out = w.run(b.q, b.cache, seen=seen)
    torch.cuda.synchronize()
    want = torch.tensor([k - 1 if q and k else -1 for q, k in zip(qo, kv)], dtype=torch.int32)
    assert torch.equal(seen.cpu(), want), (seen.cpu().tolist(), want.tolist())
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   page_size=16, causal=False)
    assert_close(out, ref, torch.bfloat16)  # the probe hides nothing
