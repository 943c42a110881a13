"""The fa2 kernel family: mma.sync m16n8k16 + cp.async (sm_80 and up), FlashAttention-2's shape.

What it supports (every attention spec), its tile configurations, how plan() picks one for a batch, and its template.
The CUDA is ``templates/include/attnjit/fa2/*.cuh`` over the shared headers (work items, loaders, split-KV merge).

Two tile shapes:
  * narrow (decode; prefill of a few packed rows): warps split the KV tile, one 16- or 32-row block per group;
  * wide (prefill): 4 warps split 64 or 128 q rows, each warp sweeps the whole KV tile.
Decode adds a deep-pipeline narrow tile for batches that cannot fill the GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .. import dtypes

if TYPE_CHECKING:
    from ..specs import AttentionSpec

NAME = "fa2"
TEMPLATE = "fa2/attention.cu.jinja"


def unsupported(spec: "AttentionSpec") -> str | None:
    """Why this family cannot build ``spec`` (None: it can). fa2 serves every attention spec on sm_80 and up."""
    return None


def pages_per_tile_of(cta_kv: int, page_size: int) -> int:
    """Page ids a KV tile (cta_kv tokens from a multiple of cta_kv) can touch: paged.cuh's pages_per_tile()."""
    if cta_kv % page_size == 0:
        return cta_kv // page_size
    if page_size % cta_kv == 0:
        return 1
    return (cta_kv - 1) // page_size + 2  # neither divides the other: the tile may start mid-page


@dataclass(frozen=True)
class Tile:
    """One fa2 kernel instance's tiling; mirrors ``AttentionTraits`` (the template static_asserts it)."""

    head_dim: int
    page_size: int  # 0 for ragged KV (no page ids to stage)
    warps_q: int
    warps_kv: int
    mma_q: int
    mma_kv: int
    stages: int
    min_blocks: int
    tag: str = ""   # tells apart two tiles of one shape in one module (e.g. "deep": a longer pipeline)
    kv_bytes: int = 2  # bytes per KV element as stored (1: fp8)
    # fp8: converted in registers on the way into the mma (fa2/fp8_frags.cuh); False where a key transform rewrites
    # K in shared memory, so the stages are converted into 16-bit K and V tiles first (fa2/traits.cuh FP8_IN_REGS)
    fp8_in_regs: bool = False

    @property
    def cta_q(self) -> int:
        return self.warps_q * self.mma_q * 16

    @property
    def cta_kv(self) -> int:
        return self.warps_kv * self.mma_kv * 16

    @property
    def threads(self) -> int:
        return 32 * self.warps_q * self.warps_kv

    @property
    def smem(self) -> int:
        d = self.head_dim
        # fp8: the ring holds the bytes as stored (rows of a multiple of 128 bytes swizzled, shorter ones padded by
        # 16 bytes), and, converted in shared memory, the 16-bit tile(s) they become (one where warps split the kv
        # tile and each converts its own rows of K, then of V; else K and V: fa2/traits.cuh KV_ROW_BYTES)
        fp8 = self.kv_bytes == 1
        dequant = (1 if self.warps_kv > 1 else 2) * self.cta_kv * d * 2 if fp8 and not self.fp8_in_regs else 0
        row = (d if d % 128 == 0 else d + 16) if fp8 else 2 * d
        pipe = 2 * self.stages * self.cta_kv * row + dequant
        merge = self.warps_kv * self.cta_q * (d + 1) * 4 if self.warps_kv > 1 else 0
        pages_per_tile = pages_per_tile_of(self.cta_kv, self.page_size) if self.page_size else 0
        page_smem = -(-2 * self.stages * pages_per_tile * 4 // 128) * 128
        qscale = -(-self.cta_q * 4 // 128) * 128 if fp8 and self.fp8_in_regs else 0  # rows' q scales (bf16 q)
        return self.cta_q * d * 2 + page_smem + qscale + max(pipe, merge)

    @property
    def name(self) -> str:
        base = f"q{self.cta_q}_kv{self.cta_kv}_w{self.warps_q}x{self.warps_kv}"
        return f"{base}_{self.tag}" if self.tag else base

    @property
    def kernel(self) -> str:
        return f"attnjit_attention_{self.name}"


@functools.lru_cache(maxsize=1024)  # a frozen Tile of three ints: plan() asks every step
def narrow_tile(head_dim: int, page_size: int, group_size: int) -> Tile:
    """Few packed rows (decode; prefill of 1-2 tokens): warps split the KV tile, one row block per group."""
    rows = -(-group_size // 16) * 16
    stages = {64: 4, 128: 3, 256: 2}[head_dim]
    min_blocks = 1 if head_dim == 256 else 2
    if rows <= 32:
        return Tile(head_dim, page_size, warps_q=1, warps_kv=4, mma_q=rows // 16, mma_kv=1, stages=stages,
                    min_blocks=min_blocks)
    return Tile(head_dim, page_size, warps_q=rows // 16, warps_kv=1, mma_q=1, mma_kv=4, stages=2,
                min_blocks=min_blocks)


@functools.lru_cache(maxsize=1024)  # a frozen Tile of three ints: plan() asks every step
def deep_decode_tile(head_dim: int, page_size: int, group_size: int) -> Tile | None:
    """The decode tile for batches too small to fill the GPU (split-KV): one stage more and one CTA per SM, so each
    SM keeps more KV bytes in flight with fewer CTAs (measured on the H200 at head_dim 128: 1x32768 2.97 -> 3.24
    TB/s, 16x4096 3.93 -> 4.09; the same tile loses on full batches, 64x4096 4.41 -> 4.26). None elsewhere."""
    narrow = narrow_tile(head_dim, page_size, group_size)
    if head_dim != 128 or narrow.warps_kv != 4:
        return None
    return replace(narrow, stages=narrow.stages + 1, min_blocks=1, tag="deep")


@functools.lru_cache(maxsize=1024)  # a frozen Tile of three ints: plan() asks every step
def wide_tile(head_dim: int, page_size: int) -> Tile:
    """Many packed rows (prefill): warps split the q rows, each warp sweeps the whole KV tile."""
    if head_dim == 256:
        return Tile(head_dim, page_size, warps_q=4, warps_kv=1, mma_q=1, mma_kv=2, stages=2, min_blocks=1)
    return Tile(head_dim, page_size, warps_q=4, warps_kv=1, mma_q=2, mma_kv=4, stages=2,
                min_blocks=2 if head_dim == 64 else 1)


@functools.lru_cache(maxsize=1024)  # a frozen Tile of three ints: plan() asks every step
def deep_fp8_decode_tile(head_dim: int, page_size: int, group_size: int) -> Tile | None:
    """The fp8 (converted in registers) decode tile for batches too small to fill the GPU: eight warps split a
    128-token tile, three stages before fp8_tile (five fp8 stages, ~165 KB), one CTA per SM. Measured on the H200
    (run 104, `fsweep`, TB/s of fp8 bytes, the narrow tile / this one): 1x32768 2.11 / 2.57, 16x4096 3.30 / 3.52,
    32x16384 4.25 / 4.34, and 64x4096 4.01 / 3.83 (a full batch: the narrow tile stays there). None where not
    measured: head_dim other than 128, or more than one row block (group size > 16)."""
    narrow = narrow_tile(head_dim, page_size, group_size)
    if head_dim != 128 or narrow.warps_kv != 4 or narrow.mma_q != 1:
        return None
    return Tile(head_dim, page_size, warps_q=1, warps_kv=8, mma_q=1, mma_kv=1, stages=3, min_blocks=1, tag="deep")


def fp8_tile(tile: Tile, kv_bytes: int, in_regs: bool = True) -> Tile:
    """The tile for a cache of ``kv_bytes`` per element. fp8 where warps split the kv tile (decode): twice the
    stages in flight (2S - 1 stages), so the same bytes are in flight as for 16-bit K/V (a memory-bound kernel needs
    bytes, not tiles, in flight), in about the same shared memory (half-size stages, plus one 16-bit tile where
    they are converted in shared memory). ``in_regs``: see ``Tile.fp8_in_regs``."""
    if kv_bytes == 2:
        return tile
    stages = 2 * tile.stages - 1 if tile.warps_kv > 1 else tile.stages
    return replace(tile, kv_bytes=kv_bytes, stages=stages, fp8_in_regs=in_regs)


@functools.lru_cache(maxsize=512)
def tiles(spec: "AttentionSpec") -> tuple[Tile, ...]:
    """Kernel instances a spec's module holds, narrowest first (memoized: plan() asks every step)."""
    page_size = spec.page_size or 0
    kv_bytes = dtypes.of(spec.dtype_kv).bytes
    in_regs = not (spec.variant and spec.variant.hook("key_transform"))
    narrow = fp8_tile(narrow_tile(spec.head_dim_qk, page_size, spec.group_size), kv_bytes, in_regs)
    if spec.op == "decode":
        # fp8 KV converted in registers: its own deep tile (eight warps, deep_fp8_decode_tile). Converted in shared
        # memory (a key transform) none: there the bf16 one's shape read fewer tokens/s than the bf16 kernel
        # (1x32768 605 vs 796 Mtok/s, before the fp8 stages were 128-byte aligned), and no fp8 one is measured
        if kv_bytes == 2:
            deep = deep_decode_tile(spec.head_dim_qk, page_size, spec.group_size)
        else:
            deep = deep_fp8_decode_tile(spec.head_dim_qk, page_size, spec.group_size) if in_regs else None
            deep = fp8_tile(deep, kv_bytes, in_regs) if deep else None
        return (narrow, deep) if deep else (narrow,)
    wide = fp8_tile(wide_tile(spec.head_dim_qk, page_size), kv_bytes, in_regs)
    return (narrow, wide) if narrow.cta_q < wide.cta_q else (wide,)


def choose_tile(spec: "AttentionSpec", *, qo_lens: Sequence[int], num_kv_heads: int, allow_split: bool,
                capacity: Callable[[Tile], int], kv_lens: Sequence[int] | None = None) -> Tile:
    """The tile plan() runs for a batch: the narrowest whose rows hold every request's packed rows (else the widest);
    for decode, the deep tile when the batch alone cannot fill the GPU (``capacity(tile)`` = resident CTAs over all
    SMs, the split-KV case). ``kv_lens`` (the families' common signature) does not enter fa2's choice."""
    all_tiles = tiles(spec)
    group = spec.group_size
    qo = np.asarray(qo_lens, dtype=np.int64)
    max_rows = int(qo.max(initial=0)) * group
    fitting = [t for t in all_tiles if max_rows <= t.cta_q] or [all_tiles[-1]]
    tile = fitting[0]
    if len(fitting) > 1 and fitting[1].tag == "deep" and allow_split:
        # every request's packed rows fit one tile (max_rows <= tile.cta_q): one item per request with rows
        items = int(np.count_nonzero(qo)) * num_kv_heads
        if items < capacity(tile):
            tile = fitting[1]
    return tile


def context(spec: "AttentionSpec") -> dict:
    """The template's render context beyond the spec's common constants."""
    return {"tiles": tiles(spec)}
