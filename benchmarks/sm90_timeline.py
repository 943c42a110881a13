"""A timeline of the sm90 consumer's main loop: clock64 stamps at each phase of each iteration, per warpgroup.

The kernel is the family's own with stamps inserted into its rendered source (the production headers carry none):
the first warp of each consumer warpgroup writes clock64 at seven points of every steady main-loop iteration (up to
MAX_REC per warpgroup) into the workspace's partial-output region, which an unsplit plan leaves unused (tmp_o is
the workspace's first byte: ops/_wrapper.py, _prepare), so the plans here disable split-KV. The report
gives each phase's mean length and how much of the time both warpgroups are in their softmax at once.

    python3 benchmarks/sm90_timeline.py --build 1x8192 8x2048    # compile the stamped kernel (no GPU needed)
    python3 benchmarks/sm90_timeline.py 1x8192 8x2048            # run and report (GPU)

Phases of iteration j (T0..T6): T0 -> T1 waiting for K(j) and the turn, then issuing S(j) = Q K^T; T1 -> T2 rescaling
O, waiting for V(j-1), issuing P(j-1) V(j-1); T2 -> T3 passing the turn and waiting for S(j); T3 -> T4 the softmax;
T4 -> T5 waiting for P(j-1) V(j-1); T5 -> T6 packing P(j).

Per work item too (the first MAX_ITEMS of each warpgroup, I0..I3): I0 -> I1 waiting for the Q tile (and, over an
fp8 cache with a bf16 q, converting its rows), I1 -> I2 the main loop, I2 -> I3 the epilogue, I3 -> the next I0 the
walk to the next item; with the item's kv tile count, so short and long items can be told apart. An unsplit item's
epilogue is cut at E1 (O normalized and staged in shared memory) and E2 (the warpgroup's barrier passed; then the
TMA store or the 16-byte global stores), and the walk at W (the top of the next item's iteration, before its work record is read). ``--kv e4m3``
times the kernel over an e4m3 cache (issue 14's sm90 fp8 path). ``--what-if NAME`` patches the kernel first
(WHAT_IFS: an upper bound on what removing one cost could buy; several joined by +), ``--no-stamps`` leaves the
stamps out and ``--time`` times run() back to back (TFLOP/s), so one call can compare a patched kernel with the one
built. Over a bf16 cache without a variant ``--time`` also checks the output against torch SDPA (``max_diff``; over
0.1 the call says WRONG RESULTS and exits 1: a what-if that drops work, no-store for one, is expected to):

    python3 benchmarks/sm90_timeline.py --build --no-stamps --what-if no-store 32x512
    python3 benchmarks/sm90_timeline.py --no-stamps --time 32x512 8x2048 1x8192                # as built
    python3 benchmarks/sm90_timeline.py --no-stamps --time --what-if no-store 32x512 8x2048 1x8192

``--head-dim 256`` times (and checks) the head_dim 256 kernel instead, with ``--no-stamps`` only:

    python3 benchmarks/sm90_timeline.py --no-stamps --time --head-dim 256 8x2048 1x8192
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attnjit  # noqa: E402
from attnjit import generator, jit  # noqa: E402
from attnjit.specs import AttentionSpec  # noqa: E402

MAX_REC = 256
MAX_ITEMS = 64
WGS = 3  # consumer warpgroups a CTA has room for in the records (two, or three for q192kv64)
PHASES = ("K + turn + issue S", "rescale O + V + issue PV", "pass + wait S", "softmax", "wait PV", "pack P")
ITEM_PHASES = ("wait Q (+ convert)", "main loop", "epilogue", "to the next item")
# the finer cuts (slots 5-7 of an item's record; slot 4 holds its kv tile count)
FINE_PHASES = ("epilogue: normalize + stage O", "epilogue: warpgroup barrier", "epilogue: global stores + lse",
               "walk: arrive + loop", "walk: read the work record")

_MEMBER = "  bool rescale = false;"
_STAMP = (_MEMBER + """
  int tl_rec = 0;
  __device__ __forceinline__ void tl(int k) {
    long long t = clock64();
    if ((threadIdx.x & 127) == 0 && tl_rec < %d)
      reinterpret_cast<long long*>(it.p.tmp_o)[((static_cast<long long>(blockIdx.x) * %d + wg) * %d + tl_rec) * 8 +
                                                 k] = t;
  }
  int tl_item = 0;
  __device__ __forceinline__ void tli(int k) {
    long long t = clock64();
    if ((threadIdx.x & 127) == 0 && tl_item < %d) {
      long long* at = reinterpret_cast<long long*>(it.p.tmp_o) + %s +
                      ((static_cast<long long>(blockIdx.x) * %d + wg) * %d + tl_item) * 8;
      at[k] = t;
      if (k == 0) at[4] = it.num_tiles;
    }
  }""" % (MAX_REC, WGS, MAX_REC, MAX_ITEMS, "ITEM_BASE", WGS, MAX_ITEMS))
# the steady main loop (Consumer::mainloop) and where each stamp goes in it: after the statement, in this order
_LOOP_HEAD = ("  __device__ __forceinline__ void step(Ring<Tr::NUM_STAGES>& kr, Ring<Tr::NUM_STAGES>& vr, int j, "
              "float scale2) {\n")
_LOOP_END = "\n  }\n"
_AFTER = ("qk_turn(kr, j);", "pv_issue(vr);", "done_with_k(kr);", "softmax<NN>(j, scale2);", "done_with_v(vr);",
          "pack_p<NN>();")


# where the per-item stamps go in the unchained walk (sm90/walk.cuh walk_items): after each statement (I0, I3) or
# before it (I1, I2). A chained walk (Sm90Traits::CHAIN, walk_chained: --tile kv128c) has no item boundary to
# cut: its items leave no complete record (I3 is never stamped), so time it with --no-stamps.
_ITEM_AFTER0 = "    it.num_tiles = __shfl_sync(0xffffffffu, it.num_tiles, 0);\n"
_ITEM_MAIN = "    c.mainloop(kr, vr, scale2);\n"
_ITEM_EPI = "    c.write_item(c.it, c.qstage);\n"


_EPI_SYNC = "      named_sync(Tr::BAR_EPILOGUE + wg, 128);\n      if (by_tma) {\n"
_ITEM_TOP = "  consumer_pairs<Tr>(c.sm, [&](int i, int stage) {  // a pair the producer took (its setup holds), its Q landed\n"


def _stamp_items(src: str, item_base: int) -> str:
    """walk_items with tli(0..3) around the item's phases, tli(5), tli(6) around the epilogue's barrier and tli(7)
    at the top of an item's iteration (item records after the loop records)."""
    if any(src.count(x) != 1 for x in (_ITEM_AFTER0, _ITEM_MAIN, _ITEM_EPI, _EPI_SYNC, _ITEM_TOP)):
        raise SystemExit("sm90_timeline.py: the consumer's item loop or epilogue changed; update _ITEM_AFTER0, "
                         "_ITEM_MAIN, _ITEM_EPI, _EPI_SYNC and _ITEM_TOP")
    src = src.replace(_EPI_SYNC, "      tli(5);\n" + _EPI_SYNC.replace("128);\n", "128);\n      tli(6);\n", 1))
    src = src.replace(_ITEM_TOP, _ITEM_TOP + "    c.tli(7);\n")
    src = src.replace(_ITEM_AFTER0, _ITEM_AFTER0 + "      tli(0);\n")
    src = src.replace(_ITEM_MAIN, "    c.tli(1);\n" + _ITEM_MAIN + "    c.tli(2);\n")
    src = src.replace(_ITEM_EPI, _ITEM_EPI + "    c.tli(3);\n    ++c.tl_item;\n")
    return src.replace("ITEM_BASE", str(item_base))


def _stamp_loop(src: str) -> str:
    """The consumer's main loop with tl(0) at its top and tl(1..6) after the statements of _AFTER."""
    if src.count(_LOOP_HEAD) != 1 or src.count(_MEMBER) != 1:
        raise SystemExit("sm90_timeline.py: the consumer's main loop changed; update _LOOP_HEAD, _AFTER and _MEMBER")
    start = src.index(_LOOP_HEAD) + len(_LOOP_HEAD)
    end = src.index(_LOOP_END, start)
    body = src[start:end]
    for k, stmt in enumerate(_AFTER, 1):
        if body.count(stmt) != 1:
            raise SystemExit(f"sm90_timeline.py: {stmt!r} is not once in the consumer's main loop; update _AFTER")
        body = body.replace(stmt, f"{stmt}\n      tl({k});")
    body = "      tl(0);\n" + body + "\n      ++tl_rec;"
    return src[:start] + body + src[end:]


# What-if patches of the rendered source (``--what-if``), each an upper bound on what removing one cost could buy:
#   no-store: an unsplit item's 16-byte global stores of O predicated off by a condition the compiler cannot fold
#   (the staging, the barrier and every other instruction stay; the output is left unwritten). With the TMA store
#   (a warpgroup's rows whole inside the request) only the other rows' stores: combine with no-tma-store
_STORE = "      if (pr < w.rows_total)\n        *reinterpret_cast<uint4*>(w.out_ptr(pr, c)) ="
#   st-cs: the same stores as streaming ones (st.global.cs: evict-first in L2), so the output does not push the K/V
#   tiles other items still read out of L2
_STORE_ALL = _STORE + ("\n            *reinterpret_cast<const uint4*>(stage + tile_offset<Tr::Q_PITCH, Tr::Q_STEP>"
                       "(row, c));")
_EXP = "            const float x = fast_exp2(fmaf(s[4 * j + 2 * r + e], sc, -m_safe));"
# 2^x by a degree-3 polynomial of its fraction (relative error 7.5e-5) and the exponent built in the bits; 0 at -inf
_POLY_EXP2 = """
__device__ __forceinline__ float poly_exp2(float x) {
  x = fmaxf(x, -127.f);
  const float big = x + 12582912.f;
  const float f = x - (big - 12582912.f);
  const float p = fmaf(fmaf(fmaf(0.0551716685f, f, 0.2426111400f), f, 0.6932609677f), f, 0.9999280572f);
  return p * __uint_as_float((__float_as_uint(big) << 23) + (127u << 23));
}
"""
_CONSUMER = "template <typename Tr, typename P>\nstruct Consumer {"


def _poly(eighths: int) -> tuple:
    use = f"((j + 1) * {eighths}) / 8 > (j * {eighths}) / 8"
    return ((_EXP, "            const float y_ = fmaf(s[4 * j + 2 * r + e], sc, -m_safe);\n"
                   f"            const float x = ({use}) ? poly_exp2(y_) : fast_exp2(y_);"),
            (_CONSUMER, _POLY_EXP2 + "\n" + _CONSUMER))


WHAT_IFS = {"no-store": (_STORE, _STORE.replace("(pr < w.rows_total)",
                                                "(pr < w.rows_total && w.p.sm_scale_log2 < -1e30)")),
            # no-mask: the causal mask of the diagonal tiles skipped (their hidden keys count: wrong results)
            "no-mask": ("    if (it.tile_needs_mask(kv0)) {",
                        "    if (it.tile_needs_mask(kv0) && it.p.sm_scale_log2 < -1e30) {"),
            # no-rescale: O never multiplied by alpha (wrong results wherever a row max moves)
            "no-rescale": ("      if (!rescale) return;", "      if (!rescale || it.p.sm_scale_log2 > -1e30) return;"),
            # no-epilogue: an unsplit item's whole epilogue skipped (normalize, stage, barrier, stores, lse; no output)
            "no-epilogue": ("    if (w.pslot < 0) {\n      uint8_t* stage = sm.q(qs);",
                            "    if (w.pslot < 0 && w.p.sm_scale_log2 > -1e30) return;\n"
                            "    if (w.pslot < 0) {\n      uint8_t* stage = sm.q(qs);"),
            # no-narrow: a narrow last tile (Consumer::narrow_last) runs at full width, as before it existed (the
            # same code; the branch is never taken): the A/B of the narrow tile
            "no-narrow": ("      return __shfl_sync(0xffffffffu, narrow, 0);",
                          "      return __shfl_sync(0xffffffffu, narrow && it.p.sm_scale_log2 < -1e30, 0);"),
            # no-tma-store: every warpgroup's output rows by the 16-byte stores, as before the TMA store (the same
            # code; the TMA branch is never taken): the A/B of the TMA store
            "no-tma-store": ("        by_tma = (w.p.tma_flags & kTmaO) && ",
                             "        by_tma = w.p.sm_scale_log2 < -1e30 && (w.p.tma_flags & kTmaO) && "),
            # no-page-ids: a TMA tile's page ids computed, not read from the page table (request r's page i is
            # kv_base + i: right for --layout paged-seq only, whose table is in order): the cost of the page-id loads
            "no-page-ids": ("? __ldg(indices + page_of<Tr::PAGE_SIZE>(j)) : 0;",
                            "? static_cast<int>(it.kv_base) + page_of<Tr::PAGE_SIZE>(j) : 0;"),
            # ragged-box16: a ragged kernel's K/V tiles in boxes of 16 rows (8 a column block), as page 16's are
            # (the host's boxes too: _HOST_WHAT_IFS): with --layout ragged, whether the box count is paging's cost
            "ragged-box16": (("? Tr::PAGE_SIZE : Tr::CTA_KV;", "? Tr::PAGE_SIZE : 16;"),
                             ("c * 64, it.kv_head, static_cast<int>(it.kv_base) + kv0);",
                              "c * 64, it.kv_head, static_cast<int>(it.kv_base) + kv0 + j * ROWS);")),
            # k-gather: K gathered by the producer's cp.async too where V is (only Q and O by TMA): whether the TMA
            # unit's share of a multi-box tile still limits it (where V is gathered: with plain-kv or v-gather; no
            # host half, so the record still says "k")
            "k-gather": ("&& !(IS_V && tma_v_gather<Tr>())) {", "&& !tma_v_gather<Tr>()) {"),
            # tma-one-warp: a tile's boxes issued by lanes of the producer's first warp (box j by lane j), as before
            # run 130: the A/B of tma_box_of
            "tma-one-warp": ("return static_cast<int>((tid % 32) * 4 + tid / 32); }",
                             "return tid < 32 ? static_cast<int>(tid) : 1 << 20; }"),
            # poly-exp2-E (E = 1, 2: eighths): E/8 of the softmax's 8-column blocks take their exponentials from
            # _POLY_EXP2 on the FMA pipe, not MUFU (the twenty-ninth session's poly_exp2, run 140) over the loop as
            # it is now; with --variant softcap: whether moving MUFU work off its pipe pays now that logits_scale
            # took an FMUL a logit out (NaN logits come out 0, not NaN: a what-if, not a kernel to keep)
            # plain-kv: paged K/V tiles in the plain layout (a TMA box a page and 64-column block, V gathered by
            # cp.async), the default before run 147; the interleaved layout (Sm90Traits::KV_INTERLEAVED) off on both
            # sides (the host's 5-D map too: _HOST_WHAT_IFS)
            "plain-kv": ("constexpr bool kKvInterleave = true;", "constexpr bool kKvInterleave = false;"),
            # v-gather: V gathered by cp.async over interleaved tiles too (K alone by TMA: run 147's interleaved-kv)
            "v-gather": ("tma_rows<Tr>() < Tr::CTA_KV && !Tr::KV_INTERLEAVED;\n",
                         "tma_rows<Tr>() < Tr::CTA_KV;  // what-if v-gather\n"),
            # v-box: V by TMA wherever K is, in the plain layout too (--what-if plain-kv+v-box: the kernel before
            # run 129)
            "v-box": ("  return tma_kv<Tr>() && Tr::PAGED && tma_rows<Tr>() < Tr::CTA_KV && !Tr::KV_INTERLEAVED;\n",
                      "  return false;  // what-if v-box\n"),
            # page-offsets: the cp.async gather of pages smaller than a copy pass (page 1: --page-size 1) computing
            # each row's offset in elements, checked and scaled, as before run 150 (kv_load.cuh gather_page_base)
            "page-offsets": ("constexpr bool kGatherPageBase = true;", "constexpr bool kGatherPageBase = false;"),
            "poly-exp2-1": _poly(1),
            "poly-exp2-2": _poly(2),
            "st-cs": (_STORE_ALL, "      if (pr < w.rows_total)\n        __stcs(reinterpret_cast<uint4*>("
                      "w.out_ptr(pr, c)),\n            *reinterpret_cast<const uint4*>(stage + "
                      "tile_offset<Tr::Q_PITCH, Tr::Q_STEP>(row, c)));")}


def _what_if(text: str) -> str:
    """--what-if's value: a name of WHAT_IFS, or several joined by + (applied in that order)."""
    bad = [n for n in text.split("+") if n not in WHAT_IFS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown what-if {bad[0]!r} (one of {', '.join(sorted(WHAT_IFS))}, or "
                                         "several joined by +)")
    return text


def _patched(src: str, what_if: str) -> str:
    for name in what_if.split("+"):
        pairs = WHAT_IFS[name]
        for old, new in pairs if isinstance(pairs[0], tuple) else (pairs,):
            if src.count(old) != 1:
                raise SystemExit(f"sm90_timeline.py: --what-if {name}: its statement is not once in the kernel; "
                                 "update WHAT_IFS")
            src = src.replace(old, new)
    return src


def _box16(tma_boxes):
    """sm90.tma_boxes with a ragged kernel's K/V boxes of 16 rows (what-if ragged-box16)."""
    def boxes(spec, tile):
        q, rows, o = tma_boxes(spec, tile)
        return q, (16 if rows and spec.kv == "ragged" else rows), o
    return boxes


def _v_gathered(tma_v_gather):
    """sm90.tma_v_gather as before run 147 (what-if v-gather): V gathered over interleaved tiles too, which are
    exactly the multi-box paged tiles the rule now leaves out."""
    from attnjit.families import sm90
    return lambda spec, tile: tma_v_gather(spec, tile) or sm90.kv_interleaved(spec, tile)


_HOST_WHAT_IFS = {"ragged-box16": ("tma_boxes", _box16),   # the host's half of a what-if: sm90.<name> wrapped
                  "plain-kv": ("kv_interleaved", lambda f: lambda spec, tile: f(spec, tile, enabled=False)),
                  "v-gather": ("tma_v_gather", _v_gathered),
                  "v-box": ("tma_v_gather", lambda _f: lambda spec, tile: False)}


def _stamped(render, stamps: bool = True, what_if: str | None = None):
    def render_stamped(spec):
        r = render(spec)
        if spec.family != "sm90":
            return r
        src = r.source
        if what_if is not None:
            src = _patched(src, what_if)
        if stamps:
            src = _stamp_items(_stamp_loop(src).replace(_MEMBER, _STAMP), ITEM_BASE)
        return generator.Rendered(spec=r.spec, source=src, kernels=r.kernels, template=r.template)
    return render_stamped


def _max_diff(o, q, k, v, b: int, L: int, causal: bool) -> float:
    """The largest |o - reference| over the batch: torch SDPA (bf16) per request, query head h on kv head h // 4."""
    import torch

    worst = 0.0
    for r in range(b):
        t = slice(r * L, (r + 1) * L)
        qh, kh, vh = (x[t].transpose(0, 1)[None] for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qh, kh.repeat_interleave(4, dim=1), vh.repeat_interleave(4, dim=1), is_causal=causal)
        worst = max(worst, (o[t].float() - ref[0].transpose(0, 1).float()).abs().max().item())
    return worst


def best_ms(run, calls: int = 40, rounds: int = 5) -> float:
    """ms a call of ``run``, called back to back in the stream: the best of ``rounds`` rounds of ``calls`` (after 5
    warm-up calls). The cold GPU's best blocks: for comparisons within one process (benchmarks/harness_ab.py)."""
    import torch

    for _ in range(5):
        run()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def tflops(run, b: int, L: int, causal: bool, calls: int = 40, rounds: int = 5, head_dim: int = 128) -> float:
    """TFLOP/s of ``run`` by best_ms (causal FLOPs 4 B H D L^2 / 2, H = 32 query heads, D = head_dim)."""
    flops = 4 * b * 32 * head_dim * L * L * (0.5 if causal else 1.0)
    return flops / (best_ms(run, calls, rounds) * 1e-3) / 1e12


LAYOUTS = ("paged", "paged-seq", "ragged")
# --variant: the spec's variant and plan()'s arguments for it
VARIANTS = {"softcap": (attnjit.variants.SOFTCAP, {"logits_soft_cap": 30.0})}
SMS_MAX = 256  # CTAs the stamp regions are laid out for (the persistent grid is one per SM)
ITEM_BASE = SMS_MAX * WGS * MAX_REC * 8  # int64s before the item records


def _spec(causal: bool, kv: str, tile: str | None = None, head_dim: int = 128,
          ragged: bool = False, page_size: int = 16) -> AttentionSpec:
    """The benchmark's sm90 prefill spec (bf16 q, page ``page_size``: 16 unless said, group 4) over a ``kv`` cache;
    sm90_sass.py's too. ``ragged``: the same over contiguous K/V tensors (the ragged wrapper)."""
    paging = dict(kv="ragged") if ragged else dict(page_size=page_size)
    return AttentionSpec(op="prefill", head_dim=head_dim, dtype_q="bf16", dtype_o="bf16", dtype_kv=kv,
                         mask="causal" if causal else "none", group_size=4, family="sm90", arch="sm_90a", tile=tile,
                         **paging)


def item_report(stamps) -> dict:
    """Per-item phase means (cycles), over all items and by kv tile count."""
    import numpy as np

    t = stamps.reshape(-1, MAX_ITEMS, 8).astype(np.int64)              # [cta * wg, item, 8]
    valid = (t[..., 0] > 0) & (t[..., 3] > t[..., 0])
    nxt = np.concatenate([t[:, 1:, 0], np.zeros_like(t[:, :1, 0])], axis=1)
    d = np.stack([t[..., 1] - t[..., 0], t[..., 2] - t[..., 1], t[..., 3] - t[..., 2], nxt - t[..., 3]], axis=-1)
    has_next = valid & np.concatenate([valid[:, 1:], np.zeros_like(valid[:, :1])], axis=1)
    out = {"items": int(valid.sum()),
           "phase_cycles": {n: float(d[..., i][has_next if i == 3 else valid].mean()) for i, n in
                            enumerate(ITEM_PHASES)}}
    e1, e2, top = t[..., 5], t[..., 6], t[..., 7]
    staged = valid & (e1 > 0) & (e2 >= e1)
    nxt_top = np.concatenate([top[:, 1:], np.zeros_like(top[:, :1])], axis=1)
    walked = has_next & (nxt_top >= t[..., 3]) & (nxt >= nxt_top)
    fine = [(e1 - t[..., 2], staged), (e2 - e1, staged), (t[..., 3] - e2, staged), (nxt_top - t[..., 3], walked),
            (nxt - nxt_top, walked)]
    out["fine_cycles"] = {n: (float(x[m].mean()) if m.any() else None) for n, (x, m) in zip(FINE_PHASES, fine)}
    tiles = t[..., 4]
    out["by_tiles"] = {int(n): {p: float(d[..., i][valid & (tiles == n)].mean()) for i, p in enumerate(ITEM_PHASES[:3])}
                       for n in np.unique(tiles[valid])[:8]}
    return out


def report(stamps, cycles_per_ns: float | None = None) -> dict:
    """Phase means (cycles) and the share of time both warpgroups of a CTA are in their softmax at once."""
    import numpy as np

    t = stamps.reshape(-1, WGS, MAX_REC, 8)[..., :7].astype(np.int64)  # [cta, wg, rec, 7] (unused wg: zeros)
    valid = (t[..., 0] > 0) & (t[..., 6] > t[..., 0])
    d = np.diff(t, axis=-1)                                          # [cta, wg, rec, 6]
    phases = {name: float(d[..., i][valid].mean()) for i, name in enumerate(PHASES)}
    iteration = float((t[..., 6] - t[..., 0])[valid].mean())
    # overlap of the two warpgroups' softmax intervals [T3, T4], per CTA, over the records both have
    both = 0
    total = 0
    for c in range(t.shape[0]):
        n = int(min(valid[c, 0].sum(), valid[c, 1].sum()))
        if n < 4:
            continue
        s0, e0 = t[c, 0, :n, 3][:, None], t[c, 0, :n, 4][:, None]
        s1, e1 = t[c, 1, :n, 3][None, :], t[c, 1, :n, 4][None, :]
        total += int((e0 - s0).sum())
        both += int(np.maximum(0, np.minimum(e0, e1) - np.maximum(s0, s1)).sum())
    c0 = t[0, :, :12, :] - t[0, 0, 0, 0]  # CTA 0's first iterations, both warpgroups, from its first stamp
    return {"iteration_cycles": iteration, "phase_cycles": phases, "records": int(valid.sum()),
            "softmax_overlap": float(both / total) if total else None, "cta0": c0.tolist()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+", help="BxL of paged causal prefill rows")
    ap.add_argument("--build", action="store_true", help="compile the stamped kernels into the cache and stop")
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "e4m3"), help="the cache's type (e4m3: the fp8 path)")
    ap.add_argument("--head-dim", type=int, default=128, choices=(128, 256),
                    help="the rows' head dim (256: with --no-stamps; the stamps' patches are head_dim 128's loop)")
    ap.add_argument("--tile", default=None, help="an sm90 tile configuration (default: the family's default)")
    ap.add_argument("--variant", default=None, choices=sorted(VARIANTS),
                    help="a built-in variant's kernel and plan (softcap: logits_soft_cap 30)")
    ap.add_argument("--json")
    ap.add_argument("--what-if", type=_what_if,
                    help="patch the kernel (WHAT_IFS; several joined by +) before stamping")
    ap.add_argument("--no-stamps", action="store_true", help="the kernel without stamps (with --time: its speed)")
    ap.add_argument("--time", action="store_true", help="also time run() back to back, TFLOP/s per shape")
    ap.add_argument("--page-size", type=int, default=16, choices=(1, 2, 4, 8, 16, 32, 64),
                    help="the paged cache's page size (1: the token-granular caches, gathered by cp.async)")
    ap.add_argument("--layout", default="paged", choices=LAYOUTS,
                    help="the K/V operand: pages (--page-size) in shuffled order (the benchmark's), the same pages in "
                         "order, or contiguous K and V tensors (the ragged wrapper)")
    args = ap.parse_args()
    jit.render = _stamped(jit.render, stamps=not args.no_stamps, what_if=args.what_if)
    for w in (args.what_if or "").split("+"):
        if w in _HOST_WHAT_IFS:
            from attnjit.families import sm90
            name, wrap = _HOST_WHAT_IFS[w]
            setattr(sm90, name, wrap(getattr(sm90, name)))
    ragged = args.layout == "ragged"
    if ragged and args.kv != "bf16":
        raise SystemExit("sm90_timeline.py: --layout ragged is over a bf16 cache only")
    if args.head_dim != 128 and not args.no_stamps:
        raise SystemExit("sm90_timeline.py: --head-dim 256 times the kernel only: add --no-stamps")
    D = args.head_dim
    ps = args.page_size
    spec = _spec(not args.non_causal, args.kv, tile=args.tile, head_dim=D, ragged=ragged, page_size=ps)
    extra: dict = {}
    if args.variant:
        variant, extra = VARIANTS[args.variant]
        spec = spec.replace(variant=variant)
    if args.build:
        jit.ensure(spec)
        print("built", spec.short_name())
        return 0
    import torch

    from benchmarks.tables import paged_tables

    out = {}
    wrong = False
    for shape in args.shapes:
        b, L = (int(x) for x in shape.split("x"))
        qo = torch.arange(0, b * L + 1, L, dtype=torch.int32, device="cuda")
        q = torch.randn(b * L, 32, D, dtype=torch.bfloat16, device="cuda")
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        causal = not args.non_causal
        if ragged:
            k = torch.randn(b * L, 8, D, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)
            w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="fa3", tile=args.tile)
            w.plan(qo, qo, 32, 8, D, causal=causal, q_data_type=torch.bfloat16, disable_split_kv=True, **extra)
            run = lambda: w.run(q, k, v)  # noqa: E731
        else:
            indptr, indices, last, cache = paged_tables(b, L, seed=1, head_dim=D, page_size=ps)
            if args.layout == "paged-seq":   # the same tables with the pages in order: request r's at r * n ..
                indices = torch.arange(indices.numel(), dtype=torch.int32, device="cuda")
            w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, backend="fa3", tile=args.tile)
            if args.kv == "e4m3":
                cache = cache.to(torch.float8_e4m3fn)
            w.plan(qo, indptr, indices, last, 32, 8, D, ps, causal=causal, q_data_type=torch.bfloat16,
                   kv_data_type=cache.dtype, disable_split_kv=True, **extra)
            run = lambda: w.run(q, cache)  # noqa: E731
            if args.kv == "bf16":
                rows = cache[indices.long()].reshape(b, -1, 2, ps, 8, D)   # request r's pages, in table order
                k = rows[:, :, 0].reshape(b, -1, 8, D)[:, :L].reshape(b * L, 8, D)
                v = rows[:, :, 1].reshape(b, -1, 8, D)[:, :L].reshape(b * L, 8, D)
        assert w._plan.spec == spec, (w._plan.spec, spec)  # the stamped kernel ran
        for _ in range(3):
            run()
        if args.time:
            t0 = time.time()
            out[shape] = {"tflops": round(tflops(run, b, L, causal, head_dim=D), 1)}
            out[shape]["span"] = [t0, time.time()]   # for benchmarks/clocks.py
            out[shape]["tma"] = w._plan.tma_used   # what the TMA unit copied (a map the driver refused: cp.async)
            if args.kv == "bf16" and not args.variant:   # a what-if that breaks the results says so here
                out[shape]["max_diff"] = _max_diff(run(), q, k, v, b, L, causal)
                wrong = wrong or out[shape]["max_diff"] > 0.1
            print(shape, args.layout, args.what_if or "as built", "stamped" if not args.no_stamps else "unstamped",
                  {n: out[shape][n] for n in ("tflops", "max_diff", "tma") if n in out[shape]}, flush=True)
        if args.no_stamps:
            continue
        ws.zero_()
        run()
        torch.cuda.synchronize()
        sms = torch.cuda.get_device_properties(0).multi_processor_count  # the persistent grid
        assert sms <= SMS_MAX
        n = sms * WGS * MAX_REC * 8
        stamps = ws[: n * 8].view(torch.int64).cpu().numpy()
        items = ws[ITEM_BASE * 8: (ITEM_BASE + sms * WGS * MAX_ITEMS * 8) * 8].view(torch.int64).cpu().numpy()
        out[shape] = {**out.get(shape, {}), **report(stamps)}
        out[shape]["items"] = item_report(items)
        shown = {k: v for k, v in out[shape].items() if k not in ("cta0", "span")}
        print(shape, json.dumps(shown, indent=1), flush=True)
        for wg in (0, 1):
            print(f"  cta 0, warpgroup {wg}:", [row[:7] for row in out[shape]["cta0"][wg][:6]], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if wrong:
        print("sm90_timeline.py: WRONG RESULTS (max_diff > 0.1 against torch SDPA): the kernel as patched is not one to "
              "keep", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
