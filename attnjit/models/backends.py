"""The attention backends a model can call: the same three names at the same call sites.

``load_ops(name)`` returns a namespace with ``BatchPrefillWithPagedKVCacheWrapper``,
``BatchDecodeWithPagedKVCacheWrapper`` and ``append_paged_kv_cache``, taking FlashInfer's arguments:

- ``"attnjit"``: this package's kernels.
- ``"flashinfer"``: FlashInfer itself (installed separately), for side-by-side runs.
- ``"reference"``: attnjit.reference in float64, on any device (CPU included): slow, for tests of a model's
  plumbing where there is no GPU.
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import torch

from .. import reference

BACKENDS = ("attnjit", "flashinfer", "reference")
# backends whose plan() takes page ids from the host without a device synchronization (attnjit checks page ids on
# the host; with device page ids it must read their range back first). FlashInfer's plan() uses the page-id tensor
# on the device as it is, so it gets the device copy.
HOST_PAGE_IDS = frozenset({"attnjit", "reference"})
# backends whose graph-mode decode wrapper re-plans a batch of the bucket's size with a public
# fast_plan(indptr, indices, last_page_len) (it keeps the first plan()'s heads, dtypes and kernel and only rewrites
# lengths and page tables). FlashInfer's equivalent is private (vLLM's fast_plan_decode), so it gets plan().
FAST_REPLAN = frozenset({"attnjit"})


def load_ops(name: str):
    if name == "attnjit":
        import attnjit
        return attnjit
    if name == "flashinfer":
        try:
            return importlib.import_module("flashinfer")
        except ImportError as exc:
            raise ImportError("backend 'flashinfer' needs FlashInfer installed (see ../shared/tools/"
                              f"flashinfer-bundle.sh); import failed: {exc}") from exc
    if name == "reference":
        return SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_RefPrefill,
                               BatchDecodeWithPagedKVCacheWrapper=_RefDecode,
                               append_paged_kv_cache=_ref_append)
    raise ValueError(f"unknown attention backend {name!r}: expected one of {', '.join(BACKENDS)}")


class _RefWrapper:
    """FlashInfer-shaped wrapper over the float64 reference. Graph buffers are accepted and ignored (run() is
    host code, nothing to capture)."""

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False, **kwargs):
        self._layout = kv_layout
        self._plan = None

    def _set(self, qo, indptr, indices, last, page_size, causal, sm_scale, head_dim):
        self._plan = {"qo": qo.tolist(), "indptr": indptr.tolist(), "indices": indices.tolist(), "last": last.tolist(),
                          "page_size": page_size, "causal": causal,
                          "sm_scale": sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)}

    def run(self, q: torch.Tensor, paged_kv_cache, out=None, **kwargs):
        p = self._plan
        if p is None:
            raise RuntimeError("run() called before plan()")
        o, _ = reference.batch_paged(q, paged_kv_cache, p["qo"], p["indptr"], p["indices"], p["last"],
                                     page_size=p["page_size"], causal=p["causal"], layout=self._layout,
                                     sm_scale=p["sm_scale"])
        o = o.to(q.dtype)
        if out is not None:
            out.copy_(o)
            return out
        return o


class _RefPrefill(_RefWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, causal=False, sm_scale=None, **kwargs):
        self._set(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, causal, sm_scale,
                  head_dim_qk)


class _RefDecode(_RefWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale=None,
             **kwargs):
        qo = torch.arange(indptr.numel(), dtype=torch.int32)
        self._set(qo, indptr, indices, last_page_len, page_size, False, sm_scale, head_dim)


def _ref_append(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                kv_last_page_len, kv_layout: str = "NHD") -> None:
    """In place: token i goes to page kv_indices[kv_indptr[b] + pos // page_size], slot pos % page_size."""
    ck, cv = reference.split_cache(paged_kv_cache)
    page_size = ck.shape[1] if kv_layout == "NHD" else ck.shape[2]
    b = batch_indices.long()
    pos = positions.long()
    page = kv_indices.long()[kv_indptr.long()[b] + pos // page_size]
    reference.write_slots(paged_kv_cache, page, pos % page_size, append_key, append_value, kv_layout)
