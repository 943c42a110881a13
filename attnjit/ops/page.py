"""append_paged_kv_cache and get_batch_indices_positions: writing new tokens' K/V into their pages."""

from __future__ import annotations

import numpy as np
import torch

from .. import dispatch
from ..generator import PARAMS
from ._common import (SPEC_DTYPE, byte_span, check_head_dim, check_layout, check_metadata, check_page_size,
                      check_tensor, check_vectors, first_shared, require_cuda, spec_for, unpack_paged_cache)
from ._grad import refuse_in_place
from ..specs import MAX_PAGE_SIZE
from .planner import INT32_MAX, check_indptr


_launches = dispatch.module_memo()  # (dtype, head_dim, page_size, layout, device index) -> Launch: one lookup a call


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor,
                                nnz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request index and KV position of each appended token.

    append_indptr: [B+1] int32 (new tokens per request), seq_lens: [B] int32 (KV length after the append),
    nnz = append_indptr[-1]. Token t of request b (t counted from append_indptr[b]) gets position
    seq_lens[b] - (append_indptr[b+1] - append_indptr[b]) + t. No host synchronization: device metadata is taken
    as it is; host metadata is checked (append_indptr an indptr, nnz its last entry, seq_lens >= each count).
    """
    dev = append_indptr.device
    check_metadata("append_indptr", append_indptr, dev)
    if append_indptr.numel() < 1:
        raise ValueError("append_indptr must have batch_size + 1 >= 1 elements, got an empty tensor")
    check_metadata("seq_lens", seq_lens, dev, append_indptr.numel() - 1)
    if type(nnz) is not int or not 0 <= nnz <= INT32_MAX:
        raise ValueError(f"nnz must be a non-negative int32 (append_indptr[-1]), got {nnz!r}")
    if dev.type == "cpu":   # read without a synchronization
        ptr = append_indptr.numpy().astype(np.int64)
        check_indptr("append_indptr", ptr)
        if ptr[-1] != nnz:
            raise ValueError(f"nnz={nnz} must equal append_indptr[-1]={int(ptr[-1])}")
        counts_h, lens = np.diff(ptr), seq_lens.numpy()
        short = np.flatnonzero(lens < counts_h)
        if short.size:
            i = int(short[0])
            raise ValueError(f"seq_lens[{i}]={int(lens[i])} is less than the {int(counts_h[i])} tokens request {i} "
                             "appends (append_indptr); seq_lens is the KV length after the append")
    batch = seq_lens.numel()
    counts = append_indptr[1:] - append_indptr[:-1]
    batch_indices = torch.repeat_interleave(torch.arange(batch, dtype=torch.int32, device=dev), counts,
                                            output_size=nnz).to(torch.int32)
    start = (seq_lens - counts)[batch_indices.long()] - append_indptr[:-1][batch_indices.long()]
    positions = (torch.arange(nnz, dtype=torch.int32, device=dev) + start).to(torch.int32)
    return batch_indices, positions


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
                          positions: torch.Tensor, paged_kv_cache, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_last_page_len: torch.Tensor, kv_layout: str = "NHD", *, check: bool = False) -> None:
    """Write append_key/append_value [nnz, H_kv, D] into the pages of their requests (append_paged_kv_cache_eager
    describes the rules; inside torch.compile this is torch.ops.attnjit.append_paged_kv_cache). Refuses tokens that
    require grad while grad mode is on: the cache write would be invisible to autograd."""
    refuse_in_place("append_paged_kv_cache", append_key=append_key, append_value=append_value,
                    paged_kv_cache=paged_kv_cache)
    if torch.compiler.is_compiling():
        k_cache, v_cache = (paged_kv_cache, None) if isinstance(paged_kv_cache, torch.Tensor) else paged_kv_cache
        torch.ops.attnjit.append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                                                kv_indices, kv_indptr, kv_last_page_len, kv_layout, check)
        return
    append_paged_kv_cache_eager(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                                kv_indptr, kv_last_page_len, kv_layout, check=check)


def append_paged_kv_cache_eager(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
                                positions: torch.Tensor, paged_kv_cache, kv_indices: torch.Tensor,
                                kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, kv_layout: str = "NHD", *,
                                check: bool = False) -> None:
    """Write append_key/append_value [nnz, H_kv, D] into the pages of their requests.

    Token i goes to request batch_indices[i] at position positions[i]: page kv_indices[kv_indptr[b] + pos //
    page_size], slot pos % page_size. Shapes, dtypes and devices are always checked, and that append_key and
    append_value share no memory with the cache. Values are checked on the host only with ``check=True`` (it
    synchronizes), including that no two tokens land in one (page, slot); without it, a token whose position lies
    outside its request's pages, or whose page-table entry lies outside kv_indices (an indptr past its ends), is
    skipped by the kernel, which never reads or writes out of bounds, and two tokens bound for one slot leave
    either one there.

    The kernel reads batch_indices, positions, kv_indptr and kv_indices as dense arrays (a strided view such as a
    table's column is an error, not a silent misread); keys and values are read 16 bytes at a time; the cache's
    pages may not overlap one another, so every write lands in the page it names. No argument is copied here (the
    call may be captured in a CUDA graph).
    """
    check_layout(kv_layout)
    cache = unpack_paged_cache("paged_kv_cache", paged_kv_cache, kv_layout, written=True)
    check_head_dim("paged_kv_cache head_dim (its last dim)", cache.head_dim)
    try:
        check_page_size(cache.page_size)
    except ValueError:
        raise ValueError(f"paged_kv_cache has page_size={cache.page_size} ({kv_layout} layout); expected an "
                         f"integer from 1 to {MAX_PAGE_SIZE}") from None
    dev = cache.k.device
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if isinstance(t, torch.Tensor) and t.dtype != cache.k.dtype:
            hint = (f"; an fp8 cache takes tokens already quantized to its type, e.g. (k / k_scale).to({cache.k.dtype})"
                    if cache.k.element_size() == 1 else "")
            raise TypeError(f"{name} must be {cache.k.dtype} (the cache's type), got {t.dtype}{hint}")
        check_tensor(name, t, dtype=cache.k.dtype, dim=3, device=dev)
        if t.shape[1] != cache.num_kv_heads or t.shape[2] != cache.head_dim or t.stride(2) != 1:
            raise ValueError(f"{name} must be [nnz, H_kv={cache.num_kv_heads}, D={cache.head_dim}] with a contiguous "
                             f"last dim; got {list(t.shape)} strides {t.stride()}")
        check_vectors(name, t, (0, 1))
    found = first_shared((("append_key", byte_span(append_key)), ("append_value", byte_span(append_value))),
                         cache.spans)
    if found:
        (name, (lo, hi)), (wname, (wlo, whi)) = found
        raise ValueError(f"{name} shares memory with {wname} (bytes {lo:#x}..{hi:#x} and {wlo:#x}..{whi:#x}); "
                         f"the kernel reads {name} while it writes the cache: pass {name} in memory of its own")
    nnz = append_key.shape[0]
    if append_value.shape[0] != nnz:
        raise ValueError(f"append_value has {append_value.shape[0]} tokens, append_key {nnz}")
    check_metadata("batch_indices", batch_indices, dev, nnz, dense=True)
    check_metadata("positions", positions, dev, nnz, dense=True)
    check_metadata("kv_indptr", kv_indptr, dev, dense=True)
    check_metadata("kv_indices", kv_indices, dev, dense=True)
    if kv_indptr.numel() < 1:
        raise ValueError("kv_indptr must have batch_size + 1 >= 1 elements, got an empty tensor")
    batch = kv_indptr.numel() - 1
    check_metadata("kv_last_page_len", kv_last_page_len, dev, batch)
    if type(check) is not bool:
        raise TypeError(f"check must be True or False, got {check!r}")
    if check and nnz:
        _check_values(batch_indices, positions, kv_indptr, kv_indices, kv_last_page_len, cache)
    require_cuda("append_paged_kv_cache", "paged_kv_cache", cache.k)
    if nnz == 0:
        return
    key = (cache.k.dtype, cache.head_dim, cache.page_size, kv_layout, cache.k.get_device())
    launch = _launches.get(key)
    if launch is None:
        spec = spec_for(op="append_kv", head_dim=cache.head_dim, page_size=cache.page_size,
                        dtype_kv=SPEC_DTYPE[cache.k.dtype], layout=kv_layout, arch=dispatch.device_arch(dev))
        mod = dispatch.module(spec, dev)
        launch = _launches[key] = dispatch.Launch("append_kv", mod.kernels["attnjit_append_kv"], (1, 1, 1))
    threads = nnz * cache.num_kv_heads * (cache.head_dim * cache.k.element_size() // 16)  # one per 16 bytes
    launch.grid = (-(-threads // 128), 1, 1)
    launch(PARAMS["append"].values(
        k=append_key.data_ptr(), v=append_value.data_ptr(), batch_indices=batch_indices.data_ptr(),
        positions=positions.data_ptr(), kv_indptr=kv_indptr.data_ptr(), kv_indices=kv_indices.data_ptr(),
        k_cache=cache.k.data_ptr(), v_cache=cache.v.data_ptr(), nnz=nnz, num_heads=cache.num_kv_heads,
        batch_size=batch, num_pages=cache.num_pages, num_indices=kv_indices.numel(),
        k_stride_n=append_key.stride(0), k_stride_h=append_key.stride(1), v_stride_n=append_value.stride(0),
        v_stride_h=append_value.stride(1),
        cache_stride_page=cache.stride_page, cache_stride_inner=cache.stride_inner))


def _check_values(batch_indices, positions, kv_indptr, kv_indices, kv_last_page_len, cache) -> None:
    """check=True: the page table is well formed and every token's position lies in its request's pages (one
    synchronizing read of the metadata)."""
    indptr = kv_indptr.cpu().numpy().astype(np.int64)
    check_indptr("kv_indptr", indptr)
    if indptr[-1] > kv_indices.numel():
        raise ValueError(f"kv_indices has {kv_indices.numel()} entries but kv_indptr[-1]={int(indptr[-1])}")
    last = kv_last_page_len.cpu().numpy().astype(np.int64)
    pages = np.diff(indptr)
    bad = np.flatnonzero((pages > 0) & ((last < 1) | (last > cache.page_size)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"kv_last_page_len[{i}]={int(last[i])} is outside 1..page_size={cache.page_size}")
    kv_len = np.where(pages > 0, cache.page_size * (pages - 1) + last, 0)
    b = batch_indices.cpu().numpy().astype(np.int64)
    pos = positions.cpu().numpy().astype(np.int64)
    batch = len(pages)
    bad = np.flatnonzero((b < 0) | (b >= batch))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"batch_indices[{i}]={int(b[i])} is outside 0..{batch - 1}")
    bad = np.flatnonzero((pos < 0) | (pos >= kv_len[b]))
    if bad.size:
        i = int(bad[0])
        bi = int(b[i])
        raise ValueError(f"positions[{i}]={int(pos[i])} is outside request {bi}'s KV length {int(kv_len[bi])} "
                         f"(pages {int(pages[bi])}, last_page_len {int(last[bi])})")
    used = kv_indices[:int(indptr[-1])].cpu().numpy().astype(np.int64)
    if used.size and (int(used.min()) < 0 or int(used.max()) >= cache.num_pages):
        raise ValueError(f"kv_indices holds page ids outside 0..{cache.num_pages - 1}")
    # two tokens bound for one (page, slot) would race: which one the cache keeps would depend on timing
    target = used[indptr[b] + pos // cache.page_size] * cache.page_size + pos % cache.page_size
    values, counts = np.unique(target, return_counts=True)
    if counts.size and counts.max() > 1:
        i, j = (int(x) for x in np.flatnonzero(target == values[int(np.argmax(counts > 1))])[:2])
        raise ValueError(f"tokens {i} and {j} (batch_indices {int(b[i])} / {int(b[j])}, positions {int(pos[i])} / "
                         f"{int(pos[j])}) are both written to page {int(target[i]) // cache.page_size} slot "
                         f"{int(target[i]) % cache.page_size}: each slot takes one token an append")
