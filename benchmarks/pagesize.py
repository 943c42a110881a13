"""Decode at page sizes that are not powers of two: issue 14's item 4 row. ``python benchmarks/bench.py --only
pagesize`` runs it.

Workload: decode 64x4096 and 16x4096 (H_q 32, H_kv 8, head_dim 128, bf16, NHD, pages shuffled) at page sizes
32, 48, 64 (48 between its powers of two) and 512, 528 (vLLM's hybrid-model block size). attnjit compiles the page
size in; FlashInfer takes it at run time (its tensor-core decode wrapper), both in the same process.
Target: each non-power-of-two size within 10% of the nearest power of two (48 against 32 and 64, 528 against 512),
in TB/s of KV read.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

H_Q, H_KV, D, DT = 32, 8, 128, torch.bfloat16
PAGE_SIZES = (32, 48, 64, 512, 528)
ROWS = ((64, 4096), (16, 4096))
NEAREST = {48: (32, 64), 528: (512,)}


def _tables(batch: int, kv_len: int, page_size: int, seed: int = 0):
    pages_per = -(-kv_len // page_size)
    total = batch * pages_per
    ids = list(range(total))
    random.Random(seed).shuffle(ids)
    indptr = torch.arange(0, total + 1, pages_per, dtype=torch.int32, device="cuda")
    indices = torch.tensor(ids, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), kv_len - page_size * (pages_per - 1), dtype=torch.int32, device="cuda")
    cache = torch.randn(total, 2, page_size, H_KV, D, dtype=DT, device="cuda")
    return indptr, indices, last, cache


def bench_page_sizes(fi, results: list[dict], *, time_ms: Callable, ws: torch.Tensor, ws_fi: Callable) -> None:
    import attnjit

    for batch, kv_len in ROWS:
        for ps in PAGE_SIZES:
            indptr, indices, last, cache = _tables(batch, kv_len, ps)
            q = torch.randn(batch, H_Q, D, dtype=DT, device="cuda")
            kv_bytes = batch * kv_len * H_KV * D * 2 * 2
            row = {"op": "decode page size", "shape": f"{batch}x{kv_len}", "page_size": ps, "kv_bytes": kv_bytes}
            w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
            w.plan(indptr, indices, last, H_Q, H_KV, D, ps, q_data_type=DT)
            out = torch.empty_like(q)
            row["attnjit_ms"] = time_ms(lambda: w.run(q, cache, out=out))
            row["attnjit_plan"] = w.last_plan
            if fi is not None:
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws_fi(), "NHD", use_tensor_cores=True)
                fw.plan(indptr, indices, last, H_Q, H_KV, D, ps, q_data_type=DT, kv_data_type=DT)
                fout = torch.empty_like(q)
                row["flashinfer_ms"] = time_ms(lambda: fw.run(q, cache, out=fout))
                row["max_diff_vs_flashinfer"] = (out.float() - fout.float()).abs().max().item()
            for k in ("attnjit", "flashinfer"):
                if f"{k}_ms" in row:
                    row[f"{k}_tbps"] = kv_bytes / (row[f"{k}_ms"] * 1e-3) / 1e12
            results.append(row)
            del cache
            torch.cuda.empty_cache()
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
