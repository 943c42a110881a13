"""One rank's attention call on its shard, with return_lse: attnjit's kernels, or the float64 reference on a CPU.

Both take the rank's ShardTable (sharding.py) and write the shard's state (o, lse) into buffers they are given
(the combiner's send buffer, so nothing is copied before the collective):

- ``AttnjitShard``: attnjit's decode or paged-prefill wrapper on the local table. A causal prefill plans the local
  call non-causal with the ``cp_causal`` variant (causal.py) and its per-request shift; decode is plain decode.
  With ``use_cuda_graph`` every buffer a kernel reads (page ids, work list, the shift) keeps its address.
- ``ReferenceShard``: attnjit.reference.batch_paged on the same local table, the same rule as a torch mask.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import reference
from ..ops.planner import plan_dtypes
from .causal import CP_CAUSAL, reference_hooks, variant_params
from .sharding import ShardTable

LOCAL_BACKENDS = ("attnjit", "reference")


def _i32(values, device=None) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int32), device=device)


class ReferenceShard:
    """The float64 reference on a shard: o and lse come out in float64."""

    o_dtype = torch.float64
    lse_dtype = torch.float64

    def __init__(self, *, kv_layout: str, **unused):
        self.layout = kv_layout
        self._plan: dict | None = None

    def plan(self, *, qo_indptr: np.ndarray, table: ShardTable, page_ids: torch.Tensor, causal: bool,
             sm_scale: float | None, head_dim: int, **unused) -> None:
        self._plan = {"qo": qo_indptr.tolist(), "table": table, "ids": page_ids.cpu().tolist(), "causal": causal,
                      "sm_scale": sm_scale if sm_scale is not None else head_dim ** -0.5}

    def run(self, q: torch.Tensor, paged_kv_cache, out: torch.Tensor, lse: torch.Tensor) -> None:
        p = self._plan
        t = p["table"]
        o, s = reference.batch_paged(q, paged_kv_cache, p["qo"], t.kv_indptr.tolist(), p["ids"],
                                     t.last_page_len.tolist(), page_size=t.page_size, causal=False, layout=self.layout,
                                     sm_scale=p["sm_scale"], hooks=reference_hooks(t) if p["causal"] else None)
        out.copy_(o)
        lse.copy_(s)


class AttnjitShard:
    """attnjit's wrapper on a shard (o in the plan's output dtype, lse float32)."""

    lse_dtype = torch.float32

    def __init__(self, *, op: str, workspace: torch.Tensor, kv_layout: str, use_cuda_graph: bool,
                 batch_capacity: int | None, page_capacity: int | None, **wrapper_kwargs):
        import attnjit

        self.op, self.graph = op, use_cuda_graph
        self.device = workspace.device
        self.o_dtype: torch.dtype | None = None
        self._kwargs = wrapper_kwargs
        self._workspace, self._layout = workspace, kv_layout
        self._wrappers: dict[bool, object] = {}
        self._shift: torch.Tensor | None = None
        self._page_buf = None
        if use_cuda_graph:
            if batch_capacity is None or page_capacity is None:
                raise ValueError("use_cuda_graph=True needs the fixed metadata buffers (paged_kv_indptr_buffer and "
                                 "paged_kv_indices_buffer) to size the shard's own")
            self._page_buf = torch.zeros(page_capacity + batch_capacity, dtype=torch.int32, device=self.device)
            self._shift = torch.zeros(batch_capacity, dtype=torch.int32, device=self.device)
        self._attnjit = attnjit
        self._run_args: dict = {}

    def _wrapper(self, masked: bool):
        w = self._wrappers.get(masked)
        if w is not None:
            return w
        a = self._attnjit
        if self.op == "decode":
            w = a.BatchDecodeWithPagedKVCacheWrapper(self._workspace, self._layout, use_cuda_graph=self.graph,
                                                     paged_kv_indices_buffer=self._page_buf, **self._kwargs)
        else:
            w = a.BatchPrefillWithPagedKVCacheWrapper(self._workspace, self._layout, use_cuda_graph=self.graph,
                                                      paged_kv_indices_buf=self._page_buf,
                                                      variant=CP_CAUSAL if masked else None, **self._kwargs)
        self._wrappers[masked] = w
        return w

    def plan(self, *, qo_indptr: np.ndarray, table: ShardTable, page_ids: torch.Tensor, causal: bool,
             sm_scale: float | None, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             q_data_type, kv_data_type, o_data_type=None) -> None:
        masked = self.op == "prefill" and causal
        w = self._wrapper(masked)
        indptr, last = _i32(table.kv_indptr), _i32(table.last_page_len)
        common = dict(q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, sm_scale=sm_scale)
        if self.op == "decode":
            w.plan(indptr, page_ids, last, num_qo_heads, num_kv_heads, head_dim, table.page_size, **common)
        else:
            w.plan(_i32(qo_indptr), indptr, page_ids, last, num_qo_heads, num_kv_heads, head_dim, table.page_size,
                   causal=False, **common)
        self._run_args = {}
        if masked:
            shift = _i32(table.q_shift)
            if self._shift is not None:
                self._shift[:len(shift)].copy_(shift, non_blocking=True)
                dev_shift = self._shift[:len(shift)]
            else:
                dev_shift = shift.to(self.device, non_blocking=True)
            self._run_args = variant_params(table, dev_shift)
        self._current = w
        self.o_dtype = plan_dtypes(q_data_type, kv_data_type, o_data_type)[2]

    def run(self, q: torch.Tensor, paged_kv_cache, out: torch.Tensor, lse: torch.Tensor) -> None:
        self._current.run(q, paged_kv_cache, out=out, lse=lse, return_lse=True, **self._run_args)


def make_shard(local_backend: str, **kwargs):
    if local_backend == "attnjit":
        return AttnjitShard(**kwargs)
    if local_backend == "reference":
        return ReferenceShard(**kwargs)
    raise ValueError(f"local_backend must be one of {', '.join(LOCAL_BACKENDS)}, got {local_backend!r}")
