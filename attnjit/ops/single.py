"""single_prefill_with_kv_cache and single_decode_with_kv_cache: one request, planned and run in one call.

Convenience over the ragged batch wrapper (one workspace per device). Unlike run(), these may copy: a view the
kernels cannot read as it is (misaligned, or k and v with different strides) is made contiguous first. The plan of
a shape and options is cached (64 per process), so repeated calls, and CUDA graphs capturing them, only launch.
Inside torch.compile they call torch.ops.attnjit.single_prefill / single_decode (ops/library.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..variants import Variant
from ._common import check_layout, check_tensor, unsupported
from ._grad import guard
from ._running import vector_ready
from .planner import MAX_KV_LEN, MAX_QO_ROWS, as_flag
from .attention import BatchPrefillWithRaggedKVCacheWrapper

_single_workspaces: dict[torch.device, torch.Tensor] = {}


def _workspace_for(device: torch.device) -> torch.Tensor:
    ws = _single_workspaces.get(device)
    if ws is None:
        ws = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        _single_workspaces[device] = ws
    return ws


_PLANS: dict[tuple, BatchPrefillWithRaggedKVCacheWrapper] = {}   # cached single-request plans (LRU by insertion)
_MAX_PLANS = 64


def _planned(q: torch.Tensor, k: torch.Tensor, *, variant, cached: bool, backend: str = "auto",
             **plan_kw) -> BatchPrefillWithRaggedKVCacheWrapper:
    """A ragged wrapper planned for one request of q's and k's lengths. With ``cached`` (no variant, no mask), the
    plan of a shape and options is kept: later calls (and a CUDA graph capturing them) only launch."""
    key = None
    if cached and variant is None and plan_kw.get("custom_mask") is None and plan_kw.get("packed_custom_mask") is None:
        key = (q.device, q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], q.dtype, k.dtype, backend,
               tuple(sorted((n, type(v), v) for n, v in plan_kw.items() if not isinstance(v, torch.Tensor))))
        # the types too: True == 1, and a plan made for one must not serve the other (which plan() may refuse)
        try:
            wrapper = _PLANS.pop(key)
            _PLANS[key] = wrapper   # most recently used last
            return wrapper
        except (KeyError, TypeError):   # TypeError: an unhashable argument, which plan() will reject by name
            pass
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("single_prefill/decode_with_kv_cache: a new shape or option while a CUDA graph is being "
                           "captured; plan() cannot run inside capture. Run the call once outside capture first "
                           "(torch.compile's reduce-overhead mode does: it warms up before it records)")
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(_workspace_for(q.device), variant=variant, backend=backend)
    qo_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32)   # host metadata: plan() reads it without a sync
    kv_indptr = torch.tensor([0, k.shape[0]], dtype=torch.int32)
    wrapper.plan(qo_indptr, kv_indptr, q.shape[1], k.shape[1], q.shape[2], q_data_type=q.dtype, kv_data_type=k.dtype,
                 **plan_kw)
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        try:
            _PLANS[key] = wrapper
        except TypeError:
            pass
    return wrapper


def single_prefill_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, custom_mask=None,
                         packed_custom_mask=None, causal: bool = False, kv_layout: str = "NHD",
                         pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                         sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
                         rope_scale=None, rope_theta=None, return_lse: bool = False, variant: Variant | None = None,
                         cached: bool = True, backend: str = "auto", k_scale=None, v_scale=None,
                         **variant_params: Any):
    check_tensor("q", q, dim=3)
    check_tensor("k", k, dim=3, device=q.device)
    check_tensor("v", v, dim=3, device=q.device)
    check_layout(kv_layout)
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {list(k.shape)} and {list(v.shape)}")
    for name, rows, most in (("q", q.shape[0], MAX_QO_ROWS), ("k", k.shape[0], MAX_KV_LEN)):
        if rows > most:   # (before the int32 indptr is built, which would overflow)
            raise ValueError(f"{name} has {rows} tokens: more than one request takes ({most})")
    if isinstance(custom_mask, torch.Tensor) and custom_mask.dim() != 1 and \
            tuple(custom_mask.shape) != (q.shape[0], k.shape[0]):
        # FlashInfer's single-request mask is [qo_len, kv_len]: any other 2-D shape of as many elements (its
        # transpose) would be flattened into a different mask
        raise ValueError(f"custom_mask must be [qo_len, kv_len] = [{q.shape[0]}, {k.shape[0]}] (or flattened to 1-D), "
                         f"got {list(custom_mask.shape)}")
    wrapper = _planned(q, k, variant=variant, cached=cached, backend=backend, causal=causal, sm_scale=sm_scale,
                       custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                       pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction,
                       window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                       rope_theta=rope_theta)
    # a copy in fresh storage: .contiguous() keeps a dense view that starts off a 16-byte boundary
    if k.stride() != v.stride() or not (vector_ready(k) and vector_ready(v)):
        k, v = (t.clone(memory_format=torch.contiguous_format) for t in (k, v))
    if not vector_ready(q):
        q = q.clone(memory_format=torch.contiguous_format)
    return wrapper.run(q, k, v, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, **variant_params)


def _compiled_options(what: str, variant, variant_params, **unsupported_features) -> None:
    """Inside torch.compile the op takes the built-in options only."""
    unsupported(**unsupported_features)
    if variant is not None or variant_params:
        raise NotImplementedError(f"{what}: variant= and run-time variant parameters are not supported inside "
                                  "torch.compile; bind the variant to a batch wrapper's plan() and call its run()")


def single_prefill_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, custom_mask=None,
                                 packed_custom_mask=None, causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                                 sm_scale: float | None = None, window_left: int = -1,
                                 logits_soft_cap: float | None = None, rope_scale=None, rope_theta=None,
                                 backend: str = "auto", return_lse: bool = False, variant: Variant | None = None,
                                 k_scale=None, v_scale=None, **variant_params: Any):
    """q: [qo_len, H_q, D], k/v: [kv_len, H_kv, D] (NHD) or [H_kv, kv_len, D] (HND) -> o [qo_len, H_q, D]. k/v may
    be fp8 (torch.float8_e4m3fn / float8_e5m2) with fp16/bf16 q; k_scale / v_scale as for the batch run()."""
    if torch.compiler.is_compiling():
        _compiled_options("single_prefill_with_kv_cache", variant, variant_params, custom_mask=custom_mask,
                          k_scale=k_scale, v_scale=v_scale,
                          packed_custom_mask=packed_custom_mask, use_fp16_qk_reduction=use_fp16_qk_reduction,
                          rope_scale=rope_scale, rope_theta=rope_theta)
        o, lse = torch.ops.attnjit.single_prefill(q, k, v, causal, kv_layout, sm_scale, window_left, logits_soft_cap,
                                                  pos_encoding_mode, return_lse)
        return guard("single_prefill_with_kv_cache", (o, lse) if return_lse else o, q, k, v)
    return single_prefill_eager(q, k, v, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                                causal=causal, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode,
                                use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale,
                                window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                                rope_theta=rope_theta, return_lse=return_lse, variant=variant, backend=backend,
                                k_scale=k_scale, v_scale=v_scale, **variant_params)


def single_decode_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False, q_scale=None,
                                k_scale=None, v_scale=None, window_left: int = -1,
                                logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale=None,
                                rope_theta=None, return_lse: bool = False, variant: Variant | None = None,
                                **variant_params: Any):
    """q: [H_q, D], k/v: [kv_len, H_kv, D] (NHD) or [H_kv, kv_len, D] (HND) -> o [H_q, D]. k/v may be fp8
    (torch.float8_e4m3fn / float8_e5m2) with fp16/bf16 q: k_scale / v_scale (floats, or float32 [H_kv] tensors)
    dequantize them, as for the batch run()."""
    if torch.compiler.is_compiling():
        _compiled_options("single_decode_with_kv_cache", variant, variant_params, q_scale=q_scale, k_scale=k_scale,
                          v_scale=v_scale, rope_scale=rope_scale, rope_theta=rope_theta)
        o, lse = torch.ops.attnjit.single_decode(q, k, v, kv_layout, sm_scale, window_left, logits_soft_cap,
                                                 pos_encoding_mode, return_lse)
        return guard("single_decode_with_kv_cache", (o, lse) if return_lse else o, q, k, v)
    check_tensor("q", q, dim=2)
    unsupported(q_scale=q_scale)
    as_flag("use_tensor_cores", use_tensor_cores)   # accepted, as FlashInfer's; every attnjit path uses them
    result = single_prefill_eager(q.unsqueeze(0), k, v, causal=False, kv_layout=kv_layout,
                                  pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                                  return_lse=return_lse, variant=variant, k_scale=k_scale, v_scale=v_scale,
                                  **variant_params)
    if return_lse:
        o, lse = result
        return o[0], lse[0]
    return result[0]
