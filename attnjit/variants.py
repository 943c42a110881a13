"""Custom attention variants: a name, typed parameters and CUDA snippets for the kernel's hook points.

    softcap = attnjit.Variant("softcap", params={"cap": float},
                              logits_transform="return cap * tanhf(logit / cap);")
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, variant=softcap)
    w.plan(...); out = w.run(q, kv_cache, cap=30.0)

Hooks (each a function body; every snippet sees the variables of HOOK_VARIABLES[hook] and every parameter by its
own name: scalars as ``float``/``int``, tensors as ``const T*``; ``HEAD_DIM`` is the spec's head dim):
  query_transform(q)     -> float  each element of a query row before Q K^T (``dim`` is its index; ``q_pair`` is the
                                   element HEAD_DIM/2 away, dim +- HEAD_DIM/2: the rotation partner of half-split
                                   rotary embeddings); the result is stored back in the query's dtype (fp16/bf16)
  key_transform(k)       -> float  each element of a key row once it is in shared memory (``kv_pos`` its position,
                                   ``k_pair`` its partner as above), stored back in the key's dtype; V is untouched
  logits_transform(logit) -> float  logit = sm_scale * q.k; the result goes into the softmax (or is the weight,
                                   with use_softmax=False); logit == qk * sm_scale, ``qk`` the unscaled dot
                                   product and ``sm_scale`` its row's scale (with an fp8 query's dequantization):
                                   a snippet that scales the logit again (soft-cap) saves a multiply a logit by
                                   folding the two scales, loop-invariant, into one; ``rel_pos`` is
                                   float(kv_pos - q_pos) (exact while |kv_pos - q_pos| < 2^24), made with one add
                                   a logit where the int conversion would cost a quarter-rate I2F each; in a
                                   composed variant a later part's logit is its predecessor's result, and its
                                   ``qk`` that result too, with ``sm_scale`` 1
  logits_scale()         -> float  optional, with logits_transform: a factor (> 0, from the parameters and the
                                   row's ``sm_scale``, the value logits_transform saw) that the transform's result is
                                   to be multiplied by, left to the softmax, which folds it into its own scale
                                   (soft-cap: cap * tanh(x) becomes tanh(x) with scale cap; ALiBi: qk + slope / sm_scale
                                   * rel_pos with scale sm_scale; one multiply a logit less). Any other value than a
                                   positive finite float gives NaN outputs. In a composed variant only the last
                                   transform's scale is folded; an earlier part's is multiplied in before the next
                                   part sees the logit (a later part's sm_scale is 1)
  logits_mask()          -> bool   false hides the key from the query (combined with causal)
  output_transform(o)    -> float  each element of an output row (``dim`` is its index)
  kv_start()             -> int    optional: the smallest kv_pos the query can see (lets whole tiles be skipped)
With ``mask_from_kv_start=True`` a variant declares that its logits_mask hides exactly the keys below kv_start
(a sliding window) and that kv_start never decreases as q_pos grows: a KV tile at or above the kv_start of an
item's last query row then skips the mask, as tiles below the causal diagonal skip the causal one (without it,
every tile of a masked variant pays for the mask). kv_start sees kv_head, not qo_head, so a mask that differs
between the query heads of a group (a per-head window) cannot declare it (a ValueError where the mask reads qo_head).
  sink()                 -> float  an attention sink: a logit (on the scale of sm_scale * q.k) that joins each row's
                                   softmax denominator only, as a key whose value is the zero vector, so
                                   o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}) and lse = log2(sum_j e^{s_j} +
                                   e^{sink}): (o, lse) stays a state merge_state combines exactly (the sink counted
                                   once); a row with no visible key gives o = 0, lse = sink * log2(e)
Positions are logical: q_pos = kv_len - qo_len + (query index in its request), so causal is kv_pos <= q_pos.
A hook may also run where its result is discarded: for a tile's padding rows (they see the request's last q_pos,
so every q_pos is one of the request's), and logits_transform for keys the mask then hides, up to the end of the
kv tile (kv_pos past kv_len - 1): a snippet that reads memory by kv_pos must bound it by kv_len.
Snippets may call attnjit::fast_tanh(x) (the hardware tanh.approx) besides CUDA's math functions.

The built-ins (soft-cap, sliding window, ALiBi, custom mask, sigmoid attention, LLaMA RoPE, attention sinks) are
declared below the same way.
A variant's snippets are part of the rendered source, hence of the cache key. Catalogs name a variant by
``module:attribute``; that is what ``ref`` resolves to for a variant defined at module level.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import keyword
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

HOOKS = ("query_transform", "key_transform", "logits_transform", "logits_scale", "logits_mask", "output_transform",
         "kv_start", "sink")
_POSITIONS = ("q_pos", "kv_pos", "qo_len", "kv_len", "batch_idx", "qo_head", "kv_head")
HOOK_VARIABLES: dict[str, tuple[str, ...]] = {
    "query_transform": ("q", "q_pair", "dim", "q_pos", "qo_len", "kv_len", "batch_idx", "qo_head", "kv_head"),
    "key_transform": ("k", "k_pair", "dim", "kv_pos", "qo_len", "kv_len", "batch_idx", "kv_head"),
    "logits_transform": ("logit", "qk", "sm_scale", "q_pos", "kv_pos", "rel_pos") + _POSITIONS[2:],
    "logits_scale": ("sm_scale",),
    "logits_mask": _POSITIONS,
    "output_transform": ("o", "dim", "q_pos", "qo_len", "kv_len", "batch_idx", "qo_head", "kv_head"),
    "kv_start": ("q_pos", "qo_len", "kv_len", "batch_idx", "kv_head"),
    "sink": ("q_pos", "qo_len", "kv_len", "batch_idx", "qo_head", "kv_head"),
}
HOOK_RETURNS = {"query_transform": "float", "key_transform": "float", "logits_transform": "float",
                "logits_scale": "float", "logits_mask": "bool", "output_transform": "float", "kv_start": "int", "sink": "float"}
_RESERVED = set(v for vs in HOOK_VARIABLES.values() for v in vs) | {"p", "params"}

# tensor parameters: element type, and what one value is per (so run() can check the length)
TENSOR_DTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int",
                 "uint8": "uint8_t", "bool": "bool"}
PER = ("qo_head", "kv_head", "request", "request+1", "qo_token", "any")


@dataclass(frozen=True)
class TensorParam:
    """A tensor parameter: ``dtype`` (float32, float16, bfloat16, int32, uint8, bool) and ``per`` = what it holds
    one value per: qo_head [H_q], kv_head [H_kv], request [B], request+1 [B+1] (an indptr), qo_token [nnz_qo], or
    any (a flat buffer the snippet indexes itself)."""

    dtype: str = "float32"
    per: str = "qo_head"

    def __post_init__(self) -> None:
        if self.dtype not in TENSOR_DTYPES:
            raise ValueError(f"TensorParam.dtype={self.dtype!r} is not supported: expected one of "
                             f"{', '.join(TENSOR_DTYPES)}")
        if self.per not in PER:
            raise ValueError(f"TensorParam.per={self.per!r} is not supported: expected one of {', '.join(PER)}")

    @property
    def ctype(self) -> str:
        return f"const {TENSOR_DTYPES[self.dtype]}*"

    def describe(self) -> str:
        return f"Tensor({self.dtype}, per {self.per})"


def _param_type(name: str, kind: Any, variant: str) -> Any:
    if kind in (float, int) or isinstance(kind, TensorParam):
        return kind
    if kind == "float":
        return float
    if kind == "int":
        return int
    raise TypeError(f"variant {variant!r}: parameter {name!r} has type {kind!r}; declare float, int or "
                    "attnjit.TensorParam(dtype, per=...)")


class Variant:
    """One attention variant (see the module docstring). Immutable; equal variants have equal ``digest``s.

    Attributes: name; params, ((name, float | int | TensorParam), ...); hooks, ((hook, snippet), ...);
    use_softmax; mask_from_kv_start (the mask is exactly kv_pos >= kv_start: mask-free tiles skip it); parts, the
    variants a composition applies in order (a plain variant's parts are itself).
    """

    __slots__ = ("name", "params", "hooks", "use_softmax", "mask_from_kv_start", "parts", "_digest")

    def __init__(self, name: str, *, params: dict[str, Any] | None = None, query_transform: str | None = None,
                 logits_transform: str | None = None, logits_mask: str | None = None,
                 output_transform: str | None = None, kv_start: str | None = None, key_transform: str | None = None,
                 sink: str | None = None, use_softmax: bool = True, mask_from_kv_start: bool = False,
                 logits_scale: str | None = None):
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"Variant name {name!r} must be an identifier (letters, digits, _)")
        declared = {}
        for pname, kind in (params or {}).items():
            if not isinstance(pname, str) or not pname.isidentifier() or keyword.iskeyword(pname):
                raise ValueError(f"variant {name!r}: parameter name {pname!r} must be an identifier")
            if pname in _RESERVED:
                raise ValueError(f"variant {name!r}: parameter name {pname!r} is taken by a hook variable "
                                 f"({', '.join(sorted(_RESERVED))})")
            declared[pname] = _param_type(pname, kind, name)
        hooks = []
        for hook, snippet in (("query_transform", query_transform), ("key_transform", key_transform),
                              ("logits_transform", logits_transform), ("logits_scale", logits_scale),
                              ("logits_mask", logits_mask),
                              ("output_transform", output_transform), ("kv_start", kv_start), ("sink", sink)):
            if snippet is None:
                continue
            if not isinstance(snippet, str) or not snippet.strip():
                raise TypeError(f"variant {name!r}: {hook} must be a string of CUDA code, got {snippet!r}")
            if hook == "kv_start" and "return" not in snippet:
                snippet = f"return {snippet.strip().rstrip(';')};"
            hooks.append((hook, snippet.strip("\n")))
        if not isinstance(use_softmax, bool):
            raise TypeError(f"variant {name!r}: use_softmax must be True or False")
        if not use_softmax and not any(h == "logits_transform" for h, _ in hooks):
            raise ValueError(f"variant {name!r}: use_softmax=False needs a logits_transform that returns each key's "
                             "weight (e.g. a sigmoid)")
        if logits_scale is not None and (logits_transform is None or not use_softmax):
            raise ValueError(f"variant {name!r}: logits_scale is the constant the softmax multiplies this variant's "
                             "logits_transform result by; it needs a logits_transform and use_softmax=True")
        if not use_softmax and any(h == "sink" for h, _ in hooks):
            raise ValueError(f"variant {name!r}: a sink joins the softmax denominator; use_softmax=False has none")
        if not isinstance(mask_from_kv_start, bool):
            raise TypeError(f"variant {name!r}: mask_from_kv_start must be True or False")
        if mask_from_kv_start and not (logits_mask and kv_start):
            raise ValueError(f"variant {name!r}: mask_from_kv_start=True says the logits_mask hides exactly the keys "
                             "below kv_start; it needs both hooks")
        if mask_from_kv_start and re.search(r"\bqo_head\b",   # in the code, not in a comment
                                            re.sub(r"//[^\n]*|/\*.*?\*/", " ", logits_mask, flags=re.S)):
            # kv_start sees kv_head, not qo_head: the query heads of a group share one bound, so a mask that differs
            # between them (a per-head window) is not "exactly the keys below kv_start" and skipping it would be wrong
            raise ValueError(f"variant {name!r}: mask_from_kv_start=True with a logits_mask that reads qo_head: "
                             "kv_start has no qo_head (the query heads of a KV head share its bound), so a per-head "
                             "mask cannot be declared by it; drop mask_from_kv_start (the mask then runs on every "
                             "tile)")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "params", tuple(declared.items()))
        object.__setattr__(self, "hooks", tuple(hooks))
        object.__setattr__(self, "use_softmax", use_softmax)
        object.__setattr__(self, "mask_from_kv_start", mask_from_kv_start)
        object.__setattr__(self, "parts", (self,))

    # --- identity ------------------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        def kind(k):
            return k.__name__ if k in (float, int) else k.describe()

        d = {"name": self.name, "params": [[n, kind(k)] for n, k in self.params], "hooks": [list(h) for h in self.hooks],
             "use_softmax": self.use_softmax, "parts": [p.describe() for p in self.parts] if len(self.parts) > 1
             else []}
        if self.mask_from_kv_start:   # only where set: every other variant keeps its digest (and cache keys)
            d["mask_from_kv_start"] = True
        return d

    @property
    def digest(self) -> str:
        """sha256 of describe() (computed once: a variant is immutable, and plan() hashes specs every step)."""
        try:
            return self._digest
        except AttributeError:
            digest = hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()[:16]
            object.__setattr__(self, "_digest", digest)
            return digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Variant) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def ref(self) -> str | None:
        """``module:attribute`` of a module-level variable holding this variant (what catalogs name), or None."""
        cached = _REFS.get(id(self))
        if cached is not None and cached[0] is self:
            return cached[1]
        if len(self.parts) > 1:
            refs = [p.ref for p in self.parts]
            ref = "+".join(refs) if all(refs) else None
        else:
            ref = None
            for mod_name, mod in list(sys.modules.items()):
                if mod is None or mod_name.startswith("__"):  # __main__, __mp_main__: not importable by name
                    continue
                for attr, value in list(getattr(mod, "__dict__", {}).items()):
                    if value is self:
                        ref = f"{mod_name}:{attr}"
                        break
                if ref:
                    break
        _REFS[id(self)] = (self, ref)
        return ref

    def canonical(self) -> str:
        """How specs name the variant: its ref when importable, else name@digest (not loadable from a catalog)."""
        return self.ref or f"{self.name}@{self.digest}"

    @property
    def param_names(self) -> list[str]:
        return [n for part in self.parts for n, _ in part.params]

    def hook(self, name: str) -> str | None:
        return dict(self.hooks).get(name)

    def __repr__(self) -> str:
        return f"Variant({self.canonical()})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("attnjit.Variant is immutable")


_REFS: dict[int, tuple[Variant, str | None]] = {}


_COMPOSED: dict[tuple[int, ...], tuple[tuple[Variant, ...], Variant]] = {}


def compose(*variants: Variant) -> Variant:
    """Several variants applied in order: logits transforms chained, masks and-ed, kv_start the largest.
    Memoized by the variants' identity (plan() composes FlashInfer's feature arguments every step)."""
    key = tuple(id(v) for v in variants)
    hit = _COMPOSED.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], variants)):
        return hit[1]
    composed = _compose(variants)
    if len(_COMPOSED) > 256:
        _COMPOSED.clear()
    _COMPOSED[key] = (variants, composed)
    return composed


def _compose(variants: tuple[Variant, ...]) -> Variant:
    parts: list[Variant] = []
    for v in variants:
        for p in v.parts:
            if p not in parts:
                parts.append(p)
    if len(parts) == 1:
        return parts[0]
    names = [n for p in parts for n, _ in p.params]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"variants {' + '.join(p.name for p in parts)} both declare parameter(s) {dup}")
    if sum(not p.use_softmax for p in parts) and len(parts) > 1 and any(p.hook("logits_transform") for p in parts
                                                                        if p.use_softmax):
        raise ValueError("a use_softmax=False variant's logits_transform gives the weight; it cannot be chained "
                         "after another logits_transform")
    sinks = [p.name for p in parts if p.hook("sink")]
    if len(sinks) > 1:
        raise ValueError(f"variants {' and '.join(sinks)} both declare a sink; a row has one sink logit (declare "
                         "one sink hook that combines them)")
    if sinks and not all(p.use_softmax for p in parts):
        raise ValueError(f"variant {sinks[0]!r} declares a sink, which joins the softmax denominator; a "
                         "use_softmax=False part leaves no softmax")
    v = object.__new__(Variant)
    object.__setattr__(v, "name", "_".join(p.name for p in parts))
    object.__setattr__(v, "params", tuple(x for p in parts for x in p.params))
    object.__setattr__(v, "hooks", ())
    object.__setattr__(v, "use_softmax", all(p.use_softmax for p in parts))
    # the and-ed mask is exactly kv_pos >= the largest kv_start when each masking part's is its own kv_start bound
    masking = [p for p in parts if p.hook("logits_mask")]
    object.__setattr__(v, "mask_from_kv_start", bool(masking) and all(p.mask_from_kv_start for p in masking))
    object.__setattr__(v, "parts", tuple(parts))
    return v


def resolve(text: str) -> Variant:
    """``module:attribute`` (or several joined by ``+``) -> the Variant it names."""
    found = []
    for ref in text.split("+"):
        mod_name, _, attr = ref.partition(":")
        if not mod_name or not attr:
            raise ValueError(f"variant {ref!r} is not of the form module:attribute")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as exc:
            raise ValueError(f"variant {ref!r}: cannot import {mod_name}: {exc}") from None
        value = getattr(mod, attr, None)
        if not isinstance(value, Variant):
            raise ValueError(f"variant {ref!r}: {mod_name}.{attr} is {type(value).__name__}, not an attnjit.Variant")
        found.append(value)
    return compose(*found)


# --- built-ins (FlashInfer's arguments map onto these) --------------------------------------------------------

# cap * tanh(logit / cap), with the factor cap left to the softmax's scale (logits_scale: one multiply a logit less);
# |cap| gives the same function (tanh is odd) and keeps that scale positive for a negative cap
SOFTCAP = Variant("softcap", params={"logits_soft_cap": float},
                  logits_transform="return attnjit::fast_tanh(qk * (sm_scale / fabsf(logits_soft_cap)));",
                  logits_scale="return fabsf(logits_soft_cap);")

SLIDING_WINDOW = Variant("sliding_window", params={"window_left": int},
                         logits_mask="return kv_pos >= q_pos - window_left;",
                         kv_start="return q_pos - window_left;", mask_from_kv_start=True)

# logit + slope * rel_pos, with the factor sm_scale left to the softmax's scale (logits_scale: the transform adds to
# the unscaled qk, one multiply a logit less; slope / sm_scale is the same for every logit of a row)
ALIBI = Variant("alibi", params={"alibi_slopes": TensorParam("float32", per="qo_head")},
                logits_transform="return qk + __fdividef(alibi_slopes[qo_head], sm_scale) * rel_pos;",
                logits_scale="return sm_scale;")

CUSTOM_MASK = Variant(
    "custom_mask", params={"packed_custom_mask": TensorParam("uint8", per="any"),
                           "mask_indptr": TensorParam("int32", per="request+1")},
    logits_mask="""const long long bit = (long long)(q_pos - (kv_len - qo_len)) * kv_len + kv_pos;
return (packed_custom_mask[mask_indptr[batch_idx] + (bit >> 3)] >> (bit & 7)) & 1;""")

SIGMOID = Variant("sigmoid", params={"sigmoid_scale": float, "sigmoid_bias": float},
                  logits_transform="return 1.f / (1.f + __expf(-(logit * sigmoid_scale + sigmoid_bias)));",
                  use_softmax=False)

# LLaMA rotary embedding (FlashInfer's pos_encoding_mode="ROPE_LLAMA"): the half-split layout, element i paired with
# i +- D/2, rotated by the angle pos * rope_freqs[i % (D/2)] (q at its q_pos, k at its kv_pos), with
# rope_freqs[f] = theta^(-2f/D) / rope_scale computed in float64 by plan() (rope_freqs). The angle is reduced to
# [-pi, pi] (two-part 2 pi) before the fast sin/cos, so its error is that of the fp32 product pos * freq.
_ROPE = """const int f = dim % (HEAD_DIM / 2);
float a = float({pos}) * rope_freqs[f];
const float turns = rintf(a * 0.159154943f);
a = fmaf(-turns, 6.28318548f, a);
a = fmaf(-turns, -1.74845553e-7f, a);
float s, c;
__sincosf(a, &s, &c);
return {x} * c + (dim < HEAD_DIM / 2 ? -{pair} : {pair}) * s;"""
ROPE_LLAMA = Variant("rope_llama", params={"rope_freqs": TensorParam("float32", per="any")},
                     query_transform=_ROPE.format(pos="q_pos", x="q", pair="q_pair"),
                     key_transform=_ROPE.format(pos="kv_pos", x="k", pair="k_pair"))

# Attention sinks (gpt-oss; FlashInfer's ``sinks``): one logit per query head in the softmax denominator.
SINK = Variant("attention_sink", params={"sinks": TensorParam("float32", per="qo_head")},
               sink="return sinks[qo_head];")


def rope_freqs(head_dim: int, rope_scale: float, rope_theta: float) -> list[float]:
    """ROPE_LLAMA's frequency table: theta^(-2f/D) / rope_scale for f < D/2, as FlashInfer's (in float64)."""
    return [rope_theta ** (-2.0 * f / head_dim) / rope_scale for f in range(head_dim // 2)]


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's head slopes (geometric, interleaved for a non-power-of-two head count), as FlashInfer."""
    n = 2 ** math.floor(math.log2(num_heads))
    m0 = 2.0 ** (-8.0 / n)
    slopes = [m0 ** (i + 1) for i in range(n)]
    if n < num_heads:
        m1 = 2.0 ** (-4.0 / n)
        slopes += [m1 ** (2 * i + 1) for i in range(num_heads - n)]
    return slopes
