"""Why bench.py's paged causal 8x2048 figure sits below sm90_timeline.py's for the same kernel and plan (runs
129-133: 482-512 against 547-569 TFLOP/s on an H100): each harness's inputs timed with each harness's timer, cold
and after a soak of back-to-back matmuls (bench.py times a row after seconds of other libraries' kernels).

    python3 benchmarks/harness_ab.py [--rows 8x2048 1x8192] [--json OUT.json]     # GPU

Inputs: "timeline" (benchmarks/tables.paged_tables, seed 1; q from torch.randn; a zeroed workspace) or "bench"
(benchmarks/prefill._inputs, the row's seed; a torch.empty workspace, as bench.py). Timers: "best" (the timeline's:
the best of 5 rounds of 40 calls) or "median" (attnjit.timing.time_ms: the median of 7 blocks of 30). Each case
plans its own wrapper (backend auto, split-KV allowed, as bench.py) and runs with a preallocated output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import attnjit  # noqa: E402
from attnjit.timing import time_ms  # noqa: E402
from benchmarks import prefill  # noqa: E402
from benchmarks.sm90_timeline import best_ms  # noqa: E402
from benchmarks.tables import paged_tables  # noqa: E402


def _flops(b: int, L: int) -> float:
    return 4 * b * 32 * 128 * L * L / 2


def inputs(kind: str, b: int, L: int, seed: int):
    if kind == "timeline":
        indptr, indices, last, cache = paged_tables(b, L, seed=1)
        qo = torch.arange(0, b * L + 1, L, dtype=torch.int32, device="cuda")
        q = torch.randn(b * L, 32, 128, dtype=torch.bfloat16, device="cuda")
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        return q, qo, cache, (indptr, indices, last), ws
    q, qo, cache, tables = prefill._inputs(prefill.Row(b, L), seed=seed)
    return q, qo, cache, tables, torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def soak(seconds: float = 2.0) -> None:
    """Back-to-back bf16 matmuls for ``seconds``: the load bench.py puts on the GPU before a row."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["8x2048", "1x8192"])
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for i, shape in enumerate(args.rows):
        b, L = (int(x) for x in shape.split("x"))
        cases = [("timeline", "best", False), ("timeline", "median", False), ("bench", "best", False),
                 ("bench", "median", False), ("bench", "median", True), ("timeline", "median", True),
                 ("timeline", "best", False)]
        for kind, timer, soaked in cases:
            q, qo, cache, tables, ws = inputs(kind, b, L, seed=2 + i)
            w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            w.plan(qo, *tables, 32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16)
            out = torch.empty_like(q)
            run = lambda: w.run(q, cache, out=out)  # noqa: E731
            run()
            torch.cuda.synchronize()
            if soaked:
                soak()
            ms = best_ms(run) if timer == "best" else time_ms(run)
            row = {"shape": shape, "inputs": kind, "timer": timer, "soaked": soaked, "ms": round(ms, 4),
                   "tflops": round(_flops(b, L) / (ms * 1e-3) / 1e12, 1), "tile": w.last_plan["tile"]}
            results.append(row)
            print(json.dumps(row), flush=True)
            del q, cache, ws, out, w
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
