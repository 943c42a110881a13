"""FlashInfer-compatible attention wrappers: plan() on the host, run() on the GPU.

plan() validates every argument before any device work (so the same errors appear on a machine with no GPU),
decides the tile and the split-KV schedule, uploads the work list, and loads the kernel module. run() checks its
tensors against the plan and launches; it compiles, loads and synchronizes nothing, so it can be captured in a
CUDA graph. With ``use_cuda_graph=True`` the wrapper keeps every buffer a kernel reads at a fixed address: a
captured run() replays correctly after a new plan() with other lengths and page tables of the same batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import dispatch, knobs
from ..errors import NoGPUError
from .. import families
from ..generator import PARAMS, attention_layout, variant_param_name
from ..specs import DEFAULT_ARCH, AttentionSpec
from ..variants import Variant, resolve as resolve_variant
from ._variants import Binding, bind, check_value
from ._common import (SPEC_DTYPE, PagedCache, as_dtype, check_head_dim, check_heads, check_indptr, check_layout,
                      check_metadata, check_page_size, check_tensor, spec_for, unpack_paged_cache, unsupported,
                      with_family)
from .scheduler import WorkPlan, plan_work

_LOG2E = 1.4426950408889634
# int32 regions of the per-plan metadata buffer, in order ("work" first: its records are read as int4 triples)
_REGIONS = ("work", "work_count", "merge_counters")
_RECORD = 12  # ints per work record


@dataclass
class _Plan:
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

    def decision(self) -> dict:
        return {"family": self.spec.family, **self.work.decision(self.num_kv_heads)}


def _check_causal(qo: list[int], kv_lens: list[int]) -> None:
    for i, kv in enumerate(kv_lens):
        if qo[i + 1] - qo[i] > kv:
            raise ValueError(f"request {i} has {qo[i + 1] - qo[i]} query rows but a KV length of {kv}; with "
                             "causal=True the KV length must include the query tokens (qo_len <= kv_len)")


def _arch_for(device: torch.device) -> str:
    if device.type == "cuda":
        return dispatch.device_arch(device)
    return knobs.ARCH.get() or DEFAULT_ARCH


class _AttentionWrapper:
    """State shared by the three batch wrappers: workspace, layout, CUDA-graph buffers, the current plan."""

    _op = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 *, max_work_items: int | None = None, variant: Variant | str | None = None, backend: str = "auto"):
        check_tensor("float_workspace_buffer", float_workspace_buffer)
        self._family = families.for_backend(backend)  # None: each plan's default (families.for_batch)
        self._backend = backend
        if isinstance(variant, str):
            variant = resolve_variant(variant)
        if variant is not None and not isinstance(variant, Variant):
            raise TypeError(f"variant must be an attnjit.Variant (or its 'module:attribute'), got {type(variant).__name__}")
        self._variant = variant
        if float_workspace_buffer.dim() != 1 or not float_workspace_buffer.is_contiguous():
            raise ValueError("float_workspace_buffer must be a contiguous 1-D tensor (e.g. torch.empty(128 << 20, "
                             f"dtype=torch.uint8, device='cuda')), got shape {tuple(float_workspace_buffer.shape)}")
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._kv_layout = check_layout(kv_layout)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._max_work_items = max_work_items
        self._plan: _Plan | None = None
        self._graph_meta: torch.Tensor | None = None    # fixed int32 metadata buffer (graph mode)
        self._graph_regions: dict[str, tuple[int, int]] | None = None
        self._graph_tables: dict[str, torch.Tensor] = {}
        self._graph_grid: int | None = None  # fixed attention grid.x
        self._graph_batch: int | None = None
        self._graph_spec: AttentionSpec | None = None
        self._graph_tile = None  # the family's tile of the first plan
        self._cache_memo: tuple | None = None  # (cache tensor, plan, PagedCache) of the last run()

    def _graph_buffers(self, **buffers: torch.Tensor | None) -> None:
        """FlashInfer's fixed metadata buffers. The kernels read only the page ids through a fixed buffer (the
        rest lives in the wrapper's own work records), so a given page-id buffer becomes that buffer."""
        for name, buf in buffers.items():
            if buf is None:
                continue
            check_metadata(name, buf, self._device)
            if "indices" in name:
                self._graph_tables["kv_indices"] = buf

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def last_plan(self) -> dict | None:
        """The current plan's decisions (tile, split-KV, work items): what the dispatch record carries."""
        return self._plan.decision() if self._plan else None

    # --- plan ---------------------------------------------------------------------------------------------

    def _bind(self, qo: list[int], kv_lens: list[int], num_qo_heads: int, *, logits_soft_cap, window_left,
              pos_encoding_mode, custom_mask=None, packed_custom_mask=None) -> Binding:
        """The wrapper's variant with the built-ins that FlashInfer's feature arguments ask for."""
        qo_lens = [qo[i + 1] - qo[i] for i in range(len(qo) - 1)]
        return bind(user=self._variant, logits_soft_cap=logits_soft_cap, window_left=window_left,
                    pos_encoding_mode=pos_encoding_mode, custom_mask=custom_mask,
                    packed_custom_mask=packed_custom_mask, qo_lens=qo_lens, kv_lens=kv_lens,
                    num_qo_heads=num_qo_heads, device=self._device)

    @staticmethod
    def _check_prefill_heads(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo) -> int:
        group = check_heads(num_qo_heads, num_kv_heads)
        check_head_dim("head_dim_qk", head_dim_qk)
        if head_dim_vo is not None and head_dim_vo != head_dim_qk:
            raise ValueError(f"head_dim_vo={head_dim_vo} must equal head_dim_qk={head_dim_qk} (not supported yet)")
        return group

    def _dtypes(self, q_data_type, kv_data_type, o_data_type) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        q_dtype = as_dtype(q_data_type, "q_data_type")
        kv_dtype = as_dtype(kv_data_type, "kv_data_type") if kv_data_type is not None else q_dtype
        o_dtype = as_dtype(o_data_type, "o_data_type") if o_data_type is not None else q_dtype
        if kv_dtype != q_dtype:
            raise ValueError(f"kv_data_type={kv_dtype} must equal q_data_type={q_dtype} (mixed q/kv types are not "
                             "supported yet)")
        return q_dtype, kv_dtype, o_dtype

    def _finish_plan(self, *, spec: AttentionSpec, qo: list[int], kv_lens: list[int], kv_bases: list[int],
                     num_qo_heads: int, num_kv_heads: int, q_dtype, kv_dtype, o_dtype, sm_scale: float | None,
                     max_page: int, total_kv: int, tables: dict[str, torch.Tensor], fixed_split_size: int | None,
                     disable_split_kv: bool, binding: Binding) -> None:
        head_dim = spec.head_dim_qk
        group = spec.group_size
        batch = len(qo) - 1
        qo_lens = [qo[i + 1] - qo[i] for i in range(batch)]
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(head_dim)
        if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
        on_gpu = self._device.type == "cuda"
        if on_gpu and not torch.cuda.is_available():
            raise NoGPUError("the workspace is on a CUDA device but CUDA is not available")

        # the kernel family: the wrapper's backend, else the spec's default for this batch (graph mode: the first
        # plan's, which the captured graph replays)
        forced = self._graph_spec.family if self._use_cuda_graph and self._graph_spec is not None else self._family
        family = families.for_batch(spec, forced=forced, max_packed_rows=max((q * group for q in qo_lens), default=0),
                                    backend=self._backend)
        if family != spec.family:
            spec = with_family(spec, family)

        def capacity(t) -> int:  # resident CTAs of tile t over all SMs
            _, per_sm, sms = self._kernel_for(spec, t, on_gpu)
            return per_sm * sms

        # the deep decode tile serves split-KV batches; graph mode keeps the tile of its first plan
        tile = families.get(spec.family).choose_tile(
            spec, qo_lens=qo_lens, num_kv_heads=num_kv_heads,
            allow_split=not disable_split_kv and not self._use_cuda_graph, capacity=capacity)
        if self._use_cuda_graph:
            # a captured graph replays the kernel it captured: later plans keep its spec and tile
            if self._graph_spec is None:
                self._graph_spec, self._graph_tile = spec, tile
            elif spec != self._graph_spec:
                raise ValueError(f"use_cuda_graph: plan() asks for {spec.short_name()} but this wrapper's graph "
                                 f"was planned for {self._graph_spec.short_name()}; use one wrapper per kernel spec")
            tile = self._graph_tile
        kernel, per_sm, sms = self._kernel_for(spec, tile, on_gpu)
        slot_bytes = num_qo_heads * (head_dim + 1) * 4
        max_slots = self._workspace.numel() * self._workspace.element_size() // slot_bytes
        work = plan_work(qo_lens=qo_lens, kv_lens=kv_lens, qo_offsets=qo[:-1], kv_bases=kv_bases, group=group,
                         tile=tile,
                         causal=spec.mask == "causal", num_kv_heads=num_kv_heads, slots=sms * per_sm,
                         max_slots=max_slots, allow_split=not disable_split_kv, fixed_chunk=fixed_split_size)
        plan = _Plan(spec=spec, work=work, batch_size=batch, total_q=qo[-1], num_qo_heads=num_qo_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=spec.page_size, q_dtype=q_dtype,
                     kv_dtype=kv_dtype, o_dtype=o_dtype, max_page=max_page, total_kv=total_kv, on_gpu=on_gpu,
                     q_shape=torch.Size((qo[-1], num_qo_heads, head_dim)), binding=binding,
                     variant_sizes={"qo_head": num_qo_heads, "kv_head": num_kv_heads, "request": batch,
                                    "request+1": batch + 1, "qo_token": qo[-1]})
        plan.keep += binding.keep
        plan.layout = attention_layout(spec.variant)
        kinds = binding.kinds()
        plan.variant_slots = [(n, plan.layout.index[variant_param_name(n)], kinds[n]) for n in binding.required]
        host = {"work": [x for rec in work.records for x in rec], "work_count": [work.num_items],
                "merge_counters": [0] * (work.num_groups * num_kv_heads)}
        if on_gpu:
            ptr = self._upload(host, tables, batch, plan)
        else:  # the parameter struct is still built (and checked) where there is no GPU: pointers stay 0
            ptr = dict.fromkeys(("kv_indices", "work", "work_count", "merge_counters"), 0)
        self._prepare_launch(plan, kernel, ptr, sm_scale, max_slots, per_sm * sms)
        self._plan = plan

    def _kernel_for(self, spec: AttentionSpec, tile, on_gpu: bool) -> tuple[Any, int, int]:
        """(kernel or None, resident CTAs per SM, SMs) for one tile of the spec's module."""
        if not on_gpu:
            return None, max(1, min(tile.min_blocks * 2, (227 * 1024) // max(tile.smem, 1))), dispatch.num_sms(None)
        kernel = dispatch.module(spec, self._device).kernels[tile.kernel]
        return kernel, max(1, kernel.occupancy()), dispatch.num_sms(self._device)

    def _upload(self, host: dict[str, list[int]], tables: dict[str, torch.Tensor], batch: int,
                plan: _Plan) -> dict[str, int]:
        """Copy the plan's int32 metadata to the device in one transfer; return each region's device pointer."""
        if self._use_cuda_graph:
            if self._graph_batch is None:
                self._graph_batch = batch
            elif batch != self._graph_batch:
                raise ValueError(f"this wrapper was built with use_cuda_graph=True and first planned for batch size "
                                 f"{self._graph_batch}; plan() got batch size {batch}. Use one wrapper per batch size.")
            if self._graph_regions is None:
                cap_items = max(self._max_work_items or 0, 2 * (len(host["work"]) // _RECORD), 64)
                caps = {"work": _RECORD * cap_items, "work_count": 1, "merge_counters": cap_items * plan.num_kv_heads}
                offset, regions = 0, {}
                for r in _REGIONS:
                    regions[r] = (offset, caps[r])
                    offset += caps[r]
                self._graph_regions = regions
                self._graph_meta = torch.zeros(offset, dtype=torch.int32, device=self._device)
            regions = self._graph_regions
            total = self._graph_meta.numel()
        else:
            offset, regions = 0, {}
            for r in _REGIONS:
                regions[r] = (offset, len(host[r]))
                offset += len(host[r])
            total = offset
        buf = torch.zeros(total, dtype=torch.int32, pin_memory=True)
        for r in _REGIONS:
            off, cap = regions[r]
            values = host[r]
            if len(values) > cap:
                raise ValueError(f"use_cuda_graph: this plan needs {len(values)} entries of {r} but the wrapper's "
                                 f"fixed buffers hold {cap}; build the wrapper with a larger max_work_items")
            if values:
                buf[off:off + len(values)] = torch.tensor(values, dtype=torch.int32)
        if self._use_cuda_graph:
            dev_buf = self._graph_meta
            dev_buf.copy_(buf, non_blocking=True)
        else:
            dev_buf = buf.to(self._device, non_blocking=True)
        plan.keep.append(dev_buf)
        base = dev_buf.data_ptr()
        ptr = {r: base + 4 * regions[r][0] for r in _REGIONS}
        # the request tables the kernels read (qo_indptr comes from `tables` unless the wrapper synthesized it)
        for name, t in tables.items():
            if t.device.type == "cpu" and not self._use_cuda_graph:  # page ids given on the host
                t = t.to(self._device, non_blocking=True)
            if self._use_cuda_graph:
                fixed = self._graph_tables.get(name)
                if fixed is None or fixed.numel() < t.numel():
                    if fixed is not None:
                        raise ValueError(f"use_cuda_graph: {name} has {t.numel()} entries, more than the "
                                         f"{fixed.numel()} of the wrapper's fixed buffer; pass a large enough "
                                         f"buffer to the constructor")
                    fixed = torch.zeros(max(t.numel() * 2, 64), dtype=torch.int32, device=self._device)
                    self._graph_tables[name] = fixed
                if fixed.data_ptr() != t.data_ptr():
                    fixed[:t.numel()].copy_(t, non_blocking=True)
                t = fixed
            plan.keep.append(t)
            ptr[name] = t.data_ptr()
        return ptr

    def _prepare_launch(self, plan: _Plan, kernel, ptr: dict[str, int], sm_scale: float, max_slots: int,
                        slots: int) -> None:
        work = plan.work
        d, hq = plan.head_dim, plan.num_qo_heads
        ws = self._workspace.data_ptr() if kernel is not None else 0
        persistent = getattr(families.get(plan.spec.family), "PERSISTENT", False)
        if self._use_cuda_graph:
            if self._graph_grid is None:
                self._graph_grid = max(slots, 1)  # persistent CTAs walk whatever work list a later plan holds
            grid_x = self._graph_grid
        elif persistent:  # one resident CTA per slot walks the list (work_count items)
            grid_x = min(work.num_items * plan.num_kv_heads, slots)
        else:
            grid_x = work.num_items * plan.num_kv_heads
        if kernel is not None:
            plan.attn = dispatch.Launch(self._op, kernel, (grid_x, 1, 1), plan=plan.decision())
        binding = plan.binding
        kinds = binding.kinds()
        fixed = {variant_param_name(n): check_value(binding.variant, n, kinds[n], v, device=self._device,
                                                   sizes=plan.variant_sizes) for n, v in binding.bound.items()}
        fixed.update({variant_param_name(n): 0 for n in binding.required})  # filled by each run()
        plan.attn_values = plan.layout.values(
            q=0, k=0, v=0, o=0, lse=0, tmp_o=ws, tmp_lse=ws + max_slots * hq * d * 4,
            kv_indices=ptr.get("kv_indices", 0), work=ptr["work"],
            work_count=ptr["work_count"] if self._use_cuda_graph or persistent else 0,  # 0: the grid is the list
            merge_counters=ptr["merge_counters"], q_stride_n=0, q_stride_h=0, o_stride_n=0, o_stride_h=0,
            kv_stride_0=0, kv_stride_1=0, num_qo_heads=hq, num_kv_heads=plan.num_kv_heads,
            sm_scale_log2=sm_scale * _LOG2E, **fixed)
        if kernel is not None:
            assert len(plan.attn_values) == kernel.layout.struct.size // 8, "plan and kernel disagree on parameters"

    # --- run ----------------------------------------------------------------------------------------------

    def _current_plan(self, variant_params: dict[str, Any] | None = None, want_lse: bool = False) -> _Plan:
        """The plan run() executes: present, its variant parameters valid, on a GPU (checked in that order, so
        argument errors show on a CPU-planned wrapper too)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{type(self).__name__}.run() called before plan()")
        if variant_params or plan.variant_slots or (want_lse and plan.binding.variant is not None):
            self._variant_args(plan, variant_params or {}, want_lse)
        if not plan.on_gpu:
            raise NoGPUError(f"{type(self).__name__} was planned on {self._device}; kernels run on CUDA devices only "
                             "(plan() validates and schedules anywhere; run() needs a GPU workspace)")
        return plan

    def _check_q_out(self, plan: _Plan, q: torch.Tensor, out, lse, return_lse: bool):
        """Check q/out/lse against the plan (allocating out/lse when not given); returns them with q/out strides."""
        shape, dev = plan.q_shape, self._device
        qs = q.stride() if isinstance(q, torch.Tensor) else None
        if qs is None or q.dtype != plan.q_dtype or q.shape != shape or qs[2] != 1 or q.device != dev:
            check_tensor("q", q)
            raise ValueError(f"run(): q must be {plan.q_dtype} {list(shape)} on {dev} with a contiguous last "
                             f"dim, as planned; got {q.dtype} {list(q.shape)} on {q.device} strides {q.stride()}. "
                             "Call plan() again for a new batch.")
        if out is None:
            out = torch.empty(shape, dtype=plan.o_dtype, device=dev)
        os_ = out.stride() if isinstance(out, torch.Tensor) else None
        if os_ is None or out.dtype != plan.o_dtype or out.shape != shape or os_[2] != 1 or out.device != dev:
            check_tensor("out", out)
            raise ValueError(f"run(): out must be {plan.o_dtype} {list(shape)} on {dev} with a contiguous "
                             f"last dim; got {out.dtype} {list(out.shape)} on {out.device}")
        if lse is None and return_lse:
            lse = torch.empty(shape[:2], dtype=torch.float32, device=dev)
        elif lse is not None:
            if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != shape[:2] \
                    or lse.device != dev or not lse.is_contiguous():
                check_tensor("lse", lse)
                raise ValueError(f"run(): lse must be a contiguous float32 {list(shape[:2])} tensor on "
                                 f"{dev}; got {lse.dtype} {list(lse.shape)}")
        return out, lse, qs, os_

    def _variant_args(self, plan: _Plan, kwargs: dict[str, Any], return_lse: bool) -> None:
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
            value = check_value(variant, name, kind, kwargs[name], device=self._device, sizes=plan.variant_sizes)
            plan.attn_values[index] = value

    def _launch(self, plan: _Plan, q: torch.Tensor, qs, k_ptr: int, v_ptr: int, stride0: int, stride1: int, out,
                os_, lse) -> None:
        vals = plan.attn_values
        vals[0], vals[1], vals[2], vals[3] = q.data_ptr(), k_ptr, v_ptr, out.data_ptr()
        vals[4] = lse.data_ptr() if lse is not None else 0
        vals[_QSN], vals[_QSH], vals[_OSN], vals[_OSH] = qs[0], qs[1], os_[0], os_[1]
        vals[_KV0], vals[_KV1] = stride0, stride1
        plan.attn(vals)


# positions in PARAMS["attention"] that _launch fills per run()
_A = PARAMS["attention"].index
assert (_A["q"], _A["k"], _A["v"], _A["o"], _A["lse"]) == (0, 1, 2, 3, 4)
_QSN, _QSH, _OSN, _OSH = _A["q_stride_n"], _A["q_stride_h"], _A["o_stride_n"], _A["o_stride_h"]
_KV0, _KV1 = _A["kv_stride_0"], _A["kv_stride_1"]


class _PagedMixin:
    def run(self, q: torch.Tensor, paged_kv_cache, *args: Any, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, **variant_params: Any):
        """q: [nnz_qo, H_q, D] (decode: [batch, H_q, D]) -> out of that shape, and lse [nnz_qo, H_q] (base 2) with
        return_lse. paged_kv_cache: one [P, 2, ...] tensor or a (k, v) tuple in the wrapper's layout. The
        wrapper's variant takes its parameters here by name (``run(q, kv, cap=30.0)``)."""
        if args:
            raise TypeError(f"run() takes q and paged_kv_cache positionally; got {len(args)} more positional arguments")
        if q_scale is not None or k_scale is not None or v_scale is not None or sinks is not None:
            unsupported(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        plan = self._current_plan(variant_params, return_lse or lse is not None)
        if window_left is not None and window_left != plan.binding.bound.get("window_left", -1):
            raise ValueError(f"run(window_left={window_left}) differs from the plan's window "
                             f"({plan.binding.bound.get('window_left', -1)}); pass window_left to plan()")
        cache = self._check_cache(plan, paged_kv_cache)
        out, lse, qs, os_ = self._check_q_out(plan, q, out, lse, return_lse)
        self._launch(plan, q, qs, cache.k_ptr, cache.v_ptr, cache.stride_page, cache.stride_inner, out, os_, lse)
        return (out, lse) if return_lse else out

    def forward(self, *args: Any, **kwargs: Any):
        return self.run(*args, **kwargs)

    def _paged_metadata(self, *, indptr, indices, last_page_len, page_size: int, batch: int,
                        names: tuple[str, str, str]) -> tuple[list[int], list[int], int]:
        """Validate the page table; return (kv lengths, page-table offsets, largest page id)."""
        n_indptr, n_indices, n_last = names
        dev = self._device
        check_metadata(n_indptr, indptr, dev, batch + 1, host_ok=True)
        check_metadata(n_indices, indices, dev, host_ok=True)
        check_metadata(n_last, last_page_len, dev, batch, host_ok=True)
        kvp = indptr.tolist()
        last = last_page_len.tolist()
        check_indptr(n_indptr, kvp)
        if kvp[-1] > indices.numel():
            raise ValueError(f"{n_indices} has {indices.numel()} entries but {n_indptr}[-1]={kvp[-1]}")
        kv_lens = []
        for i in range(batch):
            pages = kvp[i + 1] - kvp[i]
            if pages == 0:
                if last[i] != 0:
                    raise ValueError(f"{n_last}[{i}]={last[i]} but request {i} has no pages; it must be 0 there "
                                     "(an empty history)")
                kv_lens.append(0)
                continue
            if not 1 <= last[i] <= page_size:
                raise ValueError(f"{n_last}[{i}]={last[i]} is outside 1..page_size={page_size} (request {i} has "
                                 f"{pages} pages)")
            kv_lens.append(page_size * (pages - 1) + last[i])
        max_page = -1
        if kvp[-1] > 0:
            lo, hi = torch.aminmax(indices[:kvp[-1]])
            lo, max_page = int(lo), int(hi)
            if lo < 0:
                host = indices[:kvp[-1]].tolist()
                k = next(j for j, p in enumerate(host) if p < 0)
                req = next(i for i in range(batch) if kvp[i] <= k < kvp[i + 1])
                raise ValueError(f"{n_indices}[{k}]={host[k]} is not a valid page id (request {req}); page ids must "
                                 "be >= 0 and < the number of pages in the cache")
        return kv_lens, kvp[:-1], max_page

    def _check_cache(self, plan: _Plan, paged_kv_cache) -> PagedCache:
        memo = self._cache_memo  # the same cache object as last run(): skip re-deriving its views
        if memo is not None and memo[0] is paged_kv_cache and memo[1] is plan:
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
        if isinstance(paged_kv_cache, torch.Tensor):  # a tuple is rebuilt by the caller each time: not memoized
            self._cache_memo = (paged_kv_cache, plan, cache)
        return cache


class BatchPrefillWithPagedKVCacheWrapper(_PagedMixin, _AttentionWrapper):
    """Batch prefill / append / mixed attention over a paged KV cache (query rows ragged by ``qo_indptr``)."""

    _op = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None, *, max_work_items: int | None = None,
                 variant: Variant | str | None = None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, max_work_items=max_work_items,
                         variant=variant, backend=backend)
        unsupported(custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf)  # masks under graphs
        self._graph_buffers(qo_indptr_buf=qo_indptr_buf, paged_kv_indptr_buf=paged_kv_indptr_buf,
                            paged_kv_last_page_len_buf=paged_kv_last_page_len_buf, paged_kv_indices_buf=paged_kv_indices_buf)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             **unused: Any) -> None:
        unsupported(use_fp16_qk_reduction=use_fp16_qk_reduction, rope_scale=rope_scale, rope_theta=rope_theta,
                    **unused)
        group = self._check_prefill_heads(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo)
        check_page_size(page_size)
        q_dtype, kv_dtype, o_dtype = self._dtypes(q_data_type, kv_data_type, o_data_type)
        check_metadata("qo_indptr", qo_indptr, self._device, host_ok=True)
        if qo_indptr.numel() < 1:
            raise ValueError("qo_indptr must have batch_size + 1 >= 1 elements")
        batch = qo_indptr.numel() - 1
        qo = qo_indptr.tolist()
        check_indptr("qo_indptr", qo)
        kv_lens, kv_bases, max_page = self._paged_metadata(
            indptr=paged_kv_indptr, indices=paged_kv_indices, last_page_len=paged_kv_last_page_len,
            page_size=page_size, batch=batch,
            names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        binding = self._bind(qo, kv_lens, num_qo_heads, logits_soft_cap=logits_soft_cap, window_left=window_left,
                             pos_encoding_mode=pos_encoding_mode, custom_mask=custom_mask,
                             packed_custom_mask=packed_custom_mask)
        causal = causal and "packed_custom_mask" not in binding.bound  # a custom mask replaces causal (FlashInfer)
        if causal:
            _check_causal(qo, kv_lens)
        spec = spec_for(op="prefill", head_dim=head_dim_qk, page_size=page_size, dtype_q=SPEC_DTYPE[q_dtype],
                             dtype_kv=SPEC_DTYPE[kv_dtype], dtype_o=SPEC_DTYPE[o_dtype],
                             mask="causal" if causal else "none", layout=self._kv_layout, kv="paged",
                             group_size=group, variant=binding.variant, arch=_arch_for(self._device))
        self._finish_plan(spec=spec, qo=qo, kv_lens=kv_lens, kv_bases=kv_bases, num_qo_heads=num_qo_heads,
                          num_kv_heads=num_kv_heads, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                          sm_scale=sm_scale, max_page=max_page, total_kv=0,
                          tables={"kv_indices": paged_kv_indices}, fixed_split_size=fixed_split_size,
                          disable_split_kv=disable_split_kv, binding=binding)



class BatchDecodeWithPagedKVCacheWrapper(_PagedMixin, _AttentionWrapper):
    """Batch decode (one query row per request) over a paged KV cache; the GQA group shares each KV page read."""

    _op = "decode"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto", jit_args=None,
                 *, max_work_items: int | None = None, variant: Variant | str | None = None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, max_work_items=max_work_items,
                         variant=variant, backend=backend)
        self._graph_buffers(paged_kv_indptr_buffer=paged_kv_indptr_buffer,
                            paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer,
                            paged_kv_indices_buffer=paged_kv_indices_buffer)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type="float16", kv_data_type=None, data_type=None,
             sm_scale: float | None = None, rope_scale=None, rope_theta=None, non_blocking: bool = True,
             block_tables=None, seq_lens=None, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             o_data_type=None, **unused: Any) -> None:
        unsupported(rope_scale=rope_scale, rope_theta=rope_theta, block_tables=block_tables, seq_lens=seq_lens,
                    **unused)
        group = check_heads(num_qo_heads, num_kv_heads)
        check_head_dim("head_dim", head_dim)
        check_page_size(page_size)
        if data_type is not None:  # FlashInfer's older name for the KV (and q) type
            kv_data_type = kv_data_type or data_type
        q_dtype, kv_dtype, o_dtype = self._dtypes(q_data_type, kv_data_type, o_data_type)
        check_metadata("indptr", indptr, self._device, host_ok=True)
        if indptr.numel() < 1:
            raise ValueError("indptr must have batch_size + 1 >= 1 elements")
        batch = indptr.numel() - 1
        kv_lens, kv_bases, max_page = self._paged_metadata(
            indptr=indptr, indices=indices, last_page_len=last_page_len, page_size=page_size,
            batch=batch, names=("indptr", "indices", "last_page_len"))
        for i, k in enumerate(kv_lens):
            if k == 0:
                raise ValueError(f"request {i} has an empty KV history; decode needs at least the current token's "
                                 "key (append it before planning)")
        qo = list(range(batch + 1))
        binding = self._bind(qo, kv_lens, num_qo_heads, logits_soft_cap=logits_soft_cap, window_left=window_left,
                             pos_encoding_mode=pos_encoding_mode)
        spec = spec_for(op="decode", head_dim=head_dim, page_size=page_size, dtype_q=SPEC_DTYPE[q_dtype],
                             dtype_kv=SPEC_DTYPE[kv_dtype], dtype_o=SPEC_DTYPE[o_dtype], layout=self._kv_layout,
                             group_size=group, variant=binding.variant, arch=_arch_for(self._device))
        self._finish_plan(spec=spec, qo=qo, kv_lens=kv_lens, kv_bases=kv_bases, num_qo_heads=num_qo_heads,
                          num_kv_heads=num_kv_heads, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                          sm_scale=sm_scale, max_page=max_page, total_kv=0, tables={"kv_indices": indices},
                          fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv, binding=binding)



class BatchPrefillWithRaggedKVCacheWrapper(_AttentionWrapper):
    """Batch prefill where each request's K/V are contiguous rows of ragged [nnz_kv, H_kv, D] tensors."""

    _op = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, kv_indptr_buf: torch.Tensor | None = None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto", jit_args=None, jit_kwargs=None,
                 *, max_work_items: int | None = None, variant: Variant | str | None = None):
        if kv_layout != "NHD":
            raise ValueError(f"kv_layout={kv_layout!r} is not supported for ragged KV: k and v are [nnz_kv, H_kv, D]")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, max_work_items=max_work_items,
                         variant=variant, backend=backend)
        unsupported(custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf)  # masks under graphs
        self._graph_buffers(qo_indptr_buf=qo_indptr_buf, kv_indptr_buf=kv_indptr_buf)

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: float | None = None, sm_scale: float | None = None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             **unused: Any) -> None:
        unsupported(use_fp16_qk_reduction=use_fp16_qk_reduction, rope_scale=rope_scale, rope_theta=rope_theta,
                    **unused)
        group = self._check_prefill_heads(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo)
        q_dtype, kv_dtype, o_dtype = self._dtypes(q_data_type, kv_data_type, o_data_type)
        check_metadata("qo_indptr", qo_indptr, self._device, host_ok=True)
        if qo_indptr.numel() < 1:
            raise ValueError("qo_indptr must have batch_size + 1 >= 1 elements")
        batch = qo_indptr.numel() - 1
        check_metadata("kv_indptr", kv_indptr, self._device, batch + 1, host_ok=True)
        qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
        check_indptr("qo_indptr", qo)
        check_indptr("kv_indptr", kvp)
        kv_lens = [kvp[i + 1] - kvp[i] for i in range(batch)]
        binding = self._bind(qo, kv_lens, num_qo_heads, logits_soft_cap=logits_soft_cap, window_left=window_left,
                             pos_encoding_mode=pos_encoding_mode, custom_mask=custom_mask,
                             packed_custom_mask=packed_custom_mask)
        causal = causal and "packed_custom_mask" not in binding.bound  # a custom mask replaces causal (FlashInfer)
        if causal:
            _check_causal(qo, kv_lens)
        spec = spec_for(op="prefill", head_dim=head_dim_qk, dtype_q=SPEC_DTYPE[q_dtype],
                             dtype_kv=SPEC_DTYPE[kv_dtype], dtype_o=SPEC_DTYPE[o_dtype],
                             mask="causal" if causal else "none", kv="ragged", group_size=group,
                             variant=binding.variant, arch=_arch_for(self._device))
        self._finish_plan(spec=spec, qo=qo, kv_lens=kv_lens, kv_bases=kvp[:-1], num_qo_heads=num_qo_heads,
                          num_kv_heads=num_kv_heads, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                          sm_scale=sm_scale, max_page=-1, total_kv=kvp[-1], tables={},
                          fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv, binding=binding)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, **variant_params: Any):
        """q: [nnz_qo, H_q, D], k/v: [nnz_kv, H_kv, D] -> out [nnz_qo, H_q, D] (and lse with return_lse). The
        wrapper's variant takes its parameters here by name."""
        if args:
            raise TypeError(f"run() takes q, k and v positionally; got {len(args)} more positional arguments")
        plan = self._current_plan(variant_params, return_lse or lse is not None)
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, dtype=plan.kv_dtype, dim=3, device=self._device)
            if t.shape[0] < plan.total_kv or t.shape[1] != plan.num_kv_heads or t.shape[2] != plan.head_dim \
                    or t.stride(2) != 1:
                raise ValueError(f"run(): {name} must be [>= {plan.total_kv}, {plan.num_kv_heads}, {plan.head_dim}] "
                                 f"with a contiguous last dim, as planned; got {list(t.shape)} strides {t.stride()}")
        if k.stride() != v.stride():
            raise ValueError(f"run(): k and v must have the same strides; got {k.stride()} and {v.stride()}")
        out, lse, qs, os_ = self._check_q_out(plan, q, out, lse, return_lse)
        self._launch(plan, q, qs, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), out, os_, lse)
        return (out, lse) if return_lse else out

    forward = run


# --- single-request helpers ---------------------------------------------------------------------------------

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
    qo_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=dev)
    kv_indptr = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=dev)
    wrapper.plan(qo_indptr, kv_indptr, q.shape[1], k.shape[1], q.shape[2], causal=causal, sm_scale=sm_scale,
                 custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, pos_encoding_mode=pos_encoding_mode,
                 use_fp16_qk_reduction=use_fp16_qk_reduction, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                 q_data_type=q.dtype, kv_data_type=k.dtype)
    if k.stride() != v.stride() or k.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
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
