"""Variants in the wrappers: FlashInfer's feature arguments as built-in variants, and run()-time parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import variants as V
from ..variants import TensorParam, Variant
from .planner import _F32_MAX, INT32_MAX, as_real

_TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}


@dataclass
class Binding:
    """A plan's variant: the composed Variant, the parameter values plan() fixed (built-ins), and the order in
    which the kernel's parameter struct holds them."""

    variant: Variant | None = None
    bound: dict[str, Any] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)

    @property
    def required(self) -> list[str]:
        return [n for n in (self.variant.param_names if self.variant else []) if n not in self.bound]

    def kinds(self) -> dict[str, Any]:
        return {n: k for part in (self.variant.parts if self.variant else ()) for n, k in part.params}


def pack_mask_bits(custom_mask: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Bit-pack each request's flattened [qo_len * kv_len] bool mask (little-endian bits within a byte, each
    request padded to whole bytes, as FlashInfer's segment_packbits). Returns (bytes, byte offsets [B+1])."""
    weights = _on_device([1, 2, 4, 8, 16, 32, 64, 128], torch.int32, custom_mask.device)
    chunks, indptr, pos = [], [0], 0
    flat = custom_mask.reshape(-1).to(torch.int32)
    for n in sizes:
        seg = flat[pos:pos + n]
        pos += n
        pad = (-n) % 8
        if pad:
            seg = torch.cat([seg, torch.zeros(pad, dtype=torch.int32, device=seg.device)])
        chunks.append((seg.view(-1, 8) * weights).sum(dim=1).to(torch.uint8))
        indptr.append(indptr[-1] + (n + pad) // 8)
    packed = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=custom_mask.device)
    return packed, indptr


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor plan() builds, put on the device through pinned memory (an asynchronous copy: plan() does not
    synchronize with the device for it)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


_SLOPES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _alibi_slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    """The ALiBi slopes of num_heads heads on device (made once: the kernels only read them)."""
    slopes = _SLOPES.get((num_heads, device))
    if slopes is None:
        slopes = _SLOPES[(num_heads, device)] = _on_device(V.alibi_slopes(num_heads), torch.float32, device)
    return slopes


_FREQS: dict[tuple[int, float, float, torch.device], torch.Tensor] = {}


def _rope_freqs(head_dim: int, rope_scale: float, rope_theta: float, device: torch.device) -> torch.Tensor:
    """ROPE_LLAMA's frequency table on device (made once per (head_dim, scale, theta): the kernels only read it)."""
    key = (head_dim, rope_scale, rope_theta, device)
    freqs = _FREQS.get(key)
    if freqs is None:
        freqs = _on_device(V.rope_freqs(head_dim, rope_scale, rope_theta), torch.float32, device)
        if len(_FREQS) < 64:   # the first 64 configurations keep their table for good: a graph-mode re-plan finds
            _FREQS[key] = freqs   # the very tensor its captured struct points at (clearing would hand it a new one)
    return freqs


def bind(*, user: Variant | None, logits_soft_cap: float | None, window_left: int | None, pos_encoding_mode: str,
         custom_mask: torch.Tensor | None, packed_custom_mask: torch.Tensor | None, qo_lens, kv_lens,
         num_qo_heads: int, device: torch.device, head_dim: int = 0, rope_scale: float = 1.0,
         rope_theta: float = 1e4, sinks: bool = False) -> Binding:
    """The plan's variant: the wrapper's own (if any) composed with the built-ins FlashInfer's arguments ask for.
    The scalars arrive checked (planner.plan_options): None is off. ROPE_LLAMA rotates q and k first (before a user
    variant's transforms see them); ``sinks`` adds the sink whose values run() takes (``sinks=``)."""
    parts: list[Variant] = [user] if user is not None else []
    b = Binding()
    if pos_encoding_mode == "ROPE_LLAMA":
        parts.insert(0, V.ROPE_LLAMA)
        freqs = _rope_freqs(head_dim, rope_scale, rope_theta, device)
        b.bound["rope_freqs"] = freqs
        b.keep.append(freqs)
    if logits_soft_cap is not None:
        parts.append(V.SOFTCAP)
        b.bound["logits_soft_cap"] = float(logits_soft_cap)
    if window_left is not None:
        parts.append(V.SLIDING_WINDOW)
        b.bound["window_left"] = window_left
    if pos_encoding_mode == "ALIBI":
        parts.append(V.ALIBI)
        slopes = _alibi_slopes(num_qo_heads, device)
        b.bound["alibi_slopes"] = slopes
        b.keep.append(slopes)
    if custom_mask is not None or packed_custom_mask is not None:
        sizes = [int(q) * int(k) for q, k in zip(qo_lens, kv_lens)]
        if custom_mask is not None:
            if not isinstance(custom_mask, torch.Tensor) or custom_mask.dtype != torch.bool:
                raise TypeError("custom_mask must be a bool tensor (the flattened [qo_len, kv_len] masks of the "
                                f"requests), got {getattr(custom_mask, 'dtype', type(custom_mask).__name__)}")
            if custom_mask.numel() != sum(sizes):
                raise ValueError(f"custom_mask has {custom_mask.numel()} elements; the batch needs sum(qo_len * kv_len) "
                                 f"= {sum(sizes)}")
            if custom_mask.device != device:
                raise ValueError(f"custom_mask is on {custom_mask.device} but the data is on {device}")
            packed, indptr = pack_mask_bits(custom_mask, sizes)
        else:
            if not isinstance(packed_custom_mask, torch.Tensor) or packed_custom_mask.dtype != torch.uint8:
                raise TypeError("packed_custom_mask must be a uint8 tensor (each request's mask bit-packed, little "
                                "endian, padded to whole bytes), got "
                                f"{getattr(packed_custom_mask, 'dtype', type(packed_custom_mask).__name__)}")
            indptr = [0]
            for n in sizes:
                indptr.append(indptr[-1] + (n + 7) // 8)
            if packed_custom_mask.numel() != indptr[-1]:
                raise ValueError(f"packed_custom_mask has {packed_custom_mask.numel()} bytes; the batch needs "
                                 f"{indptr[-1]} (sum of ceil(qo_len * kv_len / 8))")
            if packed_custom_mask.device != device:
                raise ValueError(f"packed_custom_mask is on {packed_custom_mask.device} but the data is on {device}")
            packed = packed_custom_mask.reshape(-1).contiguous()  # a strided view is copied: plan() may copy
        parts.append(V.CUSTOM_MASK)
        mask_indptr = _on_device(indptr, torch.int32, device)
        b.bound["packed_custom_mask"] = packed
        b.bound["mask_indptr"] = mask_indptr
        b.keep += [packed, mask_indptr]
    if sinks:
        parts.append(V.SINK)
    if parts:
        b.variant = V.compose(*parts)
    return b


def with_sinks(plan: Any, variant_params: dict[str, Any], sinks: Any) -> dict[str, Any]:
    """run()'s ``sinks=`` (FlashInfer's argument) as the plan's sink parameter. A plan without the sink hook cannot
    honour it (the sink is compiled in), so it is an error there, never ignored; a plan with it requires it."""
    if sinks is None or plan is None:
        return variant_params
    variant = plan.binding.variant
    if variant is None or "sinks" not in plan.binding.required or not any(p.hook("sink") for p in variant.parts):
        raise ValueError("run(sinks=...): this plan has no attention sink; the sink changes the kernel, which plan() "
                         "chooses: pass sinks=True to plan() (or use attnjit.BatchAttentionWithAttentionSinkWrapper)")
    if "sinks" in variant_params:
        raise TypeError("run() got the sinks twice")
    return {**variant_params, "sinks": sinks}


def check_value(variant: Variant, name: str, kind: Any, value: Any, *, device: torch.device,
                sizes: dict[str, int]) -> int | float:
    """One run()-time parameter -> what its struct field holds (float, int or a device pointer)."""
    where = f"variant {variant.name!r}: parameter {name!r}"
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be a float, got {type(value).__name__}")
        value = as_real(where, value)   # an int beyond any float: a ValueError
        if math.isfinite(value) and abs(value) > _F32_MAX:
            raise ValueError(f"{where}={value!r} does not fit the kernel's float32 (|x| <= {_F32_MAX:.4g})")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where} must be an int, got {type(value).__name__}")
        if not -INT32_MAX - 1 <= value <= INT32_MAX:
            raise ValueError(f"{where}={value} does not fit the kernel's int32")
        return value
    assert isinstance(kind, TensorParam)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor ({kind.describe()}), got {type(value).__name__}")
    want = _TORCH_DTYPE[kind.dtype]
    if value.dtype != want:
        raise TypeError(f"{where} must be a {want} tensor, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{where} is on {value.device} but the data is on {device}")
    if not value.is_contiguous():
        raise ValueError(f"{where} must be contiguous (the kernel indexes it as a dense array); this view has shape "
                         f"{tuple(value.shape)} strides {value.stride()}: pass .contiguous()")
    n = sizes.get(kind.per)
    if n is not None and value.numel() != n:
        raise ValueError(f"{where} holds one value per {kind.per}: {n} elements expected, got {value.numel()}")
    return value.data_ptr()
