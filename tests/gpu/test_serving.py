"""Issue 14 on the GPU against float64 references written here in torch, independently of the kernels: RoPE inside
attention (q and k rotated, FlashInfer's ROPE_LLAMA), attention sinks (with and without a sliding window, prefill
and decode, split and not, both families; each case also proves the sink changes the output; RoPE over an fp8
cache, the one fp8 path that converts in shared memory), decode batches with
empty histories, use_tensor_cores, and FlashInfer's aliases."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import attnjit
from attnjit import dtypes, reference
from attnjit.reference import Hooks

from ..helpers import (assert_close, assert_lse_close, fp8_kwargs, i32, make_paged, make_ragged, poisoned,
                       quantize_cache)
from .cases import BACKEND, DEC_MED, MIXED_KV, MIXED_QO, SERVING_MATRIX, ServingCase

DEV = "cuda"
H_Q, H_KV, D = 32, 8, 128
WINDOW = 37
ROPE = {"rope": (1.0, 1e4), "rope_scaled": (2.5, 5e5)}   # (rope_scale, rope_theta)


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(256 << 20, dtype=torch.uint8, device=DEV)


def rope_reference(x: torch.Tensor, pos: torch.Tensor, scale: float, theta: float) -> torch.Tensor:
    """LLaMA rotary embedding in float64: x [N, H, D] at positions pos [N]; element i < D/2 pairs with i + D/2:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), angle = pos / scale * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=x.device) / x.shape[-1]) / scale
    ang = pos.double()[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def sink_values(seed: int) -> torch.Tensor:
    """Per-head sinks from -3 to 9 (shuffled): large enough that a kernel ignoring them fails by far."""
    gen = torch.Generator().manual_seed(seed)
    return torch.linspace(-3.0, 9.0, H_Q)[torch.randperm(H_Q, generator=gen)].contiguous()


def hooks_for(case: ServingCase, sinks: torch.Tensor | None, k_scale: float = 1.0) -> Hooks:
    if case.feature in ROPE:
        scale, theta = ROPE[case.feature]
        # the kernel stores the rotated q and k in their dtype before the matmuls (documented), as does this; an fp8
        # cache's keys are rotated as stored (k_scale multiplies the logits), so the rounding is of k / k_scale
        return Hooks(query=lambda q, p: rope_reference(q, p.q_pos, scale, theta).to(case.dtype).double(),
                     key=lambda k, p: rope_reference(k / k_scale, p.kv_pos, scale, theta).to(case.dtype).double()
                     * k_scale)
    s = sinks.double().to(DEV)
    if case.feature == "sink":
        return Hooks(sink=lambda p: s)
    return Hooks(sink=lambda p: s, mask=lambda p: (p.kv_pos[None, :] >= p.q_pos[:, None] - WINDOW)[None])


def plan_args(case: ServingCase) -> dict:
    out = {"force": {"fixed_split_size": 128}}.get(case.split, {})
    if case.feature in ROPE:
        scale, theta = ROPE[case.feature]
        out.update(pos_encoding_mode="ROPE_LLAMA", rope_scale=scale, rope_theta=theta)
    if case.feature == "sink_window":
        out["window_left"] = WINDOW
    if case.feature.startswith("sink") and case.kind != "sink_wrapper":
        out["sinks"] = True
    return out


@pytest.mark.parametrize("case,family", SERVING_MATRIX, ids=[f"{c.name}-{f}" for c, f in SERVING_MATRIX])
def test_serving_feature_matches_reference(case: ServingCase, family: str, workspace):
    seed = zlib.crc32(case.name.encode()) % 1000
    backend = BACKEND[family]
    dtype = case.dtype
    sinks = sink_values(seed).to(DEV) if case.feature.startswith("sink") else None
    fp8_plan, fp8_run = fp8_kwargs(case.kv, "float", H_KV, DEV)  # RoPE over fp8: converted in shared memory
    hooks = hooks_for(case, sinks, fp8_run.get("k_scale", 1.0))
    run_kw = {"sinks": sinks} if sinks is not None and case.kind != "sink_wrapper" else {}
    causal = case.causal and case.kind != "decode"
    if case.kind == "ragged":
        qo_indptr, kv_indptr, q, k, v = make_ragged(MIXED_QO, MIXED_KV, num_qo_heads=H_Q, num_kv_heads=H_KV,
                                                    head_dim=D, dtype=dtype, device=DEV, seed=seed)
        w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend=backend)
        w.plan(i32(qo_indptr, DEV), i32(kv_indptr, DEV), H_Q, H_KV, D, causal=causal, q_data_type=dtype,
               **plan_args(case))
        out, lse = poisoned(q.shape, dtype, DEV), poisoned(q.shape[:2], torch.float32, DEV)
        w.run(q, k, v, out=out, lse=lse, **run_kw)
        ref_o, ref_lse = reference.batch_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal, hooks=hooks)
        plain_o, _ = reference.batch_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal)
    else:
        qo_lens = (1,) * len(DEC_MED) if case.kind == "decode" else MIXED_QO
        kv_lens = DEC_MED if case.kind == "decode" else MIXED_KV
        b = make_paged(qo_lens, kv_lens, page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, dtype=dtype,
                       device=DEV, seed=seed)
        qo_t, kvp_t, idx_t, last_t = b.tensors(DEV)
        out, lse = poisoned(b.q.shape, dtype, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
        cache = b.cache if not case.kv else quantize_cache(b.cache, fp8_run["k_scale"], fp8_run["v_scale"], "NHD",
                                                           dtypes.of(case.kv).torch)
        if case.kind == "decode":
            w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace, backend=backend)
            w.plan(kvp_t, idx_t, last_t, H_Q, H_KV, D, 16, q_data_type=dtype, **fp8_plan, **plan_args(case))
            w.run(b.q, cache, out=out, lse=lse, **run_kw, **fp8_run)
        elif case.kind == "sink_wrapper":
            w = attnjit.BatchAttentionWithAttentionSinkWrapper(workspace, backend=backend, q_data_type=dtype,
                                                               kv_data_type=dtype, head_dim_qk=D, head_dim_vo=D,
                                                               window_left=plan_args(case).get("window_left", -1))
            w.plan(qo_t, kvp_t, idx_t, last_t, H_Q, H_KV, D, 16, causal=causal, q_data_type=dtype,
                   kv_data_type=dtype, **plan_args(case))
            w.run(b.q, b.cache, sinks, 1.0 / math.sqrt(D), out=out, lse=lse)  # FlashInfer's positional form
        else:
            w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace, backend=backend, tile=case.tile)
            w.plan(qo_t, kvp_t, idx_t, last_t, H_Q, H_KV, D, 16, causal=causal, q_data_type=dtype, **fp8_plan,
                   **plan_args(case))
            w.run(b.q, cache, out=out, lse=lse, **run_kw, **fp8_run)
        args = (b.q, cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)
        ref_o, ref_lse = reference.batch_paged(*args, page_size=16, causal=causal, hooks=hooks, **fp8_run)
        plain_hooks = Hooks(mask=hooks.mask) if case.feature == "sink_window" else None
        plain_o, _ = reference.batch_paged(*args, page_size=16, causal=causal, hooks=plain_hooks, **fp8_run)
    torch.cuda.synchronize()
    assert w.last_plan["family"] == family and w._plan.spec == case.spec(family)
    if case.split == "force":
        assert w.last_plan["split_kv"], w.last_plan
    # the feature matters: the reference without it is far outside the tolerance (a kernel ignoring it fails)
    change = ((ref_o - plain_o).norm() / ref_o.norm()).item()
    assert change > 0.1, f"the feature barely changes the output ({change:.3f}); the test would not catch its loss"
    assert_close(out, ref_o, dtype)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("split", ["auto", "force"])
def test_decode_requests_with_an_empty_history_give_zeros_and_minus_inf(workspace, split):
    kv_lens = (0, 37, 0, 1000, 5, 0, 4096)
    b = make_paged((1,) * len(kv_lens), kv_lens, page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=torch.bfloat16, device=DEV, seed=21)
    _, kvp, idx, last = b.tensors(DEV)
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
    w.plan(kvp, idx, last, H_Q, H_KV, D, 16, q_data_type=torch.bfloat16,
           **({"fixed_split_size": 128} if split == "force" else {}))
    out, lse = poisoned(b.q.shape, torch.bfloat16, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
    w.run(b.q, b.cache, out=out, lse=lse)
    torch.cuda.synchronize()
    empty = torch.tensor([k == 0 for k in kv_lens], device=DEV)
    assert torch.equal(out[empty].float(), torch.zeros_like(out[empty].float()))
    assert torch.isinf(lse[empty]).all() and (lse[empty] < 0).all()
    ref_o, ref_lse = reference.batch_decode(b.q, b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, page_size=16)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse)
    if split == "force":
        assert w.last_plan["split_kv"]


@pytest.mark.parametrize("split", ["auto", "force"])
def test_a_nan_sink_makes_its_heads_rows_nan_even_with_no_visible_key(workspace, split):
    """One head's sink is NaN (a corrupted model parameter; run() cannot read a device tensor's values without a
    sync): every row of that head is NaN, o and lse, on requests with an empty history too, where o sums no key and
    the kernels used to write o = 0 beside a NaN lse (a finite row a merge or a model would take as real). Every
    other head is the reference's (lse = its sink where no key is visible)."""
    kv_lens = (0, 37, 0, 1000, 5, 4096)
    b = make_paged((1,) * len(kv_lens), kv_lens, page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=torch.bfloat16, device=DEV, seed=22)
    _, kvp, idx, last = b.tensors(DEV)
    sinks = sink_values(22)
    bad = 5
    sinks[bad] = math.nan
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
    w.plan(kvp, idx, last, H_Q, H_KV, D, 16, q_data_type=torch.bfloat16, sinks=True,
           **({"fixed_split_size": 128} if split == "force" else {}))
    out, lse = poisoned(b.q.shape, torch.bfloat16, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
    w.run(b.q, b.cache, out=out, lse=lse, sinks=sinks.to(DEV))
    torch.cuda.synchronize()
    assert torch.isnan(out[:, bad].float()).all() and torch.isnan(lse[:, bad]).all(), (out[:, bad], lse[:, bad])
    finite = sinks.clone()
    finite[bad] = 0.0
    s = finite.double().to(DEV)
    ref_o, ref_lse = reference.batch_decode(b.q, b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, page_size=16,
                                            hooks=Hooks(sink=lambda p: s))
    good = [h for h in range(H_Q) if h != bad]
    assert_close(out[:, good], ref_o[:, good], torch.bfloat16)
    assert_lse_close(lse[:, good], ref_lse[:, good])
    if split == "force":
        assert w.last_plan["split_kv"]


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_use_tensor_cores_runs_and_is_recorded(workspace, use_tensor_cores):
    b = make_paged((1,) * 4, DEC_MED, page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=torch.bfloat16, device=DEV, seed=22)
    _, kvp, idx, last = b.tensors(DEV)
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
    w.plan(kvp, idx, last, H_Q, H_KV, D, 16, q_data_type=torch.bfloat16)
    with attnjit.recording() as rec:
        out = w.run(b.q, b.cache)
    torch.cuda.synchronize()
    assert rec and rec[-1].plan["use_tensor_cores"] is use_tensor_cores and rec[-1].plan["tensor_cores"] is True
    ref, _ = reference.batch_decode(b.q, b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, page_size=16)
    assert_close(out, ref, torch.bfloat16)


def test_flashinfer_aliases_run_the_plan(workspace):
    b = make_paged((5, 1, 9), (40, 17, 300), page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=torch.bfloat16, device=DEV, seed=23)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
    w.begin_forward(*b.tensors(DEV), H_Q, H_KV, D, 16, causal=True, q_data_type=torch.bfloat16)
    ref_o, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                           page_size=16, causal=True)
    out, lse = w.run_return_lse(b.q, b.cache)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse)
    assert_close(w.forward(b.q, b.cache, causal=True), ref_o, torch.bfloat16)
    out2, lse2 = w.forward_return_lse(b.q, b.cache)
    assert_close(out2, ref_o, torch.bfloat16)
    assert_lse_close(lse2, ref_lse)
    w.end_forward()


# --- cascade (shared-prefix) attention against the flat computation -------------------------------------------------

from ..helpers import make_cascade  # noqa: E402

CASCADES = {
    # name: (qo_lens, levels (groups of (requests, kv_len) per level), causal, plan kwargs)
    "2-level-decode": ((1,) * 16, [[(16, 1000)], [(1, 1 + (i * 37) % 300) for i in range(16)]], False, {}),
    "2-level-decode-split": ((1,) * 16, [[(16, 3000)], [(1, 17 + i) for i in range(16)]], False,
                             {"fixed_split_size": 128}),
    "2-level-append-causal": ((3, 1, 5, 2), [[(4, 517)], [(1, 40), (1, 1), (1, 64), (1, 300)]], True, {}),
    "3-level-decode": ((1,) * 6, [[(6, 700)], [(3, 129), (3, 64)], [(1, 5), (1, 1), (1, 90), (1, 33), (1, 2),
                                                                   (1, 16)]], False, {}),
    "3-level-causal": ((2,) * 6, [[(6, 300)], [(2, 48), (4, 200)], [(1, 5), (1, 2), (1, 90), (1, 33), (1, 2),
                                                                    (1, 16)]], True, {}),
}


@pytest.mark.parametrize("merge", ["deferred", "in-kernel"])
@pytest.mark.parametrize("family", ["fa2", "sm90"])
@pytest.mark.parametrize("name", list(CASCADES))
def test_cascade_matches_the_flat_computation(workspace, name, family, merge):
    """The prefix levels as deferred-merge plans (merge_partials into the last level's state: the default), and as
    ordinary plans merged by merge_state_in_place (what a variant merge_partials cannot combine takes)."""
    qo_lens, levels, causal, kw = CASCADES[name]
    b = make_cascade(qo_lens, levels, page_size=16, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                     dtype=torch.bfloat16, device=DEV, seed=zlib.crc32(name.encode()) % 1000)
    w = attnjit.MultiLevelCascadeAttentionWrapper(len(levels), workspace, "NHD", backend=BACKEND[family])
    for lw in w._batch_prefill_wrappers[:-1]:
        assert lw._defer_merge
        lw._defer_merge = merge == "deferred"
    w.plan(*b.arrays(DEV), H_Q, H_KV, D, 16, causal=causal, q_data_type=torch.bfloat16, **kw)
    out, lse = poisoned(b.q.shape, torch.bfloat16, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    assert [p["family"] for p in w.last_plan] == [family] * len(levels)
    assert [p.get("merge") for p in w.last_plan] == [merge if merge == "deferred" else None] * (len(levels) - 1) + \
        [None]
    assert not w._overlapped   # eagerly the levels run one after the other
    if kw.get("fixed_split_size"):
        assert w.last_plan[0]["split_kv"]
    ref_o, ref_lse = b.reference(causal=causal)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse)
    plain = w.run(b.q, b.cache)  # FlashInfer's form: run(q, kv) -> out
    assert_close(plain, ref_o, torch.bfloat16)
    # captured in a graph, level 0 runs beside the last level (a side stream) where that one is unsplit: both ways
    # occur in CASCADES
    out, lse = poisoned(b.q.shape, torch.bfloat16, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(b.q, b.cache, out=out, lse=lse)
    last_split = w._batch_prefill_wrappers[-1]._plan.work.chunk is not None
    assert w._overlapped == (merge == "deferred" and not last_split)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse)


def test_cascade_graph_replays_after_a_new_plan(workspace):
    """use_cuda_graph=True: the deferred prefix level's merge table lives in a fixed buffer, so a graph captured once
    replays a later plan (new suffix lengths, same query rows) right; the suffixes stay unsplit, so level 0 runs
    beside the last level on a side stream inside the capture."""
    qo_lens = (1,) * 8
    wrapper = attnjit.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD", use_cuda_graph=True)
    q = out = lse = graph = None
    for step, suffixes in enumerate(([5, 1, 90, 33, 2, 16, 250, 7], [64, 9, 1, 1, 250, 31, 2, 64])):
        b = make_cascade(qo_lens, [[(8, 2500)], [(1, k) for k in suffixes]], page_size=16, num_qo_heads=H_Q,
                         num_kv_heads=H_KV, head_dim=D, dtype=torch.bfloat16, device=DEV, seed=11)
        wrapper.plan(*b.arrays(DEV), H_Q, H_KV, D, 16, q_data_type=torch.bfloat16, fixed_split_size=256)
        assert wrapper.last_plan[0]["merge"] == "deferred" and wrapper.last_plan[0]["split_kv"]
        assert not wrapper.last_plan[1]["split_kv"]
        if graph is None:
            q, cache = b.q.clone(), b.cache.clone()
            out, lse = poisoned(q.shape, torch.bfloat16, DEV), poisoned(q.shape[:2], torch.float32, DEV)
            wrapper.run(q, cache, out=out, lse=lse)   # warm-up (loads the kernels) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                wrapper.run(q, cache, out=out, lse=lse)
        else:
            q.copy_(b.q), cache.copy_(b.cache)
        out.copy_(poisoned(q.shape, torch.bfloat16, DEV)), lse.copy_(poisoned(q.shape[:2], torch.float32, DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert wrapper._overlapped
        ref_o, ref_lse = b.reference(causal=False)
        assert_close(out, ref_o, torch.bfloat16)
        assert_lse_close(lse, ref_lse)
