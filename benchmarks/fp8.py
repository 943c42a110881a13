"""FP8 KV cache decode and prefill: issue 14 item 1's rows. ``python benchmarks/bench.py --only fp8`` runs them.

Workload: the decode rows of bench.py (H_q 32, H_kv 8, head_dim 128, bf16 q and out, page_size 16, NHD, pages
shuffled), with the cache in e4m3 (k_scale, v_scale Python floats, so nothing syncs). Timed in one process:
  * attnjit bf16: the same batch over a bf16 cache (the baseline of the ratio);
  * attnjit e4m3: BatchDecodeWithPagedKVCacheWrapper(kv_data_type=torch.float8_e4m3fn), run(k_scale=, v_scale=);
  * attnjit e4m3 with fp16 q and out (the same cache): the fp8 -> 16-bit conversion is one instruction per two
    values for fp16, three more for bf16;
  * FlashInfer e4m3, both of its decode paths: use_tensor_cores=True (its fa2 prefill module with an fp8 KV type)
    and False (its CUDA-core decode module); the row compares against the faster.
Figures: KV tokens/s (batch * kv_len / time), the fp8 / bf16 ratio of attnjit (target >= 1.8: the same TB/s of half
the bytes) and TB/s of fp8 bytes read (batch * kv_len * H_kv * D * 2 (K and V) * 1 byte / time). Both libraries
read the same quantized cache; max_diff_vs_flashinfer is their outputs' largest difference.

Prefill (bench_fp8_prefill): the paged causal rows of benchmarks/prefill.py with the cache in e4m3 under bf16 q,
attnjit's default wrapper (plan() picks the family: sm90 reads only 16-bit caches, so fa2 runs) against the same rows
over the bf16 cache (sm90) and FlashInfer's fa2 backend over the e4m3 cache; TFLOP/s as in prefill.py.
"""

from __future__ import annotations

from typing import Callable

import torch

from benchmarks.tables import D, H_KV, H_Q, paged_tables

PS, DT = 16, torch.bfloat16
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 1 / 48, 1 / 40   # the cache holds k / K_SCALE: unit-variance keys stay inside e4m3's range


SCALES = {"k_scale": K_SCALE, "v_scale": V_SCALE}   # run()'s arguments for a quantized() cache


def quantized(cache: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """The fp8 cache (e4m3, or ``dtype``) of a 16-bit [P, 2, ...] cache: k / K_SCALE and v / V_SCALE."""
    cache8 = torch.empty(cache.shape, dtype=dtype, device=cache.device)
    cache8[:, 0] = (cache[:, 0].float() / K_SCALE).to(dtype)
    cache8[:, 1] = (cache[:, 1].float() / V_SCALE).to(dtype)
    return cache8


def bench_fp8(fi, rows, results: list, *, time_ms: Callable, ws: torch.Tensor, ws_fi: Callable) -> None:
    import attnjit

    for batch, kv_len in rows:
        indptr, indices, last, cache = paged_tables(batch, kv_len, page_size=PS, dtype=DT)
        cache8 = quantized(cache)
        q = torch.randn(batch, H_Q, D, dtype=DT, device="cuda")
        tokens = batch * kv_len
        row = {"op": "decode fp8", "shape": f"{batch}x{kv_len}", "kv_dtype": "e4m3",
               "fp8_bytes": tokens * H_KV * D * 2}
        w16 = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
        w16.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=DT)
        out16 = torch.empty_like(q)
        row["attnjit_bf16_ms"] = time_ms(lambda: w16.run(q, cache, out=out16))
        del cache
        w8 = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
        w8.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=DT, kv_data_type=FP8)
        out8 = torch.empty_like(q)
        row["attnjit_ms"] = time_ms(lambda: w8.run(q, cache8, out=out8, k_scale=K_SCALE, v_scale=V_SCALE))
        row["attnjit_plan"] = w8.last_plan
        row["max_diff_vs_attnjit_bf16"] = (out8.float() - out16.float()).abs().max().item()  # quantization error
        wh = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
        wh.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=torch.float16, kv_data_type=FP8)
        qh = q.half()
        outh = torch.empty_like(qh)
        row["attnjit_fp16q_ms"] = time_ms(lambda: wh.run(qh, cache8, out=outh, k_scale=K_SCALE, v_scale=V_SCALE))
        if fi is not None:
            for tc in (True, False):
                key = f"flashinfer_{'tc' if tc else 'cuda_cores'}"
                try:
                    fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws_fi(), "NHD", use_tensor_cores=tc)
                    fw.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=DT, kv_data_type=FP8)
                    fout = torch.empty_like(q)
                    row[f"{key}_ms"] = time_ms(lambda: fw.run(q, cache8, out=fout, k_scale=K_SCALE, v_scale=V_SCALE))
                    row[f"max_diff_vs_{key}"] = (out8.float() - fout.float()).abs().max().item()
                except Exception as exc:  # noqa: BLE001 (a module that was not prebuilt: say so, go on)
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            times = [row[k] for k in ("flashinfer_tc_ms", "flashinfer_cuda_cores_ms") if k in row]
            if times:
                row["flashinfer_ms"] = min(times)
        for k in ("attnjit_bf16", "attnjit", "flashinfer"):
            if f"{k}_ms" in row:
                row[f"{k}_tokens_per_s"] = tokens / (row[f"{k}_ms"] * 1e-3)
        row["fp8_over_bf16"] = row["attnjit_tokens_per_s"] / row["attnjit_bf16_tokens_per_s"]
        row["attnjit_fp8_tbps"] = row["fp8_bytes"] / (row["attnjit_ms"] * 1e-3) / 1e12
        row["attnjit_fp16q_fp8_tbps"] = row["fp8_bytes"] / (row["attnjit_fp16q_ms"] * 1e-3) / 1e12
        results.append(row)
        del cache8
        torch.cuda.empty_cache()


def bench_fp8_prefill(fi, rows, results: list, *, time_ms: Callable, ws: torch.Tensor, ws_fi: Callable) -> None:
    import attnjit
    from benchmarks import prefill

    for i, row in enumerate(rows):
        q, qo_indptr, cache, tables = prefill._inputs(row, seed=11 + i)
        cache8 = quantized(cache)
        r = {"op": "prefill fp8", "shape": row.shape, "label": row.label, "kv_dtype": "e4m3", "flops": row.flops}
        w16, run16 = prefill._attnjit(ws, row, q, qo_indptr, cache, tables, "auto")
        out16 = torch.empty_like(q)
        r["attnjit_bf16_ms"] = time_ms(lambda: run16(out16))
        r["attnjit_bf16_family"] = w16.last_plan["family"]
        outs = {}
        for name, backend in (("attnjit", "auto"), ("attnjit_fa2", "fa2")):  # the default family, and fa2's
            out8 = outs[name] = torch.empty_like(q)
            w8 = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            w8.plan(qo_indptr, *tables, H_Q, H_KV, row.head_dim, row.page_size, causal=row.causal, q_data_type=DT,
                    kv_data_type=FP8)
            r[f"{name}_ms"] = time_ms(lambda: w8.run(q, cache8, out=out8, k_scale=K_SCALE, v_scale=V_SCALE))
            r[f"{name}_family"] = w8.last_plan["family"]
            r[f"max_diff_{name}_vs_attnjit_bf16"] = (out8.float() - out16.float()).abs().max().item()
        out8 = outs["attnjit"]  # the default family's output, what FlashInfer's is compared with
        if fi is not None:
            # fa2 only: FlashInfer's fa3 module for a bf16 q over an fp8 cache is not in the prebuilt bundle, and it
            # JIT-builds for over 2.5 minutes on the device (measured 2026-12-01), past a benchmark run's budget
            for backend in ("fa2",):
                try:
                    fw = fi.BatchPrefillWithPagedKVCacheWrapper(ws_fi(), "NHD", backend=backend)
                    fw.plan(qo_indptr, *tables, H_Q, H_KV, row.head_dim, row.page_size, causal=row.causal,
                            q_data_type=DT, kv_data_type=FP8)
                    fout = torch.empty_like(q)
                    r[f"flashinfer_{backend}_ms"] = time_ms(lambda: fw.run(q, cache8, out=fout, k_scale=K_SCALE,
                                                                           v_scale=V_SCALE))
                    r[f"max_diff_vs_flashinfer_{backend}"] = (out8.float() - fout.float()).abs().max().item()
                except Exception as exc:  # noqa: BLE001 (a module that was not prebuilt, or no such path: say so)
                    r[f"flashinfer_{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        for k in ("attnjit_bf16", "attnjit", "attnjit_fa2", "flashinfer_fa2"):
            if f"{k}_ms" in r:
                r[f"{k}_tflops"] = row.flops / (r[f"{k}_ms"] * 1e-3) / 1e12
        results.append(r)
        del cache8
        torch.cuda.empty_cache()


def prefill_table(rows) -> str:
    lines = ["| row | shape | attnjit bf16 cache (family) | attnjit e4m3 (family) | e4m3 / bf16 | attnjit e4m3 fa2 | "
             "FI fa2 e4m3 | attnjit / FI |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
    for r in rows:
        a, b, f = r["attnjit_tflops"], r["attnjit_bf16_tflops"], r.get("flashinfer_fa2_tflops")
        lines.append(f"| {r['label']} | {r['shape']} | {b:.0f} ({r['attnjit_bf16_family']}) | {a:.0f} "
                     f"({r['attnjit_family']}) | {a / b:.2f} | {fmt(r.get('attnjit_fa2_tflops'))} | {fmt(f)} | "
                     f"{f'{a / f:.2f}' if f else '-'} |")
    return "\n".join(lines)


def table(rows) -> str:
    lines = ["| shape | attnjit bf16 Mtok/s | attnjit e4m3 Mtok/s | e4m3 / bf16 | e4m3 TB/s | FlashInfer e4m3 Mtok/s "
             "(tc / cuda cores) | attnjit / FlashInfer | e4m3 TB/s, fp16 q |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r.get("flashinfer_tokens_per_s")
        tc = r.get("flashinfer_tc_ms")
        cc = r.get("flashinfer_cuda_cores_ms")
        tokens = r["attnjit_tokens_per_s"] * r["attnjit_ms"] * 1e-3
        paths = " / ".join(f"{tokens / (t * 1e-3) / 1e6:.0f}" if t else "-" for t in (tc, cc))
        fi_s = f"{f / 1e6:.0f} ({paths})" if f else "-"
        ratio = f"{r['attnjit_tokens_per_s'] / f:.2f}" if f else "-"
        lines.append(f"| {r['shape']} | {r['attnjit_bf16_tokens_per_s'] / 1e6:.0f} | "
                     f"{r['attnjit_tokens_per_s'] / 1e6:.0f} | {r['fp8_over_bf16']:.2f} | {r['attnjit_fp8_tbps']:.2f} | "
                     f"{fi_s} | {ratio} | {r['attnjit_fp16q_fp8_tbps']:.2f} |")
    return "\n".join(lines)
