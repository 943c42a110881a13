"""What a serving engine swaps in for context parallelism: the wrappers and a shard-aware append, by FlashInfer's
names, so the model's call sites stay as they are (``attnjit.models.Engine(..., ops=context_parallel_ops(...))``).

``append_paged_kv_cache`` writes a token only on the rank that owns its page (logical page ``pos // page_size``
on rank ``(pos // page_size) % world``); on the other ranks the token goes to the scratch page (page 0, which
the engine reserves), so the write keeps a fixed shape, synchronizes nothing and can be captured in a CUDA graph.
It is plain torch indexing (no kernel), the same on a CPU and a GPU.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .. import reference
from .attention import ContextParallelDecode, ContextParallelPrefill
from .sharding import check_group, token_owner


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
                          positions: torch.Tensor, paged_kv_cache, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_last_page_len: torch.Tensor | None = None, kv_layout: str = "NHD", *, world: int,
                          rank: int, scratch_page: int = 0) -> None:
    """append_key/value: [nnz, H_kv, D]; batch_indices/positions: [nnz] int32 (each token's request and global KV
    position); kv_indices/kv_indptr: the global page table. In place: this rank's tokens go to their pages."""
    world, rank = check_group(world, rank)
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    ck, cv = reference.split_cache(paged_kv_cache)
    page_size = ck.shape[1] if kv_layout == "NHD" else ck.shape[2]
    for name, t in (("batch_indices", batch_indices), ("positions", positions), ("kv_indices", kv_indices),
                    ("kv_indptr", kv_indptr)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    pos = positions.long()
    logical = pos // page_size
    owned = token_owner(pos, page_size=page_size, world=world) == rank
    entry = kv_indptr[batch_indices.long()].long() + logical  # gathers: the page table itself is never copied
    page = torch.where(owned, kv_indices[entry].long(), torch.full_like(entry, scratch_page))
    reference.write_slots(paged_kv_cache, page, pos % page_size, append_key.to(ck.dtype), append_value.to(cv.dtype),
                          kv_layout)


def context_parallel_ops(local_backend: str = "attnjit", *, group: dist.ProcessGroup | None = None,
                         combine: str = "all_gather", scratch_page: int = 0) -> SimpleNamespace:
    """A namespace with BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper and
    append_paged_kv_cache for this rank of ``group`` (torch.distributed must be initialized)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    opts = dict(group=group, local_backend=local_backend, combine=combine, scratch_page=scratch_page)
    return SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=functools.partial(ContextParallelPrefill, **opts),
        BatchDecodeWithPagedKVCacheWrapper=functools.partial(ContextParallelDecode, **opts),
        append_paged_kv_cache=functools.partial(append_paged_kv_cache, world=world, rank=rank,
                                                scratch_page=scratch_page),
        world=world, rank=rank)
