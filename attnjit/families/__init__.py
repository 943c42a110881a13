"""Kernel families: each a unit of one Python module (what it supports, its tile configurations, how plan() picks
one, its template and render context) plus its CUDA headers (``templates/include/attnjit/<family>/``), over the
shared headers in logical coordinates (work items, masks, variant hooks, loaders, split-KV merge).

A spec names its family (``AttentionSpec.family``: it changes the code); left unset it defaults from the arch:
``sm90`` on sm_90a where that family supports the spec, else ``fa2``. plan() may still run a batch on another
family's spec (``for_batch``): the sm90 family's wide tiles waste most of their rows on decode-like batches.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from . import fa2, sm90

if TYPE_CHECKING:
    from ..specs import AttentionSpec

FAMILIES: dict[str, ModuleType] = {"fa2": fa2, "sm90": sm90}
NAMES = tuple(FAMILIES)
OPS = ("prefill", "decode")   # the ops that have families


def get(name: str) -> ModuleType:
    return FAMILIES[name]


def default_family(spec: "AttentionSpec") -> str:
    """The family a spec with no family gets: sm90 on sm_90a where it supports the spec, else fa2."""
    if spec.arch == "sm_90a" and sm90.unsupported(spec) is None:
        return "sm90"
    return "fa2"


def unsupported(spec: "AttentionSpec") -> str | None:
    """Why ``spec.family`` cannot build ``spec`` (None: it can)."""
    return FAMILIES[spec.family].unsupported(spec)


def tiles_for(spec: "AttentionSpec") -> tuple:
    """The kernel instances (tiles) a spec's module holds (none for ops without a family)."""
    return FAMILIES[spec.family].tiles(spec) if spec.op in OPS else ()


# FlashInfer's wrapper argument ``backend`` names the family a wrapper runs on
BACKENDS = {"auto": None, "fa2": "fa2", "fa3": "sm90", "sm90": "sm90"}


def for_backend(backend: object) -> str | None:
    """The family a wrapper's ``backend`` asks for (None: each plan's default)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported: expected one of {', '.join(map(repr, BACKENDS))} "
                         "('fa3' runs attnjit's sm90 family)")
    return BACKENDS[backend]


def for_batch(spec: "AttentionSpec", *, forced: str | None, max_packed_rows: int, backend: str = "") -> str:
    """The family plan() runs a batch on: ``forced`` (the wrapper's ``backend``) where it supports the spec (decode
    runs on fa2 whatever the backend), else the spec's default, moved to fa2 where the default family does not want
    a batch this narrow (``prefers``)."""
    if forced is not None:
        reason = FAMILIES[forced].unsupported(spec)
        if reason is None:
            return forced
        if spec.op == "decode":
            return "fa2"
        raise ValueError(f"backend={backend or forced!r} cannot run this plan: {reason}")
    prefers = getattr(FAMILIES[spec.family], "prefers", None)
    if prefers is not None and not prefers(spec, max_packed_rows):
        return "fa2"
    return spec.family


def dispatchable(spec: "AttentionSpec") -> list[str]:
    """Every family plan() may run ``spec``'s batches on (the default first): what a catalog warms for it."""
    out = [spec.family]
    if getattr(FAMILIES[spec.family], "prefers", None) is not None and fa2.unsupported(spec) is None:
        out.append("fa2")  # batches the default family does not want (for_batch)
    return list(dict.fromkeys(out))


def tile_names(spec: "AttentionSpec") -> tuple[str, ...]:
    """The named tile configurations ``spec.tile`` may pick in its family."""
    fn = getattr(FAMILIES[spec.family], "tile_names", None)
    return fn(spec) if fn is not None else ()


def tunable_names(spec: "AttentionSpec") -> tuple[str, ...]:
    """The configurations ``attnjit tune`` searches: tile_names but for those the family has not measured yet."""
    untuned = getattr(FAMILIES[spec.family], "UNTUNED", frozenset())
    return tuple(n for n in tile_names(spec) if n not in untuned)
