"""The sm90 kernel family: wgmma + warp specialization (sm_90a), FlashAttention-3's shape. Not built yet: every
spec falls back to fa2 (``unsupported`` says why)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..specs import AttentionSpec

NAME = "sm90"
TEMPLATE = "sm90/attention.cu.jinja"


def unsupported(spec: "AttentionSpec") -> str | None:
    return "the sm90 family has no kernels yet"


def tiles(spec: "AttentionSpec") -> tuple:
    return ()


def context(spec: "AttentionSpec") -> dict:
    return {"tiles": tiles(spec)}
