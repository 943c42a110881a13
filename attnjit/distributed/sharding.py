"""Round-robin page sharding: logical page p of every request lives on rank ``p % world`` (a pure function).

``shard_page_table`` turns a batch's global page table (FlashInfer's ``paged_kv_indptr`` / ``paged_kv_last_page_len``,
host values) into one rank's table. It never reads page ids: it returns ``select``, the positions of the rank's
pages in the global ``paged_kv_indices``, so the caller gathers the ids where they lie (host or device) and the
function stays pure, cheap (vectorized numpy) and testable without tensors.

A rank's pages of a request, in logical order, hold the request's keys at the global positions

    g(j) = ((j // page_size) * world + rank) * page_size + j % page_size      (local key j)

which increase with j, so a local kernel sees its keys in global order; ``global_key_positions`` is that map.
Every local page is full except the request's global last page (on rank ``(num_pages - 1) % world``), so the
local KV length is ``page_size * (local_pages - 1) + local_last_page_len`` as the seed's contract wants.

``pad_empty=True`` gives a request with no page on this rank one dummy entry (``select`` = -1, to be replaced by a
scratch page id; last_page_len 1) so kernels that refuse an empty history (decode) run at a fixed batch shape;
``has_keys`` says which requests really have keys, and the caller turns the others into the empty state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, kw_only=True)
class ShardTable:
    """One rank's share of a batch's page table. Arrays are int64 numpy on the host."""

    world: int
    rank: int
    page_size: int
    select: np.ndarray          # [n] positions of this rank's page ids in the global paged_kv_indices; -1: dummy
    kv_indptr: np.ndarray       # [B + 1] over select
    last_page_len: np.ndarray   # [B] in 1..page_size where the request has an entry here, else 0
    kv_lens: np.ndarray         # [B] the local kernel's KV length L_b (1 for a dummy entry)
    has_keys: np.ndarray        # [B] bool: the request has at least one real key on this rank
    global_kv_lens: np.ndarray  # [B] K_b

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    @property
    def q_shift(self) -> np.ndarray:
        """[B] K_b - L_b: a query's global position minus its local one (local q_pos = L - Q + i)."""
        return self.global_kv_lens - self.kv_lens

    def page_ids(self, global_indices: list[int], scratch_page: int = 0) -> list[int]:
        """This rank's page ids from the global ``paged_kv_indices`` (host list); dummies become ``scratch_page``."""
        return [global_indices[s] if s >= 0 else scratch_page for s in self.select.tolist()]


def _int_array(name: str, values: Any, length: int | None = None) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor (host); metadata is never read from a device here
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be on the host to be sharded, got a tensor on {values.device}")
        values = values.detach().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {arr.dtype} of shape {arr.shape}")
    if length is not None and arr.size != length:
        raise ValueError(f"{name} must have {length} elements, got {arr.size}")
    return arr.astype(np.int64)


def check_group(world: Any, rank: Any) -> tuple[int, int]:
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in 0..world-1 = 0..{world - 1}, got {rank!r}")
    return int(world), int(rank)


def shard_page_table(kv_indptr: Any, last_page_len: Any, *, page_size: int, world: int, rank: int,
                     pad_empty: bool = False) -> ShardTable:
    """kv_indptr [B+1], last_page_len [B] (the global table, host ints) -> this rank's ShardTable."""
    world, rank = check_group(world, rank)
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    kvp = _int_array("kv_indptr", kv_indptr)
    if kvp.size < 1 or kvp[0] != 0:
        raise ValueError(f"kv_indptr must start with 0 and have batch_size + 1 elements, got {kvp[:4].tolist()}")
    pages = np.diff(kvp)
    if (pages < 0).any():
        i = int(np.flatnonzero(pages < 0)[0])
        raise ValueError(f"kv_indptr must be non-decreasing: kv_indptr[{i + 1}]={int(kvp[i + 1])} < "
                         f"kv_indptr[{i}]={int(kvp[i])}")
    last = _int_array("last_page_len", last_page_len, len(pages))
    bad = np.flatnonzero(np.where(pages > 0, (last < 1) | (last > page_size), last != 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"last_page_len[{i}]={int(last[i])} must be in 1..page_size={page_size} for a request with "
                         f"pages (0 for one without); request {i} has {int(pages[i])} pages")
    global_lens = np.where(pages > 0, page_size * (pages - 1) + last, 0)
    # pages p in [0, n) with p % world == rank: p = rank + world * m for m < ceil((n - rank) / world)
    n_local = np.maximum(0, (pages - rank + world - 1) // world)
    owns_last = (pages > 0) & ((pages - 1) % world == rank)
    local_last = np.where(n_local == 0, 0, np.where(owns_last, last, page_size))
    has_keys = n_local > 0
    dummy = pad_empty & ~has_keys
    n_entries = np.where(dummy, 1, n_local)
    local_kvp = np.concatenate([[0], np.cumsum(n_entries)]).astype(np.int64)
    req = np.repeat(np.arange(len(pages)), n_entries)
    m = np.arange(int(local_kvp[-1])) - local_kvp[:-1][req]
    select = np.where(dummy[req], -1, kvp[:-1][req] + rank + world * m)
    local_last = np.where(dummy, 1, local_last)
    local_lens = np.where(n_entries > 0, page_size * (n_entries - 1) + local_last, 0)
    return ShardTable(world=world, rank=rank, page_size=int(page_size), select=select.astype(np.int64),
                      kv_indptr=local_kvp, last_page_len=local_last.astype(np.int64),
                      kv_lens=local_lens.astype(np.int64), has_keys=has_keys, global_kv_lens=global_lens)


def global_key_positions(local_positions, *, page_size: int, world: int, rank: int):
    """Local key index j (int, numpy or torch) -> its global position in the request (see the module docstring)."""
    return ((local_positions // page_size) * world + rank) * page_size + local_positions % page_size


def token_owner(positions, *, page_size: int, world: int):
    """Global KV position (int, numpy or torch) -> the rank that stores that token."""
    return (positions // page_size) % world
