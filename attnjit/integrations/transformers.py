"""attnjit as a transformers attention backend.

    import attnjit.integrations.transformers as attnjit_hf
    attnjit_hf.register()                       # name "attnjit"
    model = LlamaForCausalLM.from_config(cfg, attn_implementation="attnjit")

``register()`` adds an attention function to transformers' ``AttentionInterface`` and a mask function to its
``AttentionMaskInterface`` under one name. The attention function takes what transformers passes every attention
module (query [B, H_q, S_q, D], key/value [B, H_kv, S_kv, D] from the cache, the layer's mask, ``scaling``,
``sliding_window``, ``softcap``) and runs it as one ragged batch of B requests (GQA without repeating KV heads). The
mask function returns None where attnjit's own causal and window options give the mask (no padding and the queries
at the end of the keys, as in DynamicCache prefill and decode), so those layers run the plain causal kernel; any
other mask (padding, static caches, packed sequences) comes as an explicit boolean mask, which attnjit runs as a
custom mask. Models covered by the tests: Llama, Qwen2 and Mistral (sliding windows), Gemma-2 (soft-cap, sliding
windows). Plans are cached per shape and options, so a forward pass plans once per kind of layer.

``backend="reference"`` runs the same plumbing on attnjit.reference in float64 (any device, the CPU included): what
the CPU tests use, as attnjit.models.backends does for the example model.

Continuous batching (``generate_batch``, transformers' paged cache) is not served: as of transformers 5.24 it takes
only "paged|eager", "sdpa" or an implementation whose name contains "flash"
(``ContinuousBatchingManager.switch_to_cb_friendly_attn``), so it refuses a registered implementation; the example
engine (attnjit.models) is attnjit's own continuous batching over a paged cache.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import reference
from ..reference import Hooks

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # optional dependency
    raise ImportError("attnjit.integrations.transformers needs transformers (pip install 'attnjit[model]'); "
                      f"import failed: {exc}") from exc

BACKENDS = ("attnjit", "reference")
_PLANS: dict[tuple, tuple[Any, Any]] = {}   # key -> (the mask object it was planned for, the planned wrapper)
_MAX_PLANS = 16
_workspaces: dict[torch.device, torch.Tensor] = {}


def register(name: str = "attnjit", *, backend: str = "attnjit") -> str:
    """Register attnjit with transformers under ``name`` (use it as ``attn_implementation=name``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported: expected one of {', '.join(BACKENDS)}")
    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, build_mask)
    return name


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                   allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False, use_vmap=False,
                   device="cpu", **kwargs) -> torch.Tensor | None:
    """None when the layer's causal (and sliding-window) pattern is all there is to its mask: the caller allows the
    skip, there is no padding and the queries are the last keys (bottom-right alignment, what attnjit's causal
    is); otherwise transformers' boolean mask [B, 1, S_q, S_kv] (True: attend)."""
    aligned = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset + q_length == kv_offset + kv_length
    if allow_is_causal_skip and aligned and (attention_mask is None or _no_padding(attention_mask, kv_offset,
                                                                                    kv_length)):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap, device=device)


def _no_padding(padding: torch.Tensor, kv_offset: int, kv_length: int) -> bool:
    if torch.compiler.is_compiling():   # reading the mask's values would break the graph: keep the explicit mask
        return False
    if padding.shape[-1] > kv_length:
        padding = padding[:, kv_offset:kv_offset + kv_length]
    return bool(padding.all())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      *, backend: str = "attnjit", **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H_q, S_q, D], key/value [B, H_kv, S_kv, D] -> (out [B, S_q, H_q, D], None)."""
    if dropout and module.training:
        raise NotImplementedError(f"attention dropout={dropout} in training is not supported by attnjit (inference "
                                  "kernels): call model.eval() or use another attn_implementation for training")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("output_attentions=True: attnjit does not materialize attention weights")
    batch, h_q, s_q, dim = query.shape
    h_kv, s_kv = key.shape[1], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = int(sliding_window) - 1 if sliding_window else -1    # transformers: kv > q - sliding_window
    visible = None
    if attention_mask is not None:   # an explicit mask already holds causality and the window
        visible, causal, window = _visible(attention_mask, batch, s_q, s_kv), False, -1
    q = query.transpose(1, 2).reshape(batch * s_q, h_q, dim)
    k = key.transpose(1, 2).reshape(batch * s_kv, h_kv, dim)
    v = value.transpose(1, 2).reshape(batch * s_kv, h_kv, dim)
    run = _reference if backend == "reference" else _attnjit
    out = run(q, k, v, batch=batch, s_q=s_q, s_kv=s_kv, causal=causal, window=window, softcap=softcap,
              scale=scaling, visible=visible, mask=attention_mask)
    return out.view(batch, s_q, h_q, dim), None


def _visible(mask: torch.Tensor, batch: int, s_q: int, s_kv: int) -> torch.Tensor:
    """transformers' 4-D mask (bool: True attends; float: 0 attends, the dtype's minimum hides) -> bool [B, S_q,
    S_kv]."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise NotImplementedError(f"attention masks of shape {tuple(mask.shape)}: attnjit takes one [S_q, S_kv] mask "
                                  "per batch element ([B, 1, S_q, S_kv])")
    if mask.dtype != torch.bool:
        visible = mask > torch.finfo(mask.dtype).min / 2
        if (mask[visible] != 0).any():
            raise NotImplementedError("additive attention masks with a bias (not just 0 / -inf) are not supported")
        mask = visible
    return mask[:, 0].expand(batch, s_q, s_kv)


def _indptr(batch: int, n: int) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * n, n, dtype=torch.int32)


def _attnjit(q, k, v, *, batch, s_q, s_kv, causal, window, softcap, scale, visible, mask):
    """One ragged plan of B equal requests, cached per shape and options and for the mask object transformers
    passes (one per forward pass and kind of layer): every layer of a kind runs the same plan."""
    from ..ops.attention import BatchPrefillWithRaggedKVCacheWrapper

    key = (q.device, q.dtype, batch, s_q, s_kv, q.shape[1], k.shape[1], q.shape[2], causal, window, softcap, scale)
    hit = _PLANS.get(key)
    if hit is None or hit[0] is not mask:
        ws = _workspaces.get(q.device)
        if ws is None:
            ws = _workspaces[q.device] = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        wrapper = BatchPrefillWithRaggedKVCacheWrapper(ws)
        wrapper.plan(_indptr(batch, s_q), _indptr(batch, s_kv), q.shape[1], k.shape[1], q.shape[2], causal=causal,
                     window_left=window, logits_soft_cap=softcap, sm_scale=scale, q_data_type=q.dtype,
                     custom_mask=visible.reshape(-1) if visible is not None else None)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = hit = (mask, wrapper)
    return hit[1].run(q, k, v)


def _reference(q, k, v, *, batch, s_q, s_kv, causal, window, softcap, scale, visible, mask):
    """The same request layout on attnjit.reference (float64), with the options as its hooks."""
    def mask(p):
        keep = torch.ones(p.qo_len, p.kv_len, dtype=torch.bool, device=q.device)
        if window >= 0:
            keep = keep & (p.kv_pos[None, :] >= p.q_pos[:, None] - window)
        if visible is not None:
            keep = keep & visible[p.batch_idx]
        return keep[None]
    hooks = Hooks(logits=(lambda l, p: softcap * torch.tanh(l / softcap)) if softcap else None, mask=mask)
    out, _ = reference.batch_ragged(q, k, v, _indptr(batch, s_q).tolist(), _indptr(batch, s_kv).tolist(),
                                    causal=causal, sm_scale=scale, hooks=hooks)
    return out.to(q.dtype)
