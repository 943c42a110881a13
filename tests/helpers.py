"""Builders of random test batches (paged and ragged) and the comparison rule, shared by CPU and GPU tests."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

# Relative error bound ||out - ref|| / ||ref|| and the largest absolute error allowed per element.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
ABS_TOL = {torch.bfloat16: 6e-2, torch.float16: 1.5e-2}


def i32(values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def page_tables(kv_lens, page_size: int, pool_pages: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    """(indptr, indices, last_page_len) of requests with these KV lengths over distinct shuffled pages of a pool."""
    rng = random.Random(seed)
    ids = list(range(pool_pages))
    rng.shuffle(ids)
    indptr, indices, last = [0], [], []
    for k in kv_lens:
        n = -(-k // page_size)
        indices += ids[:n]
        ids = ids[n:]
        indptr.append(len(indices))
        last.append(k - page_size * (n - 1))
    return indptr, indices, last


@dataclass
class PagedBatch:
    qo_lens: list[int]
    kv_lens: list[int]
    page_size: int
    layout: str
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    last_page_len: list[int]
    q: torch.Tensor          # [nnz, H_q, D]
    cache: torch.Tensor      # [P, 2, page, H_kv, D] (NHD) or [P, 2, H_kv, page, D] (HND)

    def tensors(self, device):
        return (i32(self.qo_indptr, device), i32(self.kv_indptr, device), i32(self.kv_indices, device),
                i32(self.last_page_len, device))


def logit_offset(q: torch.Tensor, k: torch.Tensor, offset: float, sm_scale: float) -> None:
    """Shift every logit by about ``offset`` (in place): q and k gain a large component along one direction."""
    if offset == 0:
        return
    a = math.sqrt(abs(offset) / sm_scale)
    q[..., 0] += a
    k[..., 0] += math.copysign(a, offset)


def make_paged(qo_lens, kv_lens, *, page_size, num_qo_heads, num_kv_heads, head_dim, dtype, layout="NHD",
               device="cpu", shared_prefix=False, spare_pages=3, seed=0, offset=0.0) -> PagedBatch:
    """Random pages in shuffled order; with shared_prefix, later requests reuse request 0's full first pages."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_pages = [-(-k // page_size) if k else 0 for k in kv_lens]
    total = sum(n_pages) + spare_pages
    ids = list(range(total))
    rng.shuffle(ids)
    pages, pos = [], 0
    for n in n_pages:
        pages.append(ids[pos:pos + n])
        pos += n
    if shared_prefix and pages and pages[0]:
        full0 = kv_lens[0] // page_size
        for i in range(1, len(pages)):
            share = max(0, min(full0, len(pages[i]) - 1))  # the last page stays private (it is being written)
            pages[i][:share] = pages[0][:share]
    kv_indptr, kv_indices, last = [0], [], []
    for n, p, k in zip(n_pages, pages, kv_lens):
        kv_indices += p
        kv_indptr.append(len(kv_indices))
        last.append(k - page_size * (n - 1) if n else 0)
    qo_indptr = [0]
    for q in qo_lens:
        qo_indptr.append(qo_indptr[-1] + q)
    q = torch.randn(qo_indptr[-1], num_qo_heads, head_dim, generator=gen)
    shape = (total, 2, page_size, num_kv_heads, head_dim) if layout == "NHD" else \
        (total, 2, num_kv_heads, page_size, head_dim)
    cache = torch.randn(shape, generator=gen)
    logit_offset(q, cache[:, 0], offset, 1.0 / math.sqrt(head_dim))
    return PagedBatch(list(qo_lens), list(kv_lens), page_size, layout, qo_indptr, kv_indptr, kv_indices, last,
                      q.to(dtype).to(device), cache.to(dtype).to(device))


def make_ragged(qo_lens, kv_lens, *, num_qo_heads, num_kv_heads, head_dim, dtype, device="cpu", seed=0, offset=0.0,
                ramp=0.0):
    """Ragged q, k, v; ``ramp`` scales key j of each request by 1 + ramp * j, so logits grow along the history and a
    row's running max keeps moving from tile to tile."""
    gen = torch.Generator().manual_seed(seed)
    qo_indptr, kv_indptr = [0], [0]
    for q, k in zip(qo_lens, kv_lens):
        qo_indptr.append(qo_indptr[-1] + q)
        kv_indptr.append(kv_indptr[-1] + k)
    q = torch.randn(qo_indptr[-1], num_qo_heads, head_dim, generator=gen)
    k = torch.randn(kv_indptr[-1], num_kv_heads, head_dim, generator=gen)
    v = torch.randn(kv_indptr[-1], num_kv_heads, head_dim, generator=gen)
    logit_offset(q, k, offset, 1.0 / math.sqrt(head_dim))
    if ramp:
        for i in range(len(kv_lens)):
            n = kv_indptr[i + 1] - kv_indptr[i]
            k[kv_indptr[i]:kv_indptr[i + 1]] *= (1 + ramp * torch.arange(n, dtype=k.dtype))[:, None, None]
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return qo_indptr, kv_indptr, cast(q), cast(k), cast(v)


def fp8_scales(kind: str, num_kv_heads: int, device) -> tuple:
    """(k_scale, v_scale) of an fp8 cache: floats, or (kind "tensor") float32 [H_kv] tensors of distinct per-head
    values. The cache holds k / k_scale: with unit-variance keys its values stay well inside e4m3's range (448)."""
    if kind == "tensor":
        h = torch.arange(num_kv_heads, dtype=torch.float32)
        return ((1 + h % 3) / 64).to(device), ((2 + h % 4) / 128).to(device)
    return 1 / 48, 1 / 40


def fp8_kwargs(kv: str | None, kind: str, num_kv_heads: int, device) -> tuple[dict, dict]:
    """An fp8 cache's (plan kwargs, run and reference kwargs): the kv type and fp8_scales(kind); ({}, {}) for
    ``kv`` None (the cache has q's type)."""
    if kv is None:
        return {}, {}
    ks, vs = fp8_scales(kind, num_kv_heads, device)
    return {"kv_data_type": kv}, {"k_scale": ks, "v_scale": vs}


def quantize(t: torch.Tensor, scale, head_axis: int, dtype: torch.dtype) -> torch.Tensor:
    """t / scale in ``dtype`` (fp8); a per-head scale divides along ``head_axis``."""
    if isinstance(scale, torch.Tensor):
        shape = [1] * t.dim()
        shape[head_axis] = -1
        scale = scale.to(t.device).reshape(shape)
    return (t.float() / scale).to(dtype)


def quantize_cache(cache: torch.Tensor, k_scale, v_scale, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A [P, 2, ...] cache quantized to ``dtype``: keys by k_scale, values by v_scale (per head or scalar)."""
    axis = 2 if layout == "NHD" else 1  # of cache[:, i]: [P, page, H, D] (NHD) or [P, H, page, D] (HND)
    return torch.stack([quantize(cache[:, 0], k_scale, axis, dtype), quantize(cache[:, 1], v_scale, axis, dtype)],
                       dim=1)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel does not write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "out") -> float:
    """rel error under REL_TOL[dtype], every element within ABS_TOL[dtype], no NaN/Inf. Returns the rel error."""
    out64 = out.double()
    assert torch.isfinite(out64).all(), f"{what}: {int((~torch.isfinite(out64)).sum())} non-finite elements"
    ref = ref.to(out64.device)
    denom = ref.norm().item()
    rel = (out64 - ref).norm().item() / denom if denom > 0 else (out64 - ref).norm().item()
    worst = (out64 - ref).abs().max().item() if ref.numel() else 0.0
    assert rel < REL_TOL[dtype], f"{what}: relative error {rel:.3e} >= {REL_TOL[dtype]:.0e}"
    assert worst <= ABS_TOL[dtype], f"{what}: max abs error {worst:.3e} > {ABS_TOL[dtype]:.0e}"
    return rel


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, what: str = "lse") -> None:
    """Same -inf pattern; elsewhere |lse - ref| <= 5e-3 + 1e-4 |ref| (base 2)."""
    lse64, ref = lse.double(), ref.to(lse.device).double()
    inf_ref = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse64) & (lse64 < 0), inf_ref), f"{what}: -inf pattern differs"
    assert not torch.isnan(lse64).any(), f"{what}: NaN"
    fin = ~inf_ref
    err = (lse64[fin] - ref[fin]).abs()
    bound = 5e-3 + 1e-4 * ref[fin].abs()
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3e}"


@dataclass
class CascadeBatch:
    """A batch in FlashInfer's cascade layout: per level, groups of consecutive requests share pages of one cache."""

    qo_lens: list[int]
    page_size: int
    levels: list[dict]       # per level: qo_indptr (rows), kv_indptr, kv_indices, last_page_len (lists)
    tokens: list[list[tuple[list[int], int]]]  # per request: (page ids, kv_len) of each level, in level order
    q: torch.Tensor          # [nnz, H_q, D]
    cache: torch.Tensor      # [P, 2, page, H_kv, D] (NHD)

    def arrays(self, device) -> tuple[list, list, list, list]:
        """(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len) as int32 tensors."""
        return tuple([i32(lv[k], device) for lv in self.levels]
                     for k in ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len"))

    def reference(self, *, causal: bool):
        """The flat computation: each request over the concatenation of its levels' keys (float64)."""
        from attnjit import reference

        ck, cv = self.cache[:, 0], self.cache[:, 1]
        o = torch.zeros(self.q.shape, dtype=torch.float64, device=self.q.device)
        lse = torch.full(self.q.shape[:2], -math.inf, dtype=torch.float64, device=self.q.device)
        row = 0
        for r, qlen in enumerate(self.qo_lens):
            parts = self.tokens[r]
            k = torch.cat([reference.gather_pages(ck, ids, n, "NHD") for ids, n in parts])
            v = torch.cat([reference.gather_pages(cv, ids, n, "NHD") for ids, n in parts])
            if qlen:
                o[row:row + qlen], lse[row:row + qlen] = reference.attention(self.q[row:row + qlen], k, v,
                                                                             causal=causal)
            row += qlen
        return o, lse


def make_cascade(qo_lens, levels, *, page_size, num_qo_heads, num_kv_heads, head_dim, dtype, device="cpu",
                 seed=0) -> CascadeBatch:
    """``levels``: per level, groups (n_requests, kv_len) that partition the requests in order; a group's pages hold
    its kv_len tokens (the last one partial), read by every request of the group."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-k // page_size) for lv in levels for _, k in lv)
    ids = list(range(n_pages + 3))
    rng.shuffle(ids)
    pos = 0
    tokens: list[list[tuple[list[int], int]]] = [[] for _ in qo_lens]
    out_levels = []
    for lv in levels:
        assert sum(n for n, _ in lv) == len(qo_lens), "a level's groups cover every request"
        qo_indptr, kv_indptr, kv_indices, last = [0], [0], [], []
        r = 0
        for n, k in lv:
            pages = -(-k // page_size)
            mine = ids[pos:pos + pages]
            pos += pages
            kv_indices += mine
            kv_indptr.append(len(kv_indices))
            last.append(k - page_size * (pages - 1) if pages else 0)
            qo_indptr.append(qo_indptr[-1] + sum(qo_lens[r:r + n]))
            for j in range(r, r + n):
                tokens[j].append((mine, k))
            r += n
        out_levels.append(dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, last_page_len=last))
    q = torch.randn(sum(qo_lens), num_qo_heads, head_dim, generator=gen)
    cache = torch.randn(n_pages + 3, 2, page_size, num_kv_heads, head_dim, generator=gen)
    return CascadeBatch(list(qo_lens), page_size, out_levels, tokens, q.to(dtype).to(device),
                        cache.to(dtype).to(device))
