"""run()'s side of a plan: what plan() fixed (``Plan``) and the checks of run()'s tensors against it.

Everything here runs per call and may be captured in a CUDA graph: it checks, fills the prepared parameter struct
and launches; it allocates only an ``out``/``lse`` the caller did not pass, and never synchronizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import math

import numpy as np
import torch

from ..generator import PARAMS
from ..specs import AttentionSpec
from ._common import check_no_overlap, check_tensor, check_vectors
from ._variants import Binding, check_value
from .planner import _F32_MAX, _F32_TINY, as_real
from .scheduler import WorkPlan


@dataclass
class Plan:
    spec: AttentionSpec
    work: WorkPlan
    batch_size: int
    total_q: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int | None
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    max_page: int                   # largest page id used (-1: none), checked against the cache in run()
    total_kv: int                   # ragged: kv_indptr[-1]
    on_gpu: bool
    q_shape: Any = None             # torch.Size([total_q, H_q, D]): what run() expects of q and out
    binding: Binding = field(default_factory=Binding)  # the variant and the parameters plan() fixed
    variant_slots: list = field(default_factory=list)   # (name, struct index, kind) of run()-time parameters
    layout: Any = None              # the kernel's ParamLayout (PARAMS["attention"] plus the variant's fields)
    variant_sizes: dict = field(default_factory=dict)   # per -> length, for run()'s tensor-parameter checks
    attn: Any = None                # dispatch.Launch
    attn_values: list = field(default_factory=list)
    keep: list = field(default_factory=list)  # tensors the kernels read; alive as long as the plan
    sched: dict = field(default_factory=dict)  # plan_work's arguments that do not depend on the lengths
    settings: dict = field(default_factory=dict)  # what plan() fixed, by FlashInfer's names (compat.plan_settings)
    extra: dict = field(default_factory=dict)     # a wrapper's own decisions for the record (decode: tensor cores)
    sm_scale_log2: float = 0.0      # sm_scale * log2(e): the parameter struct's, before a run()'s scalar k_scale
    merge_table: Any = None         # a deferred-merge plan: its work.merge_table on the device (merge_partials)
    tma: Any = None                 # tma.Copies: what the kernel may copy by TMA (sm90), or None
    tma_used: str = ""              # what the last launch copied by TMA ("q+kv", "q+k", "q", "kv", "")
    claims: int | None = None       # sm90: 1 CTAs claim work items, 0 grid stride (ATTNJIT_WORK_CLAIMS); else None
    plan_values: list | None = None  # graph mode: the struct as plan() filled it, before any run() (_graph)
    read_spans: tuple = ()          # (name, byte span) the kernel reads besides q and KV: plan()'s tensors, page ids

    def decision(self) -> dict:
        tma = {"tma": self.tma_used} if self.tma is not None else {}
        order = {"work_order": "claimed" if self.claims else "strided"} if self.claims is not None else {}
        return {"family": self.spec.family, **self.work.decision(self.num_kv_heads), **self.extra, **tma, **order}


def vector_ready(t: torch.Tensor) -> bool:
    """[N, H, D] with a 16-byte aligned start and token/head strides, last dim contiguous."""
    n = 16 // t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(2) == 1 and (t.shape[0] <= 1 or t.stride(0) % n == 0)
            and (t.shape[1] <= 1 or t.stride(1) % n == 0))


def check_q_out(plan: Plan, device: torch.device, q: torch.Tensor, out, lse, return_lse: bool):
    """Check q/out/lse against the plan (allocating out/lse when not given); returns them with q/out strides."""
    shape, dev = plan.q_shape, device
    qs = q.stride() if isinstance(q, torch.Tensor) else None
    if qs is None or q.dtype != plan.q_dtype or q.shape != shape or qs[2] != 1 or q.device != dev:
        check_tensor("q", q)
        raise ValueError(f"run(): q must be {plan.q_dtype} {list(shape)} on {dev} with a contiguous last "
                         f"dim, as planned; got {q.dtype} {list(q.shape)} on {q.device} strides {q.stride()}. "
                         "Call plan() again for a new batch.")
    if not vector_ready(q):
        check_vectors("q", q, (0, 1))
    if out is None:
        out = torch.empty(shape, dtype=plan.o_dtype, device=dev)
    os_ = out.stride() if isinstance(out, torch.Tensor) else None
    if os_ is None or out.dtype != plan.o_dtype or out.shape != shape or os_[2] != 1 or out.device != dev:
        check_tensor("out", out)
        raise ValueError(f"run(): out must be {plan.o_dtype} {list(shape)} on {dev} with a contiguous "
                         f"last dim; got {out.dtype} {list(out.shape)} on {out.device}")
    if not vector_ready(out):
        check_vectors("out", out, (0, 1))
    if not out.is_contiguous():
        check_no_overlap("out", out)
    if out.requires_grad:
        raise ValueError("run(): out requires grad, but attnjit's kernels write it outside autograd (no backward); "
                         "pass an out that does not require grad (e.g. out.detach())")
    if lse is None and return_lse:
        lse = torch.empty(shape[:2], dtype=torch.float32, device=dev)
    elif lse is not None:
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != shape[:2] \
                or lse.device != dev or not lse.is_contiguous():
            check_tensor("lse", lse)
            raise ValueError(f"run(): lse must be a contiguous float32 {list(shape[:2])} tensor on "
                             f"{dev} (the kernel writes it as a dense array); got {lse.dtype} {list(lse.shape)} "
                             f"strides {lse.stride()}")
    return out, lse, qs, os_


def variant_args(plan: Plan, device: torch.device, kwargs: dict[str, Any], return_lse: bool) -> None:
    """Check run()'s variant parameters against the plan's variant and put them in the parameter struct."""
    variant = plan.binding.variant
    if variant is None:
        if kwargs:
            raise TypeError(f"run() got unexpected keyword argument(s) {sorted(kwargs)}; this wrapper has no "
                            "variant (pass variant= to the constructor)")
        return
    if return_lse and not variant.use_softmax:
        raise ValueError(f"variant {variant.name!r} has use_softmax=False: its output has no log-sum-exp; call "
                         "run() without return_lse/lse")
    extra = sorted(set(kwargs) - {n for n, _, _ in plan.variant_slots})
    if extra:
        raise TypeError(f"run(): variant {variant.name!r} has no parameter {extra[0]!r}; it takes "
                        f"{[n for n, _, _ in plan.variant_slots] or 'none at run time'}")
    for name, index, kind in plan.variant_slots:
        if name not in kwargs:
            raise TypeError(f"run(): variant {variant.name!r} needs parameter {name!r} "
                            f"({getattr(kind, '__name__', None) or kind.describe()})")
        value = check_value(variant, name, kind, kwargs[name], device=device, sizes=plan.variant_sizes)
        plan.attn_values[index] = value


def _scale(name: str, value: Any, plan: Plan, device: torch.device) -> float | torch.Tensor | None:
    """run()'s k_scale / v_scale: None, a positive finite float (int) or a float32 [H_kv] tensor on the device."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        h = plan.num_kv_heads
        if value.dtype != torch.float32:
            raise TypeError(f"{name} must be a float or a float32 tensor of shape [{h}] (one scale per KV head), got a "
                            f"{value.dtype} tensor")
        if value.dim() != 1 or value.shape[0] != h or value.device != device or (h > 1 and value.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape [{h}] (one scale per KV head) on "
                             f"{device}; got shape {list(value.shape)} strides {value.stride()} on {value.device}")
        if plan.kv_dtype.itemsize != 1:
            raise ValueError(f"{name}: per-KV-head scale tensors need an fp8 KV plan (kv_data_type e4m3 or e5m2); "
                             f"this plan's cache is {plan.kv_dtype}. Pass a float (applied as FlashInfer does)")
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float or a float32 [H_kv] tensor, got {type(value).__name__}")
    value = as_real(name, value)   # a numpy scalar as plan() takes one
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a positive finite number (the cache holds value / {name}), got {value}")
    if not _F32_TINY <= value <= _F32_MAX:   # the kernels hold it (or its product with the logit scale) in float32
        raise ValueError(f"{name} must be within the float32 range the kernels compute in "
                         f"({_F32_TINY:.3g} .. {_F32_MAX:.3g}), got {value!r}")
    return value


def split_scale(scale):
    """run()'s k_scale / v_scale (None, a float or a tensor) as the torch.ops' (float?, Tensor?) pair (a bad value
    is the eager run()'s named error when the op runs)."""
    if isinstance(scale, (bool, np.bool_)):   # torch.ops would take it as 1.0 for the schema's float
        raise TypeError(f"a k_scale / v_scale must be a float or a float32 [H_kv] tensor, got {type(scale).__name__}")
    if isinstance(scale, (np.integer, np.floating)):   # a numpy scalar: the schema's float
        scale = float(scale)
    return (None, scale) if isinstance(scale, torch.Tensor) else (scale, None)


def kv_scales(plan: Plan, device: torch.device, k_scale: Any, v_scale: Any) -> float | None:
    """Put run()'s dequantization scales in the parameter struct (FlashInfer's semantics: the keys are k_scale * k and
    the values v_scale * v): a float k_scale multiplies the logit scale; per-KV-head tensors and an fp8 plan's float
    v_scale are read by the kernel (the output times v_scale, lse unaffected). Returns what run() multiplies the
    output by after the kernel: a 16-bit plan's float v_scale (as FlashInfer does), else None."""
    vals = plan.attn_values
    if k_scale is None and v_scale is None:
        vals[_SM], vals[_KS], vals[_VS], vals[_VSV] = plan.sm_scale_log2, 0, 0, 1.0
        return None
    ks, vs = _scale("k_scale", k_scale, plan, device), _scale("v_scale", v_scale, plan, device)
    if isinstance(ks, float) and not _F32_TINY <= plan.sm_scale_log2 * ks <= _F32_MAX:
        raise ValueError(f"k_scale={ks!r} times the plan's sm_scale * log2(e) ({plan.sm_scale_log2:.4g}) is "
                         f"{plan.sm_scale_log2 * ks:.4g}, outside the float32 range of the kernels' logit scale")
    vals[_SM] = plan.sm_scale_log2 * ks if isinstance(ks, float) else plan.sm_scale_log2
    vals[_KS] = ks.data_ptr() if isinstance(ks, torch.Tensor) else 0
    vals[_VS] = vs.data_ptr() if isinstance(vs, torch.Tensor) else 0
    if plan.kv_dtype.itemsize == 1:
        vals[_VSV] = vs if isinstance(vs, float) else 1.0
        return None
    vals[_VSV] = 1.0
    return vs if isinstance(vs, float) and vs != 1.0 else None


def launch(plan: Plan, q: torch.Tensor, qs, k_ptr: int, v_ptr: int, stride0: int, stride1: int, out, os_,
           lse, kv_rows: int = 0) -> None:
    """Fill run()'s fields of the parameter struct (pointers, strides, TMA descriptors) and launch."""
    vals = plan.attn_values
    vals[0], vals[1], vals[2], vals[3] = q.data_ptr(), k_ptr, v_ptr, out.data_ptr()
    vals[4] = lse.data_ptr() if lse is not None else 0
    vals[_QSN], vals[_QSH], vals[_OSN], vals[_OSH] = qs[0], qs[1], os_[0], os_[1]
    vals[_KV0], vals[_KV1] = stride0, stride1
    if plan.tma is not None:
        plan.tma_used = plan.tma.fill(vals, q, k_ptr, v_ptr, rows=kv_rows, page_size=plan.page_size or 0,
                                      heads=plan.num_kv_heads, head_dim=plan.head_dim, stride0=stride0,
                                      stride1=stride1, out=out)
    plan.attn(vals)


def copies_for(spec: AttentionSpec, tile: Any, layout: Any):
    """The kernel's tma.Copies (its family's tma_boxes of the tile), or None where it copies nothing by TMA."""
    from .. import families, tma

    family = families.get(spec.family)
    boxes = getattr(family, "tma_boxes", None)
    if boxes is None or "tma_flags" not in layout.index:
        return None
    q_box, kv_rows, o_box = boxes(spec, tile)
    i = layout.index
    return tma.Copies(q_box=q_box, kv_rows=kv_rows, dtype=spec.dtype_q, paged=spec.kv == "paged",
                      hnd=spec.layout == "HND", slots=(i["tma_flags"], i["tma_q"], i["tma_k"], i["tma_v"], i["tma_o"]),
                      o_box=o_box, o_dtype=spec.dtype_o,
                      v_gather=family.tma_v_gather(spec, tile), interleaved=family.kv_interleaved(spec, tile))



# positions in PARAMS["attention"] that launch() fills per run()
_A = PARAMS["attention"].index
assert (_A["q"], _A["k"], _A["v"], _A["o"], _A["lse"]) == (0, 1, 2, 3, 4)
_QSN, _QSH, _OSN, _OSH = _A["q_stride_n"], _A["q_stride_h"], _A["o_stride_n"], _A["o_stride_h"]
_KV0, _KV1 = _A["kv_stride_0"], _A["kv_stride_1"]
_SM, _KS, _VS, _VSV = _A["sm_scale_log2"], _A["scale_k"], _A["scale_v"], _A["scale_v_value"]
