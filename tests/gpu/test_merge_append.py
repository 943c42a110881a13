"""merge_state(s) and append_paged_kv_cache against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

import attnjit
from attnjit import reference

from ..helpers import i32

DEV = "cuda"


def _states(rows, heads, dim, dtype, seed, n=None, empty_frac=0.2):
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, heads) if n is None else (rows, n, heads)
    v = torch.randn(*shape, dim, generator=gen)
    s = torch.randn(*shape, generator=gen) * 8
    empty = torch.rand(*shape, generator=gen) < empty_frac
    s[empty] = -math.inf
    v[empty] = 0.0
    return v.to(dtype).to(DEV), s.to(DEV)


def _check(v, s, ref_v, ref_s, dtype):
    assert torch.isfinite(v.float()).all()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    err = (v.double() - ref_v).abs().max().item()
    assert err <= tol * 4, f"max abs error {err}"
    assert torch.equal(torch.isinf(s), torch.isinf(ref_s))
    fin = torch.isfinite(ref_s)
    assert (s[fin].double() - ref_s[fin]).abs().max().item() < 1e-4 if fin.any() else True


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_merge_state(dtype, dim):
    va, sa = _states(333, 8, dim, dtype, 1)
    vb, sb = _states(333, 8, dim, dtype, 2)
    v, s = attnjit.merge_state(va, sa, vb, sb)
    ref_v, ref_s = reference.merge_state(va, sa, vb, sb)
    _check(v, s, ref_v, ref_s, dtype)


def test_merge_state_seed_example():
    """[1, 0] with lse 2 and [0, 1] with lse 1 merge to [2/3, 1/3] with lse 2 + log2(1.5) = 2.585."""
    va = torch.zeros(1, 1, 64, dtype=torch.float16, device=DEV)
    vb = torch.zeros_like(va)
    va[0, 0, 0], vb[0, 0, 1] = 1.0, 1.0
    sa = torch.tensor([[2.0]], device=DEV)
    sb = torch.tensor([[1.0]], device=DEV)
    v, s = attnjit.merge_state(va, sa, vb, sb)
    assert abs(v[0, 0, 0].item() - 2 / 3) < 1e-3 and abs(v[0, 0, 1].item() - 1 / 3) < 1e-3
    assert abs(s.item() - (2 + math.log2(1.5))) < 1e-5
    # merging with the empty state (0, -inf) is the identity; two empty states stay empty
    v2, s2 = attnjit.merge_state(v, s, torch.zeros_like(v), torch.full_like(s, -math.inf))
    assert torch.equal(v2, v) and torch.equal(s2, s)
    v3, s3 = attnjit.merge_state(torch.zeros_like(v), torch.full_like(s, -math.inf), torch.zeros_like(v),
                                 torch.full_like(s, -math.inf))
    assert torch.equal(v3, torch.zeros_like(v3)) and s3.item() == -math.inf


def test_merge_state_in_place_with_mask():
    va, sa = _states(100, 4, 128, torch.bfloat16, 3)
    vb, sb = _states(100, 4, 128, torch.bfloat16, 4)
    mask = torch.rand(100, generator=torch.Generator().manual_seed(5)) < 0.5
    v, s = va.clone(), sa.clone()
    attnjit.merge_state_in_place(v, s, vb, sb, mask=mask.to(DEV))
    ref_v, ref_s = reference.merge_state(va, sa, vb, sb)
    m = mask.to(DEV)
    _check(v[m], s[m], ref_v[m], ref_s[m], torch.bfloat16)
    assert torch.equal(v[~m], va[~m]) and torch.equal(s[~m], sa[~m])
    v, s = va.clone(), sa.clone()
    attnjit.merge_state_in_place(v, s, vb, sb)
    _check(v, s, ref_v, ref_s, torch.bfloat16)


def test_a_nan_state_makes_the_merge_nan_not_the_empty_state():
    """A state with a NaN lse (what a NaN input or an invalid logits_scale gives, common.cuh row_lse) merges to NaN,
    o and lse, in merge_state, merge_state_in_place and merge_states: with every state NaN too, where the max over
    the lse (fmaxf drops a NaN) alone said "no key" and gave the empty state's (0, -inf), a finite wrong row."""
    nan, inf = math.nan, math.inf
    va, sa = _states(4, 2, 128, torch.bfloat16, 21, empty_frac=0.0)
    vb, sb = _states(4, 2, 128, torch.bfloat16, 22, empty_frac=0.0)
    # rows: (NaN, NaN), (NaN, a state), (a state, NaN), (NaN, the empty state)
    sa[0], sb[0], sa[1], sb[2], sa[3], sb[3] = nan, nan, nan, nan, nan, -inf
    vb[3] = 0
    v, s = attnjit.merge_state(va, sa, vb, sb)
    assert torch.isnan(s).all() and torch.isnan(v).all(), (s, v.isnan().float().mean().item())
    v2, s2 = va.clone(), sa.clone()
    attnjit.merge_state_in_place(v2, s2, vb, sb)
    assert torch.isnan(s2).all() and torch.isnan(v2).all()
    for n in (2, 5):
        vm, sm = _states(3, 2, 128, torch.float16, 23, n=n, empty_frac=0.0)
        sm[0] = nan          # every state of row 0
        sm[1, 0] = nan       # one state of row 1
        sm[2, :, 0] = -inf   # row 2, head 0: all empty, no NaN: stays the empty state
        vm[2, :, 0] = 0
        out, lse = attnjit.merge_states(vm, sm)
        assert torch.isnan(lse[:2]).all() and torch.isnan(out[:2]).all()
        assert lse[2, 0].item() == -inf and not out[2, 0].float().any()
        assert torch.isfinite(lse[2, 1]) and torch.isfinite(out[2, 1].float()).all()


def test_a_nan_o_reaches_the_merge_however_small_its_weight():
    """A finite state with a NaN o (a NaN value among its keys) whose weight underflows to 0 next to the others
    (lse 300 below the max: 2^-300 is 0 in fp32) still makes the merged o NaN, with the finite lse of the rest, as
    the split merges give (0 * NaN): merge_n used to skip a zero weight and return a finite row the input never
    had. An empty state's o (lse -inf) is still never read, NaN or not."""
    va, sa = _states(2, 2, 128, torch.bfloat16, 31, empty_frac=0.0)
    vb, sb = _states(2, 2, 128, torch.bfloat16, 32, empty_frac=0.0)
    sa[:] = 10.0
    sb[0] = -290.0            # row 0: b finite, far below a, o NaN
    vb[0] = math.nan
    sb[1] = -math.inf         # row 1: b empty, o NaN: never read
    vb[1] = math.nan
    v, s = attnjit.merge_state(va, sa, vb, sb)
    assert torch.isnan(v[0]).all() and torch.equal(s[0], sa[0]), (v[0], s[0])
    assert torch.equal(v[1], va[1]) and torch.equal(s[1], sa[1])
    vm, sm = _states(2, 2, 128, torch.float16, 33, n=5, empty_frac=0.0)
    sm[:] = 4.0
    sm[:, 3] = -300.0
    vm[0, 3] = math.nan       # row 0: one underflowed state's o NaN
    sm[1, 2] = -math.inf
    vm[1, 2] = math.nan       # row 1: one empty state's o NaN, the underflowed state finite
    out, lse = attnjit.merge_states(vm, sm)
    assert torch.isnan(out[0]).all() and torch.isfinite(lse[0]).all()
    keep = [0, 1, 3, 4]       # row 1 without its empty state (the reference would read its NaN o)
    ref_v, ref_s = reference.merge_states(vm[1:, keep], sm[1:, keep])
    _check(out[1:], lse[1:], ref_v, ref_s, torch.float16)


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_merge_states(n):
    v, s = _states(77, 8, 128, torch.float16, 10 + n, n=n, empty_frac=0.3)
    s[0] = -math.inf  # a row whose every state is empty
    v[0] = 0
    out, lse = attnjit.merge_states(v, s)
    ref_v, ref_s = reference.merge_states(v, s)
    _check(out, lse, ref_v, ref_s, torch.float16)
    assert lse[0].isinf().all() and torch.equal(out[0].float(), torch.zeros_like(out[0].float()))


@pytest.mark.parametrize("layout,page_size,dtype", [("NHD", 16, torch.bfloat16), ("NHD", 1, torch.float16),
                                                     ("HND", 16, torch.float16), ("HND", 8, torch.bfloat16),
                                                     ("NHD", 48, torch.bfloat16), ("HND", 5, torch.float16),
                                                     ("NHD", 16, torch.float8_e4m3fn), ("HND", 5, torch.float8_e5m2)],
                         ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_append_paged_kv_cache(layout, page_size, dtype):
    """fp8 caches take fp8 tokens (16 elements per 16-byte copy); the comparison is bitwise."""
    gen = torch.Generator().manual_seed(page_size)
    seq_lens = [7, 1, 40, 16]          # KV length after the append
    append = [3, 1, 17, 16]            # new tokens per request
    pages = [-(-k // page_size) for k in seq_lens]
    ids = torch.randperm(sum(pages) + 5, generator=gen).tolist()
    kv_indptr, kv_indices, pos = [0], [], 0
    for n in pages:
        kv_indices += ids[pos:pos + n]
        pos += n
        kv_indptr.append(len(kv_indices))
    last = [k - page_size * (n - 1) for k, n in zip(seq_lens, pages)]
    total_pages = sum(pages) + 5
    shape = (total_pages, 2, page_size, 4, 128) if layout == "NHD" else (total_pages, 2, 4, page_size, 128)
    cache = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    before = cache.clone()
    append_indptr = [0]
    for a in append:
        append_indptr.append(append_indptr[-1] + a)
    nnz = append_indptr[-1]
    k = torch.randn(nnz, 4, 128, generator=gen).to(dtype).to(DEV)
    v = torch.randn(nnz, 4, 128, generator=gen).to(dtype).to(DEV)
    b_idx, positions = attnjit.get_batch_indices_positions(i32(append_indptr, DEV), i32(seq_lens, DEV), nnz)
    ref_b, ref_pos = reference.batch_indices_positions(append_indptr, seq_lens)
    assert b_idx.tolist() == ref_b and positions.tolist() == ref_pos
    attnjit.append_paged_kv_cache(k, v, b_idx, positions, cache, i32(kv_indices, DEV), i32(kv_indptr, DEV),
                                  i32(last, DEV), kv_layout=layout, check=True)
    as_bytes = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)  # noqa: E731
    ref_k, ref_v = reference.append_paged_kv_cache(as_bytes(k), as_bytes(v), ref_b, ref_pos, as_bytes(before),
                                                   kv_indices, kv_indptr, page_size=page_size, layout=layout)
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731 (fp8 tensors compare as bytes)
    assert torch.equal(bits(cache[:, 0]), bits(ref_k)) and torch.equal(bits(cache[:, 1]), bits(ref_v))


def test_append_out_of_range_is_an_error_with_check_and_skipped_without():
    cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.float16, device=DEV)
    k = torch.ones(1, 2, 64, dtype=torch.float16, device=DEV)
    args = (i32([0], DEV), i32([16], DEV), cache, i32([2], DEV), i32([0, 1], DEV), i32([16], DEV))
    with pytest.raises(ValueError, match="positions"):
        attnjit.append_paged_kv_cache(k, k, *args, check=True)
    attnjit.append_paged_kv_cache(k, k, *args)  # position 16 is past the request's only page: not written
    torch.cuda.synchronize()
    assert cache.abs().sum().item() == 0


@pytest.mark.parametrize("indptr,position", [([0, 3], 16), ([-1, 1], 0)], ids=["past-the-end", "negative"])
def test_append_never_reads_a_page_id_outside_kv_indices(indptr, position):
    """kv_indices is a view into a larger table (the entries beside it are real page ids, 2 and 3): an indptr that
    points past its end or before its start, unchecked without check=True, must not make the kernel read a
    neighbouring entry and write the token into that page (another request's)."""
    cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.float16, device=DEV)
    k = torch.ones(1, 2, 64, dtype=torch.float16, device=DEV)
    table = i32([3, 1, 2], DEV)
    args = (i32([0], DEV), i32([position], DEV), cache, table[1:2], i32(indptr, DEV), i32([16], DEV))
    with pytest.raises(ValueError, match="kv_indptr|kv_indices"):
        attnjit.append_paged_kv_cache(k, k, *args, check=True)
    attnjit.append_paged_kv_cache(k, k, *args)
    torch.cuda.synchronize()
    assert cache.abs().sum().item() == 0, "a token was written through a page id outside kv_indices"


def test_outputs_that_need_a_gradient_fail_in_backward_not_silently():
    """attnjit's kernels have no backward: with grad mode on and q (or a state) requiring grad, the outputs carry a
    grad_fn whose backward raises (ops/_grad.py); under no_grad they are plain tensors, as every engine runs them."""
    v_a, s_a = _states(16, 4, 64, torch.float16, 1)
    v_b, s_b = _states(16, 4, 64, torch.float16, 2)
    v_a.requires_grad_()
    v, s = attnjit.merge_state(v_a, s_a, v_b, s_b)
    assert v.requires_grad
    with pytest.raises(RuntimeError, match="no backward pass"):
        v.float().sum().backward()
    with torch.no_grad():
        v2, _ = attnjit.merge_state(v_a, s_a, v_b, s_b)
    assert not v2.requires_grad and torch.equal(v2, v.detach())
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=DEV, requires_grad=True)
    k = torch.randn(32, 1, 64, dtype=torch.float16, device=DEV)
    o = attnjit.single_prefill_with_kv_cache(q, k, k.clone(), causal=True)
    assert o.requires_grad
    with pytest.raises(RuntimeError, match=r"no backward pass.*\.run\(\)"):
        o.float().sum().backward()
    assert q.grad is None
    with torch.inference_mode():
        assert not attnjit.single_prefill_with_kv_cache(q.detach(), k, k.clone(), causal=True).requires_grad
    # k or v alone requiring grad (q plain) is guarded too, and so is a paged cache passed as a (k, v) tuple
    kg = k.clone().requires_grad_()
    o = attnjit.single_prefill_with_kv_cache(q.detach(), kg, k.clone(), causal=True)
    with pytest.raises(RuntimeError, match="no backward pass"):
        o.float().sum().backward()
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV))
    w.plan(torch.tensor([0, 2], dtype=torch.int32, device=DEV), torch.tensor([0, 1], dtype=torch.int32, device=DEV),
           torch.tensor([16], dtype=torch.int32, device=DEV), 4, 1, 64, 16, q_data_type=torch.bfloat16)
    cache_k = torch.randn(2, 16, 1, 64, dtype=torch.bfloat16, device=DEV)   # (a spec of specs/gpu-tests.toml)
    o = w.run(q.detach().bfloat16(), (cache_k, cache_k.clone().requires_grad_()))
    assert o.requires_grad
    with pytest.raises(RuntimeError, match=r"BatchDecodeWithPagedKVCacheWrapper\.run\(\)"):
        o.float().sum().backward()
    # an in-place merge refuses a state that requires grad (its write would be invisible to autograd)
    with pytest.raises(RuntimeError, match="writes in place"):
        attnjit.merge_state_in_place(v_b.clone(), s_b.clone(), v_a, s_a)
