"""Shared-prefix (cascade) decode: issue 14's row. ``python benchmarks/bench.py --only cascade`` runs it.

Workload: 16 requests share an 8192-token prefix and each has its own 256-token suffix (one query token each);
H_q 32, H_kv 8, head_dim 128, bf16, page_size 16, NHD, pages shuffled. Timed four ways in one process:
  * attnjit flat: BatchDecodeWithPagedKVCacheWrapper over each request's whole page table (the prefix pages appear
    in all 16 tables: what an engine does without cascade);
  * attnjit cascade: MultiLevelCascadeAttentionWrapper, 2 levels (the prefix once for the group as a deferred-merge
    plan on half the GPU, the suffixes beside it on a side stream, then merge_partials folds the prefix's KV chunks
    into the suffixes' state), and the same plans on one stream;
  * FlashInfer's MultiLevelCascadeAttentionWrapper and its flat decode wrapper on the same cache and tables.
Figures: ms per call (every launch of a call), the speed-up of cascade over flat, and the bytes a call must read
at least (prefix once + suffixes: the floor for cascade) against the flat bytes (every request's whole history).
Each is timed twice: eagerly, back to back (a cascade call is three short launches, so its host time can exceed its
GPU time and set the figure), and as CUDA-graph replays (the GPU's time, as a graph-mode decode step runs it); the
graph rows also time attnjit's cascade by part (level 1; level 0 with its merge_partials; merge_state_in_place, what
a non-deferred level 0 would add) and level 0 alone by family, split size and deferred or in-kernel merge.
Targets (issue 14): attnjit cascade >= 3x attnjit flat, and faster than FlashInfer's cascade.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

BATCH, PREFIX, SUFFIX = 16, 8192, 256
H_Q, H_KV, D, PS, DT = 32, 8, 128, 16, torch.bfloat16


def _tables(seed: int = 0):
    """(cache, prefix page ids, suffix page ids per request): every page full (8192 and 256 are multiples of 16)."""
    n_prefix, n_suffix = PREFIX // PS, SUFFIX // PS
    total = n_prefix + BATCH * n_suffix
    ids = list(range(total))
    random.Random(seed).shuffle(ids)
    prefix = ids[:n_prefix]
    suffixes = [ids[n_prefix + i * n_suffix:n_prefix + (i + 1) * n_suffix] for i in range(BATCH)]
    cache = torch.randn(total, 2, PS, H_KV, D, dtype=DT, device="cuda")
    return cache, prefix, suffixes


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def cascade_arrays(prefix: list[int], suffixes: list[list[int]]):
    """FlashInfer's 2-level cascade layout: level 0 one group (all requests) over the prefix, level 1 the suffixes."""
    qo = [_i32([0, BATCH]), _i32(list(range(BATCH + 1)))]
    kv_indptr = [_i32([0, len(prefix)]), _i32([i * len(suffixes[0]) for i in range(BATCH + 1)])]
    kv_indices = [_i32(prefix), _i32([p for s in suffixes for p in s])]
    last = [_i32([PS]), _i32([PS] * BATCH)]
    return qo, kv_indptr, kv_indices, last


def flat_tables(prefix: list[int], suffixes: list[list[int]]):
    pages = [prefix + s for s in suffixes]
    indptr = _i32([0] + [sum(len(p) for p in pages[:i + 1]) for i in range(BATCH)])
    return indptr, _i32([x for p in pages for x in p]), _i32([PS] * BATCH)


def bench_cascade(fi, results: list[dict], *, time_ms: Callable, ws: torch.Tensor, ws_fi: Callable) -> None:
    import attnjit

    cache, prefix, suffixes = _tables()
    q = torch.randn(BATCH, H_Q, D, dtype=DT, device="cuda")
    kv_bytes_flat = BATCH * (PREFIX + SUFFIX) * H_KV * D * 2 * 2
    kv_bytes_cascade = (PREFIX + BATCH * SUFFIX) * H_KV * D * 2 * 2
    row = {"op": "cascade decode", "shape": f"{BATCH}x({PREFIX} shared + {SUFFIX})", "kv_bytes_flat": kv_bytes_flat,
           "kv_bytes_cascade": kv_bytes_cascade}
    arrays = cascade_arrays(prefix, suffixes)
    indptr, indices, last = flat_tables(prefix, suffixes)

    def both(key: str, fn, eager: bool = True) -> None:
        """``key``_ms (eager, unless ``eager`` is False) and ``key``_graph_ms, or ``key``_graph_error where the
        call cannot be captured (the eager figure stays)."""
        if eager:
            row[key + "_ms"] = time_ms(fn)
        try:
            row[key + "_graph_ms"] = time_ms(fn, graph=True)
        except Exception as exc:  # noqa: BLE001
            row[key + "_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()

    flat = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    flat.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=DT)
    out_flat = torch.empty_like(q)
    both("attnjit_flat", lambda: flat.run(q, cache, out=out_flat))
    row["attnjit_flat_plan"] = flat.last_plan

    casc = attnjit.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    casc.plan(*arrays, H_Q, H_KV, D, PS, q_data_type=DT)
    out_casc = torch.empty_like(q)
    both("attnjit_cascade", lambda: casc.run(q, cache, out=out_casc))
    row["attnjit_cascade_plan"] = casc.last_plan
    row["attnjit_cascade_overlapped"] = casc._overlapped   # level 0 beside the last level (a side stream)
    seq = attnjit.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")   # A/B: the same plans, one stream
    seq.plan(*arrays, H_Q, H_KV, D, PS, q_data_type=DT)
    seq._can_overlap = lambda q: False
    out_seq = torch.empty_like(q)
    both("attnjit_cascade_one_stream", lambda: seq.run(q, cache, out=out_seq))
    old = attnjit.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")   # A/B: level 0 merged in its kernel (its split
    old._batch_prefill_wrappers[0]._defer_merge = False           # groups' last CTAs), then merge_state_in_place
    old.plan(*arrays, H_Q, H_KV, D, PS, q_data_type=DT)
    out_old = torch.empty_like(q)
    both("attnjit_cascade_in_kernel_merge", lambda: old.run(q, cache, out=out_old))
    row["attnjit_cascade_in_kernel_merge_plan"] = old.last_plan
    row["attnjit_cascade_in_kernel_merge_host_us"] = _host_us(lambda: old.run(q, cache, out=out_old))
    # by part, in graphs: level 1 (the suffixes), level 0 (the prefix, one group: a deferred plan, so its run()
    # includes merge_partials into level 1's state), and merge_state_in_place (what a non-deferred level 0 adds)
    (w0, w1), (o0, l0) = casc._batch_prefill_wrappers, casc._scratch[0]
    o1, l1 = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    w1.run(q, cache, out=o1, lse=l1)
    parts = {"level1": lambda: w1.run(q, cache, out=o0, lse=l0), "level0": lambda: w0.run(q, cache, out=o1, lse=l1),
             "merge": lambda: attnjit.merge_state_in_place(o1, l1, o0, l0)}
    for name, fn in parts.items():
        both(f"attnjit_{name}", fn)
    row["attnjit_cascade_host_us"] = _host_us(lambda: casc.run(q, cache, out=out_casc))
    level0_sweep(row, arrays, q, cache, ws, time_ms)
    row["max_diff_cascade_vs_flat"] = (out_casc.float() - out_flat.float()).abs().max().item()
    row["attnjit_speedup"] = row["attnjit_flat_ms"] / row["attnjit_cascade_ms"]
    if "attnjit_cascade_graph_ms" in row and "attnjit_flat_graph_ms" in row:
        row["attnjit_graph_speedup"] = row["attnjit_flat_graph_ms"] / row["attnjit_cascade_graph_ms"]

    if fi is not None:
        fcasc = fi.MultiLevelCascadeAttentionWrapper(2, ws_fi(), "NHD")
        fcasc.plan(*arrays, H_Q, H_KV, D, PS, q_data_type=DT, kv_data_type=DT)
        both("flashinfer_cascade", lambda: fcasc.run(q, cache))
        row["max_diff_vs_flashinfer_cascade"] = (out_casc.float() - fcasc.run(q, cache).float()).abs().max().item()
        fflat = fi.BatchDecodeWithPagedKVCacheWrapper(ws_fi(), "NHD", use_tensor_cores=True)
        fflat.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=DT, kv_data_type=DT)
        fout = torch.empty_like(q)
        both("flashinfer_flat", lambda: fflat.run(q, cache, out=fout))
        row["attnjit_cascade_vs_flashinfer_cascade"] = row["flashinfer_cascade_ms"] / row["attnjit_cascade_ms"]
        if "flashinfer_cascade_graph_ms" in row and "attnjit_cascade_graph_ms" in row:
            row["attnjit_cascade_vs_flashinfer_cascade_graph"] = (row["flashinfer_cascade_graph_ms"] /
                                                                  row["attnjit_cascade_graph_ms"])
    results.append(row)


def _host_us(fn: Callable, calls: int = 200) -> float:
    """Host microseconds per call, back to back with no synchronization (the GPU may lag behind; what is timed is
    the Python and the launches): tells an eager figure that the host sets from one the GPU sets."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def level0_sweep(row: dict, arrays, q, cache, ws, time_ms: Callable) -> None:
    """Level 0 alone (the 16 query rows of the group over the 8192-token prefix), graph replays, under each kernel
    family and split size: ``row["level0_sweep"]`` = [{backend, fixed_split_size, plan, graph_ms}]."""
    import attnjit

    qo, kvp, idx, last = (a[0] for a in arrays)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    out = []
    o.zero_(), lse.fill_(float("-inf"))   # a state the deferred plans merge into
    for backend, deferred in (("auto", True), ("auto", False), ("fa2", True), ("fa2", False)):
        for split in (None, 256, 512, 1024, 2048):
            w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            w._defer_merge = deferred   # the cascade's prefix levels (scheduler.defer_merges): + merge_partials
            w.plan(qo, kvp, idx, last, H_Q, H_KV, D, PS, q_data_type=DT, fixed_split_size=split)
            ms = time_ms(lambda: w.run(q, cache, out=o, lse=lse), graph=True)
            out.append({"backend": backend, "deferred": deferred, "fixed_split_size": split, "plan": w.last_plan,
                        "graph_ms": ms})
    row["level0_sweep"] = out


def table(rows: list[dict]) -> str:
    lines = ["| workload | timing | attnjit flat | attnjit cascade | speed-up (>= 3x) | FlashInfer cascade | "
             "FlashInfer flat | attnjit cascade vs FlashInfer cascade |", "|---|---|---|---|---|---|---|---|"]
    ms = lambda r, k: f"{r[k]:.3f} ms" if k in r else "-"  # noqa: E731
    x = lambda r, k: f"{r[k]:.2f}x" if k in r else "-"  # noqa: E731
    for r in rows:
        for how, g in (("eager", ""), ("graph", "_graph")):
            lines.append(f"| {r['shape']} | {how} | {ms(r, 'attnjit_flat' + g + '_ms')} | "
                         f"{ms(r, 'attnjit_cascade' + g + '_ms')} | {x(r, 'attnjit' + g + '_speedup')} | "
                         f"{ms(r, 'flashinfer_cascade' + g + '_ms')} | {ms(r, 'flashinfer_flat' + g + '_ms')} | "
                         f"{x(r, 'attnjit_cascade_vs_flashinfer_cascade' + g)} |")
        for how, g in (("eager", ""), ("graph", "_graph")):
            if f"attnjit_level0{g}_ms" in r:
                lines.append(f"attnjit cascade by part ({how}): level 0 {ms(r, f'attnjit_level0{g}_ms')}, level 1 "
                             f"{ms(r, f'attnjit_level1{g}_ms')}, merge {ms(r, f'attnjit_merge{g}_ms')}")
        if "attnjit_cascade_one_stream_graph_ms" in r:
            lines.append(f"attnjit cascade level 0 beside the last level: {r.get('attnjit_cascade_overlapped')}; "
                         f"the same plans on one stream: {ms(r, 'attnjit_cascade_one_stream_ms')} eager, "
                         f"{ms(r, 'attnjit_cascade_one_stream_graph_ms')} graph")
        if "attnjit_cascade_in_kernel_merge_graph_ms" in r:
            lines.append(f"attnjit cascade with level 0 merged in its kernel, then merge_state_in_place (before "
                         f"deferred merges): {ms(r, 'attnjit_cascade_in_kernel_merge_ms')} eager, "
                         f"{ms(r, 'attnjit_cascade_in_kernel_merge_graph_ms')} graph")
        if "attnjit_cascade_host_us" in r:
            lines.append(f"attnjit cascade host time per call: {r['attnjit_cascade_host_us']:.1f} us (level 0 merged "
                         f"in its kernel: {r.get('attnjit_cascade_in_kernel_merge_host_us', float('nan')):.1f} us)")
        for v in r.get("level0_sweep", []):
            p = v["plan"]
            lines.append(f"level 0 alone, backend {v['backend']}{', deferred merge' if v.get('deferred') else ''}, "
                         f"fixed_split_size {v['fixed_split_size']}: "
                         f"{v['graph_ms']:.4f} ms ({p['family']} {p['tile']}, {p['ctas']} CTAs, chunk {p['chunk_kv']})")
    return "\n".join(lines)
