"""Context-parallel decode of one request with 1M tokens of KV across 2 GPUs against one GPU: tokens/s, the speed-up
(target >= 1.8x), and the share of the step spent combining the ranks' states (the collective alone, and collective +
merge), for both combine methods (all_gather + merge_states, all_reduce of the merge).

    python benchmarks/context_parallel.py [--kv-len 1048576] [--world 2] [--combine all_gather,all_reduce] [--json OUT]

NOT RUN YET. Written in a session where no multi-GPU machine was lent (the device tool listed one GPU only); it
needs 2+ GPUs of one host (nvidia-h200-x2) and has never been executed. Its figures below are predictions.

Workload: one request, KV length 1,048,576 (65,536 pages of 16 tokens, shuffled ids), H_q 32, H_kv 8, head_dim 128,
bf16, NHD: 4.29 GB of K and V. One GPU: attnjit's decode over the whole cache. Context parallel: rank r holds the
logical pages p with p % world == r in its own cache (2.15 GB each on 2 GPUs), runs attnjit's decode on them with
return_lse, and the states are combined over NCCL (attnjit.distributed.ContextParallelDecode). Every timed step is
a CUDA-graph replay (the collective captured with the kernels); the eager context-parallel step is reported too.
Timing: CUDA events around ``--reps`` back-to-back replays after warm-up, median of ``--blocks`` blocks, the ranks
started together by a barrier; a rank's figure is its own stream's, the reported one the slowest rank's. tokens/s
= 1000 / step ms (one request, one layer's attention: the attention part of a decode step).

Prediction (H200, 4.8 TB/s peak HBM; attnjit decode near 3.5-4 TB/s on long histories): one GPU ~1.1-1.2 ms; each
of 2 ranks reads half (~0.55-0.6 ms); the all-gather moves 2 x 32 x (128 x 2 + 4) B = 16.6 KB, latency-bound
(~15-25 us over NVLink inside a graph), merge_states ~3 us: ~1.9x, combine share ~3-5 %. all_reduce takes two
collectives (MAX then SUM, 16.5 KB each): ~5-8 % share, slightly slower. Measured: not yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnjit  # noqa: E402
from attnjit.distributed import ContextParallelDecode, launch  # noqa: E402
from attnjit.distributed.combine import METHODS, _all_gather  # noqa: E402
from attnjit.timing import time_ms as _time_ms  # noqa: E402


def time_ms(fn, reps: int, blocks: int) -> float:
    """attnjit.timing.time_ms with the ranks lined up before each block."""
    return _time_ms(fn, reps, blocks, before_block=dist.barrier if dist.is_initialized() else None)


def capture(fn, device):
    """A CUDA graph of fn() (warmed up on a side stream first); returns (graph, fn's output)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def i32(values, device="cpu") -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=device)


def _rank(rank: int, world: int, a: dict, out: str) -> None:
    dev = torch.device("cuda", rank)
    hq, hkv, d, ps, dt = a["num_qo_heads"], a["num_kv_heads"], a["head_dim"], a["page_size"], torch.bfloat16
    pages = -(-a["kv_len"] // ps)
    last = a["kv_len"] - ps * (pages - 1)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    logical = torch.randn(pages, 2, ps, hkv, d, generator=gen, device=dev, dtype=dt)   # every rank: the same data
    q = torch.randn(1, hq, d, generator=gen, device=dev, dtype=dt)
    plan_args = dict(q_data_type=dt)
    res = {"rank": rank}

    if rank == 0:   # one GPU: the whole history, pages in shuffled order
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(1))
        full = torch.empty_like(logical)
        full[perm.to(dev)] = logical
        one = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=True)
        one.plan(i32([0, pages]), i32(perm, dev), i32([last]), hq, hkv, d, ps, **plan_args)
        graph, one_out = capture(lambda: one.run(q, full), dev)
        res["one_gpu_ms"] = time_ms(graph.replay, a["reps"], a["blocks"])
        res["one_gpu_out"] = one_out.float().cpu()
        del full, graph, one
    dist.barrier()

    # this rank's cache: its logical pages r, r + world, ... under shuffled local ids 1.. (0: the scratch page)
    mine = logical[rank::world]
    n_local = mine.shape[0]
    local_perm = torch.randperm(n_local, generator=torch.Generator().manual_seed(2 + rank)) + 1
    local = torch.zeros(n_local + 1, *logical.shape[1:], device=dev, dtype=dt)
    local[local_perm.to(dev)] = mine
    del logical, mine
    # the global table names each page by its id in its owner's cache (every rank builds the same table)
    ids = torch.empty(pages, dtype=torch.int64)
    for r in range(world):
        n_r = len(range(r, pages, world))
        ids[r::world] = torch.randperm(n_r, generator=torch.Generator().manual_seed(2 + r)) + 1
    table = (i32([0, pages]), i32(ids, dev), i32([last]))
    res["methods"] = {}
    for method in a["combine"]:
        kvp_buf, idx_buf, last_buf = i32([0, 0], dev), torch.zeros(pages, dtype=torch.int32, device=dev), i32([0], dev)
        cp = ContextParallelDecode(ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, combine=method,
                                   paged_kv_indptr_buffer=kvp_buf, paged_kv_indices_buffer=idx_buf,
                                   paged_kv_last_page_len_buffer=last_buf)
        cp.plan(*table, hq, hkv, d, ps, **plan_args)
        eager_ms = time_ms(lambda: cp.run(q, local), a["reps"], a["blocks"])
        step, cp_out = capture(lambda: cp.run(q, local), dev)
        m = {"step_ms": time_ms(step.replay, a["reps"], a["blocks"]), "eager_step_ms": eager_ms}
        comb = cp.combiner
        o_loc, lse_loc = comb.local()
        local_graph, _ = capture(lambda: cp._local.run(q, local, o_loc, lse_loc), dev)
        m["local_ms"] = time_ms(local_graph.replay, a["reps"], a["blocks"])
        combine_graph, _ = capture(comb.combine, dev)
        m["combine_ms"] = time_ms(combine_graph.replay, a["reps"], a["blocks"])
        if method == "all_gather":
            coll = lambda: _all_gather(comb._recv, comb._send)  # noqa: E731
        else:
            coll = lambda: (dist.all_reduce(comb._max, op=dist.ReduceOp.MAX),  # noqa: E731
                            dist.all_reduce(comb._sum, op=dist.ReduceOp.SUM))
        coll_graph, _ = capture(coll, dev)
        m["collective_ms"] = time_ms(coll_graph.replay, a["reps"], a["blocks"])
        step.replay()
        torch.cuda.synchronize()
        m["out"] = cp_out.float().cpu()
        res["methods"][method] = m
        del step, local_graph, combine_graph, coll_graph
    every = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        Path(out).write_text(json.dumps(_summary(every, a), indent=1))


def _summary(ranks: list[dict], a: dict) -> dict:
    one_ms = ranks[0]["one_gpu_ms"]
    ref = ranks[0]["one_gpu_out"].double()
    out = {"workload": {k: a[k] for k in ("kv_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")},
           "world": len(ranks), "one_gpu_ms": one_ms, "one_gpu_tokens_per_s": 1000.0 / one_ms, "methods": {}}
    for method in a["combine"]:
        per = [r["methods"][method] for r in ranks]
        m = {k: max(p[k] for p in per) for k in ("step_ms", "eager_step_ms", "local_ms", "combine_ms",
                                                 "collective_ms")}
        m["tokens_per_s"] = 1000.0 / m["step_ms"]
        m["speedup"] = one_ms / m["step_ms"]
        m["collective_share"] = m["collective_ms"] / m["step_ms"]
        m["combine_share"] = m["combine_ms"] / m["step_ms"]
        m["max_abs_diff_vs_one_gpu"] = max((p["out"].double() - ref).abs().max().item() for p in per)
        out["methods"][method] = m
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-len", type=int, default=1 << 20)
    ap.add_argument("--num-qo-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--combine", default=",".join(METHODS), help="comma-separated: " + ", ".join(METHODS))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--target", type=float, default=1.8, help="exit 1 when the best speed-up is below this")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    methods = [m for m in args.combine.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        ap.error(f"--combine takes {', '.join(METHODS)}; got {args.combine!r}")
    if torch.cuda.device_count() < args.world:
        print(f"context_parallel.py: needs {args.world} GPUs of one host, this one has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    a = vars(args) | {"combine": methods}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        launch(_rank, args.world, a, str(path), backend="nccl")
        result = json.loads(path.read_text())
    w = result["workload"]
    print(f"decode of 1 request, KV {w['kv_len']:,} tokens, H_q {w['num_qo_heads']} H_kv {w['num_kv_heads']} "
          f"D {w['head_dim']} bf16: one GPU {result['one_gpu_ms']:.3f} ms ({result['one_gpu_tokens_per_s']:.0f} tok/s)")
    print(f"{'combine':>11} {'ranks':>5} {'step ms':>8} {'tok/s':>7} {'speedup':>7} {'local ms':>8} {'coll ms':>8} "
          f"{'coll %':>6} {'comb %':>6} {'eager ms':>8} {'max|diff|':>9}")
    for method, m in result["methods"].items():
        print(f"{method:>11} {result['world']:>5} {m['step_ms']:8.3f} {m['tokens_per_s']:7.0f} {m['speedup']:7.2f} "
              f"{m['local_ms']:8.3f} {m['collective_ms']:8.4f} {100 * m['collective_share']:6.1f} "
              f"{100 * m['combine_share']:6.1f} {m['eager_step_ms']:8.3f} {m['max_abs_diff_vs_one_gpu']:9.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    best = max(m["speedup"] for m in result["methods"].values())
    if best < args.target:
        print(f"context_parallel.py: best speed-up {best:.2f}x is below the target {args.target}x", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
