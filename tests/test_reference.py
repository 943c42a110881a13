"""The float64 reference (attnjit.reference) against the seed's worked examples and against naive loops.

Every GPU test compares a kernel to this module, so it is checked here against code that shares nothing with it:
plain Python loops over math.exp.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from attnjit import reference as ref
from tests.helpers import logit_offset, make_paged

# The seed's batch: R0 3 new tokens after 3, R1 1 after 1, R2 4 after 5; page size 4.
SEED_QO_INDPTR = [0, 3, 4, 8]
SEED_KV_INDPTR = [0, 2, 3, 6]
SEED_KV_INDICES = [7, 2, 11, 3, 14, 6]
SEED_LAST_PAGE_LEN = [2, 2, 1]
SEED_PAGE_SIZE = 4


# --- indexing (seed) ------------------------------------------------------------------------------------

def test_seed_kv_lengths():
    assert ref.kv_lengths(SEED_KV_INDPTR, SEED_LAST_PAGE_LEN, SEED_PAGE_SIZE) == [6, 2, 9]


def test_kv_length_of_a_request_without_pages_is_zero():
    assert ref.kv_lengths([0, 2, 2, 3], [4, 0, 1], 4) == [8, 0, 1]


def test_seed_token_address():
    r2_pages = SEED_KV_INDICES[SEED_KV_INDPTR[2]:SEED_KV_INDPTR[3]]
    assert r2_pages == [3, 14, 6]
    assert ref.token_address(r2_pages, SEED_PAGE_SIZE, 5) == (14, 1)  # R2's logical token 5: page 14, slot 1
    # logical order is page-table order, never sorted page ids
    assert [ref.token_address(r2_pages, SEED_PAGE_SIZE, j) for j in range(9)] == \
        [(3, 0), (3, 1), (3, 2), (3, 3), (14, 0), (14, 1), (14, 2), (14, 3), (6, 0)]


def test_seed_causal_rows_are_bottom_right_aligned():
    visible = ref.causal_visible(4, 9)  # R2: 4 queries over 9 keys
    assert visible.sum(dim=1).tolist() == [6, 7, 8, 9]
    # row 0 (logical position 5) sees keys 0..5
    assert visible[0].tolist() == [True] * 6 + [False] * 3
    assert ref.causal_visible(3, 6).sum(dim=1).tolist() == [4, 5, 6]  # R0
    assert ref.causal_visible(1, 2).sum(dim=1).tolist() == [2]        # R1 (decode row sees everything)
    # more queries than keys: the first rows see nothing
    assert ref.causal_visible(4, 2).sum(dim=1).tolist() == [0, 0, 1, 2]


def test_gather_pages_follows_the_page_table_in_both_layouts():
    batch = make_paged([3, 1, 4], [6, 2, 9], page_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=8,
                       dtype=torch.float32, seed=3)
    k_nhd = batch.cache[:, 0]                          # [P, page, H, D]
    k_hnd = k_nhd.transpose(1, 2).contiguous()         # [P, H, page, D]
    ids = batch.kv_indices[batch.kv_indptr[2]:batch.kv_indptr[3]]
    for layout, pages in (("NHD", k_nhd), ("HND", k_hnd)):
        got = ref.gather_pages(pages, ids, 9, layout)
        assert got.shape == (9, 2, 8)
        for j in range(9):
            page, slot = ref.token_address(ids, 4, j)
            want = k_nhd[page, slot]
            assert torch.equal(got[j], want), (layout, j)


# --- merge_state (seed numbers) --------------------------------------------------------------------------

def _state(o: list[float], lse: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row, one head: v [1, 1, D], s [1, 1]."""
    return torch.tensor([[o]], dtype=torch.float64), torch.tensor([[lse]], dtype=torch.float64)


def test_seed_merge_state_numbers():
    o, lse = ref.merge_state(*_state([1.0, 0.0], 2.0), *_state([0.0, 1.0], 1.0))
    assert o[0, 0].tolist() == pytest.approx([2 / 3, 1 / 3], abs=1e-12)
    assert lse.item() == pytest.approx(2 + math.log2(1.5), abs=1e-12)
    assert round(lse.item(), 3) == 2.585


def test_merging_with_the_empty_state_is_the_identity():
    state = _state([0.25, -0.5], 3.75)
    empty = _state([0.0, 0.0], -math.inf)
    for a, b in ((empty, state), (state, empty)):
        o, lse = ref.merge_state(*a, *b)
        assert torch.equal(o, state[0]) and torch.equal(lse, state[1])
    o, lse = ref.merge_state(*empty, *empty)
    assert torch.equal(o, torch.zeros(1, 1, 2, dtype=torch.float64)) and lse.item() == -math.inf


def test_merge_of_huge_values_does_not_overflow():
    o, lse = ref.merge_state(*_state([1e308], 0.0), *_state([1e308], 0.0))
    assert o.item() == 1e308 and math.isfinite(o.item())
    assert lse.item() == pytest.approx(1.0)  # log2(2^0 + 2^0)


def test_merge_uses_base_two():
    correct = ref.merge_state(*_state([1.0, 0.0], 2.0), *_state([0.0, 1.0], 1.0))[0][0, 0, 0].item()
    natural = ref.merge_state(*_state([1.0, 0.0], 2 * math.log(2)), *_state([0.0, 1.0], math.log(2)))[0][0, 0, 0]
    assert abs(natural.item() - correct) > 0.04  # lse in the wrong base weighs the states wrongly


def test_merge_states_many_and_all_empty_rows():
    # row 0: three states, one empty; row 1: all empty
    v = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]], [[0.0, 0.0]]],
                      [[[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]]]], dtype=torch.float64)  # [2, 3, 1, 2]
    s = torch.tensor([[[2.0], [1.0], [-math.inf]], [[-math.inf], [-math.inf], [-math.inf]]], dtype=torch.float64)
    o, lse = ref.merge_states(v, s)
    assert o[0, 0].tolist() == pytest.approx([2 / 3, 1 / 3], abs=1e-12)
    assert lse[0, 0].item() == pytest.approx(2 + math.log2(1.5), abs=1e-12)
    assert o[1, 0].tolist() == [0.0, 0.0] and lse[1, 0].item() == -math.inf
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()


def test_merge_states_with_a_nan_state_is_nan_not_the_empty_state():
    """A NaN lse among a row's states (a NaN input upstream) makes the merge NaN, as the kernels' merge_n does:
    with every state NaN the max alone said "no key" and gave (0, -inf), a finite row a later merge would drop."""
    nan, inf = math.nan, -math.inf
    v = torch.ones(4, 2, 1, 2, dtype=torch.float64)
    s = torch.tensor([[[nan], [nan]], [[nan], [1.0]], [[nan], [inf]], [[inf], [inf]]], dtype=torch.float64)
    v[3] = 0
    o, lse = ref.merge_states(v, s)
    assert torch.isnan(o[:3]).all() and torch.isnan(lse[:3]).all()
    assert o[3].tolist() == [[0.0, 0.0]] and lse[3].item() == -math.inf


# --- attention against a naive loop ----------------------------------------------------------------------

def naive_attention(q, k, v, *, causal: bool, sm_scale: float):
    """Per (row, head): softmax over the visible keys with math.exp. Empty rows give (0, -inf)."""
    qo_len, h_q, dim = q.shape
    kv_len, h_kv = k.shape[0], k.shape[1]
    group = h_q // h_kv
    o = [[[0.0] * dim for _ in range(h_q)] for _ in range(qo_len)]
    lse = [[-math.inf] * h_q for _ in range(qo_len)]
    for i in range(qo_len):
        last = kv_len - qo_len + i if causal else kv_len - 1  # bottom-right: row i sees j <= K - Q + i
        for h in range(h_q):
            kh = h // group  # GQA: query head h reads KV head h // group
            scores = [sm_scale * sum(float(q[i, h, d]) * float(k[j, kh, d]) for d in range(dim))
                      for j in range(0, max(0, min(last + 1, kv_len)))]
            if not scores:
                continue
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            z = sum(w)
            o[i][h] = [sum(w[j] * float(v[j, kh, d]) for j in range(len(w))) / z for d in range(dim)]
            lse[i][h] = (m + math.log(z)) / math.log(2)
    return torch.tensor(o, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


@pytest.mark.parametrize("qo_len,kv_len,causal", [(4, 9, True), (5, 3, True), (3, 7, False), (1, 1, True)])
def test_reference_attention_matches_a_naive_loop(qo_len, kv_len, causal):
    gen = torch.Generator().manual_seed(qo_len * 100 + kv_len)
    h_q, h_kv, dim = 6, 2, 8  # GQA group 3
    q = torch.randn(qo_len, h_q, dim, generator=gen)
    k = torch.randn(kv_len, h_kv, dim, generator=gen)
    v = torch.randn(kv_len, h_kv, dim, generator=gen)
    scale = 0.3
    o, lse = ref.attention(q, k, v, causal=causal, sm_scale=scale)
    o_naive, lse_naive = naive_attention(q, k, v, causal=causal, sm_scale=scale)
    assert o.dtype == torch.float64 and o.shape == (qo_len, h_q, dim) and lse.shape == (qo_len, h_q)
    torch.testing.assert_close(o, o_naive, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_naive, rtol=1e-12, atol=1e-12)
    if causal and qo_len > kv_len:
        masked = qo_len - kv_len  # fully masked rows: zeros and -inf, never NaN
        assert torch.equal(o[:masked], torch.zeros_like(o[:masked]))
        assert torch.isneginf(lse[:masked]).all()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()


def test_default_scale_is_one_over_sqrt_head_dim():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 16, generator=gen) for _ in range(3))
    a = ref.attention(q, k, v, causal=False)
    b = ref.attention(q, k, v, causal=False, sm_scale=0.25)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_batch_paged_equals_per_request_attention_on_the_seed_batch():
    batch = make_paged([3, 1, 4], [6, 2, 9], page_size=4, num_qo_heads=8, num_kv_heads=2, head_dim=16,
                       dtype=torch.float32, seed=11)
    o, lse = ref.batch_paged(batch.q, batch.cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                             batch.last_page_len, page_size=4, causal=True)
    ck, cv = ref.split_cache(batch.cache)
    for i, kv_len in enumerate([6, 2, 9]):
        a, b = batch.qo_indptr[i], batch.qo_indptr[i + 1]
        ids = batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i + 1]]
        k = torch.stack([ck[p, s] for p, s in (ref.token_address(ids, 4, j) for j in range(kv_len))])
        v = torch.stack([cv[p, s] for p, s in (ref.token_address(ids, 4, j) for j in range(kv_len))])
        want_o, want_lse = naive_attention(batch.q[a:b], k, v, causal=True, sm_scale=0.25)
        torch.testing.assert_close(o[a:b], want_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[a:b], want_lse, rtol=1e-10, atol=1e-10)


# --- split chunks merge into the whole ---------------------------------------------------------------------

@pytest.mark.parametrize("offset", [-1000.0, 0.0, 1000.0])
def test_merging_split_chunks_equals_the_whole(offset):
    rng = random.Random(int(offset) + 7)
    gen = torch.Generator().manual_seed(int(offset) + 7)
    h_q, h_kv, dim, qo_len = 4, 2, 16, 3
    for kv_len in (1, 2, 9, 33, 100):
        q = torch.randn(qo_len, h_q, dim, generator=gen, dtype=torch.float64)
        k = torch.randn(kv_len, h_kv, dim, generator=gen, dtype=torch.float64)
        v = torch.randn(kv_len, h_kv, dim, generator=gen, dtype=torch.float64)
        scale = 1 / math.sqrt(dim)
        logit_offset(q, k, offset, scale)  # every logit shifted by about `offset`
        whole_o, whole_lse = ref.attention(q, k, v, causal=False, sm_scale=scale)
        assert torch.isfinite(whole_o).all() and torch.isfinite(whole_lse).all()
        if offset:
            assert (whole_lse * math.log(2) - offset).abs().max() < 200  # the offset really is there
        for _ in range(4):
            # random disjoint chunks covering [0, kv_len), empty ones included
            cuts = sorted(rng.randint(0, kv_len) for _ in range(rng.randint(1, 4)))
            bounds = [0, *cuts, kv_len]
            states = [ref.attention(q, k[a:b], v[a:b], causal=False, sm_scale=scale)
                      for a, b in zip(bounds, bounds[1:])]
            vs = torch.stack([o for o, _ in states], dim=1)       # [Q, chunks, H, D]
            ss = torch.stack([s for _, s in states], dim=1)       # [Q, chunks, H]
            o, lse = ref.merge_states(vs, ss)
            assert not torch.isnan(o).any() and not torch.isnan(lse).any()
            torch.testing.assert_close(o, whole_o, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(lse, whole_lse, rtol=1e-12, atol=1e-9)


def test_an_empty_chunk_is_the_empty_state():
    q = torch.randn(2, 2, 4, dtype=torch.float64)
    empty = torch.zeros(0, 1, 4, dtype=torch.float64)
    o, lse = ref.attention(q, empty, empty, causal=False)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_overlapping_chunks_are_not_a_partition():
    # the seed's warning: counting a key twice changes the answer (0.5 -> 2/3)
    q = torch.zeros(1, 1, 2, dtype=torch.float64)
    k = torch.zeros(2, 1, 2, dtype=torch.float64)
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    whole = ref.attention(q, k, v, causal=False)
    assert whole[0][0, 0, 0].item() == pytest.approx(0.5)
    dup = ref.merge_state(*whole, *ref.attention(q, k[:1], v[:1], causal=False))
    assert dup[0][0, 0, 0].item() == pytest.approx(2 / 3)


# --- append reference -------------------------------------------------------------------------------------

def test_batch_indices_positions_and_append_on_the_seed_batch():
    # the seed's new tokens: 3 for R0 (positions 3..5), 1 for R1 (1), 4 for R2 (5..8)
    b, pos = ref.batch_indices_positions(SEED_QO_INDPTR, [6, 2, 9])
    assert b == [0, 0, 0, 1, 2, 2, 2, 2] and pos == [3, 4, 5, 1, 5, 6, 7, 8]
    cache = torch.zeros(15, 2, 4, 1, 1)
    new_k = torch.arange(1, 9, dtype=torch.float32).reshape(8, 1, 1)
    ck, cv = ref.append_paged_kv_cache(new_k, -new_k, b, pos, cache, SEED_KV_INDICES, SEED_KV_INDPTR, page_size=4)
    # R2's token 5 (the fifth new token, value 5) lands at page 14 slot 1
    assert ck[14, 1].item() == 5 and cv[14, 1].item() == -5
    assert ck[6, 0].item() == 8  # R2's token 8: page 6 slot 0
    assert int((ck != 0).sum()) == 8 and cache.abs().sum() == 0  # a copy; the input is untouched
