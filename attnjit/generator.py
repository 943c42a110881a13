"""spec -> CUDA source (+ kernel names and launch shapes). Deterministic: the same spec renders the same bytes.

The templates (``templates/*.cu.jinja``) bind the spec's constants and instantiate kernels; the CUDA itself lives in
ordinary headers (``templates/include/attnjit/**/*.cuh``: shared ones, and each kernel family's folder) that this
module inlines, with ``#line`` directives, so
the rendered source is self-contained: its bytes are everything the compiler sees besides the toolkit.
"""

from __future__ import annotations

import functools
import re
import struct as _struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from . import dtypes, families
from .specs import AttentionSpec
from .variants import TensorParam, Variant

TEMPLATE_DIR = Path(__file__).parent / "templates"
INCLUDE_DIR = TEMPLATE_DIR / "include"

_TEMPLATE = {"merge_state": "merge_state.cu.jinja", "append_kv": "append_kv.cu.jinja"}  # attention: the family's


# --- kernel parameter structs ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # ptr | i64 | f64: 8 bytes; tmap: a CUtensorMap (128 bytes, 64-byte aligned), passed as bytes
    doc: str

    @property
    def ctype(self) -> str:
        return {"ptr": "uint64_t", "i64": "int64_t", "f64": "double", "tmap": "attnjit::TensorMap"}[self.kind]

    @property
    def size(self) -> int:
        return 128 if self.kind == "tmap" else 8

    @property
    def align(self) -> int:
        return 64 if self.kind == "tmap" else 8


class ParamLayout:
    """The byte layout of one kernel's parameter struct (rendered into the template from the same fields): C's
    layout, each field at the next multiple of its alignment and the size a multiple of the largest (8-byte fields
    alone leave no padding)."""

    def __init__(self, fields: list[Param]):
        self.fields = tuple(fields)
        self.names = tuple(f.name for f in fields)
        self.index = {name: i for i, name in enumerate(self.names)}
        fmt, offset, offsets = "<", 0, []
        for f in fields:
            pad = -offset % f.align
            fmt += "x" * pad + {"ptr": "Q", "i64": "q", "f64": "d", "tmap": "128s"}[f.kind]
            offset += pad
            offsets.append(offset)
            offset += f.size
        align = max((f.align for f in fields), default=8)
        fmt += "x" * (-offset % align)
        self.offsets = tuple(offsets)
        self.align = align
        self.struct = _struct.Struct(fmt)
        self.size = self.struct.size

    def values(self, **kwargs: int | float | bytes) -> list[int | float | bytes]:
        missing = [n for n in self.names if n not in kwargs]
        extra = [n for n in kwargs if n not in self.index]
        if missing or extra:
            raise TypeError(f"kernel parameters: missing {missing}, unknown {extra}")
        return [kwargs[n] for n in self.names]


def _p(spec: str) -> list[Param]:
    out = []
    for line in spec.strip().splitlines():
        name, kind, doc = (s.strip() for s in line.split(":", 2))
        out.append(Param(name, kind, doc))
    return out


PARAMS: dict[str, ParamLayout] = {
    "attention": ParamLayout(_p("""
        q: ptr: [nnz_qo, H_q, D] queries
        k: ptr: keys: paged cache view or ragged [nnz_kv, H_kv, D]
        v: ptr: values, same strides as k
        o: ptr: [nnz_qo, H_q, D] output
        lse: ptr: [nnz_qo, H_q] f32 base-2 log-sum-exp, or 0
        tmp_o: ptr: [slots, H_q, D] f32 partial outputs of split requests
        tmp_lse: ptr: [slots, H_q] f32 partial lse of split requests
        kv_indices: ptr: [*] i32 page ids in logical order (paged)
        work: ptr: [W][12] i32 work records (see AttentionCTA::setup)
        work_count: ptr: [4] i32 number of work records (0: the grid is exactly records x heads), then zeros (sm90: claims)
        merge_counters: ptr: [groups][H_kv] i32 split-group tickets, zero between runs
        q_stride_n: i64: q token stride (elements)
        q_stride_h: i64: q head stride
        o_stride_n: i64: o token stride
        o_stride_h: i64: o head stride
        kv_stride_0: i64: paged: page stride; ragged: token stride
        kv_stride_1: i64: paged: slot stride (NHD) or head stride (HND); ragged: head stride
        num_qo_heads: i64: H_q
        num_kv_heads: i64: H_kv
        sm_scale_log2: f64: sm_scale * log2(e) (* the scalar k_scale)
        scale_k: ptr: [H_kv] f32 per-KV-head key scale, or 0 (fp8 KV; folded into the logit scale)
        scale_v: ptr: [H_kv] f32 per-KV-head value scale, or 0 (fp8 KV; applied to the output)
        scale_v_value: f64: scalar value scale (fp8 KV; 1 for none)
    """)),
    "merge_two": ParamLayout(_p("""
        v_a: ptr: [rows, H, D]
        lse_a: ptr: [rows, H] f32
        v_b: ptr: [rows, H, D]
        lse_b: ptr: [rows, H] f32
        v_out: ptr: [rows, H, D] (may be v_a)
        lse_out: ptr: [rows, H] f32 (may be lse_a)
        mask: ptr: [rows] bool, or 0 for all rows
        num_rows: i64: rows
        num_heads: i64: H
        v_a_stride_n: i64: element strides
        v_a_stride_h: i64: .
        v_b_stride_n: i64: .
        v_b_stride_h: i64: .
        v_out_stride_n: i64: .
        v_out_stride_h: i64: .
        lse_a_stride_n: i64: .
        lse_a_stride_h: i64: .
        lse_b_stride_n: i64: .
        lse_b_stride_h: i64: .
        lse_out_stride_n: i64: .
        lse_out_stride_h: i64: .
    """)),
    "merge_many": ParamLayout(_p("""
        v: ptr: [rows, num_states, H, D]
        lse: ptr: [rows, num_states, H] f32
        v_out: ptr: [rows, H, D]
        lse_out: ptr: [rows, H] f32
        num_rows: i64: rows
        num_states: i64: states per row
        num_heads: i64: H
        v_stride_n: i64: element strides
        v_stride_s: i64: .
        v_stride_h: i64: .
        lse_stride_n: i64: .
        lse_stride_s: i64: .
        lse_stride_h: i64: .
        v_out_stride_n: i64: .
        v_out_stride_h: i64: .
        lse_out_stride_n: i64: .
        lse_out_stride_h: i64: .
    """)),
    "merge_partials": ParamLayout(_p("""
        v: ptr: [rows, H, D] the state merged into, in place
        lse: ptr: [rows, H] f32, in place
        tmp_o: ptr: [slots, H, D] f32 partial states a deferred-merge plan wrote
        tmp_lse: ptr: [slots, H] f32
        table: ptr: [rows][3] i32 row's first slot, slot stride between its chunks, chunks
        num_rows: i64: rows
        num_heads: i64: H
        v_stride_n: i64: element strides
        v_stride_h: i64: .
        lse_stride_n: i64: .
        lse_stride_h: i64: .
        partial_scale: f64: the partials' o times this (run()'s float v_scale of a 16-bit plan; 1 for none)
    """)),
    "append": ParamLayout(_p("""
        k: ptr: [nnz, H_kv, D] new keys
        v: ptr: [nnz, H_kv, D] new values
        batch_indices: ptr: [nnz] i32 request of each token
        positions: ptr: [nnz] i32 position of each token in its request
        kv_indptr: ptr: [B+1] i32 page-table offsets
        kv_indices: ptr: [*] i32 page ids
        k_cache: ptr: key pages
        v_cache: ptr: value pages (same strides as k_cache)
        nnz: i64: tokens
        num_heads: i64: H_kv
        batch_size: i64: B
        num_pages: i64: pages in the cache
        num_indices: i64: entries of kv_indices (an entry past them is never read)
        k_stride_n: i64: element strides of k
        k_stride_h: i64: .
        v_stride_n: i64: element strides of v
        v_stride_h: i64: .
        cache_stride_page: i64: page stride of the cache views
        cache_stride_inner: i64: slot stride (NHD) or head stride (HND)
    """)),
}


def variant_param_name(name: str) -> str:
    """A variant parameter's field in the kernel's parameter struct."""
    return f"v_{name}"


@functools.lru_cache(maxsize=256)
def attention_layout(variant: Variant | None, family: str = "fa2") -> ParamLayout:
    """PARAMS["attention"], plus one 8-byte field per variant parameter (scalars widened to double/int64), plus the
    kernel family's own fields (its module's PARAM_FIELDS: sm90's TMA descriptors), last so that every other field
    keeps its place."""
    extra = []
    for part in variant.parts if variant is not None else ():
        for name, kind in part.params:
            k = "ptr" if isinstance(kind, TensorParam) else ("f64" if kind is float else "i64")
            extra.append(Param(variant_param_name(name), k, f"variant {part.name}: {name}"))
    own = family_fields(family)
    if not extra and not own:
        return PARAMS["attention"]
    return ParamLayout(list(PARAMS["attention"].fields) + extra + list(own))


@functools.lru_cache(maxsize=8)
def family_fields(family: str) -> tuple[Param, ...]:
    """A kernel family's own parameter fields (its module's PARAM_FIELDS text, in _p's format)."""
    text = getattr(families.get(family), "PARAM_FIELDS", "")
    return tuple(_p(text)) if text.strip() else ()


# --- rendering -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelInfo:
    name: str
    threads: int
    smem: int
    layout: ParamLayout  # the kernel's parameter struct
    tile: Any = None     # the family's tile (attention kernels)


@dataclass(frozen=True)
class Rendered:
    spec: AttentionSpec
    source: str
    kernels: dict[str, KernelInfo] = field(hash=False)
    template: str


_INCLUDE_RE = re.compile(r'^[ \t]*#include[ \t]+"(attnjit/[^"]+)"[ \t]*$', re.M)
SOURCE_NAME = "kernel.cu"  # the rendered source's file name, in the cache entry and in nvcc's messages


def _inline_includes(text: str, origin: str | None, seen: set[str]) -> str:
    """Replace ``#include "attnjit/x.cuh"`` by the header's text (once each, like #pragma once).

    ``#line`` directives keep nvcc's messages exact: header lines report as ``attnjit/x.cuh:N``; template code
    (origin None) reports as its own line of the rendered file, ``kernel.cu:N``, the file the cache keeps.
    """
    out: list[str] = []
    pos = 0
    for m in _INCLUDE_RE.finditer(text):
        out.append(text[pos:m.start()])
        name = m.group(1)
        if name not in seen:
            seen.add(name)
            header = (INCLUDE_DIR / name).read_text(encoding="utf-8")
            header = re.sub(r"^[ \t]*#pragma once[ \t]*$", "", header, flags=re.M)
            out.append(f'#line 1 "{name}"\n')
            body = _inline_includes(header, name, seen)
            out.append(body if body.endswith("\n") else body + "\n")
            if origin is None:  # back in the rendered file: the next line's number in the final output
                out.append(f'#line {"".join(out).count(chr(10)) + 2} "{SOURCE_NAME}"')
            else:
                out.append(f'#line {text.count(chr(10), 0, m.end()) + 2} "{origin}"')
        else:
            out.append(f"// {name}: already included")
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def _variant_context(variant: Variant) -> dict:
    """What _variant.jinja needs: each part's parameters (type, name, initializer) and hook snippets."""
    parts = []
    for part in variant.parts:
        params = []
        for name, kind in part.params:
            field_ = f"params.{variant_param_name(name)}"
            if isinstance(kind, TensorParam):
                params.append({"name": name, "ctype": kind.ctype,
                               "init": f"reinterpret_cast<{kind.ctype}>({field_})"})
            else:
                ctype = "float" if kind is float else "int"
                params.append({"name": name, "ctype": ctype, "init": f"static_cast<{ctype}>({field_})"})
        hooks = [{"name": h, "snippet": snippet} for h, snippet in part.hooks]
        parts.append({"name": part.name, "params": params, "hooks": hooks, "hook_names": [h for h, _ in part.hooks]})
    transforms = [p for p in variant.parts if p.hook("logits_transform")]
    # the part whose logits_scale the softmax applies: the chain's last transform, where it declares one
    scaled = transforms[-1].name if transforms and transforms[-1].hook("logits_scale") else None
    return {"parts": parts, "hooks": sorted({h for p in variant.parts for h, _ in p.hooks}),
            "use_softmax": variant.use_softmax, "mask_from_kv_start": variant.mask_from_kv_start,
            "scaled_transform": scaled, "scaled_first": scaled is not None and len(transforms) == 1}


def _context(spec: AttentionSpec) -> tuple[dict, dict[str, KernelInfo]]:
    cpp_bool = lambda b: "true" if b else "false"  # noqa: E731
    layout = attention_layout(spec.variant, spec.family) if spec.op in families.OPS else None
    params = {k: v.fields for k, v in PARAMS.items()}
    if layout is not None:
        params["attention"] = layout.fields
    ctx: dict = {"op": spec.op, "spec_json": spec.canonical(), "params": params,
                 "params_size": layout.size if layout is not None else 0,
                 "params_offsets": dict(zip(layout.names, layout.offsets)) if layout is not None else {}}
    kernels: dict[str, KernelInfo] = {}
    if spec.op in families.OPS:
        family = families.get(spec.family)
        ctx.update(ctype_q=dtypes.of(spec.dtype_q).ctype, ctype_o=dtypes.of(spec.dtype_o).ctype, ctype_kv=dtypes.of(spec.dtype_kv).ctype,
                   head_dim=spec.head_dim_qk,
                   group_size=spec.group_size, causal=cpp_bool(spec.mask == "causal"),
                   paged=cpp_bool(spec.kv == "paged"), page_size=spec.page_size or 1,
                   hnd=cpp_bool(spec.layout == "HND"), family=spec.family,
                   variant=_variant_context(spec.variant) if spec.variant is not None else None)
        ctx.update(family.context(spec))
        for t in ctx["tiles"]:
            kernels[t.kernel] = KernelInfo(t.kernel, t.threads, t.smem, layout, t)
    elif spec.op == "merge_state":
        ctx.update(ctype_o=dtypes.of(spec.dtype_o).ctype, head_dim=spec.head_dim_vo, block=128)
        kernels["attnjit_merge_state"] = KernelInfo("attnjit_merge_state", 128, 0, PARAMS["merge_two"])
        kernels["attnjit_merge_states"] = KernelInfo("attnjit_merge_states", 128, 0, PARAMS["merge_many"])
        kernels["attnjit_merge_partials"] = KernelInfo("attnjit_merge_partials", 128, 0, PARAMS["merge_partials"])
    elif spec.op == "append_kv":
        ctx.update(ctype_kv=dtypes.of(spec.dtype_kv).ctype, head_dim=spec.head_dim_qk, page_size=spec.page_size,
                   hnd=cpp_bool(spec.layout == "HND"), block=128)
        kernels["attnjit_append_kv"] = KernelInfo("attnjit_append_kv", 128, 0, PARAMS["append"])
    return ctx, kernels


def _return_lines(source: str) -> str:
    """`#line ATTNJIT_RETURN` (after a variant snippet) -> back to kernel.cu at the next line's real number."""
    if "#line ATTNJIT_RETURN" not in source:
        return source
    lines = source.split("\n")
    for i, line in enumerate(lines):
        if line == "#line ATTNJIT_RETURN":
            lines[i] = f'#line {i + 2} "{SOURCE_NAME}"'
    return "\n".join(lines)


@functools.lru_cache(maxsize=512)
def render(spec: AttentionSpec) -> Rendered:
    """The CUDA source of ``spec``'s module, with the kernels it defines."""
    template_name = families.get(spec.family).TEMPLATE if spec.op in families.OPS else _TEMPLATE[spec.op]
    ctx, kernels = _context(spec)
    text = _environment().get_template(template_name).render(**ctx)
    source = _return_lines(_inline_includes(text, None, set()))
    return Rendered(spec=spec, source=source, kernels=kernels, template=template_name)
