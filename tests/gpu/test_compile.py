"""torch.ops.attnjit on the GPU (issue 13 item 2): opcheck on every op; torch.compile(fullgraph=True) and
mode="reduce-overhead" (CUDA-graph trees) against eager, the graph-mode decode wrapper replaying after fast_plan().

Specs (all in specs/gpu-tests.toml): decode and paged prefill bf16 head_dim 128 page 16 group 4, ragged prefill bf16
head_dim 128 group 4 causal / none, merge_state head_dim 128 bf16, append_kv head_dim 128 page 16 bf16 NHD.
"""

from __future__ import annotations

import pytest
import torch

import attnjit
from attnjit import reference

from ..helpers import assert_close, i32, make_paged

DEV = "cuda"
H_Q, H_KV, D, PS = 32, 8, 128, 16
DT = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _states(rows=77, heads=8, n=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, heads) if n is None else (rows, n, heads)
    return torch.randn(*shape, D, generator=gen).to(DT).to(DEV), (torch.randn(*shape, generator=gen) * 4).to(DEV)


def _decode_batch(seed=1):
    b = make_paged((1,) * 5, (40, 17, 300, 7, 3000), page_size=PS, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                   dtype=DT, device=DEV, seed=seed)
    return b, tuple(i32(x) for x in (b.kv_indptr, b.kv_indices, b.last_page_len))  # host metadata


def _append_args(seed=0, heads=4, pages=12):
    """Five new tokens (3 for request 0 at positions 17..19, 2 for request 1 at 0..1) over pages 3, 7 | 9."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(pages, 2, PS, heads, D, generator=gen).to(DT).to(DEV)
    k = torch.randn(5, heads, D, generator=gen).to(DT).to(DEV)
    v = torch.randn(5, heads, D, generator=gen).to(DT).to(DEV)
    b_idx, pos = attnjit.get_batch_indices_positions(i32([0, 3, 5], DEV), i32([20, 2], DEV), 5)
    return (k, v, b_idx, pos, cache, i32([3, 7, 9], DEV), i32([0, 2, 3], DEV), i32([4, 2], DEV))


def test_opcheck_every_op():
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    b, (kvp, idx, last) = _decode_batch()
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT)
    q = b.q.contiguous()
    ops = torch.ops.attnjit
    va, sa = _states(seed=1)
    vb, sb = _states(seed=2)
    v4, s4 = _states(n=3, seed=3)
    gen = torch.Generator().manual_seed(4)
    q1, k1, v1 = (torch.randn(s, h, D, generator=gen).to(DT).to(DEV) for s, h in ((37, H_Q), (90, H_KV), (90, H_KV)))
    cases = [
        (ops.batch_run.default, (w._handle, q, b.cache, None, True)),
        (ops.batch_run.default, (w._handle, q, b.cache, None, False)),
        (ops.batch_run_out.default, (w._handle, q, b.cache, None, torch.empty_like(q), torch.empty(q.shape[:2],
                                                                                                  device=DEV))),
        (ops.single_prefill.default, (q1, k1, v1, True, "NHD", None, -1, None, "NONE", True)),
        (ops.single_decode.default, (q1[0], k1, v1, "NHD", None, -1, None, "NONE", True)),
        (ops.merge_state.default, (va, sa, vb, sb)),
        (ops.merge_state_in_place.default, (va.clone(), sa.clone(), vb, sb, None)),
        (ops.merge_states.default, (v4, s4)),
    ]
    k, v, b_idx, pos, cache, ids, indptr, lastp = _append_args()
    cases.append((ops.append_paged_kv_cache.default, (k, v, b_idx, pos, cache, None, ids, indptr, lastp, "NHD", False)))
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_compiled_decode_step_equals_eager():
    """append + batch decode run + merge_state, compiled with fullgraph=True: exactly the eager results."""
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    b, (kvp, idx, last) = _decode_batch(seed=5)
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT)
    va, sa = _states(rows=5, heads=H_Q, seed=6)

    def step(q, cache, k_new, v_new, b_idx, pos, ids, indptr, lastp):
        attnjit.append_paged_kv_cache(k_new, v_new, b_idx, pos, cache, ids, indptr, lastp)
        o, lse = w.run(q, cache, return_lse=True)
        return attnjit.merge_state(o, lse, va, sa)

    k, v, b_idx, pos, _, ids, indptr, lastp = _append_args(seed=7, heads=H_KV)
    q = b.q.contiguous()
    eager_cache, compiled_cache = b.cache.clone(), b.cache.clone()
    want = step(q, eager_cache, k, v, b_idx, pos, ids, indptr, lastp)
    got = torch.compile(step, fullgraph=True)(q, compiled_cache, k, v, b_idx, pos, ids, indptr, lastp)
    torch.cuda.synchronize()
    assert torch.equal(compiled_cache, eager_cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("static_cache", [True, False], ids=["static-cache", "copied-cache"])
def test_reduce_overhead_decode_replays_after_fast_plan(static_cache):
    """mode="reduce-overhead" over a use_cuda_graph=True wrapper's run(): each step re-plans with fast_plan() (host
    metadata, other lengths and page tables) and the replayed graph matches the reference. A cache that is not
    marked static is copied into the graph pool while it records: run() must not keep that copy alive."""
    pool = 4000
    cache = torch.randn(pool, 2, PS, H_KV, D, generator=torch.Generator().manual_seed(8)).to(DT).to(DEV)
    if static_cache:
        torch._dynamo.mark_static_address(cache)
    # graph mode keeps every buffer's address: the page-id buffer must hold the largest step's pages
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=DEV),
                                                   use_cuda_graph=True,
                                                   paged_kv_indices_buffer=torch.zeros(pool, dtype=torch.int32,
                                                                                       device=DEV))
    step = torch.compile(lambda q: w.run(q, cache), mode="reduce-overhead", fullgraph=True)
    import random

    rng = random.Random(9)
    for i, kv_lens in enumerate([(5, 17, 64, 100), (9000, 20, 1, 700), (300, 301, 302, 1), (1, 1, 1, 1),
                                 (2000, 2, 2, 2), (64, 64, 64, 64)]):
        ids = rng.sample(range(pool), sum(-(-k // PS) for k in kv_lens))
        indptr, pos = [0], 0
        for k in kv_lens:
            pos += -(-k // PS)
            indptr.append(pos)
        last = [k - PS * (-(-k // PS) - 1) for k in kv_lens]
        host = (i32(indptr), i32(ids), i32(last))
        if i == 0:
            w.plan(*host, H_Q, H_KV, D, PS, q_data_type=DT)
        else:
            w.fast_plan(*host)
        q = torch.randn(4, H_Q, D, generator=torch.Generator().manual_seed(i)).to(DT).to(DEV)
        out = step(q).clone()
        torch.cuda.synchronize()
        ref, _ = reference.batch_decode(q, cache, indptr, ids, last, page_size=PS)
        assert_close(out, ref, DT, what=f"step {i}")


def test_reduce_overhead_single_and_merge_ops_equal_eager():
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(s, h, D, generator=gen).to(DT).to(DEV) for s, h in ((37, H_Q), (90, H_KV), (90, H_KV)))
    va, sa = _states(rows=37, heads=H_Q, seed=11)

    def fn(q, k, v):
        o, lse = attnjit.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
        od = attnjit.single_decode_with_kv_cache(q[0], k, v)
        m, ms = attnjit.merge_state(o, lse, va, sa)
        return o, lse, od, m, ms

    want = fn(q, k, v)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):   # warm-up, record, replays
        got = [t.clone() for t in compiled(q, k, v)]
        torch.cuda.synchronize()
        for g, e in zip(got, want):
            assert torch.equal(g, e)


def test_reduce_overhead_append_writes_the_pages():
    """append mutates its cache input: under reduce-overhead the result equals eager's (whether or not the graph
    tree records the mutation)."""
    k, v, b_idx, pos, cache, ids, indptr, lastp = _append_args(seed=12)

    def fn(k, v, cache):
        attnjit.append_paged_kv_cache(k, v, b_idx, pos, cache, ids, indptr, lastp)
        return cache.sum()

    want_cache = cache.clone()
    fn(k, v, want_cache)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got_cache = cache.clone()
        compiled(k, v, got_cache)
        torch.cuda.synchronize()
        assert torch.equal(got_cache, want_cache)
