"""Attention sinks (gpt-oss): FlashInfer's ``BatchAttentionWithAttentionSinkWrapper``, and the rule for ``sinks=``.

A sink is one logit per query head, ``sinks[h]`` (float32 [H_q], on the scale of sm_scale * q.k), that joins every
row's softmax denominator and nothing else: it is a key whose value vector is zero. So

    o_i = sum_j e^{s_ij} v_j / (e^{sinks[h]} + sum_j e^{s_ij}),   lse_i = log2(e^{sinks[h]} + sum_j e^{s_ij})

with s_ij = sm_scale * q_i.k_j over the visible keys (causal, sliding window, ...). The lse includes the sink, as
FlashInfer's does, so (o, lse) is an attention state over "the keys plus the sink" that merge_state combines exactly
with states over other keys (the sink is then counted once); a row with no visible key gives o = 0 and
lse = sinks[h] * log2(e). Split-KV chunks carry the sink in chunk 0 only (attnjit/work.cuh).

The sink is compiled into the kernel (the ``attention_sink`` variant), so a plan chooses it: ``plan(..., sinks=True)``
on any attention wrapper, then ``run(..., sinks=tensor)``; a plan without it rejects ``sinks=`` (a backend that
ignored them would return plain attention). This wrapper is FlashInfer's spelling: every plan has the sink and
``run(q, paged_kv_cache, sinks, sm_scale)`` takes them positionally, as FlashInfer's does.
"""

from __future__ import annotations

from typing import Any

import torch

from . import planner as P
from .planner import _LOG2E
from .attention import BatchPrefillWithPagedKVCacheWrapper



class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """Paged prefill/decode attention with a per-head sink (FlashInfer's class of that name, fa2/fa3 backends).

    The constructor's ``window_left``, ``pos_encoding_mode``, ``q_data_type``/``kv_data_type`` and head dims are
    FlashInfer's module-selection arguments; attnjit takes them again from plan() (a different plan value is used),
    so they are checked and recorded only.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, head_dim_qk: int = 128,
                 head_dim_vo: int = 128, window_left: int = -1, **kwargs: Any):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf=qo_indptr_buf,
                         paged_kv_indptr_buf=paged_kv_indptr_buf, paged_kv_indices_buf=paged_kv_indices_buf,
                         paged_kv_last_page_len_buf=paged_kv_last_page_len_buf, custom_mask_buf=custom_mask_buf,
                         mask_indptr_buf=mask_indptr_buf, backend=backend, **kwargs)
        if use_fp16_qk_reduction:
            raise NotImplementedError("use_fp16_qk_reduction=True is not supported by attnjit")
        P.check_head_dims("head_dim_qk", head_dim_qk, head_dim_vo)
        P.plan_dtypes(q_data_type, kv_data_type, None)
        P.plan_options(head_dim=head_dim_qk, window_left=window_left, pos_encoding_mode=pos_encoding_mode)

    def plan(self, *args: Any, sinks: Any = True, **kwargs: Any) -> None:
        """BatchPrefillWithPagedKVCacheWrapper.plan(), always with the sink."""
        if sinks is not True:
            raise ValueError(f"{type(self).__name__}.plan(): every plan has the sink; got sinks={sinks!r}")
        super().plan(*args, sinks=True, **kwargs)

    def run(self, q: torch.Tensor, paged_kv_cache, *args: Any, sinks=None, sm_scale: float | None = None,
            **kwargs: Any):
        """q: [nnz_qo, H_q, D] -> out (and lse with return_lse). ``run(q, kv, sinks, sm_scale)`` as in FlashInfer
        (sinks: float32 [H_q]; sm_scale: this call's softmax scale, default the plan's), or ``sinks=`` by name."""
        if len(args) > 2:
            raise TypeError(f"run() takes q, paged_kv_cache, sinks and sm_scale positionally; got {2 + len(args)}")
        if args:
            if sinks is not None:
                raise TypeError("run() got sinks both positionally and by name")
            sinks = args[0]
        if len(args) == 2:
            if sm_scale is not None:
                raise TypeError("run() got sm_scale both positionally and by name")
            sm_scale = args[1]
        if sinks is None:
            raise TypeError(f"{type(self).__name__}.run() needs the sinks (float32 [num_qo_heads])")
        plan = self._plan
        if plan is not None:  # FlashInfer takes the softmax scale per call: it is a kernel parameter, not code
            scale = plan.settings["sm_scale"] if sm_scale is None else P.as_real("sm_scale", sm_scale)
            P._f32_positive("sm_scale", scale, scale * _LOG2E)   # plan()'s rule: the struct holds it in float32
            plan.sm_scale_log2 = scale * _LOG2E  # the struct's field, from run()'s kv_scales (times a float k_scale)
        return super().run(q, paged_kv_cache, sinks=sinks, **kwargs)
