"""The paged decode workload every benchmark builds: ``batch`` requests of ``kv_len`` tokens each, pages of
``page_size`` tokens in shuffled order, H_q 32 / H_kv 8 / head_dim 128, a random cache of ``dtype`` (or none); and
one decode row of it timed with attnjit and FlashInfer."""

from __future__ import annotations

import random

import torch

H_Q, H_KV, D = 32, 8, 128


def paged_tables(batch: int, kv_len: int, seed: int = 0, *, page_size: int = 16, dtype=torch.bfloat16,
                 head_dim: int = D):
    """(kv_indptr, kv_indices, kv_last_page_len, cache [pages, 2, page_size, H_kv, head_dim] or None), all on the
    GPU."""
    pages_per = -(-kv_len // page_size)
    total = batch * pages_per
    ids = list(range(total))
    random.Random(seed).shuffle(ids)
    indptr = torch.arange(0, total + 1, pages_per, dtype=torch.int32, device="cuda")
    indices = torch.tensor(ids, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), kv_len - page_size * (pages_per - 1), dtype=torch.int32, device="cuda")
    cache = None if dtype is None else torch.randn(total, 2, page_size, H_KV, head_dim, dtype=dtype, device="cuda")
    return indptr, indices, last, cache


def decode_row(fi, batch: int, kv_len: int, *, page_size: int, time_ms, ws, ws_fi, dtype=torch.bfloat16) -> dict:
    """One decode row: attnjit's and (with ``fi``) FlashInfer's tensor-core decode on the same tables and cache,
    ms and TB/s of KV read, attnjit's plan record and the two outputs' largest difference."""
    import attnjit

    indptr, indices, last, cache = paged_tables(batch, kv_len, page_size=page_size, dtype=dtype)
    q = torch.randn(batch, H_Q, D, dtype=dtype, device="cuda")
    kv_bytes = batch * kv_len * H_KV * D * 2 * dtype.itemsize
    row = {"shape": f"{batch}x{kv_len}", "kv_bytes": kv_bytes}
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(indptr, indices, last, H_Q, H_KV, D, page_size, q_data_type=dtype)
    out = torch.empty_like(q)
    row["attnjit_ms"] = time_ms(lambda: w.run(q, cache, out=out))
    row["attnjit_plan"] = w.last_plan
    if fi is not None:
        fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws_fi(), "NHD", use_tensor_cores=True)
        fw.plan(indptr, indices, last, H_Q, H_KV, D, page_size, q_data_type=dtype, kv_data_type=dtype)
        fout = torch.empty_like(q)
        row["flashinfer_ms"] = time_ms(lambda: fw.run(q, cache, out=fout))
        row["max_diff_vs_flashinfer"] = (out.float() - fout.float()).abs().max().item()
    for k in ("attnjit", "flashinfer"):
        if f"{k}_ms" in row:
            row[f"{k}_tbps"] = kv_bytes / (row[f"{k}_ms"] * 1e-3) / 1e12
    del cache
    torch.cuda.empty_cache()
    return row
