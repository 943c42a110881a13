"""The GPU correctness matrix (DESIGN.md, the seed's list): each case is one batch run against the float64
reference. ``all_specs()`` is what the cases compile; ``specs/gpu-tests.toml`` must list exactly those (a CPU test
checks it) so scripts/gpu_check.sh can build them all in parallel before the tests run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnjit import dtypes
from attnjit.specs import AttentionSpec

# The kernel families of the matrix, and the wrapper backend that runs each (FlashInfer's names)
FAMILIES = ("fa2", "sm90")
BACKEND = {"fa2": "fa2", "sm90": "fa3"}

SEED_QO, SEED_KV = (3, 1, 4), (6, 2, 9)                       # the seed's three requests
MIXED_QO = (17, 1, 0, 64, 1, 33, 2, 1, 0)                     # chunked prefill + decode rows + empty requests
MIXED_KV = (40, 1, 5, 64, 300, 1000, 2, 129, 0)
LONG_QO, LONG_KV = (100, 1), (3000, 5000)                     # few tiles: the scheduler splits
PREFILL_QO, PREFILL_KV = (200, 129), (200, 700)
DEC_SHORT = (1, 2, 15, 16, 17, 33, 100)                       # KV length 1, non-full last pages
DEC_MED = (1000, 517, 2048, 4096)
DEC_LONG = (131072,)                                          # 128K history
DEC_MANY = tuple(1 + (i * 37) % 600 for i in range(300))      # fills the GPU: no split


def families_for(kind: str) -> tuple[str, ...]:
    """Prefill (16-bit or fp8 cache) runs on both families; decode on fa2 (sm90 declines it)."""
    return ("fa2",) if kind == "decode" else FAMILIES


@dataclass(frozen=True)
class Case:
    name: str
    kind: str                   # paged | ragged | decode
    qo_lens: tuple = ()
    kv_lens: tuple = ()
    dtype: torch.dtype = torch.bfloat16
    head_dim: int = 128
    page_size: int = 16
    heads: tuple = (32, 8)      # (H_q, H_kv)
    causal: bool = True
    layout: str = "NHD"
    split: str = "auto"         # auto | force (fixed_split_size=128) | off (disable_split_kv)
    shared_prefix: bool = False
    offset: float = 0.0         # added to every logit (large-logit stability)
    ramp: float = 0.0           # ragged: key j scaled by 1 + ramp * j (the running max moves tile after tile)
    kv: str | None = None       # an fp8 cache (e4m3 | e5m2) under q's type; None: the cache has q's type
    scale: str = "float"        # fp8: k_scale/v_scale as floats, or "tensor" (float32 [H_kv] per-head scales)

    @property
    def id(self) -> str:
        return self.name

    @property
    def families(self) -> tuple[str, ...]:
        """The kernel families this case runs on (its axis in the matrix): prefill on both, decode on fa2."""
        return families_for(self.kind)

    def spec(self, family: str = "fa2") -> AttentionSpec:
        dt = dtypes.lookup(self.dtype).name
        dts = dict(dtype_q=dt, dtype_kv=self.kv or dt)
        group = self.heads[0] // self.heads[1]
        if self.kind == "decode":
            return AttentionSpec(op="decode", head_dim=self.head_dim, page_size=self.page_size, **dts,
                                 layout=self.layout, group_size=group, family=family)
        if self.kind == "ragged":
            return AttentionSpec(op="prefill", head_dim=self.head_dim, **dts, kv="ragged", group_size=group,
                                 mask="causal" if self.causal else "none", family=family)
        return AttentionSpec(op="prefill", head_dim=self.head_dim, page_size=self.page_size, **dts,
                             layout=self.layout, group_size=group, mask="causal" if self.causal else "none",
                             family=family)


_P = Case("base", "paged", MIXED_QO, MIXED_KV)
_R = Case("ragged", "ragged", MIXED_QO, MIXED_KV)
_D = Case("decode", "decode", kv_lens=DEC_SHORT, causal=False)
F16 = torch.float16

# rows that see >= 2048 keys on average: the sm90 default module runs its long-batch tile (sm90.LONG_TILE) on them
HISTORY_QO, HISTORY_KV = (300, 64), (4096, 2500)
PAGED = [
    replace(_P, name="paged-seed-fp16-p4", qo_lens=SEED_QO, kv_lens=SEED_KV, dtype=F16, page_size=4),
    replace(_P, name="paged-long-history", qo_lens=HISTORY_QO, kv_lens=HISTORY_KV, heads=(8, 2)),
    # head_dim 64 takes the long tile from 1024 keys a row (sm90.long_keys); rows here see ~1800 on average
    replace(_P, name="paged-d64-long-history", head_dim=64, qo_lens=(300, 64), kv_lens=(2048, 1500), heads=(8, 2)),
    _P,
    replace(_P, name="paged-noncausal", causal=False),
    replace(_P, name="paged-fp16", dtype=F16),
    replace(_P, name="paged-d64", head_dim=64),
    replace(_P, name="paged-d256", head_dim=256),
    replace(_P, name="paged-d256-fp16-noncausal", head_dim=256, dtype=F16, causal=False),
    replace(_P, name="paged-p1", page_size=1),
    replace(_P, name="paged-p8-fp16", page_size=8, dtype=F16),
    # pages of 2-8 tokens: the sm90 gather from per-thread bases (kv_load.cuh gather_page_base) at other slots, in
    # HND, split, and head_dim 64 (head_dim 256 keeps the offsets)
    replace(_P, name="paged-p2-hnd", page_size=2, layout="HND"),
    replace(_P, name="paged-p4", page_size=4),
    replace(_P, name="paged-p2-split-forced", page_size=2, split="force"),
    replace(_P, name="paged-d64-p8-hnd", head_dim=64, page_size=8, layout="HND"),
    replace(_P, name="paged-d256-p4-fp16", head_dim=256, page_size=4, dtype=F16),
    replace(_P, name="paged-p32-noncausal", page_size=32, causal=False),
    # pages larger than the KV tile (64 tokens; 32 at head_dim 256): a tile starts mid-page, and forced splits
    # start chunks mid-page too
    replace(_P, name="paged-p128-split-forced", page_size=128, split="force"),
    replace(_P, name="paged-d256-p64-hnd-fp16", head_dim=256, page_size=64, layout="HND", dtype=F16),
    replace(_P, name="paged-mha-g1", heads=(8, 8)),
    replace(_P, name="paged-g8", heads=(64, 8)),
    replace(_P, name="paged-g7-fp16", heads=(28, 4), dtype=F16),
    replace(_P, name="paged-hnd", layout="HND"),
    replace(_P, name="paged-hnd-p1-fp16-noncausal", layout="HND", page_size=1, dtype=F16, causal=False),
    replace(_P, name="paged-split-forced", split="force"),
    replace(_P, name="paged-split-forced-noncausal", split="force", causal=False),
    replace(_P, name="paged-long-autosplit", qo_lens=LONG_QO, kv_lens=LONG_KV),
    replace(_P, name="paged-long-nosplit", qo_lens=LONG_QO, kv_lens=LONG_KV, split="off"),
    replace(_P, name="paged-prefill-only", qo_lens=PREFILL_QO, kv_lens=PREFILL_KV),
    replace(_P, name="paged-shared-prefix", shared_prefix=True),
    replace(_P, name="paged-logits+1000", offset=1000.0),
    replace(_P, name="paged-logits-1000-fp16", offset=-1000.0, dtype=F16),
    # any page size (issue 14): tiles of 64 (fa2) or 128 (sm90) tokens against pages that do not nest with them
    # start mid-page and span two or three pages; 1024 holds a whole request
    replace(_P, name="paged-p3", page_size=3),
    replace(_P, name="paged-p5-fp16-noncausal", page_size=5, dtype=F16, causal=False),
    replace(_P, name="paged-p48", page_size=48),
    replace(_P, name="paged-p48-hnd-split-forced", page_size=48, layout="HND", split="force"),
    replace(_P, name="paged-p528-split-forced", page_size=528, split="force"),
    replace(_P, name="paged-d256-p528-fp16", head_dim=256, page_size=528, dtype=F16),
    replace(_P, name="paged-p1024", page_size=1024),
]
_RAMP = replace(_R, name="ragged-rising-logits", ramp=1 / 25)  # the running max moves by more than 8 tile after tile
RAGGED = [
    replace(_R, name="ragged-long-history-noncausal-fp16", qo_lens=(200,), kv_lens=(3000,), causal=False,
            dtype=F16, heads=(8, 2)),
    _R,
    _RAMP,
    replace(_R, name="ragged-fp16-noncausal", dtype=F16, causal=False),
    replace(_R, name="ragged-d64", head_dim=64),
    replace(_R, name="ragged-d256-fp16", head_dim=256, dtype=F16),
    replace(_R, name="ragged-mha-g1", heads=(16, 16)),
    replace(_R, name="ragged-split-forced", split="force"),
    replace(_R, name="ragged-long-autosplit", qo_lens=LONG_QO, kv_lens=LONG_KV),
    replace(_R, name="ragged-logits+1000", offset=1000.0),
]
DECODE = [
    _D,
    replace(_D, name="decode-med-autosplit", kv_lens=DEC_MED),
    replace(_D, name="decode-med-split-forced", kv_lens=DEC_MED, split="force"),
    replace(_D, name="decode-med-nosplit", kv_lens=DEC_MED, split="off"),
    replace(_D, name="decode-128k", kv_lens=DEC_LONG),
    replace(_D, name="decode-many", kv_lens=DEC_MANY),
    replace(_D, name="decode-fp16", dtype=F16, kv_lens=DEC_MED),
    replace(_D, name="decode-d64", head_dim=64, kv_lens=DEC_MED),
    replace(_D, name="decode-d256", head_dim=256, kv_lens=DEC_MED),
    replace(_D, name="decode-d256-fp16", head_dim=256, dtype=F16),
    replace(_D, name="decode-p1", page_size=1, kv_lens=DEC_MED),
    replace(_D, name="decode-p8-fp16", page_size=8, dtype=F16),
    replace(_D, name="decode-p32", page_size=32, kv_lens=DEC_MED),
    replace(_D, name="decode-p128-split-forced", page_size=128, kv_lens=DEC_MED, split="force"),
    replace(_D, name="decode-mha-g1", heads=(8, 8), kv_lens=DEC_MED),
    replace(_D, name="decode-g8", heads=(64, 8), kv_lens=DEC_MED),
    replace(_D, name="decode-g7-fp16", heads=(28, 4), dtype=F16),
    replace(_D, name="decode-g32-mqa", heads=(32, 1), kv_lens=DEC_MED),
    replace(_D, name="decode-hnd", layout="HND", kv_lens=DEC_MED),
    replace(_D, name="decode-hnd-fp16-p1", layout="HND", dtype=F16, page_size=1),
    replace(_D, name="decode-shared-prefix", kv_lens=DEC_MED, shared_prefix=True),
    replace(_D, name="decode-logits+1000", offset=1000.0, kv_lens=DEC_MED),
    replace(_D, name="decode-logits-1000-fp16", offset=-1000.0, dtype=F16, kv_lens=DEC_MED, split="force"),
    replace(_D, name="decode-p3", page_size=3, kv_lens=DEC_MED),
    replace(_D, name="decode-p5-fp16", page_size=5, dtype=F16),
    replace(_D, name="decode-p48", page_size=48, kv_lens=DEC_MED),
    replace(_D, name="decode-p48-hnd-split-forced", page_size=48, layout="HND", kv_lens=DEC_MED, split="force"),
    replace(_D, name="decode-p528-split-forced", page_size=528, kv_lens=DEC_MED, split="force"),
    replace(_D, name="decode-p1024", page_size=1024, kv_lens=DEC_MED),
]
# fp8 KV cache (issue 14 item 1): both formats x float / per-head tensor scales x fp16 / bf16 q over decode (split
# auto, forced, off), paged and ragged prefill, GQA and MHA, page sizes 1, 5, 16, 48 (non-full last pages), HND
FP8 = [
    replace(_D, name="fp8-decode-e4m3", kv="e4m3"),
    replace(_D, name="fp8-decode-e4m3-tensor-split-forced", kv="e4m3", scale="tensor", kv_lens=DEC_MED,
            split="force"),
    replace(_D, name="fp8-decode-e5m2-fp16-autosplit", kv="e5m2", dtype=F16, kv_lens=DEC_MED),
    replace(_D, name="fp8-decode-e5m2-tensor-nosplit-mha", kv="e5m2", scale="tensor", heads=(8, 8), kv_lens=DEC_MED,
            split="off"),
    replace(_D, name="fp8-decode-e4m3-fp16-tensor-p1", kv="e4m3", dtype=F16, scale="tensor", page_size=1,
            kv_lens=DEC_MED),
    replace(_D, name="fp8-decode-e5m2-p5-hnd-split-forced", kv="e5m2", page_size=5, layout="HND", kv_lens=DEC_MED,
            split="force"),
    replace(_D, name="fp8-decode-e4m3-d64-mha-fp16", kv="e4m3", head_dim=64, heads=(8, 8), dtype=F16),
    replace(_D, name="fp8-decode-e4m3-d256-tensor", kv="e4m3", head_dim=256, scale="tensor", kv_lens=DEC_MED),
    replace(_D, name="fp8-decode-e4m3-128k", kv="e4m3", kv_lens=DEC_LONG),
    replace(_D, name="fp8-decode-e5m2-g8-many", kv="e5m2", heads=(64, 8), kv_lens=DEC_MANY),
    replace(_P, name="fp8-paged-e4m3", kv="e4m3"),
    replace(_P, name="fp8-paged-e4m3-tensor-fp16-split-forced", kv="e4m3", scale="tensor", dtype=F16, split="force"),
    replace(_P, name="fp8-paged-e5m2-noncausal", kv="e5m2", causal=False),
    replace(_P, name="fp8-paged-e5m2-tensor-fp16-p1-mha", kv="e5m2", scale="tensor", dtype=F16, page_size=1,
            heads=(8, 8)),
    replace(_P, name="fp8-paged-e4m3-p48-hnd", kv="e4m3", page_size=48, layout="HND"),
    replace(_P, name="fp8-paged-e4m3-d64-tensor", kv="e4m3", head_dim=64, scale="tensor"),
    replace(_P, name="fp8-paged-e5m2-d256-fp16", kv="e5m2", head_dim=256, dtype=F16),
    replace(_P, name="fp8-paged-e4m3-d256-tensor", kv="e4m3", head_dim=256, scale="tensor"),  # bf16 q at d256
    # causal, split into 128-token chunks: the early q tiles' later chunks are items with rows and no kv tile
    # (about 112 of 256 per kv head; the sm90 fp8 producer converts its pending tiles before the next Q stage
    # then). 1024 tokens: 2048 would need 32768 partial-state slots, more than the tests' workspace holds
    replace(_P, name="fp8-paged-e4m3-empty-chunks", kv="e4m3", qo_lens=(1024,), kv_lens=(1024,), split="force"),
    replace(_P, name="fp8-paged-e4m3-long-autosplit", kv="e4m3", qo_lens=LONG_QO, kv_lens=LONG_KV),
    replace(_R, name="fp8-ragged-e4m3", kv="e4m3"),
    replace(_R, name="fp8-ragged-e5m2-tensor-fp16-noncausal", kv="e5m2", scale="tensor", dtype=F16, causal=False),
    replace(_R, name="fp8-ragged-e4m3-tensor-mha-split-forced", kv="e4m3", scale="tensor", heads=(16, 16),
            split="force"),
    replace(_R, name="fp8-ragged-e5m2-d64", kv="e5m2", head_dim=64),
]
ALL = PAGED + RAGGED + DECODE + FP8
# every case on each of its families: the matrix the GPU tests run
MATRIX = [(c, f) for c in ALL for f in c.families]
# the sm90 family's other tile configurations (attnjit tune picks among them) on a few cases
TILE_CASES = [_P, replace(_P, name="paged-split-forced", split="force"), _R,
              replace(_P, name="paged-prefill-only", qo_lens=PREFILL_QO, kv_lens=PREFILL_KV),
              replace(_P, name="paged-p1", page_size=1), replace(_P, name="paged-noncausal", causal=False),
              replace(_P, name="paged-fp16-mha", dtype=torch.float16, heads=(8, 8)),
              replace(_P, name="paged-logits+1000-tiles", offset=1000.0),
              _RAMP,
              # an fp8 cache: one Q stage (the producer converts its pending tiles before each Q), three K/V stages
              replace(_P, name="paged-fp8-e4m3-tiles", kv="e4m3", scale="tensor"),
              replace(_R, name="ragged-fp8-e5m2-fp16-tiles", kv="e5m2", dtype=torch.float16, causal=False),
              replace(_P, name="paged-fp8-e4m3-p1-tiles", kv="e4m3", page_size=1, qo_lens=PREFILL_QO,
                      kv_lens=PREFILL_KV)]
TILE_MATRIX = [(c, t) for c in TILE_CASES for t in ("kv128q1", "kv64s3", "kv128t8", "kv128s3q1", "kv128c")] + \
    [(c, "q192kv64") for c in TILE_CASES + [replace(_P, name="paged-d64-tiles", head_dim=64),
                                            replace(_R, name="ragged-d64-fp16-tiles", head_dim=64,
                                                    dtype=torch.float16, causal=False)]
     if c.kv is None and c.head_dim <= 128] + \
    [(c, t) for c in TILE_CASES if c.kv is None for t in ("kv160", "kv176q1")]  # wide K/V tiles: 16-bit caches

# Specs the other GPU tests (graphs, recording, merge, append, single-request helpers) compile.
EXTRA_SPECS = [
    AttentionSpec(op="merge_state", head_dim=hd, dtype=dt) for hd in (64, 128, 256) for dt in ("fp16", "bf16")
] + [
    AttentionSpec(op="append_kv", head_dim=128, page_size=ps, dtype=dt, layout=lay)
    for ps, dt, lay in ((16, "bf16", "NHD"), (1, "fp16", "NHD"), (16, "fp16", "HND"), (8, "bf16", "HND"),
                        (48, "bf16", "NHD"), (5, "fp16", "HND"))
] + [
    AttentionSpec(op="prefill", head_dim=128, dtype="bf16", kv="ragged", group_size=4, mask="none"),
    AttentionSpec(op="prefill", head_dim=128, dtype="fp16", kv="ragged", group_size=1, mask="causal"),
    AttentionSpec(op="prefill", head_dim=128, dtype="fp16", kv="ragged", group_size=1, mask="none"),
] + [  # tests/gpu/test_fp8.py: append into fp8 caches, the scale tests, single-request helpers, a 16-bit plan's scales
    AttentionSpec(op="append_kv", head_dim=128, page_size=ps, dtype_kv=kv, layout=lay)
    for ps, kv, lay in ((16, "e4m3", "NHD"), (5, "e5m2", "HND"))
] + [
    AttentionSpec(op="prefill", head_dim=128, dtype_q="bf16", dtype_kv="e4m3", kv="ragged", group_size=4, mask="none"),
    AttentionSpec(op="prefill", head_dim=128, dtype_q="bf16", dtype_kv="e4m3", kv="ragged", group_size=4,
                  mask="causal"),
]


# --- variants (issue 4): user-declared variants live here, at module level, so catalogs can name them -------------

from attnjit import Variant, TensorParam  # noqa: E402
from attnjit import variants as builtin  # noqa: E402

USER_SIGMOID = Variant("user_sigmoid", params={"scale": float, "bias": float}, use_softmax=False,
                       logits_transform="return 1.f / (1.f + expf(-(logit * scale + bias)));")
HEAD_SCALE = Variant("head_scale", params={"head_scale": TensorParam("float32", per="qo_head")},
                     logits_transform="return logit * head_scale[qo_head];")
# the softmax folds a transform's constant factor into its own scale (logits_scale): the logits are logit * gain
USER_SCALED = Variant("user_scaled", params={"logit_gain": float}, logits_transform="return logit;",
                      logits_scale="return logit_gain;")
GAINS = Variant("gains", params={"q_gain": float, "o_gain": float},
                query_transform="return q * q_gain;", output_transform="return o * o_gain;")
# records the largest q_pos its mask hook sees per request (tests/gpu/test_variants.py: hooks see only the
# request's positions, padding rows included)
POS_PROBE = Variant("pos_probe", params={"seen": TensorParam("int32", per="request")},
                    logits_mask="atomicMax(const_cast<int*>(seen) + batch_idx, q_pos);\nreturn true;")
# (op, family) the probe runs on
POS_PROBE_RUNS = (("prefill", "sm90"), ("prefill", "fa2"), ("decode", "fa2"))


@dataclass(frozen=True)
class VariantCase:
    name: str
    kind: str                   # paged | ragged | decode
    feature: str                # softcap | window | alibi | custom_mask | sigmoid | user_sigmoid | head_scale |
                                # scaled_softcap | gains | user_scaled | softcap_alibi
    causal: bool = True
    split: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    kv: str | None = None       # an fp8 cache: the hooks around the fp16 mma (bf16 q rescaled per row, fp8_frags.cuh)

    @property
    def variant(self):
        return {"sigmoid": builtin.SIGMOID, "user_sigmoid": USER_SIGMOID, "head_scale": HEAD_SCALE,
                "scaled_softcap": HEAD_SCALE, "gains": GAINS, "user_scaled": USER_SCALED}.get(self.feature)

    @property
    def builtin_variant(self):
        """The variant plan() composes from FlashInfer's arguments for this feature."""
        return {"softcap": builtin.SOFTCAP, "window": builtin.SLIDING_WINDOW, "alibi": builtin.ALIBI,
                "custom_mask": builtin.CUSTOM_MASK,
                "scaled_softcap": builtin.compose(HEAD_SCALE, builtin.SOFTCAP),
                "softcap_alibi": builtin.compose(builtin.SOFTCAP, builtin.ALIBI)}.get(self.feature) or self.variant

    @property
    def families(self) -> tuple[str, ...]:
        return families_for(self.kind)

    def spec(self, family: str = "fa2") -> AttentionSpec:
        base = replace(_P if self.kind == "paged" else _R if self.kind == "ragged" else _D, dtype=self.dtype,
                       causal=self.causal and self.feature != "custom_mask" and self.kind != "decode", kv=self.kv)
        return base.spec(family).replace(variant=self.builtin_variant)


VARIANTS = [
    VariantCase(f"{feature}-{kind}{'' if causal else '-noncausal'}{'-split' if split == 'force' else ''}", kind,
                feature, causal, split)
    for feature in ("softcap", "window", "alibi", "sigmoid", "user_sigmoid", "head_scale", "gains")
    for kind, causal, split in (("paged", True, "auto"), ("paged", False, "force"), ("ragged", True, "force"),
                                ("decode", False, "auto"))
] + [
    VariantCase("custom_mask-paged", "paged", "custom_mask", False),
    VariantCase("custom_mask-paged-split", "paged", "custom_mask", False, "force"),
    VariantCase("custom_mask-ragged", "ragged", "custom_mask", False),
    VariantCase("softcap-decode-fp16-split", "decode", "softcap", False, "force", torch.float16),
    VariantCase("window-decode-split", "decode", "window", False, "force"),
    # a user logits transform before the soft-cap: the soft-cap, second in the chain, sees its result (not q.k)
    VariantCase("scaled_softcap-paged", "paged", "scaled_softcap"),
    VariantCase("scaled_softcap-decode", "decode", "scaled_softcap", False),
    # a transform's constant factor left to the softmax (logits_scale): alone, and before a later part of the chain
    # (the soft-cap's cap multiplied in before ALiBi adds its bias)
    VariantCase("user_scaled-paged", "paged", "user_scaled"),
    VariantCase("user_scaled-decode-split", "decode", "user_scaled", False, "force"),
    VariantCase("softcap_alibi-paged", "paged", "softcap_alibi"),
    VariantCase("softcap_alibi-decode", "decode", "softcap_alibi", False),
    # over an fp8 cache: each hook where the fp16 mma meets it (logits transform, query and output transforms, the
    # position-dependent bias, no softmax, masks)
    VariantCase("softcap-decode-fp8-e4m3", "decode", "softcap", False, kv="e4m3"),
    VariantCase("softcap-paged-fp8-e5m2-split", "paged", "softcap", True, "force", kv="e5m2"),
    VariantCase("gains-paged-fp8-e4m3", "paged", "gains", True, kv="e4m3"),
    VariantCase("alibi-decode-fp8-e4m3-split", "decode", "alibi", False, "force", kv="e4m3"),
    # ALiBi's logits_scale is the row's sm_scale, which over an fp8 cache carries the query row's dequantization
    VariantCase("alibi-paged-fp8-e4m3", "paged", "alibi", True, kv="e4m3"),
    VariantCase("sigmoid-ragged-fp8-e4m3", "ragged", "sigmoid", True, kv="e4m3"),
    VariantCase("window-paged-fp8-e4m3-fp16", "paged", "window", True, dtype=torch.float16, kv="e4m3"),
]


VARIANT_MATRIX = [(c, f) for c in VARIANTS for f in c.families]
# the variants on the sm90 tile whose softmax keeps a stale max (tau 8: P up to 2^8), and on the chained walk
# (kv128c: a hooked softmax takes other registers there): each hook beside it
VARIANT_TILE_MATRIX = [(c, t) for c in VARIANTS if "sm90" in c.families and not c.kv and c.split == "auto"
                       for t in ("kv128t8", "kv128c")]


# --- issue 14: RoPE inside attention, attention sinks (tests/gpu/test_serving.py) ----------------------------------

@dataclass(frozen=True)
class ServingCase:
    name: str
    kind: str                   # paged | ragged | decode | sink_wrapper (paged, FlashInfer's sink wrapper)
    feature: str                # rope | rope_scaled | sink | sink_window
    causal: bool = True
    split: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    kv: str | None = None       # an fp8 cache (paged, decode): with a key transform it is converted in shared memory
    tile: str | None = None     # an sm90 tile configuration (the case then runs on sm90 only)

    @property
    def builtin_variant(self):
        """The variant plan() composes for the feature (ROPE_LLAMA first, the sink last)."""
        return {"rope": builtin.ROPE_LLAMA, "rope_scaled": builtin.ROPE_LLAMA, "sink": builtin.SINK,
                "sink_window": builtin.compose(builtin.SLIDING_WINDOW, builtin.SINK)}[self.feature]

    @property
    def families(self) -> tuple[str, ...]:
        """As Case's, less a family that declines the feature's spec (sm90: a key transform over e5m2)."""
        if self.tile is not None:
            return ("sm90",)
        return tuple(f for f in families_for(self.kind) if self.spec(f).family == f)

    def spec(self, family: str = "fa2") -> AttentionSpec:
        kind = "paged" if self.kind == "sink_wrapper" else self.kind
        base = replace(_P if kind == "paged" else _R if kind == "ragged" else _D, dtype=self.dtype,
                       causal=self.causal and kind != "decode", kv=self.kv)
        spec = base.spec(family).replace(variant=self.builtin_variant)
        return spec.replace(tile=self.tile) if self.tile is not None else spec


SERVING = [
    ServingCase("rope-paged", "paged", "rope"),
    ServingCase("rope-scaled-paged-noncausal-split", "paged", "rope_scaled", False, "force"),
    ServingCase("rope-ragged-fp16", "ragged", "rope", dtype=torch.float16),
    ServingCase("rope-decode", "decode", "rope"),
    ServingCase("rope-scaled-decode-split", "decode", "rope_scaled", split="force"),
    ServingCase("rope-decode-fp8-e4m3", "decode", "rope", kv="e4m3"),
    ServingCase("rope-paged-fp8-e5m2-split", "paged", "rope", split="force", kv="e5m2"),  # fa2 only (sm90 declines)
    ServingCase("rope-paged-fp8-e4m3", "paged", "rope", kv="e4m3"),  # sm90: RoPE on its fp16 K tile
    ServingCase("sink-paged", "paged", "sink"),
    ServingCase("sink-window-paged-split", "paged", "sink_window", split="force"),
    ServingCase("sink-ragged-noncausal", "ragged", "sink", False),
    ServingCase("sink-decode", "decode", "sink"),
    ServingCase("sink-window-decode-split", "decode", "sink_window", split="force"),
    ServingCase("sink-wrapper-window", "sink_wrapper", "sink_window"),
    ServingCase("sink-wrapper-fp16-noncausal", "sink_wrapper", "sink", False, dtype=torch.float16),
    # the sink starts the online softmax (m = sink): with kv128t8's lazy rescale too
    ServingCase("sink-paged-kv128t8", "paged", "sink", tile="kv128t8"),
    ServingCase("sink-window-paged-split-kv128t8", "paged", "sink_window", split="force", tile="kv128t8"),
]
SERVING_MATRIX = [(c, f) for c in SERVING for f in c.families]

# What tests/gpu/test_views.py compiles (views of every argument of every op; issue 10).
_VIEW_BASE = dict(head_dim=128, page_size=16, dtype="bf16", group_size=4)
VIEW_SPECS = [
    AttentionSpec(op="prefill", mask="causal", **_VIEW_BASE),
    AttentionSpec(op="prefill", mask="causal", layout="HND", **_VIEW_BASE),
    AttentionSpec(op="prefill", mask="causal", variant=HEAD_SCALE, **_VIEW_BASE),
    AttentionSpec(op="prefill", mask="none", variant=builtin.CUSTOM_MASK, **_VIEW_BASE),
    AttentionSpec(op="decode", **_VIEW_BASE),
    AttentionSpec(op="decode", layout="HND", **_VIEW_BASE),
    AttentionSpec(op="prefill", head_dim=128, dtype="bf16", kv="ragged", group_size=4, mask="causal"),
    AttentionSpec(op="prefill", head_dim=128, dtype="bf16", kv="ragged", group_size=4, mask="none"),
    AttentionSpec(op="merge_state", head_dim=128, dtype="bf16"),
    AttentionSpec(op="append_kv", head_dim=128, page_size=16, dtype="bf16", layout="NHD"),
    AttentionSpec(op="append_kv", head_dim=128, page_size=16, dtype="fp16", layout="HND"),
]


def _dispatched(spec: AttentionSpec) -> list[AttentionSpec]:
    """The spec on every family plan() may run it on (the views tests use the default backend)."""
    from attnjit import families

    if spec.family is None:
        return [spec]
    return [spec if f == spec.family else spec.replace(family=f) for f in families.dispatchable(spec)]


# What tests/gpu/test_transformers.py compiles: the models' attention (head_dim 64, 4 q heads over 2 KV heads, bf16)
# as ragged batches: causal alone, with the sliding window and the soft-cap (Gemma-2), and explicit masks of padded
# batches as custom masks.
_HF = dict(op="prefill", head_dim=64, dtype="bf16", kv="ragged", group_size=2)
TRANSFORMERS_SPECS = [
    AttentionSpec(mask="causal", **_HF),
    AttentionSpec(mask="causal", variant=builtin.SLIDING_WINDOW, **_HF),
    AttentionSpec(mask="causal", variant=builtin.SOFTCAP, **_HF),
    AttentionSpec(mask="causal", variant=builtin.compose(builtin.SOFTCAP, builtin.SLIDING_WINDOW), **_HF),
    AttentionSpec(mask="none", variant=builtin.CUSTOM_MASK, **_HF),
    AttentionSpec(mask="none", variant=builtin.compose(builtin.SOFTCAP, builtin.CUSTOM_MASK), **_HF),
]


def pos_probe_spec(op: str, family: str) -> AttentionSpec:
    base = _D if op == "decode" else replace(_P, causal=False)
    return base.spec(family).replace(variant=POS_PROBE)


# Many items per CTA (tests/gpu/test_work_order.py test_sm90_many_items_per_cta_match_reference, test_variants.py
# test_variant_on_sm90_with_many_items_per_cta): the wrapper sees 2 SMs, so each CTA walks from item to item (most
# cases above have fewer (item, kv head) pairs than a 132-SM grid). Each item alone (walk_items: the default tiles)
# and chained (walk_chained: kv128c). (With 2 SMs the long histories pick kv176q1, one Q stage, never chained.)
_WALK_CASES = ("base", "paged-p1", "paged-p4", "paged-split-forced", "paged-hnd-p1-fp16-noncausal", "paged-noncausal",
               "paged-shared-prefix", "ragged", "ragged-split-forced", "ragged-rising-logits",
               "fp8-paged-e4m3-tensor-fp16-split-forced")
WALK_MATRIX = [(n, t) for n in _WALK_CASES for t in (None, "kv128c")] + \
    [("paged-d256", None), ("paged-long-history", "kv128t8"), ("paged-long-autosplit", "kv64s3"),
     ("paged-long-history", "kv128c")]
# each hook: a logits transform (soft-cap, ALiBi, a user's scaled logit; chained, their consumers take 232
# registers), a mask, the window's skipped tiles, no softmax
WALK_VARIANTS = [(c, t) for c in VARIANTS if c.name in (
    "softcap-paged", "alibi-paged", "user_scaled-paged", "scaled_softcap-paged", "softcap_alibi-paged",
    "softcap-ragged-split", "window-paged", "custom_mask-paged", "sigmoid-paged", "head_scale-paged")
    for t in (None, "kv128c")]
assert len(WALK_VARIANTS) == 20, "a case WALK_VARIANTS names was renamed"


def sm90_case(name: str) -> Case:
    """The sm90 family's case of MATRIX by name."""
    return next(c for c, f in MATRIX if f == "sm90" and c.name == name)


def all_specs() -> list[AttentionSpec]:
    out: list[AttentionSpec] = []
    views = [d for v in VIEW_SPECS + TRANSFORMERS_SPECS for d in _dispatched(v)]
    tiles = [c.spec("sm90").replace(tile=t) for c, t in TILE_MATRIX] + \
        [c.spec("sm90").replace(tile=t) for c, t in VARIANT_TILE_MATRIX] + \
        [sm90_case(n).spec("sm90").replace(tile=t) for n, t in WALK_MATRIX] + \
        [c.spec("sm90").replace(tile=t) for c, t in WALK_VARIANTS]
    serving = [c.spec(f) for c, f in SERVING_MATRIX]
    probes = [pos_probe_spec(op, f) for op, f in POS_PROBE_RUNS]
    for s in [c.spec(f) for c, f in MATRIX] + EXTRA_SPECS + [c.spec(f) for c, f in VARIANT_MATRIX] + views + tiles \
            + serving + probes:
        if s not in out:
            out.append(s)
    return out


if __name__ == "__main__":  # regenerate specs/gpu-tests.toml
    from attnjit.specs import dump_catalog
    from tests.gpu import cases  # the importable module, so its variants are named tests.gpu.cases:NAME

    print(dump_catalog(cases.all_specs(), header="Every spec the GPU tests compile (generated by: python -m tests.gpu.cases "
                                           "> specs/gpu-tests.toml).\nscripts/gpu_check.sh warms it in parallel "
                                           "before the tests run."), end="")
