"""Shared-prefix (cascade) attention: FlashInfer's ``MultiLevelCascadeAttentionWrapper``, over the paged prefill
wrapper and merge_state.

The KV of a batch is split into levels, each a paged page table over the same cache (FlashInfer's cascade layout):
level 0 typically holds one prefix shared by a group of requests, the last level each request's own suffix. A level
is an ordinary batch whose "requests" are groups of query rows: ``qo_indptr_arr[l]`` groups the rows of q (all
levels cover the same rows, ``qo_indptr_arr[l][-1]`` equal), ``paged_kv_*_arr[l]`` gives each group its pages. A
level runs as one paged prefill launch, so a prefix's pages are read once per group (once per KV head), not once per
request; the levels' states (o, lse) over disjoint key sets are then combined exactly:

    o = merge(state_last, state_0, ..., state_{L-2})     (the order of an exact merge does not matter)

The last level writes (out, lse). A prefix level's plan is a deferred-merge one (scheduler.defer_merges): its KV
chunks, cut without the in-kernel merge's limit on chunks, each write an fp32 partial state, and one merge_partials
launch over every (row, head) merges them all into (out, lse); a prefix's few query rows over a long history
otherwise leave that merge to one CTA per split group (run 62: 8 chunks the best trade there). Where the last level
is unsplit (short suffixes: it touches no workspace), level 0's plan splits to fill half the GPU, and under CUDA
graph capture level 0 runs beside the last level: level 0's kernel on the caller's stream, the last level's on a
side stream that forks from and joins it, then level 0's merge (eagerly the levels run one after the other: the
fork and join would cost the host more than they save). A level whose variant the partial merge cannot combine
(no softmax, an output transform) runs as an ordinary plan into a scratch state, merged by merge_state_in_place.

Causal masking applies to the last level only (the prefix levels lie wholly before every query, as in FlashInfer).
Position-dependent options (a sliding window, ALiBi, RoPE) would be computed against each level's own key
positions, which are not the request's, so with more than one level they are refused rather than made wrong.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from . import planner as P
from .attention import BatchPrefillWithPagedKVCacheWrapper
from ._grad import guard
from .compat import FlashInferAliases
from .merge import merge_state_in_place

_BUFFER_ARRAYS = ("qo_indptr_buf_arr", "paged_kv_indptr_buf_arr", "paged_kv_indices_buf_arr",
                  "paged_kv_last_page_len_buf_arr")


def _levels(name: str, value: Any, n: int) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {n} tensors (one per level), got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries; this wrapper has num_levels={n} (one per level)")
    return list(value)


class MultiLevelCascadeAttentionWrapper(FlashInferAliases):
    """Multi-level cascade attention over one paged KV cache (see the module docstring).

    ``__init__(num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf_arr=None,
    paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None, paged_kv_last_page_len_buf_arr=None)`` as in
    FlashInfer; ``backend`` (attnjit's) is passed to every level. The levels share the workspace: they run one
    after another on the stream.
    """

    def __init__(self, num_levels: int, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr: Sequence[torch.Tensor] | None = None,
                 paged_kv_indptr_buf_arr: Sequence[torch.Tensor] | None = None,
                 paged_kv_indices_buf_arr: Sequence[torch.Tensor] | None = None,
                 paged_kv_last_page_len_buf_arr: Sequence[torch.Tensor] | None = None, *, backend: str = "auto"):
        n = P.as_int("num_levels", num_levels)
        if not 1 <= n <= 16:
            raise ValueError(f"num_levels must be 1..16, got {n}")
        self._use_cuda_graph = P.as_flag("use_cuda_graph", use_cuda_graph)
        given = dict(zip(_BUFFER_ARRAYS, (qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr,
                                          paged_kv_last_page_len_buf_arr)))
        bufs = {k: (_levels(k, v, n) if v is not None else [None] * n) for k, v in given.items()}
        if not self._use_cuda_graph and any(v is not None for v in given.values()):
            raise ValueError(f"{', '.join(k for k, v in given.items() if v is not None)}: fixed buffers are for "
                             "use_cuda_graph=True")
        self._num_levels = n
        self._kv_layout = kv_layout
        self._batch_prefill_wrappers = [
            BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer, kv_layout, self._use_cuda_graph, qo_indptr_buf=bufs["qo_indptr_buf_arr"][i],
                paged_kv_indptr_buf=bufs["paged_kv_indptr_buf_arr"][i],
                paged_kv_indices_buf=bufs["paged_kv_indices_buf_arr"][i],
                paged_kv_last_page_len_buf=bufs["paged_kv_last_page_len_buf_arr"][i], backend=backend)
            for i in range(n)]
        for w in self._batch_prefill_wrappers[:-1]:  # a prefix level's chunks merge straight into the last level's
            w._defer_merge = True                     # (out, lse): one spread-out merge, no split-group merge
        self._scratch: list[tuple[torch.Tensor, torch.Tensor]] = []  # (o, lse) of levels 0..n-2, made by plan()
        self._plan = None  # the last level's plan once planned (what forward() checks)
        self._side: dict = {}   # device -> the side stream run() runs the last level on, beside level 0
        self._overlapped = False  # whether the last run() did (tests and benchmarks read it)
        # graph mode: level 0's _share_gpu as the first plan set it. A graph captured with level 0 beside the last
        # level replays the two side by side, so every later plan keeps the last level unsplit (it then writes no
        # workspace, where level 0's partial states lie)
        self._graph_share: bool | None = None

    def _can_overlap(self, q: torch.Tensor) -> bool:
        """Whether run() runs level 0 beside the last level: level 0's plan is deferred and planned to share the GPU
        (plan() sets that only where the last level is unsplit, so the two share no workspace), while a CUDA graph is
        being captured (not inside torch.compile). Eagerly it does not: the fork and join cost the host more (run 85:
        119 us a call against 61 on one stream) than the GPU time they save, and a batch small enough for level 0 to
        leave half the GPU idle is host-bound then."""
        w0 = self._batch_prefill_wrappers[0]
        return (self._num_levels > 1 and w0._share_gpu and w0._plan.merge_table is not None and q.device in self._side
                and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing())

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def num_levels(self) -> int:
        return self._num_levels

    @property
    def last_plan(self) -> list[dict] | None:
        """Each level's plan decisions (level 0 first)."""
        if self._plan is None:
            return None
        return [w.last_plan for w in self._batch_prefill_wrappers]

    def plan(self, qo_indptr_arr: Sequence[torch.Tensor], paged_kv_indptr_arr: Sequence[torch.Tensor],
             paged_kv_indices_arr: Sequence[torch.Tensor], paged_kv_last_page_len: Sequence[torch.Tensor],
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
             window_left: int = -1, logits_soft_cap: float | None = None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, **kwargs: Any) -> None:
        """Plan every level (FlashInfer's arguments; ``kwargs`` go to each level's plan, e.g. fixed_split_size).
        kv_data_type may be fp8 (e4m3 / e5m2): run()'s k_scale / v_scale then go to every level's run()."""
        n = self._num_levels
        arrays = [_levels(name, value, n) for name, value in (
            ("qo_indptr_arr", qo_indptr_arr), ("paged_kv_indptr_arr", paged_kv_indptr_arr),
            ("paged_kv_indices_arr", paged_kv_indices_arr), ("paged_kv_last_page_len", paged_kv_last_page_len))]
        if n > 1:
            if pos_encoding_mode != "NONE":
                raise NotImplementedError(
                    f"pos_encoding_mode={pos_encoding_mode!r} with {n} cascade levels: positions inside a level are "
                    "that level's, not the request's; apply RoPE/ALiBi to q and k before attention")
            if window_left is not None and P.as_int("window_left", window_left) != -1:
                raise NotImplementedError(
                    f"window_left={window_left} with {n} cascade levels: a window is measured against each level's "
                    "own keys, not the request's; use one level (the paged prefill wrapper) for windowed layers")
        for key in ("sinks", "custom_mask", "packed_custom_mask"):
            value = kwargs.get(key)   # "is": a tensor compared with == is elementwise
            if not (value is None or isinstance(value, (bool, np.bool_)) and not value):
                raise NotImplementedError(f"{key} is not supported by the cascade wrapper")
        # every level is checked and staged first (plan() of a level that holds its commit writes nothing), then
        # all are committed: a refused level leaves every level's plan, and a captured graph's buffers, as they were
        wrappers = self._batch_prefill_wrappers
        w0, share_before = wrappers[0], wrappers[0]._share_gpu
        try:
            staged = self._stage(arrays, share=self._graph_share, args=(num_qo_heads, num_kv_heads, head_dim,
                                 page_size), opts=dict(
                causal=causal, pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction,
                sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type, **kwargs))
        except BaseException:
            w0._share_gpu = share_before
            raise
        for w, st in zip(wrappers, staged):
            w._commit(*st)
        if self._use_cuda_graph and n > 1 and self._graph_share is None:
            self._graph_share = w0._share_gpu
        dev = w0._device
        if n > 1 and w0._share_gpu and dev.type == "cuda" and dev not in self._side:
            self._side[dev] = torch.cuda.Stream(dev)   # made here: run() may be under graph capture
        last_plan = wrappers[-1]._plan
        shape, dt = last_plan.q_shape, last_plan.o_dtype
        if len(self._scratch) != n - 1 or any(o.shape != shape or o.dtype != dt for o, _ in self._scratch):
            self._scratch = [(torch.empty(shape, dtype=dt, device=dev),
                              torch.empty(shape[:2], dtype=torch.float32, device=dev)) for _ in range(n - 1)]
        self._plan = last_plan

    def _stage(self, arrays: list, *, share: bool | None, args: tuple, opts: dict) -> list[tuple]:
        """Every level's plan checked and staged (its _commit arguments), the last level first: whether it splits
        decides whether level 0 runs beside it (then level 0 splits to half the GPU). Writes nothing."""
        n = self._num_levels
        wrappers = self._batch_prefill_wrappers
        levels = list(enumerate(zip(wrappers, *arrays)))
        staged: list = [None] * n
        rows = None
        for w in wrappers:
            w._hold_commit = True
        try:
            for i, (w, qo, kvp, idx, last) in levels[-1:] + levels[:-1]:
                if i == 0 and n > 1:
                    w._share_gpu = share if share is not None else staged[-1][0].work.chunk is None
                # graph mode, level 0 captured beside the last level: that level stays unsplit (it then writes no
                # workspace, where level 0's partial states lie); fixed_split_size, a speed setting, gives way
                keep_unsplit = {"disable_split_kv": True, "fixed_split_size": None} if i == n - 1 and share else {}
                try:
                    w.plan(qo, kvp, idx, last, *args, **{**opts, "causal": opts["causal"] if i == n - 1 else False,
                                                         **keep_unsplit})
                except NotImplementedError as exc:
                    raise NotImplementedError(f"cascade level {i}: {exc}") from None
                except TypeError as exc:
                    raise TypeError(f"cascade level {i}: {exc}") from None
                except ValueError as exc:
                    raise ValueError(f"cascade level {i}: {exc}") from None
                staged[i] = w._staged
                total_q = staged[i][0].total_q
                if rows is None:
                    rows = total_q
                elif total_q != rows:
                    raise ValueError(f"qo_indptr_arr[{i}][-1]={total_q} but qo_indptr_arr[{n - 1}][-1]={rows}: "
                                     "every level covers the same query rows")
        finally:
            for w in wrappers:
                w._hold_commit, w._staged = False, None
        last_plan = staged[-1][0]
        if self._use_cuda_graph and self._scratch and (self._scratch[0][0].shape != last_plan.q_shape
                                                       or self._scratch[0][0].dtype != last_plan.o_dtype):
            o = self._scratch[0][0]
            raise ValueError(f"use_cuda_graph: this plan has {last_plan.total_q} query rows ({last_plan.o_dtype}) "
                             f"but the graph was planned for {o.shape[0]} ({o.dtype})")
        return staged

    def run(self, q: torch.Tensor, paged_kv_cache, *args: Any, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False, **kwargs: Any):
        """q: [nnz_qo, H_q, D] -> out [nnz_qo, H_q, D] (and the merged lse [nnz_qo, H_q], base 2, with
        return_lse). The last level writes out/lse, each other level its scratch, merged in place. ``kwargs`` (e.g.
        k_scale, v_scale for an fp8 cache) go to every level's run()."""
        with torch.no_grad():   # the levels' outputs are merged in place; the result is guarded once
            result = self._run(q, paged_kv_cache, *args, out=out, lse=lse, return_lse=return_lse, **kwargs)
        return guard(type(self), result, q, paged_kv_cache, kwargs)

    def _run(self, q: torch.Tensor, paged_kv_cache, *args: Any, out: torch.Tensor | None = None,
             lse: torch.Tensor | None = None, return_lse: bool = False, **kwargs: Any):
        if self._plan is None:
            raise RuntimeError("MultiLevelCascadeAttentionWrapper.run() called before plan()")
        if args:
            raise TypeError(f"run() takes q and paged_kv_cache positionally; got {len(args)} more positional arguments")
        if type(return_lse) is not bool:
            raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
        last, prefix = self._batch_prefill_wrappers[-1], self._batch_prefill_wrappers[:-1]
        rest = list(zip(prefix, self._scratch))
        self._overlapped = self._can_overlap(q)
        if self._overlapped:
            # level 0 beside the last level: its kernel (partial states into the workspace, on half the GPU) on this
            # stream, the last level's (out and lse; it is unsplit, so it uses no workspace) on a side stream, then
            # level 0's merge into (out, lse) once both are done
            plan = self._plan
            if out is None:
                out = torch.empty(plan.q_shape, dtype=plan.o_dtype, device=q.device)
            if lse is None:
                lse = torch.empty(plan.q_shape[:2], dtype=torch.float32, device=q.device)
            cur = torch.cuda.current_stream(q.device)
            side = self._side[q.device]
            side.wait_stream(cur)
            merge0 = prefix[0]._run_partials(q, paged_kv_cache, out, lse, **kwargs)
            with torch.cuda.stream(side):
                last.run(q, paged_kv_cache, out=out, lse=lse, **kwargs)
            cur.wait_stream(side)
            merge0()
            rest = rest[1:]
        else:
            out, lse = last.run(q, paged_kv_cache, out=out, lse=lse, return_lse=True, **kwargs)
        for w, (o_i, lse_i) in rest:
            if w._plan.merge_table is not None:   # deferred (every plan on a GPU whose variant allows it): the
                w.run(q, paged_kv_cache, out=out, lse=lse, **kwargs)   # level's partials merge into (out, lse)
                continue
            w.run(q, paged_kv_cache, out=o_i, lse=lse_i, **kwargs)
            merge_state_in_place(out, lse, o_i, lse_i)
        return (out, lse) if return_lse else out
