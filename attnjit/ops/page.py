"""append_paged_kv_cache and get_batch_indices_positions: writing new tokens' K/V into their pages."""

from __future__ import annotations

import torch

from .. import dispatch
from ..generator import PARAMS
from ._common import SPEC_DTYPE, check_layout, check_metadata, check_tensor, spec_for, unpack_paged_cache

_launches: dict[tuple, dispatch.Launch] = {}


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor,
                                nnz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request index and KV position of each appended token.

    append_indptr: [B+1] int32 (new tokens per request), seq_lens: [B] int32 (KV length after the append),
    nnz = append_indptr[-1]. Token t of request b (t counted from append_indptr[b]) gets position
    seq_lens[b] - (append_indptr[b+1] - append_indptr[b]) + t. No host synchronization.
    """
    dev = append_indptr.device
    check_metadata("append_indptr", append_indptr, dev)
    check_metadata("seq_lens", seq_lens, dev, append_indptr.numel() - 1)
    if type(nnz) is not int or nnz < 0:
        raise ValueError(f"nnz must be a non-negative int (append_indptr[-1]), got {nnz!r}")
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
    """Write append_key/append_value [nnz, H_kv, D] into the pages of their requests.

    Token i goes to request batch_indices[i] at position positions[i]: page kv_indices[kv_indptr[b] + pos //
    page_size], slot pos % page_size. Shapes, dtypes and devices are always checked. Values are checked on the
    host only with ``check=True`` (it synchronizes); without it, a token whose position lies outside its
    request's pages is skipped by the kernel, which never writes out of bounds.
    """
    check_layout(kv_layout)
    cache = unpack_paged_cache("paged_kv_cache", paged_kv_cache, kv_layout)
    dev = cache.k.device
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        check_tensor(name, t, dtype=cache.k.dtype, dim=3, device=dev)
        if t.shape[1] != cache.num_kv_heads or t.shape[2] != cache.head_dim or t.stride(2) != 1:
            raise ValueError(f"{name} must be [nnz, H_kv={cache.num_kv_heads}, D={cache.head_dim}] with a contiguous "
                             f"last dim; got {list(t.shape)} strides {t.stride()}")
    nnz = append_key.shape[0]
    if append_value.shape[0] != nnz:
        raise ValueError(f"append_value has {append_value.shape[0]} tokens, append_key {nnz}")
    check_metadata("batch_indices", batch_indices, dev, nnz)
    check_metadata("positions", positions, dev, nnz)
    check_metadata("kv_indptr", kv_indptr, dev)
    check_metadata("kv_indices", kv_indices, dev)
    batch = kv_indptr.numel() - 1
    check_metadata("kv_last_page_len", kv_last_page_len, dev, batch)
    if check and nnz:
        _check_values(batch_indices, positions, kv_indptr, kv_indices, kv_last_page_len, cache)
    if nnz == 0:
        return
    spec = spec_for(op="append_kv", head_dim=cache.head_dim, page_size=cache.page_size,
                    dtype_kv=SPEC_DTYPE[cache.k.dtype], layout=kv_layout, arch=dispatch.device_arch(dev))
    mod = dispatch.module(spec, dev)
    launch = _launches.get((spec, mod.device_index))
    if launch is None or launch.kernel.module is not mod:  # first call, or the module was reloaded
        launch = dispatch.Launch("append_kv", mod.kernels["attnjit_append_kv"], (1, 1, 1))
        _launches[(spec, mod.device_index)] = launch
    threads = nnz * cache.num_kv_heads * (cache.head_dim // 8)
    launch.grid = (-(-threads // 128), 1, 1)
    launch(PARAMS["append"].values(
        k=append_key.data_ptr(), v=append_value.data_ptr(), batch_indices=batch_indices.data_ptr(),
        positions=positions.data_ptr(), kv_indptr=kv_indptr.data_ptr(), kv_indices=kv_indices.data_ptr(),
        k_cache=cache.k.data_ptr(), v_cache=cache.v.data_ptr(), nnz=nnz, num_heads=cache.num_kv_heads,
        batch_size=batch, num_pages=cache.num_pages, k_stride_n=append_key.stride(0),
        k_stride_h=append_key.stride(1), v_stride_n=append_value.stride(0), v_stride_h=append_value.stride(1),
        cache_stride_page=cache.stride_page, cache_stride_inner=cache.stride_inner))


def _check_values(batch_indices, positions, kv_indptr, kv_indices, kv_last_page_len, cache) -> None:
    b = batch_indices.tolist()
    pos = positions.tolist()
    indptr = kv_indptr.tolist()
    last = kv_last_page_len.tolist()
    batch = len(indptr) - 1
    for i, (bi, p) in enumerate(zip(b, pos)):
        if not 0 <= bi < batch:
            raise ValueError(f"batch_indices[{i}]={bi} is outside 0..{batch - 1}")
        pages = indptr[bi + 1] - indptr[bi]
        kv_len = cache.page_size * (pages - 1) + last[bi] if pages else 0
        if not 0 <= p < kv_len:
            raise ValueError(f"positions[{i}]={p} is outside request {bi}'s KV length {kv_len} (pages {pages}, "
                             f"last_page_len {last[bi]})")
    used = kv_indices[:indptr[-1]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache.num_pages):
        raise ValueError(f"kv_indices holds page ids outside 0..{cache.num_pages - 1}")
