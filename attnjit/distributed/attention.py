"""Context-parallel decode and paged prefill: FlashInfer-shaped plan/run wrappers over a torch.distributed group.

Every rank calls plan() with the same global page table (the batch's ``paged_kv_*``, page ids naming pages in
their owner's cache) and run() with the same q and its own cache. plan() shards the table (sharding.py: logical
page p on rank p % world), run() computes the shard's (o, lse) with the local backend straight into the combiner's
send buffer, turns the rows of requests without a key on this rank into the empty state, and combines the ranks'
states with one collective (combine.py). Every rank returns the merged output of the whole history.

    cp = ContextParallelDecode(workspace, "NHD", group=None, local_backend="attnjit")
    cp.plan(kv_indptr, kv_indices, last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    out = cp.run(q, local_cache)            # [B, H_q, D], equal on every rank

With ``use_cuda_graph=True`` (decode) every buffer run() touches keeps its address across plans of one batch
size, and run() synchronizes nothing on the host, so ``local kernel -> collective -> merge`` can be captured in a
CUDA graph and replayed after a new plan(). The global table's indptr and last_page_len are read on the host
(pass host tensors to spare plan() a device-to-host copy); the page ids are gathered where they lie.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..ops._grad import guard
from .combine import StateCombiner
from .local import make_shard
from .sharding import ShardTable, shard_page_table


def _host(name: str, t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}; convert it with .to(torch.int32)")
        return t.cpu().numpy().astype(np.int64)
    return np.asarray(t, dtype=np.int64)


# the FlashInfer arguments whose default is neither None nor False; every other one defaults to None or False
_DEFAULTS = {"window_left": -1, "pos_encoding_mode": "NONE"}


def _at_default(name: str, value: Any) -> bool:
    if value is None or value is False:
        return True
    default = _DEFAULTS.get(name)
    return default is not None and type(value) is type(default) and value == default  # 0 is not False, 0.0 not None


def _reject(where: str, unused: dict) -> None:
    """FlashInfer arguments this wrapper does not implement must be at their defaults (never silently ignored)."""
    bad = {k: v for k, v in unused.items() if k != "non_blocking" and not _at_default(k, v)}
    if bad:
        name = sorted(bad)[0]
        shown = f"a {type(bad[name]).__name__}" if isinstance(bad[name], torch.Tensor) else repr(bad[name])
        raise NotImplementedError(f"{where}: {name}={shown} is not supported by the context-parallel wrappers "
                                  "(soft-cap, windows, ALiBi, custom masks and variants are single-GPU features here)")


def _capacities(use_cuda_graph: bool, indptr_buf, indices_buf, kwargs: dict) -> None:
    """Graph mode: the fixed buffers FlashInfer's constructor takes give the shard's batch and page capacities."""
    if use_cuda_graph and indptr_buf is not None and indices_buf is not None:
        kwargs.setdefault("batch_capacity", indptr_buf.numel() - 1)
        kwargs.setdefault("page_capacity", indices_buf.numel())


class _ContextParallelWrapper:
    _op = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 *, group: dist.ProcessGroup | None = None, local_backend: str = "attnjit",
                 combine: str = "all_gather", scratch_page: int = 0, batch_capacity: int | None = None,
                 page_capacity: int | None = None, **wrapper_kwargs: Any):
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError(f"float_workspace_buffer must be a torch.Tensor, got {type(float_workspace_buffer).__name__}")
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        if isinstance(scratch_page, bool) or not isinstance(scratch_page, int) or scratch_page < 0:
            raise ValueError(f"scratch_page must be a page id >= 0 (a page every rank's cache has), got {scratch_page!r}")
        self._combiner = StateCombiner(group, combine)
        self.world, self.rank = self._combiner.world, self._combiner.rank
        self.device = float_workspace_buffer.device
        self._graph = bool(use_cuda_graph)
        self._scratch = scratch_page
        self._local = make_shard(local_backend, op=self._op, workspace=float_workspace_buffer, kv_layout=kv_layout,
                                 use_cuda_graph=self._graph, batch_capacity=batch_capacity,
                                 page_capacity=page_capacity, **wrapper_kwargs)
        self._empty: torch.Tensor | None = None    # [rows] bool: the row's request has no key on this rank
        self._shape: tuple | None = None           # (rows, H_q, D) of the plan

    @property
    def combiner(self) -> StateCombiner:
        return self._combiner

    def _page_ids(self, table: ShardTable, indices: torch.Tensor) -> torch.Tensor:
        """This rank's page ids (int32, where ``indices`` lies); dummy entries read the scratch page."""
        if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 1:
            raise TypeError(f"paged_kv_indices must be a 1-D int32 tensor, got "
                            f"{getattr(indices, 'dtype', type(indices).__name__)}")
        used = int(table.select.max(initial=-1)) + 1
        if used > indices.numel():
            raise ValueError(f"paged_kv_indices has {indices.numel()} entries but the page table needs {used}")
        sel = torch.as_tensor(table.select)
        if indices.device.type == "cpu":
            src = indices.to(torch.int64)
            ids = torch.where(sel >= 0, src[sel.clamp_min(0)] if src.numel() else torch.zeros_like(sel),
                              torch.full_like(sel, self._scratch))
            return ids.to(torch.int32).to(self.device)
        sel = sel.to(indices.device, non_blocking=True)
        picked = indices.index_select(0, sel.clamp_min(0)) if indices.numel() else torch.zeros_like(sel,
                                                                                                    dtype=torch.int32)
        return torch.where(sel >= 0, picked, torch.full_like(picked, self._scratch))

    def _plan(self, *, qo: np.ndarray, kv_indptr, kv_indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
              head_dim: int, page_size: int, causal: bool, sm_scale, q_data_type, kv_data_type, o_data_type) -> None:
        table = shard_page_table(_host("paged_kv_indptr", kv_indptr), _host("paged_kv_last_page_len", last_page_len),
                                 page_size=page_size, world=self.world, rank=self.rank, pad_empty=True)
        if len(qo) != table.batch_size + 1:
            raise ValueError(f"qo_indptr has {len(qo)} entries; the page table has {table.batch_size} requests")
        qo_lens = np.diff(qo)
        if causal:
            bad = np.flatnonzero(qo_lens > table.global_kv_lens)
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"qo_indptr: request {i} has {int(qo_lens[i])} query rows but a KV length of "
                                 f"{int(table.global_kv_lens[i])}; with causal=True the KV length must include the "
                                 "query tokens (qo_len <= kv_len)")
        page_ids = self._page_ids(table, kv_indices)
        self._local.plan(qo_indptr=qo, table=table, page_ids=page_ids, causal=causal, sm_scale=sm_scale,
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type)
        empty = torch.as_tensor(~np.repeat(table.has_keys, qo_lens))
        if self._graph and self._empty is not None:
            if self._empty.numel() != empty.numel():
                raise ValueError(f"use_cuda_graph: this wrapper was planned for {self._empty.numel()} query rows; "
                                 f"plan() got {empty.numel()}. Use one wrapper per batch size.")
            self._empty.copy_(empty, non_blocking=True)
        else:
            self._empty = empty.to(self.device, non_blocking=True)
        self._shape = (int(qo[-1]), num_qo_heads, head_dim)

    def run(self, q: torch.Tensor, paged_kv_cache, *, out: torch.Tensor | None = None,
            return_lse: bool = False, **unused: Any):
        """q: [rows, H_q, D] (the same on every rank), paged_kv_cache: this rank's cache -> out [rows, H_q, D] (q's
        dtype), and lse [rows, H_q] (base 2) with return_lse: the state of the whole history, on every rank.
        A collective: every rank of the group must call it."""
        _reject("run()", unused)
        if self._shape is None:
            raise RuntimeError(f"{type(self).__name__}.run() called before plan()")
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != self._shape:
            raise ValueError(f"run(): q must be [rows, H_q, D] = {list(self._shape)} as planned, got "
                             f"{list(getattr(q, 'shape', [])) or type(q).__name__}")
        rows, heads, dim = self._shape
        o_loc, lse_loc = self._combiner.local_state(rows, heads, dim, self._local.o_dtype, self._local.lse_dtype,
                                                    q.device)
        self._local.run(q, paged_kv_cache, o_loc, lse_loc)
        o_loc.masked_fill_(self._empty[:, None, None], 0.0)     # rows with no key here: the empty state
        lse_loc.masked_fill_(self._empty[:, None], -math.inf)
        o, lse = self._combiner.combine()
        if out is not None:  # copy_ rounds to out's type once (q's type, as o.to(q.dtype) would)
            o = out.copy_(o if out.dtype == q.dtype else o.to(q.dtype))
        else:
            o = o.to(q.dtype)
        return guard(type(self), (o, lse) if return_lse else o, q, paged_kv_cache)

    forward = run


class ContextParallelPrefill(_ContextParallelWrapper):
    """Paged prefill (ragged query rows by ``qo_indptr``; causal bottom-right aligned on the global history)."""

    _op = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf=None, **kwargs: Any):
        _capacities(use_cuda_graph, paged_kv_indptr_buf, paged_kv_indices_buf, kwargs)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, **kwargs)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, page_size: int, causal: bool = False, sm_scale: float | None = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, **unused: Any) -> None:
        _reject("plan()", unused)
        self._plan(qo=_host("qo_indptr", qo_indptr), kv_indptr=paged_kv_indptr, kv_indices=paged_kv_indices,
                   last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim_qk, page_size=page_size, causal=bool(causal), sm_scale=sm_scale,
                   q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type)


class ContextParallelDecode(_ContextParallelWrapper):
    """Batch decode (one query row per request, which sees the request's every key: no mask)."""

    _op = "decode"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None, paged_kv_last_page_len_buffer=None,
                 **kwargs: Any):
        _capacities(use_cuda_graph, paged_kv_indptr_buffer, paged_kv_indices_buffer, kwargs)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, use_tensor_cores=use_tensor_cores,
                         **kwargs)

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, sm_scale: float | None = None, q_data_type="float16", kv_data_type=None,
             data_type=None, o_data_type=None, **unused: Any) -> None:
        _reject("plan()", unused)
        kvp = _host("indptr", indptr)
        pages = np.diff(kvp)
        if (pages <= 0).any():
            i = int(np.flatnonzero(pages <= 0)[0])
            raise ValueError(f"indptr: request {i} has an empty KV history; decode needs at least the current "
                             "token's key (append it before planning)")
        self._plan(qo=np.arange(len(kvp), dtype=np.int64), kv_indptr=kvp, kv_indices=indices,
                   last_page_len=last_page_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, page_size=page_size, causal=False, sm_scale=sm_scale,
                   q_data_type=q_data_type, kv_data_type=kv_data_type if kv_data_type is not None else data_type,
                   o_data_type=o_data_type)
