"""Float64 torch references of every op, written for clarity. Tests compare the kernels against these.

Conventions (DESIGN.md): lse is base 2, ``lse = log2(sum_j exp(s_j))`` over the scaled logits; a row with no
visible key has o = 0 and lse = -inf; causal is bottom-right aligned (row i of Q queries over K keys sees key j iff
j <= K - Q + i); GQA query head h reads KV head h // (H_q // H_kv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

LN2 = math.log(2.0)


def kv_lengths(kv_indptr: list[int], last_page_len: list[int], page_size: int) -> list[int]:
    """KV length of each request: page_size * (num_pages - 1) + last_page_len (0 for a request with no pages)."""
    out = []
    for i in range(len(kv_indptr) - 1):
        pages = kv_indptr[i + 1] - kv_indptr[i]
        out.append(page_size * (pages - 1) + last_page_len[i] if pages else 0)
    return out


def token_address(page_ids: list[int], page_size: int, j: int) -> tuple[int, int]:
    """(page, slot) of logical token j of a request whose pages are ``page_ids`` (logical order)."""
    return page_ids[j // page_size], j % page_size


def causal_visible(qo_len: int, kv_len: int) -> torch.Tensor:
    """[qo_len, kv_len] bool: row i sees key j iff j <= kv_len - qo_len + i."""
    i = torch.arange(qo_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    return j <= kv_len - qo_len + i


@dataclass(frozen=True)
class Positions:
    """What a variant's hooks see, for one request: q_pos [Q] (logical: kv_len - qo_len + i), kv_pos [K],
    head [H_q] (query head indices), batch_idx, qo_len, kv_len."""

    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    head: torch.Tensor
    batch_idx: int
    qo_len: int
    kv_len: int


@dataclass(frozen=True)
class Hooks:
    """A variant written as plain torch (tests write these independently of the CUDA snippets). Each gets the
    tensor and a Positions: query(q [Q, H, D]), key(k [K, H_kv, D]), logits(l [H, Q, K], l = sm_scale * q.k), mask
    (-> bool broadcastable to [H, Q, K]), output(o [Q, H, D]); sink(pos) -> [H] sink logits (a key with a zero value
    vector in every row's softmax: o = sum_j e^{l_j} v_j / (sum_j e^{l_j} + e^{sink}), lse includes e^{sink});
    use_softmax=False makes the transformed logits the weights."""

    query: Callable | None = None
    logits: Callable | None = None
    mask: Callable | None = None
    output: Callable | None = None
    key: Callable | None = None
    sink: Callable | None = None
    use_softmax: bool = True


def dequantize(t: torch.Tensor, scale: float | torch.Tensor | None) -> torch.Tensor:
    """A (quantized, e.g. fp8) cache's real values in float64: t * scale. t: [K, H_kv, D] (or any [..., H_kv, D]);
    scale: None (1), a float, or [H_kv] (one per KV head)."""
    t64 = t.double()
    if scale is None:
        return t64
    if isinstance(scale, torch.Tensor):
        return t64 * scale.double().to(t64.device).reshape(-1, 1)
    return t64 * float(scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, sm_scale: float | None = None,
              hooks: Hooks | None = None, batch_idx: int = 0, k_scale: float | torch.Tensor | None = None,
              v_scale: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request. q: [Q, H_q, D], k/v: [K, H_kv, D] -> o [Q, H_q, D] (float64), lse [Q, H_q] (base 2).
    k_scale / v_scale: the cache holds k / k_scale and v / v_scale (fp8); attention runs on the dequantized
    values (``dequantize``), so hooks see them as if the cache held them."""
    qo_len, h_q, dim = q.shape
    kv_len, h_kv = k.shape[0], k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(dim)
    group = h_q // h_kv
    dev = q.device
    pos = Positions(q_pos=torch.arange(qo_len, device=dev) + (kv_len - qo_len), kv_pos=torch.arange(kv_len, device=dev),
                    head=torch.arange(h_q, device=dev), batch_idx=batch_idx, qo_len=qo_len, kv_len=kv_len)
    hooks = hooks or Hooks()
    q64 = q.double()
    if hooks.query is not None:
        q64 = hooks.query(q64, pos).double()
    k64 = dequantize(k, k_scale)
    if hooks.key is not None:
        k64 = hooks.key(k64, pos).double()
    k64 = k64.repeat_interleave(group, dim=1)  # reference only: the kernels never copy KV heads
    v64 = dequantize(v, v_scale).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q64, k64) * scale  # [H_q, Q, K]
    if hooks.logits is not None:
        scores = hooks.logits(scores, pos).double()
    visible = torch.ones_like(scores, dtype=torch.bool)
    if causal:
        visible = visible & causal_visible(qo_len, kv_len).to(dev)[None]
    if hooks.mask is not None:
        visible = visible & hooks.mask(pos).to(dev)
    if not hooks.use_softmax:
        o = torch.einsum("hqk,khd->qhd", torch.where(visible, scores, torch.zeros_like(scores)), v64)
        lse = torch.zeros(qo_len, h_q, dtype=torch.float64, device=dev)
    else:
        scores = scores.masked_fill(~visible, -math.inf)
        if hooks.sink is not None:  # one more key per row: logit sink[h], value 0
            sink = hooks.sink(pos).double().to(dev).reshape(h_q, 1, 1).expand(h_q, qo_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
            v64 = torch.cat([v64, torch.zeros_like(v64[:1])], dim=0)
        lse_e = torch.logsumexp(scores, dim=-1)  # [H_q, Q]; -inf where nothing is visible
        probs = torch.exp(scores - lse_e[..., None].clamp_min(-1e300))  # a fully masked row: exp(-inf) = 0
        o = torch.einsum("hqk,khd->qhd", probs, v64)
        lse = (lse_e / LN2).transpose(0, 1)
    if hooks.output is not None:
        o = hooks.output(o, pos).double()
    return o, lse


def gather_pages(cache_k: torch.Tensor, page_ids: list[int], kv_len: int, layout: str) -> torch.Tensor:
    """[kv_len, H_kv, D] from pages [P, page, H, D] (NHD) or [P, H, page, D] (HND), in the given page order."""
    pages = cache_k[page_ids]
    if layout == "HND":
        pages = pages.transpose(1, 2)
    return pages.reshape(-1, pages.shape[2], pages.shape[3])[:kv_len]


def split_cache(paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(paged_kv_cache, torch.Tensor):
        return paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    return paged_kv_cache[0], paged_kv_cache[1]


def write_slots(paged_kv_cache, page: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layout: str = "NHD") -> None:
    """In place: token i's k/v [nnz, H_kv, D] into page[i], slot[i] of the cache (of the cache's dtype)."""
    ck, cv = split_cache(paged_kv_cache)
    if layout == "NHD":
        ck[page, slot], cv[page, slot] = k, v
    else:
        ck[page, :, slot], cv[page, :, slot] = k, v


def batch_paged(q: torch.Tensor, paged_kv_cache, qo_indptr: list[int], kv_indptr: list[int], kv_indices: list[int],
                last_page_len: list[int], *, page_size: int, causal: bool, layout: str = "NHD",
                sm_scale: float | None = None, hooks: Hooks | None = None, k_scale=None,
                v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch attention over a paged cache. q: [nnz, H_q, D] -> (o [nnz, H_q, D], lse [nnz, H_q]) in float64.
    k_scale / v_scale (float or [H_kv]) dequantize the cache (``attention``)."""
    ck, cv = split_cache(paged_kv_cache)
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)
    lengths = kv_lengths(kv_indptr, last_page_len, page_size)
    for i in range(len(qo_indptr) - 1):
        a, b = qo_indptr[i], qo_indptr[i + 1]
        if a == b:
            continue
        ids = kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
        k = gather_pages(ck, ids, lengths[i], layout)
        v = gather_pages(cv, ids, lengths[i], layout)
        o[a:b], lse[a:b] = attention(q[a:b], k, v, causal=causal, sm_scale=sm_scale, hooks=hooks, batch_idx=i,
                                     k_scale=k_scale, v_scale=v_scale)
    return o, lse


def batch_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: list[int], kv_indptr: list[int], *,
                 causal: bool, sm_scale: float | None = None, hooks: Hooks | None = None, k_scale=None,
                 v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch attention over ragged K/V [nnz_kv, H_kv, D] (k_scale / v_scale as for ``attention``)."""
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)
    for i in range(len(qo_indptr) - 1):
        a, b = qo_indptr[i], qo_indptr[i + 1]
        if a == b:
            continue
        ka, kb = kv_indptr[i], kv_indptr[i + 1]
        o[a:b], lse[a:b] = attention(q[a:b], k[ka:kb], v[ka:kb], causal=causal, sm_scale=sm_scale, hooks=hooks,
                                     batch_idx=i, k_scale=k_scale, v_scale=v_scale)
    return o, lse


def batch_decode(q: torch.Tensor, paged_kv_cache, kv_indptr: list[int], kv_indices: list[int],
                 last_page_len: list[int], *, page_size: int, layout: str = "NHD",
                 sm_scale: float | None = None, hooks: Hooks | None = None, k_scale=None,
                 v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row per request. q: [B, H_q, D]."""
    qo_indptr = list(range(q.shape[0] + 1))
    return batch_paged(q, paged_kv_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, page_size=page_size,
                       causal=False, layout=layout, sm_scale=sm_scale, hooks=hooks, k_scale=k_scale, v_scale=v_scale)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v_a/v_b: [seq, H, D], s_a/s_b: [seq, H]. Normalizes the weights before combining."""
    return merge_states(torch.stack([v_a, v_b], dim=1), torch.stack([s_a, s_b], dim=1))


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [seq, n, H, D], s: [seq, n, H] -> (v [seq, H, D], s [seq, H]); all-empty rows give (0, -inf), and a row
    with a NaN lse among its states gives NaN, o and lse (as the kernels' merge_n: never the empty state)."""
    v64, s64 = v.double(), s.double()
    m = s64.max(dim=1).values                                  # [seq, H]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp2(s64 - m_safe[:, None])                      # [seq, n, H]; exp2(-inf) = 0
    z = w.sum(dim=1)                                           # [seq, H]
    scale = torch.where((z > 0)[:, None], w / z.clamp_min(1e-300)[:, None], torch.zeros_like(w))
    out = (scale[..., None] * v64).sum(dim=1)
    lse = torch.where(z > 0, m_safe + torch.log2(z.clamp_min(1e-300)), torch.full_like(m, -math.inf))
    nan = torch.isnan(s64).any(dim=1)                          # [seq, H]
    return out.masked_fill(nan[..., None], math.nan), lse.masked_fill(nan, math.nan)


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: list[int],
                          positions: list[int], paged_kv_cache, kv_indices: list[int], kv_indptr: list[int], *,
                          page_size: int, layout: str = "NHD"):
    """Returns a copy of the cache with token i written at its request's page and slot."""
    ck, cv = (t.clone() for t in split_cache(paged_kv_cache))
    for i, (b, p) in enumerate(zip(batch_indices, positions)):
        write_slots((ck, cv), kv_indices[kv_indptr[b] + p // page_size], p % page_size, append_key[i],
                    append_value[i], layout)
    return ck, cv


def batch_indices_positions(append_indptr: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
    b_idx, pos = [], []
    for b in range(len(seq_lens)):
        n = append_indptr[b + 1] - append_indptr[b]
        for t in range(n):
            b_idx.append(b)
            pos.append(seq_lens[b] - n + t)
    return b_idx, pos
