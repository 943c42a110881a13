"""AttentionSpec: the frozen, validated description of one kernel module, and the TOML spec catalogs.

A spec names everything that changes the generated code. It knows nothing about files or CUDA: the generator
turns it into source, the cache turns source into a binary.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
import tomllib
from dataclasses import InitVar, dataclass, fields
from pathlib import Path
from typing import Any, Iterable

from . import dtypes as _dt
from .errors import CatalogError
from .trust import replace_file
from .variants import Variant, resolve as resolve_variant

OPS = ("prefill", "decode", "merge_state", "append_kv")
HEAD_DIMS = (64, 128, 256)
DTYPES = _dt.COMPUTE           # q and o (attnjit/dtypes.py: the element-type table)
KV_DTYPES = _dt.COMPUTE + _dt.FP8  # the KV cache: q's type, or fp8 (e4m3/e5m2) with fp16/bf16 q
MASKS = ("none", "causal")
LAYOUTS = ("NHD", "HND")
KV_KINDS = ("paged", "ragged")
MAX_PAGE_SIZE = 1024  # any size from 1 (not only powers of two): page_size is a compile-time constant
MAX_GROUP_SIZE = 64
DEFAULT_ARCH = "sm_90a"
MAX_CATALOG_SPECS = 100_000   # a catalog that expands to more is refused (with its count) unless asked for
MAX_TEXT_BYTES = 64 << 20     # a catalog or dispatch log read from a path: more is refused, not read into memory

_ARCH_RE = re.compile(r"^sm_(\d{2,3})(a?)$")


def supported_arch(arch: str) -> bool:
    """sm_XY or sm_XYa with XY >= 80: the archs attnjit builds for (the one rule; callers strip their input)."""
    m = _ARCH_RE.match(arch)
    return m is not None and int(m.group(1)) >= 80


# Which fields each op uses. A field outside its op's set must be left unset: a spec never carries a value
# that does not change its kernel, so two specs that compile to the same code are equal.
_FIELDS_BY_OP = {
    "prefill": {"head_dim_qk", "head_dim_vo", "page_size", "dtype_q", "dtype_kv", "dtype_o", "mask", "layout",
                "kv", "group_size", "variant", "family", "tile"},
    "decode": {"head_dim_qk", "head_dim_vo", "page_size", "dtype_q", "dtype_kv", "dtype_o", "layout", "kv",
               "group_size", "variant", "family", "tile"},
    "merge_state": {"head_dim_vo", "dtype_o"},
    "append_kv": {"head_dim_qk", "head_dim_vo", "page_size", "dtype_kv", "layout"},
}


class SpecError(ValueError):
    """A spec field has a value no template supports. ``.field`` and ``.value`` name it."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"AttentionSpec.{field}={value!r} is not supported: {allowed}")


def _dtype_key(value: Any) -> Any:
    """The canonical name of a dtype alias, or the value itself (so validation reports it) when unknown."""
    t = _dt.lookup(value)
    return t.name if t is not None else value


def canonical_dtype(value: Any, field: str) -> str:
    allowed = KV_DTYPES if field == "dtype_kv" else DTYPES
    t = _dt.lookup(value)
    if t is None or t.name not in allowed:
        raise SpecError(field, value, f"expected one of {', '.join(allowed)}")
    return t.name


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """One kernel module to generate. Frozen and validated on construction.

    ``head_dim`` sets both ``head_dim_qk`` and ``head_dim_vo``; ``dtype`` sets ``dtype_q``, ``dtype_kv`` and
    ``dtype_o``. Fields an op does not use stay ``None``.
    """

    op: str
    head_dim_qk: int | None = None     # D of q and k
    head_dim_vo: int | None = None     # D of v and o
    page_size: int | None = None       # tokens per KV page (paged KV only)
    dtype_q: str | None = None
    dtype_kv: str | None = None
    dtype_o: str | None = None
    mask: str = "none"                 # none | causal (bottom-right aligned)
    layout: str | None = None          # NHD | HND page layout (paged KV only)
    kv: str | None = None              # paged | ragged (attention ops)
    group_size: int | None = None      # H_q / H_kv, fused into one CTA
    variant: Variant | None = None     # custom attention (attnjit.Variant, or its "module:attribute")
    family: str | None = None          # kernel family (attnjit.families): fa2 | sm90; default from the arch
    tile: str | None = None            # a named tile configuration of the family (attnjit tune); None: its default
    arch: str = DEFAULT_ARCH           # nvcc target, e.g. sm_90a
    head_dim: InitVar[int | None] = None
    dtype: InitVar[str | None] = None

    def __post_init__(self, head_dim: int | None, dtype: str | None) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        if self.op not in OPS:
            raise SpecError("op", self.op, f"expected one of {', '.join(OPS)}")
        used = _FIELDS_BY_OP[self.op]
        if isinstance(self.variant, str):
            if "@" in self.variant:
                raise SpecError("variant", self.variant, "this variant is not importable (it was not declared at "
                                "module level of an importable module); catalogs name variants as module:attribute")
            try:
                set_("variant", resolve_variant(self.variant))
            except ValueError as exc:
                raise SpecError("variant", self.variant, str(exc)) from None
        elif self.variant is not None and not isinstance(self.variant, Variant):
            raise SpecError("variant", self.variant, "expected an attnjit.Variant or its 'module:attribute'")
        if head_dim is not None:
            for name in ("head_dim_qk", "head_dim_vo"):
                if name in used:
                    if getattr(self, name) not in (None, head_dim):
                        raise SpecError(name, getattr(self, name), f"conflicts with head_dim={head_dim}")
                    set_(name, head_dim)
        if dtype is not None:
            for name in ("dtype_q", "dtype_kv", "dtype_o"):
                if name in used:
                    if getattr(self, name) is not None and _dtype_key(getattr(self, name)) != _dtype_key(dtype):
                        raise SpecError(name, getattr(self, name), f"conflicts with dtype={dtype!r}")
                    set_(name, dtype)
        # fill defaults for the op
        if self.op in ("prefill", "decode"):
            if self.kv is None:
                set_("kv", "paged")
            if self.group_size is None:
                set_("group_size", 1)
            if self.dtype_o is None and self.dtype_q is not None:
                set_("dtype_o", self.dtype_q)
        if ("layout" in used and self.layout is None and self.kv != "ragged"):
            set_("layout", "NHD")
        if self.op == "merge_state" and self.head_dim_vo is None and self.head_dim_qk is not None:
            raise SpecError("head_dim_qk", self.head_dim_qk, "merge_state uses head_dim (or head_dim_vo) only")
        # fields the op does not use must be unset
        for f in fields(self):
            if f.name in ("op", "arch") or f.name in used:
                continue
            value = getattr(self, f.name)
            if value is not None and not (f.name == "mask" and value == "none"):
                raise SpecError(f.name, value, f"op={self.op!r} does not use {f.name}; leave it unset")
        self._validate(used)

    def _validate(self, used: set[str]) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for name in ("head_dim_qk", "head_dim_vo"):
            if name in used:
                value = getattr(self, name)
                if value is None:
                    raise SpecError(name, None, f"op={self.op!r} needs it (or head_dim); allowed {HEAD_DIMS}")
                if type(value) is not int or value not in HEAD_DIMS:
                    raise SpecError(name, value, f"allowed head dims are {', '.join(map(str, HEAD_DIMS))}")
        if {"head_dim_qk", "head_dim_vo"} <= used and self.head_dim_qk != self.head_dim_vo:
            raise SpecError("head_dim_vo", self.head_dim_vo,
                            f"must equal head_dim_qk={self.head_dim_qk} (different q/k and v/o dims are not "
                            "supported yet)")
        for name in ("dtype_q", "dtype_kv", "dtype_o"):
            if name in used:
                value = getattr(self, name)
                if value is None:
                    raise SpecError(name, None, f"op={self.op!r} needs it (or dtype); allowed {', '.join(DTYPES)}")
                set_(name, canonical_dtype(value, name))
        if {"dtype_q", "dtype_kv"} <= used and self.dtype_q != self.dtype_kv and not _dt.is_fp8(self.dtype_kv):
            raise SpecError("dtype_kv", self.dtype_kv,
                            f"must equal dtype_q={self.dtype_q!r} or be an fp8 type ({', '.join(_dt.FP8)})")
        if "mask" in used and self.mask not in MASKS:
            raise SpecError("mask", self.mask, f"expected one of {', '.join(MASKS)}")
        if "kv" in used and self.kv not in KV_KINDS:
            raise SpecError("kv", self.kv, f"expected one of {', '.join(KV_KINDS)}")
        if self.op == "decode" and self.kv != "paged":
            raise SpecError("kv", self.kv, "decode reads a paged KV cache; use op='prefill' for ragged KV")
        paged = "page_size" in used and self.kv != "ragged"
        if paged:
            ps = self.page_size
            if type(ps) is not int or ps < 1 or ps > MAX_PAGE_SIZE:
                raise SpecError("page_size", ps, f"expected an integer from 1 to {MAX_PAGE_SIZE}")
            if self.layout not in LAYOUTS:
                raise SpecError("layout", self.layout, f"expected one of {', '.join(LAYOUTS)}")
        elif "page_size" in used:
            if self.page_size is not None:
                raise SpecError("page_size", self.page_size, "ragged KV has no pages; leave it unset")
            if self.layout not in (None, "NHD"):
                raise SpecError("layout", self.layout, "ragged KV is [nnz_kv, H_kv, D] (NHD); leave it unset")
            set_("layout", None)
        if "group_size" in used:
            g = self.group_size
            if type(g) is not int or not 1 <= g <= MAX_GROUP_SIZE:
                raise SpecError("group_size", g, f"expected an integer H_q/H_kv from 1 to {MAX_GROUP_SIZE}")
        if not supported_arch(str(self.arch)):
            raise SpecError("arch", self.arch, "expected sm_XY or sm_XYa with XY >= 80 (e.g. sm_90a, sm_80)")
        if "family" in used:
            from . import families  # families know nothing of specs at import time

            if self.family is None:
                set_("family", families.default_family(self))
            elif self.family not in families.NAMES:
                raise SpecError("family", self.family, f"expected one of {', '.join(families.NAMES)}")
            else:
                reason = families.unsupported(self)
                if reason is not None:
                    raise SpecError("family", self.family, reason)
            if self.tile is not None:
                names = families.tile_names(self)
                if self.tile not in names:
                    raise SpecError("tile", self.tile, f"the {self.family} family's tile configurations for this spec "
                                    f"are {', '.join(names) or 'none (it picks its tiles per batch)'}")
                if self.tile == names[0]:  # the default compiles to the same code as no tile: one spec for it
                    set_("tile", None)

    # --- canonical form ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Fields that are set, in declaration order (a variant by its module:attribute, or name@digest)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if getattr(self, f.name) is not None and not (f.name == "mask" and self.op not in ("prefill",))}
        if self.variant is not None:
            out["variant"] = self.variant.canonical()
        return out

    def canonical(self) -> str:
        """The one serialized form: compact JSON, fields in declaration order, unset fields omitted."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionSpec":
        allowed = {f.name for f in fields(cls)} | {"head_dim", "dtype"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise SpecError(unknown[0], data[unknown[0]], f"unknown field; known fields: {', '.join(sorted(allowed))}")
        return cls(**data)

    @classmethod
    def parse(cls, text: str) -> "AttentionSpec":
        """From canonical JSON or ``key=value,key=value`` (the CLI's ``--spec``)."""
        text = text.strip()
        if text.startswith("{"):
            return cls.from_dict(json.loads(text))
        data: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ValueError(f"spec item {part!r} is not key=value")
            k, v = (s.strip() for s in part.split("=", 1))
            data[k] = int(v) if re.fullmatch(r"-?\d+", v) else v
        return cls.from_dict(data)

    def as_flags(self) -> str:
        """``key=value,...`` form that ``parse`` and ``attnjit warm --spec`` accept."""
        return ",".join(f"{k}={v}" for k, v in self.to_dict().items())

    def short_name(self) -> str:
        """A readable label for logs and progress lines (not unique across arches of one op by itself)."""
        d = self.to_dict()
        parts = [self.op]
        if self.kv:
            parts.append(self.kv)
        if self.op == "prefill":
            parts.append(self.mask)
        hd = self.head_dim_qk or self.head_dim_vo
        parts.append(f"d{hd}")
        if self.page_size:
            parts.append(f"p{self.page_size}")
        if self.group_size:
            parts.append(f"g{self.group_size}")
        parts.append(d.get("dtype_q") or d.get("dtype_kv") or d.get("dtype_o"))
        if self.dtype_q and self.dtype_kv and self.dtype_kv != self.dtype_q:
            parts.append(f"kv{self.dtype_kv}")
        if self.dtype_o and self.dtype_q and self.dtype_o != self.dtype_q:
            parts.append(f"o{self.dtype_o}")
        if self.layout:
            parts.append(self.layout)
        if self.variant is not None:
            parts.append(f"v{self.variant.name}")
        if self.family:
            parts.append(self.family)
        if self.tile:
            parts.append(f"t{self.tile}")
        parts.append(self.arch)
        return "-".join(str(p) for p in parts)

    def replace(self, **changes: Any) -> "AttentionSpec":
        """A spec with some fields changed. A defaulted family is defaulted again (the change may move it)."""
        data = self.to_dict()
        if "family" in changes and "tile" not in changes:
            data.pop("tile", None)  # tile configurations belong to a family
        if "family" not in changes and self.family is not None:
            from . import families

            if self.family == families.default_family(self):
                del data["family"]
        data.update(changes)
        return AttentionSpec.from_dict({k: v for k, v in data.items() if v is not None})


# --- catalogs ------------------------------------------------------------------------------------------

def expand_table(table: dict[str, Any]) -> list[dict[str, Any]]:
    """A list value expands as a cartesian product, in key order."""
    keys = list(table)
    choices = [v if isinstance(v, list) else [v] for v in table.values()]
    return [dict(zip(keys, combo)) for combo in itertools.product(*choices)]


def table_size(table: dict[str, Any]) -> int:
    """How many specs ``expand_table`` would give, computed without expanding."""
    return math.prod(len(v) if isinstance(v, list) else 1 for v in table.values())


def _product_text(table: dict[str, Any]) -> str:
    lists = [(k, len(v)) for k, v in table.items() if isinstance(v, list) and len(v) > 1]
    return " x ".join(f"{n} {k}" for k, n in lists) or "no lists"


def read_bounded(path: Path) -> bytes:
    """The bytes of a file the user named (a pipe or process substitution too: read to its end), at most
    MAX_TEXT_BYTES: an endless source (/dev/zero) or a huge file is an OSError saying so, not the process's memory."""
    max_bytes = MAX_TEXT_BYTES
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise OSError(f"more than {max_bytes} bytes (a catalog or dispatch log is far smaller)")
    return raw


def load_catalog(path: str | Path, *, arch: str | None = None,
                 max_specs: int = MAX_CATALOG_SPECS) -> list[AttentionSpec]:
    """Read a TOML catalog (``[[spec]]`` tables) into specs, de-duplicated, in file order.

    ``arch`` fills in tables that name none. A table that names no ``family`` gives each attention spec once per
    family plan() may run it on (``families.dispatchable``). Errors name the file, the table and the field. A
    catalog whose tables expand to more than ``max_specs`` specs (before families) is refused before anything is
    expanded (the message gives the count). Linear in the number of specs.
    """
    path = Path(path)
    try:
        raw = read_bounded(path)
    except OSError as exc:
        raise CatalogError(path, None, None, f"cannot read: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CatalogError(path, None, None, f"not valid TOML: {exc}") from None
    extra = sorted(set(doc) - {"spec"})
    if extra:
        raise CatalogError(path, None, extra[0], "unknown top-level key; a catalog holds [[spec]] tables only")
    tables = doc.get("spec")
    if not isinstance(tables, list) or not tables:
        raise CatalogError(path, None, None, "no [[spec]] tables found")
    allowed = {f.name for f in fields(AttentionSpec)} | {"head_dim", "dtype"}
    for t, table in enumerate(tables):
        if not isinstance(table, dict):
            raise CatalogError(path, t, None, f"expected a [[spec]] table, got {table!r}")
        for key, value in table.items():
            if key not in allowed:
                raise CatalogError(path, t, key, f"unknown field; known fields: {', '.join(sorted(allowed))}")
            if isinstance(value, list) and not value:
                raise CatalogError(path, t, key, "an empty list expands to no specs")
            if isinstance(value, (dict,)) or (isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)):
                raise CatalogError(path, t, key, "expected a scalar or a list of scalars")
        if "op" not in table:
            raise CatalogError(path, t, "op", f"missing; expected one of {', '.join(OPS)}")
    sizes = [table_size(t) for t in tables]
    if sum(sizes) > max_specs:
        t = max(range(len(tables)), key=sizes.__getitem__)
        raise CatalogError(path, None, None,
                           f"expands to {sum(sizes):,} specs, more than the {max_specs:,} a catalog may hold (the "
                           f"largest, [[spec]] table #{t + 1}, is {_product_text(tables[t])} = {sizes[t]:,}); narrow "
                           "its lists or split the catalog, or pass --max-specs N if you mean it")
    specs: dict[AttentionSpec, None] = {}  # ordered and de-duplicated in O(1) per spec
    for t, table in enumerate(tables):
        for combo in expand_table(table):
            if arch is not None and "arch" not in combo:
                combo["arch"] = arch
            try:
                spec = AttentionSpec.from_dict(combo)
            except SpecError as exc:
                raise CatalogError(path, t, exc.field, f"{exc.value!r} is not supported: {exc.allowed}") from None
            except TypeError as exc:
                raise CatalogError(path, t, None, str(exc)) from None
            # a table that names no family warms every family plan() may dispatch the spec on (on sm_90a a prefill
            # spec runs on sm90, and on fa2 for decode-like batches)
            siblings = [spec] if "family" in table or spec.family is None else [
                spec if f == spec.family else spec.replace(family=f) for f in _dispatch_families(spec)]
            for s in siblings:
                specs.setdefault(s)
    return list(specs)


def _dispatch_families(spec: AttentionSpec) -> list[str]:
    from . import families

    return families.dispatchable(spec)


def dump_catalog(specs: Iterable[AttentionSpec | dict[str, Any]], header: str = "") -> str:
    """Write specs (or their ``to_dict`` forms) as a catalog that ``load_catalog`` reads back to the same specs (one
    table per spec)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for spec in specs:
        lines.append("")
        lines.append("[[spec]]")
        for k, v in (spec if isinstance(spec, dict) else spec.to_dict()).items():
            lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines).lstrip("\n") + "\n"


_FIELD_ORDER = [f.name for f in fields(AttentionSpec)]
# a variant as catalogs name it: module:attribute, several joined by "+"
_VARIANT_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*(\+[A-Za-z_][\w.]*:[A-Za-z_]\w*)*")


def _with_logged_variant(d: dict[str, Any], variant: Any, *, family_given: bool) -> dict[str, Any]:
    """A checked spec's ``to_dict`` with a logged variant put back as text, in its declaration place (as to_dict
    puts it); checked by form and by the op's fields only (nothing is imported)."""
    if not (isinstance(variant, str) and _VARIANT_REF.fullmatch(variant)):
        raise SpecError("variant", variant, "a logged variant is named as module:attribute (joined by +)")
    if "variant" not in _FIELDS_BY_OP[d["op"]]:
        raise SpecError("variant", variant, f"op={d['op']!r} does not use variant")
    if not family_given:
        d.pop("family", None)   # the default family may depend on the variant: warm derives it
    return {k: variant if k == "variant" else d[k] for k in _FIELD_ORDER if k in d or k == "variant"}


def specs_from_log(path: Path) -> list[dict[str, Any]]:
    """The distinct specs of a dispatch log (ATTNJIT_LOG's JSONL), in first-dispatch order, as ``to_dict`` forms for
    ``dump_catalog``. Every field is checked as a spec's, but a variant stays its ``module:attribute`` text, checked
    by form only: turning a log into a catalog imports nothing (a log is data; ``warm`` of the catalog imports the
    variant's module, as it must to render it). A line that is no dispatch record is a ValueError naming the file and
    line; an unreadable file an OSError, as ``read_bounded``."""
    try:
        lines = read_bounded(path).decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    specs: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(json.loads(line)["spec"])
            if not isinstance(data, dict):
                raise TypeError(f"the spec is a {type(data).__name__}, not an object")
            variant = data.pop("variant", None)
            d = AttentionSpec.from_dict(data).to_dict()
            if variant is not None:
                d = _with_logged_variant(d, variant, family_given="family" in data)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise ValueError(f"{path}:{n}: not a dispatch record: {why}") from None
        if d not in specs:
            specs.append(d)
    return specs


def write_catalog(path: Path, text: str) -> None:
    """A catalog's text into ``path``, whole or not at all: written beside it under a temporary name and renamed into
    place, so a killed or failed write leaves the old catalog (or none). ``path`` may be a regular file (replaced) or
    absent; anything else (a FIFO, which would block, a symlink, a directory) is a ValueError naming it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} exists and is not a regular file; a catalog is written only as one")
    replace_file(path, text, 0o644)
