"""Decode at page sizes that are not powers of two: issue 14's item 4 row. ``python benchmarks/bench.py --only
pagesize`` runs it.

Workload: decode 64x4096 and 16x4096 (H_q 32, H_kv 8, head_dim 128, bf16, NHD, pages shuffled) at page sizes
32, 48, 64 (48 between its powers of two) and 512, 528 (vLLM's hybrid-model block size). attnjit compiles the page
size in; FlashInfer takes it at run time (its tensor-core decode wrapper), both in the same process.
Target: each non-power-of-two size within 10% of the nearest power of two (48 against 32 and 64, 528 against 512),
in TB/s of KV read.
"""

from __future__ import annotations

from typing import Callable

import torch

from benchmarks.tables import decode_row

DT = torch.bfloat16
PAGE_SIZES = (32, 48, 64, 512, 528)
ROWS = ((64, 4096), (16, 4096))
NEAREST = {48: (32, 64), 528: (512,)}


def bench_page_sizes(fi, results: list[dict], *, time_ms: Callable, ws: torch.Tensor, ws_fi: Callable) -> None:
    for batch, kv_len in ROWS:
        for ps in PAGE_SIZES:
            row = decode_row(fi, batch, kv_len, page_size=ps, time_ms=time_ms, ws=ws, ws_fi=ws_fi, dtype=DT)
            results.append({"op": "decode page size", "page_size": ps, **row})
    by = {(r["shape"], r["page_size"]): r for r in results if r["op"] == "decode page size"}
    for (shape, ps), r in by.items():
        if ps in NEAREST:
            ref = [by[(shape, p)]["attnjit_tbps"] for p in NEAREST[ps] if (shape, p) in by]
            if ref:
                r["vs_nearest_pow2"] = r["attnjit_tbps"] / max(ref)


def table(rows: list[dict]) -> str:
    lines = ["| shape | page size | attnjit TB/s | FlashInfer TB/s | attnjit / FlashInfer | vs nearest power of two "
             "(>= 0.90) |", "|---|---|---|---|---|---|"]
    for r in rows:
        fi = f"{r['flashinfer_tbps']:.2f}" if "flashinfer_tbps" in r else "-"
        ratio = f"{r['attnjit_tbps'] / r['flashinfer_tbps']:.2f}" if "flashinfer_tbps" in r else "-"
        near = f"{r['vs_nearest_pow2']:.2f}" if "vs_nearest_pow2" in r else ""
        lines.append(f"| {r['shape']} | {r['page_size']} | {r['attnjit_tbps']:.2f} | {fi} | {ratio} | {near} |")
    return "\n".join(lines)
