"""Where a decode call's fixed cost goes: issue 11's small-batch rows (1x32768 at ~3.2 TB/s, 16x4096 at ~3.95)
against the long ones (32x16384 at ~4.45).

    python3 benchmarks/decode_fixed.py [--json out.json]          # on the GPU machine

Three probes, each timed back to back in the stream (attnjit.timing.time_ms) and once more as CUDA-graph replays
(no host launch cost between calls):
  1. length: batch 1, bf16 (and e4m3) cache, KV length 4096 .. 131072; a least-squares line t = a + bytes / bw
     gives the fixed cost a and the streaming rate bw. The same for a plain read of the same bytes (a torch sum of
     a dense tensor of that size, float32 accumulation) and a device copy, so the fixed cost of any kernel that
     reads this many bytes stands beside attnjit's.
  2. split: 1x32768 bf16 with fixed_split_size 256 .. 8192 and split disabled (work items per call, of the
     CTA slots), to see the partial-state merge's and the load balance's share.
  3. floor: the smallest decode (1x16), the per-call time no KV traffic explains.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import attnjit  # noqa: E402
from attnjit.timing import time_ms  # noqa: E402
from benchmarks import fp8  # noqa: E402
from benchmarks.tables import D, H_KV, H_Q, paged_tables  # noqa: E402

PS = 16
LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
SPLITS = (256, 512, 1024, 2048, 4096, 8192, None)   # None: split disabled


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def decode_call(batch: int, kv_len: int, kv: str, ws: torch.Tensor, **plan_kw):
    indptr, indices, last, cache = paged_tables(batch, kv_len, page_size=PS)
    scales = {}
    kv_dtype = torch.bfloat16
    if kv == "e4m3":
        kv_dtype, cache, scales = fp8.FP8, fp8.quantized(cache), fp8.SCALES
    q = torch.randn(batch, H_Q, D, dtype=torch.bfloat16, device="cuda")
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=torch.bfloat16, kv_data_type=kv_dtype, **plan_kw)
    out = torch.empty_like(q)
    nbytes = batch * kv_len * H_KV * D * 2 * cache.element_size()
    return (lambda: w.run(q, cache, out=out, **scales)), nbytes, w.last_plan


def times(fn) -> dict:
    eager = time_ms(fn)
    try:
        graph = time_ms(fn, graph=True)
    except Exception as e:  # noqa: BLE001 — a probe, not a test: record why and go on
        graph = None
        print(f"graph timing failed: {e}", file=sys.stderr)
    return {"us": eager * 1e3, "graph_us": None if graph is None else graph * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows: list[dict] = []
    for kv in ("bf16", "e4m3"):
        for n in LENGTHS:
            fn, nbytes, plan = decode_call(1, n, kv, ws)
            rows.append({"probe": "length", "who": f"attnjit {kv}", "shape": f"1x{n}", "bytes": nbytes,
                         "plan": plan, **times(fn)})
            del fn
    for n in LENGTHS:   # plain reads and copies of the bf16 cache's byte counts
        nbytes = n * H_KV * D * 2 * 2
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        rows.append({"probe": "length", "who": "torch sum", "shape": f"1x{n}", "bytes": nbytes,
                     **times(lambda: x.sum(dtype=torch.float32))})
        rows.append({"probe": "length", "who": "torch copy (read bytes)", "shape": f"1x{n}", "bytes": nbytes,
                     **times(lambda: y.copy_(x))})
        del x, y
    for split in SPLITS:
        kw = {"disable_split_kv": True} if split is None else {"fixed_split_size": split}
        fn, nbytes, plan = decode_call(1, 32768, "bf16", ws, **kw)
        rows.append({"probe": "split", "who": "attnjit bf16", "shape": "1x32768", "split": split or "off",
                     "bytes": nbytes, "plan": plan, **times(fn)})
        del fn
    fn, nbytes, plan = decode_call(1, 16, "bf16", ws)
    rows.append({"probe": "floor", "who": "attnjit bf16", "shape": "1x16", "bytes": nbytes, "plan": plan, **times(fn)})
    for r in rows:
        for k in ("us", "graph_us"):
            t = r.get(k)
            r[k.replace("us", "tbps")] = None if t is None else r["bytes"] / (t * 1e-6) / 1e12
    fits = []
    for who in sorted({r["who"] for r in rows if r["probe"] == "length"}):
        pts = [r for r in rows if r["probe"] == "length" and r["who"] == who]
        for k in ("us", "graph_us"):
            if any(r[k] is None for r in pts):
                continue
            a, b = fit([r["bytes"] for r in pts], [r[k] for r in pts])
            fits.append({"who": who, "timing": k, "fixed_us": a, "stream_tbps": 1e-6 / b})
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "fits": fits}, indent=1, default=str))
    print("| probe | who | shape | split | us | TB/s | graph us | graph TB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        g = "" if r["graph_us"] is None else f"{r['graph_us']:.1f} | {r['graph_tbps']:.2f}"
        print(f"| {r['probe']} | {r['who']} | {r['shape']} | {r.get('split', '')} | {r['us']:.1f} | "
              f"{r['tbps']:.2f} | {g or ' | '} |")
    print("\n| who | timing | fixed us | streaming TB/s |\n| --- | --- | --- | --- |")
    for f in fits:
        print(f"| {f['who']} | {f['timing']} | {f['fixed_us']:.1f} | {f['stream_tbps']:.2f} |")


if __name__ == "__main__":
    main()
