"""JIT-engine figures (benchmarks/RESULTS.md, "engine"): no kernel timing here, only the machinery.

    python benchmarks/engine.py compile   # CPU machine: cold compile of one spec per op (-j 1), and
                                          # `attnjit warm specs/ci.toml` when everything is cached
    python benchmarks/engine.py runtime   # GPU machine: fresh process -> first loaded kernel on a disk hit, and
                                          # host time of one run() on a memory hit
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECS = {
    "prefill": "op=prefill,mask=causal,head_dim=128,page_size=16,dtype=bf16,group_size=4",
    "decode": "op=decode,head_dim=128,page_size=16,dtype=bf16,group_size=4",
    "append_kv": "op=append_kv,head_dim=128,page_size=16,dtype=bf16",
    "merge_state": "op=merge_state,head_dim=128,dtype=bf16",
}


def cli(*args: str, env=None) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "attnjit.cli", *args], capture_output=True, text=True,
                          env=env or os.environ, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(proc.stderr)
    return time.perf_counter() - t0, proc.stdout.strip()


def compile_figures() -> dict:
    out: dict = {"cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for op, spec in SPECS.items():
            root = Path(tmp) / op
            cli("warm", "--spec", spec, "--cache-dir", str(root), "--jobs", "1")
            manifest = json.loads(next(root.glob("??/*/manifest.json")).read_text())
            out[f"cold_compile_s_{op}"] = manifest["compile_seconds"]
        root = Path(tmp) / "ci"
        wall, line = cli("warm", str(ROOT / "specs/ci.toml"), "--cache-dir", str(root))
        out["warm_ci_cold_wall_s"] = round(wall, 2)
        out["warm_ci_cold_line"] = line
        walls = [cli("warm", str(ROOT / "specs/ci.toml"), "--cache-dir", str(root))[0] for _ in range(5)]
        out["warm_ci_cached_wall_s"] = round(statistics.median(walls), 3)
    return out


FIRST_CALL = r"""
import time
t0 = time.perf_counter()
import torch, attnjit
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
i = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")
w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
with attnjit.recording() as rec:
    t2 = time.perf_counter()
    w.plan(i([0, 4]), i([0, 1, 2, 3]), i([16]), 32, 8, 128, 16, q_data_type=torch.bfloat16)
    t3 = time.perf_counter()
    w.run(torch.randn(1, 32, 128, dtype=torch.bfloat16, device="cuda"),
          torch.randn(4, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
print({"import_and_cuda_init_s": t1 - t0, "first_plan_ms": (t3 - t2) * 1e3, "binary": rec[0].binary,
       "load_ms": rec[0].load_ms})
"""


def runtime_figures() -> dict:
    import torch

    import attnjit

    out: dict = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cli("warm", "--spec", SPECS["decode"], env=env)  # make sure it is on disk
    runs = []
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(proc.stderr)
        runs.append(eval(proc.stdout.strip().splitlines()[-1]))  # noqa: S307 (our own dict literal)
    out["fresh_process_first_plan_ms_disk_hit"] = round(statistics.median(r["first_plan_ms"] for r in runs), 2)
    out["fresh_process_load_ms"] = round(statistics.median(r["load_ms"] for r in runs), 2)
    out["fresh_process_binary"] = runs[0]["binary"]
    # host overhead of one run() on a memory hit: a small decode, many calls, host clock only
    ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    i = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(i([0, 4]), i([0, 1, 2, 3]), i([16]), 32, 8, 128, 16, q_data_type=torch.bfloat16)
    q = torch.randn(1, 32, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.randn(4, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    o = torch.empty_like(q)
    for _ in range(200):
        w.run(q, cache, out=o)
    torch.cuda.synchronize()
    per = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(500):
            w.run(q, cache, out=o)
        per.append((time.perf_counter() - t0) / 500 * 1e6)
        torch.cuda.synchronize()
    out["host_us_per_run_memory_hit"] = round(statistics.median(per), 2)
    # host time of one decode plan() (what a serving step pays before its graph replay), attnjit and FlashInfer
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    for batch in (1, 64):
        indptr = torch.arange(0, (batch + 1) * 72, 72, dtype=torch.int32, device="cuda")
        indices = torch.arange(batch * 72, dtype=torch.int32, device="cuda")
        last = torch.full((batch,), 5, dtype=torch.int32, device="cuda")
        wrappers = {"attnjit": attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)}
        if flashinfer is not None:
            wrappers["flashinfer"] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=True)
        for name, w in wrappers.items():
            def plan():
                w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16,
                       kv_data_type=torch.bfloat16)
            for _ in range(10):
                plan()
            per = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    plan()
                torch.cuda.synchronize()
                per.append((time.perf_counter() - t0) / 50 * 1e6)
            out[f"host_us_per_decode_plan_b{batch}_{name}"] = round(statistics.median(per), 1)
    return out


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "compile"
    print(json.dumps(compile_figures() if what == "compile" else runtime_figures()))
