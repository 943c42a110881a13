"""The machinery every attention wrapper shares: plan()'s common tail (spec, family, tile, schedule, upload, kernel)
and run()'s checks against the plan and its launch. The public wrappers are in ``attention``, the paged wrappers'
run() and page-table reader in ``_paged``, graph mode's replay rules in ``_graph``; this module holds what they
inherit, so that each file keeps one job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import dispatch, families, knobs, tuning
from ..errors import NoGPUError
from ..generator import PARAMS, attention_layout, family_fields, variant_param_name
from ..specs import DEFAULT_ARCH, AttentionSpec
from ..variants import Variant, resolve as resolve_variant
from . import _handles, planner as P
from .planner import _LOG2E
from ._common import (SPEC_DTYPE, byte_span, check_apart_from, check_layout, check_metadata, check_tensor,
                      check_written_apart, plan_spans, spec_for, tensor_spans, with_family)
from ._graph import Replay, check_launch
from ._grad import guard
from ._running import Plan, check_q_out, copies_for, kv_scales, launch, split_scale, variant_args
from ._upload import MetadataBuffers
from ._variants import Binding, bind, check_value
from .compat import FlashInferAliases, plan_settings
from .merge import merge_partials_in_place
from .scheduler import MAX_WORK_ITEMS, WorkPlan, defer_merges, plan_work


@dataclass(slots=True)
class _Prepared:
    """What one plan key fixes (``_AttentionWrapper._prepare``); shared by the plans of the key, never changed."""

    slots: int                # resident CTAs over all SMs
    sched: dict               # plan_work's arguments that do not depend on the lengths
    launch: Any               # dispatch.Launch, or None without a GPU
    layout: Any               # the kernel's ParamLayout
    values: list              # the parameter struct; pointers, strides and variant values 0
    persistent: bool          # the family's CTAs walk the work list
    count: bool               # the kernel reads work_count (graph mode or persistent)
    bound_slots: list         # (name, struct index, kind) of the variant values plan() fixes
    variant_slots: list       # (name, struct index, kind) of the run()-time variant parameters
    extra: dict               # the wrapper's own decisions for the record
    tma: Any = None           # tma.Copies of the kernel (sm90), or None
    claims_slot: int | None = None  # the struct index of work_claims (sm90), or None


_A = PARAMS["attention"].index  # the fields each plan fills, at their PARAMS["attention"] positions
_KVI, _WORK, _WC, _MC = _A["kv_indices"], _A["work"], _A["work_count"], _A["merge_counters"]
_TMP_O, _TMP_LSE = _A["tmp_o"], _A["tmp_lse"]
_NO_POINTERS = dict.fromkeys(("kv_indices", "work", "work_count", "merge_counters"), 0)
_METADATA = {_KVI, _WORK, _WC, _MC}   # the fixed buffers' fields: the same buffers in every graph-mode plan


_PLAIN = frozenset((type(None), bool, int, float, str, torch.dtype))


def args_key(values: tuple) -> tuple | None:
    """A plan()'s scalar arguments as a memo key, their types included (1, 1.0 and True differ), or None where one
    is not a plain scalar (a tensor, a numpy number: checked afresh each time)."""
    types = tuple(map(type, values))
    for t in types:
        if t not in _PLAIN:
            return None
    return values, types


def _schedule(batch: P.Batch, sched: dict, defer: bool = False) -> WorkPlan:
    """The batch's work list; ``defer``: a deferred-merge one (scheduler.defer_merges) where its partial states fit
    in the workspace, else the in-kernel-merge list (``merge_table`` None says which)."""
    args = dict(qo_lens=batch.qo_lens, kv_lens=batch.kv_lens, qo_offsets=batch.qo_indptr[:-1],
                kv_bases=batch.kv_bases, **sched)
    if defer:
        work = defer_merges(plan_work(**args, merge_in_kernel=False), batch.total_q, sched["max_slots"])
        if work is not None:
            return work
    return plan_work(**args)


def _merge_partials(plan: Plan, out: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
    """A deferred plan's partial states (in the workspace its parameter struct points at) merged into (out, lse)."""
    vals = plan.attn_values
    merge_partials_in_place(out, lse, vals[_TMP_O], vals[_TMP_LSE], plan.merge_table, scale)


def _mergeable(variant) -> bool:
    """Whether merge_partials may combine this variant's partial states: softmax ones with no output transform
    (which the kernels apply to a finished row only)."""
    return variant is None or all(part.use_softmax and not part.hook("output_transform") for part in variant.parts)


def _arch_for(device: torch.device) -> str:
    if device.type == "cuda":
        return dispatch.device_arch(device)
    return knobs.ARCH.get() or DEFAULT_ARCH


class _AttentionWrapper(FlashInferAliases):
    """State shared by the three batch wrappers: workspace, layout, CUDA-graph buffers, the current plan."""

    _op = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 *, max_work_items: int | None = None, variant: Variant | str | None = None, backend: str = "auto",
                 tile: str | None = None):
        check_tensor("float_workspace_buffer", float_workspace_buffer)
        self._family = families.for_backend(backend)  # None: each plan's default (families.for_batch)
        self._backend = backend
        if tile is not None and not isinstance(tile, str):
            raise TypeError(f"tile must be the name of a tile configuration (str) or None, got {type(tile).__name__}")
        self._tile = tile       # a forced tile configuration (attnjit tune); None: the tuning record's, or the default
        self._tuned: dict = {}  # spec -> the spec plan() runs (its tuned tile), per wrapper
        if isinstance(variant, str):
            variant = resolve_variant(variant)
        if variant is not None and not isinstance(variant, Variant):
            raise TypeError("variant must be an attnjit.Variant (or its 'module:attribute'), got "
                            f"{type(variant).__name__}")
        self._variant = variant
        if float_workspace_buffer.dim() != 1 or not float_workspace_buffer.is_contiguous():
            raise ValueError("float_workspace_buffer must be a contiguous 1-D tensor (e.g. torch.empty(128 << 20, "
                             f"dtype=torch.uint8, device='cuda')), got shape {tuple(float_workspace_buffer.shape)}")
        if float_workspace_buffer.device.type not in ("cuda", "cpu"):
            raise ValueError(f"float_workspace_buffer must be on a CUDA device (or the CPU, to plan without a GPU), "
                             f"got {float_workspace_buffer.device}")
        if float_workspace_buffer.data_ptr() % 16:
            raise ValueError("float_workspace_buffer must start on a 16-byte boundary (the kernels store partial "
                             f"states 16 bytes at a time); this view starts {float_workspace_buffer.data_ptr() % 16} "
                             "bytes past one")
        if max_work_items is not None:
            max_work_items = P.as_int("max_work_items", max_work_items)
            if not 1 <= max_work_items <= MAX_WORK_ITEMS:
                raise ValueError(f"max_work_items must be 1..{MAX_WORK_ITEMS}, got {max_work_items}")
        self._workspace = float_workspace_buffer
        self._ws_span = byte_span(float_workspace_buffer)   # the kernels write partial states into it (run())
        self._device = float_workspace_buffer.device
        self._kv_layout = check_layout(kv_layout)
        self._use_cuda_graph = P.as_flag("use_cuda_graph", use_cuda_graph)
        self._meta = MetadataBuffers(self._device, self._use_cuda_graph, max_work_items)
        self._cuda_seen = False   # torch.cuda.is_available() once answered True for this wrapper (_finish_plan)
        self._plan: Plan | None = None  # graph mode: every plan has the first one's spec, tile and grid
        self._replay = Replay()   # graph mode: the operands a replay reads and writes (_graph)
        self._cache_memo: tuple | None = None  # (cache tensor, plan, PagedCache, its memory) of the last run()
        self._launches: dict[int, dispatch.Launch] = {}  # kernel pointer -> its Launch
        self._kernels: dict[tuple, tuple] = {}            # (spec, tile, sms) -> (kernel, slots): _kernel_for
        self._prepared: dict[tuple, _Prepared] = {}       # plan key -> what it fixes: _prepare
        self._args_memo: tuple | None = None              # (args_key, checked values) of the last plan(): _checked
        self._handle = _handles.register(self)            # how torch.ops.attnjit.batch_run names this wrapper
        # the cascade's prefix levels: plans whose split groups are merged by merge_partials into the (out, lse) run()
        # is given, after the kernel, rather than by each group's last CTA (scheduler.defer_merges)
        self._defer_merge = False
        # ... and such a plan that splits its KV to fill the GPU fills half of it (the cascade runs its last level on
        # the other half, beside it: MultiLevelCascadeAttentionWrapper.run)
        self._share_gpu = False
        # _run_partials: run() leaves a deferred plan's merge to the caller, keeping here its scale for the partials
        self._hold_merge = False
        self._held_scale: float | None = None
        self._table_buf: torch.Tensor | None = None       # graph mode: a deferred plan's merge table (_merge_table)
        # the cascade: plan() checks and stages (self._staged: _commit's arguments) and writes nothing
        self._hold_commit = False
        self._staged: tuple | None = None

    def _graph_buffers(self, **buffers: torch.Tensor | None) -> None:
        """FlashInfer's fixed metadata buffers. The kernels read only the page ids through a fixed buffer (the
        rest lives in the wrapper's own work records), so a given page-id buffer becomes that buffer; it must be
        dense, as the kernels read it through its data pointer."""
        for name, buf in buffers.items():
            if buf is None:
                continue
            check_metadata(name, buf, self._device, dense=True)
            if "indices" in name:
                self._meta.fixed_page_ids = buf

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def _decision_extra(self) -> dict:
        """What this wrapper adds to the plan's decisions (the dispatch record's ``plan``)."""
        return {}

    @property
    def last_plan(self) -> dict | None:
        """The current plan's decisions (tile, split-KV, work items): what the dispatch record carries."""
        return self._plan.decision() if self._plan else None

    # --- plan ---------------------------------------------------------------------------------------------

    def _bind(self, batch: P.Batch, num_qo_heads: int, opts: P.PlanOptions, custom_mask=None,
              packed_custom_mask=None, *, head_dim: int, sinks: Any = False) -> Binding:
        """The wrapper's variant with the built-ins that FlashInfer's feature arguments ask for."""
        if self._use_cuda_graph and (custom_mask is not None or packed_custom_mask is not None):
            raise NotImplementedError("custom_mask / packed_custom_mask with use_cuda_graph=True: a replay reads the "
                                      "mask the graph captured, and each plan makes its own (FlashInfer's "
                                      "custom_mask_buf is not supported either); plan masked batches without a graph")
        return bind(user=self._variant, logits_soft_cap=opts.logits_soft_cap, window_left=opts.window_left,
                    pos_encoding_mode=opts.pos_encoding_mode, custom_mask=custom_mask,
                    packed_custom_mask=packed_custom_mask, qo_lens=batch.qo_lens, kv_lens=batch.kv_lens,
                    num_qo_heads=num_qo_heads, device=self._device, head_dim=head_dim, rope_scale=opts.rope_scale,
                    rope_theta=opts.rope_theta, sinks=P.as_flag("sinks", sinks, none=False))

    def _plan_batch(self, op: str, batch: P.Batch, *, group: int, head_dim: int,
                    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype], opts: P.PlanOptions, num_qo_heads: int,
                    num_kv_heads: int, page_ids: torch.Tensor | None, sinks: Any, causal_names: tuple[str, str] = (),
                    custom_mask=None, packed_custom_mask=None, **spec_fields: Any) -> None:
        """Every plan()'s tail once its arguments and metadata are read: the variant binding, the causal check
        (prefill: ``causal_names`` name the query and KV arguments), the spec, then _finish_plan."""
        binding = self._bind(batch, num_qo_heads, opts, custom_mask, packed_custom_mask, head_dim=head_dim,
                             sinks=sinks)
        if op == "prefill":
            causal = opts.causal and "packed_custom_mask" not in binding.bound  # a custom mask replaces causal
            if causal:                                                        # (FlashInfer)
                P.check_causal(*causal_names, batch)
            spec_fields["mask"] = "causal" if causal else "none"
        q_dtype, kv_dtype, o_dtype = dtypes
        spec = spec_for(op=op, head_dim=head_dim, dtype_q=SPEC_DTYPE[q_dtype], dtype_kv=SPEC_DTYPE[kv_dtype],
                        dtype_o=SPEC_DTYPE[o_dtype], group_size=group, variant=binding.variant,
                        arch=_arch_for(self._device), **spec_fields)
        self._finish_plan(spec=spec, batch=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                          dtypes=dtypes, opts=opts, page_ids=page_ids, binding=binding)

    def _finish_plan(self, *, spec: AttentionSpec, batch: P.Batch, num_qo_heads: int, num_kv_heads: int,
                     dtypes: tuple[torch.dtype, torch.dtype, torch.dtype], opts: P.PlanOptions,
                     page_ids: torch.Tensor | None, binding: Binding) -> None:
        group = spec.group_size
        qo_lens = batch.qo_lens
        on_gpu = self._device.type == "cuda"
        if on_gpu and not self._cuda_seen:
            if not torch.cuda.is_available():
                raise NoGPUError("the workspace is on a CUDA device but CUDA is not available")
            self._cuda_seen = True   # asked once per wrapper: it does not stop being available
        sms = None if on_gpu else dispatch.num_sms(None)  # no GPU: ATTNJIT_NUM_SMS, read once per plan
        # the kernel family: the wrapper's backend, else the spec's default for this batch (graph mode: the first
        # plan's, which the captured graph replays)
        graph = self._graph_plan()
        forced = graph.spec.family if graph is not None else self._family
        family = families.for_batch(spec, forced=forced, max_packed_rows=batch.longest_qo() * group,
                                    backend=self._backend)
        if family != spec.family:
            spec = with_family(spec, family)
        spec = self._with_tile(spec)
        if self._use_cuda_graph:
            self._check_graph_plan(spec, batch)

        def capacity(t) -> int:  # resident CTAs of tile t over all SMs
            return self._kernel_for(spec, t, sms)[1]

        # the deep decode tile serves split-KV batches; a captured graph replays the kernel it captured: later
        # plans keep the first plan's tile
        tile = graph.work.tile if graph is not None else families.get(spec.family).choose_tile(
            spec, qo_lens=qo_lens, num_kv_heads=num_kv_heads, kv_lens=batch.kv_lens,
            allow_split=not opts.disable_split_kv and not self._use_cuda_graph, capacity=capacity)
        key = (spec, tile, sms, num_qo_heads, num_kv_heads, opts.sm_scale, opts.fixed_split_size,
               opts.disable_split_kv, tuple(binding.bound))
        prep = self._prepared.get(key)
        if prep is None:
            prep = self._prepared[key] = self._prepare(key, binding)
        defer = self._defer_merge and _mergeable(spec.variant)
        if graph is not None:   # a captured run merges as the first plan did: in a second kernel or in the kernel
            defer = graph.work.merge_table is not None
        # a deferred plan beside the cascade's last level: a split fills half of the GPU, which the list then walks
        # (the grid stays the key's, so an unsplit list still runs on all of it)
        sched = {**prep.sched, "slots": max(1, prep.sched["slots"] // 2)} if defer and self._share_gpu else prep.sched
        work = _schedule(batch, sched, defer)
        if work.merge_table is None and sched is not prep.sched:   # it fell back to in-kernel merges: all the GPU
            work = _schedule(batch, prep.sched)
        if graph is not None and defer and work.merge_table is None:
            raise ValueError("use_cuda_graph: this plan's partial states do not fit float_workspace_buffer, but the "
                             "graph was planned to merge them in a second kernel (a cascade level); give the wrapper "
                             "a larger workspace")
        q_dtype, kv_dtype, o_dtype = dtypes
        total_q, size = batch.total_q, batch.batch_size
        plan = Plan(spec=spec, work=work, batch_size=size, total_q=total_q, num_qo_heads=num_qo_heads,
                    num_kv_heads=num_kv_heads, head_dim=spec.head_dim_qk, page_size=spec.page_size, q_dtype=q_dtype,
                    kv_dtype=kv_dtype, o_dtype=o_dtype, max_page=batch.max_page, total_kv=batch.total_kv,
                    on_gpu=on_gpu, q_shape=torch.Size((total_q, num_qo_heads, spec.head_dim_qk)), binding=binding,
                    variant_sizes={"qo_head": num_qo_heads, "kv_head": num_kv_heads, "request": size,
                                   "request+1": size + 1, "qo_token": total_q}, sched=prep.sched,
                    layout=prep.layout, variant_slots=prep.variant_slots, extra=prep.extra, tma=prep.tma)
        plan.keep += binding.keep
        plan.settings = plan_settings(causal=spec.mask == "causal", opts=opts)
        plan.sm_scale_log2 = opts.sm_scale * _LOG2E   # run()'s scalar k_scale multiplies it (_running.kv_scales)
        values = self._plan_values(plan, prep)
        if graph is not None:   # nothing is written before these checks: a refused plan leaves the graph's intact
            check_launch(graph.plan_values, values, prep.layout.names, _METADATA)
            if work.merge_table is not None:
                self._check_merge_table(work.merge_table)
        if self._use_cuda_graph:
            plan.plan_values = values.copy()
            self._meta.check_fits(len(work.records), work.num_groups * num_kv_heads, page_ids is not None,
                                  batch.num_page_ids)
        # what of the caller's the kernel will read, off the workspace it writes: bound tensors, and device page ids
        # outside graph mode (read in place; graph mode copies them into its fixed buffer)
        in_place = page_ids is not None and page_ids.device.type != "cpu" and not self._use_cuda_graph
        check_apart_from(("float_workspace_buffer", self._ws_span),
                         plan_spans(binding.bound, byte_span(page_ids) if in_place else None), "plan()")
        staged = (plan, prep, values, page_ids, batch.num_page_ids)
        if self._hold_commit:   # the cascade: every level checked before any writes (_commit)
            self._staged = staged
            return
        self._commit(*staged)

    def _commit(self, plan: Plan, prep: _Prepared, values: list, page_ids: torch.Tensor | None, used: int) -> None:
        """What a checked plan writes: its metadata (graph mode: into the fixed buffers a replay reads), its
        parameter struct and merge table; then it is the wrapper's plan. Raises nothing a check could have said."""
        work = plan.work
        if plan.on_gpu:
            ptr = self._meta.upload(work.records, num_groups=work.num_groups, num_kv_heads=plan.num_kv_heads,
                                    page_ids=page_ids, used=used, keep=plan.keep)
        else:  # the parameter struct is still built (and checked) where there is no GPU: pointers stay 0
            ptr = _NO_POINTERS
        self._fill_launch(plan, prep, ptr, values)
        # what run() keeps out and lse apart from: the page ids where the kernel reads them (alive as long as the
        # plan: kept by it, or graph mode's fixed buffer, whole, since fast_plan() rewrites it)
        ids, span = ptr.get("kv_indices", 0), None
        if ids and self._use_cuda_graph:
            span = byte_span(self._meta.fixed_page_ids)
        elif ids and used:
            span = (ids, ids + 4 * used)
        plan.read_spans = plan_spans(plan.binding.bound, span)
        if work.merge_table is not None and plan.on_gpu:
            plan.merge_table = self._merge_table(work.merge_table)
        if self._use_cuda_graph and self._meta.batch is None:
            self._meta.batch = plan.batch_size
        self._plan = plan

    def _merge_table(self, table: np.ndarray) -> torch.Tensor:
        """A deferred plan's merge table on the device, copied asynchronously (the pinned source is torch's, freed
        only once the copy is done). Graph mode: always the same buffer (the captured merge reads its address)."""
        host = torch.from_numpy(table).pin_memory()
        buf = self._table_buf
        if buf is None or not self._use_cuda_graph:
            buf = torch.empty(table.shape, dtype=torch.int32, device=self._device)
            if self._use_cuda_graph:
                self._table_buf = buf
        buf.copy_(host, non_blocking=True)   # (graph mode: its shape checked before the plan wrote anything)
        return buf

    def _check_merge_table(self, table: np.ndarray) -> None:
        """Graph mode: the captured merge covers the first deferred plan's rows, no more and no fewer."""
        buf = self._table_buf
        if buf is not None and buf.shape != table.shape:
            raise ValueError(f"use_cuda_graph: this plan has {table.shape[0]} query rows but the graph was planned for "
                             f"{buf.shape[0]}")

    def _checked(self, args: dict[str, Any]) -> tuple:
        """P.plan_scalars(args), or its result for the last plan() when ``args`` has the same values, of the same
        types: an engine plans every step with the same heads, dtypes and options, and those were checked then. A
        failing check raises every time (nothing is kept). Refused while the stream captures a graph."""
        self._meta.refuse_capture(f"{type(self).__name__}.plan()")
        key = args_key(tuple(args.values()))
        memo = self._args_memo
        if key is not None and memo is not None and memo[0] == key:
            return memo[1]
        out = P.plan_scalars(args)
        if key is not None:
            self._args_memo = (key, out)
        return out

    def _graph_plan(self) -> Plan | None:
        """Graph mode: the last plan, whose spec and tile (the first plan's) every later plan keeps."""
        return self._plan if self._use_cuda_graph else None

    def _with_tile(self, spec: AttentionSpec) -> AttentionSpec:
        """The spec with the wrapper's forced tile, else the tuning record's for this GPU (attnjit tune), else as is."""
        out = self._tuned.get(spec)
        if out is None:
            out = spec
            if self._tile is not None:
                try:
                    out = spec.replace(tile=self._tile)
                except ValueError as exc:
                    raise ValueError(f"tile={self._tile!r}: {exc}") from None
            elif families.tile_names(spec):
                gpu = tuning.gpu_id(spec.arch, dispatch.num_sms(self._device if self._device.type == "cuda" else None))
                tuned = tuning.best_tile(spec, gpu)
                if tuned is not None:
                    out = spec.replace(tile=tuned)
            self._tuned[spec] = out
        return out

    def _check_graph_plan(self, spec: AttentionSpec, batch: P.Batch) -> None:
        """Graph mode: a plan must fit what the captured graph replays (kernel spec, batch size, the operands)."""
        graph = self._graph_plan()
        if graph is not None and spec is not graph.spec and spec != graph.spec:  # (fast_plan passes the same)
            raise ValueError(f"use_cuda_graph: plan() asks for {spec.short_name()} but this wrapper's graph "
                             f"was planned for {graph.spec.short_name()}; use one wrapper per kernel spec")
        self._meta.check_batch(batch.batch_size)
        self._replay.check_batch(batch.total_q, batch.total_kv, batch.max_page, spec.kv == "paged")

    def _kernel_for(self, spec: AttentionSpec, tile, sms: int | None) -> tuple[Any, int]:
        """(kernel or None, resident CTAs over all SMs) of one tile of the spec's module, memoized per wrapper
        (the module, its occupancy and the SM count do not change in a process). ``sms``: None on a GPU (the
        device's), else the SM count a CPU plan assumes (ATTNJIT_NUM_SMS), part of the key."""
        key = (spec, tile, sms)
        got = self._kernels.get(key)
        if got is None:
            if sms is not None:  # no GPU: the occupancy the tile's shared memory and min_blocks allow
                got = None, max(1, min(tile.min_blocks * 2, (227 * 1024) // max(tile.smem, 1))) * sms
            else:
                kernel = dispatch.module(spec, self._device).kernels[tile.kernel]
                got = kernel, max(1, kernel.occupancy()) * dispatch.num_sms(self._device)
            self._kernels[key] = got
        return got

    def _prepare(self, key: tuple, binding: Binding) -> _Prepared:
        """What a plan key fixes, made once per wrapper: the kernel and its slots, the scheduler's arguments, the
        Launch (one per kernel, re-aimed by each plan), and the parameter struct with every field that does not
        depend on the metadata; a plan of the key fills in only the device pointers and its variant values.
        key: (spec, tile, sms, H_q, H_kv, sm_scale, fixed_split_size, disable_split_kv, bound variant names)."""
        spec, tile, sms, hq, hkv, sm_scale, fixed_split_size, disable_split_kv, _ = key
        kernel, slots = self._kernel_for(spec, tile, sms)
        d = spec.head_dim_qk
        max_slots = self._workspace.numel() * self._workspace.element_size() // (hq * (d + 1) * 4)
        sched = dict(group=spec.group_size, tile=tile, causal=spec.mask == "causal", num_kv_heads=hkv, slots=slots,
                     max_slots=max_slots, allow_split=not disable_split_kv, fixed_chunk=fixed_split_size)
        launch = None
        if kernel is not None:
            launch = self._launches.get(kernel.ptr)
            if launch is None or launch.kernel is not kernel:
                launch = self._launches[kernel.ptr] = dispatch.Launch(self._op, kernel, (1, 1, 1))
        layout = attention_layout(spec.variant, spec.family)
        kinds = binding.kinds()
        ws = self._workspace.data_ptr() if kernel is not None else 0
        values = layout.values(
            q=0, k=0, v=0, o=0, lse=0, tmp_o=ws, tmp_lse=ws + max_slots * hq * d * 4, kv_indices=0, work=0,
            work_count=0, merge_counters=0, q_stride_n=0, q_stride_h=0, o_stride_n=0, o_stride_h=0, kv_stride_0=0,
            kv_stride_1=0, num_qo_heads=hq, num_kv_heads=hkv, sm_scale_log2=sm_scale * _LOG2E, scale_k=0, scale_v=0,
            scale_v_value=1.0, **{variant_param_name(n): 0 for n in kinds},  # bound ones: each plan's; the rest: each run()'s
            **{f.name: 0 if f.kind != "tmap" else bytes(128) for f in family_fields(spec.family)})
        if kernel is not None:
            assert kernel.layout.names == layout.names, "plan and kernel disagree on parameters"
        tma = copies_for(spec, tile, layout)
        persistent = getattr(families.get(spec.family), "PERSISTENT", False)
        return _Prepared(slots=slots, sched=sched, launch=launch, layout=layout, values=values,
                         persistent=persistent, count=self._use_cuda_graph or persistent,
                         bound_slots=[(n, layout.index[variant_param_name(n)], kinds[n]) for n in binding.bound],
                         variant_slots=[(n, layout.index[variant_param_name(n)], kinds[n]) for n in binding.required],
                         extra=self._decision_extra(), tma=tma, claims_slot=layout.index.get("work_claims"))

    def _plan_values(self, plan: Plan, prep: _Prepared) -> list:
        """The plan's parameter struct before its metadata pointers: the key's, with this plan's variant values."""
        vals = prep.values.copy()
        if prep.claims_slot is not None:   # sm90: CTAs claim items from work_count[1] (sm90/producer.cuh)
            vals[prep.claims_slot] = plan.claims = int(knobs.WORK_CLAIMS.get())
        if prep.bound_slots:
            binding = plan.binding
            for name, index, kind in prep.bound_slots:
                vals[index] = check_value(binding.variant, name, kind, binding.bound[name], device=self._device,
                                          sizes=plan.variant_sizes)
        return vals

    def _fill_launch(self, plan: Plan, prep: _Prepared, ptr: dict[str, int], vals: list) -> None:
        """The plan's parameter struct (``vals``, _plan_values, with the metadata pointers) and grid."""
        work = plan.work
        if self._use_cuda_graph:  # the kernel is the first plan's, so are its slots: the grid is fixed
            grid_x = max(prep.slots, 1)  # persistent CTAs walk whatever work list a later plan holds
        elif prep.persistent:  # one resident CTA per slot walks the list (work_count items)
            grid_x = min(work.num_items * plan.num_kv_heads, prep.slots)
        else:
            grid_x = work.num_items * plan.num_kv_heads
        launch = prep.launch
        if launch is not None:
            launch.grid, launch.decide = (grid_x, 1, 1), plan.decision
            plan.attn = launch
        vals[_KVI], vals[_WORK], vals[_MC] = ptr.get("kv_indices", 0), ptr["work"], ptr["merge_counters"]
        vals[_WC] = ptr["work_count"] if prep.count else 0  # 0: the grid is the list
        plan.attn_values = vals

    # --- run ----------------------------------------------------------------------------------------------

    def _current_plan(self, variant_params: dict[str, Any] | None, return_lse: Any, lse) -> Plan:
        """The plan run() executes, its variant parameters checked and put in the parameter struct."""
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{type(self).__name__}.run() called before plan()")
        if type(return_lse) is not bool:
            raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
        want_lse = return_lse or lse is not None
        if variant_params or plan.variant_slots or (want_lse and plan.binding.variant is not None):
            variant_args(plan, self._device, variant_params or {}, want_lse)
        return plan

    def _run_compiled(self, q, k, v, out, lse, return_lse: bool, variant_params: dict, k_scale=None, v_scale=None):
        """run() while torch.compile traces: the torch.ops.attnjit op that runs this wrapper's plan (ops/library.py).
        Reads nothing of the plan here, so a new plan() does not make torch.compile recompile. k_scale / v_scale
        travel as a float (specialized by torch.compile, like any Python float) or a tensor (read at run time)."""
        if variant_params:
            raise NotImplementedError(f"run-time variant parameters ({sorted(variant_params)}) are not supported "
                                      "inside torch.compile; bind the values at plan() (a built-in option) or run "
                                      "eagerly")
        ks, kt = split_scale(k_scale)
        vs, vt = split_scale(v_scale)
        if out is None:
            out, lse_ = torch.ops.attnjit.batch_run(self._handle, q, k, v, return_lse or lse is not None, ks, vs, kt, vt)
            if lse is not None:   # as check_q_out: the op's lse has the plan's shape; a copy would convert
                if lse.dtype != lse_.dtype or lse.shape != lse_.shape or lse.device != lse_.device:
                    raise ValueError(f"run(): lse must be {lse_.dtype} {list(lse_.shape)} on {lse_.device}, as "
                                     f"planned; got {lse.dtype} {list(lse.shape)} on {lse.device}")
                lse.copy_(lse_)
            else:
                lse = lse_
        else:
            if lse is None and return_lse:
                lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
            torch.ops.attnjit.batch_run_out(self._handle, q, k, v, out, lse, ks, vs, kt, vt)
        return guard(type(self), (out, lse) if return_lse else out, q, k, v, k_scale, v_scale)

    def _launch_run(self, plan: Plan, q, out, lse, return_lse: bool, k_scale, v_scale, k_ptr: int, v_ptr: int,
                    stride0: int, stride1: int, kv_rows: int = 0, paged: bool = False, kv_spans: tuple = (),
                    variant_params: dict | None = None):
        """run()'s common tail once the KV operand is checked: q/out/lse, the dequantization scales, the launch.
        kv_rows: the KV operand's pages (paged) or tokens (ragged), for its TMA descriptors; kv_spans: its
        ((name, byte_span), ...), which a caller's out and lse may not touch."""
        given = out is not None or lse is not None
        out, lse, qs, os_ = check_q_out(plan, self._device, q, out, lse, return_lse)
        ws = ("float_workspace_buffer", self._ws_span)
        read = (("q", byte_span(q)),) + kv_spans
        if variant_params or k_scale is not None or v_scale is not None:   # tensors among them
            read += tensor_spans(variant_params, k_scale, v_scale)
        if given:   # (run()'s own out and lse are new allocations; plan() kept read_spans off the workspace)
            check_written_apart(out, lse, read + plan.read_spans + (ws,))
        check_apart_from(ws, read)
        post = kv_scales(plan, self._device, k_scale, v_scale)
        if self._use_cuda_graph:  # every argument passed: what a replay reads and writes (fast_plan, re-plans)
            self._replay.note_run(self._meta.capturing(), q.shape[0], kv_rows, paged)
        self._require_gpu(plan)
        launch(plan, q, qs, k_ptr, v_ptr, stride0, stride1, out, os_, lse, kv_rows)
        if plan.merge_table is not None:  # a deferred plan: the kernel wrote partial states only; merged into the
            if lse is None:               # state (out, lse) holds (the cascade's other levels), v_scale with them
                raise ValueError("run() of a deferred-merge plan merges into out and lse: pass both")
            scale = 1.0 if post is None else post
            if self._hold_merge:
                self._held_scale = scale
            else:
                _merge_partials(plan, out, lse, scale)
        elif post is not None:
            out.mul_(post)
        return (out, lse) if return_lse else out

    def _run_partials(self, q, paged_kv_cache, out, lse, **kwargs):
        """run() of a deferred plan that launches its kernel (it writes partial states only, not out or lse) and
        returns the merge of those states into (out, lse), for the caller to call once (out, lse) holds the state
        of the other keys (the cascade's last level, run beside this one)."""
        self._hold_merge = True
        try:
            self.run(q, paged_kv_cache, out=out, lse=lse, **kwargs)
        finally:
            self._hold_merge = False
        scale, self._held_scale = self._held_scale, None
        if scale is None:
            raise RuntimeError("_run_partials needs a deferred-merge plan")
        plan = self._plan
        return lambda: _merge_partials(plan, out, lse, scale)

    def _require_gpu(self, plan: Plan) -> None:
        """After every argument check (so they show on a CPU-planned wrapper too): kernels need a GPU."""
        if not plan.on_gpu:
            raise NoGPUError(f"{type(self).__name__} was planned on {self._device}; kernels run on CUDA devices only "
                             "(plan() validates and schedules anywhere; run() needs a GPU workspace)")
