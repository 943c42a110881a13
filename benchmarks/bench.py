"""attnjit against FlashInfer (and torch SDPA for prefill) on the KERNELS.md workloads, in one process.

Workloads: H_q 32, H_kv 8, head_dim 128, bf16, page_size 16, NHD, pages in shuffled order.
  decode  batch x KV length: 1x32768 16x4096 64x4096 128x2048 256x1024 32x16384
          figure: TB/s of KV read = batch * kv_len * H_kv * D * 2 (K and V) * 2 bytes / time
  prefill (benchmarks/prefill.py) paged causal, no prefix, batch x length: 1x8192 8x2048 32x512, plus non-causal,
          head_dim 64 and 256, page_size 1 and ragged rows; attnjit on its default family (sm90 on Hopper) and on
          fa2, FlashInfer fa2 and fa3, torch SDPA (cuDNN); figure: TFLOP/s = 4 * batch * H_q * D * L^2 (/ 2 causal)
  variants: built-ins and a user variant on the default family (prefill) and on decode
Ceilings measured in the same run: device copy (read + write) and an 8192^3 bf16 matmul.
Timing: CUDA events around 30 back-to-back calls (after 10 warm-up calls), median of 7 such blocks; each call is
a whole run() (all its launches). A prefill row's implementations (and the variants) are timed interleaved, block by
block (attnjit.timing.time_many), so that none runs on a GPU the others heated. Every input is random; KV caches
are larger than the 60 MB L2.

    python benchmarks/bench.py [--only decode|prefill|variants] [--main-only] [--no-flashinfer] [--json OUT.json]
    python benchmarks/bench.py --only cascade   # shared-prefix decode (benchmarks/cascade.py; not in the default run)
    python benchmarks/bench.py --only fp8       # fp8 (e4m3) KV decode vs bf16 and FlashInfer (benchmarks/fp8.py)
    python benchmarks/bench.py --sweep      # prefill tile variants (tuning aid; compiles each variant)
    python benchmarks/bench.py --order-sweep   # prefill work orders: request-grouped vs longest-first
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnjit  # noqa: E402
from attnjit.timing import time_many as _time_many  # noqa: E402
from attnjit.timing import time_ms as _time_ms  # noqa: E402
from benchmarks import cascade, fp8, pagesize, prefill  # noqa: E402
from benchmarks.clocks import Spans  # noqa: E402
from benchmarks.tables import decode_row, paged_tables  # noqa: E402

# every timed block's wall-clock span, for benchmarks/clocks.py (the SM clock and power each figure was measured at)
time_ms = Spans(_time_ms)
time_many = time_ms.interleaved(_time_many)

H_Q, H_KV, D, PS, DT = 32, 8, 128, 16, torch.bfloat16
DECODE_ROWS = [(1, 32768), (16, 4096), (64, 4096), (128, 2048), (256, 1024), (32, 16384)]
PREFILL_ROWS = [(1, 8192), (8, 2048), (32, 512)]


def load_flashinfer():
    try:
        import flashinfer  # noqa: F401

        return flashinfer
    except Exception as exc:  # noqa: BLE001
        print(f"# FlashInfer unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def bench_decode(fi, rows, results):
    for batch, kv_len in rows:
        results.append({"op": "decode", **decode_row(fi, batch, kv_len, page_size=PS, time_ms=time_ms, ws=_ws(),
                                                     ws_fi=ws_fi, dtype=DT)})


_workspaces: dict[str, torch.Tensor] = {}


def _workspace(who: str) -> torch.Tensor:
    """One 256 MiB workspace per library, allocated once."""
    if who not in _workspaces:
        _workspaces[who] = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return _workspaces[who]


def ws_fi():
    return _workspace("flashinfer")


def _ws():
    return _workspace("attnjit")


def bench_prefill(fi, rows, results, sdpa: bool = True, families=("auto", "fa2")):
    """Paged causal prefill rows (batch, length) through benchmarks/prefill.py (both families, FlashInfer, SDPA)."""
    prefill.bench_rows(fi, [prefill.Row(b, L) for b, L in rows], results, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi,
                       sdpa=sdpa, families=families, time_many=time_many)


def measure_ceilings() -> dict:
    """The two ceilings in this run: device copy (bytes read + written) and a bf16 matmul, on random data."""
    n = 1 << 30  # 2 GiB of bf16 each way
    a = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    copy_ms = time_ms(lambda: b.copy_(a), reps=10, blocks=5, warmup=3)
    del a, b
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = time_ms(lambda: m @ k, reps=10, blocks=5, warmup=3)
    del m, k
    torch.cuda.empty_cache()
    return {"copy_tbps": 2 * n / (copy_ms * 1e-3) / 1e12, "matmul_tflops": 2 * 8192 ** 3 / (mm_ms * 1e-3) / 1e12}


NOOP = attnjit.Variant("noop", logits_transform="return logit;")
# (feature, plan() arguments, run() arguments, FlashInfer plan() arguments or None)
VARIANT_ROWS = [("default", {}, {}, {}), ("noop variant", {}, {}, None),
                ("soft-cap 30", {"logits_soft_cap": 30.0}, {}, {"logits_soft_cap": 30.0}),
                ("window 1024", {"window_left": 1024}, {}, {"window_left": 1024}),
                ("ALiBi", {"pos_encoding_mode": "ALIBI"}, {}, None)]


def bench_variants(fi, results) -> None:
    """Cost of each built-in on a decode row, against the default kernel and FlashInfer's feature (the prefill
    variants: prefill.bench_variants)."""
    batch, length = 64, 4096
    indptr, indices, last, cache = paged_tables(batch, length, seed=2)
    q = torch.randn(batch, H_Q, D, dtype=DT, device="cuda")
    out = torch.empty_like(q)
    for feature, plan_kw, run_kw, fi_kw in VARIANT_ROWS:
        row = {"op": "decode variants", "shape": f"{batch}x{length}", "feature": feature}
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(_ws(), variant=NOOP if feature == "noop variant" else None)
        w.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=DT, **plan_kw)
        row["attnjit_ms"] = time_ms(lambda: w.run(q, cache, out=out, **run_kw))
        if fi is not None and fi_kw is not None:
            try:
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws_fi(), "NHD", use_tensor_cores=True)
                fw.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=DT, kv_data_type=DT, **fi_kw)
                fout = torch.empty_like(q)
                row["flashinfer_ms"] = time_ms(lambda: fw.run(q, cache, out=fout))
                row["max_diff_vs_flashinfer"] = (out.float() - fout.float()).abs().max().item()
            except Exception as exc:  # noqa: BLE001
                row["flashinfer_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        results.append(row)
    del cache
    torch.cuda.empty_cache()


def variant_table(rows) -> str:
    lines = ["| op | shape | feature | attnjit ms | vs attnjit default | FlashInfer ms | attnjit / FlashInfer |",
             "|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        key = (r["op"], r["shape"])
        base.setdefault(key, r["attnjit_ms"])
        f = r.get("flashinfer_ms")
        fi_ms = f"{f:.4f}" if f else r.get("flashinfer_error", "-")[:40]
        ratio = f"{f / r['attnjit_ms']:.2f}" if f else "-"
        lines.append(f"| {r['op']} | {r['shape']} | {r['feature']} | {r['attnjit_ms']:.4f} | "
                     f"{r['attnjit_ms'] / base[key]:.3f} | {fi_ms} | {ratio} |")
    return "\n".join(lines)


# Prefill tile variants tried by --sweep: (warps_q, warps_kv, mma_q, mma_kv, stages, min_blocks)
SWEEP = [(4, 1, 2, 4, 2, 1), (4, 1, 2, 2, 2, 2), (4, 1, 2, 2, 2, 3), (4, 1, 1, 4, 2, 2), (4, 1, 1, 2, 3, 3),
         (4, 1, 1, 2, 2, 3), (8, 1, 1, 4, 2, 1)]
# Decode (narrow) tile variants: group 4 packs into one 16-row block; warps split the KV tile
SWEEP_DECODE = [(1, 4, 1, 1, 3, 2), (1, 4, 1, 1, 2, 3), (1, 4, 1, 1, 4, 1), (1, 4, 1, 2, 2, 2), (1, 2, 1, 2, 3, 2),
                (1, 4, 1, 1, 2, 4)]


def _sweep_tiles(factory: str, variants, run_rows, metric: str, digits: int) -> list[dict]:
    """Time each tile variant as ``attnjit.families.fa2.<factory>``'s tile (a tuning aid: the winner goes into the
    family). ``run_rows(res)`` appends one result row per shape; a tile that does not build is reported."""
    from attnjit import dispatch, generator
    from attnjit.families import fa2

    original = getattr(fa2, factory)
    out = []
    try:
        for v in variants:
            tile = fa2.Tile(D, PS, *v)
            setattr(fa2, factory, lambda *args, tile=tile: tile)
            generator.render.cache_clear()
            fa2.tiles.cache_clear()
            dispatch.clear_memory()
            res: list[dict] = []
            try:
                run_rows(res)
            except Exception as exc:  # noqa: BLE001  (a tile that does not fit: say so, go on)
                out.append({"tile": tile.name, "variant": v, "error": str(exc)[:200]})
                continue
            out.append({"tile": tile.name, "variant": v, "smem": tile.smem,
                        **{r["shape"]: round(r[metric], digits) for r in res}})
            print(json.dumps(out[-1]), flush=True)
    finally:
        setattr(fa2, factory, original)
        generator.render.cache_clear()
        fa2.tiles.cache_clear()
        dispatch.clear_memory()
    return out


def sweep_decode(rows) -> list[dict]:
    return _sweep_tiles("narrow_tile", SWEEP_DECODE, lambda res: bench_decode(None, rows, res), "attnjit_tbps", 2)


# The deep decode tile (batches that cannot fill the GPU) tried by --deep-sweep, the current one first
SWEEP_DEEP = [(1, 4, 1, 1, 4, 1, "deep"), (1, 4, 1, 1, 5, 1, "deep"), (1, 4, 1, 1, 6, 1, "deep"),
              (1, 8, 1, 1, 3, 1, "deep"), (1, 8, 1, 1, 2, 1, "deep"), (1, 4, 1, 2, 3, 1, "deep"),
              (1, 4, 1, 1, 3, 2, "deep")]
SMALL_DECODE_ROWS = [(1, 32768), (16, 4096), (4, 16384)]


# fp8 decode (narrow) tile variants tried by --fp8-sweep; stages as for 16-bit K/V (fa2.fp8_tile doubles them)
SWEEP_FP8 = [(1, 4, 1, 1, 3, 2), (1, 4, 1, 1, 2, 3), (1, 4, 1, 2, 2, 2), (1, 8, 1, 1, 2, 2), (1, 4, 1, 1, 4, 1),
             (1, 8, 1, 1, 3, 1)]
FP8_SWEEP_ROWS = [(64, 4096), (1, 32768), (16, 4096), (32, 16384)]


def sweep_fp8(rows) -> list[dict]:
    return _sweep_tiles("narrow_tile", SWEEP_FP8,
                        lambda res: fp8.bench_fp8(None, rows, res, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi),
                        "attnjit_fp8_tbps", 2)


def sweep_deep(rows) -> list[dict]:
    return _sweep_tiles("deep_decode_tile", SWEEP_DEEP, lambda res: bench_decode(None, rows, res), "attnjit_tbps", 2)


def sweep_prefill(rows) -> list[dict]:
    return _sweep_tiles("wide_tile", SWEEP, lambda res: bench_prefill(None, rows, res, sdpa=False, families=("fa2",)),
                        "attnjit_fa2_tflops", 1)


def sweep_grid(rows) -> list[dict]:
    """Prefill with a persistent grid (CTAs loop over the work list with stride gridDim.x) of 1x, 2x or 3x the
    resident slots, against one CTA per (item, head): does CTA launch/retire cost matter on short rows?"""
    ws = _ws()
    out = []
    for batch, length in rows:
        indptr, indices, last, cache = paged_tables(batch, length, seed=1)
        qo_indptr = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
        q = torch.randn(batch * length, H_Q, D, dtype=DT, device="cuda")
        flops = 4 * batch * H_Q * D * length * length / 2
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
        w.plan(qo_indptr, indptr, indices, last, H_Q, H_KV, D, PS, causal=True, q_data_type=DT)
        o = torch.empty_like(q)
        full = w._plan.attn.grid
        slots = w._plan.work.slots_target
        row = {"shape": f"{batch}x{length}", "ctas": full[0], "slots": slots}
        ref = w.run(q, cache).float()
        for name, g in (("one_per_item", full[0]), ("persistent_1x", slots), ("persistent_2x", 2 * slots),
                        ("persistent_3x", 3 * slots)):
            w._plan.attn.grid = (min(g, full[0]), 1, 1)
            row[name] = round(flops / time_ms(lambda: w.run(q, cache, out=o)) / 1e9, 1)
            row[name + "_maxdiff"] = (o.float() - ref).abs().max().item()
        w._plan.attn.grid = full
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _lpt_order(work):
    """The work list in pure longest-first order over the whole batch (the order before request grouping)."""
    import numpy as np

    from attnjit.ops.scheduler import item_costs

    cost = item_costs(work.records, cta_q=work.tile.cta_q, group=H_Q // H_KV, causal=True)
    work.records = work.records[np.argsort(-cost, kind="stable")]
    return work


def sweep_order(rows) -> list[dict]:
    """Prefill with the work list in request-grouped order (the scheduler's) against pure longest-first."""
    from attnjit.ops import _wrapper

    original = _wrapper.plan_work
    out = []
    try:
        for name, fn in (("request_grouped", original),
                         ("global_lpt", lambda **kw: _lpt_order(original(**kw)))):
            _wrapper.plan_work = fn
            res: list[dict] = []
            bench_prefill(None, rows, res, sdpa=False)
            out.append({"order": name, **{r["shape"]: round(r["attnjit_tflops"], 1) for r in res},
                         **{f"{r['shape']} fa2": round(r["attnjit_fa2_tflops"], 1) for r in res}})
            print(json.dumps(out[-1]), flush=True)
    finally:
        _wrapper.plan_work = original
    return out


def sweep_sm90(rows, names: str = "") -> list[dict]:
    """Every sm90 tile configuration of the default spec (or those ``names`` lists) on the prefill rows, with
    FlashInfer fa3 and cuDNN in the same process (what the family's default should be; ``attnjit tune`` does this per
    spec on one shape)."""
    from attnjit.families import sm90
    from benchmarks.sm90_timeline import _spec

    known = sm90.tile_names(_spec(True, "bf16"))  # the rows' configurations (head_dim 64 or 128, a 16-bit cache)
    tiles = tuple(filter(None, names.split(","))) or tuple(known)
    unknown = [t for t in tiles if t not in known]
    if unknown:
        raise SystemExit(f"bench.py: unknown sm90 tile configuration(s) {unknown}; known: {', '.join(known)}")
    fi = load_flashinfer()
    res: list[dict] = []
    prefill.bench_rows(fi, rows, res, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi,
                       families=tuple(f"fa3@{t}" for t in tiles),
                       fi_backends=("fa3",), time_many=time_many)
    print(prefill.tile_table(res, tiles), flush=True)
    return res


def table(results, copy_tbps: float) -> str:
    lines = ["| op | shape | attnjit | FlashInfer | ratio | attnjit / ceiling |", "|---|---|---|---|---|---|"]
    for r in results:
        a, f = r.get("attnjit_tbps"), r.get("flashinfer_tbps")
        ratio = f"{a / f:.2f}" if a and f else "-"
        fs = f"{f:.2f} TB/s" if f else "-"
        lines.append(f"| {r['op']} | {r['shape']} | {a:.2f} TB/s | {fs} | {ratio} | {a / copy_tbps:.0%} |")
    return "\n".join(lines)


SECTIONS = ("decode", "prefill", "variants", "cascade", "pagesize", "fp8")


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(filter(None, (x.strip() for x in text.split(","))))
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {bad or [text]}; choose from {', '.join(SECTIONS)}")
    return names


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", type=_sections, default=None,
                    help=f"comma-separated sections to run, in that order ({', '.join(SECTIONS)}); default: decode, "
                         "prefill, variants")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--main-only", action="store_true", help="prefill: only the three main rows")
    ap.add_argument("--fi-skip", default="",
                    help="FlashInfer modules not to run, e.g. fa3:64,fa3:256,fa3:variants (or one: fa3:window)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--tiles", default="", help="--sm90-sweep: the configurations to time (default: all)")
    sweeps = {  # flag -> (help, the sweep): each a tuning aid that times its variants and exits
        "sweep": ("time the prefill tile variants in SWEEP",
                  lambda: sweep_prefill(PREFILL_ROWS) + sweep_decode(DECODE_ROWS)),
        "grid_sweep": ("time prefill with persistent grids (sweep_grid)", lambda: sweep_grid(PREFILL_ROWS)),
        "order_sweep": ("time prefill work orders (sweep_order)", lambda: sweep_order(PREFILL_ROWS)),
        "deep_sweep": ("time the deep decode tile variants in SWEEP_DEEP", lambda: sweep_deep(SMALL_DECODE_ROWS)),
        "fp8_sweep": ("time the fp8 decode tile variants in SWEEP_FP8", lambda: sweep_fp8(FP8_SWEEP_ROWS)),
        "sm90_sweep": ("time the sm90 tile configurations (sweep_sm90)",
                       lambda: sweep_sm90(prefill.MAIN + ([] if args.main_only else
                                                          [r for r in prefill.EXTRA if r.head_dim <= 128]),
                                          args.tiles)),
    }
    for flag, (text, _) in sweeps.items():
        ap.add_argument("--" + flag.replace("_", "-"), action="store_true", help=text)
    args = ap.parse_args()
    for flag, (_, run) in sweeps.items():
        if getattr(args, flag):
            rows = run()
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
            return 0
    fi = None if args.no_flashinfer else load_flashinfer()
    fi_skip = frozenset(filter(None, args.fi_skip.split(",")))
    t0 = time.time()
    ceilings = measure_ceilings()
    print(json.dumps({"ceilings": ceilings}), flush=True)
    decode_rows: list[dict] = []
    prefill_rows: list[dict] = []
    variant_rows: list[dict] = []
    cascade_rows: list[dict] = []
    fp8_rows: list[dict] = []
    fp8_prefill_rows: list[dict] = []
    only = args.only or ("decode", "prefill", "variants")
    page_rows: list[dict] = []

    def fp8_section():
        fp8.bench_fp8(fi, DECODE_ROWS, fp8_rows, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi)
        print(fp8.table(fp8_rows), flush=True)
        try:
            fp8.bench_fp8_prefill(fi, prefill.MAIN, fp8_prefill_rows, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi)
            print(fp8.prefill_table(fp8_prefill_rows), flush=True)
        except Exception as exc:  # noqa: BLE001 (the other sections still run; the error is in the output)
            print(f"# fp8 prefill rows failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def prefill_section():
        rows = prefill.MAIN + ([] if args.main_only else prefill.EXTRA)
        prefill.bench_rows(fi, rows, prefill_rows, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi, fi_skip=fi_skip,
                           time_many=time_many)
        print(prefill.table(prefill_rows, ceilings["matmul_tflops"]), flush=True)

    def variants_section():
        prefill.bench_variants(fi, variant_rows, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi, fi_skip=fi_skip,
                               time_many=time_many)
        bench_variants(fi, variant_rows)

    def pagesize_section():
        pagesize.bench_page_sizes(fi, page_rows, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi)
        print(pagesize.table(page_rows), flush=True)

    def cascade_section():
        cascade.bench_cascade(fi, cascade_rows, time_ms=time_ms, ws=_ws(), ws_fi=ws_fi)
        print(cascade.table(cascade_rows), flush=True)

    def decode_section():
        bench_decode(fi, DECODE_ROWS, decode_rows)
        print(table(decode_rows, ceilings["copy_tbps"]), flush=True)

    sections = {"pagesize": pagesize_section, "fp8": fp8_section, "cascade": cascade_section,
                "decode": decode_section, "prefill": prefill_section, "variants": variants_section}
    for name in only:   # in the order given (a call that may be cut short runs what matters most first)
        sections[name]()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "flashinfer": getattr(fi, "__version__", None), "seconds": round(time.time() - t0, 1),
            "date": time.strftime("%Y-%m-%d"), "ceilings": ceilings, "spans": time_ms.spans}
    if args.json:
        doc = {"meta": meta, "decode": decode_rows, "prefill": prefill_rows, "variants": variant_rows}
        if cascade_rows:
            doc["cascade"] = cascade_rows
        if fp8_rows:
            doc["fp8"] = fp8_rows
            doc["fp8_prefill"] = fp8_prefill_rows
        if page_rows:
            doc["pagesize"] = page_rows
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(json.dumps(meta))
    if decode_rows:
        print(table(decode_rows, ceilings["copy_tbps"]))
    if prefill_rows:
        print(prefill.table(prefill_rows, ceilings["matmul_tflops"]))
    if cascade_rows:
        print(cascade.table(cascade_rows))
    if fp8_rows:
        print(fp8.table(fp8_rows))
        if fp8_prefill_rows:
            print(fp8.prefill_table(fp8_prefill_rows))
    if page_rows:
        print(pagesize.table(page_rows))
    if variant_rows:
        print(prefill.variant_table([r for r in variant_rows if r["op"] == "prefill variants"]))
        print(variant_table([r for r in variant_rows if r["op"] != "prefill variants"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
