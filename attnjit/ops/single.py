"""single_prefill_with_kv_cache and single_decode_with_kv_cache: one request, planned and run in one call.

Convenience over the ragged batch wrapper (one workspace per device). Unlike run(), these may copy: a view the
kernels cannot read as it is (misaligned, or k and v with different strides) is made contiguous first.
"""

from __future__ import annotations

from typing import Any

import torch

from ..variants import Variant
from ._common import check_layout, check_tensor, unsupported
from ._running import vector_ready
from .attention import BatchPrefillWithRaggedKVCacheWrapper

_single_workspaces: dict[torch.device, torch.Tensor] = {}


def _workspace_for(device: torch.device) -> torch.Tensor:
    ws = _single_workspaces.get(device)
    if ws is None:
        ws = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        _single_workspaces[device] = ws
    return ws


def single_prefill_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, custom_mask=None,
                                 packed_custom_mask=None, causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                                 sm_scale: float | None = None, window_left: int = -1,
                                 logits_soft_cap: float | None = None, rope_scale=None, rope_theta=None,
                                 backend: str = "auto", return_lse: bool = False, variant: Variant | None = None,
                                 **variant_params: Any):
    """q: [qo_len, H_q, D], k/v: [kv_len, H_kv, D] (NHD) or [H_kv, kv_len, D] (HND) -> o [qo_len, H_q, D]."""
    check_tensor("q", q, dim=3)
    check_tensor("k", k, dim=3, device=q.device)
    check_tensor("v", v, dim=3, device=q.device)
    check_layout(kv_layout)
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {list(k.shape)} and {list(v.shape)}")
    dev = q.device
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(_workspace_for(dev), variant=variant)
    qo_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32)   # host metadata: plan() reads it without a sync
    kv_indptr = torch.tensor([0, k.shape[0]], dtype=torch.int32)
    wrapper.plan(qo_indptr, kv_indptr, q.shape[1], k.shape[1], q.shape[2], causal=causal, sm_scale=sm_scale,
                 custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, pos_encoding_mode=pos_encoding_mode,
                 use_fp16_qk_reduction=use_fp16_qk_reduction, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                 q_data_type=q.dtype, kv_data_type=k.dtype)
    if k.stride() != v.stride() or not (vector_ready(k) and vector_ready(v)):
        k, v = k.contiguous(), v.contiguous()
    if not vector_ready(q):
        q = q.contiguous()
    return wrapper.run(q, k, v, return_lse=return_lse, **variant_params)


def single_decode_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False, q_scale=None,
                                k_scale=None, v_scale=None, window_left: int = -1,
                                logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale=None,
                                rope_theta=None, return_lse: bool = False, variant: Variant | None = None,
                                **variant_params: Any):
    """q: [H_q, D], k/v: [kv_len, H_kv, D] (NHD) or [H_kv, kv_len, D] (HND) -> o [H_q, D]."""
    check_tensor("q", q, dim=2)
    unsupported(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    result = single_prefill_with_kv_cache(q.unsqueeze(0), k, v, causal=False, kv_layout=kv_layout,
                                          pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                                          window_left=window_left, logits_soft_cap=logits_soft_cap,
                                          rope_scale=rope_scale, rope_theta=rope_theta, return_lse=return_lse,
                                          variant=variant, **variant_params)
    if return_lse:
        o, lse = result
        return o[0], lse[0]
    return result[0]
