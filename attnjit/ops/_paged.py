"""The paged wrappers' run() (the cache checked against the plan) and their page-table reader."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import planner as P
from ._common import PagedCache, unpack_paged_cache, unsupported
from ._grad import guard
from ._running import Plan
from ._variants import with_sinks

_PAGED_NAMES = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")


class _PagedMixin:
    def run(self, q: torch.Tensor, paged_kv_cache, *args: Any, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, **variant_params: Any):
        """q: [nnz_qo, H_q, D] (decode: [batch, H_q, D]) -> out of that shape, and lse [nnz_qo, H_q] (base 2) with
        return_lse. paged_kv_cache: one [P, 2, ...] tensor or a (k, v) tuple in the wrapper's layout, of the plan's
        kv_data_type. The wrapper's variant takes its parameters here by name (``run(q, kv, cap=30.0)``). A caller's
        out and lse may not share memory with the cache or with each other (a ValueError).

        k_scale / v_scale: the cache's dequantization scales (keys are k_scale * k, values v_scale * v), each a
        positive float (graph friendly: no device read) or, for an fp8 plan, a float32 [H_kv] tensor of per-KV-head
        scales on the device. As in FlashInfer they apply to any plan: k_scale multiplies the logits (lse included),
        v_scale the output (not lse); on a 16-bit plan a float v_scale is an in-place multiply of the output after
        the kernel, as FlashInfer does it. enable_pdl (FlashInfer's) is accepted and changes nothing: attnjit's
        kernels launch without programmatic dependent launch (benchmarks/RESULTS.md, eighteenth session)."""
        if args:
            raise TypeError(f"run() takes q and paged_kv_cache positionally; got {len(args)} more positional arguments")
        if enable_pdl is not None:
            P.as_flag("enable_pdl", enable_pdl)
        if q_scale is not None:
            unsupported(q_scale=q_scale)
        variant_params = with_sinks(self._plan, variant_params, sinks)
        if torch.compiler.is_compiling():
            if window_left is not None:
                raise NotImplementedError("run(window_left=...) inside torch.compile: pass window_left to plan()")
            k, v = (paged_kv_cache, None) if isinstance(paged_kv_cache, torch.Tensor) else paged_kv_cache
            return self._run_compiled(q, k, v, out, lse, return_lse, variant_params, k_scale, v_scale)
        plan = self._current_plan(variant_params, return_lse, lse)
        planned = plan.binding.bound.get("window_left", -1)
        if window_left is not None and P.as_int("window_left", window_left) != planned:
            raise ValueError(f"run(window_left={window_left}) differs from the plan's window "
                             f"({planned}); pass window_left to plan()")
        cache = self._check_cache(plan, paged_kv_cache)
        result = self._launch_run(plan, q, out, lse, return_lse, k_scale, v_scale, cache.k_ptr, cache.v_ptr,
                                  cache.stride_page, cache.stride_inner, cache.num_pages, paged=True,
                                  kv_spans=cache.spans, variant_params=variant_params)
        return guard(type(self), result, q, paged_kv_cache, variant_params, k_scale, v_scale)

    _op_kind = "paged"

    def _check_cache(self, plan: Plan, paged_kv_cache) -> PagedCache:
        memo = self._cache_memo  # the same cache object as last run(): skip re-deriving its views, unless its
        # memory moved under it (``cache.data = ...``, ``set_``, ``resize_`` keep the object): then the old pointers
        # would read freed memory
        tensor = isinstance(paged_kv_cache, torch.Tensor)  # a tuple is rebuilt by the caller each time: not memoized
        memory = (paged_kv_cache.data_ptr(), paged_kv_cache.shape, paged_kv_cache.stride(),
                  paged_kv_cache.dtype) if tensor else None
        if memo is not None and memo[0] is paged_kv_cache and memo[1] is plan and memo[3] == memory:
            return memo[2]
        cache = unpack_paged_cache("paged_kv_cache", paged_kv_cache, self._kv_layout)
        if cache.k.dtype != plan.kv_dtype or cache.k.device != self._device or cache.page_size != plan.page_size \
                or cache.num_kv_heads != plan.num_kv_heads or cache.head_dim != plan.head_dim:
            raise ValueError(
                f"run(): paged_kv_cache must be {plan.kv_dtype} on {self._device} with page_size={plan.page_size}, "
                f"H_kv={plan.num_kv_heads}, D={plan.head_dim} ({self._kv_layout}), as planned; got {cache.k.dtype} on "
                f"{cache.k.device} with page_size={cache.page_size}, H_kv={cache.num_kv_heads}, D={cache.head_dim}")
        if plan.max_page >= cache.num_pages:
            raise ValueError(f"run(): the plan's page table uses page id {plan.max_page} but paged_kv_cache has "
                             f"{cache.num_pages} pages")
        if tensor:
            self._cache_memo = (paged_kv_cache, plan, cache, memory)
        return cache

    def _read_paged(self, names: tuple[str, str, str], qo_indptr, indptr, indices, last_page_len,
                    page_size: int) -> P.Batch:
        """Check and read a page table (qo_indptr None: decode, one query row per request)."""
        dev = self._device
        n_indptr, n_indices, n_last = names
        if qo_indptr is None:  # decode: the batch size is the page table's
            P.check_meta(n_indptr, indptr, dev)
            if indptr.numel() < 1:
                raise ValueError(f"{n_indptr} must have batch_size + 1 >= 1 elements, got an empty tensor")
            if indptr.numel() - 1 > P.MAX_QO_ROWS:   # one query row a request
                raise ValueError(f"{n_indptr} gives a batch of {indptr.numel() - 1} requests, one query row each: more "
                                 f"than one plan takes ({P.MAX_QO_ROWS} rows); plan fewer requests")
            P.check_meta(n_last, last_page_len, dev, indptr.numel() - 1)
            P.check_meta(n_indices, indices, dev)
            rng = P.device_page_range(indices, indptr) if indices.device.type != "cpu" else None
            kvp, last, *rng = self._meta.to_host(indptr, last_page_len, *(rng or ()))  # one copy of all device metadata
            qo = np.arange(indptr.numel(), dtype=np.int64)
        else:  # qo_indptr is read (and checked) first: it says how long the others must be
            for name, t in (("qo_indptr", qo_indptr), (n_indptr, indptr), (n_indices, indices),
                            (n_last, last_page_len)):
                P.check_meta(name, t, dev)
            rng = P.device_page_range(indices, indptr) if indices.device.type != "cpu" else None
            qo_h, kvp, last, *rng = self._meta.to_host(qo_indptr, indptr, last_page_len, *(rng or ()))
            batch = P.read_prefill(qo_h, kvp, indices, last, page_size=page_size, page_range=rng or None)
            if batch is not None:   # the compiled reader: every rule holds
                return batch
            qo = P.read_qo_indptr("qo_indptr", qo_h)
            P.check_meta(n_indptr, indptr, dev, len(qo))
            P.check_meta(n_last, last_page_len, dev, len(qo) - 1)
        return P.read_paged(names, qo, kvp, indices, last, page_size=page_size, page_range=rng or None)
