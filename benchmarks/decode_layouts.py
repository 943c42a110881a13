"""Decode TB/s by how many contiguous bytes one KV head's token row is: a probe of issue 14's fp8 gap.

    python3 benchmarks/decode_layouts.py [--json out.json]          # on the GPU machine

The fp8 decode reads ~3.7-3.9 TB/s of fp8 bytes where the bf16 decode reads ~4.3-4.4 (RESULTS.md): 13% fewer
instructions a tile (run 98) did not move it, so the loop's issue is not the limit. One hypothesis left: in the NHD
layout ([page][token][head][dim]) a head's token row is HEAD_DIM x element bytes, 256 B in bf16 d128 but 128 B in
fp8 d128, scattered at a stride of H_kv rows; smaller scattered chunks may cost DRAM efficiency. This times the
same decode batch (H_q 32, H_kv 8, page 16, shuffled pages, bf16 q) over:
  bf16 d128 NHD (256 B rows), bf16 d64 NHD (128 B rows, the fp8 row size in a 16-bit kernel),
  e4m3 d128 NHD (128 B rows), e4m3 d128 HND ([page][head][token][dim]: a page's 16 rows of a head are 2 KB
  contiguous), bf16 d128 HND.
If the row size is the limit, e4m3 HND reads as fast as bf16 and bf16 d64 NHD as slowly as e4m3 NHD.
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
from benchmarks.tables import H_KV, H_Q, paged_tables  # noqa: E402

PS = 16
SHAPES = ((64, 4096), (32, 16384))
CASES = (("bf16", 128, "NHD"), ("bf16", 64, "NHD"), ("e4m3", 128, "NHD"), ("e4m3", 128, "HND"),
         ("bf16", 128, "HND"))


def row(batch: int, kv_len: int, kv: str, d: int, layout: str, ws: torch.Tensor) -> dict:
    indptr, indices, last, _ = paged_tables(batch, kv_len, page_size=PS, dtype=None)  # bench.py's shuffled pages
    total = indices.numel()
    shape = (total, 2, PS, H_KV, d) if layout == "NHD" else (total, 2, H_KV, PS, d)
    cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    kv_dtype, scales = torch.bfloat16, {}
    if kv == "e4m3":
        kv_dtype, cache, scales = fp8.FP8, fp8.quantized(cache), fp8.SCALES
    q = torch.randn(batch, H_Q, d, dtype=torch.bfloat16, device="cuda")
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws, layout)
    w.plan(indptr, indices, last, H_Q, H_KV, d, PS, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    out = torch.empty_like(q)
    ms = time_ms(lambda: w.run(q, cache, out=out, **scales))
    nbytes = batch * kv_len * H_KV * d * 2 * cache.element_size()
    return {"shape": f"{batch}x{kv_len}", "kv": kv, "head_dim": d, "layout": layout,
            "row_bytes": d * cache.element_size() if layout == "NHD" else PS * d * cache.element_size(),
            "ms": ms, "tbps": nbytes / (ms * 1e-3) / 1e12, "plan": w.last_plan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for batch, kv_len in SHAPES:
        for kv, d, layout in CASES:
            r = row(batch, kv_len, kv, d, layout, ws)
            rows.append(r)
            torch.cuda.empty_cache()
    print("| shape | cache | head_dim | layout | contiguous bytes | TB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['kv']} | {r['head_dim']} | {r['layout']} | {r['row_bytes']} | {r['tbps']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
