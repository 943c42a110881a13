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
