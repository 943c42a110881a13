"""The sm90 kernel family: wgmma + warp specialization (sm_90a), FlashAttention-3's shape, for prefill.

One producer warpgroup copies Q, K and V tiles (paged or ragged) into shared memory with the TMA unit where a
tile is whole boxes (``attnjit/tma.py``, ``sm90/tma.cuh``), else with cp.async, completing on mbarriers (a consumer
warpgroup's 64 output rows leave by one TMA store where they all belong to the request); two consumer warpgroups of 64 packed rows each run S = Q K^T and O += P V on wgmma with the softmax of one
tile under the other's GEMMs (``templates/include/attnjit/sm90/attention.cuh``). The grid is persistent. The tile
configuration ``q192kv64`` has three consumers (192-row items, 64-token K/V tiles; head_dim 64 and 128 over a
16-bit cache), taking turns at the tensor cores in a ring. ``kv160`` and ``kv176q1`` have wider K/V tiles; the
default module also holds ``kv176q1`` and plan() runs it for batches of long requests (``choose_tile``). An item's
last K/V tile whose visible keys fit in its first 64 columns (the causal diagonal of a short q tile, a short tail)
runs its softmax and P V over those columns only (``Sm90Traits::NARROW``, kv128 tiles). ``kv128c`` is kv128 with
consecutive items chained (``sm90/walk.cuh``): an item's last P V goes in one turn with the next item's first
S = Q K^T, and its epilogue runs beside the other consumer's GEMMs.

An fp8 cache (e4m3, e5m2) is copied as stored into the fp16 tiles it becomes and converted there by the producer
(``sm90/producer.cuh``); the wgmma then run in fp16, a bf16 q rescaled per row into fp16 by the consumers.

Decode stays on fa2 (memory-bound; its narrow tiles), and so do prefill batches whose requests have few packed rows
(``prefers``): a 128-row tile would compute mostly padding there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .. import dtypes

if TYPE_CHECKING:
    from ..specs import AttentionSpec

NAME = "sm90"
TEMPLATE = "sm90/attention.cu.jinja"
PERSISTENT = True   # one CTA per SM walks the work list (the grid is min(work, SMs))
# The family's own kernel parameters, after the shared ones (generator.attention_layout): how CTAs take work items
# (plan() sets it from ATTNJIT_WORK_CLAIMS), the TMA descriptors of q, k and v (attnjit/tma.py encodes them per
# run(); sm90/tma.cuh reads them) and which of them this run may use.
PARAM_FIELDS = """
    work_claims: i64: 1: CTAs claim work items from the counter at work_count[1]; 0: grid stride (sm90/producer.cuh)
    tma_flags: i64: TMA descriptors valid this run: 1 k and v, 2 q, 4 o (attnjit/tma.py)
    tma_q: tmap: q's CUtensorMap, box {64, GROUP, CTA_Q / GROUP}
    tma_k: tmap: k's CUtensorMap, box {64, TMA_ROWS tokens of one head}
    tma_v: tmap: v's CUtensorMap, same box as k
    tma_o: tmap: the output's CUtensorMap, box {64, GROUP, 64 / GROUP} (a consumer warpgroup's rows)
"""


def unsupported(spec: "AttentionSpec") -> str | None:
    """Why this family cannot build ``spec`` (None: it can)."""
    if spec.arch != "sm_90a":
        return f"the sm90 family needs arch sm_90a (wgmma, setmaxnreg), not {spec.arch}"
    if spec.op != "prefill":
        return "the sm90 family is for prefill; decode runs on fa2 (memory-bound, narrow tiles)"
    if spec.dtype_kv != spec.dtype_q and not _fp8(spec):
        return f"the sm90 family reads a {spec.dtype_q} or fp8 KV cache, not {spec.dtype_kv}"
    if _fp8(spec) and spec.variant is not None:
        # the key transform runs on the fp16 K tile (fa2 transforms in bf16). The one known to stay in fp16's
        # range is LLaMA RoPE over e4m3: a rotation (|k| grows by at most sqrt(2)) of values up to 448. A rotation
        # of e5m2's (57344) overflows, and a user transform may scale without bound.
        keyed = [part for part in spec.variant.parts if part.hook("key_transform")]
        if keyed and (spec.dtype_kv != "e4m3" or any(part is not _rope() for part in keyed)):
            what = "an e5m2 cache" if spec.dtype_kv == "e5m2" else "an fp8 cache, but for RoPE over e4m3"
            return f"the sm90 family's fp16 K tile cannot hold a key transform of {what} (fa2 can)"
    return None


def _rope():
    from ..variants import ROPE_LLAMA

    return ROPE_LLAMA


def _fp8(spec: "AttentionSpec") -> bool:
    return dtypes.of(spec.dtype_kv).is_fp8


@dataclass(frozen=True)
class Tile:
    """One sm90 kernel instance; mirrors ``Sm90Traits`` (the template static_asserts it)."""

    head_dim: int
    page_size: int   # 0 for ragged KV
    cta_kv: int      # kv tokens per tile (wgmma N of S = Q K^T)
    stages: int      # K and V tiles in flight, each in its own ring
    q_stages: int = 2  # Q tiles: 2 lets the producer load the next item's Q while the consumers finish this one
    consumers: int = 2
    min_blocks: int = 1
    tau: int = 0       # the running max moves only past max + tau (log2 units): fewer O rescales, P <= 2^tau
    q_to_half: bool = False  # bf16 q over fp8: the Q rows' fp16 scales (CTA_Q floats)
    chain: bool = False  # consecutive items chained (Sm90Traits::CHAIN, sm90/walk.cuh), where the kernel allows

    @property
    def cta_q(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def smem(self) -> int:
        q = self.cta_q * self.head_dim * 2
        kv = self.cta_kv * self.head_dim * 2
        barriers = 2 * self.q_stages + 4 * self.stages
        qinv = 4 * self.cta_q if self.q_to_half else 0
        pairs = 4 * (self.q_stages + 1)  # the work order's slots (sm90/producer.cuh)
        return self.q_stages * q + 2 * self.stages * kv + qinv + barriers * 8 + pairs + 1024

    @property
    def name(self) -> str:
        tau = f"_t{self.tau}" if self.tau else ""
        chain = "_c" if self.chain else ""
        return f"q{self.cta_q}_kv{self.cta_kv}_s{self.stages}q{self.q_stages}{tau}{chain}_ws"

    @property
    def kernel(self) -> str:
        return f"attnjit_sm90_{self.name}"


# Named tile configurations (``AttentionSpec.tile``, searched by ``attnjit tune``), the default first. At head_dim
# 256 the 64 KB Q tile leaves room for one Q stage and 64-token K/V tiles only.
CONFIGS: dict[str, dict[str, int]] = {
    "kv128": dict(cta_kv=128, stages=2, q_stages=2),    # 128 x 128 tiles; the next item's Q loads under this one
    "kv128q1": dict(cta_kv=128, stages=2, q_stages=1),  # one Q tile (the v1 kernel)
    "kv64s3": dict(cta_kv=64, stages=3, q_stages=2),    # smaller K/V tiles, one more in flight
    "kv128t8": dict(cta_kv=128, stages=2, q_stages=2, tau=8),  # O rescaled only when a row max grows past m + 8
    "kv128s3q1": dict(cta_kv=128, stages=3, q_stages=1),  # one more K/V tile in flight, for one Q tile
    # kv128 with consecutive items chained (sm90/walk.cuh walk_chained): an item's last P V issued in one turn with
    # the next item's S(0), its epilogue then, beside the other consumer's GEMMs (RESULTS.md, thirty-sixth session)
    "kv128c": dict(cta_kv=128, stages=2, q_stages=2, chain=True),
}
# Wider K/V tiles over a 16-bit cache, head_dim 64 or 128: an iteration's fixed costs (the O rescale, the row
# statistics, the turn and the K/V barriers) spread over more keys (FA3 takes 176 for non-causal head_dim 128); S and P
# need 3N/4 registers, so the consumers take 232 (sm90/traits.cuh), and 176 leaves room for one Q tile only.
CONFIGS_WIDE: dict[str, dict[str, int]] = {"kv160": dict(cta_kv=160, stages=2, q_stages=2),
                                           "kv176q1": dict(cta_kv=176, stages=2, q_stages=1)}
# Three consumers of 64 rows (192-row items) over 64-token K/V tiles, head_dim 64 or 128 over a 16-bit cache only
# (their 160 registers hold O, S and P of a 64 x 64 tile): the softmax of one beside the other two's GEMMs (RESULTS.md,
# runs 55-58: a softmax beside wgmma runs 1.6x longer than alone, longer than one other warpgroup's GEMMs).
CONFIGS_3: dict[str, dict[str, int]] = {"q192kv64": dict(cta_kv=64, stages=3, q_stages=2, consumers=3)}
# Configurations built and tested on the host only so far: a spec or a wrapper may name them (the GPU tests and the
# tsweep stage do), but attnjit tune does not search them until they have run on a GPU (RESULTS.md): kv128s3q1, and
# kv128c (the thirty-sixth session: no device machine started). q192kv64 ran in run 60 (its 11 tile-matrix cases
# passed; faster than kv128 on 1x8192 and the d64 row), kv160 and kv176q1 in run 78 (9 tile-matrix cases each
# passed; kv176q1 +4% on causal 1x8192, slower on short rows).
UNTUNED: frozenset[str] = frozenset({"kv128s3q1", "kv128c"})
CONFIGS_D256: dict[str, dict[str, int]] = {"kv64q1": dict(cta_kv=64, stages=2, q_stages=1)}


def _configs(spec: "AttentionSpec") -> dict[str, dict[str, int]]:
    if spec.head_dim_qk == 256:
        return CONFIGS_D256
    if spec.head_dim_qk <= 128 and not _fp8(spec):
        return {**CONFIGS, **CONFIGS_3, **CONFIGS_WIDE}
    return CONFIGS


def tile_names(spec: "AttentionSpec") -> tuple[str, ...]:
    return tuple(_configs(spec))


# The default configuration's module also holds LONG_TILE for batches of long requests, where it is faster (run 79:
# causal 1x8192 536 against 516 TFLOP/s, non-causal 1x8192 559 / 524, non-causal 8x2048 525 / 512) and which it
# loses at short ones (causal 8x2048 441 / 459, 32x512 262 / 318): plan() takes it when the batch's query rows see
# long_keys() keys or more on average. Only without a variant (the tile matrix of the GPU tests runs LONG_TILE on
# the variant-free cases) and over a ragged cache or pages of 16 (the benchmarked size; at page 1, 48 or 1024 its
# 40-register producer spills 130-176 B).
# At head_dim 64 an iteration's fixed costs weigh twice as much against its GEMMs, and the wide tile wins from
# about 1024 keys a row (run 79: causal d64 8x2048, 1024.5 keys a row, kv128 317 against kv176q1 334 TFLOP/s).
LONG_TILE = "kv176q1"
LONG_KEYS = 2048
LONG_KEYS_BY_HEAD_DIM = {64: 1024}


def long_keys(head_dim: int) -> int:
    """The mean keys a query row must see for plan() to take LONG_TILE."""
    return LONG_KEYS_BY_HEAD_DIM.get(head_dim, LONG_KEYS)


def _has_long_tile(spec: "AttentionSpec") -> bool:
    return (spec.tile is None and spec.variant is None and LONG_TILE in _configs(spec)
            and spec.page_size in (None, 0, 16))


@functools.lru_cache(maxsize=512)
def tiles(spec: "AttentionSpec") -> tuple[Tile, ...]:
    """The module's kernels: ``spec.tile``'s configuration, else the default (and LONG_TILE, _has_long_tile)."""
    configs = _configs(spec)
    names = [spec.tile] if spec.tile is not None else [next(iter(configs))]
    if _has_long_tile(spec):
        names.append(LONG_TILE)
    q_to_half = _fp8(spec) and spec.dtype_q == "bf16"
    return tuple(Tile(spec.head_dim_qk, spec.page_size or 0, **configs[n], q_to_half=q_to_half) for n in names)


def mean_keys(qo_lens: Sequence[int], kv_lens: Sequence[int], causal: bool) -> float:
    """Keys a query row of the batch sees on average (causal: a request's rows see kv - qo + 1 ... kv keys). Small
    batches in Python ints (plan() asks every step: ~1 us at batch 1 against ~9 through numpy)."""
    if len(qo_lens) <= 8:
        q = qo_lens.tolist() if isinstance(qo_lens, np.ndarray) else list(qo_lens)
        k = kv_lens.tolist() if isinstance(kv_lens, np.ndarray) else list(kv_lens)
        rows = sum(q)
        if rows <= 0:
            return 0.0
        if causal:
            return sum(a * max(b - (a - 1) / 2, 0.0) for a, b in zip(q, k)) / rows
        return sum(a * max(b, 0) for a, b in zip(q, k)) / rows
    qo = np.asarray(qo_lens, dtype=np.int64)
    rows = int(qo.sum())
    if rows <= 0:
        return 0.0
    keys = np.asarray(kv_lens, dtype=np.float64) - (qo - 1) / 2 if causal else np.asarray(kv_lens, dtype=np.float64)
    return float(np.dot(qo, np.maximum(keys, 0.0))) / rows


def choose_tile(spec: "AttentionSpec", *, qo_lens: Sequence[int], num_kv_heads: int, allow_split: bool,
                capacity: Callable[[Tile], int], kv_lens: Sequence[int] | None = None) -> Tile:
    """The module's default tile, or its LONG_TILE for a batch whose rows see long_keys() keys or more on average."""
    ts = tiles(spec)
    if len(ts) > 1 and kv_lens is not None and \
            mean_keys(qo_lens, kv_lens, spec.mask == "causal") >= long_keys(spec.head_dim_qk):
        return ts[1]
    return ts[0]


def prefers(spec: "AttentionSpec", max_packed_rows: int) -> bool:
    """Whether a batch whose longest request has this many packed rows (query tokens x group) should run here rather
    than on fa2: fa2's narrow tile (16 or 32 rows) serves decode-like batches without 128-row padding."""
    from . import fa2

    return max_packed_rows > fa2.narrow_tile(spec.head_dim_qk, spec.page_size or 0, spec.group_size).cta_q


def tma_boxes(spec: "AttentionSpec", tile: Tile) -> tuple[tuple[int, int] | None, int, tuple[int, int] | None]:
    """What ``tile``'s kernel copies by TMA (sm90/tma.cuh tma_q, tma_rows, tma_kv, tma_o; the template asserts they
    agree): the Q box's (GROUP, CTA_Q) or None, the rows of a K/V box or 0, and the output box's (GROUP, 64: a
    consumer warpgroup's rows) or None. Not over an fp8 cache (its tiles are converted in place after the copy)."""
    if _fp8(spec):
        return None, 0, None
    g, ps = spec.group_size, spec.page_size or 0
    q = (g, tile.cta_q) if tile.cta_q % g == 0 and g <= 256 and tile.cta_q // g <= 256 else None
    paged = spec.kv == "paged"
    rows = ps if paged and ps < tile.cta_kv else tile.cta_kv
    in_page = ps >= 16 and ps % 16 == 0 and (tile.cta_kv % ps == 0 or ps % tile.cta_kv == 0)
    kv = rows if rows % 8 == 0 and (not paged or in_page) else 0
    o = (g, 64) if q is not None and 64 % g == 0 and dtypes.of(spec.dtype_o).bytes == 2 else None
    return q, kv, o


def tma_v_gather(spec: "AttentionSpec", tile: Tile) -> bool:
    """Whether ``tile``'s kernel gathers V by cp.async where it copies K by TMA (sm90/tma.cuh tma_v_gather): a paged
    kernel whose K/V tile is several boxes (pages smaller than the tile) in the plain layout (interleaved tiles,
    kv_interleaved, take V by TMA too)."""
    rows = tma_boxes(spec, tile)[1]
    return spec.kv == "paged" and 0 < rows < tile.cta_kv and not kv_interleaved(spec, tile)


# Paged NHD K/V tiles of several pages of 16k tokens (whole TMA boxes, tma_boxes) can be interleaved
# (Sm90Traits::KV_INTERLEAVED, sm90/tma.cuh): one TMA box a page brings all of its column blocks (the 5-D map of
# tma.kv_args), where the plain layout takes a box a page and 64-column block; V comes by TMA too (tma_v_gather).
# The template asserts that this and the header (sm90/traits.cuh kKvInterleave) agree; benchmarks/sm90_timeline.py
# --what-if plain-kv turns both off for an A/B (run 147, RESULTS.md).
KV_INTERLEAVE = True


def kv_interleaved(spec: "AttentionSpec", tile: Tile, enabled: bool | None = None) -> bool:
    """Whether ``tile``'s kernel lays its K/V tiles out interleaved (Sm90Traits::KV_INTERLEAVED); ``enabled``
    overrides KV_INTERLEAVE (the what-if's host half)."""
    ps = spec.page_size or 0
    on = KV_INTERLEAVE if enabled is None else enabled
    return (on and spec.kv == "paged" and spec.layout != "HND" and not _fp8(spec)
            and spec.head_dim_qk >= 128 and ps % 16 == 0 and 0 < ps < tile.cta_kv and tile.cta_kv % ps == 0)


def context(spec: "AttentionSpec") -> dict:
    ts = tiles(spec)
    return {"tiles": ts, "tma": {t.name: tma_boxes(spec, t) for t in ts},
            "tma_v_gather": {t.name: tma_v_gather(spec, t) for t in ts},
            "kv_interleaved": {t.name: kv_interleaved(spec, t) for t in ts}}
