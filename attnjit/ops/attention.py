"""FlashInfer-compatible attention wrappers: plan() on the host, run() on the GPU.

Every plan() validates every argument on the host before any device work (``planner``: a bad one is a ValueError
or TypeError naming it, the same on a machine with no GPU), picks the kernel family (``backend``; on sm_90a the sm90
family for wide batches, fa2 for decode-like ones), its tile and the split-KV schedule (``scheduler``), uploads the
work list (``_upload``) and loads the kernel module, compiling it on a cache miss unless ATTNJIT_JIT=0 (the common
tail lives in ``_wrapper``, which these wrappers inherit); ``_running`` holds the plan it leaves and run()'s checks
against it. q_data_type / o_data_type are fp16 or bf16; kv_data_type is q's type (the default) or fp8
(torch.float8_e4m3fn, torch.float8_e5m2, or "e4m3" / "e5m2"), dequantized in the kernel with run()'s k_scale /
v_scale. Metadata may be on the device or the host (host metadata spares a device-to-host copy). A plan belongs to
its batch: run() with other shapes is an error.

run() checks its tensors against the plan and launches; it compiles, loads, allocates (when given ``out``) and
synchronizes nothing, so it can be captured in a CUDA graph. With ``use_cuda_graph=True`` the wrapper keeps every
buffer a kernel reads at a fixed address: a captured run() replays correctly after a new plan() with other lengths
and page tables of the same batch size. plan() and fast_plan() themselves are refused (a RuntimeError naming them)
while the current stream captures a graph: plan before the capture, capture run().

Tensors a kernel reads or writes through a pointer are checked for what the kernels assume: q, out, k and v move
16 bytes at a time (16-byte aligned data pointers and strides), lse is dense, out's elements are distinct. Metadata
plan() reads on the host may be any view; page ids are made dense for the kernels.
"""
from __future__ import annotations

from typing import Any

import torch

from ..variants import Variant
from . import planner as P
from ._common import byte_span, check_tensor, check_vectors, unsupported
from ._grad import guard
from ._running import vector_ready
from ._variants import with_sinks
from ._paged import _PAGED_NAMES, _PagedMixin
from ._wrapper import _AttentionWrapper, _schedule


class BatchPrefillWithPagedKVCacheWrapper(_PagedMixin, _AttentionWrapper):
    """Batch prefill / append / mixed attention over a paged KV cache (query rows ragged by ``qo_indptr``)."""

    _op = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None, *, max_work_items: int | None = None,
                 variant: Variant | str | None = None, tile: str | None = None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, max_work_items=max_work_items,
                         variant=variant, backend=backend, tile=tile)
        # masks under graphs; FlashInfer's JIT variants (attnjit's are variant=): refused, never ignored
        unsupported(custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf, jit_args=jit_args,
                    jit_kwargs=jit_kwargs)
        self._graph_buffers(qo_indptr_buf=qo_indptr_buf, paged_kv_indptr_buf=paged_kv_indptr_buf,
                            paged_kv_last_page_len_buf=paged_kv_last_page_len_buf,
                            paged_kv_indices_buf=paged_kv_indices_buf)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             sinks: bool = False, **unused: Any) -> None:
        """Plan a batch of prefill/append/mixed requests over a paged KV cache.

        qo_indptr: [B+1] int32, request i's query rows are qo_indptr[i]:qo_indptr[i+1] of q. paged_kv_indptr: [B+1]
        int32 offsets into paged_kv_indices. paged_kv_indices: [*] int32 page ids in logical order.
        paged_kv_last_page_len: [B] int32 in 1..page_size (0 for a request with no pages). KV length of request
        i = page_size * (pages - 1) + last, including the new tokens. causal is bottom-right aligned (query row t of Q
        sees key j iff j <= K - Q + t).
        logits_soft_cap, window_left, pos_encoding_mode="ALIBI" or "ROPE_LLAMA" (rope_scale, rope_theta),
        custom_mask / packed_custom_mask are built-in variants (FlashInfer's semantics); sm_scale defaults to
        1/sqrt(head_dim). sinks=True adds an attention sink whose values run() takes (``sinks=``; ops/sinks.py).
        Every argument is checked before any device work (a bad one is a ValueError/TypeError naming it); the
        dtypes, the kernel family (``backend``) and tile, and use_cuda_graph=True's re-plans: as every plan()
        (this module's docstring).
        """
        unsupported(use_fp16_qk_reduction=use_fp16_qk_reduction, **unused)
        group, head_dim, page_size, dtypes, opts = self._checked(dict(
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=page_size, q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
            pos_encoding_mode=pos_encoding_mode, causal=causal, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv, non_blocking=non_blocking, rope_scale=rope_scale, rope_theta=rope_theta))
        batch = self._read_paged(_PAGED_NAMES, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                 page_size)
        self._plan_batch("prefill", batch, group=group, head_dim=head_dim, dtypes=dtypes, opts=opts,
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_ids=paged_kv_indices, sinks=sinks,
                         causal_names=("qo_indptr", "paged_kv_indptr/paged_kv_last_page_len"),
                         custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, page_size=page_size,
                         layout=self._kv_layout, kv="paged")


class BatchDecodeWithPagedKVCacheWrapper(_PagedMixin, _AttentionWrapper):
    """Batch decode (one query row per request) over a paged KV cache; the GQA group shares each KV page read."""

    _op = "decode"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto", jit_args=None,
                 *, max_work_items: int | None = None, variant: Variant | str | None = None,
                 tile: str | None = None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, max_work_items=max_work_items,
                         variant=variant, backend=backend, tile=tile)
        self._use_tensor_cores = P.as_flag("use_tensor_cores", use_tensor_cores)
        unsupported(jit_args=jit_args)   # FlashInfer's JIT variants (attnjit's are variant=): refused, never ignored
        self._graph_buffers(paged_kv_indptr_buffer=paged_kv_indptr_buffer,
                            paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer,
                            paged_kv_indices_buffer=paged_kv_indices_buffer)

    @property
    def use_tensor_cores(self) -> bool:
        """FlashInfer's flag (it picks a prefill kernel for decode). attnjit's decode kernels use the tensor cores
        (mma.sync) either way; the plan's decisions record both (``use_tensor_cores``, ``tensor_cores``)."""
        return self._use_tensor_cores

    def _decision_extra(self) -> dict:
        return {"use_tensor_cores": self._use_tensor_cores, "tensor_cores": True}

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type="float16", kv_data_type=None, data_type=None,
             sm_scale: float | None = None, rope_scale=None, rope_theta=None, non_blocking: bool = True,
             block_tables=None, seq_lens=None, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             o_data_type=None, sinks: bool = False, **unused: Any) -> None:
        """Plan a decode batch (one query row per request) over a paged KV cache.

        indptr: [B+1] int32 offsets into indices. indices: [*] int32 page ids in logical order. last_page_len: [B]
        int32 in 1..page_size (0 for a request with no pages: its rows are 0, lse -inf, as in FlashInfer). The
        GROUP = num_qo_heads / num_kv_heads query heads of a KV head share each page read; long histories are split
        across CTAs and merged in-kernel (fixed_split_size / disable_split_kv steer it).
        Every argument is checked before any device work (a bad one is a ValueError/TypeError naming it); the
        dtypes, the kernel family (``backend``) and tile, and use_cuda_graph=True's re-plans: as every plan()
        (this module's docstring).
        """
        unsupported(block_tables=block_tables, seq_lens=seq_lens, **unused)
        group, head_dim, page_size, dtypes, opts = self._checked(dict(
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, data_type=data_type,
            sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
            pos_encoding_mode=pos_encoding_mode, fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
            non_blocking=non_blocking, rope_scale=rope_scale, rope_theta=rope_theta))
        batch = self._read_decode(indptr, indices, last_page_len, page_size)
        self._plan_batch("decode", batch, group=group, head_dim=head_dim, dtypes=dtypes, opts=opts,
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_ids=indices, sinks=sinks,
                         page_size=page_size, layout=self._kv_layout)


    def _read_decode(self, indptr, indices, last_page_len, page_size: int) -> P.Batch:
        # a request with an empty KV history (no pages) is allowed, as in FlashInfer: its rows are 0, lse -inf
        return self._read_paged(_DECODE_NAMES, None, indptr, indices, last_page_len, page_size)

    def fast_plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor) -> None:
        """Graph mode: re-plan the last plan() for new lengths and page tables of the same batch size.

        Only what a decode step changes is read again: the page table is checked as plan() checks it (page ids
        against the cache the last run() read, since a replay does not pass through run()), the work list is
        rescheduled and it and the page ids are rewritten in the fixed buffers the captured graph reads. The heads,
        dtypes, options and kernel of the last plan() stay (call plan() to change those). With host metadata it
        neither allocates on the device nor synchronizes, and on a GPU it is one compiled call (read, check,
        schedule, stage: MetadataBuffers.fast_decode) and one copy, 12-29 us on the H200 host at batch 1-256
        (benchmarks/RESULTS.md, run 73); a table that breaks a rule is read again by plan()'s readers, which raise.
        """
        plan = self._plan
        if not self._use_cuda_graph:
            raise ValueError("fast_plan() rewrites the fixed buffers of a use_cuda_graph=True wrapper; this wrapper "
                             "has none: call plan()")
        if plan is None:
            raise RuntimeError("fast_plan() called before plan(): it keeps that plan's heads, dtypes and options")
        self._meta.refuse_capture("BatchDecodeWithPagedKVCacheWrapper.fast_plan()")
        if plan.on_gpu:  # host metadata, the common case: read, checked, scheduled and staged in one compiled call
            fast = self._meta.fast_decode(indptr, indices, last_page_len, page_size=plan.page_size, sched=plan.sched,
                                          num_pages=self._replay.num_pages)
            if fast is not None:
                plan.work, plan.max_page = fast
                return
        # the full path: device metadata, no compiled core, or a table the fast path refused (raised here)
        batch = self._read_decode(indptr, indices, last_page_len, plan.page_size)
        self._check_graph_plan(plan.spec, batch)
        work = _schedule(batch, plan.sched)
        if plan.on_gpu:
            self._meta.upload(work.records, num_groups=work.num_groups, num_kv_heads=plan.num_kv_heads,
                              page_ids=indices, used=batch.num_page_ids, keep=[])
        plan.work, plan.max_page = work, batch.max_page  # the Launch asks plan.decision() for its records


_DECODE_NAMES = ("indptr", "indices", "last_page_len")


class BatchPrefillWithRaggedKVCacheWrapper(_AttentionWrapper):
    """Batch prefill where each request's K/V are contiguous rows of ragged [nnz_kv, H_kv, D] tensors."""

    _op = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, kv_indptr_buf: torch.Tensor | None = None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto", jit_args=None, jit_kwargs=None,
                 *, max_work_items: int | None = None, variant: Variant | str | None = None,
                 tile: str | None = None):
        if kv_layout != "NHD":
            raise ValueError(f"kv_layout={kv_layout!r} is not supported for ragged KV: k and v are [nnz_kv, H_kv, D]")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, max_work_items=max_work_items,
                         variant=variant, backend=backend, tile=tile)
        # masks under graphs; FlashInfer's JIT variants (attnjit's are variant=): refused, never ignored
        unsupported(custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf, jit_args=jit_args,
                    jit_kwargs=jit_kwargs)
        self._graph_buffers(qo_indptr_buf=qo_indptr_buf, kv_indptr_buf=kv_indptr_buf)

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: float | None = None, sm_scale: float | None = None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             sinks: bool = False, **unused: Any) -> None:
        """Plan a batch of prefill requests whose K/V are contiguous rows of ragged [nnz_kv, H_kv, D] tensors.

        qo_indptr: [B+1] int32 (query rows per request), kv_indptr: [B+1] int32 (key rows per request, including
        the new tokens). causal, variants and sm_scale as for the paged prefill wrapper.
        Every argument is checked before any device work (a bad one is a ValueError/TypeError naming it); the
        dtypes, the kernel family (``backend``) and tile, and use_cuda_graph=True's re-plans: as every plan()
        (this module's docstring).
        """
        unsupported(use_fp16_qk_reduction=use_fp16_qk_reduction, **unused)
        group, head_dim, _, dtypes, opts = self._checked(dict(
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap, window_left=window_left, pos_encoding_mode=pos_encoding_mode,
            causal=causal, fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
            non_blocking=non_blocking, rope_scale=rope_scale, rope_theta=rope_theta))
        P.check_meta("qo_indptr", qo_indptr, self._device)
        P.check_meta("kv_indptr", kv_indptr, self._device)
        qo_h, kv_h = self._meta.to_host(qo_indptr, kv_indptr)
        qo = P.read_qo_indptr("qo_indptr", qo_h)
        P.check_meta("kv_indptr", kv_indptr, self._device, len(qo))
        batch = P.read_ragged("kv_indptr", qo, kv_h)
        self._plan_batch("prefill", batch, group=group, head_dim=head_dim, dtypes=dtypes, opts=opts,
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_ids=None, sinks=sinks,
                         causal_names=("qo_indptr", "kv_indptr"), custom_mask=custom_mask,
                         packed_custom_mask=packed_custom_mask, kv="ragged")

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, sinks=None, k_scale=None, v_scale=None,
            **variant_params: Any):
        """q: [nnz_qo, H_q, D], k/v: [nnz_kv, H_kv, D] of the plan's kv_data_type -> out [nnz_qo, H_q, D] (and lse
        with return_lse). The wrapper's variant takes its parameters here by name. k_scale / v_scale: the
        dequantization scales, as for the paged wrappers' run() (a float, or an fp8 plan's float32 [H_kv] tensor);
        enable_pdl as there (accepted, no effect)."""
        if args:
            raise TypeError(f"run() takes q, k and v positionally; got {len(args)} more positional arguments")
        if enable_pdl is not None:
            P.as_flag("enable_pdl", enable_pdl)
        variant_params = with_sinks(self._plan, variant_params, sinks)
        if torch.compiler.is_compiling():
            return self._run_compiled(q, k, v, out, lse, return_lse, variant_params, k_scale, v_scale)
        plan = self._current_plan(variant_params, return_lse, lse)
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, dtype=plan.kv_dtype, dim=3, device=self._device)
            if t.shape[0] < plan.total_kv or t.shape[1] != plan.num_kv_heads or t.shape[2] != plan.head_dim \
                    or t.stride(2) != 1:
                raise ValueError(f"run(): {name} must be [>= {plan.total_kv}, {plan.num_kv_heads}, {plan.head_dim}] "
                                 f"with a contiguous last dim, as planned; got {list(t.shape)} strides {t.stride()}")
            if not vector_ready(t):
                check_vectors(name, t, (0, 1))
        if k.stride() != v.stride():
            raise ValueError(f"run(): k and v must have the same strides; got {k.stride()} and {v.stride()}")
        spans = (("k", byte_span(k)), ("v", byte_span(v)))
        result = self._launch_run(plan, q, out, lse, return_lse, k_scale, v_scale, k.data_ptr(), v.data_ptr(),
                                  k.stride(0), k.stride(1), min(k.shape[0], v.shape[0]), kv_spans=spans,
                                  variant_params=variant_params)
        return guard(type(self), result, q, k, v, variant_params, k_scale, v_scale)

    _op_kind = "ragged"
